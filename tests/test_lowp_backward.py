"""The 16-bit backward after the GEMM (kernels/lowp/bn_16bit_backward.cu:
bn_backward_train and bn_backward_eval of the 16-bit extension) against a
float64 autograd reference of the chain it differentiates, and the Python glue
around it (model_new_lowp.backward) on the CPU.
Names: M = batch, N = out_features, K = in_features.

Run: python -m pytest -q tests/test_lowp_backward.py      (GPU tests skip without CUDA)

Reference (bn_backward_reference): float64 autograd of what the kernel's header
says it differentiates, from the same z (M, N), coeff (4, N) rows {mean, invstd,
gamma, beta} and scale (N):
  problem 33: u = rnd_S(z s),  y = gamma (u - mean) invstd + beta,  L = sum g y
  problem 84: u = z,  y = rnd_T(gamma (u - mean) invstd + beta),  L = sum g (y s)
with each rounding's derivative 1 (the rounded value enters as value + a
detached correction, so the reference sees the kernel's rounded values).
Training takes mean and invstd from u's batch (autograd follows them; coeff
holds the same values, as the forward's fold writes them); eval takes them from
coeff as constants (the running statistics).  Returns (dz, dscale, dgamma, dbeta).

CPU (CI)
  - test_cpu_lowp_backward_glue [problem, mode]: model_new_lowp.backward driven
    in float64 by the reference as its bn_backward: the six gradients (x,
    gemm.weight, gemm.bias, scale, bn.weight, bn.bias) equal float64 autograd of
    the whole forward (Linear -> chain -> 84's softmax) within 1e-10; gemm.bias
    exactly 0 in training, Σ_m dz in eval.

GPU
  - test_gpu_lowp_bn_backward_contract [dtype, problem, mode, g dtype, storage]:
    the extension's bn_backward_train / bn_backward_eval against the reference at
    (257, 264) (a feature tail in the last CTA): dz within 2 units of roundoff of
    the 16-bit dtype (relative Frobenius: it is rounded once), the float32
    parameter gradients within 1e-4 (float64 sums; the rest is the reference's
    own rounding emulation and the float32 coefficients; problem 33's training
    dscale, 0 in exact arithmetic up to eps, against the size of its terms).  A probe call's
    outputs are filled with NaN and freed, the call reuses those blocks
    (asserted): every element must be written.
"""
import pytest
import torch

