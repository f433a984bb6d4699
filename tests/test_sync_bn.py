"""Synchronized BatchNorm (nn.SyncBatchNorm.convert_sync_batchnorm) for both
problems, on CPU with two processes on gloo (CI); the processes are
tests/sync_bn_workers.py's (spawned, K = 48, N = 40, five SGD steps).

  - conversion: model.bn becomes a SyncBatchNorm holding the same parameter and
    buffer objects; the state_dict keys are converted Model's; containers
    (nn.Sequential, nn.ModuleDict) holding a ModelNew convert; BatchNormState
    itself is a parameter container (calling it raises), with BatchNorm1d's
    repr, input check and loading of state dicts without num_batches_tracked
  - one process (torch.distributed not initialized): a converted ModelNew is
    the unconverted one (SyncBatchNorm's own need_sync decision)
  - training against the single-process equal of data-parallel training with
    synchronized BatchNorm (Model, plain BatchNorm1d, on the concatenated batch,
    loss (1 / world) sum_r loss_r; Model's SyncBatchNorm itself refuses CPU
    tensors): each rank's output slice at every step, every parameter after
    every step, the first step's averaged gradients, the running statistics and
    num_batches_tracked at the end; float64 (rtol 1e-10) and float32 (within
    TOL of that Model's float32 run, or elementwise no further from its float64
    run than the float32 one is, + TOL: two float32 trajectories that round
    differently drift apart over the steps), even
    (24 + 24) and uneven (30 + 14) batches, a rank with one row, a rank with
    none, momentum=None, an explicit process group of both ranks; one
    all_gather per training forward and one all_reduce per backward
  - bfloat16 (the 16-bit path: GEMM in bfloat16, the rest in float32): outputs,
    parameters and buffers against Model in float64 from the same state, no
    further off than Model's own bfloat16 run (x 1.25, + 2^-8)
  - negative control: the unconverted ModelNew under DDP (per-process batch
    statistics) does not match that reference
  - process_group honoured: a group of one rank each gives the unconverted
    module's results, with no collective
  - bn.eval() in a training module: no collective, running statistics used
    (Model's output and gradients on the local batch), buffers unchanged
  - a merged batch of one row raises BatchNorm's ValueError on every rank, buffers unchanged
  - the self-contained files: conversion leaves them per-process, and a
    training call under two processes warns once (the repository's file never does)
"""
import copy
import io
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn

import model_new
from tests import sync_bn_workers as workers
from tests.harness import PROBLEMS as FILES, read
from tests.problems import PROBLEMS, make_pair

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with the gloo backend")

WORLD = workers.WORLD
# (rtol, atol) per dtype: float64 is rounding only; float32 compares two float32
# computations that round differently (Model's BatchNorm1d, ours in float64 statistics).
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=2e-4, atol=2e-5)}


def _close(actual, expected, tol, where):
    torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"{where}: {m}")


def _no_further_than_eager(actual, eager, oracle, tol, where):
    """Each element of actual no further from the float64 oracle than eager's (Model in
    float32) is, + atol + rtol |oracle|: passes wherever assert_close(actual, eager, tol)
    would (triangle inequality), and also where actual is the closer of the two to float64."""
    a, e, o = actual.double(), eager.double(), oracle.double()
    excess = (a - o).abs() - ((e - o).abs() + tol["atol"] + tol["rtol"] * o.abs())
    bad = ~(excess <= 0)  # (NaN counts as bad)
    assert not bad.any(), (f"{where}: {int(bad.sum())} of {bad.numel()} elements further from float64 than "
                           f"Model's float32 run + tolerance; worst excess {excess.max().item():.3e}")


