"""ModelNew under torch.autocast (docs/design.md "Mixed precision (`torch.autocast`)") on Model's own ops
(the path of CPUs, GPUs other than Hopper, and SWITCHES.autocast_fused off):
the same outputs, dtypes, running statistics, num_batches_tracked and
gradients as Model under the same autocast, bit for bit, on the CPU (bfloat16
autocast: runs in CI) and on CUDA (float16 and bfloat16, the fused path
switched off).  Which calls take the fused kernels instead (model_new_autocast.fused_gemm)
is checked here on simulated GPUs; tests/test_autocast_fused.py compares the
fused path with Model.

Negative control: ModelNew outside autocast (its float32 path) is not equal to
Model under autocast, so the equality tests can fail.
"""
import pytest
import torch

import model_new
import model_new_autocast
from tests.problems import BOTH, assert_state_equal, make_pair, requires_cuda, snapshot

K, N, M = 48, 40, 16


def _run(model, x, g, grad):
    """(output, {parameter name: gradient}) of one call (and its backward when grad)."""
    model.zero_grad(set_to_none=True)
    if not grad:
        with torch.no_grad():
            return model(x), {}
    out = model(x)
    (out.float() * g).sum().backward()
    return out.detach(), {name: p.grad for name, p in model.named_parameters()}


def _compare(problem, device, dtype, training, grad, momentum=0.1, bn_eval=False, steps=3):
    ref, new = make_pair(problem, 0, K, N, momentum=momentum, device=device, scale="random")
    for module in (ref, new):
        module.train(training)
        if bn_eval:
            module.bn.eval()
    gen = torch.Generator().manual_seed(7)
    for step in range(steps):
        x = (torch.rand(M, K, generator=gen) * 2 - 1).to(device)
        g = torch.randn(M, N, generator=gen).to(device)
        with torch.autocast(device, dtype=dtype):
            with torch.set_grad_enabled(grad):
                path = new.kernel_path(x)
            out_ref, grads_ref = _run(ref, x, g, grad)
            out_new, grads_new = _run(new, x, g, grad)
        assert path == "torch_ops_autocast_" + ("train" if new.bn.training else "eval") + ("_grad" if grad else "")
        assert out_new.dtype == out_ref.dtype and torch.equal(out_new, out_ref), f"step {step}: output"
        assert grads_new.keys() == grads_ref.keys()
        for name in grads_ref:
            assert torch.equal(grads_new[name], grads_ref[name]), f"step {step}: grad of {name}"
        assert_state_equal(snapshot(new), snapshot(ref), f"step {step}")
    return ref, new


@pytest.mark.parametrize("problem", BOTH)
@pytest.mark.parametrize("training,grad", [(True, True), (True, False), (False, True), (False, False)],
                         ids=["train_grad", "train", "eval_grad", "eval"])
def test_cpu_autocast_matches_model(problem, training, grad):
    _compare(problem, "cpu", torch.bfloat16, training, grad)


@pytest.mark.parametrize("problem", BOTH)
def test_cpu_autocast_momentum_none_and_frozen_bn(problem):
    _compare(problem, "cpu", torch.bfloat16, True, True, momentum=None)
    _compare(problem, "cpu", torch.bfloat16, True, True, bn_eval=True)


