"""16-bit floats on CUDA (issue 7): ModelNew of both problems in float16 and
bfloat16 (the kernels/lowp/ extension, built on the first 16-bit call) against
Model in the same dtype, and the error left when 16-bit sources are missing.
Names: M = batch, K = in_features, N = out_features; shapes are (M, K, N).

Run: python -m pytest -q tests/test_lowp.py -s      (-s prints the measured errors;
     the GPU tests skip without CUDA: python -m pytest -q -k gpu tests/test_lowp.py)

Both models are built from one seed in float32 (make_pair: scale, bn.weight and
bn.bias drawn away from 1 / 1 / 0) and then moved with .to("cuda", dtype), as
harnesses do.  cuBLAS's reduced-precision split-K reductions are switched off
for the eager references (fixture full_precision_reductions, the 16-bit
counterpart of conftest.py's fp32_matmul): Model then rounds exactly where its
ops say, which is what ModelNew reproduces.

GPU (names contain "gpu"; the main ones run on both 16-bit GEMM kernels, fixture
lowp_kernel: lowp_sm90 on Hopper, any K, and lowp_sm80)
  - test_gpu_lowp_matches_model [dtype, problem, mode, shape]: three calls (train:
    fresh inputs, running statistics compared after each; eval: after three
    settling training calls, with Model's state copied into ModelNew first):
    outputs within atol = rtol = 1e-2 (all but a small fraction: TOL below), running_mean /
    running_var within atol = rtol = 1e-2, num_batches_tracked equal; the
    caller's x and the parameters unchanged; problem 84's rows sum to 1 within
    two units of roundoff.  Shapes: KernelBench (1024, 8192, 8192), (257, 300,
    1000) and (64, 77, 129) (K % 8 != 0: the element-wise load path), (3, 8, 5),
    (130, 1024, 264).
  - test_gpu_lowp_error_vs_float64: oracle Model in float64 holding the same
    (16-bit) parameters, state and input.  err(t) = ||t - ref||_F / ||ref||_F.
    Bound err(ModelNew) <= 1.05 err(Model in the same 16-bit dtype) + 1e-6: both
    round at the same points, so their errors are the same 16-bit roundings
    except where a float32 sum in another order (the GEMM, the statistics) lands
    on the other side of a rounding tie -- a rare event whose effect on a
    Frobenius norm over >= 10^4 elements is far below 5% (a CPU emulation of
    both chains with independent float32-level GEMM differences gave ratios
    within 1 +- 0.002 at these shapes); a chain that rounds once more than Model
    moves the ratio by about 1.14 (negative control below: the Linear output
    rounded before its bias is added fails the bound).
  - test_gpu_lowp_small_m_route: lowp_small_m (a few rows, the project's product reading W once)
    by default on Hopper: path, output, error vs float64 and buffers as above, every
    element written, and with gradients the gradient bound below.
  - test_gpu_lowp_every_output_element_written: the output's memory is poisoned
    (NaN) through the caching allocator; every element is finite afterwards.
  - test_gpu_lowp_grad_enabled: with gradients the forward still equals Model's
    (same criterion) and updates the running statistics once; backward runs;
    every gradient is finite and err(ModelNew's gradient) <= 2 err(Model's
    16-bit gradient) + GRAD_FLOOR[dtype], both against the float64 Model.
    GRAD_FLOOR is 8 units of roundoff of the dtype: each 16-bit gradient is a
    16-bit rounding of a sum, and the GEMM backward runs on 16-bit operands, so
    a correct 16-bit gradient carries a relative error of a few units of
    roundoff; twice Model's error covers gradients that Model itself gets
    badly (problem 33's grad scale is a small difference of large terms).
    gemm.bias in training (exactly 0 in exact arithmetic): max |grad| at most
    2x Model's + 1e-3.
  - test_gpu_lowp_compile_fullgraph_without_grad / _training_step:
    torch.compile(fullgraph=True), calls without gradients and training steps
    with gradients (outputs, buffers and gradients bit-equal to eager's: the
    compiled backward is the backward_16bit operator, the eager node's backward),
    both kernels and dtypes.
  Eval with gradients (`model.bn.eval()` while fine-tuning; lowp_sm90 or lowp_cublas):
  - test_gpu_lowp_eval_grad_fused: as test_gpu_lowp_grad_enabled in eval, on
    the extension's forward_grad (forward_eval_saved, bn_backward_eval), both Hopper
    routes: output as Model's, buffers untouched, gradients within 2x Model's error
    against float64 (+ the floor), the output bit for bit the no-gradient forward's.
  - test_gpu_lowp_compile_fullgraph_eval_with_grad: steps with BatchNorm frozen
    (`model.bn.eval()`, the rest training) under torch.compile(fullgraph=True):
    forward_eval_saved and backward_16bit as operators (no graph break);
    output, buffers and gradients bit-equal to eager's.
  - test_gpu_lowp_jit_trace_eval_with_grad: torch.jit.trace of a 16-bit module
    with BatchNorm frozen records forward_eval_saved; the traced module gives
    eager's output at other batch sizes, and its backward runs.
  - test_gpu_lowp_eval_backward_keeps_forward_statistics: a change of the running
    statistics between an eval forward with gradients and its backward (here a
    training call) leaves the gradients those of the forward that ran (the
    forward's coeff is saved; eager Model refuses the backward instead, its
    saved running statistics having been modified in place).
  - test_gpu_lowp_opcheck: torch.library.opcheck on the operators' 16-bit forms
    (forward_train_saved, forward_eval_saved, backward_16bit in training and eval).
  - test_gpu_lowp_momentum_none, test_gpu_lowp_input_layouts (strided,
    transposed and misaligned x: copied or the element-wise path; x unchanged).
  - test_gpu_lowp_one_number_scale_read_in_place: a (1,) scale (read in place,
    stride 0) and the same value per feature give the same bits, every route.
  - test_gpu_lowp_node_matches_operators: the eager forward with gradients
    (forward_grad, its autograd node and backward in C++) and the operators'
    registered autograd (SWITCHES.eager_ops: model_new_lowp.backward, the
    backward_16bit operator) give the same output, buffers and gradients, bit for bit.
  - test_gpu_lowp_double_backward_raises: create_graph=True through the 16-bit
    node raises RuntimeError (no second derivative), nothing silently dropped.

CPU (CI)
  - test_cpu_bundle_rejects_16bit_cuda_clearly: the bundle (no kernels/lowp/)
    and model_new.py with the folder's absence simulated raise a RuntimeError
    naming kernels/lowp/ and what is supported, from check_input (a 16-bit
    tensor that reports is_cuda); with the folder present model_new.py accepts
    it; mixed dtypes still raise PyTorch's message.
    test_cpu_bundle_module_rejects_before_touching_buffers: the bundle's
    ModelNew on such a tensor raises, every buffer unchanged.
  - test_cpu_lowp_sources_and_extension_name: the 16-bit extension's sources and
    its own hashed name; the bundle embeds none of them.
  - test_cpu_lowp_only_operators_refuse_other_tensors: forward_eval_saved and
    backward_16bit, whose kernels exist only in the 16-bit extension, raise a
    RuntimeError naming what they take for CPU or float32/float64 tensors, with
    nothing built or run.
"""
import copy
import os

