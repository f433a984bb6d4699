"""The processes of tests/test_sync_bn.py: two ranks on gloo (CPU), started with
torch.multiprocessing.spawn, each importable here by name (spawn pickles the
function by reference).  Each worker writes what it saw to `out_dir` as
torch.save files; the test process compares them with single-process references.

Scenarios (SCENARIOS): ModelNew (problem 33 or 84) trained for STEPS SGD steps
with data-parallel gradient averaging, each rank on its slice of one global
batch per step (`split`: rows per rank), loss_r = sum(out_r * g_r) for a fixed
random g.  Averaging the gradients makes the run equal, in one process, to
Model on the concatenated batch with loss (1 / world) sum_r loss_r when
BatchNorm is synchronized (reference_run).  DistributedDataParallel averages
them where it can: its constructor refuses a CPU module that holds a
SyncBatchNorm ("SyncBatchNorm layers only work with GPU modules", a check of
DDP's own, whatever the layer computes), so the converted CPU modules average
with one all_reduce per gradient after the backward (average_gradients, what
DDP's reducer computes); the unconverted ones run under DDP itself.  `convert`: nn.SyncBatchNorm.convert_sync_batchnorm
applied; `group`: its process_group ("world": none given; "own": a group of
this rank alone; "pair": a new group of both ranks).

Names: M = batch (global, sum of split), K = in_features, N = out_features.
"""
import datetime
import os
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tests.problems import DEFAULT, PROBLEMS, cpu_input, make_pair

WORLD = 2
K, N = 48, 40
STEPS = 5
LR = 0.05
SEED = 11
F64, F32 = torch.float64, torch.float32


@dataclass(frozen=True)
class Scenario:
    problem: str
    dtype: torch.dtype
    split: tuple
    convert: bool = True
    group: str = "world"
    momentum: object = DEFAULT
    device: str = "cpu"
    fused: bool = True  # SWITCHES.sync_fused (CUDA float32: the fused kernels or the torch ops)


def _scenarios():
    out = {}
    for problem in ("33", "84"):
        for dtype, dname in ((F64, "f64"), (F32, "f32")):
            for split, sname in (((24, 24), "even"), ((30, 14), "uneven")):
                out[f"{problem}-{dname}-{sname}"] = Scenario(problem, dtype, split)
        out[f"{problem}-f64-one_row"] = Scenario(problem, F64, (1, 15))
        out[f"{problem}-f64-empty_rank"] = Scenario(problem, F64, (20, 0))
        out[f"{problem}-f64-momentum_none"] = Scenario(problem, F64, (30, 14), momentum=None)
        out[f"{problem}-f64-pair_group"] = Scenario(problem, F64, (30, 14), group="pair")
        out[f"{problem}-bf16-uneven"] = Scenario(problem, torch.bfloat16, (30, 14))
        # the negative control and the group of one rank: per-process statistics
        out[f"{problem}-f64-unconverted"] = Scenario(problem, F64, (30, 14), convert=False)
        out[f"{problem}-f64-own_group"] = Scenario(problem, F64, (30, 14), group="own")
        # CUDA (both ranks on one GPU, gloo): float32 takes the fused kernels
        # (_SyncFusedTrainFn) where a rank has rows, the torch ops where it has
        # none, or everywhere with SWITCHES.sync_fused off (the A/B twin)
        for split, sname in (((24, 24), "even"), ((30, 14), "uneven"), ((1, 15), "one_row"),
                             ((20, 0), "empty_rank")):
            out[f"{problem}-f32-cuda-{sname}"] = Scenario(problem, F32, split, device="cuda")
        out[f"{problem}-f32-cuda-uneven-torch_ops"] = Scenario(problem, F32, (30, 14), device="cuda", fused=False)
        out[f"{problem}-f32-cuda-momentum_none"] = Scenario(problem, F32, (30, 14), momentum=None, device="cuda")
    return out


SCENARIOS = _scenarios()
# Scenarios whose BatchNorm merges the ranks' batches: they must match reference_run
# (the bfloat16 ones: closer to float64 than Model's own bfloat16 run, LOWP).
SYNCHRONIZED = sorted(name for name, sc in SCENARIOS.items()
                      if sc.convert and sc.group != "own" and sc.dtype in (F64, F32))
LOWP = sorted(name for name, sc in SCENARIOS.items() if sc.dtype == torch.bfloat16)


def _gloo_reduces_bfloat16():
    """Whether this torch's gloo backend all_reduces bfloat16 (the bfloat16
    scenarios' gradient averaging); torch 2.0.1's raises "Invalid scalar type"."""
    if not (dist.is_available() and dist.is_gloo_available()):
        return False
    try:
        dist.ProcessGroupGloo(dist.HashStore(), 0, 1).allreduce([torch.ones(1, dtype=torch.bfloat16)]).wait()
    except RuntimeError:
        return False
    return True


GLOO_BFLOAT16 = _gloo_reduces_bfloat16()
# Scenarios that run here: CUDA ones where a GPU is visible (gloo carries CUDA tensors),
# bfloat16 ones where gloo reduces bfloat16.
RUNNABLE = sorted(name for name, sc in SCENARIOS.items() if (sc.device == "cpu" or torch.cuda.is_available())
                  and (sc.dtype != torch.bfloat16 or GLOO_BFLOAT16))


