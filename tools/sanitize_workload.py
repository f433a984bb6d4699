"""A short GPU workload for compute-sanitizer: every kernel of both problems, at
small shapes (both GEMM paths: the Hopper kernel and, with
FUSED_GEMM_BN_PORTABLE=1, the portable one; tile tails; split tiles; K not a
multiple of 8, padded) and, with
--full, one training forward at the KernelBench shape.  --dtype float16 or
bfloat16 runs the 16-bit kernels of kernels/lowp/ instead (the same shapes: K % 8
== 0 takes their 16-byte loads, K % 8 != 0 the element-wise path).  --autocast
float16 or bfloat16 runs float32 models inside torch.autocast: the same kernels
in their float32-storage (autocast) form, and with gradients the fused 16-bit
step (the 16-bit extension's forward_grad: training forward_train_saved on lowp_sm90,
eval forward_eval_saved on lowp_cublas; then bn16_backward_kernel and two cuBLAS
16-bit products).  16-bit calls with
gradients in eval run forward_grad too (forward_eval_saved: at 2048 x 200 x 2176
lowp_sm90's kEvalSaved epilogue storing z and coeff, at the others lowp_cublas
with bn16_chain_eval writing coeff; bn16_backward_kernel's eval form).

    compute-sanitizer --tool memcheck  --error-exitcode 1 python tools/sanitize_workload.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python tools/sanitize_workload.py
    compute-sanitizer --tool initcheck --error-exitcode 1 python tools/sanitize_workload.py
    compute-sanitizer --tool synccheck --error-exitcode 1 python tools/sanitize_workload.py

The synchronized-BatchNorm kernels (float32) run through the extension's
entry points directly, with a "gathered" of one process (one process has no
process group to merge over): sync_forward_local, sync_bn_apply,
bn_backward_sums, bn_backward_grad.

Each call's output is checked for finiteness, so a run that completes under the
sanitizer also computed something.  Exit code 0 when every call ran.

initcheck and 16-bit dtypes: lowp_sm90 writes a 16-bit out of its 256-row tiles
with TMA stores (store_tile_tma), which initcheck does not see either: the
kernels that read out afterwards (bn16_apply, the row softmax) are then reported
as reading uninitialized memory at the shapes with 256-row tiles (2048 x 200 x
2176 here); the poisoned-output tests (tests/test_lowp.py) show every element
written.  Run it with --no-backward.  The 16-bit backward
runs cuBLAS products (the two products of each step with gradients, and in
eval the recompute's or the forward's), and initcheck does not see the stores of
cuBLAS's 16-bit Hopper GEMM kernels (nvjet_sm90_*): a later read of such a
product in never-written memory is reported as uninitialized, with no project
code involved (tools/initcheck_cublas_16bit.py reproduces it with one torch
product).  The 16-bit kernels of kernels/lowp/ all run in the forward calls
except bn16_backward_kernel (the backward's), which memcheck, racecheck and
synccheck cover with backward calls.

racecheck and 16-bit dtypes with gradients: racecheck reports hazards inside cuBLAS's 16-bit
Hopper products of the backward at a few rows (nvjet_sm90_hsh_64x8_64x16 / _tst_; 8 reports
in docs/perf.md v98's run), with no project code involved; judge a run by the kernels its
reports name.

initcheck and float32: problem 84's backward at the 2305-row shape reports
4440 uninitialized reads per backward call inside torch's own column-sum
reduction (at::native::reduce_kernel), with no project code involved
(tools/initcheck_torch_column_sum.py gives the same 4440 with torch alone);
every other kernel of the workload is clean under initcheck.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model_new  # noqa: E402
from level2_84_gemm_batchnorm_scaling_softmax import model_new as model_new_84  # noqa: E402

# (M, K, N): tile tails in every dimension, a shape with split tiles, a tiny one, and a batch
# tile one row deep (2305 = 9 * 256 + 1).
# (2048, 200, 2176): 136 tiles of 256 rows, so lowp_sm90 takes its 256-row tiles (the
# float32-weight form's 3-stage ring included) with a partial last k-block.
# (7, 4095, 513): a few rows, K odd: sm80_3xtf32's 16-row tile, split K, 4-byte w loads.
# (4353, 72, 1100): 18 batch tiles of 256 rows, so lowp_sm90 (and sm90_fp16x3) take the grouped
# tile order (docs/perf.md v62); N % 8 != 0, so lowp's 16-bit out has no tensor map.
# (7, 4096, 512), (5, 520, 1000): 16-bit batches of at most 8 rows take lowp_small_m on Hopper (its
# product with K split into pieces and the finish kernel; one piece, a partial last stage).
# (6, 264, 8192): one K piece a CTA (256 feature blocks), so the 16-bit BatchNorm runs in the product's
# epilogue (lowp_small_m_linear_bn; problem 84's eval keeps its row softmax); float32: small_m_fp64.
# (12, 300, 1000), (40, 264, 1032): 16-bit training on lowp_cublas (K % 8 != 0; more rows than
# lowp_small_m takes) runs bn_16bit_strip.cu's mid form, a row a slice and 3 rows a slice, the last
# CTA's feature groups partly outside N at 1032.
# (40, 2048, 1096): float32 grad W on sm90_fp16x3 in 144 tiles of one k-block, so CTAs of the persistent
# grid walk two tiles (the staged stores' buffers reused across tiles).
# (800, 64, 2200), (300, 72, 130): the float32 training backward's resident strip kernel
# (bn_backward.cu; no other shape here takes it), its last strip partly outside N, rows past M
# masked, its vectors' cp.async copies zero-filled past N.
SMALL_SHAPES = [(200, 264, 136), (130, 1028, 260), (33, 36, 20), (2305, 64, 136), (2048, 200, 2176),
                (7, 4095, 513), (4353, 72, 1100), (7, 4096, 512), (5, 520, 1000), (6, 264, 8192),
                (12, 300, 1000), (40, 264, 1032), (40, 2048, 1096), (800, 64, 2200), (300, 72, 130)]


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def models(k, n, dtype):
    torch.manual_seed(0)
    return {"33": model_new.ModelNew(k, n, (n,)).to("cuda", dtype),
            "84": model_new_84.ModelNew(k, n).to("cuda", dtype)}


def run_shape(m, k, n, backward, dtype=torch.float32, autocast=None):
    for name, model in models(k, n, dtype).items():
        x = torch.rand(m, k, device="cuda").to(dtype)
        for training in (True, False):
            model.train(training)
            with torch.no_grad(), torch.autocast("cuda", dtype=autocast or torch.float16, enabled=autocast is not None):
                path = model.kernel_path(x)
                out = model(x)
            assert torch.isfinite(out).all(), f"problem {name} {m}x{k}x{n} {path}: non-finite output"
            if backward:
                xg = x.clone().requires_grad_(True)
                with torch.autocast("cuda", dtype=autocast or torch.float16, enabled=autocast is not None):
                    out = model(xg)
                (out * torch.randn(m, n, device="cuda").to(out.dtype)).sum().backward()
                assert torch.isfinite(xg.grad).all(), f"problem {name}: non-finite grad"
        torch.cuda.synchronize()
        print(f"problem {name} {m}x{k}x{n}: ok (last path {path})", flush=True)


def run_sync_kernels(m, k, n):
    """The synchronized BatchNorm kernels of _SyncFusedTrainFn, both problems,
    on this process's statistics alone (world = 1)."""
    ext = model_new._ext
    for name, model in models(k, n, torch.float32).items():
        scale_after_bn = name == "84"
        x = torch.rand(m, k, device="cuda")
        gemm = model_new.dispatch(x, model.gemm.weight, True, True, scale_after_bn).gemm
        bn, lin = model.bn, model.gemm
        scale = model_new.per_feature_scale(model.scale, n).contiguous()
        with torch.no_grad():
            z, local = ext.sync_forward_local(gemm, x, lin.weight, lin.bias, bn.num_batches_tracked, None)
            out, stats, count = ext.sync_bn_apply(z, local[None].contiguous(), lin.bias, scale, bn.weight, bn.bias,
                                                  bn.running_mean, bn.running_var, bn.num_batches_tracked, 0.1,
                                                  bn.eps, scale_after_bn)
            g = torch.randn(m, n, device="cuda")
            sums = ext.bn_backward_sums(g, z, stats)
            grads = ext.bn_backward_grad(g, z, stats, lin.bias, scale, bn.weight, bn.eps, scale_after_bn, count,
                                         sums, sums.clone(), bn.bias)
        torch.cuda.synchronize()
        assert all(torch.isfinite(t).all() for t in (out, stats, count, sums, *grads)), f"problem {name}: non-finite"
        print(f"problem {name} {m}x{k}x{n}: synchronized-BatchNorm kernels ok ({gemm})", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="also one training forward at (1024, 8192, 8192)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                   help="dtype of the models and inputs (default float32; 16-bit: the kernels/lowp/ kernels)")
    p.add_argument("--autocast", choices=("float16", "bfloat16"), default=None,
                   help="float32 models inside torch.autocast in this dtype")
    p.add_argument("--no-backward", action="store_true",
                   help="forward calls only (for initcheck with a 16-bit --dtype: see the module docstring)")
    args = p.parse_args()
    dtype = DTYPES[args.dtype]
    autocast = DTYPES[args.autocast] if args.autocast else None
    for shape in SMALL_SHAPES:
        run_shape(*shape, backward=not args.no_backward, dtype=dtype, autocast=autocast)
        if dtype == torch.float32 and autocast is None:
            run_sync_kernels(*shape)
    if args.full:
        model = model_new.ModelNew(8192, 8192, (8192,)).to("cuda", dtype)
        with torch.no_grad():
            out = model(torch.rand(1024, 8192, device="cuda").to(dtype))
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        print("KernelBench shape, training forward: ok", flush=True)


if __name__ == "__main__":
    main()