def _load(out_dir, name):
    return [torch.load(out_dir / f"{name}.rank{rank}.pt") for rank in range(WORLD)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """{scenario name: [rank 0's record, rank 1's]} (sync_bn_workers._train_rank), one spawn for all."""
    out_dir = tmp_path_factory.mktemp("sync_bn_train")
    workers.spawn(workers.train_worker, out_dir, str(out_dir), workers.RUNNABLE)
    return {name: _load(out_dir, name) for name in workers.RUNNABLE}


def _runnable(name):
    if name not in workers.RUNNABLE:
        pytest.skip("a CUDA scenario: needs a GPU")


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("sync_bn_checks")
    workers.spawn(workers.checks_worker, out_dir, str(out_dir))
    return _load(out_dir, "checks")


# ---------------------------------------------------------------------------
# Conversion (one process)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_conversion_shares_parameters_and_buffers(problem):
    ref, new = make_pair(PROBLEMS[problem], 0, 12, 10, dtype=torch.float64)
    bn = new.bn
    tensors = {name: t for name, t in list(bn.named_parameters()) + list(bn.named_buffers())}
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(new)
    assert converted is new and type(new.bn) is nn.SyncBatchNorm
    for name, t in list(new.bn.named_parameters()) + list(new.bn.named_buffers()):
        assert t is tensors[name], name
    assert (new.bn.eps, new.bn.momentum, new.bn.training) == (bn.eps, bn.momentum, bn.training)
    assert list(new.state_dict()) == list(nn.SyncBatchNorm.convert_sync_batchnorm(ref).state_dict())
    assert list(new.state_dict()) == list(ref.state_dict())


def test_conversion_of_containers():
    _, a = make_pair(PROBLEMS["33"], 0, 12, 10)
    _, b = make_pair(PROBLEMS["84"], 1, 12, 10)
    seq = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(a, nn.Identity()))
    assert type(seq[0].bn) is nn.SyncBatchNorm
    group = object()  # never used in one process: conversion only stores it
    tree = nn.SyncBatchNorm.convert_sync_batchnorm(nn.ModuleDict({"b": nn.Sequential(b)}), process_group=group)
    assert type(tree["b"][0].bn) is nn.SyncBatchNorm and tree["b"][0].bn.process_group is group


@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_converted_without_distributed_is_unconverted(problem):
    """torch.distributed not initialized here: SyncBatchNorm's own rule says no
    synchronization, and the converted module takes the usual paths (same
    outputs, gradients, buffers, kernel_path)."""
    assert not (dist.is_available() and dist.is_initialized())
    _, plain = make_pair(PROBLEMS[problem], 2, 12, 10, dtype=torch.float64, scale="random")
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(plain))
    x = torch.rand(9, 12, dtype=torch.float64)
    for module in (plain, converted):
        module.zero_grad(set_to_none=True)
        module(x).pow(2).sum().backward()
    assert converted.kernel_path(x) == plain.kernel_path(x) == "torch_ops_train_grad"
    for (name, a), b in zip(converted.named_parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad), name
    for (name, a), b in zip(converted.named_buffers(), plain.buffers()):
        assert torch.equal(a, b), name


@pytest.mark.min_torch("2.2", reason="BatchNorm1d.load_state_dict resets a missing num_batches_tracked to 0 "
                                      "before pytorch/pytorch#110850")
def test_batch_norm_state_is_a_container():
    _, new = make_pair(PROBLEMS["33"], 0, 12, 10)
    bn = new.bn
    with pytest.raises(RuntimeError, match="computes nothing itself"):
        bn(torch.rand(4, 10))
    assert repr(bn) == ("BatchNormState(10, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)")
    bn._check_input_dim(torch.rand(4, 10))
    with pytest.raises(ValueError, match=r"expected 2D or 3D input \(got 1D input\)"):
        bn._check_input_dim(torch.rand(10))
    # a state dict from before num_batches_tracked (no version metadata): the counter keeps its value, as BatchNorm1d's
    state = {k: v for k, v in new.state_dict().items() if k != "bn.num_batches_tracked"}
    twin = copy.deepcopy(new)
    twin.bn.num_batches_tracked.fill_(7)
    twin.load_state_dict(state)
    assert int(twin.bn.num_batches_tracked) == 7
    for module in (pickle.loads(pickle.dumps(new)), copy.deepcopy(new)):
        assert type(module.bn) is type(bn) and list(module.state_dict()) == list(new.state_dict())
    buffer = io.BytesIO()
    torch.save(nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(new)), buffer)
    buffer.seek(0)
    assert type(torch.load(buffer, weights_only=False).bn) is nn.SyncBatchNorm


