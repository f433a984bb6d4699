"""BatchNorm1d's and nn.Linear's optional state, as Model has it (issue 40):
on CPU in float64 (the torch-op path, and the fused_gemm_bn:: operators with
SWITCHES.eager_ops) and, where a GPU is present, the fused float32 kernels.

  - bn.track_running_stats = False: batch statistics in training and eval
    (eval when the running statistics are None), the buffers left alone
  - running_mean / running_var / num_batches_tracked set to None, momentum None
    (cumulative average), in both modes
  - gemm.bias None (a bias-free Linear), bn.weight / bn.bias None (affine=False)
  Each case: output of two calls, every gradient and the whole state_dict
  against Model's.  Negative control: the same cases with the tracking case's
  flag left on change the buffers (so "left alone" is no vacuous check).
  - one running statistic None, gemm.weight None, scale None: Model's exception
    type (and message where torch's is fixed), nothing touched.
"""

import pytest
import torch

import model_new
from tests.problems import PROBLEMS, make_pair, requires_cuda, set_attrs

M, K, N = 24, 20, 12


CASES = {
    "track_off": set_attrs(bn__track_running_stats=False),
    "buffers_none": set_attrs(bn__running_mean=None, bn__running_var=None),
    "buffers_none_track_off": set_attrs(bn__track_running_stats=False, bn__running_mean=None, bn__running_var=None,
                                   bn__num_batches_tracked=None),
    "num_batches_tracked_none": set_attrs(bn__num_batches_tracked=None),
    "num_batches_tracked_none_momentum_none": set_attrs(bn__num_batches_tracked=None, bn__momentum=None),
    "momentum_none": set_attrs(bn__momentum=None),
    "gemm_bias_none": set_attrs(gemm__bias=None),
    "bn_weight_none": set_attrs(bn__weight=None),
    "bn_affine_off": set_attrs(bn__weight=None, bn__bias=None),
    "everything_optional_off": set_attrs(gemm__bias=None, bn__weight=None, bn__bias=None, bn__track_running_stats=False),
}


def run(model, xs, grad):
    """Outputs of calls on xs (the last with a backward when grad), then the
    state_dict and the gradients."""
    outs = []
    for i, x in enumerate(xs):
        x = x.clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            out = model(x)
            if grad and i == len(xs) - 1:
                g = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).reshape(out.shape)
                (out * g).sum().backward()
                outs.append(x.grad)
        outs.append(out.detach())
    grads = {name: p.grad for name, p in model.named_parameters()}
    return outs, {k: v.clone() for k, v in model.state_dict().items()}, grads


def compare(ref, new, xs, grad, rtol, atol):
    (out_r, state_r, grads_r), (out_n, state_n, grads_n) = run(ref, xs, grad), run(new, xs, grad)
    for i, (a, b) in enumerate(zip(out_n, out_r)):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"output {i}: {m}")
    assert state_n.keys() == state_r.keys()
    for key in state_r:
        torch.testing.assert_close(state_n[key].to(state_r[key].dtype), state_r[key], rtol=rtol, atol=atol,
                                   msg=lambda m: f"{key}: {m}")
    assert grads_n.keys() == grads_r.keys()
    for key in grads_r:
        assert (grads_n[key] is None) == (grads_r[key] is None), key
        if grads_r[key] is not None:
            torch.testing.assert_close(grads_n[key], grads_r[key], rtol=rtol, atol=atol, msg=lambda m: f"{key}: {m}")


def pair(problem, case, training, dtype=torch.float64, device="cpu"):
    ref, new = make_pair(PROBLEMS[problem], 0, K, N, dtype=dtype)
    for model in (ref, new):
        with torch.no_grad():  # running statistics other than 0 / 1, so eval reads them
            model.bn.running_mean.uniform_(-0.5, 0.5, generator=torch.Generator().manual_seed(1))
            model.bn.running_var.uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(2))
        model.to(device)
        CASES[case](model)
        model.train(training)
    return ref, new


def inputs(dtype=torch.float64, device="cpu"):
    gen = torch.Generator().manual_seed(3)
    return [(torch.rand(M, K, generator=gen, dtype=dtype) * 2 + 0.5).to(device) for _ in range(2)]


