"""The fp16x3 split of kernels/fp16x3_split.cuh, emulated bit-exactly on the CPU
(runs in CI).

torch's float32 -> float16 conversion rounds to nearest even, as the kernels'
`cvt.rn.f16x2.f32` does, so `(v * s).half()` is the kernels' fp16 part bit for
bit; `scale_of` is fp16x3_scale's exponent arithmetic.  The emulated GEMM sums
the three products exactly (float64: fp16 x fp16 products are exact there), so
what it measures is the split's representation error, the part of the error
budget that the tensor core's accumulation (promoted every 32 k in the kernel,
measured on the GPU by tests/test_equivalence.py) does not cover.

Negative controls: no small part, no scaling (wide-range rows), and a scale
that lets |v s| exceed fp16's range each fail the bounds the real split meets.
The row centring is emulated with a truncating float32 accumulation per 16-k
step (the tensor core's): the uncentred split's batch means are biased towards
zero, the centred split's are not.
"""
import pytest
import torch

FP16_MAX = 65504.0


def scale_of(amax):
    """fp16x3_scale: s = 2^(14 - floor(log2 amax)) clamped to [2^-126, 2^126], and 1 / s."""
    e = (amax.float().contiguous().view(torch.int32) >> 23) & 0xFF
    es = torch.clamp(268 - e, 1, 253)
    s = (es << 23).view(torch.float32)
    inv = ((254 - es) << 23).view(torch.float32)
    return s, inv


def split(v, s, with_lo=True):
    """hi = rn_fp16(v s), lo = rn_fp16(v s - hi), as float32 values (v float32)."""
    vs = v * s
    hi = vs.half().float()
    lo = (vs - hi).half().float() if with_lo else torch.zeros_like(vs)
    return hi, lo


def row_parts(x, scaled=True, with_lo=True):
    amax = x.abs().amax(dim=1, keepdim=True)
    s, inv = scale_of(amax) if scaled else (torch.ones_like(amax), torch.ones_like(amax))
    hi, lo = split(x, s, with_lo)
    return hi.double(), lo.double(), inv.double()


def gemm_fp16x3(x, w, span=32, scaled=True, with_lo=True):
    """z = x @ w^T as the kernel forms it: x's parts per row, w's per (row, 32-k span),
    z = sum_span (x_hi w_hi + x_hi w_lo + x_lo w_hi) 2^-e_w 2^-e_x, summed exactly."""
    xh, xl, x_inv = row_parts(x, scaled, with_lo)
    z = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)
    for k0 in range(0, x.shape[1], span):
        wh, wl, w_inv = row_parts(w[:, k0:k0 + span], scaled, with_lo)
        a_h, a_l = xh[:, k0:k0 + span], xl[:, k0:k0 + span]
        z += (a_h @ wh.t() + a_h @ wl.t() + a_l @ wh.t()) * w_inv.t()
    return z * x_inv


def test_scale_puts_the_row_maximum_in_the_top_binade():
    amax = torch.tensor([1.0, 1.5, 3.0e-5, 7.9e4, 1.0e30, 1.0e-30, 2.0 ** -112, 3.3e38])
    s, inv = scale_of(amax)
    scaled = amax.double() * s.double()
    assert ((scaled >= 2.0 ** 14) & (scaled < 2.0 ** 15)).all()
    assert torch.equal(s.double() * inv.double(), torch.ones(len(amax), dtype=torch.float64))
    # tiny rows, zero rows and non-finite maxima clamp to normal scales
    s, inv = scale_of(torch.tensor([2.0 ** -120, 0.0, float("inf")]))
    assert s.tolist()[:2] == [2.0 ** 126, 2.0 ** 126]
    assert torch.isfinite(s).all() and torch.isfinite(inv).all() and (inv > 0).all()


def test_split_error_bound():
    """|v s - (hi + lo)| <= 2^-22 |v s| where lo is a normal fp16 (|v s| >= 2^-3),
    and <= 2^-25 absolute below (lo subnormal); zero stays exact."""
    g = torch.Generator().manual_seed(0)
    v = (torch.rand(4096, generator=g) * 2 - 1) * 10.0 ** torch.randint(-12, 12, (4096,), generator=g).float()
    v[:8] = 0.0
    s, _ = scale_of(v.abs().max())
    hi, lo = split(v, s)
    vs = v.double() * s.double()
    err = (vs - (hi.double() + lo.double())).abs()
    normal = vs.abs() >= 2.0 ** -3
    assert (err[normal] <= 2.0 ** -22 * vs.abs()[normal]).all()
    assert (err[~normal] <= 2.0 ** -25).all()
    assert (hi[:8] == 0).all() and (lo[:8] == 0).all()
    assert hi.abs().max() <= FP16_MAX and torch.isfinite(lo).all()


