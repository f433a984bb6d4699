"""The fp16x3 path's K padding (kernels/prepass_fp16x3.cu, torch_binding.cpp),
emulated on the CPU (runs in CI; no GPU).

sm90_prepass_fp16x3 writes x's and W's fp16 parts in rows of K_pad =
round_up(K, 8) words (TMA needs 16-byte row strides), zeros in columns
K .. K_pad - 1, with each row's centre, scale and sum taken over its K real
elements; the GEMM then runs over K_pad.  Emulated here with the split of
tests/test_fp16x3_split.py (bit-exact: torch's float32 -> float16 rounds to
nearest even, as cvt.rn.f16x2.f32) and a GEMM that sums each 16-k wgmma step
exactly and accumulates steps in float32 per 32-k span, promoted into a
float32 accumulator (the kernel's structure; the tensor core's truncating
adds are not modelled: they add +0 exactly too).  Checked:
  - the padded run gives bit for bit what the same GEMM over the real K gives
    with TMA's zero fill past K (the pre-Issue-38 layout for K % 8 == 0), for
    K % 8 in 0 .. 7, and the k-block count (64-k blocks) is unchanged;
  - the result is float32-accurate against float64 (the split's budget);
  - negative controls: padding columns holding anything but zeros (what
    torch::empty may leave there) change the result, and an Inf or NaN word in
    one operand's padding makes it NaN even where the other operand's is zero,
    so both operands' padding is written;
  - the packed weight tensor's layout (weight_parts_floats): both parts start
    16-byte aligned and the scales follow them.
"""
import pytest
import torch

from tests.test_fp16x3_split import scale_of


def padded_k(k):
    """launchers.cuh fp16x3_padded_k."""
    return (k + 7) // 8 * 8


def prepass(x, centred, pad_value=0.0):
    """(hi, lo) (rows, K_pad) float16 as the pre-pass stores them, inv_scale (rows, 1)
    float64, centre (rows, 1) float32 (x side) or zeros (w side)."""
    rows, k = x.shape
    k_pad = padded_k(k)
    if centred:
        c = x.sum(dim=1, keepdim=True) / k
    else:
        c = torch.zeros(rows, 1)
    v = x - c
    amax = torch.maximum(x.amax(dim=1, keepdim=True) - c, c - x.amin(dim=1, keepdim=True)).clamp_min(0.0)
    s, inv = scale_of(amax)
    vs = v * s
    hi = torch.full((rows, k_pad), pad_value, dtype=torch.float16)
    lo = torch.full((rows, k_pad), pad_value, dtype=torch.float16)
    hi[:, :k] = vs.half()
    lo[:, :k] = (vs - hi[:, :k].float()).half()
    return hi, lo, inv.double(), c


def gemm(xp, wp, k_run, w_row_sum):
    """z = x @ w^T from the parts over k_run columns (reading zeros past the stored
    width, as TMA's fill does), the kernel's order: per 32-k span the small products
    then the big one, 16-k steps exact, spans in float32, promoted into acc."""
    xh, xl, x_inv, c = xp
    wh, wl, w_inv, _ = wp

    def cols(t, k0, k1):
        out = torch.zeros(t.shape[0], k1 - k0, dtype=torch.float64)
        width = max(0, min(k1, t.shape[1]) - k0)
        out[:, :width] = t[:, k0:k0 + width].double()
        return out

    acc = torch.zeros(xh.shape[0], wh.shape[0], dtype=torch.float32)
    for s0 in range(0, (k_run + 63) // 64 * 64, 32):
        part = torch.zeros_like(acc)
        for pair in ((xl, wh), (xh, wl), (xh, wh)):
            for k0 in range(s0, s0 + 32, 16):
                a, b = cols(pair[0], k0, k0 + 16), cols(pair[1], k0, k0 + 16)
                part = (part.double() + a @ b.t()).float()
        acc = acc + part
    z = (acc.double() * w_inv.t()).float().double() * x_inv
    z = z.float()
    hi = w_row_sum.float()
    lo = (w_row_sum - hi.double()).float()
    return (c.double() * hi.double().t() + (c.double() * lo.double().t() + z.double())).float()


def run(x, w, x_pad=0.0, w_pad=0.0):
    k = x.shape[1]
    xp = prepass(x, centred=True, pad_value=x_pad)
    wp = prepass(w, centred=False, pad_value=w_pad)
    row_sum = w.double().sum(dim=1, keepdim=True)
    return gemm(xp, wp, padded_k(k), row_sum), xp, wp, row_sum


@pytest.mark.parametrize("k", [1, 3, 7, 8, 13, 36, 63, 64, 65, 100, 131])
def test_padded_parts_match_the_zero_filled_gemm(k):
    g = torch.Generator().manual_seed(k)
    x = torch.rand(24, k, generator=g) + 0.5
    w = torch.randn(20, k, generator=g)
    z, xp, wp, row_sum = run(x, w)
    k_pad = padded_k(k)
    assert k_pad % 8 == 0 and 0 <= k_pad - k < 8
    assert (k_pad + 63) // 64 == (k + 63) // 64  # the same k-blocks, the same split-tile plan
    for part in (xp[0], xp[1], wp[0], wp[1]):
        assert part.shape[1] == k_pad and (part[:, k:] == 0).all()
    # The same GEMM over the real K reading zeros past K (TMA's out-of-bounds fill).
    trimmed = lambda p: (p[0][:, :k], p[1][:, :k], p[2], p[3])
    z_real = gemm(trimmed(xp), trimmed(wp), k, row_sum)
    assert torch.equal(z, z_real)
    ref = x.double() @ w.double().t()
    err = ((z.double() - ref).norm() / ref.norm()).item()
    assert err < 2.0 ** -20, err


def test_negative_controls():
    g = torch.Generator().manual_seed(1)
    k = 13
    x = torch.rand(16, k, generator=g) + 0.5
    w = torch.randn(12, k, generator=g)
    z, *_ = run(x, w)
    ref = x.double() @ w.double().t()
    err = ((z.double() - ref).norm() / ref.norm()).item()
    # padding that is not zero enters the products
    z_bad, *_ = run(x, w, x_pad=1024.0, w_pad=1024.0)  # words of the scaled domain: 2^-4 of the rows' max
    assert ((z_bad.double() - ref).norm() / ref.norm()).item() > 1e3 * err
    # zeros on one side do not suffice: 0 * Inf = NaN
    z_bad, *_ = run(x, w, w_pad=float("inf"))
    assert torch.isnan(z_bad).all()


def weight_parts_layout(n, k):
    """torch_binding.cpp weight_parts_floats / packed_weight_parts offsets, in floats."""
    k_pad = padded_k(k)
    part = n * k_pad // 2
    inv_scale = 2 * part
    row_sum = inv_scale + (n + 3) // 4 * 4
    return part, inv_scale, row_sum, n * k_pad + (n + 3) // 4 * 4 + 2 * n


@pytest.mark.parametrize("n,k", [(1, 1), (3, 5), (7, 12), (64, 8), (5, 1001)])
def test_weight_parts_layout(n, k):
    part, inv_scale, row_sum, total = weight_parts_layout(n, k)
    assert part % 4 == 0  # w_lo starts 16-byte aligned (the GEMM's TMA), w_hi at the tensor's start
    assert part * 2 == n * padded_k(k)  # two fp16 words per float
    assert inv_scale == 2 * part and row_sum % 4 == 0 and row_sum + 2 * n == total
