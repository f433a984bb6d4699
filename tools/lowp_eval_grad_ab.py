"""16-bit eval with gradients (`model.bn.eval()` while fine-tuning a 16-bit
model), side by side in one run: eager Model and ModelNew (the 16-bit extension's forward_grad:
forward_eval_saved on lowp_cublas, bn_backward_eval, two cuBLAS products).
Forward + backward (model(x).backward(g)) in eval after bench.py's settling
steps, CUDA-event medians of bench.time_fn (interleaved, L2 flushed, GPU time
behind a spin kernel), both 16-bit dtypes and problems; then every gradient's
relative Frobenius error against a float64 Model holding that side's own state
(parameters and running statistics), named by named_parameters() (both
problems list `scale` first), mean over SEEDS (x, g) draws, and the ratio of the
means (the largest single-draw ratio beside it).  Problem 84's `scale` is one
number: its error is the rounding luck of one 16-bit value, so single draws
swing by ulps and only the mean over draws says something.

    python tools/lowp_eval_grad_ab.py [M,K,N]      (default: KernelBench's 1024,8192,8192)
"""
import copy
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402

SEEDS = 5


def gradients(module, x, g):
    """{"x": grad x, name: grad of each parameter} of sum(module(x) * g)."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = module(x)
    (out * g.to(out.dtype)).sum().backward()
    return {"x": x.grad, **{name: p.grad for name, p in module.named_parameters()}}


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def gradient_errors(sides, ref, m, k, n, dtype):
    """{side: {name: [error per seed]}} against a float64 Model holding the side's state."""
    errors = {side: {} for side in sides}
    for seed in range(SEEDS):
        gen = torch.Generator(device="cuda").manual_seed(1000 + seed)
        g = torch.randn(m, n, device="cuda", generator=gen).to(dtype)
        x = torch.rand(m, k, device="cuda", generator=gen).to(dtype)
        for side, module in sides.items():
            ref64 = copy.deepcopy(ref).double()
            ref64.load_state_dict(module.state_dict())
            want = gradients(ref64, x.double(), g.double())
            for name, got in gradients(module, x, g).items():
                errors[side].setdefault(name, []).append(rel_err(got, want[name]))
    return errors


def main():
    shape = tuple(int(v) for v in sys.argv[1].split(",")) if len(sys.argv) > 1 else (1024, 8192, 8192)
    m, k, n = shape
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}; M,K,N = {shape}; "
          f"eval, forward + backward; gradient errors: mean of {SEEDS} draws, ModelNew / eager (max single draw)")
    for dtype in (torch.float16, torch.bfloat16):
        for name in ("33", "84"):
            problem = bench.load_problem(name)
            ref, new = bench.build_models(problem, shape, "eval", 0, dtype)
            sides = {"eager": ref, "ModelNew": new}
            errors = gradient_errors(sides, ref, m, k, n, dtype)
            g = torch.randn(m, n, device="cuda").to(dtype)
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
            cells = []
            for key, ours in errors["ModelNew"].items():
                theirs = errors["eager"][key]
                worst = max(a / b for a, b in zip(ours, theirs))
                cells.append(f"{key}: {statistics.mean(ours):.2e} / {statistics.mean(theirs):.2e} "
                             f"({statistics.mean(ours) / statistics.mean(theirs):.2f}x, max {worst:.2f}x)")
            print("    grad err vs float64 " + "  ".join(cells))


if __name__ == "__main__":
    main()
