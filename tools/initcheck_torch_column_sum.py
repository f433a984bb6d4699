"""Reproduces a compute-sanitizer initcheck report that involves no project code:
torch's column sum (Tensor.sum(dim=0)) of a (2305, 136) float32 tensor that torch
itself wrote fully is reported as reading uninitialized global memory inside
at::native::reduce_kernel (the multi-block reduction over 2305 rows reads its own
staging memory).  tools/sanitize_workload.py reaches the same reduction in
problem 84's training backward (grad_scale's sum_m grad_y term, in torch ops) at
its 2305 x 64 x 136 shape.

    compute-sanitizer --tool initcheck python tools/initcheck_torch_column_sum.py   # 4440 reports

Measured on an H200 (torch 2.11.0+cu130, CUDA 13.0): 4440 reports, the same
count the workload's problem-84 2305 x 64 x 136 training backward gives alone;
the problem-33 backward and both forwards at that shape give 0 (each run in its
own process under initcheck).
"""
import torch


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(2305, 136, device="cuda", generator=gen)
    b = torch.randn(2305, 136, device="cuda", generator=gen)
    y = a * (b - (a * b).sum(dim=1, keepdim=True))  # the row-softmax backward's shape of work
    s = y.sum(dim=0)
    torch.cuda.synchronize()
    print(f"column sum of a {tuple(y.shape)} tensor: {tuple(s.shape)}, finite: {bool(torch.isfinite(s).all())}")


if __name__ == "__main__":
    main()
