"""Gradients of both ModelNews: problem 33 (model_new.py, Linear -> * scale ->
BatchNorm1d) and problem 84 (level2_84_gemm_batchnorm_scaling_softmax/, Linear ->
BatchNorm1d -> * scale -> Softmax), against their reference.Model's autograd.
Names: M = batch, K = in_features, N = out_features.

Run: python -m pytest -q tests/test_backward.py -s      (-s shows the measured errors)

Two code paths give the gradients, and the tests run both where they exist:
  "function": the autograd.Functions (_TrainFn, _GemmNT) over the
              extension on CUDA, over the _torch_* functions (same names and
              arguments) on CPU; what eager calls take.
  "ops":      the fused_gemm_bn:: custom operators and their registered autograd
              (torch >= 2.4), forced in eager with SWITCHES.eager_ops;
              what torch.compile traces.

CPU (always run; CI)
  - test_cpu_gradcheck: torch.autograd.gradcheck in float64 with respect to x
    and every parameter, train and eval, scale (N,) and (1,), both paths;
    negative control: a BatchNorm backward missing one term fails it
  - test_cpu_gradients_match_reference: float64 (1e-10) and float32 (error vs
    the float64 Model at most 2x the float32 Model's + GRAD_FLOOR), train and
    eval, shapes with tile tails; gemm.bias in training: exactly zero
  - test_torch_bn_backward_train_contract: _torch_bn_backward_train, the contract of
    the extension's bn_backward_train, against autograd of the unfused
    BatchNorm in float64 (both problems' formulas)
  - test_cpu_opcheck: torch.library.opcheck on every operator (schema,
    autograd registration, fake implementation, AOT dispatch)
  - test_cpu_compile_fullgraph: torch.compile(ModelNew, fullgraph=True),
    backends aot_eager and inductor, forward and backward, with and without
    grad: outputs, gradients and buffers against eager ModelNew;
    test_cpu_compiled_graph_calls_the_operators: the traced graph holds the
    fused_gemm_bn:: operators
  - test_cpu_sgd_loop: 20 SGD steps of ModelNew and Model from one seed, float64
    (1e-9) and float32 (against the float64 Model: at most 2x the float32 Model's
    deviation + a floor): losses, parameters, running statistics
  - test_cpu_inputs_unmodified_and_needed_grads_only: x and the parameters
    unchanged by forward and backward; frozen parameters and an x without
    requires_grad get no gradient, the others the same as with all; gradients
    accumulate into existing .grad
  - test_cpu_double_backward_raises: the hand-written backward is once
    differentiable and says so

GPU (skipped without CUDA; float32; TF32 off for the eager references)
  - test_gpu_gradients_vs_float64 [gemm_path]: every gradient against
    reference.Model in float64 on the same inputs and state, train and eval, at
    (64, 96, 80), (300, 1000, 520), (257, 1028, 130) and (1024, 8192, 8192):
    err(ModelNew) <= 2 err(eager float32) + GRAD_FLOOR (relative Frobenius),
    both printed; gemm.bias in training exactly zero (the float64 oracle's is
    rounding noise, asserted)
  - test_gpu_forward_train_saved_contract, test_gpu_forward_train_saved_small_m_centred,
    test_gpu_gemm_nt_any_strides, test_gpu_plain_products_write_every_element (outputs in
    NaN-poisoned memory),
    test_gpu_bn_backward_train_contract, test_gpu_softmax_rows_backward: the
    extension functions against float64, with the same 2x-eager criterion
  - test_gpu_ops_path_matches_function_path, test_gpu_opcheck,
    test_gpu_compile_inductor, test_gpu_sgd_loop, test_gpu_inputs_unmodified
"""
import copy
import math
import os
import subprocess
import sys

import pytest
import torch