def test_split_of_non_finite_values_poisons_the_products():
    s, _ = scale_of(torch.tensor(float("inf")))
    hi, lo = split(torch.tensor([float("inf"), 1.0, float("nan")]), s)
    assert torch.isinf(hi[0]) and torch.isnan(lo[0]) and torch.isnan(hi[2])


FAMILIES = {
    "uniform": lambda g, shape: torch.rand(shape, generator=g),
    "normal": lambda g, shape: torch.randn(shape, generator=g),
    "offset": lambda g, shape: 100 + torch.rand(shape, generator=g),
    "wide": lambda g, shape: torch.rand(shape, generator=g) * 10.0 ** torch.randint(-30, 31, shape, generator=g).float(),
}


def _operands(family, m=24, k=512, n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = FAMILIES[family](g, (m, k))
    x[3] = 0.0  # an all-zero row
    w = (torch.rand(n, k, generator=g) * 2 - 1) / k ** 0.5
    return x, w


def _elementwise_error(z, x, w):
    """max over elements of |z - z64| / (|x| |w|)[m, n]: the rounding bound's own unit."""
    z64 = x.double() @ w.double().t()
    bound = x.double().abs() @ w.double().abs().t()
    return ((z - z64).abs() / bound.clamp_min(1e-300)).max().item()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_emulated_gemm_within_the_split_bound(family):
    """Each product term carries at most about 2^-22 relative representation error
    per operand plus the dropped lo*lo term (< 2^-22): 2^-20 per |x||w| covers it."""
    x, w = _operands(family)
    z = gemm_fp16x3(x, w)
    assert _elementwise_error(z, x, w) <= 2.0 ** -20
    assert (z[3] == 0).all()


@pytest.mark.parametrize("family", ["uniform", "normal"])
def test_emulated_gemm_beats_eager_sgemm(family):
    """Frobenius error against float64 below float32 eager's (CPU SGEMM) at K = 2048."""
    x, w = _operands(family, m=32, k=2048, n=48)
    z64 = x.double() @ w.double().t()
    ours = (gemm_fp16x3(x, w) - z64).norm() / z64.norm()
    eager = ((x @ w.t()).double() - z64).norm() / z64.norm()
    assert ours <= eager


def test_negative_control_without_the_small_part():
    x, w = _operands("uniform")
    assert _elementwise_error(gemm_fp16x3(x, w, with_lo=False), x, w) > 2.0 ** -18


def test_negative_control_without_scaling_on_wide_rows():
    """Unscaled, values above 65504 overflow and small ones underflow fp16."""
    x, w = _operands("wide")
    z = gemm_fp16x3(x, w, scaled=False)
    assert not torch.isfinite(z).all() or _elementwise_error(z, x, w) > 2.0 ** -18


def test_negative_control_without_scaling_on_weights():
    """nn.Linear's weights (|w| < 2^-6 at K = 8192) leave unscaled small parts in
    fp16's subnormal range (spacing 2^-24): each weight then carries up to 2^-25
    absolute error, far above the 2^-22 relative bound the scaled split meets."""
    g = torch.Generator().manual_seed(1)
    k = 8192
    w = (torch.rand(8, k, generator=g) * 2 - 1) / k ** 0.5
    w = w[w.abs() > 1e-4]

    def worst_relative(scaled):
        s = scale_of(w.abs().max())[0] if scaled else torch.tensor(1.0)
        hi, lo = split(w, s)
        return ((w.double() * s.double() - hi.double() - lo.double()).abs() / (w.double() * s.double()).abs()).max()

    assert worst_relative(True) <= 2.0 ** -22
    assert worst_relative(False) > 2.0 ** -18


# ---------------------------------------------------------------------------
# Centring (prepass_fp16x3.cu): x's rows split as x - c_m, c_m sum_k w added back
# ---------------------------------------------------------------------------


def _rz_fp32(v):
    """float64 -> float32 rounded towards zero (the tensor core's accumulation
    truncates: Fasi, Higham, Mikaitis and Pranesh, "Numerical behavior of NVIDIA
    tensor cores", PeerJ CS 2021), returned as float64."""
    f = v.float()
    over = f.double().abs() > v.abs()
    f = torch.where(over, torch.nextafter(f, torch.zeros_like(f)), f)
    return f.double()


def gemm_truncating(x, w, center, span=32, step=16):
    """z = x @ w^T with the kernel's structure: per-row parts of x (centred on
    its row mean when `center`) and of w; per span of 32 k a partial sum that
    each 16-k step's three exact products enter with truncation to float32, then
    acc += part rounded to nearest (the promotion); z = acc 2^-e_w 2^-e_x, then
    + c_m (hi_n + lo_n) rounded to float32 (the epilogue's two fmas)."""
    c = (x.sum(dim=1, keepdim=True) * (1.0 / x.shape[1])) if center else torch.zeros(x.shape[0], 1)
    xh, xl, x_inv = row_parts(x - c)
    wh, wl, w_inv = row_parts(w)
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)
    for k0 in range(0, x.shape[1], span):
        part = torch.zeros_like(acc)
        for k1 in range(k0, k0 + span, step):
            sl = slice(k1, k1 + step)
            part = _rz_fp32(part + xh[:, sl] @ wl[:, sl].t() + xl[:, sl] @ wh[:, sl].t() + xh[:, sl] @ wh[:, sl].t())
        acc = (acc + part).float().double()
    z = (acc * w_inv.t()).float().double() * x_inv
    row_sum = w.double().sum(dim=1)
    hi = row_sum.float().double()
    lo = (row_sum - hi).float().double()
    return (z + c.double() * lo[None, :] + c.double() * hi[None, :]).float().double()