# ---------------------------------------------------------------------------
# Two processes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", workers.SYNCHRONIZED)
def test_synchronized_training_equals_global_batch(trained, name):
    _runnable(name)
    sc = workers.SCENARIOS[name]
    ref = workers.reference_run(sc)
    tol = TOL[sc.dtype]
    # float32: also the float64 run of the same state and data (None: float64, rounding only)
    oracle = workers.reference_run(sc, torch.float64) if sc.dtype != torch.float64 else None

    def close(actual, pick, tol, where):
        """actual against pick(ref), Model's run in sc.dtype (and pick(oracle) for float32)."""
        if oracle is None:
            _close(actual, pick(ref), tol, where)
        else:
            _no_further_than_eager(actual, pick(ref), pick(oracle), tol, where)

    for rank, got in enumerate(trained[name]):
        where = f"{name} rank {rank}"
        assert got["bn_type"] == "SyncBatchNorm"
        if sc.split[rank] == 0:
            assert got["kernel_path"] == "empty_sync_train_grad"
        elif sc.device == "cpu":
            assert got["kernel_path"] == "torch_ops_sync_train_grad"
        else:  # <gemm>_sync_fused_train_grad: the fused kernels (>= 2 rows), unless switched off
            fused = sc.fused and sc.split[rank] >= 2
            assert got["kernel_path"].endswith("_sync_fused_train_grad" if fused else "_sync_train_grad"), where
            assert got["kernel_path"].endswith("_sync_train_grad") != fused, where
        assert got["forward_collectives"] == [{"all_gather": 1, "all_reduce": 0}] * workers.STEPS, where
        assert got["backward_collectives"] == [{"all_gather": 0, "all_reduce": 1}] * workers.STEPS, where
        rows = workers.rows(sc, rank)
        for step in range(workers.STEPS):
            close(got["out"][step], lambda r: r["out"][step][rows], tol, f"{where} step {step} output")
            for key in ref["params"][step]:
                close(got["params"][step][key], lambda r: r["params"][step][key], tol, f"{where} step {step} {key}")
        for key in ref["grads"]:
            # gemm.bias: 0 on every rank (its gradient sums to 0 over the ranks); Model's is rounding noise
            atol = max(tol["atol"], 1e-12 * ref["grads"]["gemm.weight"].abs().max().item())
            close(got["grads"][key], lambda r: r["grads"][key], dict(rtol=tol["rtol"], atol=atol),
                  f"{where} first step grad {key}")
        assert torch.count_nonzero(got["grads"]["gemm.bias"]) == 0
        for key in ref["buffers"]:
            close(got["buffers"][key], lambda r: r["buffers"][key], tol, f"{where} {key}")


@pytest.mark.skipif(not workers.GLOO_BFLOAT16, reason="this torch's gloo cannot all_reduce bfloat16 (torch 2.0.1: "
                                                     "'Invalid scalar type'), which the bfloat16 scenarios need")
@pytest.mark.parametrize("name", workers.LOWP)
def test_synchronized_16bit_as_accurate_as_model(trained, name):
    """Error against float64 (Model from the same bfloat16 state and data):
    ours <= 1.25 x Model-in-bfloat16's + 2^-8, for the last step's output, every
    parameter and the running statistics; both printed."""
    sc = workers.SCENARIOS[name]
    oracle, eager = workers.reference_run(sc, torch.float64), workers.reference_run(sc)

    def err(t, ref):
        return ((t.double() - ref).abs().max() / ref.abs().max()).item()

    last = workers.STEPS - 1
    for rank, got in enumerate(trained[name]):
        rows = workers.rows(sc, rank)
        pairs = {"output": (got["out"][last], eager["out"][last][rows], oracle["out"][last][rows])}
        pairs.update({k: (got["params"][last][k], eager["params"][last][k], oracle["params"][last][k])
                      for k in oracle["params"][last]})
        pairs.update({k: (got["buffers"][k], eager["buffers"][k], oracle["buffers"][k])
                      for k in ("bn.running_mean", "bn.running_var")})
        for key, (ours, model, ref) in pairs.items():
            e_ours, e_model = err(ours, ref), err(model, ref)
            print(f"[bfloat16] {name} rank {rank} {key}: ours {e_ours:.2e}  Model bfloat16 {e_model:.2e}")
            assert e_ours <= 1.25 * e_model + 2.0 ** -8, key
        assert torch.equal(got["buffers"]["bn.num_batches_tracked"], eager["buffers"]["bn.num_batches_tracked"])