import pytest
import torch

import model_new
from tests.harness import BUNDLE, exec_texts, read
from tests.test_backward import PARAM_NAMES, forward_backward, make_pair, rel_err

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (ModelNew's kernels)")
requires_compile_ops = pytest.mark.skipif(
    not torch.cuda.is_available() or not hasattr(torch, "compile") or model_new._OPS is None,
    reason="needs a CUDA GPU, torch.compile and the fused_gemm_bn:: operators (torch >= 2.4)")

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
KERNELBENCH_SHAPE = (1024, 8192, 8192)
# lowp_sm90's grids: 256-row batch tiles where they fill the GPU (KernelBench; (2305, 72, 4100):
# the last batch tile one row deep, an N tail), 128-row tiles with split tiles below (the other
# shapes; K % 8 != 0 padded).  (40, 64, 20000): N > 16384, problem 84's row softmax in shared
# memory instead of registers.  More than 16 batch tiles take the grouped tile order (perf.md v62):
# (4353, 72, 1100) on 256-row tiles (18 batch tiles, the last one row deep; 9 feature tiles, so the
# second group of 8 holds one) and (2200, 64, 136) on 128-row tiles (18 batch tiles, an N tail).
GROUPED_SHAPES = [(4353, 72, 1100), (2200, 64, 136)]
# Training on lowp_cublas takes bn_16bit_strip.cu's forms by rows (N % 8 == 0): (3, 8, 5) none (N % 8),
# (12, 300, 1000) the mid form with a row a slice, (40, 64, 20000) and (100, 520, 1032) the mid form with
# 3 and 7 rows a slice (1032: the last CTA's groups partly outside N), (130, 1024, 264) the sliced form.
SHAPES = [KERNELBENCH_SHAPE, (257, 300, 1000), (64, 77, 129), (3, 8, 5), (130, 1024, 264), (2305, 72, 4100),
          (40, 64, 20000), (12, 300, 1000), (100, 520, 1032)] + GROUPED_SHAPES
ERROR_SHAPES = [KERNELBENCH_SHAPE, (257, 300, 1000), (130, 1024, 264), (2305, 72, 4100)]
GRAD_SHAPES = [(257, 300, 1000), (130, 1024, 264)]
NUM_CALLS = 3

TOL = dict(atol=1e-2, rtol=1e-2)
# Where ModelNew's float32 GEMM sum and cuBLAS's (the same products added in
# another order) straddle a rounding tie of the 16-bit Linear output z, the two
# z differ by one unit in the last place, and problem 33's BatchNorm magnifies
# that by |bn.weight| / std: the output moves by up to
# |w| (ulp(z) / std(z) + ulp(y) / std(y)) (y = rnd(z scale)), which reaches
# about 0.03 (float16) and 0.25 (bfloat16) for the KernelBench shape's features
# whose mean is largest against their spread.  Such ties are rare (a
# float32-level difference against a 16-bit ulp), rarer still for float16:
# bfloat16 has 8x its unit roundoff, so both the chance of a straddled tie and
# its effect are 8x larger.  Hence: at most MAX_OUTSIDE_FRACTION of the
# elements outside TOL, every element within ALL_WITHIN.  Model's own error
# against float64 is made of the same roundings (test_gpu_lowp_error_vs_float64
# bounds ours by it).
MAX_OUTSIDE_FRACTION = {torch.float16: 1e-3, torch.bfloat16: 1e-2}
ALL_WITHIN = {torch.float16: 0.1, torch.bfloat16: 0.5}
UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
ERR_FACTOR, ERR_FLOOR = 1.05, 1e-6
GRAD_FLOOR = {dtype: 8 * u for dtype, u in UNIT_ROUNDOFF.items()}


@pytest.fixture(params=["sm90", "cublas", "sm80"])
def lowp_kernel(request, monkeypatch):
    """Every 16-bit route on a Hopper GPU: lowp_sm90 (the wgmma kernel), lowp_cublas
    (cuBLAS's product, then the chain kernels; SWITCHES.lowp_gemm forces one or the
    other over the shape rule) and lowp_sm80 (SWITCHES.portable, what sm_80-89 GPUs
    run).  Off Hopper only lowp_sm80 exists and the other cases skip."""
    if request.param != "sm80" and torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"lowp_{request.param} is a Hopper route (sm_90)")
    monkeypatch.setattr(model_new, "SWITCHES", model_new.SWITCHES._replace(
        portable=request.param == "sm80", lowp_gemm=request.param if request.param != "sm80" else "auto"))
    return request.param


def expect_lowp_kernel(new, x, lowp_kernel):
    """The path a call without gradients takes is the one the fixture asked for
    (eval with gradients on lowp_sm80's GPUs takes lowp_cublas: forward_eval_saved)."""
    expected = "lowp_" + lowp_kernel
    with torch.no_grad():
        path = new.kernel_path(x)
    assert path.startswith(expected), (path, expected)


_BASE = {}


def lowp_pair(problem, k, n, dtype, seed=3, momentum="default", scale_shape=None):
    """(Model, ModelNew) with identical state, built in float32 on the CPU (once
    per configuration, then deep-copied), then .to("cuda", dtype).  scale_shape:
    make_pair's (None: each problem's KernelBench one)."""
    key = (problem, k, n, seed, momentum, scale_shape)
    if key not in _BASE:
        _BASE.clear()  # keep at most one (possibly KernelBench-sized) pair resident
        _BASE[key] = make_pair(problem, k, n, scale_shape=scale_shape, dtype=torch.float32, device="cpu", seed=seed,
                               momentum=momentum)
    ref, new = (copy.deepcopy(mod) for mod in _BASE[key])
    return ref.to("cuda", dtype), new.to("cuda", dtype)


def lowp_input(step, m, k, dtype, seed=0):
    """Step 0: KernelBench's torch.rand input; then standard normal, then
    uniform on [-0.5, 1.5) (spreads and means that differ, none with a larger
    mean against its spread than torch.rand's)."""
    gen = torch.Generator().manual_seed(1000 + seed * 10 + step)
    if step % 3 == 0:
        x = torch.rand(m, k, generator=gen)
    elif step % 3 == 1:
        x = torch.randn(m, k, generator=gen)
    else:
        x = torch.rand(m, k, generator=gen) * 2 - 0.5
    return x.to("cuda", dtype)