import model_new
import reference
from level2_84_gemm_batchnorm_scaling_softmax import model_new as model_new_84
from level2_84_gemm_batchnorm_scaling_softmax import reference as reference_84
from tests.problems import GEMM_PATHS, gemm_switches, launched_kernels

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (ModelNew's kernels)")
HAS_CUSTOM_OP = hasattr(torch.library, "custom_op")
# The operators exist where model_new found torch.library.custom_op at its import.
requires_ops = pytest.mark.skipif(model_new._OPS is None,
                                  reason="no fused_gemm_bn:: operators (torch.library.custom_op needs torch >= 2.4)")
HAS_COMPILE = hasattr(torch, "compile") and hasattr(torch, "compiler")

# Both problems: reference and ModelNew classes, constructor arguments for (K, N, scale_shape).
PROBLEMS = {
    "33": (reference.Model, model_new.ModelNew, lambda k, n, s: (k, n, s)),
    "84": (reference_84.Model, model_new_84.ModelNew, lambda k, n, s: (k, n, 1e-5, 0.1, s)),
}
PARAM_NAMES = ["gemm.weight", "gemm.bias", "scale", "bn.weight", "bn.bias"]
PATHS = ["function", pytest.param("ops", marks=requires_ops)]

# Floor of the accuracy criteria, relative Frobenius: about 16 units of float32
# roundoff (2^-24 = 6e-8), the level at which two correct float32 reductions
# summed in different orders already differ; it only matters where eager's own
# error is smaller (e.g. grad of bn.bias, a plain column sum).
GRAD_FLOOR = 1e-6


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def rel_err(t, ref):
    """||t - ref||_F / ||ref||_F in float64."""
    t, ref = t.detach().double(), ref.detach().double()
    return ((t - ref).norm() / ref.norm()).item()


def assert_rel_close(a, b, bound, what):
    """||a - b||_F <= bound ||b||_F (both exactly zero also passes)."""
    if b.norm() == 0:
        assert torch.count_nonzero(a) == 0, f"{what}: expected zero"
        return
    err = rel_err(a, b)
    assert err <= bound, f"{what}: relative error {err:.2e} > {bound:.0e}"


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Runs the test on the autograd.Function path and again on the custom operators."""
    monkeypatch.setattr(model_new, "SWITCHES", model_new.SWITCHES._replace(eager_ops=request.param == "ops"))
    return request.param


def make_pair(problem, k, n, scale_shape=None, dtype=torch.float64, device="cpu", seed=0, momentum="default"):
    """(Model, ModelNew) with identical parameters and buffers: constructed after
    the same seed, then scale, bn.weight and bn.bias drawn away from their
    initial 1 / 1 / 0 (both signs for scale), so every gradient term is exercised.
    scale_shape defaults to each problem's KernelBench one: (N,) for 33, (1,) for 84."""
    ref_cls, new_cls, init = PROBLEMS[problem]
    if scale_shape is None:
        scale_shape = (n,) if problem == "33" else (1,)
    torch.manual_seed(seed)
    ref = ref_cls(*init(k, n, scale_shape))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        ref.scale.copy_((torch.rand(scale_shape, generator=gen) + 0.5) * torch.where(
            torch.rand(scale_shape, generator=gen) < 0.3, -1.0, 1.0))
        ref.bn.weight.copy_(torch.rand(n, generator=gen) + 0.5)
        ref.bn.bias.copy_(torch.rand(n, generator=gen) - 0.5)
    if momentum != "default":
        ref.bn.momentum = momentum
    torch.manual_seed(seed)
    new = new_cls(*init(k, n, scale_shape))
    new.bn.momentum = ref.bn.momentum
    new.load_state_dict(ref.state_dict())
    return ref.to(device=device, dtype=dtype), new.to(device=device, dtype=dtype)


def settle_running_stats(models, m, k, gen, device="cpu", dtype=torch.float64, steps=2):
    """A few no-grad training steps with momentum=None on the same inputs, so
    that eval mode runs with the running statistics of the data (the folded
    affine then cancels as much as after long training)."""
    saved = [mod.bn.momentum for mod in models]
    for mod in models:
        mod.bn.momentum = None
        mod.train()
    with torch.no_grad():
        for _ in range(steps):
            x = torch.randn(m, k, generator=gen, dtype=dtype).to(device) + 0.5
            for mod in models:
                mod(x.to(mod.gemm.weight.dtype))
    for mod, mom in zip(models, saved):
        mod.bn.momentum = mom


def forward_backward(model, x, g, params_of=None):
    """out = model(x) and the gradients of sum(out * g) with respect to x and
    every parameter of `params_of` (default: model; the original module of a
    compiled one), {name: grad}; .grad is cleared first."""
    params_of = model if params_of is None else params_of
    params_of.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = model(x)
    (out * g).sum().backward()
    grads = {"x": x.grad}
    params = dict(params_of.named_parameters())
    grads.update({name: params[name].grad for name in PARAM_NAMES})
    return out.detach(), grads


def as_grad(t, like):
    return torch.zeros_like(like) if t is None else t


# ---------------------------------------------------------------------------
# CPU: gradcheck and the reference's gradients
# ---------------------------------------------------------------------------

GRADCHECK_CASES = [("33", (5,)), ("33", (1,)), ("84", (1,)), ("84", (5,))]


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("problem,scale_shape", GRADCHECK_CASES, ids=[f"{p}-scale{s}" for p, s in GRADCHECK_CASES])
def test_cpu_gradcheck(problem, scale_shape, training, path):
    m, k, n = 9, 7, 5
    _, new = make_pair(problem, k, n, scale_shape, seed=3)
    gen = torch.Generator().manual_seed(4)
    settle_running_stats([new], m, k, gen)
    new.train(training)
    names = [name for name, _ in new.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for p in new.parameters()]
    x = torch.randn(m, k, generator=gen, dtype=torch.float64, requires_grad=True)

    def f(x, *ps):
        return torch.func.functional_call(new, dict(zip(names, ps)), (x,))

    assert torch.autograd.gradcheck(f, (x, *params), eps=1e-6, atol=1e-7, rtol=1e-5)


def _bn_backward_without_mean_of_g_xhat(grad_y, z, stats, scale, bn_weight, eps, scale_after_bn, bn_bias=None):
    """_torch_bn_backward_train with grad_z's term - a xhat mean_m(grad_y xhat) left
    out (xhat = scale (z - mu) r for problem 33, (z - mu) r for 84)."""
    out = model_new._torch_bn_backward_train(grad_y, z, stats, scale, bn_weight, eps, scale_after_bn, bn_bias)
    d = z - stats[0]
    s2 = torch.ones_like(scale) if scale_after_bn else scale * scale
    r = torch.rsqrt(s2 * stats[1] + eps)
    out[0] = out[0] + (scale * bn_weight * r) * s2 * r * r * d * (grad_y * d).mean(0)
    return out


@pytest.mark.parametrize("problem", ["33", "84"])
def test_cpu_gradcheck_negative_control(problem, path, monkeypatch):
    """gradcheck can tell: with one term of grad_z left out of the BatchNorm
    backward (the same substitution on both paths: the operators' CPU
    implementation calls _TORCH_PATH too), it fails."""
    monkeypatch.setattr(model_new._TORCH_PATH, "bn_backward_train", _bn_backward_without_mean_of_g_xhat)
    m, k, n = 9, 7, 5
    _, new = make_pair(problem, k, n, seed=3)
    names = [name for name, _ in new.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for p in new.parameters()]
    x = torch.randn(m, k, dtype=torch.float64, requires_grad=True)

    def f(x, *ps):
        return torch.func.functional_call(new, dict(zip(names, ps)), (x,))

    assert not torch.autograd.gradcheck(f, (x, *params), eps=1e-6, atol=1e-7, rtol=1e-5, raise_exception=False)


CPU_SHAPES = [(64, 96, 80), (300, 130, 70), (2, 5, 3), (129, 33, 257)]


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("m,k,n", CPU_SHAPES)
@pytest.mark.parametrize("problem", ["33", "84"])
def test_cpu_gradients_match_reference(problem, m, k, n, training, path):
    """float64: ModelNew's gradients equal Model's to 1e-10 relative.  float32:
    each gradient's error against the float64 Model is at most twice the float32
    Model's + GRAD_FLOOR.  gemm.bias in training: ModelNew's gradient is exactly
    zero; the float64 Model's is rounding noise (at most 1e-10 of grad bn.bias)."""
    ref64, new64 = make_pair(problem, k, n, seed=5)
    gen = torch.Generator().manual_seed(6)
    settle_running_stats([ref64, new64], m, k, gen)
    ref32, new32 = copy.deepcopy(ref64).float(), copy.deepcopy(new64).float()
    for mod in (ref64, new64, ref32, new32):
        mod.train(training)
    x = torch.randn(m, k, generator=gen, dtype=torch.float64) * 2 + 1
    g = torch.randn(m, n, generator=gen, dtype=torch.float64)
    out64, grads64 = forward_backward(ref64, x, g)
    out_new64, grads_new64 = forward_backward(new64, x, g)
    _, grads32 = forward_backward(ref32, x.float(), g.float())
    _, grads_new32 = forward_backward(new32, x.float(), g.float())
    torch.testing.assert_close(out_new64, out64, rtol=1e-10, atol=1e-12)
    for name, want in grads64.items():
        got = as_grad(grads_new64[name], want)
        if training and name == "gemm.bias":
            assert torch.count_nonzero(got) == 0, "grad of gemm.bias in training must be exactly zero"
            assert want.norm() <= 1e-10 * grads64["bn.bias"].norm() + 1e-300, "the oracle's bias grad is not ~0"
            assert torch.count_nonzero(as_grad(grads_new32[name], want)) == 0
            continue
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10 * want.abs().max().item(), msg=name)
        err_new, err_eager = rel_err(grads_new32[name], want), rel_err(grads32[name], want)
        assert err_new <= 2 * err_eager + GRAD_FLOOR, f"{name}: float32 err {err_new:.2e} vs eager {err_eager:.2e}"


def _unfused_bn_train(z, stats_unused, scale, bn_weight, bn_bias, eps, scale_after_bn):
    """The reference chain on z, in torch ops, for autograd: problem 33
    BatchNorm(scale * z), problem 84 scale * BatchNorm(z) (training, batch stats)."""
    u = z if scale_after_bn else scale * z
    mean = u.mean(0)
    var = ((u - mean) ** 2).mean(0)
    y = (u - mean) / torch.sqrt(var + eps) * bn_weight + bn_bias
    return scale * y if scale_after_bn else y


def _unfused_bn_eval(z, bias, scale, bn_weight, bn_bias, running_mean, running_var, eps, scale_after_bn):
    """Model's eval ops after the GEMM on z = x W^T, in torch ops, for autograd: problem 33
    BatchNorm(scale * (z + bias)), problem 84 scale * BatchNorm(z + bias) (the pre-softmax
    logits), with the running statistics."""
    u = z + bias if scale_after_bn else scale * (z + bias)
    y = (u - running_mean) / torch.sqrt(running_var + eps) * bn_weight + bn_bias
    return scale * y if scale_after_bn else y


def _bn_eval_case(m, n, one_scale, seed, device):
    """float64 (z, bias, scale, bn_weight, bn_bias, running_mean, running_var) and grad_y for
    the eval backward's contract tests: z off-centre, running statistics drawn; scale (1,)
    for one_scale, else (N,)."""
    gen = torch.Generator().manual_seed(seed)
    d = dict(dtype=torch.float64, generator=gen)
    tensors = [torch.randn(m, n, **d) * 3 + 2, torch.randn(n, **d), torch.rand(1 if one_scale else n, **d) + 0.5,
               torch.rand(n, **d) + 0.5, torch.randn(n, **d), torch.randn(n, **d), torch.rand(n, **d) + 0.5]
    return [t.to(device) for t in tensors], torch.randn(m, n, **d).to(device)


def _bn_eval_autograd(tensors, grad_y, dtype, eps, scale_after_bn):
    """Autograd of _unfused_bn_eval in dtype: gradients of (z, bias, scale, bn_weight, bn_bias)."""
    z, bias, scale, bn_weight, bn_bias = (t.to(dtype).requires_grad_(True) for t in tensors[:5])
    mean, var = (t.to(dtype) for t in tensors[5:])
    y = _unfused_bn_eval(z, bias, scale.expand(z.shape[1]), bn_weight, bn_bias, mean, var, eps, scale_after_bn)
    return torch.autograd.grad(y, (z, bias, scale, bn_weight, bn_bias), grad_y.to(dtype))