# ---------------------------------------------------------------------------
# Shared by the workers and the test process
# ---------------------------------------------------------------------------


def models(sc):
    """(Model, ModelNew) of the scenario's problem, identical state, in sc.dtype,
    scale uniform in [-2, 2) (both problems: a scale that matters)."""
    return make_pair(PROBLEMS[sc.problem], SEED, K, N, momentum=sc.momentum, dtype=sc.dtype, scale="random")


def batches(sc):
    """[(x (M, K), g (M, N))] for each step: the global batch and the loss weights."""
    gen = torch.Generator().manual_seed(SEED + 1)
    m = sum(sc.split)
    return [(cpu_input(step, m, K, sc.dtype, gen), torch.randn(m, N, generator=gen, dtype=sc.dtype))
            for step in range(STEPS)]


def rows(sc, rank):
    """The slice of the global batch that `rank` holds."""
    start = sum(sc.split[:rank])
    return slice(start, start + sc.split[rank])


def param_state(module):
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def buffer_state(module):
    return {name: b.detach().clone() for name, b in module.named_buffers()}


def reference_run(sc, dtype=None):
    """The single-process equal of DDP + synchronized BatchNorm: Model on the
    global batch, loss (1 / world) sum_r loss_r, SGD.  Returns {"out": [per
    step (M, N)], "params": [per step, after the update], "grads": step 0's,
    "buffers": at the end}.  dtype: Model, its state and the batches converted
    to it after they are made in sc.dtype (float64: the oracle of a 16-bit run)."""
    ref, _ = models(sc)
    dtype = sc.dtype if dtype is None else dtype
    ref = ref.to(dtype)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    record = {"out": [], "params": [], "grads": None}
    ref.train()
    for step, (x, g) in enumerate(batches(sc)):
        x, g = x.to(dtype), g.to(dtype)
        opt.zero_grad(set_to_none=True)
        out = ref(x)
        ((out * g).sum() / WORLD).backward()
        if step == 0:
            record["grads"] = {name: p.grad.clone() for name, p in ref.named_parameters()}
        opt.step()
        record["out"].append(out.detach())
        record["params"].append(param_state(ref))
    record["buffers"] = buffer_state(ref)
    return record


def spawn(fn, tmp_path, *args):
    """fn(rank, WORLD, rendezvous, *args) in WORLD fresh processes; a worker's
    exception is raised here (torch.multiprocessing.spawn)."""
    rendezvous = f"file://{tmp_path}/rendezvous"
    torch.multiprocessing.spawn(fn, args=(WORLD, rendezvous) + args, nprocs=WORLD, join=True)


# ---------------------------------------------------------------------------
# Inside the workers
# ---------------------------------------------------------------------------


def _finish():
    """A worker's last step, after its results are saved: a barrier (both ranks
    have saved theirs and are past their last collective), then the process
    leaves at once with exit status 0, which is what spawn checks, without
    tearing gloo down.  The teardown is not what these tests test, and it
    failed both ways in CI: on torch 2.0.x destroy_process_group sometimes never
    returned in both ranks of the checks worker (twice in the oldest leg); on
    2.13.0 rank 0 of the checks worker once aborted ("terminate called without
    an active exception", SIGABRT) while rank 1 was still alive."""
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _init(rank, world, rendezvous):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))


class CollectiveCounter:
    """Counts torch.distributed.all_gather / all_reduce calls made through the
    Python API (model_new's; DDP's own reductions run in C++ and are not counted)."""

    def __init__(self):
        self.counts = {"all_gather": 0, "all_reduce": 0}
        for name in self.counts:
            original = getattr(dist, name)

            def counted(*args, _name=name, _original=original, **kwargs):
                self.counts[_name] += 1
                return _original(*args, **kwargs)
            setattr(dist, name, counted)

    def snapshot(self):
        return dict(self.counts)

    def since(self, before):
        return {k: v - before[k] for k, v in self.counts.items()}


def _groups():
    """{"own": this rank's group of one, "pair": a group of both ranks}; every
    rank creates every group, in the same order, as new_group requires."""
    own = [dist.new_group([r]) for r in range(WORLD)]
    return {"own": own[dist.get_rank()], "pair": dist.new_group(list(range(WORLD))), "world": None}


def average_gradients(module):
    """Every parameter's gradient replaced by its mean over the ranks (DDP's
    reduction: one all_reduce per gradient, divided by the world size)."""
    for p in module.parameters():
        dist.all_reduce(p.grad)
        p.grad.div_(dist.get_world_size())