def assert_close_16bit(actual, expected, where):
    """|actual - expected| <= 1e-2 + 1e-2 |expected| for all but
    MAX_OUTSIDE_FRACTION[dtype] of the elements, and every element within
    ALL_WITHIN[dtype] (see above); non-finite elements must match exactly."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, where
    a, b = actual.double(), expected.double()
    assert torch.equal(torch.isfinite(a), torch.isfinite(b)), f"{where}: non-finite elements differ"
    finite = torch.isfinite(b)
    diff = (a - b).abs()[finite]
    outside = int((diff > TOL["atol"] + TOL["rtol"] * b.abs()[finite]).sum())
    worst = diff.max().item() if diff.numel() else 0.0
    print(f"[{where}] max |diff| {worst:.2e}, outside atol=rtol=1e-2: {outside} of {diff.numel()}")
    assert outside <= MAX_OUTSIDE_FRACTION[actual.dtype] * diff.numel(), \
        f"{where}: {outside} elements outside atol=rtol=1e-2"
    assert worst <= ALL_WITHIN[actual.dtype], f"{where}: max |diff| {worst:.3e}"


def assert_buffers_close(new, ref, where):
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(getattr(new.bn, name), getattr(ref.bn, name), msg=f"{where}: bn.{name}", **TOL)
    assert torch.equal(new.bn.num_batches_tracked, ref.bn.num_batches_tracked), f"{where}: num_batches_tracked"


def assert_rows_sum_to_one(out, where):
    sums = out.double().sum(dim=1)
    bound = 2 * UNIT_ROUNDOFF[out.dtype]
    assert (sums - 1).abs().max().item() <= bound, f"{where}: row sums off by {(sums - 1).abs().max().item():.2e}"


def settle(ref, new, m, k, dtype, calls=NUM_CALLS):
    """Training calls on both (no grad), then Model's state copied into ModelNew,
    so that eval compares outputs from one state."""
    ref.train()
    new.train()
    with torch.no_grad():
        for step in range(calls):
            x = lowp_input(step, m, k, dtype, seed=7)
            ref(x)
            new(x)
    new.load_state_dict(ref.state_dict())


def shape_id(shape):
    return "x".join(map(str, shape))


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------


# Parameters listed so that the shape and problem vary slowest (lowp_pair's cache).
@requires_cuda
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("problem", ["33", "84"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_gpu_lowp_matches_model(dtype_name, problem, mode, shape, full_precision_reductions, lowp_kernel):
    dtype = DTYPES[dtype_name]
    m, k, n = shape
    ref, new = lowp_pair(problem, k, n, dtype)
    if mode == "eval":
        settle(ref, new, m, k, dtype)
    ref.train(mode == "train")
    new.train(mode == "train")
    params_before = {name: p.detach().clone() for name, p in new.named_parameters()}
    for step in range(NUM_CALLS):
        x = lowp_input(step, m, k, dtype)
        x_before = x.clone()
        expect_lowp_kernel(new, x, lowp_kernel)
        with torch.no_grad():
            out_ref, out_new = ref(x), new(x)
        where = f"{dtype_name} {problem} {mode} {shape} call {step}"
        assert out_new.dtype == dtype and out_new.shape == (m, n) and out_new.is_contiguous()
        assert_close_16bit(out_new, out_ref, where)
        assert_buffers_close(new, ref, where)
        if problem == "84":
            assert_rows_sum_to_one(out_new, where)
        assert torch.equal(x, x_before), f"{where}: x was modified"
    for name, p in new.named_parameters():
        assert torch.equal(p, params_before[name]), f"{name} was modified"


@requires_cuda
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("problem", ["33", "84"])
@pytest.mark.parametrize("shape", ERROR_SHAPES, ids=shape_id)
def test_gpu_lowp_error_vs_float64(dtype_name, problem, mode, shape, full_precision_reductions, lowp_kernel):
    dtype = DTYPES[dtype_name]
    m, k, n = shape
    ref, new = lowp_pair(problem, k, n, dtype, seed=11)
    if mode == "eval":
        settle(ref, new, m, k, dtype)
    ref64 = copy.deepcopy(ref).double()
    for mod in (ref, new, ref64):
        mod.train(mode == "train")
    x = lowp_input(1, m, k, dtype, seed=11)
    expect_lowp_kernel(new, x, lowp_kernel)
    with torch.no_grad():
        out64 = ref64(x.double())
        err_eager, err_new = rel_err(ref(x), out64), rel_err(new(x), out64)
    print(f"\n[error vs float64] {lowp_kernel} {dtype_name} {problem} {mode} {shape}: eager {err_eager:.3e}, "
          f"ModelNew {err_new:.3e}, ratio {err_new / err_eager:.4f}")
    assert err_new <= ERR_FACTOR * err_eager + ERR_FLOOR


# lowp_small_m (model_new_lowp.SMALL_M_ROWS; lowp/small_m_16bit.cu): (2, 8192, 8192) one K piece a CTA;
# (7, 2048, 1500) and (8, 4104, 1300) K split into pieces (the finish kernel; a partial last stage; N a
# tail of the 32-feature blocks); (1, 1024, 10000) eval only (training needs 2 rows); (16, 4096, 8192)
# and (13, 8200, 2080) the 16-row CTA, in one K piece and split; (17, 4096, 8192) and (32, 2048, 8192) the
# 32-row CTA of 64 features (N / 64 CTAs fill the SMs), (24, 1024, 4096) and (29, 8200, 2080) the 32-row
# CTA of 32 features, in one K piece and split (one pair of rows and sixteen in the BatchNorm's sums:
# bn_16bit_strip.cuh's feature_stats).  Each output has at least 10^4
# elements, which the error ratio's bound needs (test_gpu_lowp_error_vs_float64); the split shape at
# 13 rows has 2.7 10^4: at 13 x 4104 x 1300 (1.7 10^4) one draw of problem 84's float16 training
# measured 1.064x eager's error (9.56e-4 against 8.98e-4), the bound's noise where z differs from
# eager's in the last bit of a few % of its elements and BatchNorm over 13 rows carries each such
# difference into a whole column (docs/perf.md v102).
SMALL_M_SHAPES = [(2, 8192, 8192), (7, 2048, 1500), (8, 4104, 1300), (1, 1024, 10000), (16, 4096, 8192),
                  (13, 8200, 2080), (17, 4096, 8192), (32, 2048, 8192), (24, 1024, 4096), (29, 8200, 2080)]


@requires_cuda
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("problem", ["33", "84"])
@pytest.mark.parametrize("shape", SMALL_M_SHAPES, ids=shape_id)
def test_gpu_lowp_small_m_route(shape, problem, mode, dtype_name, grad, full_precision_reductions):
    """lowp_small_m, the default Hopper route of batches of at most SMALL_M_ROWS rows: the path
    taken; the output within the 16-bit tolerance of Model's and its error against float64 within
    ERR_FACTOR of Model's; the running statistics as Model's; without gradients every output
    element written (the output's block poisoned, as test_gpu_lowp_every_output_element_written);
    with gradients every gradient within 2x Model's error of float64 (+ the floor).  With
    gradients problem 84 takes a per-feature scale, as test_backward.py's compiled 16-bit step
    does: the gradient of a one-number scale is a sum of M N terms that cancels, so its error is
    a draw of the forward's 16-bit roundings (perf.md v75, v76), and this route's z differs from
    eager's in the last bit of 2-5% of the elements (the float32 sums' order): one draw measured
    8.3x eager's error (7 x 2048 x 1500, bfloat16, eval) where the two are equally accurate."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("lowp_small_m is a Hopper route (sm_90)")
    m, k, n = shape
    if mode == "train" and m < 2:
        pytest.skip("training needs 2 rows (nn.BatchNorm1d)")
    dtype = DTYPES[dtype_name]
    ref, new = lowp_pair(problem, k, n, dtype, seed=13, scale_shape=(n,) if grad else None)
    if mode == "eval":
        settle(ref, new, 16, k, dtype)
    ref64 = copy.deepcopy(ref).double()
    for mod in (ref, new, ref64):
        mod.train(mode == "train")
    x = lowp_input(1, m, k, dtype, seed=13)
    where = f"lowp_small_m {dtype_name} {problem} {mode} {shape_id(shape)}" + (" with grad" if grad else "")
    if grad:
        assert new.kernel_path(x.detach().requires_grad_(True)) == f"lowp_small_m_{mode}_grad"
        g = torch.randn(m, n, generator=torch.Generator().manual_seed(81)).to("cuda", dtype)
        out_ref, grads_ref = forward_backward(ref, x, g)
        out_new, grads_new = forward_backward(new, x, g)
        out64, grads64 = forward_backward(ref64, x.double(), g.double())
        assert_grads_within(grads_new, grads_ref, grads64, dtype, dtype, mode == "train", where)
    else:
        with torch.no_grad():
            assert new.kernel_path(x) == f"lowp_small_m_{mode}"
            out_ref, out64 = ref(x), ref64(x.double())
            probe = copy.deepcopy(new)
            poison = probe(x)
            poison.fill_(float("nan"))
            poisoned_ptr = poison.data_ptr()
            del poison
            out_new = new(x)
        assert out_new.data_ptr() == poisoned_ptr, "output did not reuse the poisoned block"
        assert bool(torch.isfinite(out_new).all()), f"{where}: output elements not written"
    assert_close_16bit(out_new, out_ref, where)
    assert_buffers_close(new, ref, where)
    err_eager, err_new = rel_err(out_ref, out64), rel_err(out_new, out64)
    print(f"[{where}] error vs float64: eager {err_eager:.3e}, ModelNew {err_new:.3e}")
    assert err_new <= ERR_FACTOR * err_eager + ERR_FLOOR, where


