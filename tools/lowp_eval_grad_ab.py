"""16-bit eval with gradients (`model.bn.eval()` while fine-tuning a 16-bit
model), side by side in one run: eager Model and ModelNew (model_new_lowp.GradFn:
forward_eval_saved on lowp_cublas, bn_backward_eval, two cuBLAS products).
Forward + backward (model(x).backward(g)) in eval after bench.py's settling
steps, CUDA-event medians of bench.time_fn (interleaved, L2 flushed, GPU time
behind a spin kernel), both 16-bit dtypes and problems; then every gradient's
relative Frobenius error against the float64 Model for both sides (x,
gemm.weight, gemm.bias, scale, bn.weight, bn.bias) and their ratio.

Each side is compared with a float64 Model that carries that side's own state
(parameters and running statistics): bench.build_models' settling steps leave
the two sides with running statistics that differ by their training-mode
rounding, and in eval the gradients depend on them, so one float64 Model for
both would charge that difference to the backward.  `--shared-reference`
compares both with the float64 copy of eager's state instead (the old reading).
`--full-precision-reductions` turns off cuBLAS's reduced-precision reductions
for 16-bit products (torch.backends.cuda.matmul.allow_{fp16,bf16}_reduced_
precision_reduction) for both sides; the strides of each side's gradient of
the Linear output (the grad_W product's left operand, transposed) are printed.

    python tools/lowp_eval_grad_ab.py [M,K,N] [--shared-reference] [--full-precision-reductions]
                                             (default shape: KernelBench's 1024,8192,8192)
"""
import contextlib
import copy
import os
import statistics
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402

NAMES = ("x", "gemm.weight", "gemm.bias", "scale", "bn.weight", "bn.bias")


class MatmulLog(TorchDispatchMode):
    """Records (op, operand shapes and strides) of every aten mm / addmm the backward runs."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in ("mm", "addmm", "bmm"):
            self.calls.append(f"{func.__name__}" + "".join(
                f" {tuple(a.shape)}/{a.stride()}" for a in args if isinstance(a, torch.Tensor)))
        return func(*args, **(kwargs or {}))


def gradients(module, x, g, log=None):
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = module(x)
    with log if log is not None else contextlib.nullcontext():
        (out * g.to(out.dtype)).sum().backward()
    return [x.grad] + [p.grad for p in module.parameters()]


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    shared = "--shared-reference" in sys.argv[1:]
    if "--full-precision-reductions" in sys.argv[1:]:
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    shape = tuple(int(v) for v in args[0].split(",")) if args else (1024, 8192, 8192)
    m, k, n = shape
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}; M,K,N = {shape}; "
          f"eval, forward + backward")
    for dtype in (torch.float16, torch.bfloat16):
        for name in ("33", "84"):
            problem = bench.load_problem(name)
            ref, new = bench.build_models(problem, shape, "eval", 0, dtype)
            sides = {"eager": ref, "ModelNew": new}
            gen = torch.Generator(device="cuda").manual_seed(1)
            g = torch.randn(m, n, device="cuda", generator=gen).to(dtype)
            x_check = torch.rand(m, k, device="cuda").to(dtype)
            errors = {}
            for side, module in sides.items():
                ref64 = copy.deepcopy(ref).double()
                if not shared:
                    ref64.load_state_dict(module.state_dict())
                want = gradients(ref64, x_check.double(), g.double())
                log = MatmulLog()
                errors[side] = [rel_err(a, b) for a, b in zip(gradients(module, x_check, g, log), want)]
                print(f"    {side} backward products: " + "; ".join(log.calls))
            stats = "  ".join(f"{key}: {rel_err(new.state_dict()[key], v):.1e}" for key, v in ref.state_dict().items()
                              if key.startswith("bn.running"))
            inputs = [torch.rand(m, k, device="cuda").to(dtype).requires_grad_(True) for _ in range(3)]

            def clear(x):
                x.grad = None
                ref.zero_grad(set_to_none=True)
                new.zero_grad(set_to_none=True)

            fns = {side: (lambda f: lambda x: f(x).backward(g))(module) for side, module in sides.items()}
            times = bench.time_fn(fns, inputs, 30, 5, prepare={side: clear for side in sides})
            med = {side: statistics.median(t) for side, t in times.items()}
            print(f"{name} {str(dtype)[6:]}: eager {med['eager']:.3f} ms, ModelNew {med['ModelNew']:.3f} ms, "
                  f"ModelNew / eager {med['ModelNew'] / med['eager']:.3f}  ({new.kernel_path(inputs[0])})")
            print(f"    ModelNew's running statistics against eager's (relative): {stats}")
            print("    grad err vs float64 " + "  ".join(f"{n_}: {e:.2e} / {r:.2e} ({e / r:.2f}x)"
                                                         for n_, e, r in zip(NAMES, errors["ModelNew"],
                                                                              errors["eager"])))


if __name__ == "__main__":
    main()
