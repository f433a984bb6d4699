"""ModelNew under torch.autocast on the fused 16-bit kernels (issue 19; README
"Mixed precision"): float32 modules inside torch.autocast("cuda", float16 or
bfloat16) on Hopper run the 16-bit kernels' autocast form (kernel path
<route>_autocast_<mode>[_grad]: lowp_sm90; in eval at a few rows without gradients
lowp_small_m, in eval with gradients lowp_cublas) and are compared with Model under
the same autocast.  Names: M = batch, K = in_features, N = out_features; shapes (M, K, N).

GPU (all need an sm_90 GPU; names contain "gpu")
  - test_gpu_autocast_fused_matches_model [dtype, problem, mode, shape]: three
    calls (eval: after three settling training calls, Model's state copied into
    ModelNew): output float32 as Model's, within the 16-bit closeness of
    tests/test_lowp.py (both round x, gemm.weight, the bias and the Linear output
    to the autocast dtype; a float32 sum in another order can land a rounding on
    the other side of a tie); running_mean / running_var within 1e-3 (float32
    statistics of the same 16-bit values); num_batches_tracked equal; the
    caller's x and the parameters unchanged; problem 84's rows sum to 1 within
    float32 accuracy (1e-5).
  - test_gpu_autocast_fused_error_vs_float64: err = ||out - out64||_F / ||out64||_F
    against Model in float64 (same parameters, state and input, no autocast);
    bound err(ModelNew) <= 1.05 err(Model under autocast) + 1e-6, the bound of
    test_gpu_lowp_error_vs_float64 (its negative control shows the bound catches
    one extra rounding; test_gpu_autocast_fused_error_negative_control here: a
    chain that also rounds `v * scale` to the autocast dtype fails it).
  - test_gpu_autocast_fused_every_output_element_written: the output block is
    poisoned (NaN) through the caching allocator; every element finite after.
  - test_gpu_autocast_fused_training_step [dtype, problem, mode, shape]: a call
    with gradients (model_new_lowp.forward_autocast_grad: the fused forward, then the fused
    backward; training on lowp_sm90, eval after three settling training calls on
    lowp_cublas) against Model under the same autocast: output as above, buffers
    updated once (eval: untouched), output error against float64 at most 1.05x Model's, and every
    gradient (x and the five parameters, all float32 as Model's) within
    2 err(Model's gradient) + GRAD_FLOOR[dtype] against the float64 Model
    (test_gpu_lowp_grad_enabled's bound); gemm.bias's (exactly 0 in exact
    arithmetic in training) at most 2x Model's + 1e-3 in max norm.
  - test_gpu_autocast_weight_rounded_in_kernel [gemm, dtype, problem, mode, shape]:
    the extension's autocast form with the float32 gemm.weight (lowp_sm90: the
    kernel rounds each tile to the 16-bit dtype as it loads it, the path of
    training calls without a cached cast; lowp_cublas and lowp_small_m: the
    extension casts it first, lowp_small_m's path of eval calls that cannot cache
    the cast)
    against the same call with gemm.weight cast first: out, running_mean,
    running_var and num_batches_tracked bit-equal (the same 16-bit operands and
    the same float32 sums); shapes with K not a multiple of the 64-wide k-block,
    K % 8 != 0 (zero-padded copies), small batches (128-row tiles cut along K;
    lowp_small_m's 8-, 16- and 32-row CTAs) and N not a multiple of 128.
  - test_gpu_autocast_training_calls_reuse_the_cast (lowp_sm90, training) and
    test_gpu_autocast_eval_small_m_same_bits_without_cache (lowp_small_m, eval):
    repeated calls without gradients give the first call's
    bits, whether the cast came from the cache or not.
  - test_gpu_autocast_fused_weight_update_seen: optimizer steps (their
    gradients from the fused training step) and an in-place write to
    gemm.weight between fused calls reach the next call (a stale cached cast
    is dropped, and made again where it is used).
"""
import copy

import pytest
import torch

from tests.test_backward import forward_backward, rel_err
from tests.test_lowp import (DTYPES, KERNELBENCH_SHAPE, NUM_CALLS, assert_close_16bit, assert_grads_within,
                             lowp_input, lowp_pair)

# Eager 16-bit GEMMs without reduced-precision split-K reductions in every test here (conftest.py).
pytestmark = pytest.mark.usefixtures("full_precision_reductions")

requires_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                   reason="needs an sm_90 GPU (lowp_sm90's autocast form)")