@pytest.fixture(params=["torch_path", "operators"])
def path(request, monkeypatch):
    if request.param == "operators":
        if model_new._OPS is None:
            pytest.skip("no custom operators (torch < 2.4)")
        monkeypatch.setattr(model_new, "SWITCHES", model_new.SWITCHES._replace(eager_ops=True))
    return request.param


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_optional_state_as_model(problem, case, training, grad, path):
    ref, new = pair(problem, case, training)
    compare(ref, new, inputs(), grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_untracked_buffers_negative_control(problem):
    """With tracking on the same calls change every buffer: the cases above
    that leave them alone are seen to do so."""
    for case, changed in (("track_off", False), ("momentum_none", True)):
        ref, new = pair(problem, case, True)
        before = {k: v.clone() for k, v in new.state_dict().items()}
        run(new, inputs(), False)
        moved = [not torch.equal(v, before[k]) for k, v in new.state_dict().items() if k.startswith("bn.running")
                 or k.endswith("num_batches_tracked")]
        assert moved and all(m == changed for m in moved), case


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_refused_state_raises_as_model_and_touches_nothing(problem, training):
    cases = {"running_mean": (set_attrs(bn__running_mean=None), ValueError if training else RuntimeError),
             "running_var": (set_attrs(bn__running_var=None), ValueError if training else RuntimeError),
             "gemm_weight": (set_attrs(gemm__weight=None), TypeError),
             "scale": (lambda m: setattr(m, "scale", None), TypeError)}
    for name, (apply, error) in cases.items():
        ref, new = make_pair(PROBLEMS[problem], 0, K, N, dtype=torch.float64)
        for model in (ref, new):
            apply(model)
            model.train(training)
        x = inputs()[0]
        if name == "running_mean" or name == "running_var":
            model_error = None
            try:  # torch < 2.1's BatchNorm1d takes one running statistic None in training
                ref(x)
            except (ValueError, RuntimeError) as e:
                model_error = type(e)
            assert model_error in (error, None), name
        else:
            with pytest.raises(error):
                ref(x)
        before = {k: v.clone() for k, v in new.state_dict().items()}
        with pytest.raises(error):
            new(x)
        assert all(torch.equal(v, before[k]) for k, v in new.state_dict().items()), name


@requires_cuda
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("case", ["track_off", "buffers_none", "num_batches_tracked_none", "everything_optional_off"])
@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_gpu_optional_state_as_model(problem, case, training, grad, fp32_matmul):
    """The fused float32 kernels (the default route of this GPU) against
    float32 Model: the tolerance of the equivalence tests, buffers untouched
    where Model leaves them (equal), counted where it counts."""
    ref, new = pair(problem, case, training, dtype=torch.float32, device="cuda")
    assert not new.kernel_path(inputs(torch.float32, "cuda")[0]).startswith("torch_ops")
    compare(ref, new, inputs(torch.float32, "cuda"), grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_stand_ins(problem):
    """module_call's stand-ins: zeros / ones for the None parameters, scratch
    statistics that are not the module's; a call under inference mode first
    leaves a later differentiable call as Model's."""
    ref, new = pair(problem, "everything_optional_off", True)
    with torch.inference_mode():
        new(inputs()[0])
    compare(ref, new, inputs(), True, rtol=1e-10, atol=1e-12)
    gemm, bn = model_new.module_call(new.gemm, new.bn)
    assert torch.equal(gemm.bias, torch.zeros_like(gemm.bias)) and torch.equal(bn.weight, torch.ones_like(bn.weight))
    assert torch.equal(bn.bias, torch.zeros_like(bn.bias))
    assert bn.running_mean is not new.bn.running_mean and bn.num_batches_tracked is not new.bn.num_batches_tracked


@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_state_read_as_attribute_access(problem):
    """The forward reads parameters, buffers and submodules through module_fields (a fast read
    of nn.Module's tables): what attribute access gives in every way torch swaps them in.
    torch.func.functional_call (parameters and a buffer replaced for one call), a
    parametrization on gemm.weight (a property on a subclass), a submodule replaced by
    assignment: each output as Model's with the same state, and module_fields equal to getattr."""
    ref, new = pair(problem, "track_off", False)
    x = inputs()[0]
    swap = {"gemm.weight": torch.randn(N, K, dtype=torch.float64, generator=torch.Generator().manual_seed(4)),
            "bn.running_mean": torch.full((N,), 0.25, dtype=torch.float64), "scale": new.scale * 3}
    out_new = torch.func.functional_call(new, swap, (x,))
    torch.testing.assert_close(out_new, torch.func.functional_call(ref, swap, (x,)), rtol=1e-10, atol=1e-12)
    assert not torch.allclose(out_new, new(x))  # the swap was seen, and undone after the call

    class Doubled(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    for model in (ref, new):
        torch.nn.utils.parametrize.register_parametrization(model.gemm, "weight", Doubled())
    torch.testing.assert_close(new(x), ref(x), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(model_new.module_call(new.gemm, new.bn)[0].weight,
                               2 * ref.gemm.parametrizations.weight.original)
    new.bn = model_new.BatchNormState(N, eps=1e-3, momentum=0.5).double().eval()
    ref.bn = torch.nn.BatchNorm1d(N, eps=1e-3, momentum=0.5).double().eval()
    torch.testing.assert_close(new(x), ref(x), rtol=1e-10, atol=1e-12)
    for module, names in ((new, ("gemm", "scale", "bn")), (new.gemm, ("weight", "bias", "in_features")),
                          (new.bn, ("weight", "bias", "running_mean", "running_var", "num_batches_tracked", "eps"))):
        for name, field in zip(names, model_new.module_fields(module, names)):  # (the parametrization's
            attribute = getattr(module, name)                                     # weight is made per read)
            assert field is attribute or (isinstance(field, torch.Tensor) and torch.equal(field, attribute)), name
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        model_new.module_fields(new.bn, ("weight", "nothing"))
