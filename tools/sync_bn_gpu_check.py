"""Synchronized BatchNorm on two GPUs (docs/multi-gpu.md): ModelNew converted
by nn.SyncBatchNorm.convert_sync_batchnorm against Model converted the same way,
both under DistributedDataParallel on NCCL, float32, both problems; and the
time of a synchronized against a per-process training step.

    python tools/sync_bn_gpu_check.py          # 2 GPUs: batches 1024+1024 and 300+212, K = N = 8192
    python tools/sync_bn_gpu_check.py --cpu    # smoke test: 2 CPU processes on gloo, K = 48, N = 40, float64
    python tools/sync_bn_gpu_check.py --package mypkg --package-root DIR   # a vendored copy: DIR/mypkg/model_new.py, ...

It starts its two processes itself (no torchrun).  For each problem and each
split of the global batch (rows per rank), from one seeded state:
  - five SGD steps (loss_r = sum(out_r * g_r) / M, g fixed random, M the global
    batch) of Model + SyncBatchNorm and of ModelNew + SyncBatchNorm, each under
    DDP; then the relative difference max |new - ref| / max |ref| of every
    parameter and buffer (num_batches_tracked: equal), maximised over the
    ranks; the exit status is 1 when one exceeds --bar (1e-6);
  - the median time of one training step (forward, backward, optimizer step;
    CUDA events, after --warmup steps, over --iters steps; the slower rank's)
    of Model and ModelNew, each per-process (plain BatchNorm under DDP) and
    synchronized, printed as a table with the device, torch and CUDA versions.
Model's GEMMs run in true float32 (TF32 off), as in the test suite.

--cpu runs the same on gloo, where two things differ: Model's SyncBatchNorm
refuses CPU tensors and DDP refuses a CPU module holding a SyncBatchNorm, so
the reference is Model (plain BatchNorm1d) on the whole global batch in each
process, loss (1 / world) sum_r loss_r (what DDP + SyncBatchNorm compute), and
the converted ModelNew averages its gradients with one all_reduce each (DDP's
reduction).  CPU times say nothing about GPUs.
"""
import argparse
import copy
import importlib
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