@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_unconverted_does_not_match_global_batch(trained, problem):
    """Negative control: per-process batch statistics (DDP without conversion)
    miss the reference's running statistics and outputs by far more than the tolerance."""
    name = f"{problem}-f64-unconverted"
    ref = workers.reference_run(workers.SCENARIOS[name])
    for got in trained[name]:
        assert got["bn_type"] == "BatchNormState" and got["kernel_path"] == "torch_ops_train_grad"
        diff = (got["buffers"]["bn.running_var"] - ref["buffers"]["bn.running_var"]).abs().max().item()
        assert diff > 1e-3 * ref["buffers"]["bn.running_var"].abs().max().item()
        assert not torch.allclose(got["buffers"]["bn.running_mean"], ref["buffers"]["bn.running_mean"], rtol=1e-3)


@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_process_group_of_one_rank_is_per_process(trained, problem):
    """convert_sync_batchnorm(model, group of this rank alone): SyncBatchNorm's
    rule gives no synchronization, so the run is the unconverted one's (which
    ran under DDP, whose buffer broadcast from rank 0 before each forward makes
    rank 1's final running statistics differ: those are compared on rank 0)."""
    own, unconverted = trained[f"{problem}-f64-own_group"], trained[f"{problem}-f64-unconverted"]
    for rank in range(WORLD):
        got, want = own[rank], unconverted[rank]
        assert got["bn_type"] == "SyncBatchNorm" and got["kernel_path"] == "torch_ops_train_grad"
        assert all(c == {"all_gather": 0, "all_reduce": 0} for c in got["forward_collectives"])
        for step in range(workers.STEPS):
            _close(got["out"][step], want["out"][step], TOL[torch.float64], f"rank {rank} step {step} output")
            for key in want["params"][step]:
                _close(got["params"][step][key], want["params"][step][key], TOL[torch.float64], key)
        for key in want["buffers"] if rank == 0 else ():
            _close(got["buffers"][key], want["buffers"][key], TOL[torch.float64], key)


@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_frozen_batch_norm_never_communicates(checks, problem):
    for rank, result in enumerate(checks):
        got = result[f"frozen-{problem}"]
        assert got["collectives"] == {"all_gather": 0, "all_reduce": 0}
        assert got["kernel_path"] == "torch_ops_eval_grad"
        for key, before in got["buffers_before"].items():
            assert torch.equal(got["buffers_after"][key], before), key
        sc = workers.Scenario(problem, torch.float64, (24, 24))
        ref, _ = workers.models(sc)
        ref.load_state_dict(got["buffers_before"], strict=False)
        ref.train()
        ref.bn.eval()
        x, g = (t[workers.rows(sc, rank)] for t in workers.batches(sc)[0])
        out = ref(x)
        (out * g).sum().backward()
        _close(got["out"], out.detach(), TOL[torch.float64], f"rank {rank} output")
        for name, p in ref.named_parameters():
            _close(got["grads"][name], p.grad, dict(rtol=1e-8, atol=1e-12), f"rank {rank} grad {name}")


@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_merged_batch_of_one_row_raises(checks, problem):
    for result in checks:
        got = result[f"one_row-{problem}"]
        assert got["error"] == "Expected more than 1 value per channel when training, got input size " \
                               f"{torch.Size([1, workers.N])}"
        assert got["buffers_unchanged"]


def test_bundles_warn_once_and_stay_per_process(tmp_path):
    texts = {problem: read(paths[2]) for problem, paths in FILES.items()}
    workers.spawn(workers.bundle_worker, tmp_path, str(tmp_path), texts)
    for result in _load(tmp_path, "bundle"):
        for problem in texts:
            bn_type, messages = result[problem]
            assert bn_type == "BatchNormState", problem
            assert len(messages) == 1, messages
            assert "keeps per-process batch statistics" in messages[0]
            assert "repository's model_new.py" in messages[0]
        assert result["repository"] == ("SyncBatchNorm", [])
        assert result["repository_unconverted"] == ("BatchNormState", [])
    assert model_new._SYNC is not None
