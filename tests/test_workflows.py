"""PyTorch workflows a drop-in meets, both problems, on CPU (CI) and where noted
on the GPU: ModelNew behaves as Model does, or raises a clear error.

  - bn.training decides: `model.bn.eval()` inside a training model normalises
    with the running statistics and leaves them alone (Model's BatchNorm1d
    does); `model.eval(); model.bn.train()` the reverse; forward, gradients and
    buffers against Model in float64
  - every per-feature scale shape Model broadcasts ((), (1,), (1, 1), (N,),
    (1, N)) gives Model's output and a gradient of the parameter's shape; a
    per-row or 3-D scale raises RuntimeError and leaves the buffers alone
  - bad ranks raise Model's exception types (0-D: RuntimeError, 1-D / 4-D:
    ValueError with BatchNorm1d's message), 3-D a RuntimeError; buffers untouched
  - the raw training operators refuse a batch of fewer than 2 rows (ValueError,
    buffers untouched); the operators without gradients refuse, at the call,
    inputs that require grad
  - torch.export.export with a dynamic batch dimension, train and eval
  - on a GPU: the fused float32 kernels follow bn.training (against float32 Model)
  - torch.jit.trace with its default settings records the custom operators and
    generalises over the batch size, with no warning from this project (torch
    >= 2.4; without them tracing raises); torch.jit.script raises a
    RuntimeError that says what to use
"""
import copy
import os
import warnings

import pytest
import torch

import model_new
from tests.problems import DEFAULT, PROBLEMS, REPO, make_pair

F64 = torch.float64
requires_ops = pytest.mark.skipif(model_new._OPS is None, reason="no custom operators (torch < 2.4)")
M, K, N = 24, 20, 12


def pair(problem, scale_shape=DEFAULT, seed=0):
    """(Model, ModelNew) in float64 with one state."""
    return make_pair(PROBLEMS[problem], seed, K, N, scale_shape=scale_shape, dtype=F64)


def states_equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def forward_backward(module, x):
    x = x.clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    out = module(x)
    g = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    (out * g).sum().backward()
    grads = {"x": x.grad, **{name: p.grad for name, p in module.named_parameters()}}
    return out.detach(), grads


