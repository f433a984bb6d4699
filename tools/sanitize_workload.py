"""A short GPU workload for compute-sanitizer: every kernel of both problems, at
small shapes (both GEMM paths: the Hopper kernel and, with
FUSED_GEMM_BN_PORTABLE=1, the portable one; tile tails; split tiles) and, with
--full, one training forward at the KernelBench shape.  --dtype float16 or
bfloat16 runs the 16-bit kernels of kernels/lowp/ instead (the same shapes: K % 8
== 0 takes their 16-byte loads, K % 8 != 0 the element-wise path).

    compute-sanitizer --tool memcheck  --error-exitcode 1 python tools/sanitize_workload.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python tools/sanitize_workload.py
    compute-sanitizer --tool initcheck --error-exitcode 1 python tools/sanitize_workload.py
    compute-sanitizer --tool synccheck --error-exitcode 1 python tools/sanitize_workload.py

Each call's output is checked for finiteness, so a run that completes under the
sanitizer also computed something.  Exit code 0 when every call ran.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model_new  # noqa: E402
from level2_84_gemm_batchnorm_scaling_softmax import model_new as model_new_84  # noqa: E402

# (M, K, N): tile tails in every dimension, a shape with split tiles, a tiny one.
SMALL_SHAPES = [(200, 264, 136), (130, 1028, 260), (33, 36, 20)]


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def models(k, n, dtype):
    torch.manual_seed(0)
    return {"33": model_new.ModelNew(k, n, (n,)).to("cuda", dtype),
            "84": model_new_84.ModelNew(k, n).to("cuda", dtype)}


def run_shape(m, k, n, backward, dtype=torch.float32):
    for name, model in models(k, n, dtype).items():
        x = torch.rand(m, k, device="cuda").to(dtype)
        for training in (True, False):
            model.train(training)
            with torch.no_grad():
                out = model(x)
            assert torch.isfinite(out).all(), f"problem {name} {m}x{k}x{n} training={training}: non-finite output"
            if backward:
                xg = x.clone().requires_grad_(True)
                (model(xg) * torch.randn(m, n, device="cuda").to(dtype)).sum().backward()
                assert torch.isfinite(xg.grad).all(), f"problem {name}: non-finite grad"
        torch.cuda.synchronize()
        print(f"problem {name} {m}x{k}x{n}: ok", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="also one training forward at (1024, 8192, 8192)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                   help="dtype of the models and inputs (default float32; 16-bit: the kernels/lowp/ kernels)")
    args = p.parse_args()
    dtype = DTYPES[args.dtype]
    for shape in SMALL_SHAPES:
        run_shape(*shape, backward=True, dtype=dtype)
    if args.full:
        model = model_new.ModelNew(8192, 8192, (8192,)).to("cuda", dtype)
        with torch.no_grad():
            out = model(torch.rand(1024, 8192, device="cuda").to(dtype))
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        print("KernelBench shape, training forward: ok", flush=True)


if __name__ == "__main__":
    main()