# Eval without gradients: lowp_small_m at 3, 12 and 30 rows (its 8-, 16- and 32-row CTAs), else lowp_sm90.
SHAPES = [KERNELBENCH_SHAPE, (257, 300, 1000), (64, 72, 129), (3, 8, 5), (12, 264, 1000), (30, 520, 1032),
          (2305, 72, 4100)]
ERR_FACTOR, ERR_FLOOR = 1.05, 1e-6
BUFFER_TOL = dict(atol=1e-3, rtol=1e-3)


def shape_id(shape):
    return "x".join(map(str, shape))


def autocast_pair(problem, k, n, seed=3):
    """(Model, ModelNew) in float32 on CUDA with identical state."""
    return lowp_pair(problem, k, n, torch.float32, seed=seed)


def float_input(step, m, k, seed=0):
    return lowp_input(step, m, k, torch.float32, seed=seed)


def settle(ref, new, m, k, dtype):
    """Training calls of both under autocast (no grad), then Model's state copied into ModelNew."""
    ref.train()
    new.train()
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
        for step in range(NUM_CALLS):
            x = float_input(step, m, k, seed=7)
            ref(x)
            new(x)
    new.load_state_dict(ref.state_dict())


def expected_path(new, x, grad):
    """model_new_autocast.path_name's name on Hopper for x: lowp_sm90 in training; in eval
    lowp_cublas with gradients, without them lowp_small_m where the 16-bit modules' rule
    takes it (model_new_lowp.hopper_gemm, which tests/test_dispatch.py checks), else lowp_sm90."""
    import model_new

    training = new.bn.training
    if training or grad:
        route = "lowp_sm90" if training else "lowp_cublas"
    else:
        (m, k), n = x.shape, new.gemm.weight.shape[0]
        route = model_new.extra("model_new_lowp").hopper_gemm(m, n, k, training, model_new.device_facts(x.get_device()),
                                                              model_new.SWITCHES)
        route = route if route == "lowp_small_m" else "lowp_sm90"
    return route + "_autocast_" + ("train" if training else "eval") + ("_grad" if grad else "")


def assert_close_autocast(actual, expected, dtype, where):
    """assert_close_16bit's criterion for the autocast dtype, on float32 outputs."""
    assert actual.dtype == expected.dtype == torch.float32, where
    assert_close_16bit(actual.to(dtype), expected.to(dtype), where)


def assert_buffers_close(new, ref, where):
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(getattr(new.bn, name), getattr(ref.bn, name), msg=f"{where}: bn.{name}",
                                   **BUFFER_TOL)
    assert torch.equal(new.bn.num_batches_tracked, ref.bn.num_batches_tracked), f"{where}: num_batches_tracked"


