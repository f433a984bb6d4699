"""Float32 eval with gradients (`model.bn.eval()` while fine-tuning), side by side in one
run (docs/perf.md v57): eager Model; ModelNew as dispatched ("auto": z by small_m_fp64's
gemm_nt up to its rows, then _EvalFn's fused fold and backward); ModelNew with
FUSED_GEMM_BN_SMALL_M=0's switches (z by sm90_fp16x3's gemm_nt, _EvalFn); and the path
before v57 (z by gemm_nt, the fold in torch ops: _eval_with_grad, which compiled graphs
still run).  Each side takes forward with gradients (model(x)) and forward + backward
(model(x).backward(g)), the gradients cleared before each call, timed by bench.time_fn
(interleaved, L2 flushed by reading, medians of CUDA events) in both protocols: back to
back and synchronized per call.  Printed: each side's median us and eager's time over it.

    python tools/eval_grad_ab.py [M,M,...] [K,N]     (default: 1,2,4,8,16,1024 and 8192,8192; a GPU)

The switches and the previous path are set per call on the engine module each problem
runs (model_new for 33; problem 84's _ENGINE_MODULE), and restored after it.
"""
import functools
import importlib
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402

ITERS, WARMUP = 30, 5


def previous_apply(engine):
    """_EvalFn.apply's stand-in running the path before v57: gemm_nt, then the fold in torch ops."""
    def apply(kernels, gemm, scale_after_bn, eps, x, weight, bias, scale, bn_weight, bn_bias, mean, var):
        return engine._eval_with_grad(functools.partial(engine._GemmNT.apply, kernels, gemm),
                                      engine._SoftmaxRows.apply if scale_after_bn else None,
                                      x, weight, bias, scale, bn_weight, bn_bias, mean, var, eps)
    return apply


def sides_for(engine, ref, new, make):
    """{name: fn(x)} of the four sides, `make(model)` giving the call to time."""
    auto, fused = engine.SWITCHES, engine._EvalFn.apply
    fp16x3 = auto._replace(small_m=False)

    def on(switches, apply, fn):
        def call(x):
            engine.SWITCHES, engine._EvalFn.apply = switches, apply
            try:
                return fn(x)
            finally:
                engine.SWITCHES, engine._EvalFn.apply = auto, fused
        return call

    return {"eager": make(ref), "auto": on(auto, fused, make(new)), "fp16x3": on(fp16x3, fused, make(new)),
            "previous": on(fp16x3, previous_apply(engine), make(new))}


def main(argv):
    rows = [int(v) for v in (argv[0] if argv else "1,2,4,8,16,1024").split(",")]
    k, n = (int(v) for v in (argv[1] if len(argv) > 1 else "8192,8192").split(","))
    torch.backends.cuda.matmul.allow_tf32 = False
    for name in ("33", "84"):
        problem = bench.load_problem(name)
        module = importlib.import_module(problem["model_new"])
        engine = getattr(module, "_ENGINE_MODULE", module)
        for m in rows:
            ref, new = bench.build_models(problem, (m, k, n), "eval", 0)
            xs = [torch.rand(m, k, device="cuda").requires_grad_(True) for _ in range(4)]
            g = torch.randn(m, n, device="cuda")

            def clear(model):
                def run(x):
                    model.zero_grad(set_to_none=True)
                    x.grad = None
                return run

            print(f"problem {name} {m}x{k}x{n}: {new.kernel_path(xs[0])}", flush=True)
            for kind, make in (("forward", lambda model: model),
                               ("forward+backward", lambda model: lambda x: model(x).backward(g))):
                fns = sides_for(engine, ref, new, make)
                prepare = {side: clear(ref if side == "eager" else new) for side in fns}
                medians = {}
                for synchronized in (False, True):
                    times = bench.time_fn(fns, xs, ITERS, WARMUP, prepare=prepare, synchronized=synchronized)
                    medians[synchronized] = {side: statistics.median(t) * 1e3 for side, t in times.items()}
                for synchronized, label in ((False, "back to back"), (True, "synchronized")):
                    us = medians[synchronized]
                    print(f"  {kind:16s} {label:12s} us: " + "  ".join(f"{s} {v:7.1f}" for s, v in us.items())
                          + "  | eager / side: " + "  ".join(f"{s} {us['eager'] / v:.2f}" for s, v in us.items()
                                                           if s != "eager"), flush=True)
            del ref, new


if __name__ == "__main__":
    main(sys.argv[1:])