import model_new
from tests.test_backward import rel_err

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (ModelNew's kernels)")

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
EPS = 1e-5


def rounded(v, dtype):
    """v with the value of its rounding to dtype and the derivative of v (None: v)."""
    if dtype is None or dtype == v.dtype:
        return v
    return v + (v.detach().to(dtype).double() - v.detach())


def bn_backward_reference(g, z, coeff, scale, scale_after_bn, training, t_dtype=None, s_dtype=None):
    """(dz, dscale, dgamma, dbeta) in float64 (module docstring).  t_dtype: the
    16-bit type T of the kernel (84's y is rounded to it); s_dtype: the storage S
    (33's u is rounded to it; float32: autocast's form, no 16-bit rounding there)."""
    z = z.detach().double().requires_grad_(True)
    s = scale.detach().double().requires_grad_(True)
    mean, invstd, gamma, beta = (row.clone() for row in coeff.detach().double())
    gamma.requires_grad_(True)
    beta.requires_grad_(True)
    u = z if scale_after_bn else rounded(z * s, s_dtype)
    if training:
        mean = u.mean(dim=0)
        invstd = torch.rsqrt(u.var(dim=0, unbiased=False) + EPS)
    y = gamma * (u - mean) * invstd + beta
    loss = (g.double() * (rounded(y, t_dtype) * s)).sum() if scale_after_bn else (g.double() * y).sum()
    return torch.autograd.grad(loss, (z, s, gamma, beta))


def training_coeff(u, gamma, beta):
    """coeff (4, N) float64 of u's batch: {mean, rsqrt(biased var + EPS), gamma, beta}."""
    u = u.double()
    return torch.stack((u.mean(dim=0), torch.rsqrt(u.var(dim=0, unbiased=False) + EPS), gamma.double(),
                        beta.double()))


def problem_inputs(m, k, n, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(m, k, generator=gen, dtype=torch.float64)
    w = torch.randn(n, k, generator=gen, dtype=torch.float64) / k ** 0.5
    vecs = {"bias": 0.3 * torch.randn(n, generator=gen, dtype=torch.float64),
            "scale": torch.rand(n, generator=gen, dtype=torch.float64) + 0.5,
            "gamma": torch.rand(n, generator=gen, dtype=torch.float64) + 0.5,
            "beta": torch.randn(n, generator=gen, dtype=torch.float64),
            "running_mean": 0.2 * torch.randn(n, generator=gen, dtype=torch.float64),
            "running_var": torch.rand(n, generator=gen, dtype=torch.float64) + 0.3}
    g = torch.randn(m, n, generator=gen, dtype=torch.float64)
    return x, w, vecs, g


def whole_forward(x, w, v, scale_after_bn, training):
    """The float64 forward of either problem (what Model computes), differentiable."""
    z = x @ w.t() + v["bias"]
    u = z if scale_after_bn else z * v["scale"]
    if training:
        mean, var = u.mean(dim=0), u.var(dim=0, unbiased=False)
    else:
        mean, var = v["running_mean"], v["running_var"]
    y = v["gamma"] * (u - mean) * torch.rsqrt(var + EPS) + v["beta"]
    return torch.softmax(y * v["scale"], dim=1) if scale_after_bn else y


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("problem", ["33", "84"])
def test_cpu_lowp_backward_glue(problem, mode):
    scale_after_bn, training = problem == "84", mode == "train"
    m, k, n = 19, 13, 11
    x, w, v, g = problem_inputs(m, k, n, seed=3)
    leaves = [x, w, v["bias"], v["scale"], v["gamma"], v["beta"]]
    leaves = [t.clone().requires_grad_(True) for t in leaves]
    named = dict(v, bias=leaves[2], scale=leaves[3], gamma=leaves[4], beta=leaves[5])
    out = whole_forward(leaves[0], leaves[1], named, scale_after_bn, training)
    want = torch.autograd.grad((out * g).sum(), leaves)

    with torch.no_grad():
        z = x @ w.t() + v["bias"]
        u = z if scale_after_bn else z * v["scale"]
        if training:
            coeff = training_coeff(u, v["gamma"], v["beta"])
        else:
            coeff = torch.stack((v["running_mean"], torch.rsqrt(v["running_var"] + EPS), v["gamma"], v["beta"]))
        out_saved = whole_forward(x, w, v, scale_after_bn, training) if scale_after_bn else None

    def bn_backward(g_y, z_, coeff_, scale_, scale_after_bn_):
        return bn_backward_reference(g_y, z_, coeff_, scale_, scale_after_bn_, training)

    got = model_new._LOWP.backward(bn_backward, training, scale_after_bn, g, x, w, v["scale"], z, coeff, out_saved,
                                   (True,) * 6, (torch.float64,) * 6)
    names = ["x", "gemm.weight", "gemm.bias", "scale", "bn.weight", "bn.bias"]
    for name, a, b in zip(names, got, want):
        assert a is not None and a.dtype == torch.float64 and a.shape == b.shape, name
        if training and name == "gemm.bias":
            assert torch.count_nonzero(a) == 0 and b.abs().max() < 1e-12, name
            continue
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


@requires_cuda
@pytest.mark.parametrize("storage", ["16bit", "float32"])
@pytest.mark.parametrize("g_dtype", ["16bit", "float32"])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("problem", ["33", "84"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_gpu_lowp_bn_backward_contract(dtype_name, problem, mode, g_dtype, storage):
    t_dtype = DTYPES[dtype_name]
    s_dtype = t_dtype if storage == "16bit" else torch.float32
    scale_after_bn, training = problem == "84", mode == "train"
    m, n = 257, 264
    gen = torch.Generator().manual_seed(11)
    z = (0.5 + torch.randn(m, n, generator=gen)).to("cuda", t_dtype)
    scale = (torch.rand(n, generator=gen) + 0.5).to("cuda", s_dtype)
    gamma = torch.rand(n, generator=gen) + 0.5
    beta = torch.randn(n, generator=gen)
    g = torch.randn(m, n, generator=gen).to("cuda", t_dtype if g_dtype == "16bit" else torch.float32)
    if training:
        z64, s64 = z.double().cpu(), scale.double().cpu()
        u = z64 if scale_after_bn else (z64 * s64).to(s_dtype).double()  # the kernel's u
        coeff = training_coeff(u, gamma, beta)
    else:
        coeff = torch.stack((0.2 * torch.randn(n, generator=gen).double(),
                             torch.rsqrt(torch.rand(n, generator=gen).double() + 0.3 + EPS),
                             gamma.double(), beta.double()))
    coeff = coeff.to("cuda", torch.float32).contiguous()
    ext = model_new._LOWP.kernels()
    fn = ext.bn_backward_train if training else ext.bn_backward_eval
    # A probe call's outputs filled with NaN and freed; the call below makes the same
    # allocations in the same order and gets those blocks back (asserted), so an element the
    # kernel leaves unwritten stays NaN.
    probe = fn(g, z, coeff, scale, scale_after_bn)
    for t in probe:
        t.fill_(float("nan"))
    poisoned = [t.data_ptr() for t in probe]
    del probe
    got = fn(g, z, coeff, scale, scale_after_bn)
    assert [t.data_ptr() for t in got] == poisoned, "outputs did not reuse the poisoned blocks: the check is vacuous"
    want = bn_backward_reference(g, z, coeff, scale, scale_after_bn, training, t_dtype, s_dtype)
    names = ["dz", "dscale", "dgamma", "dbeta"]
    for name, a, b in zip(names, got, want):
        assert bool(torch.isfinite(a).all()), f"{name}: non-finite (unwritten) elements"
        err = rel_err(a, b)
        if name == "dscale" and training and not scale_after_bn:
            # sum_m du z is 0 in exact arithmetic up to eps (BatchNorm undoes the scale): measured
            # against the size of its terms, sum_m |du z|, instead of itself
            terms = (want[0].abs() * z.double().abs()).sum(dim=0) / scale.double().abs()
            err = ((a.double() - b).norm() / terms.norm()).item()
        bound = 2 * UNIT_ROUNDOFF[t_dtype] if name == "dz" else 1e-4
        print(f"[{dtype_name} {problem} {mode} g {g_dtype} S {storage}] {name}: err {err:.2e} (bound {bound:.1e})")
        assert err <= bound, name
    assert got[0].dtype == t_dtype and all(t.dtype == torch.float32 for t in got[1:])