@requires_sm90
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("problem", ["33", "84"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_gpu_autocast_fused_matches_model(dtype_name, problem, mode, shape):
    dtype = DTYPES[dtype_name]
    m, k, n = shape
    ref, new = autocast_pair(problem, k, n)
    if mode == "eval":
        settle(ref, new, m, k, dtype)
    ref.train(mode == "train")
    new.train(mode == "train")
    params_before = {name: p.detach().clone() for name, p in new.named_parameters()}
    for step in range(NUM_CALLS):
        x = float_input(step, m, k)
        x_before = x.clone()
        with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
            assert new.kernel_path(x) == expected_path(new, x, False)
            out_ref, out_new = ref(x), new(x)
        where = f"autocast {dtype_name} {problem} {mode} {shape} call {step}"
        assert out_new.shape == (m, n) and out_new.is_contiguous()
        assert_close_autocast(out_new, out_ref, dtype, where)
        assert_buffers_close(new, ref, where)
        if problem == "84":
            assert (out_new.double().sum(dim=1) - 1).abs().max().item() <= 1e-5, f"{where}: row sums"
        assert torch.equal(x, x_before), f"{where}: x was modified"
    for name, p in new.named_parameters():
        assert torch.equal(p, params_before[name]), f"{name} was modified"


@requires_sm90
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("problem", ["33", "84"])
@pytest.mark.parametrize("shape", [KERNELBENCH_SHAPE, (257, 300, 1000), (130, 1024, 264), (2305, 72, 4100)],
                         ids=shape_id)
def test_gpu_autocast_fused_training_step(dtype_name, problem, mode, shape):
    dtype = DTYPES[dtype_name]
    m, k, n = shape
    ref, new = autocast_pair(problem, k, n, seed=5)
    if mode == "eval":  # BatchNorm frozen (fine-tuning): settled running statistics, then eval
        settle(ref, new, m, k, dtype)
        ref.eval()
        new.eval()
    ref64 = copy.deepcopy(ref).double()
    x = float_input(2, m, k, seed=5)
    g = torch.randn(m, n, generator=torch.Generator().manual_seed(77)).to("cuda")
    with torch.autocast("cuda", dtype=dtype):
        assert new.kernel_path(x.requires_grad_(True)) == expected_path(new, x, True)
        out_ref, grads_ref = forward_backward(ref, x, g)
        out_new, grads_new = forward_backward(new, x, g)
    out64, grads64 = forward_backward(ref64, x.double(), g.double())
    where = f"autocast {dtype_name} {problem} {mode} {shape} step"
    assert_close_autocast(out_new, out_ref, dtype, where)
    assert_buffers_close(new, ref, where)
    err_eager, err_new = rel_err(out_ref, out64), rel_err(out_new, out64)
    print(f"\n[{where}] output err vs float64: eager {err_eager:.3e}, ModelNew {err_new:.3e}")
    assert err_new <= ERR_FACTOR * err_eager + ERR_FLOOR
    assert all(grads_ref[name].dtype == torch.float32 for name in grads_ref), "Model's gradients are float32"
    assert_grads_within(grads_new, grads_ref, grads64, torch.float32, dtype, mode == "train", where)


def _errors(problem, mode, shape, dtype, chain=None):
    """(err(Model under autocast), err(ModelNew or `chain` under autocast)) against Model in float64."""
    m, k, n = shape
    ref, new = autocast_pair(problem, k, n, seed=11)
    if mode == "eval":
        settle(ref, new, m, k, dtype)
    ref64 = copy.deepcopy(ref).double()
    for mod in (ref, new, ref64):
        mod.train(mode == "train")
    x = float_input(1, m, k, seed=11)
    with torch.no_grad():
        out64 = ref64(x.double())
        with torch.autocast("cuda", dtype=dtype):
            assert new.kernel_path(x) == expected_path(new, x, False)
            out_ref = ref(x)
            out_new = new(x) if chain is None else chain(ref, x)
    return rel_err(out_ref, out64), rel_err(out_new, out64)


@requires_sm90
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("problem", ["33", "84"])
@pytest.mark.parametrize("shape", [KERNELBENCH_SHAPE, (257, 300, 1000), (12, 264, 1000), (2305, 72, 4100)],
                         ids=shape_id)
def test_gpu_autocast_fused_error_vs_float64(dtype_name, problem, mode, shape):
    err_eager, err_new = _errors(problem, mode, shape, DTYPES[dtype_name])
    print(f"\n[autocast error vs float64] {dtype_name} {problem} {mode} {shape}: eager {err_eager:.3e}, "
          f"ModelNew {err_new:.3e}, ratio {err_new / err_eager:.4f}")
    assert err_new <= ERR_FACTOR * err_eager + ERR_FLOOR


@requires_sm90
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_gpu_autocast_fused_error_negative_control(dtype_name):
    """Model's chain with `v * scale` also rounded to the autocast dtype (one
    rounding more than Model under autocast) fails the bound above."""
    dtype = DTYPES[dtype_name]

    def extra_rounding(ref, x):
        v = torch.nn.functional.linear(x, ref.gemm.weight, ref.gemm.bias)
        u = (v * ref.scale.to(dtype)).float()  # a 16-bit product: the extra rounding
        return torch.nn.functional.batch_norm(u, None, None, ref.bn.weight, ref.bn.bias, True, 0.0, ref.bn.eps)

    err_eager, err_bad = _errors("33", "train", (257, 300, 1000), dtype, chain=extra_rounding)
    print(f"\n[autocast negative control] {dtype_name}: eager {err_eager:.3e}, extra rounding {err_bad:.3e}")
    assert err_bad > ERR_FACTOR * err_eager + ERR_FLOOR


@requires_sm90
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("problem", ["33", "84"])
@pytest.mark.parametrize("shape", [KERNELBENCH_SHAPE, (257, 300, 1000), (3, 8, 5), (30, 520, 1032)], ids=shape_id)
def test_gpu_autocast_fused_every_output_element_written(shape, dtype_name, problem, mode):
    """As test_gpu_lowp_every_output_element_written: a probe call's output
    block is filled with NaN and freed; the next call gets it back (asserted)."""
    dtype = DTYPES[dtype_name]
    m, k, n = shape
    _, new = autocast_pair(problem, k, n)
    new.train(mode == "train")
    probe = copy.deepcopy(new)
    x = float_input(0, m, k)
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
        x16 = x.to(dtype)  # held, so both calls make the same allocations in the same order
        for _ in range(2):  # each module's weight cast made and cached first (training: on its second sight)
            new(x16)
            probe(x16)
        poison = probe(x16)
        poison.fill_(float("nan"))
        poisoned_ptr = poison.data_ptr()
        del poison
        out = new(x16)
    assert out.data_ptr() == poisoned_ptr, "output did not reuse the poisoned block: the check would be vacuous"
    bad = int((~torch.isfinite(out)).sum())
    assert bad == 0, f"{bad} of {out.numel()} output elements not written (NaN left from the poisoned block)"
    for name, b in new.named_buffers():
        assert bool(torch.isfinite(b.double()).all()), f"{name} not finite"


@requires_sm90
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("problem", ["33", "84"])
@pytest.mark.parametrize("shape", [KERNELBENCH_SHAPE, (257, 300, 1000), (64, 72, 129), (2305, 1000, 264),
                                   (130, 1024, 264), (3, 8, 5), (12, 264, 1000), (30, 520, 1032)], ids=shape_id)
@pytest.mark.parametrize("gemm", ["lowp_sm90", "lowp_cublas", "lowp_small_m"])
def test_gpu_autocast_weight_rounded_in_kernel(gemm, dtype_name, problem, mode, shape):
    import model_new

    dtype = DTYPES[dtype_name]
    m, k, n = shape
    if gemm == "lowp_small_m" and (m > 32 or k % 8 != 0):
        pytest.skip("lowp_small_m takes at most 32 rows and in_features a multiple of 8")
    if gemm != "lowp_sm90" and m * k * n > (1 << 28):
        pytest.skip("lowp_sm90's case at the KernelBench shape; the product-first routes at the small ones")
    _, new = autocast_pair(problem, k, n)
    kernels = model_new._LOWP.kernels()
    x16 = float_input(0, m, k).to(dtype)
    w = new.gemm.weight.detach()
    vectors = (new.gemm.bias.detach(), model_new.per_feature_scale(new.scale.detach(), n), new.bn.weight.detach(),
               new.bn.bias.detach())
    sab = problem == "84"
    results = []
    for weight in (w.to(dtype), w):
        buffers = [b.clone() for b in (new.bn.running_mean, new.bn.running_var, new.bn.num_batches_tracked)]
        if mode == "train":
            out = kernels.forward_train(gemm, x16, weight, *vectors, *buffers, 0.1, 1e-5, sab)
        else:
            out = kernels.forward_eval(gemm, x16, weight, *vectors, *buffers[:2], 1e-5, sab)
        results.append((out, *buffers))
    assert results[1][0].dtype == torch.float32 and bool(torch.isfinite(results[1][0]).all())
    for name, a, b in zip(("out", "running_mean", "running_var", "num_batches_tracked"), *results):
        assert torch.equal(a, b), f"{gemm} {name}: the float32 weight rounded in the extension differs from its cast"
    assert torch.equal(w, new.gemm.weight), "gemm.weight was modified"


@requires_sm90
@pytest.mark.parametrize("problem", ["33", "84"])
def test_gpu_autocast_fused_weight_update_seen(problem):
    """Fused calls (no grad) between optimizer steps (whose gradients come from
    the fused training step) and after an in-place write to gemm.weight see the
    new weight: the cached cast is made again.  After each step Model takes
    ModelNew's state (the two steps' gradients differ by 16-bit roundings, so
    the weights would drift apart), so the next call compares one state."""
    dtype = torch.bfloat16
    m, k, n = 257, 300, 1000
    ref, new = autocast_pair(problem, k, n)
    opt_new = torch.optim.SGD(new.parameters(), lr=0.5)
    for step in range(3):
        x = float_input(step, m, k)
        g = torch.randn(m, n, generator=torch.Generator().manual_seed(step)).to("cuda")
        with torch.autocast("cuda", dtype=dtype):
            with torch.no_grad():
                assert new.kernel_path(x) == expected_path(new, x, False)
                assert_close_autocast(new(x), ref(x), dtype, f"step {step}")
            assert new.kernel_path(x.requires_grad_(True)) == expected_path(new, x, True)
            before = new.gemm.weight.detach().clone()
            opt_new.zero_grad()
            (new(x) * g).sum().backward()
            opt_new.step()
        assert not torch.equal(new.gemm.weight, before), "the step did not change gemm.weight"
        ref.load_state_dict(new.state_dict())
    with torch.no_grad():  # an in-place write outside an optimizer (bumps the version counter)
        ref.gemm.weight.mul_(-1)
        new.gemm.weight.mul_(-1)
        x = float_input(0, m, k)
        with torch.autocast("cuda", dtype=dtype):
            assert_close_autocast(new(x), ref(x), dtype, "after weight.mul_(-1)")


@requires_sm90
@pytest.mark.skipif(not hasattr(torch, "compile"), reason="needs torch.compile")
@pytest.mark.requires_torch_compile
@pytest.mark.parametrize("problem", ["33", "84"])
def test_gpu_autocast_compile_fullgraph(problem):
    """torch.compile(fullgraph=True) of ModelNew under CUDA autocast, without
    gradients (where eager takes the fused 16-bit kernels): no graph break, and
    Model's own ops run, so the result is Model's, bit for bit (aot_eager)."""
    # Every compiled ModelNew shares FusedModule.forward's code object: start from
    # an empty dynamo cache, so earlier tests' entries cannot reach the recompile
    # limit (past it dynamo runs the frame eagerly, which would hide the check).
    torch._dynamo.reset()
    m, k, n = 257, 300, 1000
    ref, new = autocast_pair(problem, k, n)
    compiled = torch.compile(new, backend="aot_eager", fullgraph=True)
    for step, training in enumerate((True, False)):
        ref.train(training)
        new.train(training)
        x = float_input(step, m, k)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            assert new.kernel_path(x) == expected_path(new, x, grad=False)  # eager's path: the fused kernels
            out_ref, out_new = ref(x), compiled(x)
        assert out_new.dtype == out_ref.dtype and torch.equal(out_new, out_ref), f"step {step}"
        for (name, a), b in zip(new.named_buffers(), ref.buffers()):
            assert torch.equal(a, b), f"step {step}: {name}"


@requires_sm90
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("problem", ["33", "84"])
def test_gpu_autocast_training_calls_reuse_the_cast(dtype_name, problem):
    """Training-mode calls without gradients in one autocast region (an
    evaluation loop that keeps BatchNorm in training mode) on lowp_sm90: the first
    call rounds the float32 weight in the kernel, the second finds it unchanged and
    caches its cast, later calls read that cast; every call's output is the
    first's bit for bit (the same 16-bit operands), the buffers follow Model's,
    and an optimizer step drops the cast (the next call rounds in the kernel)."""
    import model_new

    dtype = DTYPES[dtype_name]
    m, k, n = 257, 300, 1000
    ref, new = autocast_pair(problem, k, n)
    x = float_input(0, m, k)
    model_new.clear_weight_cache()
    entry = lambda: model_new._WEIGHT_PARTS.get(id(new.gemm.weight))  # noqa: E731
    outs = []
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
        for call in range(3):
            assert new.kernel_path(x) == "lowp_sm90_autocast_train"
            outs.append(new(x))
            assert_close_autocast(outs[-1], ref(x), dtype, f"call {call}")
            cached = entry() is not None and entry().parts is not None
            assert cached == (call >= 1), f"call {call}: cast cached {cached}"
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    assert_buffers_close(new, ref, "three calls")
    new.gemm.weight.grad = torch.ones_like(new.gemm.weight)
    torch.optim.SGD(new.parameters(), lr=1e-3).step()
    assert entry() is None
    model_new.clear_weight_cache()


@requires_sm90
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("problem", ["33", "84"])
@pytest.mark.parametrize("shape", [(12, 264, 1000), (30, 520, 1032)], ids=shape_id)
def test_gpu_autocast_eval_small_m_same_bits_without_cache(dtype_name, problem, shape, monkeypatch):
    """Eval calls without gradients on lowp_small_m (its 16- and 32-row CTAs), which reads
    a 16-bit weight: the first call makes and caches the cast, the second reads
    it; with the weight cache switched off (as in a CUDA graph capture or on a side stream)
    the extension casts the float32 weight in every call.  Every call's output is the
    first's bit for bit, and Model's within the 16-bit closeness."""
    import model_new

    dtype = DTYPES[dtype_name]
    m, k, n = shape
    ref, new = autocast_pair(problem, k, n)
    settle(ref, new, m, k, dtype)
    ref.eval()
    new.eval()
    x = float_input(0, m, k)
    model_new.clear_weight_cache()
    entry = lambda: model_new._WEIGHT_PARTS.get(id(new.gemm.weight))  # noqa: E731
    outs = []
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
        for call in range(4):
            if call == 2:
                monkeypatch.setattr(model_new, "SWITCHES", model_new.SWITCHES._replace(weight_cache=False))
                model_new.clear_weight_cache()
            assert new.kernel_path(x) == "lowp_small_m_autocast_eval"
            outs.append(new(x))
            assert_close_autocast(outs[-1], ref(x), dtype, f"call {call}")
            cached = entry() is not None and entry().parts is not None
            assert cached == (call < 2), f"call {call}: cast cached {cached}"
    assert all(torch.equal(o, outs[0]) for o in outs[1:]), "a call's bits depend on where its cast came from"
    model_new.clear_weight_cache()