def _train_rank(sc, rank, groups, counter):
    import model_new
    model_new.SWITCHES = model_new.SWITCHES._replace(sync_fused=sc.fused)
    _, new = models(sc)
    new = new.to(sc.device)
    if sc.convert:
        new = nn.SyncBatchNorm.convert_sync_batchnorm(new, groups[sc.group])
    ddp = new if sc.convert else torch.nn.parallel.DistributedDataParallel(new)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    record = {"out": [], "params": [], "grads": None, "forward_collectives": [], "backward_collectives": [],
              "bn_type": type(new.bn).__name__}
    ddp.train()
    for step, (x, g) in enumerate(batches(sc)):
        x, g = x[rows(sc, rank)].to(sc.device), g[rows(sc, rank)].to(sc.device)
        if step == 0:
            record["kernel_path"] = new.kernel_path(x)
        opt.zero_grad(set_to_none=True)
        before = counter.snapshot()
        out = ddp(x)
        record["forward_collectives"].append(counter.since(before))
        before = counter.snapshot()
        (out * g).sum().backward()
        record["backward_collectives"].append(counter.since(before))
        if ddp is new:
            average_gradients(new)
        if step == 0:
            record["grads"] = {name: p.grad.cpu() for name, p in new.named_parameters()}
        opt.step()
        record["out"].append(out.detach().cpu())
        record["params"].append({k: v.cpu() for k, v in param_state(new).items()})
    record["buffers"] = {k: v.cpu() for k, v in buffer_state(new).items()}
    return record


def train_worker(rank, world, rendezvous, out_dir, names):
    """Runs the named SCENARIOS on this rank; writes <out_dir>/<name>.rank<rank>.pt."""
    _init(rank, world, rendezvous)
    counter = CollectiveCounter()
    groups = _groups()
    for name in names:
        torch.save(_train_rank(SCENARIOS[name], rank, groups, counter), f"{out_dir}/{name}.rank{rank}.pt")
    _finish()


def _frozen_bn_rank(problem, rank, counter):
    """A converted ModelNew in training with bn.eval(): output, gradients,
    buffers before and after, collectives, kernel_path."""
    sc = Scenario(problem, F64, (24, 24))
    _, new = models(sc)
    gen = torch.Generator().manual_seed(SEED + 2)
    with torch.no_grad():
        new.bn.running_mean.copy_(torch.randn(N, generator=gen, dtype=F64))
        new.bn.running_var.copy_(torch.rand(N, generator=gen, dtype=F64) + 0.5)
    new = nn.SyncBatchNorm.convert_sync_batchnorm(new)
    new.train()
    new.bn.eval()
    x, g = (t[rows(sc, rank)] for t in batches(sc)[0])
    buffers_before = buffer_state(new)
    before = counter.snapshot()
    path = new.kernel_path(x)
    out = new(x)
    (out * g).sum().backward()
    return {"out": out.detach(), "grads": {name: p.grad.clone() for name, p in new.named_parameters()},
            "buffers_before": buffers_before, "buffers_after": buffer_state(new), "collectives": counter.since(before),
            "kernel_path": path}


def _one_row_rank(problem, rank):
    """A merged batch of one row (rank 0 one row, rank 1 none): the error on each rank, buffers unchanged."""
    sc = Scenario(problem, F64, (1, 0))
    _, new = models(sc)
    new = nn.SyncBatchNorm.convert_sync_batchnorm(new)
    x = batches(sc)[0][0][rows(sc, rank)]
    before = buffer_state(new)
    error = None
    try:
        new(x)
    except ValueError as e:
        error = str(e)
    after = buffer_state(new)
    return {"error": error, "buffers_unchanged": all(torch.equal(before[k], after[k]) for k in before)}


def checks_worker(rank, world, rendezvous, out_dir):
    """The frozen-BatchNorm and one-row checks of both problems; writes
    <out_dir>/checks.rank<rank>.pt."""
    _init(rank, world, rendezvous)
    counter = CollectiveCounter()
    result = {}
    for problem in ("33", "84"):
        result[f"frozen-{problem}"] = _frozen_bn_rank(problem, rank, counter)
        result[f"one_row-{problem}"] = _one_row_rank(problem, rank)
    torch.save(result, f"{out_dir}/checks.rank{rank}.pt")
    _finish()


def bundle_worker(rank, world, rendezvous, out_dir, texts):
    """Each self-contained file's text executed into a fresh namespace, then
    convert_sync_batchnorm, two training calls and one eval call; the same with
    the repository's ModelNew, converted and not (no warning: it can be converted).
    Writes <out_dir>/bundle.rank<rank>.pt: {problem: (bn type name, warning messages)}."""
    _init(rank, world, rendezvous)
    import model_new
    result = {}
    gen = torch.Generator().manual_seed(SEED + 3)
    x = torch.rand(6, 8, generator=gen)
    cases = {problem: {"__name__": f"__bundle_{problem}__"} for problem in texts}
    for problem, text in texts.items():
        exec(compile(text, "<string>", "exec"), cases[problem])
    cases["repository"] = cases["repository_unconverted"] = {"ModelNew": model_new.ModelNew}
    for name, ns in cases.items():
        model = ns["ModelNew"](*((8, 6) if name == "84" else (8, 6, (6,))))
        if name != "repository_unconverted":
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(x)
            model(x)
            model.eval()(x)
        result[name] = (type(model.bn).__name__, [str(w.message) for w in caught])
    torch.save(result, f"{out_dir}/bundle.rank{rank}.pt")
    _finish()