@pytest.mark.parametrize("scale_after_bn", [False, True], ids=["33", "84"])
def test_torch_bn_backward_eval_contract(scale_after_bn):
    """_torch_bn_backward_eval (= what the extension's bn_backward_eval must return)
    against autograd of Model's eval ops in float64: every output to float64 rounding."""
    tensors, grad_y = _bn_eval_case(37, 11, False, 27, "cpu")
    want = _bn_eval_autograd(tensors, grad_y, torch.float64, 1e-3, scale_after_bn)
    got = model_new._torch_bn_backward_eval(grad_y, *tensors, 1e-3, scale_after_bn)
    for name, a, w in zip(["grad_z", "grad_bias", "grad_scale", "grad_bn_weight", "grad_bn_bias"], got, want):
        torch.testing.assert_close(a, w, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("scale_after_bn", [False, True], ids=["33", "84"])
def test_torch_bn_backward_train_contract(scale_after_bn):
    """_torch_bn_backward_train (= what the extension's bn_backward_train must
    return) against autograd of the unfused BatchNorm in float64, bn_bias given
    (problem 84's grad_scale then holds bn_bias * sum_m grad_y).  Without
    bn_bias, grad_scale lacks exactly that term and nothing else changes."""
    m, n, eps = 37, 11, 1e-3
    gen = torch.Generator().manual_seed(7)
    d = dict(dtype=torch.float64, generator=gen)
    z = (torch.randn(m, n, **d) * 3 + 2).requires_grad_(True)
    scale = (torch.randn(n, **d)).requires_grad_(True)
    bn_weight = (torch.rand(n, **d) + 0.5).requires_grad_(True)
    bn_bias = (torch.randn(n, **d)).requires_grad_(True)
    grad_y = torch.randn(m, n, **d)
    y = _unfused_bn_train(z, None, scale, bn_weight, bn_bias, eps, scale_after_bn)
    want = torch.autograd.grad(y, (z, scale, bn_weight, bn_bias), grad_y)
    stats = torch.stack((z.detach().mean(0), z.detach().var(0, unbiased=False)))
    args = (grad_y, z.detach(), stats, scale.detach(), bn_weight.detach(), eps, scale_after_bn)
    got = model_new._torch_bn_backward_train(*args, bn_bias.detach())
    for name, a, b in zip(["grad_z", "grad_scale", "grad_bn_weight", "grad_bn_bias"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)
    without = model_new._torch_bn_backward_train(*args)
    if scale_after_bn:
        without[1] = without[1] + bn_bias.detach() * grad_y.sum(0)
    for name, a, b in zip(["grad_z", "grad_scale", "grad_bn_weight", "grad_bn_bias"], without, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


# ---------------------------------------------------------------------------
# Custom operators
# ---------------------------------------------------------------------------


def op_cases(device, dtype=torch.float32):
    """(name, op, args) for opcheck: every operator, both problems where the
    operator takes the flag; inputs that the operator differentiates require grad."""
    ops = model_new._OPS
    m, k, n = 9, 7, 5
    gen = torch.Generator().manual_seed(8)

    def t(*shape, grad=False, positive=False):
        v = torch.rand(*shape, generator=gen, dtype=dtype) + 0.5 if positive else torch.randn(
            *shape, generator=gen, dtype=dtype)
        return v.to(device).requires_grad_(grad)

    def params(grad):
        return [t(m, k, grad=grad), t(n, k, grad=grad), t(n, grad=grad), t(n, grad=grad),
                t(n, grad=grad, positive=True), t(n, grad=grad)]

    def buffers():
        return [t(n), t(n, positive=True), torch.tensor(3, device=device)]

    cases = [("gemm_nt", ops.gemm_nt.default, (t(m, k, grad=True), t(k, n, grad=True).t())),
             ("gemm_nn", ops.gemm_nn.default, (t(m, n), t(n, k))),
             ("gemm_tn", ops.gemm_tn.default, (t(m, n), t(m, k))),
             ("softmax_rows", ops.softmax_rows.default, (t(m, n, grad=True),))]
    for scale_after_bn in (False, True):
        tag = "84" if scale_after_bn else "33"
        cases += [
            (f"forward_train_saved-{tag}", ops.forward_train_saved.default,
             (*params(True), *buffers(), 0.1, 1e-5, scale_after_bn)),
            (f"forward_train-{tag}", ops.forward_train.default,
             (*params(False), *buffers(), -1.0, 1e-5, scale_after_bn)),
            (f"forward_eval-{tag}", ops.forward_eval.default, (*params(False), *buffers()[:2], 1e-5, scale_after_bn)),
        ]
        p = [v.detach() for v in params(False)]
        plan = model_new.dispatch(p[0], p[1], True, True, scale_after_bn)
        kernels = model_new._kernels(plan.kernels)
        _, z, stats = kernels.forward_train_saved(plan.gemm, *p, *buffers(), 0.1, 1e-5, scale_after_bn,
                                                  *model_new._weight_args(kernels, plan.gemm, p[1]))
        cases.append((f"bn_backward_train-{tag}", ops.bn_backward_train.default,
                      (t(m, n), z, stats, p[3], p[4], 1e-5, scale_after_bn)))
    return cases


OP_CASE_NAMES = ["gemm_nt", "gemm_nn", "gemm_tn", "softmax_rows"] + [f"{op}-{tag}" for tag in ("33", "84")
                               for op in ("forward_train_saved", "forward_train", "forward_eval", "bn_backward_train")]


def run_opcheck(device, case_name):
    cases = {name: (op, args) for name, op, args in op_cases(device)}
    op, args = cases[case_name]
    result = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in result.values()), result


@requires_ops
@pytest.mark.parametrize("case_name", OP_CASE_NAMES)
def test_cpu_opcheck(case_name):
    run_opcheck("cpu", case_name)


def test_operators_registered_where_custom_op_exists():
    """The operators exist exactly where torch.library.custom_op does (decided
    by hasattr at import), and a second execution of the module reuses them."""
    assert (model_new._OPS is not None) == HAS_CUSTOM_OP
    if HAS_CUSTOM_OP:
        for name in model_new._OP_SCHEMAS:
            assert hasattr(getattr(torch.ops, model_new._OP_NAMESPACE), name), name
        again = model_new._define_ops()  # would raise "already registered" if it registered again
        assert all(hasattr(again, name) for name in model_new._OP_SCHEMAS)


# ---------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------

requires_compile = pytest.mark.skipif(model_new._OPS is None or not HAS_COMPILE,
                                      reason="torch.compile through the custom operators needs torch >= 2.4")


# Compiled against eager float32, relative Frobenius: inductor reorders and
# fuses the float32 elementwise work and reductions around the operators (the
# measured differences are ~2e-7 on CPU); 1e-5 leaves room for sums of a few
# thousand terms and still fails any wrong term.
COMPILE_BOUND = 1e-5


def compile_compare(problem, training, grad, backend, device, shape, seed=10, mode=None, calls=2):
    """torch.compile(ModelNew, fullgraph=True) against eager ModelNew with the
    same state on the same inputs, `calls` calls (the second one reuses the graph;
    mode "reduce-overhead": CUDA graphs, warmed up, recorded, then replayed):
    outputs, gradients of sum(out * g) and buffers."""
    m, k, n = shape
    torch.compiler.reset()
    _, new = make_pair(problem, k, n, dtype=torch.float32, device=device, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    settle_running_stats([new], m, k, gen, device=device, dtype=torch.float32)
    new.train(training)
    twin = copy.deepcopy(new)
    compiled = torch.compile(twin, fullgraph=True, backend=backend, mode=mode)
    for call in range(calls):
        x = torch.randn(m, k, generator=gen).to(device)
        g = torch.randn(m, n, generator=gen).to(device)
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        if grad:
            out_e, grads_e = forward_backward(new, x, g)
            out_c, grads_c = forward_backward(compiled, x, g, params_of=twin)
            for name in grads_e:
                assert (grads_c[name] is None) == (grads_e[name] is None), name
                if grads_e[name] is not None:
                    assert_rel_close(grads_c[name], grads_e[name], COMPILE_BOUND, f"call {call}: grad {name}")
        else:
            with torch.no_grad():
                out_e, out_c = new(x), compiled(x)
        assert_rel_close(out_c, out_e, COMPILE_BOUND, f"call {call}: output")
        for (name, a), b in zip(new.named_buffers(), twin.buffers()):
            assert_rel_close(b.double(), a.double(), COMPILE_BOUND, f"call {call}: {name}")


@requires_compile
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("problem", ["33", "84"])
def test_cpu_compile_fullgraph(problem, training, grad, backend):
    compile_compare(problem, training, grad, backend, "cpu", (70, 40, 24))


@requires_compile
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("problem", ["33", "84"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_cpu_compile_16bit_step(dtype, problem, training):
    """torch.compile(ModelNew, fullgraph=True) of a 16-bit module on the CPU, forward +
    backward, as eager ModelNew: the operators take the torch-op functions there (their
    batch statistics are the float32 path's (2, N); the 16-bit extension's backward once
    ran for them and failed), outputs and buffers bit for bit, gradients within the 16-bit
    compiled step's 1e-2 (tests/test_lowp.py).  A per-feature scale for both problems: problem
    84's one-number scale has a gradient that cancels (a sum over M N terms), whose 16-bit
    rounding differs between any two orders of summation by more than that."""
    torch.compiler.reset()
    _, new = make_pair(problem, 40, 24, scale_shape=(24,), dtype=torch.float32, seed=4)
    new = new.to(dtype).train(training)
    twin = copy.deepcopy(new)
    compiled = torch.compile(twin, fullgraph=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(5)
    for call in range(2):
        x = torch.randn(70, 40, generator=gen).to(dtype)
        g = torch.randn(70, 24, generator=gen).to(dtype)
        out_e, grads_e = forward_backward(new, x, g)
        out_c, grads_c = forward_backward(compiled, x, g, params_of=twin)
        assert out_c.dtype == dtype and torch.equal(out_c, out_e), f"call {call}: output"
        for name in grads_e:
            assert (grads_c[name] is None) == (grads_e[name] is None), name
            if grads_e[name] is not None:
                assert grads_c[name].dtype == grads_e[name].dtype, name
                assert_rel_close(grads_c[name], grads_e[name], 1e-2, f"call {call}: grad {name}")
        for (name, a), b in zip(new.named_buffers(), twin.buffers()):
            assert torch.equal(a, b), f"call {call}: {name}"


@requires_compile
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_cpu_compiled_graph_calls_the_operators(training):
    """The graph torch.compile traces (fullgraph) holds the fused_gemm_bn::
    operators, not a decomposition of the CPU math: what runs compiled on CUDA."""
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    torch.compiler.reset()
    _, new = make_pair("33", 16, 12, dtype=torch.float32)
    new.train(training)
    compiled = torch.compile(new, fullgraph=True, backend=recording_backend)
    out = compiled(torch.randn(10, 16, requires_grad=True))
    out.sum().backward()
    assert graphs and all(p.grad is not None for p in new.parameters())
    expected = "forward_train_saved" if training else "gemm_nt"
    assert any(f"{model_new._OP_NAMESPACE}.{expected}" in text for text in graphs), graphs


# ---------------------------------------------------------------------------
# Training loops
# ---------------------------------------------------------------------------


def loss_fn(problem, out, target):
    """Mean squared error against a target for problem 33; cross entropy
    against labels for problem 84 (whose output is a probability per row)."""
    if problem == "33":
        return ((out - target) ** 2).mean()
    return -out.gather(1, target[:, None]).log().mean()


def sgd_run(problem, model, steps, data, lr=0.05):
    """`steps` SGD steps over the batches of `data`, cycled (momentum 0.9,
    weight decay 1e-4: every parameter's gradient, gemm.bias's zero included,
    enters the update); returns the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    dtype = model.gemm.weight.dtype
    losses = []
    model.train()
    for step in range(steps):
        x, target = data[step % len(data)]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(problem, model(x.to(dtype)), target.to(dtype) if target.is_floating_point() else target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64)


def sgd_data(problem, m, k, n, device, seed, batches=4):
    """A fixed training set of `batches` batches (the loop can fit it, so the loss falls)."""
    gen = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(batches):
        x = torch.randn(m, k, generator=gen, dtype=torch.float64) + 0.3
        target = (torch.randn(m, n, generator=gen, dtype=torch.float64) if problem == "33"
                  else torch.randint(0, n, (m,), generator=gen))
        data.append((x.to(device), target.to(device)))
    return data


def state_errors(a, b, ref):
    """Relative Frobenius error of every float parameter and buffer of `a` and
    of `b` against `ref`: {name: (err a, err b)}."""
    sa, sb, sr = a.state_dict(), b.state_dict(), ref.state_dict()
    return {name: (rel_err(sa[name], sr[name]), rel_err(sb[name], sr[name]))
            for name in sr if sr[name].is_floating_point() and sr[name].norm() > 0}


def check_sgd_loop(problem, device, m, k, n, steps=20):
    """20 steps of ModelNew and Model from one seed on the same data.
    float64: losses, parameters and running statistics agree to 1e-9 (both
    are float64 throughout; 20 steps of SGD amplify the ~1e-16 differences of
    summation order far less than that).  float32 (on `device`): ModelNew's
    losses and final state deviate from the float64 Model's by at most twice
    as much as the float32 Model's do (+ GRAD_FLOOR): the float32 trajectories
    drift apart from the float64 one by their rounding, amplified by the same
    dynamics, so eager float32's own drift is the yardstick."""
    data = sgd_data(problem, m, k, n, device, seed=12)
    ref64, new64 = make_pair(problem, k, n, dtype=torch.float64, device=device, seed=11)
    ref32, new32 = copy.deepcopy(ref64).float(), copy.deepcopy(new64).float()
    loss_ref64 = sgd_run(problem, ref64, steps, data)
    if device == "cpu":
        loss_new64 = sgd_run(problem, new64, steps, data)
        torch.testing.assert_close(loss_new64, loss_ref64, rtol=1e-9, atol=0)
        for name, (err, _) in state_errors(new64, new64, ref64).items():
            assert err <= 1e-9, f"float64 {name}: {err:.2e}"
        assert torch.equal(new64.bn.num_batches_tracked, ref64.bn.num_batches_tracked)
    loss_ref32 = sgd_run(problem, ref32, steps, data)
    loss_new32 = sgd_run(problem, new32, steps, data)
    assert loss_ref64[-1] < loss_ref64[0], "the loop does not train: the comparison would be vacuous"
    err_loss_new = ((loss_new32 - loss_ref64).abs() / loss_ref64.abs()).max().item()
    err_loss_eager = ((loss_ref32 - loss_ref64).abs() / loss_ref64.abs()).max().item()
    print(f"\n[sgd] {problem} {device} float32 losses: max rel err ModelNew {err_loss_new:.2e}, "
          f"eager {err_loss_eager:.2e}")
    assert err_loss_new <= 2 * err_loss_eager + GRAD_FLOOR
    for name, (err_new, err_eager) in state_errors(new32, ref32, ref64).items():
        print(f"[sgd] {problem} {device} float32 {name}: ModelNew {err_new:.2e}, eager {err_eager:.2e}")
        assert err_new <= 2 * err_eager + GRAD_FLOOR, name
    assert torch.equal(new32.bn.num_batches_tracked.cpu(), torch.tensor(steps))


@pytest.mark.parametrize("problem", ["33", "84"])
def test_cpu_sgd_loop(problem, path):
    check_sgd_loop(problem, "cpu", 48, 40, 24)


# ---------------------------------------------------------------------------
# Inputs, needed gradients, double backward
# ---------------------------------------------------------------------------


def check_inputs_and_needed_grads(problem, training, device, dtype, shape):
    """x and the parameters unchanged by forward + backward (buffers change only
    in training); with scale and bn.weight frozen and x not requiring grad,
    those get no gradient and the others the same as with all; gradients add
    into an existing .grad.  "The same": equal on CPU; on CUDA within 1e-6
    relative Frobenius (a kernel's reduction order may differ from call to call)."""
    m, k, n = shape
    _, new = make_pair(problem, k, n, dtype=dtype, device=device, seed=13)
    gen = torch.Generator().manual_seed(14)
    settle_running_stats([new], m, k, gen, device=device, dtype=dtype)
    new.train(training)

    def assert_same(a, b, what):
        if device == "cpu":
            assert torch.equal(a, b), what
        else:
            assert_rel_close(a, b, 1e-6, what)

    state = {name: t.clone() for name, t in new.state_dict().items()}
    x = torch.randn(m, k, generator=gen, dtype=dtype).to(device)
    g = torch.randn(m, n, generator=gen, dtype=dtype).to(device)
    x_before = x.clone()
    _, full = forward_backward(new, x, g)
    assert torch.equal(x, x_before), "x modified"
    after = new.state_dict()
    for name, value in state.items():
        updated = training and (name.startswith("bn.running_") or name == "bn.num_batches_tracked")
        if not updated:
            assert torch.equal(after[name], value), f"{name} modified by forward + backward"
    new.load_state_dict(state)
    new.zero_grad(set_to_none=True)
    new.scale.requires_grad_(False)
    new.bn.weight.requires_grad_(False)
    x_plain = x.clone()
    (new(x_plain) * g).sum().backward()
    assert x_plain.grad is None and new.scale.grad is None and new.bn.weight.grad is None
    params = dict(new.named_parameters())
    for name in ("gemm.weight", "gemm.bias", "bn.bias"):
        assert_same(params[name].grad, full[name], name)
    new.load_state_dict(state)
    new.scale.requires_grad_(True)
    new.bn.weight.requires_grad_(True)
    for p in new.parameters():
        p.grad = torch.ones_like(p)
    (new(x) * g).sum().backward()
    for name, p in new.named_parameters():
        assert_same(p.grad, 1 + full[name], f"{name} accumulated")


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("problem", ["33", "84"])
def test_cpu_inputs_unmodified_and_needed_grads_only(problem, training, path):
    check_inputs_and_needed_grads(problem, training, "cpu", torch.float64, (20, 12, 9))


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_cpu_double_backward_raises(training):
    _, new = make_pair("33", 6, 5)
    new.train(training)
    x = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(new(x).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        gx.sum().backward()


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------

GPU_SHAPES = [(64, 96, 80), (300, 1000, 520), (257, 1028, 130), (1024, 8192, 8192)]


@pytest.fixture(params=GEMM_PATHS)
def gemm_path(request, monkeypatch):
    """The kernel the device dispatches to, 3xTF32 on Hopper, and the portable one."""
    monkeypatch.setattr(model_new, "SWITCHES", gemm_switches(request.param))
    return request.param


def gpu_models(problem, k, n, seed=20):
    """(float64 Model, float32 Model, float32 ModelNew) on cuda with one state."""
    ref64, new64 = make_pair(problem, k, n, dtype=torch.float64, device="cuda", seed=seed)
    return ref64, copy.deepcopy(ref64).float(), new64.float()


@requires_cuda
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("m,k,n", GPU_SHAPES)
@pytest.mark.parametrize("problem", ["33", "84"])
def test_gpu_gradients_vs_float64(problem, m, k, n, training, fp32_matmul, gemm_path):
    ref64, ref32, new = gpu_models(problem, k, n)
    gen = torch.Generator().manual_seed(21)
    settle_running_stats([ref64, ref32, new], m, k, gen, device="cuda")
    for mod in (ref64, ref32, new):
        mod.train(training)
    x = (torch.rand(m, k, generator=gen, dtype=torch.float64) * 2).cuda()
    g = torch.randn(m, n, generator=gen, dtype=torch.float64).cuda()
    out64, grads64 = forward_backward(ref64, x, g)
    out32, grads32 = forward_backward(ref32, x.float(), g.float())
    out_new, grads_new = forward_backward(new, x.float(), g.float())
    mode = "train" if training else "eval"
    print(f"\n[grad] {problem} {gemm_path} ({m},{k},{n}) {mode}: out err ModelNew {rel_err(out_new, out64):.2e} "
          f"eager {rel_err(out32, out64):.2e}")
    for name, want in grads64.items():
        if training and name == "gemm.bias":
            ours = as_grad(grads_new[name], want)
            print(f"[grad]   gemm.bias: ModelNew max |g| {ours.abs().max().item():.1e}, eager "
                  f"{grads32[name].abs().max().item():.1e}, float64 {want.abs().max().item():.1e}")
            assert torch.count_nonzero(ours) == 0, "grad of gemm.bias in training must be exactly zero"
            assert want.norm() <= 1e-10 * grads64["bn.bias"].norm(), "the float64 oracle's bias grad is not ~0"
            continue
        err_new, err_eager = rel_err(grads_new[name], want), rel_err(grads32[name], want)
        print(f"[grad]   {name:12s} err ModelNew {err_new:.2e}  eager fp32 {err_eager:.2e}")
        assert math.isfinite(err_new)
        assert err_new <= 2 * err_eager + GRAD_FLOOR, name


@requires_cuda
@pytest.mark.parametrize("scale_after_bn", [False, True], ids=["33", "84"])
def test_gpu_forward_train_saved_contract(scale_after_bn, gemm_path):
    """forward_train_saved: out and running statistics as forward_train's, z =
    x weight^T (no bias), stats = (mean, biased variance) of z, float32, to
    float32 accuracy against float64."""
    ext = model_new._ext
    m, k, n = 257, 1028, 130
    gen = torch.Generator().manual_seed(22)
    d = dict(generator=gen)
    x, w = torch.rand(m, k, **d).cuda(), (torch.randn(n, k, **d) / 30).cuda()
    vecs = [torch.randn(n, **d).cuda() for _ in range(4)]
    buffers = [torch.zeros(n).cuda(), torch.ones(n).cuda(), torch.zeros((), dtype=torch.long).cuda()]
    twin = [b.clone() for b in buffers]
    gemm = model_new.dispatch(x, w, True, False, scale_after_bn).gemm
    gemm_saved = model_new.dispatch(x, w, True, True, scale_after_bn).gemm
    out = ext.forward_train(gemm, x, w, *vecs, *buffers, 0.1, 1e-5, scale_after_bn, None)
    out_s, z, stats = ext.forward_train_saved(gemm_saved, x, w, *vecs, *twin, 0.1, 1e-5, scale_after_bn, None)
    # The same math; forward_train may take the cluster-fused kernel, whose rounding differs in the last bits.
    assert_rel_close(out_s, out, 1e-6, "out")
    for name, a, b in zip(["running_mean", "running_var"], twin, buffers):
        assert_rel_close(a, b, 1e-6, name)
    assert torch.equal(twin[2], buffers[2]) and int(buffers[2]) == 1
    z64 = x.double() @ w.double().t()
    assert z.shape == (m, n) and z.dtype == torch.float32 and stats.shape == (2, n) and stats.dtype == torch.float32
    assert rel_err(z, z64) <= 2 * rel_err(x @ w.t(), z64) + GRAD_FLOOR
    torch.testing.assert_close(stats[0].double(), z64.mean(0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats[1].double(), z64.var(0, unbiased=False), rtol=1e-5, atol=1e-6)


@requires_cuda
@pytest.mark.parametrize("scale_after_bn", [False, True], ids=["33", "84"])
def test_gpu_forward_train_saved_small_m_centred(scale_after_bn, monkeypatch):
    """forward_train_saved on small_m_fp64 (7 rows, x with a large mean: z's mean is far
    from its spread): out and running statistics as forward_train's (same kernel,
    same bits), and the backward's inputs centred: z - stats[0] is z - mean_z within
    0.5 ulp of its float64 value plus the float64 GEMM's error (far below a float32 z
    minus a float32 mean), stats[0] = 0, stats[1] the biased variance."""
    if torch.cuda.get_device_capability() not in model_new._FULL_RATE_FP64:
        pytest.skip("small_m_fp64 runs on sm_80 and sm_90 only")
    monkeypatch.setattr(model_new, "SWITCHES", model_new.SWITCHES._replace(small_m=True))
    ext = model_new._ext
    m, k, n = 7, 1028, 130
    gen = torch.Generator().manual_seed(24)
    d = dict(generator=gen)
    x, w = (torch.rand(m, k, **d) + 100).cuda(), (torch.randn(n, k, **d) / 30).cuda()
    vecs = [torch.randn(n, **d).cuda() for _ in range(4)]
    buffers = [torch.zeros(n).cuda(), torch.ones(n).cuda(), torch.zeros((), dtype=torch.long).cuda()]
    twin = [b.clone() for b in buffers]
    assert model_new.dispatch(x, w, True, True, scale_after_bn).gemm == "small_m_fp64"
    out = ext.forward_train("small_m_fp64", x, w, *vecs, *buffers, 0.1, 1e-5, scale_after_bn, None)
    out_s, z, stats = ext.forward_train_saved("small_m_fp64", x, w, *vecs, *twin, 0.1, 1e-5, scale_after_bn, None)
    assert torch.equal(out_s, out) and all(torch.equal(a, b) for a, b in zip(twin, buffers))
    z64 = x.double() @ w.double().t()
    centred = z64 - z64.mean(0)
    assert torch.equal(stats[0], torch.zeros_like(stats[0]))
    gemm_err = (k + 8) * 2 ** -53 * (x.double().abs() @ w.double().abs().t()).max()  # z64's, and mean64's
    err = (z.double() - centred).abs()
    assert (err <= centred.abs() * 2 ** -24 + 2 * gemm_err).all(), (err.max().item(), gemm_err.item())
    # What it replaces: a float32 z minus a float32 mean, about |z| 2^-24 off: 10x the bound here.
    assert ((z64.float().double() - z64.mean(0).float().double()) - centred).abs().max() > 10 * err.max()
    torch.testing.assert_close(stats[1].double(), z64.var(0, unbiased=False), rtol=1e-6, atol=1e-9)


@requires_cuda
@pytest.mark.parametrize("layout", ["contiguous", "a_transposed", "b_transposed", "both_transposed", "strided"])
@pytest.mark.parametrize("m,k,n", [(257, 1028, 130), (1024, 8192, 8192), (33, 37, 515)])
def test_gpu_gemm_nt_any_strides(m, k, n, layout, fp32_matmul):
    """gemm_nt(a, b) = a b^T for a (M, K), b (N, K) of any strides (the backward
    passes grad_z^T and x^T views): error against float64 at most 2x torch's float32."""
    gen = torch.Generator().manual_seed(23)
    a = torch.randn(m, k, generator=gen).cuda()
    b = torch.randn(n, k, generator=gen).cuda()
    if layout in ("a_transposed", "both_transposed"):
        a = a.t().contiguous().t()
    if layout in ("b_transposed", "both_transposed"):
        b = b.t().contiguous().t()
    if layout == "strided":
        a = torch.zeros(m, 2 * k, device="cuda")[:, ::2].copy_(a)
    out = model_new._ext.gemm_nt(model_new.dispatch_gemm_nt(a, b), a, b, None)
    ref64 = a.double() @ b.double().t()
    err_new, err_eager = rel_err(out, ref64), rel_err(a @ b.t(), ref64)
    print(f"\n[gemm_nt] ({m},{k},{n}) {layout}: err {err_new:.2e}, torch fp32 {err_eager:.2e}")
    assert out.shape == (m, n) and out.is_contiguous()
    assert err_new <= 2 * err_eager + GRAD_FLOOR


# (M, N, K) of the backward's products: tile tails, a batch below one tile, M
# odd (grad_W's reduction), and N or K not a multiple of 8 (the transposed-copy route).
# (40, 8200, 136): rows of grad z longer than 8192, the pre-passes' loop forms (not held in registers).
BACKWARD_PRODUCT_SHAPES = [(64, 96, 80), (300, 1000, 520), (33, 136, 520), (1024, 8192, 8192), (257, 130, 1028),
                           (130, 1028, 136), (40, 8200, 136)]


def fp16x3_backward_route(m, n, k):
    """Whether gemm_nn / gemm_tn read their operands in place (MN-major) here."""
    on_hopper = torch.cuda.get_device_capability() == (9, 0) and model_new._ext.sm90_gemm_available(0)
    return on_hopper and not model_new.SWITCHES.portable and n % 8 == 0 and k % 8 == 0


@requires_cuda
@pytest.mark.parametrize("layout", ["contiguous", "a_transposed", "strided"])
@pytest.mark.parametrize("m,n,k", BACKWARD_PRODUCT_SHAPES)
def test_gpu_gemm_nn_tn(m, n, k, layout, fp32_matmul):
    """gemm_nn(a, b) = a b (grad_x = grad_z W) and gemm_tn(a, c) = a^T c
    (grad_W = grad_z^T x) for a (M, N), b (N, K), c (M, K), a of any strides:
    error against float64 at most 2x torch's float32 (+ GRAD_FLOOR), with and
    without b's cached fp16x3 parts; on Hopper with N, K multiples of 8 the
    launches are the pre-passes and the GEMM only (no transposed copies)."""
    gen = torch.Generator().manual_seed(29)
    a = torch.randn(m, n, generator=gen).cuda()
    b = torch.randn(n, k, generator=gen).cuda()
    c = torch.randn(m, k, generator=gen).cuda()
    if layout == "a_transposed":
        a = a.t().contiguous().t()
    if layout == "strided":
        a = torch.zeros(m, 2 * n, device="cuda")[:, ::2].copy_(a)
    a_before, b_before, c_before = a.clone(), b.clone(), c.clone()
    in_place = fp16x3_backward_route(m, n, k)
    gemm_nn = model_new.dispatch_gemm_nt(a, b.t())
    gemm_tn = model_new.dispatch_gemm_tn(a, c)
    parts = model_new._ext.fp16x3_weight_parts(b) if in_place else None
    for name, run, ref64, eager in [
            ("gemm_nn", lambda: model_new._ext.gemm_nn(gemm_nn, a, b, None), a.double() @ b.double(), a @ b),
            ("gemm_nn cached", lambda: model_new._ext.gemm_nn(gemm_nn, a, b, parts), a.double() @ b.double(), a @ b),
            ("gemm_tn", lambda: model_new._ext.gemm_tn(gemm_tn, a, c), a.double().t() @ c.double(), a.t() @ c)]:
        out = run()
        err_new, err_eager = rel_err(out, ref64), rel_err(eager, ref64)
        print(f"\n[{name}] ({m},{n},{k}) {layout} {gemm_nn if name != 'gemm_tn' else gemm_tn}: err {err_new:.2e}, "
              f"torch fp32 {err_eager:.2e}")
        assert out.shape == ref64.shape and out.is_contiguous() and out.dtype == torch.float32
        assert err_new <= 2 * err_eager + GRAD_FLOOR, name
    assert torch.equal(a, a_before) and torch.equal(b, b_before) and torch.equal(c, c_before)
    if in_place:
        assert gemm_nn.startswith("sm90_fp16x3") and gemm_tn.startswith("sm90_fp16x3")
        names_nn = launched_kernels(lambda: model_new._ext.gemm_nn(gemm_nn, a, b, parts))
        names_tn = launched_kernels(lambda: model_new._ext.gemm_tn(gemm_tn, a, c))
        contiguous = layout == "contiguous"
        expected_nn = ["sm90_prepass_fp16x3_scaled_kernel", "sm90_gemm_fp16x3_bn_kernel"]
        expected_tn = ["sm90_prepass_fp16x3_columns_kernel"] * 2 + ["sm90_gemm_fp16x3_bn_kernel"]
        for names, expected in ((names_nn, expected_nn), (names_tn, expected_tn)):
            assert len(names) == len(expected) + (0 if contiguous else 1), names  # + a's row copy otherwise
            for fragment in expected:
                assert any(fragment in n_ for n_ in names), (fragment, names)


# (m, n, k) of a (m, n), b (n, k), c (m, k), d (m, k): outputs a b (m, k), a^T c (n, k) and
# d b^T (m, n), whose rows are a multiple of 4 floats (grad W's staged TMA stores; tiles
# partial in rows and columns) or not (per-element stores: gemm_nn's and gemm_tn's at
# (40, 96, 102), gemm_nt's at (257, 130, 1028)).
WRITE_EVERY_ELEMENT_SHAPES = [(33, 136, 520), (40, 96, 102), (257, 130, 1028), (130, 1028, 136), (24, 8192, 4096)]


@requires_cuda
@pytest.mark.parametrize("m,n,k", WRITE_EVERY_ELEMENT_SHAPES)
def test_gpu_plain_products_write_every_element(m, n, k, fp32_matmul):
    """gemm_nn, gemm_tn and gemm_nt write every element of their output: each runs once,
    its output is filled with NaN and freed, and the next call's output reuses that block
    (asserted: else the check would be vacuous), holds no NaN and is within
    test_gpu_gemm_nn_tn's bar of float64."""
    gen = torch.Generator().manual_seed(31)
    a = torch.randn(m, n, generator=gen).cuda()
    b = torch.randn(n, k, generator=gen).cuda()
    c = torch.randn(m, k, generator=gen).cuda()
    d = torch.randn(m, k, generator=gen).cuda()
    gemm_nn = model_new.dispatch_gemm_nt(a, b.t())
    gemm_tn = model_new.dispatch_gemm_tn(a, c)
    gemm_nt = model_new.dispatch_gemm_nt(d, b)
    for name, run, ref64, eager in [
            ("gemm_nn", lambda: model_new._ext.gemm_nn(gemm_nn, a, b, None), a.double() @ b.double(), a @ b),
            ("gemm_tn", lambda: model_new._ext.gemm_tn(gemm_tn, a, c), a.double().t() @ c.double(), a.t() @ c),
            ("gemm_nt", lambda: model_new._ext.gemm_nt(gemm_nt, d, b, None), d.double() @ b.double().t(), d @ b.t())]:
        poison = run()
        poison.fill_(float("nan"))
        poisoned_ptr = poison.data_ptr()
        del poison
        out = run()
        torch.cuda.synchronize()
        assert out.data_ptr() == poisoned_ptr, f"{name}: the output did not reuse the poisoned block"
        unwritten = int(torch.isnan(out).sum())
        assert unwritten == 0, f"{name}: {unwritten} of {out.numel()} output elements not written"
        err_new, err_eager = rel_err(out, ref64), rel_err(eager, ref64)
        print(f"\n[{name}] ({m},{n},{k}) out {tuple(out.shape)}: err {err_new:.2e}, torch fp32 {err_eager:.2e}")
        assert err_new <= 2 * err_eager + GRAD_FLOOR, name


@requires_cuda
@pytest.mark.parametrize("scale_after_bn", [False, True], ids=["33", "84"])
@pytest.mark.parametrize("m,n", [(257, 130), (1024, 8192), (2, 5)])
def test_gpu_bn_backward_train_contract(scale_after_bn, m, n):
    """The extension's bn_backward_train against autograd of the unfused
    BatchNorm in float64, bn.bias passed (problem 84's grad_scale holds
    bn_bias * sum_m grad_y): each output's error at most 2x that of the float32
    autograd."""
    gen = torch.Generator().manual_seed(24)
    d = dict(dtype=torch.float64, generator=gen)
    z64 = (torch.randn(m, n, **d) * 3 + 2).cuda()
    vecs64 = [torch.randn(n, **d).cuda(), (torch.rand(n, **d) + 0.5).cuda(), torch.randn(n, **d).cuda()]
    grad_y64 = torch.randn(m, n, **d).cuda()
    eps = 1e-5

    def autograd_grads(dtype):
        z = z64.to(dtype).requires_grad_(True)
        scale, bn_weight, bn_bias = (v.to(dtype).requires_grad_(True) for v in vecs64)
        y = _unfused_bn_train(z, None, scale, bn_weight, bn_bias, eps, scale_after_bn)
        return torch.autograd.grad(y, (z, scale, bn_weight, bn_bias), grad_y64.to(dtype))

    want, eager = autograd_grads(torch.float64), autograd_grads(torch.float32)
    z = z64.float()
    stats = torch.stack((z64.mean(0), z64.var(0, unbiased=False))).float()
    got = list(model_new._ext.bn_backward_train(grad_y64.float(), z, stats, vecs64[0].float(), vecs64[1].float(),
                                                eps, scale_after_bn, vecs64[2].float()))
    for name, a, e, w in zip(["grad_z", "grad_scale", "grad_bn_weight", "grad_bn_bias"], got, eager, want):
        err_new, err_eager = rel_err(a, w), rel_err(e, w)
        print(f"\n[bn_backward_train] {'84' if scale_after_bn else '33'} ({m},{n}) {name}: err {err_new:.2e}, "
              f"torch fp32 autograd {err_eager:.2e}")
        assert a.shape == w.shape and a.dtype == torch.float32
        assert err_new <= 2 * err_eager + GRAD_FLOOR, name


@requires_cuda
@pytest.mark.parametrize("one_scale", [False, True], ids=["N-scales", "one-scale"])
@pytest.mark.parametrize("scale_after_bn", [False, True], ids=["33", "84"])
@pytest.mark.parametrize("m,n", [(257, 130), (1024, 8192), (4, 8192), (1, 5)])
def test_gpu_bn_backward_eval_contract(scale_after_bn, one_scale, m, n):
    """The extension's bn_backward_eval against autograd of Model's eval ops in float64
    (running statistics drawn, z off-centre): each output's error at most 2x that of
    the float32 autograd + GRAD_FLOOR; a one-number scale (viewed as N, stride 0) gets
    [its gradient, 0, ..., 0]."""
    tensors, grad_y = _bn_eval_case(m, n, one_scale, 26, "cuda")
    eps = 1e-5
    want = _bn_eval_autograd(tensors, grad_y, torch.float64, eps, scale_after_bn)
    eager = _bn_eval_autograd(tensors, grad_y, torch.float32, eps, scale_after_bn)
    f32 = [t.float() for t in tensors]
    if one_scale:
        f32[2] = f32[2].expand(n)
    got = list(model_new._ext.bn_backward_eval(grad_y.float(), *f32, eps, scale_after_bn))
    if one_scale:
        assert torch.count_nonzero(got[2][1:]) == 0
        got[2] = got[2][:1]
    for name, a, e, w in zip(["grad_z", "grad_bias", "grad_scale", "grad_bn_weight", "grad_bn_bias"], got, eager,
                             want):
        err_new, err_eager = rel_err(a, w), rel_err(e, w)
        print(f"\n[bn_backward_eval] {'84' if scale_after_bn else '33'} ({m},{n}) {name}: err {err_new:.2e}, "
              f"torch fp32 autograd {err_eager:.2e}")
        assert a.shape == w.shape and a.dtype == torch.float32
        assert err_new <= 2 * err_eager + GRAD_FLOOR, name


@requires_cuda
@pytest.mark.parametrize("scale_after_bn", [False, True], ids=["33", "84"])
@pytest.mark.parametrize("m,n", [(16, 8192), (1024, 8192), (3, 1001), (2, 1)])
def test_gpu_bn_backward_train_one_scale(scale_after_bn, m, n):
    """A one-number scale viewed as N (stride 0, as per_feature_scale passes it): grad_scale is
    [g, 0, ..., 0], g the float64 sum over the features of the kernel's per-feature terms
    rounded once, so within half an ulp (+ float64 noise) of that sum computed here in float64
    from the same float32 inputs and statistics; the other outputs bit-identical to the call
    with the scale copied to N floats (the per-feature path), whose grad_scale sums to g within
    its own float32 rounding (printed: the error this removes)."""
    gen = torch.Generator().manual_seed(25)
    d = dict(dtype=torch.float64, generator=gen)
    z = (torch.randn(m, n, **d) * 3 + 2).float().cuda()
    bn_weight, bn_bias = (torch.rand(n, **d) + 0.5).float().cuda(), torch.randn(n, **d).float().cuda()
    grad_y = torch.randn(m, n, **d).float().cuda()
    one = torch.tensor([0.75], device="cuda")
    eps = 1e-5
    stats = torch.stack((z.double().mean(0), z.double().var(0, unbiased=False))).float()
    got = model_new._ext.bn_backward_train(grad_y, z, stats, one.expand(n), bn_weight, eps, scale_after_bn, bn_bias)
    per_feature = model_new._ext.bn_backward_train(grad_y, z, stats, one.expand(n).contiguous(), bn_weight, eps,
                                                   scale_after_bn, bn_bias)
    for name, a, b in zip(["grad_z", "grad_bn_weight", "grad_bn_bias"], got[:1] + got[2:],
                          per_feature[:1] + per_feature[2:]):
        assert torch.equal(a, b), name
    assert torch.count_nonzero(got[1][1:]) == 0
    torch.testing.assert_close(got[1].sum(), per_feature[1].sum(), rtol=1e-5, atol=1e-6)
    # The terms in float64 from the kernel's inputs (finish_feature's formulas).
    g64, zc, var = grad_y.double(), (z - stats[0]).double(), stats[1].double()  # z - mu in float32, as the kernel
    s1, s2 = g64.sum(0), (g64 * zc).sum(0)
    s, gamma, beta = 0.75, bn_weight.double(), bn_bias.double()
    eps = float(torch.tensor(eps, dtype=torch.float32))  # as the kernel reads it
    if scale_after_bn:
        sigma = torch.sqrt(var + eps)
        terms = gamma * s2 / sigma + beta * s1
    else:
        sigma2 = s * s * var + eps
        terms = gamma * s2 * eps / (sigma2 * torch.sqrt(sigma2))
    want = terms.sum().item()
    ulp = 2.0 ** (math.frexp(torch.tensor(want, dtype=torch.float32).item())[1] - 24)  # float32's, at want
    err = abs(got[1][0].item() - want)
    err_per_feature = abs(per_feature[1].sum().item() - want)
    print(f"\n[one scale] {'84' if scale_after_bn else '33'} ({m},{n}): |error| {err / ulp:.2f} ulp, per-feature "
          f"terms summed in float32 {err_per_feature / ulp:.2f} ulp")
    assert err <= 0.5 * ulp + 1e-12 * terms.abs().sum().item()


@requires_cuda
@pytest.mark.parametrize("layout", ["contiguous", "grad_transposed"])
@pytest.mark.parametrize("m,n", [(1024, 8192), (257, 132), (5, 8196), (257, 130), (3, 1001), (1, 7)])
def test_gpu_softmax_rows_backward(m, n, layout):
    """The extension's softmax_rows_backward (problem 84's row softmax backward)
    against float64: error at most 2x torch ops' float32 error + GRAD_FLOOR;
    the register kernel (n % 4 == 0, n <= 8192), the 16-byte loop (n = 8196) and
    the 4-byte loop, a transposed grad_out (copied);
    _softmax_rows_backward takes it for plain float32 CUDA tensors (the result is
    the kernel's, bit for bit); negative control: a kernel that dropped the row
    term s_m would fail the bound."""
    gen = torch.Generator().manual_seed(7)
    out64 = torch.softmax(torch.randn(m, n, dtype=torch.float64, generator=gen) * 3, dim=1).cuda()
    g64 = torch.randn(m, n, dtype=torch.float64, generator=gen).cuda()
    want = out64 * (g64 - (g64 * out64).sum(1, keepdim=True))
    out, g = out64.float(), g64.float()
    if layout == "grad_transposed":
        g = g.t().contiguous().t()
    got = model_new._ext.softmax_rows_backward(out, g)
    eager = out * (g - (g * out).sum(1, keepdim=True))
    err_new, err_eager = rel_err(got, want), rel_err(eager, want)
    print(f"\n[softmax_rows_backward] ({m},{n}) {layout}: err {err_new:.2e}, torch ops fp32 {err_eager:.2e}")
    assert got.shape == (m, n) and got.dtype == torch.float32 and got.is_contiguous()
    assert torch.isfinite(got).all()
    assert err_new <= 2 * err_eager + GRAD_FLOOR
    assert torch.equal(model_new._softmax_rows_backward(out, g), got)
    assert rel_err(out * g, want) > 2 * err_eager + GRAD_FLOOR  # the control
    # Each element out * (g - s_m) from these float32 inputs, s_m unrounded, rounded once (no
    # rounding shared by a row: 2^-24 relative, and a float32 rounding's slack); torch's form
    # (s_m and g - s_m rounded first, emulated exactly) misses that bound where g is near s_m.
    o64, gi64 = out.double(), g.double()
    s64 = (o64 * gi64).sum(1, keepdim=True)
    exact = o64 * (gi64 - s64)
    bound = 2.0 ** -23 * exact.abs() + 1e-45
    assert ((got.double() - exact).abs() <= bound).all()
    row_rounded = (o64 * (gi64 - s64.float().double()).float().double()).float().double()
    assert n < 64 or ((row_rounded - exact).abs() > bound).any()


@requires_cuda
@requires_ops
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("problem", ["33", "84"])
def test_gpu_ops_path_matches_function_path(problem, training, monkeypatch):
    """The operators' registered autograd gives the autograd.Functions' outputs,
    gradients and buffers (the same extension calls, in the same order)."""
    m, k, n = 300, 1000, 520
    _, _, new = gpu_models(problem, k, n)
    new.train(training)
    twin = copy.deepcopy(new)
    gen = torch.Generator().manual_seed(25)
    x = torch.rand(m, k, generator=gen).cuda()
    g = torch.randn(m, n, generator=gen).cuda()
    out_f, grads_f = forward_backward(new, x, g)
    monkeypatch.setattr(model_new, "SWITCHES", model_new.SWITCHES._replace(eager_ops=True))
    out_o, grads_o = forward_backward(twin, x, g)
    # The same calls in the same order; a kernel's reduction order may still vary between calls.
    assert_rel_close(out_o, out_f, 1e-6, "output")
    for name in grads_f:
        assert (grads_o[name] is None) == (grads_f[name] is None), name
        if grads_f[name] is not None:
            assert_rel_close(grads_o[name], grads_f[name], 1e-6, f"grad {name}")
    for (name, a), b in zip(new.named_buffers(), twin.buffers()):
        assert_rel_close(b.double(), a.double(), 1e-6, name)


@requires_cuda
@requires_ops
@pytest.mark.parametrize("case_name", OP_CASE_NAMES)
def test_gpu_opcheck(case_name):
    run_opcheck("cuda", case_name)


@requires_cuda
@requires_compile
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("problem", ["33", "84"])
def test_gpu_compile_inductor(problem, training, grad):
    """torch.compile(ModelNew, fullgraph=True, inductor) on CUDA, against eager ModelNew."""
    compile_compare(problem, training, grad, "inductor", "cuda", (257, 1028, 130))


@requires_cuda
@requires_compile
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("problem", ["33", "84"])
def test_gpu_compile_cuda_graphs(problem, training):
    """torch.compile(mode="reduce-overhead"): the compiled forward + backward as CUDA
    graphs (warm-up, recording, three replays), against eager ModelNew.  The weight
    cache kept the fp16x3 parts made during the warm-up, which runs on the graphs'
    own stream into their memory pool, and the recording failed ("Detected 1
    tensor(s) in the cudagraph pool not tracked as outputs"): parts are kept only
    for work on the device's default stream (model_new._weight_parts)."""
    compile_compare(problem, training, True, "inductor", "cuda", (257, 1028, 130), mode="reduce-overhead", calls=5)


@requires_cuda
@pytest.mark.parametrize("problem", ["33", "84"])
def test_gpu_sgd_loop(problem, fp32_matmul):
    check_sgd_loop(problem, "cuda", 256, 1028, 130)


@requires_cuda
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("problem", ["33", "84"])
def test_gpu_inputs_unmodified(problem, training, path):
    check_inputs_and_needed_grads(problem, training, "cuda", torch.float32, (257, 1028, 130))


# The first call a process ever makes, under torch.compile: a cache the forward fills lazily
# (a dict of dtypes once did) makes dynamo guard on its state during tracing, and the guard fails
# on its own frame (AssertionError "Guard failed on the same frame it was created").  Every test in
# a suite process runs after others have filled such caches, so this one starts a fresh process.
# Bounds as compile_compare's (float32) and test_lowp's compiled training step (16-bit gradients).
_FIRST_CALL_UNDER_COMPILE = r"""
import copy, torch
import model_new
from level2_84_gemm_batchnorm_scaling_softmax import model_new as model_new_84
classes = {"33": model_new.ModelNew, "84": model_new_84.ModelNew}
init = {"33": (64, 40, (40,)), "84": (64, 40, 1e-5, 0.1, (1,))}
cases = [(p, d, t) for d in (torch.float16, torch.bfloat16, torch.float32) for p in ("84", "33")
         for t in (True, False)]
def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()
results = []
for problem, dtype, training in cases:  # every call compiled before any eager call
    torch._dynamo.reset()  # one module instance a case: past dynamo's recompile limit otherwise
    torch.manual_seed(0)
    new = classes[problem](*init[problem]).to("cuda", dtype).train(training)
    twin = copy.deepcopy(new)
    x = torch.randn(33, 64, generator=torch.Generator().manual_seed(1)).to("cuda", dtype).requires_grad_(True)
    out = torch.compile(new, fullgraph=True)(x)
    out.float().square().sum().backward()
    results.append((twin, x, out.detach(), [x.grad] + [p.grad for p in new.parameters()],
                    [b.clone() for b in new.buffers()]))
for (problem, dtype, training), (twin, x, out, grads, buffers) in zip(cases, results):
    where = f"{problem} {dtype} {'train' if training else 'eval'}"
    bound = 1e-5 if dtype == torch.float32 else 1e-2
    xe = x.detach().clone().requires_grad_(True)
    oute = twin(xe)
    oute.float().square().sum().backward()
    assert rel(out, oute) <= (1e-5 if dtype == torch.float32 else 0), (where, rel(out, oute))
    for got, want in zip(grads, [xe.grad] + [p.grad for p in twin.parameters()]):
        assert (got is None) == (want is None), where
        assert got is None or rel(got, want) <= bound, (where, rel(got, want))
    assert all(rel(a, b) <= (1e-5 if dtype == torch.float32 else 0) for a, b in zip(buffers, twin.buffers())), where
print("ok", len(cases))
"""


@requires_cuda
@requires_compile
def test_gpu_compile_first_call_of_a_fresh_process():
    """torch.compile(ModelNew, fullgraph=True) as a process's first call of each problem and
    dtype (float16, bfloat16, float32; train and eval; forward + backward) runs, and gives what
    eager ModelNew gives (16-bit outputs and buffers bit for bit)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", _FIRST_CALL_UNDER_COMPILE], cwd=repo, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok 12"), (r.stdout + r.stderr)[-3000:]
