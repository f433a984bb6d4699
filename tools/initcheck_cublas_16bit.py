"""Reproduces a compute-sanitizer initcheck report that involves no project code:
initcheck does not see the global stores of cuBLAS's 16-bit Hopper GEMM kernels
(nvjet_sm90_*), so reading their product from never-written memory is reported as
an uninitialized read (one report per element), while the same product into
memory filled beforehand, or a float32 product, gives none.

    compute-sanitizer --tool initcheck python tools/initcheck_cublas_16bit.py fresh bfloat16      # M*N reports
    compute-sanitizer --tool initcheck python tools/initcheck_cublas_16bit.py prefilled bfloat16  # 0
    compute-sanitizer --tool initcheck python tools/initcheck_cublas_16bit.py fresh float32       # 0
    python tools/initcheck_cublas_16bit.py compare bfloat16   # both products, bit-equal: the values are written

Measured on an H200 (torch 2.11.0+cu130, CUDA 13.0, compute-sanitizer 2025.3.1):
27200 reports (= 200 x 136) for fresh float16 and bfloat16, 0 for prefilled and
for float32.  This is why tools/sanitize_workload.py runs
initcheck on 16-bit dtypes with --no-backward (the 16-bit backward recomputes
through torch's 16-bit GEMM).
"""
import argparse

import torch


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("fresh", "prefilled", "compare"),
                   help="product into new memory, into memory filled first, or both compared bit for bit")
    p.add_argument("dtype", choices=("float16", "bfloat16", "float32"))
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    m, k, n = 200, 264, 136
    a = torch.rand(m, k, device="cuda", dtype=dtype)
    b = torch.rand(n, k, device="cuda", dtype=dtype)
    fresh = prefilled = None
    if args.mode in ("fresh", "compare"):
        fresh = a @ b.t()
    if args.mode in ("prefilled", "compare"):
        prefilled = torch.full((m, n), 1.0, device="cuda", dtype=dtype)
        torch.mm(a, b.t(), out=prefilled)
    if args.mode == "compare":
        print(f"{args.dtype}: fresh and prefilled products bit-equal: {torch.equal(fresh, prefilled)}")
        return
    c = fresh if fresh is not None else prefilled
    total = c.float().sum().item()  # reads every element of the product
    print(f"{args.mode} {args.dtype}: sum {total:.6g}")


if __name__ == "__main__":
    main()
