"""CPU model of the sm80_3xtf32 kernel's accumulation (kernels/sm80_gemm_3xtf32_bn.cuh), to
predict how the promotion interval (SPAN_K) and the term order move the batch variance of
z = x W^T against float64 -- the statistic that running_var averages -- with no GPU.

The model: x's rows centred and split as prepass_3xtf32.cu does (rn(x - c_m), cvt.rna big
and small parts), W split as split_tf32 does (big rounded half away, small truncated to
TF32 as the MMA reads it), x_small w_small dropped; each mma.m16n8k8 is
d = RZ_fp32(c + sum of its 8 products), the products and the sum exact (float64), then
rounded toward zero (the tensor core's truncating accumulation: the assumption under
test); a span's partial sums are promoted into acc with one round-to-nearest fp32 add; the
epilogue adds c_m (hi_n + lo_n) back.  The alignment truncation inside one MMA is not
modelled.  Per variant it prints, over seeds, the signed mean and the rms over features of
var_ours / var_64 - 1 (var over the batch, float64 arithmetic on each z), and the relative
error of the batch means (norm over features), in units of u = 2^-24, beside torch's CPU
float32 product (an eager-like random error).

    python tools/sm80_span_model.py                   # 64 x 512 x 256 and 256 x 1024 x 512, log-normal and uniform
    python tools/sm80_span_model.py --shape 64,512,256 --family lognormal --seeds 3
"""
import argparse
import math
import statistics

import torch

U = 2.0 ** -24
MMA_K = 8
BLOCK_K = 32

# name: (SPAN_K, small terms first within the span)
VARIANTS = {
    "span32 (today)": (32, False),
    "span8": (8, False),
    "span16": (16, False),
    "span64": (64, False),
    "span32 small-first": (32, True),
    "span16 small-first": (16, True),
}


def tf32_rna(v):
    """cvt.rna.tf32.f32: round to 10 explicit significand bits, ties away (finite v)."""
    b = v.view(torch.int32)
    return ((b + 0x1000) & -0x2000).view(torch.float32)


def tf32_trunc(v):
    """The top 19 bits of an fp32 word, as the TF32 MMA reads a raw fp32 operand."""
    return (v.view(torch.int32) & -0x2000).view(torch.float32)


def rz_fp32(v64):
    """float64 -> float32 rounded toward zero."""
    f = v64.float()
    over = f.double().abs() > v64.abs()
    f[over] = torch.nextafter(f[over], torch.zeros_like(f[over]))
    return f


def operands(x, w):
    """The kernel's operands: x's centred TF32 parts, W's parts, the centres and W's row sums."""
    K = x.shape[1]
    c = (x.sum(dim=1) * (1.0 / K)).float()  # rn(sum) / K in fp32 (the sum's order aside)
    v = x - c[:, None]
    xb = tf32_rna(v)
    xs = tf32_rna(v - xb)
    wb = tf32_rna(w)
    ws = tf32_trunc(w - wb)
    s64 = w.double().sum(dim=1)
    hi = s64.float()
    lo = (s64 - hi.double()).float()
    return c, xb, xs, wb, ws, hi, lo


def k_step_columns(K):
    """Logical k columns of each mma k-step: slab j, step s reads 32 j + 8 q + 2 s + h (q < 4, h < 2)."""
    steps = []
    for j in range(0, K, BLOCK_K):
        for s in range(BLOCK_K // MMA_K):
            cols = [j + 8 * q + 2 * s + h for q in range(4) for h in range(2)]
            steps.append([k for k in cols if k < K])
    return steps


def kernel_z(x, w, span_k, small_first):
    M, K = x.shape
    c, xb, xs, wb, ws, hi, lo = (t.double() for t in operands(x, w))
    steps = k_step_columns(K)
    steps_per_span = max(span_k // MMA_K, 1)
    acc = torch.zeros(M, w.shape[0], dtype=torch.float32)
    part = torch.zeros(M, w.shape[0], dtype=torch.float64)

    def mma(part, a, b, cols):
        return rz_fp32(part + a[:, cols] @ b[:, cols].T).double()

    for first in range(0, len(steps), steps_per_span):
        span = steps[first:first + steps_per_span]
        part.zero_()
        if small_first:
            for cols in span:
                part = mma(part, xs, wb, cols)
                part = mma(part, xb, ws, cols)
            for cols in span:
                part = mma(part, xb, wb, cols)
        else:
            for cols in span:
                part = mma(part, xs, wb, cols)
                part = mma(part, xb, ws, cols)
                part = mma(part, xb, wb, cols)
        acc = (acc.double() + part).float()  # the promotion: round to nearest
    # z = fma(c, hi, fma(c, lo, acc)), each fma rounded once
    z = (c[:, None] * lo[None, :] + acc.double()).float().double()
    return (c[:, None] * hi[None, :] + z).float()


def var_error(z, z64):
    """Per feature: var over the batch (float64 arithmetic) relative to float64's, minus 1."""
    return z.double().var(dim=0) / z64.var(dim=0) - 1.0


def mean_error(z, z64):
    """||mean_ours - mean_64|| / ||mean_64|| over features (batch means, float64 arithmetic)."""
    m64 = z64.mean(dim=0)
    return ((z.double().mean(dim=0) - m64).norm() / m64.norm()).item()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", action="append", help="M,K,N (repeatable; default 64,512,256 and 256,1024,512)")
    p.add_argument("--family", action="append", choices=("lognormal", "uniform"))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of " + ", ".join(VARIANTS))
    args = p.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in (args.shape or ["64,512,256", "256,1024,512"])]
    families = args.family or ["lognormal", "uniform"]
    names = [n for n in args.variants.split(",") if n]
    torch.set_num_threads(1)
    print("var: var_ours / var_64 - 1 per feature, signed mean and rms over features; mean: ||mean - mean_64|| / "
          "||mean_64||; averages over seeds, in u = 2^-24")
    for (m, k, n) in shapes:
        for fam in families:
            rows = {name: ([], [], []) for name in ["torch cpu fp32"] + names}
            for seed in range(args.seeds):
                gen = torch.Generator().manual_seed(seed)
                bound = 1.0 / math.sqrt(k)
                w = (torch.rand(n, k, generator=gen) * 2 - 1) * bound
                x = torch.empty(m, k).log_normal_(generator=gen) if fam == "lognormal" else torch.rand(m, k, generator=gen)
                z64 = x.double() @ w.double().T
                outs = {"torch cpu fp32": x @ w.T}
                for name in names:
                    outs[name] = kernel_z(x, w, *VARIANTS[name])
                for name, z in outs.items():
                    e = var_error(z, z64)
                    rows[name][0].append(e.mean().item() / U)
                    rows[name][1].append(e.square().mean().sqrt().item() / U)
                    rows[name][2].append(mean_error(z, z64) / U)
            for name, (bias, rms, mean) in rows.items():
                print(f"{m}x{k}x{n} {fam:9s} {name:20s} var: bias {statistics.mean(bias):+7.2f} u, rms "
                      f"{statistics.mean(rms):6.2f} u | mean: {statistics.mean(mean):6.2f} u", flush=True)


if __name__ == "__main__":
    main()