WORLD = 2
SEED = 0
LR = 0.1
GPU_DEFAULTS = dict(shape="8192,8192", splits="1024,1024;300,212", dtype="float32")
CPU_DEFAULTS = dict(shape="48,40", splits="24,24;30,14", dtype="float64")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="gloo on 2 CPU processes (smoke test)")
    parser.add_argument("--problem", choices=["33", "84", "both"], default="both")
    parser.add_argument("--shape", help="K,N (default 8192,8192; --cpu 48,40)")
    parser.add_argument("--splits", help="rows per rank, splits separated by ';' (default 1024,1024;300,212)")
    parser.add_argument("--dtype", choices=["float32", "float64", "float16", "bfloat16"],
                        help="default float32 (--cpu: float64); 16-bit runs need a --bar of their own")
    parser.add_argument("--steps", type=int, default=5, help="SGD steps compared")
    parser.add_argument("--lr", type=float, default=LR, help=f"SGD learning rate (default {LR})")
    parser.add_argument("--no-timing", action="store_true", help="compare only; skip the step timings")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--bar", type=float, default=1e-6, help="largest relative difference allowed")
    parser.add_argument("--package", default="", help="run a vendored copy: PACKAGE.model_new, PACKAGE.reference, "
                        "PACKAGE.level2_84_gemm_batchnorm_scaling_softmax.{model_new,reference} (default: the "
                        "repository's modules)")
    parser.add_argument("--package-root", default="", help="the folder holding --package (put on sys.path)")
    args = parser.parse_args(argv)
    for key, value in (CPU_DEFAULTS if args.cpu else GPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


# ---------------------------------------------------------------------------
# Models and data (every process builds the same from the same seeds)
# ---------------------------------------------------------------------------


def load_module(args, name):
    """The module `name` of the repository, or of the vendored copy --package."""
    if args.package_root and args.package_root not in sys.path:
        sys.path.insert(0, args.package_root)
    return importlib.import_module(f"{args.package}.{name}" if args.package else name)


def problem_classes(problem, args):
    """(Model, ModelNew, constructor arguments for K, N) of a problem."""
    if problem == "33":
        return (load_module(args, "reference").Model, load_module(args, "model_new").ModelNew,
                lambda k, n: (k, n, (n,)))
    folder = "level2_84_gemm_batchnorm_scaling_softmax"
    return (load_module(args, f"{folder}.reference").Model, load_module(args, f"{folder}.model_new").ModelNew,
            lambda k, n: (k, n))


def make_models(problem, k, n, device, dtype, args):
    """(Model, ModelNew) with one state (ModelNew loads Model's), on `device` in
    `dtype`; scale uniform in [-2, 2) (problem 84's default, all ones, would
    leave the scale untested)."""
    model_cls, new_cls, init = problem_classes(problem, args)
    torch.manual_seed(SEED)
    ref = model_cls(*init(k, n))
    new = new_cls(*init(k, n))
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        ref.scale.copy_(torch.rand(ref.scale.shape, generator=gen) * 4.0 - 2.0)
    new.load_state_dict(ref.state_dict())
    return ref.to(device=device, dtype=dtype), new.to(device=device, dtype=dtype)


def global_batch(step, m, k, n, dtype, device):
    """(x (M, K) uniform, g (M, N) normal) of a step, the same in every process."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.rand(m, k, generator=gen, dtype=dtype)
    g = torch.randn(m, n, generator=gen, dtype=dtype)
    return x.to(device), g.to(device)


def rank_rows(split, rank):
    start = sum(split[:rank])
    return slice(start, start + split[rank])


# ---------------------------------------------------------------------------
# Training and timing
# ---------------------------------------------------------------------------


def average_gradients(module):
    """DDP's reduction for the CPU runs (DDP refuses SyncBatchNorm in CPU modules)."""
    for p in module.parameters():
        dist.all_reduce(p.grad)
        p.grad.div_(dist.get_world_size())


class Trainer:
    """A module as each process trains it: converted to SyncBatchNorm or not,
    under DDP (or, for a converted CPU module, with average_gradients), SGD."""

    def __init__(self, module, synchronized, cpu, lr=LR):
        self.module = nn.SyncBatchNorm.convert_sync_batchnorm(module) if synchronized else module
        self.manual_average = cpu and synchronized
        if self.manual_average:
            self.wrapped = self.module
        else:
            device_ids = None if cpu else [torch.cuda.current_device()]
            self.wrapped = torch.nn.parallel.DistributedDataParallel(self.module, device_ids=device_ids)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=lr)

    def step(self, x, g, inv_m):
        """One training step (forward, backward, gradient averaging, SGD); returns the output."""
        self.opt.zero_grad(set_to_none=True)
        out = self.wrapped(x)
        ((out * g).sum() * inv_m).backward()
        if self.manual_average:
            average_gradients(self.module)
        self.opt.step()
        return out.detach()


def reference_on_global_batch(ref, xs, gs, world, steps, lr):
    """--cpu: Model (plain BatchNorm1d) on the whole batch, loss (1 / world)
    sum_r loss_r, SGD: what DDP + SyncBatchNorm compute."""
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    ref.train()
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        ((ref(xs[step]) * gs[step]).sum() / xs[step].shape[0] / world).backward()
        opt.step()
    return ref


def rel_diff(a, b):
    """max |a - b| / max |b| in float64 (0 for equal tensors, also all-zero ones)."""
    a, b = a.detach().double(), b.detach().double()
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale > 0 else diff