def warm_up(ref, new, steps=2):
    """A few training steps so the running statistics are not the initial 0 / 1."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _ in range(steps):
            x = torch.rand(M, K, generator=gen, dtype=F64)
            ref(x)
            new(x)


@pytest.mark.parametrize("pattern", ["bn_eval_in_train", "bn_train_in_eval"])
@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_bn_training_flag_decides(problem, pattern):
    ref, new = pair(problem)
    warm_up(ref, new)
    for module in (ref, new):
        if pattern == "bn_eval_in_train":
            module.train()
            module.bn.eval()
        else:
            module.eval()
            module.bn.train()
    x = torch.rand(M, K, generator=torch.Generator().manual_seed(6), dtype=F64) + 0.5
    out_ref, grads_ref = forward_backward(ref, x)
    out_new, grads_new = forward_backward(new, x)
    torch.testing.assert_close(out_new, out_ref, rtol=1e-10, atol=1e-12)
    for name, want in grads_ref.items():
        torch.testing.assert_close(grads_new[name], want, rtol=1e-8, atol=1e-12, msg=name)
    for (name, a), b in zip(new.named_buffers(), ref.buffers()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)
    path = new.kernel_path(x)
    assert path.startswith("torch_ops_" + ("eval" if pattern == "bn_eval_in_train" else "train")), path


GOOD_SCALES = [(), (1,), (1, 1), (N,), (1, N)]
BAD_SCALES = [(M, 1), (M, N), (1, 1, N), (2, N)]


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("scale_shape", GOOD_SCALES, ids=[str(s) for s in GOOD_SCALES])
@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_per_feature_scale_shapes_broadcast_as_model(problem, scale_shape, training):
    ref, new = pair(problem, scale_shape=scale_shape)
    with torch.no_grad():
        ref.scale.copy_(torch.rand(scale_shape, dtype=F64) + 0.5)
        new.scale.copy_(ref.scale)
    ref.train(training)
    new.train(training)
    x = torch.rand(M, K, generator=torch.Generator().manual_seed(7), dtype=F64)
    out_ref, grads_ref = forward_backward(ref, x)
    out_new, grads_new = forward_backward(new, x)
    torch.testing.assert_close(out_new, out_ref, rtol=1e-10, atol=1e-12)
    assert grads_new["scale"].shape == new.scale.shape == ref.scale.shape
    torch.testing.assert_close(grads_new["scale"], grads_ref["scale"], rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("scale_shape", BAD_SCALES, ids=[str(s) for s in BAD_SCALES])
@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_non_per_feature_scale_raises_clearly(problem, scale_shape):
    _, new = pair(problem, scale_shape=scale_shape)
    before = {k: v.clone() for k, v in new.state_dict().items()}
    with pytest.raises(RuntimeError, match="one number or one per feature"):
        new(torch.rand(M, K, dtype=F64))
    assert all(torch.equal(v, before[k]) for k, v in new.state_dict().items())


BAD_RANKS = {"0d": (), "1d": (K,), "3d": (3, M, K), "4d": (2, 3, M, K)}


@pytest.mark.parametrize("rank", sorted(BAD_RANKS))
@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_bad_rank_raises_models_exception_type(problem, rank):
    ref, new = pair(problem)
    x = torch.rand(BAD_RANKS[rank], dtype=F64) if BAD_RANKS[rank] else torch.tensor(0.5, dtype=F64)
    before = {k: v.clone() for k, v in new.state_dict().items()}
    with pytest.raises(Exception) as got:
        new(x)
    assert all(torch.equal(v, before[k]) for k, v in new.state_dict().items())
    if rank == "3d":  # Model normalises over dim 1 here, or fails on its length; ModelNew says why it refuses
        assert got.type is RuntimeError and "3D input" in str(got.value)
        return
    with pytest.raises(Exception) as want:
        ref(x)
    assert got.type is want.type, (got.value, want.value)
    assert str(got.value) == str(want.value)


@requires_ops
@pytest.mark.parametrize("op", ["forward_train", "forward_train_saved"])
@pytest.mark.parametrize("m", [0, 1])
def test_raw_training_operators_refuse_small_batches(op, m):
    _, new = pair("33")
    bn = new.bn
    args = (torch.rand(m, K, dtype=F64), new.gemm.weight.detach(), new.gemm.bias.detach(), new.scale.detach(),
            bn.weight.detach(), bn.bias.detach(), bn.running_mean, bn.running_var, bn.num_batches_tracked, 0.1, 1e-5,
            False)
    before = {k: v.clone() for k, v in new.state_dict().items()}
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        getattr(model_new._OPS, op)(*args)
    assert all(torch.equal(v, before[k]) for k, v in new.state_dict().items())


@requires_ops
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_jit_trace_generalises_over_batch(problem, training, grad):
    """Traced at batch 16 with torch.jit.trace's default settings (its check
    re-records the module under no_grad: one graph for both grad modes), called
    at batch 40 and 7: the traced module gives eager ModelNew's output and
    buffers (the operators are in the graph).  No warning comes from the
    project's files."""
    _, new = pair(problem)
    new.train(training)
    twin = copy.deepcopy(new)
    gen = torch.Generator().manual_seed(8)
    with torch.set_grad_enabled(grad), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced = torch.jit.trace(twin, torch.rand(16, K, generator=gen, dtype=F64))
    ours = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if os.path.abspath(w.filename).startswith(REPO)]
    assert not ours, ours
    new_ref = copy.deepcopy(new)
    # the trace ran the module once: bring the reference to the same state
    with torch.set_grad_enabled(grad):
        new_ref.load_state_dict(twin.state_dict())
        for m in (40, 7) if training else (40, 7, 0):
            x = torch.rand(m, K, generator=gen, dtype=F64)
            out_traced = traced(x)
            out_eager = new_ref(x)
            assert out_traced.shape == (m, N)
            torch.testing.assert_close(out_traced, out_eager, rtol=1e-10, atol=1e-12)
            if grad and m > 0:
                out_traced.sum().backward()
    for (name, a), b in zip(new_ref.named_buffers(), traced.buffers()):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_jit_script_raises_clearly(problem):
    _, new = pair(problem)
    with pytest.raises(RuntimeError, match="torch.jit.script does not support ModelNew"):
        torch.jit.script(new)


@pytest.mark.skipif(model_new._OPS is not None, reason="this torch has the custom operators")
def test_jit_trace_without_operators_raises_clearly():
    _, new = pair("33")
    with pytest.raises(RuntimeError, match="torch.jit.trace of ModelNew needs"):
        torch.jit.trace(new, torch.rand(16, K, dtype=F64))