def _mean_bias(z, ref):
    """Signed error of the per-feature batch means, relative: sum_n (mean z - mean ref)
    sign(mean ref) / sum_n |mean ref| (negative: the means shrink towards zero)."""
    d = z.mean(dim=0) - ref.mean(dim=0)
    return float((d * ref.mean(dim=0).sign()).sum() / ref.mean(dim=0).abs().sum())


def test_centring_removes_the_truncation_bias_of_the_batch_mean():
    """Rows that share a level (uniform [0, 1)) make every row of a feature lose
    the same signed amount to the truncating accumulation, which the batch mean
    (running_mean) keeps; centring the rows leaves only what varies between rows,
    whose truncation errors average out.  Negative control: the uncentred split
    shows the bias (-4e-8 to -7e-8 over five seeds here; -5.8e-8 was measured on an H200 at the
    KernelBench shape, docs/perf.md v21)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(256, 512, generator=gen)
    w = (torch.rand(64, 512, generator=gen) * 2 - 1) / 512 ** 0.5
    ref = x.double() @ w.double().t()
    plain = _mean_bias(gemm_truncating(x, w, center=False), ref)
    centred = _mean_bias(gemm_truncating(x, w, center=True), ref)
    assert plain < -2e-8, plain
    assert abs(centred) < abs(plain) / 5, (centred, plain)


def test_centring_keeps_the_product_exact_up_to_the_split():
    """z = sum_k (x - c) w + c sum_k w: the centred emulation (with exact
    accumulation) stays within the uncentred one's elementwise error bound, on
    rows with a common level and on zero-mean rows."""
    gen = torch.Generator().manual_seed(4)
    for x in (100 + torch.rand(32, 256, generator=gen), torch.randn(32, 256, generator=gen)):
        w = (torch.rand(24, 256, generator=gen) * 2 - 1) / 16
        c = x.sum(dim=1, keepdim=True) * (1.0 / 256)
        xh, xl, x_inv = row_parts(x - c)
        wh, wl, w_inv = row_parts(w)
        z = (xh @ wh.t() + xh @ wl.t() + xl @ wh.t()) * w_inv.t() * x_inv + c.double() * w.double().sum(dim=1)
        ref = x.double() @ w.double().t()
        bound = x.double().abs() @ w.double().abs().t()
        assert float(((z - ref).abs() / bound).max()) < 2 ** -21
