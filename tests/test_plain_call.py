"""The forward's common-call lane (model_new._plain_call, FusedModule.forward):
the plain CUDA call takes it, and it gives what fused_forward's general path gives.

  - taken: float32, float16, bfloat16; both problems; train / eval; with and
    without gradients; a one-number scale (problem 84's).  Output, buffers and
    every gradient bit-equal to fused_forward on a copy with the same state.
  - taken under torch.autocast (float16, bfloat16) for a float32 module with x
    float32 or float16, where the fused route runs the call (the Plan named as
    kernel_path names it): output, buffers and gradients bit-equal to
    fused_forward's general path, two calls (the weight cache's cast made on
    the second in training).
  - declined (None, nothing written) wherever the general path decides
    something the lane does not: optional state absent, a batch of 0 or of 1
    row in training, x a tensor subclass or not on the module's GPU,
    float64, a scale of two dims, a parametrized weight, a SyncBatchNorm,
    SWITCHES.eager_ops; under autocast a 16-bit module, SWITCHES.autocast_fused
    off and a batch of 1 row in training.  The forward still gives Model's output there.
  - torch.func.functional_call's swapped tensors are what the lane reads.
GPU only: the lane takes CUDA tensors alone (python -m pytest -q -k gpu tests/test_plain_call.py).
"""
import copy

import pytest
import torch
from torch import nn

import model_new
from tests.problems import PROBLEMS, make_pair, requires_cuda, set_attrs

M, K, N = 48, 64, 40