@pytest.mark.parametrize("problem", BOTH)
def test_cpu_float32_path_differs_from_autocast(problem):
    """Negative control: without autocast ModelNew computes in float32, which is
    not Model under autocast."""
    ref, new = make_pair(problem, 0, K, N, scale="random")
    x = torch.rand(M, K, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out_ref = ref(x)
        out_new = new(x)
        assert new.kernel_path(x) == "torch_ops_train"
    assert not torch.equal(out_new.to(out_ref.dtype), out_ref)


@pytest.mark.parametrize("problem", BOTH)
def test_cpu_autocast_bad_input_raises_model_errors_and_keeps_buffers(problem):
    ref, new = make_pair(problem, 0, K, N)
    before = snapshot(new)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
            new(torch.rand(1, K))
        with pytest.raises(ValueError, match="expected 2D or 3D input"):
            new(torch.rand(2, 3, 4, K))
        with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
            new(torch.rand(4, K + 1))
    assert_state_equal(snapshot(new), before, "after the errors")


@pytest.mark.parametrize("problem", BOTH)
def test_autocast_off_inside_autocast_region_uses_kernels_path(problem):
    """torch.autocast(enabled=False) inside an autocast region: ModelNew's own path again."""
    _, new = make_pair(problem, 0, K, N)
    x = torch.rand(M, K)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.autocast("cpu", enabled=False):
            assert new.kernel_path(x) == "torch_ops_train_grad"


@pytest.fixture
def ops_path(monkeypatch):
    """Model's ops under autocast on every GPU (the fused kernels switched off)."""
    monkeypatch.setattr(model_new, "SWITCHES", model_new.SWITCHES._replace(autocast_fused=False))


@requires_cuda
@pytest.mark.parametrize("problem", BOTH)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("training,grad", [(True, True), (True, False), (False, True), (False, False)],
                         ids=["train_grad", "train", "eval_grad", "eval"])
def test_gpu_autocast_matches_model(problem, dtype, training, grad, ops_path):
    _compare(problem, "cuda", dtype, training, grad)


@requires_cuda
@pytest.mark.parametrize("problem", BOTH)
def test_gpu_autocast_16bit_input_and_frozen_bn(problem, ops_path):
    """A float16 input under bfloat16 autocast (autocast casts it), and bn.eval()."""
    ref, new = make_pair(problem, 0, K, N, device="cuda", scale="random")
    x = torch.rand(M, K, device="cuda").to(torch.float16)
    for module in (ref, new):
        module.bn.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        out_ref, out_new = ref(x), new(x)
    assert out_new.dtype == out_ref.dtype and torch.equal(out_new, out_ref)


@pytest.mark.requires_torch_compile
@pytest.mark.parametrize("problem", BOTH)
def test_cpu_autocast_under_torch_compile(problem):
    """torch.compile(fullgraph=True) of ModelNew under autocast: Model's result."""
    if not hasattr(torch, "compile"):
        pytest.skip("torch.compile needs torch >= 2.0")
    ref, new = make_pair(problem, 0, K, N, scale="random")
    compiled = torch.compile(new, backend="aot_eager", fullgraph=True)
    x = torch.rand(M, K, generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ref, out_new = ref(x), compiled(x)
    assert out_new.dtype == out_ref.dtype and torch.equal(out_new, out_ref)
    assert_state_equal(snapshot(new), snapshot(ref), "after the compiled call")


class _FakeCudaInput:
    """What model_new_autocast.fused_gemm reads off x, for a simulated CUDA call."""
    is_cuda = True

    def __init__(self, m, k, dtype):
        self.shape, self.dtype, self.device = (m, k), dtype, torch.device("cuda", 0)


HOPPER = model_new.DeviceFacts(capability=(9, 0), num_sms=132, sm90_gemm=True)
AMPERE = model_new.DeviceFacts(capability=(8, 0), num_sms=108, sm90_gemm=False)


@pytest.mark.parametrize("problem", BOTH)
def test_cpu_autocast_fused_decision(problem):
    """model_new_autocast.fused_gemm: a float32 module on Hopper with float32 or 16-bit x
    under float16 / bfloat16 autocast takes the fused kernels (training lowp_sm90, with
    gradients the fused training step; eval at 16 rows with in_features a multiple of 8
    lowp_small_m, with gradients lowp_cublas); Model's ops (None) off Hopper,
    with SWITCHES.portable or autocast_fused off, for a 16-bit module, for an empty
    batch, and for x of another dtype."""
    _, new = make_pair(problem, 0, K, N)
    on = model_new.SWITCHES._replace(portable=False, autocast_fused=True)

    def decide(x, dtype=torch.bfloat16, facts=HOPPER, switches=on, module=new, grad=False):
        return model_new_autocast.fused_gemm(x, module.gemm, module.scale, module.bn, dtype, grad, facts, switches)

    for x_dtype in (torch.float32, torch.float16, torch.bfloat16):
        for dtype in (torch.float16, torch.bfloat16):
            assert decide(_FakeCudaInput(M, K, x_dtype), dtype) == "lowp_sm90"
    x = _FakeCudaInput(M, K, torch.float32)
    assert decide(x, facts=AMPERE) is None
    assert decide(x, grad=True) == "lowp_sm90"  # training: the fused step (model_new_lowp.forward_autocast_grad)
    new.eval()
    assert decide(x, grad=True) == "lowp_cublas"  # eval with gradients: forward_eval_saved's float32-vector form
    assert decide(x, grad=True, facts=AMPERE) is None
    assert decide(x) == "lowp_small_m"
    new.train()
    assert decide(x, switches=on._replace(portable=True)) is None
    assert decide(x, switches=on._replace(autocast_fused=False)) is None
    assert decide(_FakeCudaInput(0, K, torch.float32)) is None
    assert decide(_FakeCudaInput(M, K, torch.float64)) is None
    assert decide(torch.rand(M, K)) is None  # a CPU tensor
    assert decide(x, module=new.to(torch.bfloat16)) is None


def test_cpu_autocast_route_by_shape():
    """model_new_autocast.route in eval without gradients: lowp_small_m where the 16-bit
    modules' rule takes it (model_new_lowp.hopper_gemm: 1-32 rows with in_features a
    multiple of 8; not where SWITCHES.lowp_gemm forces another route), else lowp_sm90, also
    where that rule takes lowp_cublas (33 x 8192 x 8192, 257 x 300 x 1000: docs/perf.md
    v109).  Elsewhere the shape does not matter: lowp_sm90 in training, lowp_cublas in eval
    with gradients."""
    on = model_new.SWITCHES._replace(portable=False, autocast_fused=True)

    def route(m, k, n, grad=False, switches=on, training=False):
        return model_new_autocast.route(torch.float16, training, grad, HOPPER, switches, m, n, k)

    for m in (1, 8, 9, 16, 17, 32):
        assert route(m, 8192, 8192) == "lowp_small_m", m
    assert route(32, 300, 1000) == "lowp_sm90"  # in_features not a multiple of 8
    for m, k, n in ((33, 8192, 8192), (257, 300, 1000)):  # the 16-bit modules' lowp_cublas
        assert model_new.extra("model_new_lowp").hopper_gemm(m, n, k, False, HOPPER, on) == "lowp_cublas"
        assert route(m, k, n) == "lowp_sm90"
    assert route(1024, 8192, 8192) == "lowp_sm90"
    assert route(16, 8192, 8192, switches=on._replace(lowp_gemm="cublas")) == "lowp_sm90"
    for m, k, n in ((16, 8192, 8192), (257, 300, 1000), (1024, 8192, 8192)):
        assert route(m, k, n, grad=True) == "lowp_cublas"
        for grad in (False, True):
            assert route(m, k, n, grad=grad, training=True) == "lowp_sm90"
            assert route(m, k, n, grad=grad, training=True, switches=on._replace(lowp_gemm="cublas")) == "lowp_sm90"
    assert model_new_autocast.route(torch.float16, False, False, AMPERE, on, 16, 8192, 8192) is None
