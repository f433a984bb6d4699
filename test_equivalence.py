"""Equivalence and accuracy tests: `model_new.ModelNew` against `reference.Model`
(Linear -> * scale -> BatchNorm1d).  Names as in model_new.py: M = batch,
K = in_features, N = out_features.

Run: python -m pytest -q test_equivalence.py -s      (-s shows the measured errors)

CPU tests (always run, also in CI with a CPU-only torch; ModelNew takes the `_cpu_*` functions)
  - seeded-init parity: same seed -> same state_dict keys, order and bits
  - state_dict loads both ways (strict), after training steps
  - forward equivalence, train (4 steps, outputs and running stats after each
    step) and eval, float64 (tight: 1e-10) and float32 (1e-4), momentum 0.1 / 0.3 /
    None (cumulative average); tile tails (M around multiples of 128, odd K, N)
  - non-contiguous inputs, inputs left unmodified
  - bad inputs raise a clear error and leave every buffer unchanged; M == 1 in
    training raises PyTorch's own ValueError text; M == 1 in eval works
  - gradients through the CPU path equal Model's (float64)
  - 3xTF32 arithmetic emulated bit-exactly (cvt.rna.tf32.f32 as integer
    arithmetic; the small part rounded with cvt.rna as for x, or truncated by the
    MMA as for w): split accuracy, 3-term product accuracy vs float64, the bound
    on the dropped small*small term; negative control: 1xTF32 fails the check
  - ptxas: every kernels/*.cu and kernels/lowp/*.cu compiles for sm_90a and sm_80
    with no spills and no stack frame (skipped only when nvcc is not on PATH)

GPU tests (skipped without CUDA)
  - equivalence with float32 Model, train (5 steps) and eval, KernelBench shape
    (1024, 8192, 8192) and odd shapes (tails, K % 4 != 0 -> 4-byte load path)
  - accuracy, train and eval (eval with the running statistics of the data).
    Oracle: reference.Model in float64 on the GPU with the same parameters and
    buffers.  err(t) = ||t - ref||_F / ||ref||_F.  Criterion, as
    in flash-attention's tests: err(ModelNew) <= 2 * err(PyTorch float32 eager),
    both printed; at the KernelBench shape with uniform input ModelNew must be at
    least as accurate as eager float32.  Inputs: uniform, normal, large common
    offset, columns of very different magnitude.
  - negative control: eager Model with TF32 matmuls enabled fails that criterion,
    so the criterion can tell 3xTF32 from plain TF32.
  - momentum 0.3 / None / 0, eps, scale_shape (1,); empty batch in eval
  - every output element written (caching allocator poisoned with NaN), inputs
    unchanged, non-contiguous and misaligned x, no_grad / grad-enabled (same
    output, backward fills every gradient; accuracy of the gradients in
    tests/test_backward.py), current-stream semantics on a side stream, bad
    inputs on CUDA.
"""
import copy
import glob
import math
import os
import re
import shutil
import subprocess

import pytest
import torch

from model_new import ModelNew
from reference import Model