def _x(dtype, m=M, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(m, K, device="cuda", generator=g).to(dtype)


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _run(call, model, x, grad):
    """call(model, x)'s output, the state after it, and the gradients of x and the parameters."""
    x = x.clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        out = call(model, x)
        grads = []
        if grad:
            w = torch.linspace(-1, 1, out.numel(), device="cuda", dtype=out.dtype).reshape(out.shape)
            (out * w).sum().backward()
            grads = [x.grad] + [p.grad for p in model.parameters()]
    return out.detach(), _state(model), grads


def _general(model, x):
    return model_new.fused_forward(x, model.gemm, model.scale, model.bn, model.scale_after_bn)


@requires_cuda
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_gpu_plain_call_as_general_path(problem, dtype, training, grad):
    """The lane is taken and gives fused_forward's output, buffers and gradients, bit for bit."""
    _, new = make_pair(PROBLEMS[problem], 0, K, N, device="cuda", dtype=dtype)
    new.train(training)
    other = copy.deepcopy(new)
    x = _x(dtype)
    with torch.set_grad_enabled(grad):
        call = model_new._plain_call(new, x)
    assert call is not None
    assert call[0] == model_new.dispatch(x, new.gemm.weight, training, grad, new.scale_after_bn)
    assert all(torch.equal(v, _state(other)[k]) for k, v in _state(new).items())  # (the lane wrote nothing)
    for _ in range(2):  # the second call sees the first one's running statistics
        out, state, grads = _run(lambda m, x: m(x), new, x, grad)
        out_ref, state_ref, grads_ref = _run(_general, other, x, grad)
        assert torch.equal(out, out_ref)
        assert state.keys() == state_ref.keys() and all(torch.equal(v, state_ref[k]) for k, v in state.items())
        assert len(grads) == len(grads_ref) and all(torch.equal(a, b) for a, b in zip(grads, grads_ref))
        for m in (new, other):
            m.zero_grad(set_to_none=True)


def _decline_cases():
    """name -> (change(model) -> x or None for the default x); each makes the lane decline."""
    def scale_2d(model):
        model.scale = nn.Parameter(model.scale.detach().reshape(1, -1).expand(1, N).clone())

    def parametrized(model):
        torch.nn.utils.parametrize.register_parametrization(model.gemm, "weight", _Identity())

    def sync_bn(model):
        nn.SyncBatchNorm.convert_sync_batchnorm(model)  # (converts model.bn in place)

    return {
        "gemm_bias_none": (set_attrs(gemm__bias=None), None),
        "affine_off": (set_attrs(bn__weight=None, bn__bias=None), None),
        "track_off_training": (set_attrs(bn__track_running_stats=False), None),
        "num_batches_tracked_none": (set_attrs(bn__num_batches_tracked=None), None),
        "one_row_training": (None, lambda dtype: _x(dtype, m=1)),
        "empty_batch": (None, lambda dtype: _x(dtype, m=0)),
        "x_subclass": (None, lambda dtype: nn.Parameter(_x(dtype), requires_grad=False)),
        "x_on_cpu": (None, lambda dtype: _x(dtype).cpu()),
        "scale_1_by_n": (scale_2d, None),
        "parametrized_weight": (parametrized, None),
        "sync_batch_norm": (sync_bn, None),
    }


class _Identity(nn.Module):
    def forward(self, w):
        return w


@requires_cuda
@pytest.mark.parametrize("case", sorted(_decline_cases()))
@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_gpu_plain_call_declines(problem, case):
    """Each case's call goes to fused_forward's general path (the lane gives None and writes
    nothing), whose output is Model's (float32, the equivalence tests' tolerance)."""
    if case == "sync_batch_norm" and model_new._SYNC is None:
        pytest.skip("SyncBatchNorm conversion needs model_new_sync.py")
    ref, new = make_pair(PROBLEMS[problem], 0, K, N, device="cuda")
    change, make_x = _decline_cases()[case]
    if change is not None:
        change(ref)
        change(new)
    x = _x(torch.float32) if make_x is None else make_x(torch.float32)
    before = _state(new)
    assert model_new._plain_call(new, x) is None
    assert all(torch.equal(v, before[k]) for k, v in _state(new).items())
    errors = {"x_on_cpu": RuntimeError, "one_row_training": ValueError}
    if case in errors:
        with pytest.raises(errors[case]):
            new(x)
        assert all(torch.equal(v, before[k]) for k, v in _state(new).items())
        return
    torch.testing.assert_close(new(x), ref(x), rtol=1e-4, atol=1e-4)


@requires_cuda
def test_gpu_plain_call_declines_modes():
    """float64 and SWITCHES.eager_ops go to the general path too."""
    _, new = make_pair(PROBLEMS["33"], 0, K, N, device="cuda")
    assert model_new._plain_call(new, _x(torch.float32)) is not None
    assert model_new._plain_call(copy.deepcopy(new).double(), _x(torch.float64)) is None
    switches = model_new.SWITCHES
    try:
        model_new.SWITCHES = switches._replace(eager_ops=True)
        assert model_new._plain_call(new, _x(torch.float32)) is None or model_new._OPS is None
    finally:
        model_new.SWITCHES = switches


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_gpu_plain_call_reads_functional_call_swaps(dtype):
    """torch.func.functional_call swaps tensors into the modules' tables for one call: the lane
    reads the swapped ones (the output is the general path's with the same swap) and the
    module's own after the call."""
    _, new = make_pair(PROBLEMS["33"], 0, K, N, device="cuda", dtype=dtype)
    new.eval()
    x = _x(dtype)
    g = torch.Generator(device="cuda").manual_seed(5)
    swap = {"gemm.weight": torch.randn(N, K, device="cuda", generator=g).to(dtype),
            "bn.running_mean": torch.full((N,), 0.25, device="cuda", dtype=dtype), "scale": new.scale * 3}
    with torch.no_grad():
        out = torch.func.functional_call(new, swap, (x,))
        other = copy.deepcopy(new)
        other.gemm.weight.copy_(swap["gemm.weight"])
        other.bn.running_mean.copy_(swap["bn.running_mean"])
        other.scale.copy_(swap["scale"])
        assert torch.equal(out, _general(other, x))
        assert not torch.equal(out, new(x)) and torch.equal(new(x), _general(new, x))


_AUTOCAST_DTYPES = [torch.float16, torch.bfloat16]


@requires_cuda
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", _AUTOCAST_DTYPES, ids=str)
@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_gpu_plain_call_autocast_as_general_path(problem, dtype, training, grad, x_dtype):
    """Under autocast a float32 module's common call takes the lane where the fused route runs
    it (its Plan named as kernel_path names it, with the autocast dtype), else declines; the
    forward gives fused_forward's output, buffers and gradients, bit for bit."""
    if model_new._AUTOCAST is None:
        pytest.skip("autocast needs model_new_autocast.py")
    _, new = make_pair(PROBLEMS[problem], 0, K, N, device="cuda")
    new.train(training)
    other = copy.deepcopy(new)
    x = _x(x_dtype)
    with torch.autocast("cuda", dtype=dtype), torch.set_grad_enabled(grad):
        call = model_new._plain_call(new, x)
        path = new.kernel_path(x.clone().requires_grad_(grad))
    if path.startswith("torch_ops"):  # not an sm_90 GPU, or SWITCHES.portable
        assert call is None
    else:
        assert call is not None and call[0].name == path and call[0].mixed_dtype is dtype
    assert all(torch.equal(v, _state(other)[k]) for k, v in _state(new).items())  # (the lane wrote nothing)
    for _ in range(2):  # training: the second call finds the weight unchanged and caches its cast
        with torch.autocast("cuda", dtype=dtype):
            out, state, grads = _run(lambda m, x: m(x), new, x, grad)
            out_ref, state_ref, grads_ref = _run(_general, other, x, grad)
        assert out.dtype == torch.float32 and torch.equal(out, out_ref)
        assert state.keys() == state_ref.keys() and all(torch.equal(v, state_ref[k]) for k, v in state.items())
        assert len(grads) == len(grads_ref) and all(torch.equal(a, b) for a, b in zip(grads, grads_ref))
        for m in (new, other):
            m.zero_grad(set_to_none=True)


@requires_cuda
@pytest.mark.parametrize("case", ["module_16bit", "autocast_fused_off", "one_row_training"])
def test_gpu_plain_call_autocast_declines(case):
    """Under autocast the lane declines (None, nothing written) a 16-bit module (Model's ops run
    it), SWITCHES.autocast_fused off, and a batch of one row in training (the general path raises
    BatchNorm's ValueError, nothing written)."""
    if model_new._AUTOCAST is None:
        pytest.skip("autocast needs model_new_autocast.py")
    _, new = make_pair(PROBLEMS["84"], 0, K, N, device="cuda")
    x = _x(torch.float32, m=1 if case == "one_row_training" else M)
    if case == "module_16bit":
        new = new.half()
    before = _state(new)
    switches = model_new.SWITCHES
    try:
        if case == "autocast_fused_off":
            model_new.SWITCHES = switches._replace(autocast_fused=False)
        with torch.autocast("cuda", dtype=torch.float16), torch.no_grad():
            assert model_new._plain_call(new, x) is None
            assert all(torch.equal(v, before[k]) for k, v in _state(new).items())
            if case == "one_row_training":
                with pytest.raises(ValueError):
                    new(x)
                assert all(torch.equal(v, before[k]) for k, v in _state(new).items())
            else:
                assert new.kernel_path(x).startswith("torch_ops")
                assert torch.isfinite(new(x)).all()
    finally:
        model_new.SWITCHES = switches