def compare_training(problem, split, args, rank, device, dtype, synchronized=True):
    """{name: (new vs ref, new vs float64, ref vs float64)} relative differences
    of every parameter and buffer after args.steps steps: ModelNew against the
    reference (Model, converted when `synchronized`; --cpu: Model on the global
    batch), and both against Model trained the same way in float64 (GPU only;
    NaN on --cpu, whose run is float64 already)."""
    k, n = (int(v) for v in args.shape.split(","))
    m = sum(split)
    ref, new = make_models(problem, k, n, device, dtype, args)
    batches = [global_batch(step, m, k, n, dtype, device) for step in range(args.steps)]
    rows = rank_rows(split, rank)
    ref64 = None
    if args.cpu:
        ref = reference_on_global_batch(ref, [b[0] for b in batches], [b[1] for b in batches], WORLD, args.steps, args.lr)
    else:
        ref64 = copy.deepcopy(ref).double()
        ref_trainer = Trainer(ref, synchronized, cpu=False, lr=args.lr)
        ref64_trainer = Trainer(ref64, synchronized, cpu=False, lr=args.lr)
    new_trainer = Trainer(new, synchronized, cpu=args.cpu, lr=args.lr)
    for x, g in batches:
        if not args.cpu:
            ref_trainer.step(x[rows], g[rows], 1.0 / m)
            ref64_trainer.step(x[rows].double(), g[rows].double(), 1.0 / m)
        new_trainer.step(x[rows], g[rows], 1.0 / m)
    want = dict(ref.state_dict())
    got = dict(new_trainer.module.state_dict())
    exact = dict(ref64.state_dict()) if ref64 is not None else None
    assert list(got) == list(want), (list(got), list(want))

    def diff(a, b):
        if b is None:
            return float("nan")
        if not b.is_floating_point():
            return 0.0 if torch.equal(a, b) else float("inf")
        return rel_diff(a, b)

    return {name: (diff(got[name], want[name]), diff(got[name], exact and exact[name]),
                   diff(want[name], exact and exact[name])) for name in want}