@requires_cuda
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_gpu_lowp_error_criterion_negative_control(dtype_name, full_precision_reductions):
    """The bound of test_gpu_lowp_error_vs_float64 can tell a chain that rounds
    once more than Model: Model with the Linear output rounded before its bias
    is added (x W^T, then + b as a second 16-bit op) fails it."""
    dtype = DTYPES[dtype_name]
    m, k, n = 257, 300, 1000
    ref, _ = lowp_pair("33", k, n, dtype, seed=11)
    ref64 = copy.deepcopy(ref).double()
    x = lowp_input(1, m, k, dtype, seed=11)
    with torch.no_grad():
        out64 = ref64(x.double())
        err_eager = rel_err(ref(x), out64)
        w, b = ref.gemm.weight, ref.gemm.bias
        z = (x @ w.t()) + b  # two roundings where F.linear has one
        y = z * ref.scale
        mean, var = y.float().mean(0), y.float().var(0, unbiased=False)
        out = ((ref.bn.weight.float() * (y.float() - mean)) * torch.rsqrt(var + ref.bn.eps) +
               ref.bn.bias.float()).to(dtype)
        err_bad = rel_err(out, out64)
    print(f"\n[negative control] {dtype_name}: eager {err_eager:.3e}, extra rounding {err_bad:.3e}")
    assert err_bad > ERR_FACTOR * err_eager + ERR_FLOOR


@requires_cuda
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("problem", ["33", "84"])
@pytest.mark.parametrize("shape", [KERNELBENCH_SHAPE, (257, 300, 1000), (3, 8, 5), (100, 520, 1032)] + GROUPED_SHAPES,
                         ids=shape_id)
def test_gpu_lowp_every_output_element_written(shape, dtype_name, problem, mode, lowp_kernel):
    """As test_equivalence.py's float32 check: a probe call's output block is
    filled with NaN and freed; the next call makes the same allocations in the
    same order and gets that block back (asserted), so an element the kernels
    leave unwritten stays NaN."""
    dtype = DTYPES[dtype_name]
    m, k, n = shape
    _, new = lowp_pair(problem, k, n, dtype)
    new.train(mode == "train")
    probe = copy.deepcopy(new)
    x = lowp_input(0, m, k, dtype)
    with torch.no_grad():
        poison = probe(x)
        poison.fill_(float("nan"))
        poisoned_ptr = poison.data_ptr()
        del poison
        out = new(x)
    assert out.data_ptr() == poisoned_ptr, "output did not reuse the poisoned block: the check would be vacuous"
    bad = int((~torch.isfinite(out)).sum())
    assert bad == 0, f"{bad} of {out.numel()} output elements not written (NaN left from the poisoned block)"
    for name, b in new.named_buffers():
        assert bool(torch.isfinite(b.double()).all()), f"{name} not finite"


@requires_cuda
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("problem", ["33", "84"])
@pytest.mark.parametrize("shape", GRAD_SHAPES, ids=shape_id)
def test_gpu_lowp_grad_enabled(dtype_name, problem, mode, shape, full_precision_reductions, lowp_kernel):
    dtype = DTYPES[dtype_name]
    m, k, n = shape
    ref, new = lowp_pair(problem, k, n, dtype, seed=5)
    if mode == "eval":
        settle(ref, new, m, k, dtype)
    ref64 = copy.deepcopy(ref).double()
    for mod in (ref, new, ref64):
        mod.train(mode == "train")
    x = lowp_input(2, m, k, dtype, seed=5)
    gen = torch.Generator().manual_seed(77)
    g = torch.randn(m, n, generator=gen).to("cuda", dtype)
    out_ref, grads_ref = forward_backward(ref, x, g)
    out_new, grads_new = forward_backward(new, x, g)
    _, grads64 = forward_backward(ref64, x.double(), g.double())
    where = f"{dtype_name} {problem} {mode} {shape} with grad"
    assert_close_16bit(out_new, out_ref, where)
    assert_buffers_close(new, ref, where)  # updated once, as Model's
    assert_grads_within(grads_new, grads_ref, grads64, dtype, dtype, mode == "train", where)


def assert_grads_within(grads_new, grads_ref, grads64, grad_dtype, compute_dtype, training, where):
    """Every gradient of x and the parameters: present, of grad_dtype, finite, and
    err(ModelNew) <= 2 err(Model) + GRAD_FLOOR[compute_dtype] against the float64
    Model; in training gemm.bias's (exactly 0 in exact arithmetic) instead at most
    2x Model's max |grad| + 1e-3."""
    for name in ["x"] + PARAM_NAMES:
        got, eager, want = grads_new[name], grads_ref[name], grads64[name]
        assert got is not None and got.dtype == grad_dtype and got.shape == want.shape, name
        assert bool(torch.isfinite(got).all()), f"{name}: non-finite gradient"
        if training and name == "gemm.bias":
            bound = 2 * eager.abs().max().item() + 1e-3
            print(f"[{where}] grad gemm.bias max |.|: ModelNew {got.abs().max().item():.2e}, "
                  f"Model {eager.abs().max().item():.2e}")
            assert got.abs().max().item() <= bound
            continue
        err_new, err_eager = rel_err(got, want), rel_err(eager, want)
        print(f"[{where}] grad {name}: err ModelNew {err_new:.2e}, Model {err_eager:.2e}")
        assert err_new <= 2 * err_eager + GRAD_FLOOR[compute_dtype], name