HERE = os.path.dirname(os.path.abspath(__file__))
KERNEL_DIR = os.path.join(HERE, "kernels")

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (ModelNew's kernels)")

# (M, K, N) for the CPU path: tile tails (M vs BLOCK_M = 128), odd K and N.
CPU_SHAPES = [(64, 96, 80), (300, 130, 70), (2, 5, 3), (129, 33, 257)]

KERNELBENCH_SHAPE = (1024, 8192, 8192)


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def rel_err(t, ref):
    """||t - ref||_F / ||ref||_F, computed in float64."""
    t, ref = t.detach().double(), ref.detach().double()
    return ((t - ref).norm() / ref.norm()).item()


def make_pair(seed, *init_args, device="cpu", dtype=torch.float32, **init_kwargs):
    """(Model, ModelNew) built from the same seed, with identical parameters and
    buffers, on `device` in `dtype`.  The state is also copied explicitly so that
    every test but the init-parity one is independent of the random draws."""
    torch.manual_seed(seed)
    ref = Model(*init_args, **init_kwargs)
    torch.manual_seed(seed)
    new = ModelNew(*init_args, **init_kwargs)
    new.load_state_dict(ref.state_dict())
    return ref.to(device=device, dtype=dtype), new.to(device=device, dtype=dtype)


def snapshot(module):
    """Deep copy of the state_dict (parameters and buffers)."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_state_equal(a, b, where=""):
    assert list(a.keys()) == list(b.keys()), where
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{where}: {k} differs"


def assert_close(actual, expected, rtol, atol, where):
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    except AssertionError as e:
        raise AssertionError(f"{where}: {e}") from None


def assert_bn_buffers_close(new, ref, rtol, atol, where):
    for name in ("running_mean", "running_var"):
        assert_close(getattr(new.bn, name), getattr(ref.bn, name), rtol, atol, f"{where}: bn.{name}")
    assert torch.equal(new.bn.num_batches_tracked, ref.bn.num_batches_tracked), f"{where}: bn.num_batches_tracked"


def cpu_input(step, m, k, dtype, gen):
    """Fresh input for training step `step`: normal, uniform + offset, wide normal, uniform."""
    kind = step % 4
    if kind == 0:
        return torch.randn(m, k, generator=gen, dtype=dtype)
    if kind == 1:
        return torch.rand(m, k, generator=gen, dtype=dtype) + 2.0
    if kind == 2:
        return 3.0 * torch.randn(m, k, generator=gen, dtype=dtype)
    return torch.rand(m, k, generator=gen, dtype=dtype)


# Tolerances of the CPU comparison, per dtype: (outputs, running statistics).
CPU_TOL = {
    torch.float64: (dict(rtol=1e-10, atol=1e-10), dict(rtol=1e-10, atol=1e-12)),
    torch.float32: (dict(rtol=1e-4, atol=1e-4), dict(rtol=1e-5, atol=1e-5)),
}


def train_then_eval_compare(ref, new, m, k, dtype, steps, tol_out, tol_buf, seed=0, where=""):
    """`steps` training steps with fresh inputs, comparing outputs and running
    statistics after each; then one eval-mode step."""
    gen = torch.Generator().manual_seed(seed)
    ref.train()
    new.train()
    for step in range(steps):
        x = cpu_input(step, m, k, dtype, gen)
        out_ref, out_new = ref(x), new(x)
        assert out_new.shape == out_ref.shape and out_new.dtype == out_ref.dtype
        assert_close(out_new, out_ref, where=f"{where} train step {step}: output", **tol_out)
        assert_bn_buffers_close(new, ref, where=f"{where} train step {step}", **tol_buf)
    ref.eval()
    new.eval()
    x = cpu_input(steps, m, k, dtype, gen)
    assert_close(new(x), ref(x), where=f"{where} eval: output", **tol_out)
    assert_bn_buffers_close(new, ref, where=f"{where} eval", **tol_buf)


# ---------------------------------------------------------------------------
# CPU: parameters and state
# ---------------------------------------------------------------------------

INIT_ARGS = [
    ((96, 80, (80,)), {}),
    ((33, 257, (1,)), dict(eps=1e-3, momentum=0.3)),
    ((5, 3, (3,)), dict(eps=1e-4, momentum=None)),
]


@pytest.mark.parametrize("seed", [0, 1234])
@pytest.mark.parametrize("args,kwargs", INIT_ARGS, ids=["default", "scale1_eps1e-3_momentum0.3", "eps1e-4_cumulative"])
def test_seeded_init_matches_reference(seed, args, kwargs):
    torch.manual_seed(seed)
    ref = Model(*args, **kwargs)
    next_draw_ref = torch.rand(4)
    torch.manual_seed(seed)
    new = ModelNew(*args, **kwargs)
    next_draw_new = torch.rand(4)
    assert_state_equal(new.state_dict(), ref.state_dict(), "seeded init")
    assert new.bn.eps == ref.bn.eps and new.bn.momentum == ref.bn.momentum
    assert [n for n, _ in new.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert [n for n, _ in new.named_buffers()] == [n for n, _ in ref.named_buffers()]
    # Same number of draws: the global RNG is left in the same state.
    assert torch.equal(next_draw_new, next_draw_ref)


def _train_steps(module, m, k, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    module.train()
    for step in range(steps):
        module(cpu_input(step, m, k, torch.float32, gen))


@pytest.mark.parametrize("direction", ["Model->ModelNew", "ModelNew->Model"])
def test_state_dict_loads_both_ways(direction):
    m, k, n = 64, 96, 80
    torch.manual_seed(0)
    src = Model(k, n, (n,), momentum=0.2) if direction == "Model->ModelNew" else ModelNew(k, n, (n,), momentum=0.2)
    _train_steps(src, m, k, steps=3, seed=1)
    assert int(src.bn.num_batches_tracked) == 3
    assert not torch.equal(src.bn.running_mean, torch.zeros(n))

    torch.manual_seed(99)  # different parameters before loading
    dst = ModelNew(k, n, (n,), momentum=0.2) if direction == "Model->ModelNew" else Model(k, n, (n,), momentum=0.2)
    dst.load_state_dict(src.state_dict(), strict=True)
    assert_state_equal(dst.state_dict(), src.state_dict(), direction)

    src.eval()
    dst.eval()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2))
    assert_close(dst(x), src(x), rtol=1e-5, atol=1e-5, where=f"{direction} eval after load")


# ---------------------------------------------------------------------------
# CPU: forward equivalence
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("momentum", [0.1, 0.3, None], ids=["momentum0.1", "momentum0.3", "cumulative"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("m,k,n", CPU_SHAPES)
def test_cpu_forward_matches_reference(m, k, n, dtype, momentum):
    ref, new = make_pair(0, k, n, (n,), momentum=momentum, dtype=dtype)
    tol_out, tol_buf = CPU_TOL[dtype]
    train_then_eval_compare(ref, new, m, k, dtype, steps=4, tol_out=tol_out, tol_buf=tol_buf,
                            where=f"({m},{k},{n}) {dtype} momentum={momentum}")


@pytest.mark.parametrize("m", [3, 127, 128, 129, 255, 256, 257, 385])
def test_cpu_tile_tails(m):
    """M around multiples of the 128-row statistics tile: the partial last tile
    enters Chan's merge with its own count; odd K and N."""
    k, n = 37, 19
    ref, new = make_pair(3, k, n, (n,), dtype=torch.float64)
    tol_out, tol_buf = CPU_TOL[torch.float64]
    train_then_eval_compare(ref, new, m, k, torch.float64, steps=2, tol_out=tol_out, tol_buf=tol_buf,
                            where=f"M={m}")


@pytest.mark.parametrize("scale_shape", [(1,), (19,)])
@pytest.mark.parametrize("eps", [1e-5, 0.5])
def test_cpu_scale_shape_and_eps(scale_shape, eps):
    m, k, n = 40, 23, 19
    ref, new = make_pair(4, k, n, scale_shape, eps=eps, dtype=torch.float64)
    tol_out, tol_buf = CPU_TOL[torch.float64]
    train_then_eval_compare(ref, new, m, k, torch.float64, steps=3, tol_out=tol_out, tol_buf=tol_buf,
                            where=f"scale_shape={scale_shape} eps={eps}")


def _noncontiguous(x, how):
    m, k = x.shape
    if how == "transposed":  # column-major strides
        return x.t().contiguous().t()
    if how == "strided":  # every other column of a wider tensor
        wide = torch.zeros(m, 2 * k, dtype=x.dtype, device=x.device)
        wide[:, ::2] = x
        return wide[:, ::2]
    if how == "sliced":  # interior window of a larger tensor
        big = torch.zeros(m + 3, k + 5, dtype=x.dtype, device=x.device)
        big[2:2 + m, 3:3 + k] = x
        return big[2:2 + m, 3:3 + k]
    raise ValueError(how)


@pytest.mark.parametrize("how", ["transposed", "strided", "sliced"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_cpu_noncontiguous_input_and_input_unmodified(how, dtype):
    m, k, n = 129, 33, 70
    ref, new = make_pair(5, k, n, (n,), dtype=dtype)
    new_c = copy.deepcopy(new)
    tol_out, tol_buf = CPU_TOL[dtype]
    gen = torch.Generator().manual_seed(6)
    for mode in ("train", "eval"):
        for module in (ref, new, new_c):
            module.train(mode == "train")
        x = _noncontiguous(torch.randn(m, k, generator=gen, dtype=dtype), how)
        assert not x.is_contiguous()
        x_before = x.clone()
        base_before = x._base.clone() if x._base is not None else None
        out_nc = new(x)
        assert torch.equal(x, x_before), "ModelNew modified its input"
        if base_before is not None:
            assert torch.equal(x._base, base_before), "ModelNew modified the input's storage"
        out_c = new_c(x.contiguous())
        assert_close(out_nc, out_c, where=f"{how} {mode}: non-contiguous vs contiguous", **tol_out)
        assert_close(out_nc, ref(x), where=f"{how} {mode}: vs Model", **tol_out)
        assert_bn_buffers_close(new, new_c, where=f"{how} {mode}", **tol_buf)


# ---------------------------------------------------------------------------
# CPU: errors
# ---------------------------------------------------------------------------

BAD_INPUTS = {
    "rank1": lambda m, k: torch.randn(k),
    "rank3": lambda m, k: torch.randn(4, 3, k),
    "features": lambda m, k: torch.randn(m, k + 1),
    "dtype": lambda m, k: torch.randn(m, k, dtype=torch.float64),
}


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("bad", list(BAD_INPUTS))
def test_bad_input_raises_and_leaves_buffers_unchanged(bad, training):
    m, k, n = 8, 96, 80
    ref, new = make_pair(7, k, n, (n,))
    _train_steps(new, 16, k, steps=2, seed=8)  # non-trivial buffers
    new.train(training)
    ref.train(training)
    x = BAD_INPUTS[bad](m, k)
    before = snapshot(new)
    with pytest.raises((RuntimeError, ValueError)) as exc_new:
        new(x)
    assert_state_equal(snapshot(new), before, f"after rejected {bad} input")
    with pytest.raises((RuntimeError, ValueError)):
        ref(x)  # the reference rejects the same input
    msg = str(exc_new.value)
    if bad in ("rank1", "rank3"):
        assert f"(batch, {k})" in msg and str(tuple(x.shape)) in msg, msg
    elif bad == "features":
        assert f"(batch, {k})" in msg and f"{m}x{k + 1}" in msg, msg
    else:
        assert "dtype" in msg and "float64" in msg and "float32" in msg, msg


def test_batch_of_one_in_training_raises_pytorch_error():
    k, n = 96, 80
    ref, new = make_pair(9, k, n, (n,))
    _train_steps(new, 16, k, steps=2, seed=10)
    x = torch.randn(1, k)
    before = snapshot(new)
    with pytest.raises(ValueError) as exc_new:
        new(x)
    with pytest.raises(ValueError) as exc_ref:
        ref(x)
    assert str(exc_new.value) == str(exc_ref.value)
    assert_state_equal(snapshot(new), before, "after rejected batch of 1")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_batch_of_one_in_eval_matches_reference(dtype):
    k, n = 96, 80
    ref, new = make_pair(11, k, n, (n,), dtype=dtype)
    train_then_eval_compare(ref, new, 32, k, dtype, steps=2, tol_out=CPU_TOL[dtype][0], tol_buf=CPU_TOL[dtype][1])
    x = torch.randn(1, k, dtype=dtype)
    out = new(x)
    assert out.shape == (1, n)
    assert_close(out, ref(x), where="eval, batch of 1", **CPU_TOL[dtype][0])


def test_cpu_empty_batch_eval_matches_reference():
    k, n = 9, 7
    ref, new = make_pair(12, k, n, (n,))
    ref.eval()
    new.eval()
    x = torch.randn(0, k)
    assert new(x).shape == ref(x).shape == (0, n)


def test_cpu_empty_batch_train_matches_reference():
    """nn.BatchNorm1d returns an empty (0, N) output for an empty batch in
    training, counts the call in num_batches_tracked and leaves the running
    statistics alone; ModelNew does the same."""
    k, n = 9, 7
    ref, new = make_pair(12, k, n, (n,))
    x = torch.randn(0, k)
    try:
        out_ref = ref(x)
    except (RuntimeError, ValueError) as e:
        pytest.skip(f"this torch's BatchNorm1d rejects an empty batch too: {e}")
    out_new = new(x)
    assert out_new.shape == out_ref.shape == (0, n)
    for key, value in ref.state_dict().items():
        assert torch.equal(new.state_dict()[key], value), key


# ---------------------------------------------------------------------------
# CPU: gradients
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_cpu_gradients_match_reference(training):
    """The CPU path runs the same autograd code as the CUDA path (_TrainFn /
    _eval_with_grad over the _cpu_* functions) and must give Model's gradients
    (more in tests/test_backward.py)."""
    m, k, n = 48, 20, 12
    ref, new = make_pair(13, k, n, (n,), dtype=torch.float64)
    gen = torch.Generator().manual_seed(14)
    if not training:
        train_then_eval_compare(ref, new, m, k, torch.float64, steps=2, tol_out=CPU_TOL[torch.float64][0],
                                tol_buf=CPU_TOL[torch.float64][1])
    ref.train(training)
    new.train(training)
    x = torch.randn(m, k, generator=gen, dtype=torch.float64)
    weights = torch.randn(m, n, generator=gen, dtype=torch.float64)
    x_ref = x.clone().requires_grad_(True)
    x_new = x.clone().requires_grad_(True)
    (ref(x_ref) * weights).sum().backward()
    (new(x_new) * weights).sum().backward()
    assert_close(x_new.grad, x_ref.grad, rtol=1e-8, atol=1e-8, where="grad x")
    params_ref = dict(ref.named_parameters())
    for name, p in new.named_parameters():
        # In training the Linear bias cancels from the output: Model's gradient is
        # rounding noise around 0, ModelNew's is None (bias not in the graph).
        if p.grad is None:
            assert training and name == "gemm.bias", f"{name} has no gradient"
        g_new = p.grad if p.grad is not None else torch.zeros_like(p)
        assert params_ref[name].grad is not None, name
        assert_close(g_new, params_ref[name].grad, rtol=1e-8, atol=1e-8, where=f"grad {name}")


# ---------------------------------------------------------------------------
# CPU: 3xTF32 arithmetic, emulated bit-exactly
# ---------------------------------------------------------------------------


def tf32_round(v):
    """PTX cvt.rna.tf32.f32 for finite float32 v: round to nearest, ties away from
    zero, to 10 explicit mantissa bits.  On the int32 view the sign is a separate
    bit, so adding half an ulp (0x1000) to the magnitude and clearing the low 13
    bits rounds |v| half-up, i.e. v half-away-from-zero; a carry out of the
    mantissa bumps the exponent, as it should."""
    assert v.dtype == torch.float32
    bits = v.contiguous().view(torch.int32)
    return ((bits + 0x1000) & -0x2000).view(torch.float32)


def tf32_truncate(v):
    """What a TF32 MMA reads from a raw fp32 register: the top 19 bits (the low 13
    mantissa bits ignored, i.e. truncation toward zero)."""
    return (v.contiguous().view(torch.int32) & -0x2000).view(torch.float32)


def tf32_split(v, small_rounding="rna"):
    """v = big + small.  big = cvt.rna(v); v - big is exact in fp32 and becomes
    `small` either through cvt.rna ("rna": the x pre-pass) or raw, truncated by
    the MMA ("truncate": the in-register split of w in sm80_gemm_3xtf32_bn.cu)."""
    big = tf32_round(v)
    rest = v - big
    small = tf32_round(rest) if small_rounding == "rna" else tf32_truncate(rest)
    return big, small


# Reconstruction bound |big + small - v| / |v| as the kernel header states it,
# per way of rounding `small`.  Both are loose by 2x / 4x: v - big is a multiple
# of ulp_fp32(v) below 2^-11 |v|, so it has at most 12 significant bits and
# dropping the 12th loses at most 2^-23 |v| either way (asserted below).
SPLIT_BOUND = {"rna": 2.0 ** -22, "truncate": 2.0 ** -21}
SPLIT_BOUND_TIGHT = 2.0 ** -23


def tf32_round_reference(v):
    """The same rounding from its definition, in float64 arithmetic (exact here)."""
    v64 = v.double()
    mant, expo = torch.frexp(v64.abs())  # |v| = mant * 2**expo, mant in [0.5, 1)
    ulp = torch.pow(2.0, (expo - 11).double())  # 11 significant bits
    q = v64.abs() / ulp  # in [1024, 2048), exact
    return torch.sign(v64) * torch.floor(q + 0.5) * ulp


def _wide_range_values(n, seed, max_exp=100):
    """Random finite float32 of both signs with exponents in [-max_exp, max_exp]
    and uniformly random mantissa bits (so exact ties, low bits == 0x1000, occur),
    plus hand-picked ties and TF32-exact values."""
    gen = torch.Generator().manual_seed(seed)
    mant_bits = torch.randint(0, 1 << 23, (n,), generator=gen, dtype=torch.int64)
    exp_field = torch.randint(127 - max_exp, 127 + max_exp + 1, (n,), generator=gen, dtype=torch.int64)
    magnitude = ((exp_field << 23) | mant_bits).to(torch.int32).view(torch.float32)
    sign = 1.0 - 2.0 * (torch.rand(n, generator=gen) < 0.5).float()
    special = torch.tensor([1.0, -1.0, 1 + 2 ** -11, -(1 + 2 ** -11), 1 + 3 * 2 ** -11, 2 - 2 ** -23,
                            -(2 - 2 ** -23), 1 + 2 ** -10, 3.0, 0.1, -0.1, 2.0 ** -100, 2.0 ** 100],
                           dtype=torch.float64).float()
    return torch.cat([magnitude * sign, special])


def test_tf32_round_matches_rna_definition():
    v = _wide_range_values(1 << 20, seed=20)
    big = tf32_round(v)
    assert torch.equal(big.double(), tf32_round_reference(v)), "bit trick != round-half-away definition"
    assert int((big.view(torch.int32) & 0x1FFF).abs().sum()) == 0, "low 13 bits must be zero"
    # Ties go away from zero (round-to-nearest-even would give 1.0 here).
    one_tie = torch.tensor([1 + 2 ** -11, -(1 + 2 ** -11)], dtype=torch.float64).float()
    assert tf32_round(one_tie).double().tolist() == [1 + 2 ** -10, -(1 + 2 ** -10)]
    n_ties = int(((v.view(torch.int32) & 0x1FFF) == 0x1000).sum())
    print(f"\n[tf32] round-half-away bit trick == definition on {v.numel()} values ({n_ties} exact ties)")
    assert n_ties > 10


@pytest.mark.parametrize("small_rounding", ["rna", "truncate"])
def test_tf32_split_reconstruction_bound(small_rounding):
    v = _wide_range_values(1 << 21, seed=21)
    big, small = tf32_split(v, small_rounding)
    rest = v - big
    # v - big is exact in float32 (big is v rounded at mantissa bit 13).
    assert torch.equal(rest.double(), v.double() - big.double())
    assert bool((rest.double().abs() <= 2.0 ** -11 * v.double().abs()).all())
    assert int((small.view(torch.int32) & 0x1FFF).abs().sum()) == 0
    bound = SPLIT_BOUND[small_rounding]
    rel = ((big.double() + small.double() - v.double()).abs() / v.double().abs()).max().item()
    print(f"\n[tf32] split ({small_rounding} small part): max |big + small - v| / |v| = {rel:.3e} "
          f"(stated bound 2^{int(math.log2(bound))}, tight bound 2^-23 = {SPLIT_BOUND_TIGHT:.3e}) over "
          f"{v.numel()} values, exponents in [-100, 100]")
    assert rel <= bound
    assert rel <= SPLIT_BOUND_TIGHT


@pytest.mark.parametrize("b_small_rounding", ["rna", "truncate"])
def test_3xtf32_product_accuracy_and_1xtf32_negative_control(b_small_rounding):
    """A = x-like (small part by cvt.rna), B = w-like (small part by cvt.rna, or
    raw and truncated by the MMA as in the kernel); the three products are
    summed exactly enough (float64) that only the split is measured."""
    m, k, n = 64, 4096, 64
    gen = torch.Generator().manual_seed(22)
    a = torch.randn(m, k, generator=gen)
    b = torch.randn(k, n, generator=gen)
    exact = a.double() @ b.double()
    a_big, a_small = tf32_split(a, "rna")
    b_big, b_small = tf32_split(b, b_small_rounding)
    d = lambda t: t.double()  # noqa: E731
    three = d(a_small) @ d(b_big) + d(a_big) @ d(b_small) + d(a_big) @ d(b_big)
    one = d(a_big) @ d(b_big)
    err3, err1, err_fp32 = rel_err(three, exact), rel_err(one, exact), rel_err(a @ b, exact)
    print(f"\n[tf32] K={k}, w small part {b_small_rounding}: rel. error vs float64: 3xTF32 terms {err3:.3e}, "
          f"1xTF32 {err1:.3e}, CPU float32 matmul {err_fp32:.3e}")
    assert err3 < 1e-6
    assert err1 > 1e-4, "negative control: 1xTF32 must fail the 1e-6 check by a wide margin"


@pytest.mark.parametrize("small_rounding", ["rna", "truncate"])
def test_dropped_small_times_small_term_is_bounded(small_rounding):
    a = _wide_range_values(1 << 20, seed=23, max_exp=40)
    b = _wide_range_values(1 << 20, seed=24, max_exp=40)
    _, a_small = tf32_split(a, "rna")
    _, b_small = tf32_split(b, small_rounding)
    dropped = (a_small.double() * b_small.double()).abs()
    bound = 2.0 ** -22 * (a.double() * b.double()).abs()
    ratio = (dropped / bound).max().item()
    print(f"\n[tf32] max |a_small * b_small| / (2^-22 |a b|) = {ratio:.4f} over {a.numel()} pairs "
          f"(b small part {small_rounding})")
    assert bool((dropped <= bound).all())


# ---------------------------------------------------------------------------
# ptxas resource check (no GPU needed)
# ---------------------------------------------------------------------------

# kernels/*.cu and the 16-bit kernels in kernels/lowp/ (which include kernels/bn_stats.cuh).
CU_FILES = (sorted(glob.glob(os.path.join(KERNEL_DIR, "*.cu"))) +
            sorted(glob.glob(os.path.join(KERNEL_DIR, "lowp", "*.cu"))))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("cu_file", CU_FILES, ids=[os.path.relpath(f, KERNEL_DIR) for f in CU_FILES])
def test_ptxas_no_spills_no_stack(cu_file, tmp_path):
    cmd = [shutil.which("nvcc"), "-c", "-std=c++17", "-O3", "-Xptxas", "-v",
           "-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_80,code=sm_80",
           "-I", KERNEL_DIR, "-I", os.path.dirname(cu_file), "-o", str(tmp_path / "kernel.o"), cu_file]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True)
    log = proc.stdout
    assert proc.returncode == 0, f"nvcc failed:\n{log}"
    entries = re.findall(r"Compiling entry function '(\S+)' for '(sm_\w+)'", log)
    stack = [int(v) for v in re.findall(r"(\d+) bytes stack frame", log)]
    spill_st = [int(v) for v in re.findall(r"(\d+) bytes spill stores", log)]
    spill_ld = [int(v) for v in re.findall(r"(\d+) bytes spill loads", log)]
    regs = re.findall(r"Used (\d+) registers", log)
    print(f"\n[ptxas] {os.path.basename(cu_file)}: {len(entries)} entries, registers {regs}, "
          f"stack {stack}, spill stores {spill_st}, spill loads {spill_ld}")
    assert entries, f"no kernel entries reported:\n{log}"
    assert {arch for _, arch in entries} == {"sm_90a", "sm_80"}
    # One 'Function properties' line per entry (and per non-inlined device function).
    assert min(len(stack), len(spill_st), len(spill_ld)) >= len(entries), log
    assert all(v == 0 for v in spill_st + spill_ld), f"register spills:\n{log}"
    assert all(v == 0 for v in stack), f"non-zero stack frame:\n{log}"


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------

GPU_SHAPES = [KERNELBENCH_SHAPE, (1000, 1000, 1000), (257, 4100, 130), (33, 37, 515), (2, 8, 8),
              (4096, 256, 1000), (64, 8191, 300)]
ACCURACY_SHAPES = [(257, 4100, 130), (1000, 1000, 1000), KERNELBENCH_SHAPE]
INPUT_KINDS = ["uniform", "normal", "offset100", "column_scales"]


_GPU_BASE = {}


def gpu_pair(m, k, n, seed=0, **init_kwargs):
    """Fresh (Model, ModelNew) float32 on cuda, identical parameters; the initial
    pair is built once per configuration and deep-copied."""
    key = (k, n, seed, tuple(sorted(init_kwargs.items())))
    if key not in _GPU_BASE:
        scale_shape = init_kwargs.pop("scale_shape", (n,))
        _GPU_BASE.clear()  # keep at most one large pair resident
        _GPU_BASE[key] = make_pair(seed, k, n, scale_shape, device="cuda", **init_kwargs)
    ref, new = _GPU_BASE[key]
    return copy.deepcopy(ref), copy.deepcopy(new)


def gpu_input(kind, m, k, gen):
    if kind == "uniform":
        return torch.rand(m, k, device="cuda", generator=gen)
    if kind == "normal":
        return torch.randn(m, k, device="cuda", generator=gen)
    if kind == "offset100":
        return torch.rand(m, k, device="cuda", generator=gen) + 100.0
    if kind == "column_scales":
        return torch.randn(m, k, device="cuda", generator=gen) * torch.logspace(-3, 3, k, device="cuda")
    raise ValueError(kind)


def cuda_gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


GPU_TOL = dict(rtol=1e-4, atol=1e-4)

# "default" takes the kernel the device dispatches to (the Hopper wgmma kernel on
# compute capability 9.0, the portable mma.sync kernel elsewhere); "portable"
# forces the portable kernel (FUSED_GEMM_BN_PORTABLE=1), so a Hopper run tests both.
GEMM_PATHS = ["default", "portable"]


@pytest.fixture(params=GEMM_PATHS)
def gemm_path(request, monkeypatch):
    if request.param == "portable":
        monkeypatch.setenv("FUSED_GEMM_BN_PORTABLE", "1")
    else:
        monkeypatch.delenv("FUSED_GEMM_BN_PORTABLE", raising=False)
    return request.param


def gemm_kernel_names(fn):
    """Names of the CUDA kernels fn() launches whose name contains 'gemm'."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if "gemm" in e.name}


@requires_cuda
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_gpu_dispatch_by_compute_capability(mode, gemm_path):
    """sm_90 runs the wgmma kernel unless the portable one is forced; other GPUs
    run the portable kernel."""
    m, k, n = 256, 512, 384
    _, new = gpu_pair(m, k, n)
    new.train(mode == "train")
    x = torch.rand(m, k, device="cuda")
    with torch.no_grad():
        names = gemm_kernel_names(lambda: new(x))
    hopper = torch.cuda.get_device_capability() == (9, 0) and gemm_path == "default"
    expected = "sm90_gemm_3xtf32" if hopper else "sm80_gemm_3xtf32"
    assert any(expected in name for name in names), names
    assert not any(("sm80_gemm" if hopper else "sm90_gemm_3xtf32_bn_kernel") in name for name in names), names


@requires_cuda
@pytest.mark.parametrize("m,k,n", GPU_SHAPES)
def test_gpu_matches_reference_train_and_eval(m, k, n, fp32_matmul, gemm_path):
    ref, new = gpu_pair(m, k, n)
    gen = cuda_gen(30)
    for step in range(5):
        x = gpu_input("uniform" if step % 2 == 0 else "normal", m, k, gen)
        with torch.no_grad():
            out_ref, out_new = ref(x), new(x)
        assert out_new.shape == (m, n) and out_new.dtype == torch.float32 and out_new.is_cuda
        assert_close(out_new, out_ref, where=f"({m},{k},{n}) train step {step}", **GPU_TOL)
        assert_bn_buffers_close(new, ref, where=f"({m},{k},{n}) train step {step}", **GPU_TOL)
    ref.eval()
    new.eval()
    x = gpu_input("uniform", m, k, gen)
    with torch.no_grad():
        assert_close(new(x), ref(x), where=f"({m},{k},{n}) eval", **GPU_TOL)
    assert_bn_buffers_close(new, ref, where=f"({m},{k},{n}) eval", **GPU_TOL)


@requires_cuda
@pytest.mark.parametrize("init_kwargs", [dict(scale_shape=(1,), eps=1e-3, momentum=0.3),
                                         dict(momentum=None), dict(momentum=0.0, eps=0.5)],
                         ids=["scale1_eps1e-3_momentum0.3", "cumulative", "momentum0_eps0.5"])
def test_gpu_momentum_eps_scale_variants(init_kwargs, fp32_matmul):
    m, k, n = 300, 130, 70
    ref, new = gpu_pair(m, k, n, seed=31, **init_kwargs)
    gen = cuda_gen(32)
    for step in range(4):
        x = gpu_input(INPUT_KINDS[step % 2], m, k, gen)
        with torch.no_grad():
            assert_close(new(x), ref(x), where=f"{init_kwargs} train step {step}", **GPU_TOL)
        assert_bn_buffers_close(new, ref, where=f"{init_kwargs} train step {step}", **GPU_TOL)
    ref.eval()
    new.eval()
    x = gpu_input("normal", m, k, gen)
    with torch.no_grad():
        assert_close(new(x), ref(x), where=f"{init_kwargs} eval", **GPU_TOL)


def _accuracy_case(m, k, n, kind, mode, seed):
    """One accuracy case: returns (out ModelNew, out eager float32, out float64
    oracle, the eager float32 Model, x).  Eval mode first trains two steps with
    momentum=None (cumulative average), so the running statistics are those of
    the data, as after long training: the folded eval affine a * z + c then
    cancels as much as it does in use.  All three models hold the same state."""
    ref32, new = gpu_pair(m, k, n)
    gen = cuda_gen(seed)
    if mode == "eval":
        momentum, ref32.bn.momentum = ref32.bn.momentum, None
        with torch.no_grad():
            for _ in range(2):
                ref32(gpu_input(kind, m, k, gen))
        ref32.bn.momentum = momentum
        new.load_state_dict(ref32.state_dict())
        ref32.eval()
        new.eval()
    ref64 = copy.deepcopy(ref32).double()
    x = gpu_input(kind, m, k, gen)
    with torch.no_grad():
        return new(x), ref32(x), ref64(x.double()), ref32, x


@requires_cuda
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("kind", INPUT_KINDS)
@pytest.mark.parametrize("m,k,n", ACCURACY_SHAPES)
def test_gpu_accuracy_vs_float64(m, k, n, kind, mode, fp32_matmul, gemm_path):
    out_new, out_eager, out_64, _, _ = _accuracy_case(m, k, n, kind, mode, seed=40)
    err_new, err_eager = rel_err(out_new, out_64), rel_err(out_eager, out_64)
    print(f"\n[accuracy] {gemm_path:8s} ({m},{k},{n}) {kind:13s} {mode:5s}: err(ModelNew) {err_new:.3e}  "
          f"err(PyTorch fp32) {err_eager:.3e}  ratio {err_new / err_eager:.2f}")
    assert math.isfinite(err_new)
    assert err_new <= 2 * err_eager
    if (m, k, n) == KERNELBENCH_SHAPE and kind == "uniform":
        assert err_new <= err_eager


@requires_cuda
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_gpu_negative_control_plain_tf32_fails_accuracy_check(mode, fp32_matmul):
    m, k, n = KERNELBENCH_SHAPE
    _, out_eager, out_64, ref32, x = _accuracy_case(m, k, n, "uniform", mode, seed=40)
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        with torch.no_grad():
            out_tf32 = ref32(x)  # train mode: the batch statistics do not depend on the running ones
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    err_tf32, err_eager = rel_err(out_tf32, out_64), rel_err(out_eager, out_64)
    print(f"\n[negative control] {mode}: err(PyTorch TF32) {err_tf32:.3e}  err(PyTorch fp32) {err_eager:.3e}  "
          f"ratio {err_tf32 / err_eager:.1f}")
    assert err_tf32 > 2 * err_eager, "plain TF32 passes the accuracy criterion: the criterion cannot tell"


@requires_cuda
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("m,k,n", [KERNELBENCH_SHAPE, (257, 4100, 130), (33, 37, 515)])
def test_gpu_every_output_element_written(m, k, n, mode, gemm_path):
    """ModelNew allocates its output inside the extension, so the caching
    allocator is poisoned: a probe call's output block is filled with NaN and
    freed.  The allocator's state is then what it was before the probe, so the
    next call makes the same allocations in the same order and gets that block
    back (asserted); any element the kernels do not write stays NaN."""
    _, new = gpu_pair(m, k, n)
    new.train(mode == "train")
    probe = copy.deepcopy(new)
    x = gpu_input("uniform", m, k, cuda_gen(50))
    with torch.no_grad():
        poison = probe(x)
        poison.fill_(float("nan"))
        poisoned_ptr = poison.data_ptr()
        del poison
        out = new(x)
    assert out.data_ptr() == poisoned_ptr, "output did not reuse the poisoned block: the check would be vacuous"
    bad = int((~torch.isfinite(out)).sum())
    assert bad == 0, f"{bad} of {out.numel()} output elements not written (NaN left from the poisoned block)"


@requires_cuda
def test_gpu_empty_batch_eval_matches_reference():
    k, n = 37, 515
    ref, new = gpu_pair(0, k, n)
    ref.eval()
    new.eval()
    x = torch.rand(0, k, device="cuda")
    with torch.no_grad():
        out = new(x)
        assert out.shape == ref(x).shape == (0, n)


@requires_cuda
@pytest.mark.parametrize("how", ["strided", "transposed", "misaligned"])
@pytest.mark.parametrize("m,k,n", [(257, 4100, 130), (33, 36, 515)])
def test_gpu_input_unmodified_and_layouts(m, k, n, how):
    ref, new = gpu_pair(m, k, n)
    new_c = copy.deepcopy(new)
    x = gpu_input("normal", m, k, cuda_gen(60))
    if how == "strided":
        wide = torch.zeros(m, 2 * k, device="cuda")
        wide[:, ::2] = x
        x_in = wide[:, ::2]
    elif how == "transposed":
        x_in = x.t().contiguous().t()
    else:  # contiguous, but 4 bytes past a 16-byte boundary: 4-byte cp.async path
        flat = torch.zeros(m * k + 1, device="cuda")
        x_in = flat[1:].view(m, k)
        x_in.copy_(x)
        assert x_in.is_contiguous() and x_in.data_ptr() % 16 != 0
    for mode in ("train", "eval"):
        new.train(mode == "train")
        new_c.train(mode == "train")
        x_before = x_in.clone()
        with torch.no_grad():
            out = new(x_in)
            out_c = new_c(x)
        torch.cuda.synchronize()
        assert torch.equal(x_in, x_before), f"{how} {mode}: input modified"
        assert torch.equal(out, out_c), f"{how} {mode}: differs from the contiguous, aligned input"
        assert_state_equal(snapshot(new), snapshot(new_c), f"{how} {mode}")


@requires_cuda
def test_gpu_no_grad_and_grad_enabled():
    """Under no_grad the output has no graph; with grad enabled the forward
    (forward_train_saved / gemm_nt + fold) gives the no-grad output and a
    backward that fills every gradient.  The gradients' accuracy:
    tests/test_backward.py."""
    m, k, n = 257, 4100, 130
    _, new = gpu_pair(m, k, n)
    x = gpu_input("uniform", m, k, cuda_gen(70))
    for mode in ("eval", "train"):
        new.train(mode == "train")
        state = snapshot(new)
        with torch.no_grad():
            out_ng = new(x)
        assert not out_ng.requires_grad
        new.load_state_dict(state)  # the same running statistics for the grad-enabled call
        x_g = x.clone().requires_grad_(True)
        out = new(x_g)
        assert out.requires_grad
        assert_close(out.detach(), out_ng, rtol=1e-5, atol=1e-5, where=f"{mode}: grad-enabled output")
        new.zero_grad(set_to_none=True)
        out.sum().backward()
        for name, t in [("x", x_g)] + list(new.named_parameters()):
            assert t.grad is not None and bool(torch.isfinite(t.grad).all()), f"{mode}: grad of {name}"


@requires_cuda
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_gpu_runs_on_current_stream(mode, fp32_matmul):
    """The input is written on a side stream right before the call, behind a
    long device-side sleep: a kernel launched on another stream would read it
    too early."""
    m, k, n = 1000, 1000, 1000
    ref, new = gpu_pair(m, k, n)
    ref.train(mode == "train")
    new.train(mode == "train")
    x_src = gpu_input("uniform", m, k, cuda_gen(80))
    x = torch.zeros_like(x_src)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(100_000_000)  # tens of milliseconds of device time
        x.copy_(x_src)
        out = new(x)
    side.synchronize()
    torch.cuda.current_stream().wait_stream(side)
    with torch.no_grad():
        expected = ref(x_src)
    assert_close(out, expected, where=f"{mode} on a side stream", **GPU_TOL)
    assert_bn_buffers_close(new, ref, where=f"{mode} on a side stream", **GPU_TOL)


@requires_cuda
def test_gpu_bad_inputs_raise_and_leave_buffers_unchanged():
    m, k, n = 64, 96, 80
    ref, new = gpu_pair(m, k, n)
    with torch.no_grad():
        new(torch.rand(m, k, device="cuda"))  # non-trivial buffers
    bad_inputs = {
        "batch of 1": torch.rand(1, k, device="cuda"),
        "float64 input, float32 module": torch.rand(m, k, device="cuda", dtype=torch.float64),
        "cpu tensor": torch.rand(m, k),
        "features": torch.rand(m, k + 1, device="cuda"),
        "rank 3": torch.rand(2, m, k, device="cuda"),
    }
    for what, x in bad_inputs.items():
        before = snapshot(new)
        with pytest.raises((RuntimeError, ValueError)) as exc_new:
            new(x)
        torch.cuda.synchronize()
        assert_state_equal(snapshot(new), before, f"after rejected {what}")
        if what == "batch of 1":
            with pytest.raises(ValueError) as exc_ref:
                ref(x)
            assert exc_new.type is ValueError and str(exc_new.value) == str(exc_ref.value)
    new.load_state_dict(ref.state_dict())
    new.eval()
    ref.eval()
    x = torch.rand(1, k, device="cuda")
    with torch.no_grad():
        assert_close(new(x), ref(x), where="eval, batch of 1", **GPU_TOL)