def median_step_ms(trainer, x, g, inv_m, args, cpu):
    """Median time of one training step, after args.warmup untimed ones."""
    for _ in range(args.warmup):
        trainer.step(x, g, inv_m)
    times = []
    for _ in range(args.iters):
        if cpu:
            start = time.perf_counter()
            trainer.step(x, g, inv_m)
            times.append((time.perf_counter() - start) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        trainer.step(x, g, inv_m)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_steps(problem, split, args, rank, device, dtype):
    """{"Model per-process": ms, "Model synchronized": ms, "ModelNew ...": ms}
    (--cpu: "Model synchronized" None, SyncBatchNorm refusing CPU tensors)."""
    k, n = (int(v) for v in args.shape.split(","))
    x, g = global_batch(0, sum(split), k, n, dtype, device)
    rows = rank_rows(split, rank)
    x, g = x[rows], g[rows]
    ref, new = make_models(problem, k, n, device, dtype, args)
    out = {}
    for label, module in (("Model", ref), ("ModelNew", new)):
        for synchronized in (False, True):
            key = f"{label} {'synchronized' if synchronized else 'per-process'}"
            if args.cpu and synchronized and label == "Model":
                out[key] = None
                continue
            trainer = Trainer(copy.deepcopy(module), synchronized, args.cpu)
            out[key] = median_step_ms(trainer, x, g, 1.0 / sum(split), args, args.cpu)
            del trainer
    return out


# ---------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------


def worker(rank, world, rendezvous, args, out_dir):
    """One rank: every (problem, split) comparison and timing; writes
    <out_dir>/rank<rank>.json."""
    if args.cpu:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("gloo" if args.cpu else "nccl", init_method=rendezvous, rank=rank, world_size=world)
    dtype = getattr(torch, args.dtype)
    problems = ["33", "84"] if args.problem == "both" else [args.problem]
    splits = [tuple(int(v) for v in s.split(",")) for s in args.splits.split(";")]
    results = []
    for problem in problems:
        for split in splits:
            if len(split) != world:
                raise SystemExit(f"split {split} does not have {world} ranks")
            diffs = compare_training(problem, split, args, rank, device, dtype)
            baseline = None if args.cpu else compare_training(problem, split, args, rank, device, dtype, False)
            times = None if args.no_timing else time_steps(problem, split, args, rank, device, dtype)
            results.append({"problem": problem, "split": list(split), "diffs": diffs, "baseline": baseline,
                            "times": times})
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def merge_ranks(per_rank):
    """Each case's differences and times maximised over the ranks."""
    merged = []
    for cases in zip(*per_rank):
        case = dict(cases[0])
        for key in ("diffs", "baseline"):
            if case[key] is not None:
                case[key] = {k: [max(c[key][k][i] for c in cases) for i in range(3)] for k in case[key]}
        if case["times"] is None:
            merged.append(case)
            continue
        case["times"] = {k: None if case["times"][k] is None else max(c["times"][k] for c in cases)
                         for k in case["times"]}
        merged.append(case)
    return merged


def environment(args):
    device = "CPU (gloo)" if args.cpu else f"{WORLD} x {torch.cuda.get_device_name(0)} (NCCL)"
    return f"device: {device}; torch {torch.__version__}; CUDA {torch.version.cuda}; dtype {args.dtype}"


def report(merged, args):
    """Prints both tables; returns the cases over the bar."""
    k, n = args.shape.split(",")
    print(environment(args))
    print(f"K = {k}, N = {n}, {args.steps} SGD steps (lr {args.lr:g}); relative difference max|new - ref| / max|ref| "
          f"of ModelNew + SyncBatchNorm against {'Model on the global batch' if args.cpu else 'Model + SyncBatchNorm'}")
    print("Each cell: ModelNew vs Model / ModelNew vs float64 Model / Model vs float64 Model (the last two on GPU "
          "only: Model trained the same way in float64).  A case passes when ModelNew is within the bar of Model, "
          "or at least as close to float64 as Model is (Model's own float32 error above the bar).")
    print(f"\n| problem | batches | BatchNorm | worst parameter | diff | worst buffer | diff | bar {args.bar:g} |")
    print("|---|---|---|---|---|---|---|---|")
    failed = []
    for case in merged:
        for label, diffs in (("synchronized", case["diffs"]), ("per-process", case.get("baseline"))):
            if diffs is None:
                continue
            params = {k: v for k, v in diffs.items() if not k.startswith("bn.running") and "num_batches" not in k}
            buffers = {k: v for k, v in diffs.items() if k not in params}
            worst_p = max(params, key=lambda k: params[k][0])
            worst_b = max(buffers, key=lambda k: buffers[k][0])
            within = all(v[0] <= args.bar for v in diffs.values())
            closer = all(v[1] <= max(args.bar, v[2]) for v in diffs.values())  # False when NaN (--cpu)
            ok = within or closer
            if not ok:
                failed.append(case)
            cell = lambda v: " / ".join("-" if x != x else f"{x:.2e}" for x in v)  # noqa: E731
            verdict = "ok" if within else ("ok (closer to float64 than Model)" if closer else "FAIL")
            print(f"| {case['problem']} | {'+'.join(str(s) for s in case['split'])} | {label} | {worst_p} | "
                  f"{cell(params[worst_p])} | {worst_b} | {cell(buffers[worst_b])} | {verdict} |")
    if merged[0]["times"] is None:
        return failed
    print(f"\nmedian training step (forward + backward + SGD step), ms, slower rank, "
          f"{args.warmup} warm-up + {args.iters} timed steps")
    labels = list(merged[0]["times"])
    print("| problem | batches | " + " | ".join(labels) + " | ModelNew sync / per-process |")
    print("|---|---|" + "---|" * (len(labels) + 1))
    for case in merged:
        t = case["times"]
        ratio = t["ModelNew synchronized"] / t["ModelNew per-process"]
        print(f"| {case['problem']} | {'+'.join(str(s) for s in case['split'])} | "
              + " | ".join("n/a" if t[label] is None else f"{t[label]:.3f}" for label in labels) + f" | {ratio:.2f} |")
    return failed


def main(argv=None):
    args = parse_args(argv)
    if not args.cpu and torch.cuda.device_count() < WORLD:
        sys.exit(f"needs {WORLD} GPUs, found {torch.cuda.device_count()} (--cpu runs the smoke test)")
    core = load_module(args, "model_new")  # a GPU build happens here once, not in both processes
    print(f"engine: {core.__file__} (module {core.__name__}); synchronized BatchNorm extra: "
          f"{getattr(core.extra('model_new_sync'), '__name__', None)}")
    with tempfile.TemporaryDirectory() as out_dir:
        rendezvous = f"file://{os.path.join(out_dir, 'rendezvous')}"
        torch.multiprocessing.spawn(worker, args=(WORLD, rendezvous, args, out_dir), nprocs=WORLD, join=True)
        per_rank = []
        for rank in range(WORLD):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                per_rank.append(json.load(f))
    failed = report(merge_ranks(per_rank), args)
    if failed:
        sys.exit(f"{len(failed)} case(s) over the relative bar {args.bar:g}")


if __name__ == "__main__":
    main()