requires_export = pytest.mark.skipif(model_new._OPS is None or not hasattr(torch, "export"),
                                     reason="torch.export and the custom operators need torch >= 2.4")


@requires_export
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_torch_export_dynamic_batch(problem, training):
    """torch.export.export with a dynamic batch dimension, exported at batch 16:
    the program holds the fused_gemm_bn:: operators and, called at batches 40
    and 7, gives eager ModelNew's output and running statistics."""
    from torch.export import Dim, export
    _, new = pair(problem)
    new.train(training)
    gen = torch.Generator().manual_seed(9)
    program = export(copy.deepcopy(new), (torch.rand(16, K, generator=gen, dtype=F64),),
                     dynamic_shapes={"x": {0: Dim("batch", min=2)}})
    targets = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert any(t.startswith(model_new._OP_NAMESPACE + ".") for t in targets), targets
    exported = program.module()
    for m in (40, 7):
        x = torch.rand(m, K, generator=gen, dtype=F64)
        torch.testing.assert_close(exported(x), new(x), rtol=1e-10, atol=1e-12)
    for name, want in new.named_buffers():
        torch.testing.assert_close(exported.get_buffer(name), want, rtol=1e-10, atol=1e-12, msg=name)


@requires_ops
@pytest.mark.parametrize("op", ["forward_train", "forward_eval", "bn_backward_train"])
def test_raw_operators_without_gradients_refuse_inputs_that_require_grad(op):
    """An operator with no autograd formula refuses, at the call, inputs that
    require grad with grad mode on (before, the output required grad and failed
    only at backward); the caller's buffers stay as they were; under no_grad it runs."""
    _, new = pair("33")
    bn = new.bn
    x = torch.rand(M, K, dtype=F64, requires_grad=True)
    vecs = (new.gemm.weight, new.gemm.bias, new.scale, bn.weight, bn.bias)
    if op == "forward_train":
        args = (x, *vecs, bn.running_mean, bn.running_var, bn.num_batches_tracked, 0.1, 1e-5, False)
    elif op == "forward_eval":
        args = (x, *vecs, bn.running_mean, bn.running_var, 1e-5, False)
    else:
        z = torch.rand(M, N, dtype=F64)
        stats = torch.stack((z.mean(0), z.var(0, unbiased=False)))
        args = (torch.rand(M, N, dtype=F64, requires_grad=True), z, stats, new.scale, bn.weight, 1e-5, False)
    before = {k: v.clone() for k, v in new.state_dict().items()}
    with pytest.raises(RuntimeError, match=f"{model_new._OP_NAMESPACE}::{op} has no autograd formula"):
        getattr(model_new._OPS, op)(*args)
    assert all(torch.equal(v, before[k]) for k, v in new.state_dict().items())
    with torch.no_grad():
        getattr(model_new._OPS, op)(*args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("pattern", ["bn_eval_in_train", "bn_train_in_eval"])
@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_gpu_bn_training_flag_decides(problem, pattern, grad, fp32_matmul):
    """The fused float32 kernels follow bn.training too: output within the
    suite's GPU tolerance of float32 Model's, buffers as Model's, the path's mode."""
    m, k, n = 256, 512, 384
    ref, new = make_pair(PROBLEMS[problem], 0, k, n, device="cuda", dtype=torch.float32)
    gen = torch.Generator(device="cuda").manual_seed(10)
    with torch.no_grad():
        for _ in range(2):
            x = torch.rand(m, k, device="cuda", generator=gen)
            ref(x)
            new(x)
    for module in (ref, new):
        module.train(pattern == "bn_eval_in_train")
        module.bn.train(pattern == "bn_train_in_eval")
    x = torch.rand(m, k, device="cuda", generator=gen)
    with torch.set_grad_enabled(grad):
        path = new.kernel_path(x)
        out_ref, out_new = ref(x), new(x)
    assert ("_train" in path) == (pattern == "bn_train_in_eval"), path
    torch.testing.assert_close(out_new.detach(), out_ref.detach(), **PROBLEMS[problem].gpu_out_tol)
    for (name, a), b in zip(new.named_buffers(), ref.buffers()):
        torch.testing.assert_close(a, b, **PROBLEMS[problem].gpu_buf_tol, msg=name)