@requires_cuda
@pytest.mark.parametrize("route", ["sm90", "cublas"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("problem", ["33", "84"])
@pytest.mark.parametrize("shape", GRAD_SHAPES + [KERNELBENCH_SHAPE], ids=shape_id)
def test_gpu_lowp_eval_grad_fused(dtype_name, problem, shape, route, full_precision_reductions, monkeypatch):
    """16-bit eval with gradients (forward_eval_saved) on each Hopper route, forced by
    SWITCHES.lowp_gemm: output within the 16-bit tolerance of eager's, gradients within eager's error
    of float64, buffers untouched; and the output bit for bit the no-gradient forward's on the same
    route (lowp_sm90: the kEvalSaved epilogue, which also stores z and coeff, against kEval's;
    lowp_cublas, problem 84: one row-softmax pass reading z, kept, against the pass in place over z;
    problem 33: the chain kernel into out or over z)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"lowp_{route} is a Hopper route (sm_90)")
    monkeypatch.setattr(model_new, "SWITCHES", model_new.SWITCHES._replace(lowp_gemm=route))
    dtype = DTYPES[dtype_name]
    m, k, n = shape
    ref, new = lowp_pair(problem, k, n, dtype, seed=5)
    settle(ref, new, m, k, dtype)
    ref64 = copy.deepcopy(ref).double()
    for mod in (ref, new, ref64):
        mod.eval()
    x = lowp_input(2, m, k, dtype, seed=5)
    assert new.kernel_path(x.requires_grad_(True)) == f"lowp_{route}_eval_grad"
    gen = torch.Generator().manual_seed(77)
    g = torch.randn(m, n, generator=gen).to("cuda", dtype)
    before = {name: b.clone() for name, b in new.named_buffers()}
    out_ref, grads_ref = forward_backward(ref, x, g)
    out_new, grads_new = forward_backward(new, x, g)
    _, grads64 = forward_backward(ref64, x.double(), g.double())
    where = f"{dtype_name} {problem} eval {shape} fused with grad"
    assert_close_16bit(out_new, out_ref, where)
    for name, b in new.named_buffers():
        assert torch.equal(b, before[name]), name
    assert_grads_within(grads_new, grads_ref, grads64, dtype, dtype, False, where)
    with torch.no_grad():
        assert new.kernel_path(x) == f"lowp_{route}_eval"
        assert torch.equal(new(x), out_new), f"{where}: the no-gradient forward's output differs"


@requires_compile_ops
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("problem", ["33", "84"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_gpu_lowp_node_matches_operators(dtype_name, problem, mode, lowp_kernel, monkeypatch):
    """The two implementations of the 16-bit backward, the eager node's (C++,
    binding_16bit.cpp's backward_grads) and the operators' (model_new_lowp.backward,
    which torch.compile records), run the same kernels and products in the same
    order: the same output, running statistics and gradients, bit for bit."""
    dtype = DTYPES[dtype_name]
    m, k, n = 257, 300, 1000
    _, new = lowp_pair(problem, k, n, dtype, seed=11)
    new.train(mode == "train")
    twin = copy.deepcopy(new)
    x = lowp_input(1, m, k, dtype, seed=11)
    g = torch.randn(m, n, generator=torch.Generator().manual_seed(79)).to("cuda", dtype)
    with torch.no_grad():
        assert new.kernel_path(x).startswith("lowp_" + lowp_kernel)
    out_node, grads_node = forward_backward(new, x, g)
    monkeypatch.setattr(model_new, "SWITCHES", model_new.SWITCHES._replace(eager_ops=True))
    out_ops, grads_ops = forward_backward(twin, x, g)
    where = f"{dtype_name} {problem} {mode} on lowp_{lowp_kernel}"
    assert torch.equal(out_node, out_ops), where
    for name, got in grads_node.items():
        want = grads_ops[name]
        assert (got is None) == (want is None), f"{where}: grad {name}"
        assert got is None or (got.dtype == want.dtype and torch.equal(got, want)), f"{where}: grad {name}"
    for (name, b_node), b_ops in zip(new.named_buffers(), twin.buffers()):
        assert torch.equal(b_node, b_ops), f"{where}: {name}"


@requires_cuda
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_gpu_lowp_double_backward_raises(mode):
    """The 16-bit node has no second derivative: create_graph=True raises a
    RuntimeError naming it, where a gradient penalty would otherwise lose its
    term silently."""
    _, new = lowp_pair("84", 64, 40, torch.float16)
    new.train(mode == "train")
    x = lowp_input(1, 32, 64, torch.float16).requires_grad_(True)
    out = new(x)
    with pytest.raises(RuntimeError, match="cannot be differentiated again"):
        torch.autograd.grad(out.float().square().sum(), x, create_graph=True)


@requires_cuda
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_gpu_lowp_one_number_scale_reaches_node(mode):
    """Problem 84's scale of shape (1,) reaches the 16-bit node itself: the node's edge for it is the
    scale's AccumulateGrad, with no expand view between (a view of a tensor that requires gradients
    records a node: 5-10 us of host time per call, docs/perf.md v47).  Its gradient keeps shape (1,)."""
    _, new = lowp_pair("84", 64, 40, torch.float16)
    new.train(mode == "train")
    assert new.scale.shape == (1,)
    out = new(lowp_input(1, 32, 64, torch.float16))
    leaves = [fn.variable for fn, _ in out.grad_fn.next_functions if fn is not None and hasattr(fn, "variable")]
    assert any(v is new.scale for v in leaves), out.grad_fn.next_functions
    out.float().square().sum().backward()
    assert new.scale.grad.shape == (1,) and torch.isfinite(new.scale.grad).all()


# Shapes of the one-number scale test: 1024 rows take the walking row softmax (problem 84) and, on
# lowp_cublas in training, bn_16bit_strip.cu; 130 rows the reg softmax and the chain kernels.
ONE_SCALE_SHAPES = [(1024, 256, 520), (130, 1024, 264)]


@requires_cuda
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("how", ["16bit", "autocast"])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("problem", ["33", "84"])
@pytest.mark.parametrize("shape", ONE_SCALE_SHAPES, ids=shape_id)
def test_gpu_lowp_one_number_scale_read_in_place(shape, problem, mode, how, grad, lowp_kernel):
    """A one-number scale, shape (1,), which the 16-bit kernels read in place
    (LowpBatchNormArgs.scale_stride 0), gives bit for bit the output, running
    statistics and gradients of the same value given per feature, shape (N,)
    (stride 1); the scale's own gradient is the sum of the per-feature one's, up to
    their own rounding (it is the float64 sum of the unrounded terms, rounded once:
    kernels/scale_terms.cuh; each per-feature gradient is rounded to the scale's dtype).
    Every 16-bit route, 16-bit modules and a float32 module under autocast,
    forward with and without gradients.  Autocast takes the fused kernels on
    lowp_sm90 alone, and not in eval with gradients (Model's ops run those)."""
    if how == "autocast" and (lowp_kernel != "sm90" or (grad and mode == "eval")):
        pytest.skip("autocast runs the 16-bit kernels on lowp_sm90, without gradients or in training")
    dtype = torch.float16 if how == "autocast" else torch.bfloat16
    m, k, n = shape
    _, one = make_pair(problem, k, n, scale_shape=(1,), dtype=torch.float32, seed=9)
    per_feature = copy.deepcopy(one)
    per_feature.scale = torch.nn.Parameter(one.scale.detach().expand(n).clone())
    module_dtype = torch.float32 if how == "autocast" else dtype
    one, per_feature = (mod.to("cuda", module_dtype).train(mode == "train") for mod in (one, per_feature))
    x = lowp_input(1, m, k, module_dtype, seed=9)
    gen = torch.Generator().manual_seed(78)
    g = torch.randn(m, n, generator=gen).to("cuda", module_dtype)
    results = []
    for mod in (one, per_feature):
        with torch.autocast("cuda", dtype=dtype, enabled=how == "autocast"), torch.set_grad_enabled(grad):
            path = mod.kernel_path(x)
            if grad:
                out, grads = forward_backward(mod, x, g)
            else:
                with torch.no_grad():
                    out, grads = mod(x), {}
        results.append((path, out, grads, [b.clone() for b in mod.buffers()]))
    (path_1, out_1, grads_1, buffers_1), (path_n, out_n, grads_n, buffers_n) = results
    where = f"{problem} {mode} {how} {shape} grad={grad} ({path_1})"
    assert path_1 == path_n and "lowp" in path_1, (path_1, path_n)
    if how == "16bit":  # (eval with gradients on lowp_sm80's GPUs: lowp_cublas)
        expected = "cublas" if grad and mode == "eval" and lowp_kernel == "sm80" else lowp_kernel
        assert path_1.startswith("lowp_" + expected), where
    assert torch.equal(out_1, out_n), where
    for b1, bn in zip(buffers_1, buffers_n):
        assert torch.equal(b1, bn), where
    for name, got in grads_1.items():
        want = grads_n[name]
        if name == "scale":  # the float64 sum of the terms rounded once; want's terms each rounded
            u = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}[want.dtype]
            total, size = want.double().sum(), want.double().abs().sum()
            assert got.shape == (1,) and got.dtype == want.dtype, where
            assert abs(got.double().item() - total.item()) <= u * (abs(got.double().item()) + size.item()), where
        else:
            assert got is not None and torch.equal(got, want), f"{where}: grad {name}"


@requires_cuda
@pytest.mark.parametrize("problem", ["33", "84"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_gpu_lowp_momentum_none(dtype_name, problem, full_precision_reductions, lowp_kernel):
    """momentum=None: the cumulative average with factor 1 / num_batches_tracked,
    num_batches_tracked incremented once per call before it is used (on
    lowp_cublas the binding adds 1 before bn_16bit_strip.cu's kernel reads it)."""
    dtype = DTYPES[dtype_name]
    m, k, n = 257, 300, 1000
    ref, new = lowp_pair(problem, k, n, dtype, momentum=None)
    assert ref.bn.momentum is None and new.bn.momentum is None
    for step in range(4):
        x = lowp_input(step, m, k, dtype, seed=3)
        with torch.no_grad():
            out_ref, out_new = ref(x), new(x)
        assert_close_16bit(out_new, out_ref, f"momentum None call {step}")
        assert_buffers_close(new, ref, f"momentum None call {step}")
    expect_lowp_kernel(new, x, lowp_kernel)
    assert int(new.bn.num_batches_tracked) == 4


@requires_cuda
@pytest.mark.parametrize("how", ["strided", "transposed", "misaligned"])
@pytest.mark.parametrize("problem", ["33", "84"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_gpu_lowp_input_layouts(dtype_name, problem, how, full_precision_reductions, lowp_kernel):
    dtype = DTYPES[dtype_name]
    m, k, n = 130, 264, 200
    ref, new = lowp_pair(problem, k, n, dtype)
    x = lowp_input(0, m, k, dtype)
    if how == "strided":
        wide = torch.zeros(m, 2 * k, device="cuda", dtype=dtype)
        wide[:, ::2] = x
        x_in = wide[:, ::2]
    elif how == "transposed":
        x_in = x.t().contiguous().t()
    else:  # contiguous, 2 bytes past a 16-byte boundary: the element-wise load path
        flat = torch.zeros(m * k + 1, device="cuda", dtype=dtype)
        flat[1:] = x.reshape(-1)
        x_in = flat[1:].view(m, k)
    before = x_in.clone()
    with torch.no_grad():
        out_ref, out_new = ref(x), new(x_in)
    assert_close_16bit(out_new, out_ref, f"{how} x")
    assert_buffers_close(new, ref, f"{how} x")
    assert torch.equal(x_in, before), "x was modified"


# ---------------------------------------------------------------------------
# CPU (CI)
# ---------------------------------------------------------------------------


class _ReportsCuda(torch.Tensor):
    """A CPU tensor that answers is_cuda = True: check_input's CUDA branch without a GPU."""

    @property
    def is_cuda(self):
        return True


def _fake_cuda_16bit(m, k, dtype):
    return torch.rand(m, k).to(dtype).as_subclass(_ReportsCuda)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_cpu_bundle_rejects_16bit_cuda_clearly(dtype_name, monkeypatch):
    dtype = DTYPES[dtype_name]
    weight = torch.rand(6, 8).to(dtype)
    x = _fake_cuda_16bit(4, 8, dtype)
    assert x.is_cuda and x.dtype == dtype

    ns = exec_texts(read(BUNDLE))
    assert ns["_LOWP"] is None, "the bundle cannot have the 16-bit kernels"
    with pytest.raises(RuntimeError) as exc:
        ns["check_input"](x, weight, True)
    message = str(exc.value)
    for part in ("16-bit CUDA input", "model_new_lowp.py", "kernels/lowp/", "float32 on CUDA", "float64 on CUDA",
                 "CPU"):
        assert part in message, (part, message)
    assert ns["_cuda_dtype_problem"](torch.float32) is None
    assert ns["_cuda_dtype_problem"](torch.float64) is None

    # model_new.py from the repository finds kernels/lowp/ and accepts the input ...
    lowp = model_new.extra("model_new_lowp")
    assert set(lowp.sources()) >= set(os.listdir(os.path.join(os.path.dirname(model_new.__file__), "kernels", "lowp")))
    model_new.check_input(x, weight, True)
    # ... and names the missing file where the folder is missing.
    monkeypatch.setattr(lowp, "_SOURCES", None)
    with pytest.raises(RuntimeError, match="kernels/lowp/") as exc:
        model_new.check_input(x, weight, True)
    assert os.path.join("kernels", "lowp", "binding_16bit.cpp") + " is missing" in str(exc.value)
    assert "self-contained" not in str(exc.value)
    # Mixed dtypes still raise PyTorch's message first; other dtypes name what is supported.
    with pytest.raises(RuntimeError, match="must have the same dtype"):
        model_new.check_input(x, weight.float(), True)
    assert "supports float32" in model_new._cuda_dtype_problem(torch.int32)


def test_cpu_bundle_module_rejects_before_touching_buffers():
    """The bundle's ModelNew on a 16-bit input that reports CUDA: the error comes
    from the input checks, so no buffer changes (a rejected call is harmless)."""
    ns = exec_texts(read(BUNDLE))
    model = ns["ModelNew"](8, 6, (6,)).to(torch.float16)
    before = {name: b.clone() for name, b in model.named_buffers()}
    with pytest.raises(RuntimeError, match="kernels/lowp/"):
        model(_fake_cuda_16bit(4, 8, torch.float16))
    for name, b in model.named_buffers():
        assert torch.equal(b, before[name]), name


def test_cpu_lowp_sources_and_extension_name(tmp_path):
    sources = model_new._LOWP.sources()
    assert {"binding_16bit.cpp", "sm80_gemm_bn_16bit.cu", "sm90_gemm_bn_16bit.cu", "bn_16bit.cu", "lowp_types.cuh",
            "bn_16bit_chain.cu", "bn_16bit_strip.cu", "lowp_chain.cuh", "lowp_coeff.cuh", "sm90_wgmma_16bit.cuh", "bn_stats.cuh", "launchers.cuh", "sm90_gemm_tiles.cuh",
            "sm90_primitives.cuh", "cp_async.cuh"} <= set(sources)  # headers included through other headers too
    assert not any(name.endswith((".cu", ".cpp")) and name in model_new._KERNEL_SOURCES for name in sources), \
        "the 16-bit extension must not compile the float32 sources again"
    flags = ["-O3", "-gencode=arch=compute_90a,code=sm_90a"]
    name = model_new._extension_name(sources, flags, model_new._LOWP.PREFIX)
    assert name.startswith("fused_gemm_bn_lowp_") and name != model_new._extension_name(model_new._KERNEL_SOURCES,
                                                                                         flags)
    changed = dict(sources, **{"bn_16bit.cu": sources["bn_16bit.cu"] + " "})
    assert model_new._extension_name(changed, flags, model_new._LOWP.PREFIX) != name
    model_new._write_headers(str(tmp_path), sources)
    assert sorted(os.listdir(tmp_path)) == ["binding_checks.cuh", "block_reduce.cuh", "bn_16bit_strip.cuh", "bn_stats.cuh",
                                            "cp_async.cuh", "device_facts.cuh", "heuristics_sm90.cuh", "launchers.cuh",
                                            "lowp_chain.cuh", "lowp_coeff.cuh", "lowp_mma.cuh", "lowp_types.cuh", "pdl.cuh",
                                            "row_divisor.cuh", "scale_terms.cuh", "sm90_gemm_tiles.cuh", "sm90_primitives.cuh",
                                            "sm90_wgmma_16bit.cuh", "softmax_backward.cuh", "tensor_map.cuh"]
    embedded = exec_texts(read(BUNDLE))["_KERNEL_SOURCES"]
    assert not set(embedded) & {"binding_16bit.cpp", "sm80_gemm_bn_16bit.cu", "bn_16bit.cu", "lowp_types.cuh"}


@pytest.mark.skipif(model_new._OPS is None, reason="needs the fused_gemm_bn:: operators (torch >= 2.4)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64], ids=str)
def test_cpu_lowp_only_operators_refuse_other_tensors(dtype):
    m, k, n = 6, 5, 4
    x, weight = torch.rand(m, k, dtype=dtype), torch.rand(n, k, dtype=dtype)
    vecs = [torch.rand(n, dtype=dtype) + 0.5 for _ in range(6)]
    built = model_new._LOWP._ext
    with pytest.raises(RuntimeError, match="forward_eval_saved takes 16-bit CUDA tensors"):
        model_new._OPS.forward_eval_saved(x, weight, *vecs, 1e-5, False)
    z, coeff = torch.rand(m, n, dtype=dtype), torch.rand(4, n)
    with pytest.raises(RuntimeError, match="backward_16bit takes 16-bit CUDA tensors"):
        model_new._OPS.backward_16bit(False, True, torch.rand(m, n, dtype=dtype), x, weight, vecs[0], z, coeff,
                                      torch.rand(m, n, dtype=dtype), [True] * 6)
    assert model_new._LOWP._ext is built, "the refusal must come before any build"


@requires_compile_ops
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("problem", ["33", "84"])
def test_gpu_lowp_compile_fullgraph_without_grad(dtype_name, problem, lowp_kernel):
    """torch.compile(fullgraph=True) of a 16-bit ModelNew called without
    gradients: the fused_gemm_bn:: operators run the 16-bit kernels (no graph
    break), training and eval, with outputs and buffers bit-equal to eager
    ModelNew's over several calls."""
    # Every compiled ModelNew shares FusedModule.forward's code object: start from
    # an empty dynamo cache, so earlier tests' entries cannot reach the recompile
    # limit (past it dynamo runs the frame eagerly, which would hide the check).
    torch._dynamo.reset()
    dtype = DTYPES[dtype_name]
    m, k, n = 130, 1024, 264
    _, new = lowp_pair(problem, k, n, dtype)
    twin = copy.deepcopy(new)
    compiled = torch.compile(new, backend="aot_eager", fullgraph=True)
    for step, training in enumerate((True, True, False)):
        new.train(training)
        twin.train(training)
        x = lowp_input(step, m, k, dtype)
        expect_lowp_kernel(twin, x, lowp_kernel)
        with torch.no_grad():
            out_c, out_e = compiled(x), twin(x)
        assert out_c.dtype == dtype and torch.equal(out_c, out_e), f"step {step}"
        for (name, a), b in zip(new.named_buffers(), twin.buffers()):
            assert torch.equal(a, b), f"step {step}: {name}"


@requires_compile_ops
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("problem", ["33", "84"])
def test_gpu_lowp_compile_fullgraph_training_step(dtype_name, problem, lowp_kernel):
    """torch.compile(fullgraph=True) of a 16-bit ModelNew in a training step with
    gradients: forward_train_saved and backward_16bit as operators (no graph
    break).  Output, buffers and gradients bit-equal to eager ModelNew's (the same
    kernels and products: backward_16bit is the eager node's backward)."""
    torch._dynamo.reset()  # see test_gpu_lowp_compile_fullgraph_without_grad
    dtype = DTYPES[dtype_name]
    m, k, n = 130, 1024, 264
    _, new = lowp_pair(problem, k, n, dtype)
    twin = copy.deepcopy(new)
    compiled = torch.compile(new, backend="aot_eager", fullgraph=True)
    for step in range(2):
        x = lowp_input(step, m, k, dtype)
        g = torch.randn(m, n, generator=torch.Generator().manual_seed(step)).to("cuda", dtype)
        expect_lowp_kernel(twin, x, lowp_kernel)
        out_c, grads_c = forward_backward(compiled, x, g, params_of=new)
        out_e, grads_e = forward_backward(twin, x, g)
        assert out_c.dtype == dtype and torch.equal(out_c, out_e), f"step {step}: output"
        for (name, a), b in zip(new.named_buffers(), twin.buffers()):
            assert torch.equal(a, b), f"step {step}: {name}"
        for name in ["x"] + PARAM_NAMES:
            got, want = grads_c[name], grads_e[name]
            assert got is not None and got.dtype == want.dtype and torch.equal(got, want), (step, name)


def frozen_bn_step(model, x, g, params_of=None):
    """A fine-tuning step with BatchNorm frozen (`model.bn.eval()`, the rest in
    training): forward_backward with bn in eval."""
    (params_of or model).train()
    (params_of or model).bn.eval()
    return forward_backward(model, x, g, params_of=params_of)


@requires_compile_ops
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("problem", ["33", "84"])
def test_gpu_lowp_compile_fullgraph_eval_with_grad(dtype_name, problem):
    """torch.compile(fullgraph=True) of a 16-bit ModelNew whose BatchNorm is
    frozen while the rest trains: forward_eval_saved and backward_16bit as
    operators (no graph break).  Output and gradients bit-equal to eager
    ModelNew's (the same kernels), buffers untouched by both."""
    torch._dynamo.reset()  # see test_gpu_lowp_compile_fullgraph_without_grad
    dtype = DTYPES[dtype_name]
    m, k, n = 130, 1024, 264
    ref, new = lowp_pair(problem, k, n, dtype)
    settle(ref, new, m, k, dtype)
    twin = copy.deepcopy(new)
    compiled = torch.compile(new, backend="aot_eager", fullgraph=True)
    before = {name: b.clone() for name, b in new.named_buffers()}
    for step in range(2):
        x = lowp_input(step, m, k, dtype)
        g = torch.randn(m, n, generator=torch.Generator().manual_seed(step)).to("cuda", dtype)
        out_c, grads_c = frozen_bn_step(compiled, x, g, params_of=new)
        out_e, grads_e = frozen_bn_step(twin, x, g)
        assert twin.kernel_path(x) == "lowp_cublas_eval_grad"
        assert out_c.dtype == dtype and torch.equal(out_c, out_e), f"step {step}: output"
        for (name, a), b in zip(new.named_buffers(), twin.buffers()):
            assert torch.equal(a, b) and torch.equal(a, before[name]), f"step {step}: {name}"
        for name in ["x"] + PARAM_NAMES:
            got, want = grads_c[name], grads_e[name]
            assert got is not None and got.dtype == want.dtype and torch.equal(got, want), (step, name)


@requires_compile_ops
@pytest.mark.parametrize("problem", ["33", "84"])
def test_gpu_lowp_jit_trace_eval_with_grad(problem):
    dtype = torch.bfloat16
    m, k, n = 130, 1024, 264
    ref, new = lowp_pair(problem, k, n, dtype)
    settle(ref, new, m, k, dtype)
    new.bn.eval()
    twin = copy.deepcopy(new)
    traced = torch.jit.trace(new, lowp_input(0, m, k, dtype), check_trace=False)
    for step, rows in enumerate((64, 257)):
        x = lowp_input(step + 1, rows, k, dtype).requires_grad_(True)
        out_t, out_e = traced(x), twin(x)
        assert out_t.shape == (rows, n) and torch.equal(out_t, out_e), f"{rows} rows"
        out_t.float().sum().backward()
        assert x.grad is not None and bool(torch.isfinite(x.grad).all())


@requires_cuda
@pytest.mark.parametrize("problem", ["33", "84"])
def test_gpu_lowp_eval_backward_keeps_forward_statistics(problem, full_precision_reductions):
    dtype = torch.float16
    m, k, n = 130, 1024, 264
    ref, new = lowp_pair(problem, k, n, dtype)
    settle(ref, new, m, k, dtype)
    twin = copy.deepcopy(new)
    x = lowp_input(1, m, k, dtype)
    g = torch.randn(m, n, generator=torch.Generator().manual_seed(3)).to("cuda", dtype)
    _, want = frozen_bn_step(twin, x, g)

    new.train()
    new.bn.eval()
    new.zero_grad(set_to_none=True)
    xg = x.clone().requires_grad_(True)
    out = new(xg)
    new.bn.train()
    with torch.no_grad():
        new(lowp_input(2, m, k, dtype))  # moves the running statistics
    assert not torch.equal(new.bn.running_var, twin.bn.running_var)
    (out * g).sum().backward()
    got = {"x": xg.grad, **{name: p.grad for name, p in new.named_parameters()}}
    for name in ["x"] + PARAM_NAMES:
        assert torch.equal(got[name], want[name]), name


def lowp_op_cases(dtype):
    """(name, op, args) for opcheck of the operators' 16-bit forms, both problems;
    inputs the operator differentiates require grad."""
    ops = model_new._OPS
    m, k, n = 40, 64, 24
    gen = torch.Generator().manual_seed(9)

    def t(*shape, grad=False, positive=False):
        v = torch.rand(*shape, generator=gen) + 0.5 if positive else torch.randn(*shape, generator=gen)
        return v.to("cuda", dtype).requires_grad_(grad)

    def params(grad):
        return [t(m, k, grad=grad), t(n, k, grad=grad), t(n, grad=grad), t(n, grad=grad),
                t(n, grad=grad, positive=True), t(n, grad=grad)]

    def buffers():
        return [t(n), t(n, positive=True), torch.tensor(3, device="cuda")]

    cases = []
    for scale_after_bn in (False, True):
        tag = "84" if scale_after_bn else "33"
        p = [v.detach() for v in params(False)]
        _, z, coeff = ops.forward_eval_saved(*p, *buffers()[:2], 1e-5, scale_after_bn)
        _, zt, coeff_t, *_ = ops.forward_train_saved(*p, *buffers(), 0.1, 1e-5, scale_after_bn)
        out = t(m, n) if scale_after_bn else None  # problem 84's softmax output (any values serve)
        cases += [
            (f"forward_eval_saved-{tag}", ops.forward_eval_saved.default,
             (*params(True), *buffers()[:2], 1e-5, scale_after_bn)),
            (f"forward_train_saved-{tag}", ops.forward_train_saved.default,
             (*params(True), *buffers(), 0.1, 1e-5, scale_after_bn)),
            (f"backward_16bit_eval-{tag}", ops.backward_16bit.default,
             (False, scale_after_bn, t(m, n), p[0], p[1], p[3], z, coeff, out, [True] * 6)),
            (f"backward_16bit_train-{tag}", ops.backward_16bit.default,
             (True, scale_after_bn, t(m, n), p[0], p[1], p[3], zt, coeff_t, out, [True, False, True, True, False, True])),
        ]
    return cases


LOWP_OP_CASE_NAMES = [f"{op}-{tag}" for tag in ("33", "84") for op in ("forward_eval_saved", "forward_train_saved",
                                                                        "backward_16bit_eval", "backward_16bit_train")]


@requires_compile_ops
@pytest.mark.parametrize("case_name", LOWP_OP_CASE_NAMES)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_gpu_lowp_opcheck(dtype_name, case_name):
    cases = {name: (op, args) for name, op, args in lowp_op_cases(DTYPES[dtype_name])}
    op, args = cases[case_name]
    result = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in result.values()), result
