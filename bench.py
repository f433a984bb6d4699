"""Forward-pass benchmark: ModelNew against its reference Model in eager mode
and under torch.compile, all in one dtype (--dtype, default float32) on one CUDA
GPU, in one process, for
  --model 33: Linear -> scale -> BatchNorm1d          (reference.py, model_new.py)
  --model 84: Linear -> BatchNorm1d -> scale -> Softmax
              (level2_84_gemm_batchnorm_scaling_softmax/)
  --model both (default): 33, then 84.
float32: both ModelNews run the float32-accurate tensor-core GEMM of kernels/
(fp16x3 on Hopper, 3xTF32 elsewhere or with FUSED_GEMM_BN_PORTABLE=1); a "floor"
side times three cuBLAS float16 products with float32 output at the same shape
(torch.mm(a16, b16.t(), out_dtype=torch.float32): the fp16x3 GEMM's work without
BatchNorm; needs torch.mm's out_dtype), and the table gives ModelNew's time over
the floor's.  The floor's operands have K padded with zero columns to a multiple
of 8, as sm90_fp16x3's prepass pads them: the padded GEMM's work, and cuBLAS's
float16 path on rows that are not 16-byte aligned is slow (measured 1.5-3 ms at
1024 x 8191 x 8192 against 0.52 ms at K = 8192).
float16 / bfloat16: both models are built in float32 from one seed and moved
with .to(dtype), as harnesses do; ModelNew runs the 16-bit kernels of
kernels/lowp/ (compiled on its first 16-bit call, before timing).

How it measures: each side's forward call is bracketed by a pair of CUDA events.
Before every call, outside the events, a 256 MB buffer is read (torch.amax) to
flush L2, leaving it full of clean lines (zeroing the buffer, as bench did up to
docs/perf.md v55, left ~50 MB of dirty lines whose write-backs the timed call then
paid: 6-7 us more on a 70-230 us call that reads an 8192 x 8192 W, 1.5 us on the
W-read floor; v56), the GPU spins for SPIN_CYCLES clock cycles (so the host has enqueued the whole
call before the GPU starts it: the events time the GPU's work, not the host's
launches; the host time per call is reported beside it in the sweep, and a note
is printed if the GPU reached a call before its launches were all issued),
and the input rotates among 4 pre-generated torch.rand tensors.  The sides are
interleaved (each repetition calls every side once), in orders where each side
follows every other side equally often (balanced_orders: a call's synchronized time
depends on the side timed before it, docs/perf.md v64, v66).  After --warmup untimed
repetitions, --iters timed ones give the median (the reported figure) and the minimum.
Building the CUDA extension (importing model_new) and torch.compile's compilation
(its first call) happen before timing and are excluded.  Calls run under torch.no_grad() unless --grad.
Every mode is timed in two protocols, one after the other on the same sides:
back to back (above: the GPU's time per call, the host ahead of it; median ms)
and synchronized per call (sync ms: the host synchronises, records the start
event, calls, records the end event and synchronises again, as a harness times a
trial and a server answers one request: host time per call included).

Reported per side: median and min ms; GEMM TFLOP/s = 2*M*N*K / median time (the
scale and BatchNorm work is not counted); speedup = eager_ms / ms; time ratio =
ms / eager_ms; relative error ||y - y64||_F / ||y64||_F against reference.Model
copied to float64 with the same parameters and state, on one fresh input.

--backward times forward + backward instead: each timed call is
model(x).backward(g) with x requiring grad and one fixed g ~ N(0, 1) of the
output's shape, for eager Model and ModelNew (no compile side); the gradients
of x and every parameter are cleared before each call, outside the events, so
no call accumulates into an earlier one's.  GEMM TFLOP/s counts the three
GEMMs (forward, grad x, grad weight): 6*M*N*K.  The floor side runs those three
GEMMs at their own shapes and layouts (z = x W^T, grad x = g W, grad W = g^T x),
each as the forward's floor does (float32: three float16 products with float32
output over K padded to a multiple of 8, nine in all; 16-bit: one product each).
Gradient errors: relative
Frobenius error of each gradient against reference.Model in float64 (same
state, input and g); in training the float64 gradient of gemm.bias is rounding
noise around its exact value 0, so its max |grad| is reported instead.
ModelNew counts as close when every gradient error is at most 2x eager's +
GRAD_FLOOR and its gemm.bias gradient in training is exactly zero.

--optimizer sgd (with --backward) adds an optimizer step to every timed call:
model(x).backward(g) then torch.optim.SGD(model.parameters(), lr=OPTIMIZER_LR)
.step(), one optimizer per side.  The step writes every parameter, so each of
ModelNew's forwards finds gemm.weight changed and splits it again (its cached
weight parts are dropped by the step), as in a training loop; the floor side
stays the step's GEMM products (no update).  Both models start from one state; the
gradient check runs before the timed steps, after which the weights drift apart
(the timings do not depend on the values).

--sweep times eager Model, ModelNew and the floor (no compile side) in --mode
over SWEEP_SHAPES: batches 1..64 x K = N 4096, 8192 (small batches), 128..16384 x
K = N 1024..8192, plus tails (K % 8 != 0 included); per shape median ms, ModelNew's
speedup over eager (back to back and synchronized per call), its time over the
floor's and over reading W once (w_read: half a copy_ of W's size), errors against
float64 and host time per call.  It writes
results/sweep.json (problem 84: sweep_84.json) beside --json, a table, and
results/sweep.png (speedup over eager and ModelNew / floor against M; needs
matplotlib).

--autocast float16 / bfloat16 runs every call of every side (eager Model, its
torch.compile, ModelNew; --backward: the forward of each step) inside its own
torch.autocast("cuda", dtype) region, with float32 models and inputs, as
mixed-precision code is written; the error columns compare with Model in
float64, and closeness is the 16-bit one below.  Model casts gemm.weight in
every region; ModelNew keeps its cast while the weight is unchanged, so in
train mode the bench drops ModelNew's cast before every call (outside the
events), as a training step's weight update would, and in eval keeps it.
--one-region instead runs all of a side's calls in one autocast region with
nothing dropped (an evaluation loop inside one region: Model's autocast
caches its weight cast for the region, ModelNew keeps its own).

16-bit dtypes and --autocast: a "floor" side times one cuBLAS product of the
shape in that dtype (torch.mm of pre-cast operands, 16-bit output).

16-bit dtypes: the error columns compare with the same float64 Model (holding
the 16-bit parameters and input); cuBLAS's reduced-precision split-K reductions
are switched off for the eager sides (torch.backends.cuda.matmul
.allow_{fp16,bf16}_reduced_precision_reduction = False), so eager rounds
exactly where Model's ops say; the --backward floor is 8 units of roundoff of
the dtype instead of GRAD_FLOOR, and gemm.bias's training gradient is rounding
noise (not required to be 0).

Exit status: 0 ok; 1 ModelNew not close to the eager Model (float32: 33:
allclose with atol=rtol=1e-4; 84, whose outputs are about 1/N: |ours - eager|
<= 1e-4 |eager| + 1e-7 elementwise; 16-bit: at most 0.1% (float16) / 1%
(bfloat16) of the elements outside |ours - eager| <= 1e-2 + 1e-2 |eager|
(tests/test_lowp.py says why not all); --backward: the gradient criterion
above); 2 no CUDA GPU.
M = batch, K = in_features, N = out_features.
"""
import argparse
import contextlib
import copy
import importlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

DEVICE = "cuda"
L2_FLUSH_BYTES = 256 * 1024 * 1024
SYNC_NOTE = ("median / min ms: back to back (the host ahead of the GPU: GPU time per call); sync ms: each call "
             "alone, synchronized before and after (the latency a harness or a server sees, host time included)")
SPIN_CYCLES = 400_000  # GPU clock cycles spun before each timed call (~0.2 ms at 2 GHz): time_fn
NUM_INPUTS = 4
EVAL_TRAIN_STEPS = 3  # training steps before --mode eval, so the running statistics are not 0 / 1
ATOL = RTOL = 1e-4
SOFTMAX_RTOL, SOFTMAX_ATOL = 1e-4, 1e-7
GRAD_FLOOR = 1e-6  # --backward closeness floor, relative Frobenius, as in tests/test_backward.py
# --optimizer sgd's learning rate: the step's cost does not depend on it; the weights drift
# the same way every step (one fixed g): in 60 steps at 1024 x 2048 x 2048 (CPU), gemm.weight's
# largest change was 3x its largest initial entry at 1e-5, 0.75x at 1e-6.
OPTIMIZER_LR = 1e-6
GRAD_NAMES = ["x", "gemm.weight", "gemm.bias", "scale", "bn.weight", "bn.bias"]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# 16-bit closeness (tests/test_lowp.py): the fraction of elements allowed outside 1e-2 + 1e-2 |eager|.
LOWP_TOL = 1e-2
LOWP_MAX_OUTSIDE = {torch.float16: 1e-3, torch.bfloat16: 1e-2}
# --backward floor per dtype: float32 GRAD_FLOOR; 16-bit 8 units of roundoff (tests/test_lowp.py).
GRAD_FLOORS = {torch.float32: GRAD_FLOOR, torch.float16: 8 * 2.0 ** -11, torch.bfloat16: 8 * 2.0 ** -8}


def _allclose(y_new, y_ref):
    return bool(torch.allclose(y_new, y_ref, atol=ATOL, rtol=RTOL))


def _softmax_close(y_new, y_ref):
    return bool(((y_new - y_ref).abs() <= SOFTMAX_RTOL * y_ref.abs() + SOFTMAX_ATOL).all())


def _lowp_close(y_new, y_ref, dtype):
    a, b = y_new.double(), y_ref.double()
    outside = int(((a - b).abs() > LOWP_TOL + LOWP_TOL * b.abs()).sum())
    return outside <= LOWP_MAX_OUTSIDE[dtype] * b.numel()


def close_check(problem, dtype):
    """(closeness function, its description) for ModelNew vs eager computing in
    dtype (the models' dtype, or the autocast dtype)."""
    if dtype == torch.float32:
        return problem["close"], problem["close_text"]
    return (lambda y_new, y_ref: _lowp_close(y_new, y_ref, dtype)), (f"at most {LOWP_MAX_OUTSIDE[dtype]:.1%} of elements outside |diff| <= {LOWP_TOL:g} + "
                         f"{LOWP_TOL:g} |eager|")


# Each problem: modules (imported when benched; importing a model_new builds the
# extension), constructor arguments for (K, N), and the closeness test.
PROBLEMS = {
    "33": {"title": "Linear -> scale -> BatchNorm1d", "reference": "reference", "model_new": "model_new",
           "init": lambda k, n: (k, n, (n,)), "close": _allclose, "close_text": f"allclose(atol=rtol={ATOL:g})"},
    "84": {"title": "Linear -> BatchNorm1d -> scale -> Softmax",
           "reference": "level2_84_gemm_batchnorm_scaling_softmax.reference",
           "model_new": "level2_84_gemm_batchnorm_scaling_softmax.model_new",
           "init": lambda k, n: (k, n), "close": _softmax_close,
           "close_text": f"|diff| <= {SOFTMAX_RTOL:g} |eager| + {SOFTMAX_ATOL:g}"},
}
# --sweep grid (M, K, N): batch 128..16384 x features 1024..8192 (K = N; 16384 x 4096 x 4096
# is issue 39's large-batch shape), plus shapes whose sizes are not multiples of the tiles
# (two with K % 8 != 0: the floor pads K, _padded_k).  The largest, 16384 x 8192 x 8192,
# peaks under 8 GiB on the GPU (four 512 MiB inputs, the float64 check's input and output,
# each side's output, the floor's operands).
SWEEP_BATCHES = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
SWEEP_FEATURES = (1024, 2048, 4096, 8192)
# Small batches (issue 50): M = 1..64 at K = N = 4096 and 8192, where reading W once is the floor
# (the w_read column).
SWEEP_SMALL_BATCHES = (1, 2, 3, 4, 8, 12, 16, 24, 32, 48, 64)
SWEEP_SHAPES = ([(m, f, f) for f in (4096, 8192) for m in SWEEP_SMALL_BATCHES]
                + [(m, f, f) for f in SWEEP_FEATURES for m in SWEEP_BATCHES]
                + [(1000, 3000, 3000), (4000, 8188, 1000), (333, 8192, 5000), (2048, 1028, 8190)])


def parse_shape(text):
    try:
        m, k, n = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected M,K,N (three integers), got {text!r}") from None
    if min(m, k, n) < 1:
        raise argparse.ArgumentTypeError(f"M, K and N must be positive, got {text!r}")
    return m, k, n


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("33", "84", "both"), default="both",
                   help="KernelBench level 2 problem to bench (default: both)")
    p.add_argument("--shape", type=parse_shape, default=(1024, 8192, 8192), metavar="M,K,N",
                   help="batch, in_features, out_features (default: KernelBench's 1024,8192,8192)")
    p.add_argument("--mode", choices=("train", "eval", "both"), default="train",
                   help="BatchNorm mode of every side (default: train)")
    p.add_argument("--iters", type=int, default=50, help="timed repetitions per side (default: 50)")
    p.add_argument("--warmup", type=int, default=10, help="untimed repetitions per side first (default: 10)")
    p.add_argument("--seed", type=int, default=0, help="seed for parameters and inputs (default: 0)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                   help="dtype of both models and the inputs (default: float32; float16 / bfloat16 run ModelNew's "
                        "16-bit kernels from kernels/lowp/)")
    p.add_argument("--autocast", choices=("float16", "bfloat16"), default=None,
                   help="run every side inside torch.autocast('cuda', dtype) with float32 models (needs --dtype "
                        "float32)")
    p.add_argument("--one-region", action="store_true",
                   help="with --autocast: one autocast region around all calls, no cast dropped (default: a "
                        "region per call)")
    p.add_argument("--json", default=os.path.join("results", "bench.json"), metavar="PATH",
                   help="where to write the results (default: results/bench.json)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile(Model) side")
    p.add_argument("--grad", action="store_true", help="time with autograd enabled instead of torch.no_grad()")
    p.add_argument("--backward", action="store_true",
                   help="time forward + backward (model(x).backward(g)) of eager Model and ModelNew beside the "
                        "floor of the step's three GEMMs, and report every gradient's error against float64")
    p.add_argument("--optimizer", choices=("sgd",), default=None,
                   help="with --backward: each timed call also takes an optimizer step, "
                        f"torch.optim.SGD(lr={OPTIMIZER_LR:g}), so ModelNew re-splits the changed weight every call; "
                        "the floor stays the step's GEMM products (no update)")
    p.add_argument("--sweep", action="store_true",
                   help="time eager Model, ModelNew and the floor (three fp16 products over K padded to a "
                        "multiple of 8; no compile side) over SWEEP_SHAPES (batch up to 16384) in --mode; "
                        "writes results/sweep.json, a table and results/sweep.png (if matplotlib is installed)")
    args = p.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    if args.autocast is not None and args.dtype != "float32":
        p.error("--autocast runs float32 models inside torch.autocast: it needs --dtype float32")
    if args.one_region and args.autocast is None:
        p.error("--one-region needs --autocast")
    if args.optimizer is not None and not args.backward:
        p.error("--optimizer times a training step: it needs --backward")
    if args.backward and args.sweep:
        p.error("--backward times one shape: it cannot be combined with --sweep")
    if args.sweep and (args.autocast is not None or args.grad):
        p.error("--sweep times float32 (or --dtype) calls without gradients: it takes neither --autocast nor --grad")
    if args.shape[0] < 2 and args.mode != "eval":  # (eval's settling training steps take 2 rows: build_models)
        p.error("BatchNorm1d training needs a batch M >= 2 (--mode eval takes M = 1)")
    return args


def build_models(problem, shape, mode, seed, dtype=torch.float32):
    """(Model, ModelNew) on DEVICE in dtype with bit-identical parameters (the same
    seed before each constructor, then .to(DEVICE, dtype)).  For mode "eval",
    both first take EVAL_TRAIN_STEPS training steps on the same inputs (at least
    two rows: BatchNorm's batch statistics), then switch to eval."""
    m, k, n = shape
    models = []
    for cls in (problem["Model"], problem["ModelNew"]):
        torch.manual_seed(seed)
        models.append(cls(*problem["init"](k, n)).to(DEVICE, dtype).train())
    ref, new = models
    ref_state, new_state = ref.state_dict(), new.state_dict()
    if ref_state.keys() != new_state.keys() or not all(torch.equal(v, new_state[key]) for key, v in ref_state.items()):
        raise RuntimeError("Model and ModelNew built from the same seed differ in parameters or buffers")
    if mode == "eval":
        with torch.no_grad():
            for _ in range(EVAL_TRAIN_STEPS):
                x = torch.rand(max(m, 2), k, device=DEVICE).to(dtype)
                ref(x)
                new(x)
        ref.eval()
        new.eval()
    return ref, new


def _reset_dynamo():
    try:
        import torch._dynamo
        torch._dynamo.reset()
    except Exception:
        pass


def try_compile(model, x, wrap=lambda f: f):
    """wrap(torch.compile(model)) after its first call (the compilation, excluded
    from the timings), or None with a printed note if unavailable or failing."""
    if not hasattr(torch, "compile"):
        print("note: this torch has no torch.compile; skipping the compile side")
        return None
    try:
        compiled = wrap(torch.compile(model))
        t0 = time.perf_counter()
        compiled(x)
        torch.cuda.synchronize()
    except Exception as e:  # a compile failure must not end the bench
        first_line = (str(e).strip().splitlines() or [""])[0]
        print(f"note: torch.compile failed, skipping the compile side: {type(e).__name__}: {first_line}")
        _reset_dynamo()
        return None
    print(f"torch.compile: first call (compilation) took {time.perf_counter() - t0:.1f} s, excluded")
    return compiled


def check_accuracy(problem, sides, ref, x, compute=None):
    """Relative Frobenius error of each side against `ref` copied to float64
    (same parameters and state) on x, plus ModelNew vs eager max |diff| and the
    closeness test of the problem and the dtype the GEMM computes in (compute,
    default x's dtype; close_check).
    Calls the timed models themselves: in train mode that advances their running
    statistics by one step, which the train-mode output and the timings do not depend on."""
    ref64 = copy.deepcopy(ref).double()
    with torch.no_grad():
        y64 = ref64(x.double())
    outs = {name: fn(x).detach() for name, fn in sides.items()}
    with torch.no_grad():
        errors = {name: ((y.double() - y64).norm() / y64.norm()).item() for name, y in outs.items()}
        y_ref, y_new = outs["eager"], outs["ModelNew"]
        check = {"max_abs_diff_vs_eager": (y_new.double() - y_ref.double()).abs().max().item(),
                 "close_vs_eager": close_check(problem, compute or x.dtype)[0](y_new, y_ref)}
    return errors, check


def balanced_orders(n):
    """Orders of the sides 0 .. n - 1, one per repetition, cycled: a Latin square balanced
    for the side before (Williams 1949, "Experimental designs balanced for the estimation
    of residual effects of treatments"): over the n rows (2n, the square and its mirror,
    for odd n) each side is called right after every other side equally often.  A
    rotation (0 1 2 3, 1 2 3 0, ...) keeps one predecessor per side, and a synchronized
    call timed after eager measured 3-10% slower than the same code timed after another
    side (H200, docs/perf.md v64)."""
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [[(side + i) % n for side in first] for i in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 else rows


def time_fn(fns, inputs, iters, warmup, prepare=None, host=None, synchronized=False):
    """CUDA-event times in ms of every callable in `fns` (name -> fn(x)), interleaved:
    each repetition calls every side once on the same input, in the orders of
    balanced_orders (timed repetitions from its first row); L2 is flushed before each
    call, outside its events, by reading a 256 MB buffer (clean lines: no write-backs charged to the timed call).
    The events time the GPU's work: before each start event the GPU is given
    SPIN_CYCLES of spinning (torch.cuda._sleep) besides the flush, so the host has
    enqueued the whole call before the GPU reaches it (nvbench's blocking-kernel
    idea).  Without that, a small call whose host time outruns the GPU's work ahead
    of it is timed partly on the host, and its time moved 3x between runs on an
    H200 (docs/perf.md v33).  host (name -> dict), when given, receives each side's
    host time per call ("host_us": the Python call, from before fn(x) to its return)
    and "gpu_waited": the timed calls whose start event had already completed when
    the host returned from fn(x) (the GPU may then have waited on the host).
    prepare (name -> fn(x)), when given, runs before the flush, outside the events.
    synchronized=True times the other protocol, each call alone as a harness times
    a trial or a server answers one request: no spin; the host synchronises, records
    the start event, calls fn(x), records the end event and synchronises again, so
    the time holds the host's time per call (launches, Python) wherever the GPU
    waits for it."""
    flush = torch.ones(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=DEVICE)
    spin = getattr(torch.cuda, "_sleep", None)
    names = list(fns)
    events = {name: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                     for _ in range(iters)] for name in names}
    host_us = {name: [] for name in names}
    waited = dict.fromkeys(names, 0)
    orders = balanced_orders(len(names))
    for rep in range(warmup + iters):
        x = inputs[rep % len(inputs)]
        for name in (names[i] for i in orders[(rep - warmup) % len(orders)]):
            if prepare is not None:
                prepare[name](x)
            torch.amax(flush)
            if rep < warmup:
                fns[name](x)
                continue
            if synchronized:
                torch.cuda.synchronize()
            elif spin is not None:
                spin(SPIN_CYCLES)
            start, end = events[name][rep - warmup]
            start.record()
            t0 = time.perf_counter()
            fns[name](x)
            host_us[name].append((time.perf_counter() - t0) * 1e6)
            waited[name] += start.query()
            end.record()
            if synchronized:
                torch.cuda.synchronize()
    torch.cuda.synchronize()
    if host is not None:
        for name in names:
            host[name] = {"host_us": host_us[name], "gpu_waited": waited[name]}
    return {name: [start.elapsed_time(end) for start, end in events[name]] for name in names}


def protocol_rows(times, sync_times, flops):
    """One row per side from both protocols' times (time_fn): back to back
    (median_ms, min_ms, gemm_tflops, speedup_vs_eager, time_ratio_vs_eager) and
    synchronized per call (sync_median_ms, sync_speedup_vs_eager)."""
    eager_ms, eager_sync_ms = statistics.median(times["eager"]), statistics.median(sync_times["eager"])
    rows = []
    for name, ts in times.items():
        ms, sync_ms = statistics.median(ts), statistics.median(sync_times[name])
        rows.append({"side": name, "median_ms": ms, "min_ms": min(ts), "gemm_tflops": flops / (ms * 1e-3) / 1e12,
                     "speedup_vs_eager": eager_ms / ms, "time_ratio_vs_eager": ms / eager_ms,
                     "sync_median_ms": sync_ms, "sync_speedup_vs_eager": eager_sync_ms / sync_ms})
    return rows


def compute_dtype(args):
    """The dtype the GEMM runs in: --autocast's, else --dtype's."""
    return DTYPES[args.autocast or args.dtype]


def autocast_context(args):
    """torch.autocast("cuda", --autocast's dtype); without --autocast no context (torch 2.0's
    CPU autocast refuses float32 as its dtype even when disabled)."""
    if args.autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(DEVICE, dtype=compute_dtype(args))


def in_autocast(fn, args):
    """fn with each call inside its own autocast region (fn itself without
    --autocast, or with --one-region: the caller holds the region)."""
    if args.autocast is None or args.one_region:
        return fn

    def call(x):
        with autocast_context(args):
            return fn(x)

    return call


def one_region(args):
    """--one-region's autocast region around a mode's checks and timings (else nothing)."""
    return autocast_context(args) if args.one_region else contextlib.nullcontext()


def weight_cast_drop(args, mode):
    """prepare hooks for time_fn: under --autocast in train mode, ModelNew's
    cached weight cast is dropped before each of its calls (the engine's
    clear_weight_cache), as after a training step's weight update; else None."""
    if args.autocast is None or mode != "train" or args.one_region:
        return None
    clear = importlib.import_module("model_new").clear_weight_cache
    return {"eager": lambda x: None, "compile": lambda x: None, "floor": lambda x: None,
            "ModelNew": lambda x: clear()}


def bench_mode(problem, args, mode):
    """Builds, checks and times every side in one BatchNorm mode; returns (rows, check)."""
    m, k, n = args.shape
    dtype = DTYPES[args.dtype]
    ref, new = build_models(problem, args.shape, mode, args.seed, dtype)
    inputs = [torch.rand(m, k, device=DEVICE).to(dtype) for _ in range(NUM_INPUTS)]
    x_check = torch.rand(m, k, device=DEVICE).to(dtype)
    with torch.set_grad_enabled(args.grad), one_region(args):
        sides = {"eager": in_autocast(ref, args)}
        compiled = None if args.no_compile else try_compile(ref, inputs[0], lambda f: in_autocast(f, args))
        if compiled is not None:
            sides["compile"] = compiled
        sides["ModelNew"] = in_autocast(new, args)
        errors, check = check_accuracy(problem, sides, ref, x_check, compute_dtype(args))
        with autocast_context(args):
            check["kernel_path"] = new.kernel_path(inputs[0])  # dispatch's name for the path timed below
        compute = compute_dtype(args)
        floor = make_floor(m, k, n, compute)
        if floor is not None:
            sides["floor"] = floor
        times = time_fn(sides, inputs, args.iters, args.warmup, prepare=weight_cast_drop(args, mode))
        sync_times = time_fn(sides, inputs, args.iters, args.warmup, prepare=weight_cast_drop(args, mode),
                             synchronized=True)
    rows = protocol_rows(times, sync_times, 2.0 * m * n * k)
    for row in rows:
        row.update(mode=mode, rel_err_vs_fp64=errors.get(row["side"], float("nan")))
    if "floor" in times:
        check["modelnew_time_over_floor"] = statistics.median(times["ModelNew"]) / statistics.median(times["floor"])
    return rows, dict(check, mode=mode, model=problem["name"], floor=_floor_text(compute_dtype(args)))


def _floor_text(dtype):
    if dtype == torch.float32:
        return ("three cuBLAS float16 products with float32 output over K padded to a multiple of 8 "
                "(the fp16x3 GEMM's work)")
    return f"one cuBLAS {str(dtype).replace('torch.', '')} product (torch.mm, 16-bit output)"


def gemm_floor_16bit(m, k, n, dtype):
    """The 16-bit floor as a timed side: one cuBLAS product of (m, k) x (k, n)
    operands of dtype (the GEMM ModelNew's 16-bit and autocast paths run), on
    fixed pre-cast random operands (the argument x is ignored)."""
    a = torch.rand(m, k, device=DEVICE).to(dtype)
    b = torch.rand(n, k, device=DEVICE).to(dtype).t()

    def floor(x):
        torch.mm(a, b)

    return floor


def _padded_k(k):
    """K rounded up to a multiple of 8: sm90_fp16x3's prepass pads K with zero
    columns so every 16-bit row is 16-byte aligned; the floor does the same work
    (cuBLAS's fp16 path on unaligned rows is slow: measured 1.5-3 ms at
    1024 x 8191 x 8192 against 0.52 ms at K = 8192)."""
    return -(-k // 8) * 8


def _fp16_operand(rows, k):
    """A (rows, _padded_k(k)) float16 tensor: torch.rand in the first k columns,
    zeros after (the padding)."""
    t = torch.zeros(rows, _padded_k(k), device=DEVICE, dtype=torch.float16)
    t[:, :k] = torch.rand(rows, k, device=DEVICE)
    return t


def _has_out_dtype():
    """Whether this torch's mm takes out_dtype (16-bit operands, float32 output)."""
    a = torch.zeros(1, 8, device=DEVICE, dtype=torch.float16)
    try:
        torch.mm(a, a.t(), out_dtype=torch.float32)
    except (TypeError, RuntimeError):
        print("note: this torch's mm has no out_dtype; no floor side")
        return False
    return True


def gemm_floor(m, k, n):
    """The fp16x3 floor as a timed side: three cuBLAS products of (m, K8) x (K8, n)
    float16 operands with float32 output (torch.mm's out_dtype), K8 = k rounded
    up to a multiple of 8 with zero columns (_padded_k: the padded fp16x3 GEMM's
    work), on fixed pre-converted random operands (the argument x is ignored: the
    floor computes no model output).  None, with a note, where this torch's mm
    has no out_dtype."""
    if not _has_out_dtype():
        return None
    a = _fp16_operand(m, k)
    b = _fp16_operand(n, k).t()

    def floor(x):
        for _ in range(3):
            torch.mm(a, b, out_dtype=torch.float32)

    return floor


def w_read_floor(n, k, dtype):
    """A timed side whose time is twice reading W (n, k) once: a copy_ of W's size
    (read plus write); half its time is the floor of any forward that reads W once
    (small batches, where W's bytes dominate).  Fixed buffers; x ignored."""
    src = torch.rand(n, k, device=DEVICE).to(dtype)
    dst = torch.empty_like(src)
    return lambda x: dst.copy_(src)


def gemm_floor_step(m, k, n, dtype=torch.float32):
    """The training step's floor as a timed side: its three GEMMs at their own
    shapes and layouts, forward z = x W^T (m, n), grad x = g W (m, K8) and
    grad W = g^T x (n, K8), each as the forward's floor does it: for float32
    three cuBLAS float16 products with float32 output over K padded to K8 (nine
    products in all; gemm_floor), for a 16-bit dtype one product in that dtype
    over the unpadded k (three in all; gemm_floor_16bit).  Fixed random
    operands (x ignored).  None, with a note, where a float32 floor needs
    out_dtype and this torch's mm lacks it."""
    if dtype == torch.float32:
        if not _has_out_dtype():
            return None
        x16, w16 = _fp16_operand(m, k), _fp16_operand(n, k)
        g16 = torch.randn(m, n, device=DEVICE).half()
        products = [(x16, w16.t()), (g16, w16), (g16.t(), x16)]
        repeat, mm = 3, lambda a, b: torch.mm(a, b, out_dtype=torch.float32)
    else:
        x16, w16 = torch.rand(m, k, device=DEVICE).to(dtype), torch.rand(n, k, device=DEVICE).to(dtype)
        g16 = torch.randn(m, n, device=DEVICE).to(dtype)
        products = [(x16, w16.t()), (g16, w16), (g16.t(), x16)]
        repeat, mm = 1, torch.mm

    def floor(x):
        for a, b in products:
            for _ in range(repeat):
                mm(a, b)

    return floor


def optimizer_floor(products, n, k, dtype):
    """The step-with-optimizer floor as a timed side: `products` (gemm_floor_step's
    side), then SGD's update of a weight of gemm.weight's shape and dtype, w -= lr g
    (read W and its gradient, write W: what torch.optim.SGD's step does to it; the
    vectors' updates are N-sized and left out).  Fixed random buffers; x ignored."""
    w = torch.rand(n, k, device=DEVICE).to(dtype)
    g = torch.rand(n, k, device=DEVICE).to(dtype)

    def floor(x):
        products(x)
        w.add_(g, alpha=-OPTIMIZER_LR)

    return floor


def make_floor(m, k, n, compute):
    """The forward's floor side for GEMMs computing in `compute`: gemm_floor
    (float32) or gemm_floor_16bit; None where there is none."""
    return gemm_floor(m, k, n) if compute == torch.float32 else gemm_floor_16bit(m, k, n, compute)


def _gradients(model, x, g):
    """{name: gradient} of x and every parameter after model(x).backward(g) (x a
    fresh leaf; the parameters' .grad cleared first)."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    model(x).backward(g)
    params = dict(model.named_parameters())
    return {name: (x if name == "x" else params[name]).grad for name in GRAD_NAMES}


def check_grad_accuracy(sides, ref, x, g, training, compute=None):
    """Per side and gradient: relative Frobenius error against `ref` copied to
    float64 (same parameters and state) on x with output gradient g; in
    training, gemm.bias's max |grad| instead (its exact value is 0).  Calls the
    timed models (one more training step, as check_accuracy)."""
    grads64 = _gradients(copy.deepcopy(ref).double(), x.double(), g.double())
    errors, bias_max = {}, {}
    for name, model in sides.items():
        grads = _gradients(model, x, g)
        errors[name] = {}
        for key, want in grads64.items():
            got = grads[key] if grads[key] is not None else torch.zeros_like(want)
            if training and key == "gemm.bias":
                bias_max[name] = got.abs().max().item()
                continue
            errors[name][key] = ((got.double() - want).norm() / want.norm()).item()
    bias_max["float64"] = grads64["gemm.bias"].abs().max().item() if training else None
    compute = compute or x.dtype  # the dtype the GEMMs run in (--autocast's for float32 x)
    floor = GRAD_FLOORS[compute]
    close = all(errors["ModelNew"][k] <= 2 * errors["eager"][k] + floor for k in errors["eager"])
    if training and compute == torch.float32:
        close = close and bias_max["ModelNew"] == 0.0
    elif training:  # 16-bit: rounding noise around 0, as eager's (tests/test_lowp.py)
        close = close and bias_max["ModelNew"] <= 2 * bias_max["eager"] + 1e-3
    return errors, bias_max, close


def make_optimizer(name, model):
    """--optimizer's optimizer over model's parameters (None for no optimizer):
    "sgd" is torch.optim.SGD(lr=OPTIMIZER_LR), no momentum, torch's default
    (foreach) implementation.  Its step() writes every parameter, so the next
    forward of ModelNew finds gemm.weight changed and splits it again (the
    weight cache is dropped by the step), as in a training loop."""
    if name is None:
        return None
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=OPTIMIZER_LR)
    raise ValueError(f"unknown optimizer {name!r}")


def bench_backward_mode(problem, args, mode):
    """Forward + backward of eager Model and ModelNew in one BatchNorm mode;
    returns (rows, check)."""
    m, k, n = args.shape
    dtype = DTYPES[args.dtype]
    ref, new = build_models(problem, args.shape, mode, args.seed, dtype)
    inputs = [torch.rand(m, k, device=DEVICE).to(dtype).requires_grad_(True) for _ in range(NUM_INPUTS)]
    gen = torch.Generator(device=DEVICE).manual_seed(args.seed + 1)
    g = torch.randn(m, n, device=DEVICE, generator=gen).to(dtype)
    x_check = torch.rand(m, k, device=DEVICE).to(dtype)
    sides = {"eager": ref, "ModelNew": new}
    with autocast_context(args):
        errors, bias_max, close = check_grad_accuracy(sides, ref, x_check, g, mode == "train", compute_dtype(args))
        path = new.kernel_path(inputs[0])

    # --optimizer: each side steps its own optimizer inside the timed call, after the
    # accuracy check (the weights drift from here on; both sides start from one state).
    optimizers = {name: make_optimizer(args.optimizer, model) for name, model in sides.items()}

    def step(name, model):
        forward = in_autocast(model, args)
        optimizer = optimizers[name]
        if optimizer is None:
            return lambda x: forward(x).backward(g)

        def run(x):
            forward(x).backward(g)
            optimizer.step()

        return run

    # Under --autocast in train mode ModelNew's cached weight cast is dropped too, as a
    # training step's weight update would (weight_cast_drop).
    drop_cast = weight_cast_drop(args, mode) or {}

    def clear(name, model):
        def run(x):
            x.grad = None
            model.zero_grad(set_to_none=True)
            if name in drop_cast:
                drop_cast[name](x)
        return run

    fns = {name: step(name, model) for name, model in sides.items()}
    prepare = {name: clear(name, model) for name, model in sides.items()}
    # The floor: the three products of a training step (forward, grad x, grad W) at their
    # shapes, each as the forward's floor (gemm_floor_step); with --optimizer, plus the
    # optimizer's own update of gemm.weight (optimizer_floor).
    compute = compute_dtype(args)
    floor = gemm_floor_step(m, k, n, compute)
    if floor is not None and args.optimizer:
        floor = optimizer_floor(floor, n, k, DTYPES[args.dtype])
    if floor is not None:
        fns["floor"] = floor
        prepare["floor"] = lambda x: None
    with one_region(args):
        times = time_fn(fns, inputs, args.iters, args.warmup, prepare=prepare)
        sync_times = time_fn(fns, inputs, args.iters, args.warmup, prepare=prepare, synchronized=True)
    kind = "forward+backward" + (f"+{args.optimizer}" if args.optimizer else "")
    rows = protocol_rows(times, sync_times, 6.0 * m * n * k)
    for row in rows:
        row.update(mode=mode, kind=kind, grad_rel_err_vs_fp64=errors.get(row["side"], {}),
                   gemm_bias_grad_max_abs=bias_max.get(row["side"]))
    check = {"mode": mode, "model": problem["name"], "kind": kind, "optimizer": args.optimizer,
             "optimizer_lr": OPTIMIZER_LR if args.optimizer else None, "close_vs_eager": close,
             "gemm_bias_grad_max_abs_fp64": bias_max["float64"], "dtype": args.dtype, "autocast": args.autocast,
             "grad_floor": GRAD_FLOORS[compute], "kernel_path": path}
    if "floor" in times:
        check["floor"] = ("forward, grad x and grad W, each " + _floor_text(compute)
                          + (", then SGD's update of gemm.weight (read W and its gradient, write W)"
                             if args.optimizer else ""))
        check["modelnew_time_over_floor"] = statistics.median(times["ModelNew"]) / statistics.median(times["floor"])
    return rows, check


def print_backward_table(problem, rows, check):
    where = f", float32 models under autocast {check['autocast']}" if check.get("autocast") else ""
    step = (f" + {check['optimizer']}(lr={check['optimizer_lr']:g}).step()" if check.get("optimizer") else "")
    print(f"\nproblem {problem['name']} ({problem['title']}), mode={check['mode']}, "
          f"forward + backward{' + optimizer step' if step else ''}: model(x).backward(g){step}{where}")
    print(f"{'side':<10}{'median ms':>11}{'min ms':>10}{'GEMM TFLOP/s':>14}{'speedup':>10}{'time/eager':>12}"
          f"{'sync ms':>10}{'sync speedup':>14}")
    for r in rows:
        print(f"{r['side']:<10}{r['median_ms']:>11.3f}{r['min_ms']:>10.3f}{r['gemm_tflops']:>14.1f}"
              f"{r['speedup_vs_eager']:>9.2f}x{r['time_ratio_vs_eager']:>12.3f}"
              f"{r['sync_median_ms']:>10.3f}{r['sync_speedup_vs_eager']:>13.2f}x")
    print(SYNC_NOTE)
    if "modelnew_time_over_floor" in check:
        print(f"floor: {check['floor']}; ModelNew takes {check['modelnew_time_over_floor']:.2f}x the floor's time")
    by_side = {r["side"]: r for r in rows}
    print("gradient error vs float64, ||g - g64||_F / ||g64||_F:")
    print(f"  {'gradient':<13}{'eager':>10}{'ModelNew':>10}")
    for key in GRAD_NAMES:
        if key in by_side["eager"]["grad_rel_err_vs_fp64"]:
            print(f"  {key:<13}{by_side['eager']['grad_rel_err_vs_fp64'][key]:>10.2e}"
                  f"{by_side['ModelNew']['grad_rel_err_vs_fp64'][key]:>10.2e}")
        else:
            print(f"  {key:<13}max |grad| (exact value 0): eager {by_side['eager']['gemm_bias_grad_max_abs']:.1e}, "
                  f"ModelNew {by_side['ModelNew']['gemm_bias_grad_max_abs']:.1e}, "
                  f"float64 {check['gemm_bias_grad_max_abs_fp64']:.1e}")
    exact_bias = check["mode"] == "train" and check["dtype"] == "float32" and not check.get("autocast")
    print(f"ModelNew's gradients within 2x eager's error + {check['grad_floor']:g}"
          f"{' and gemm.bias exactly 0' if exact_bias else ''}: "
          f"{'yes' if check['close_vs_eager'] else 'NO'}; ModelNew path: {check['kernel_path']}")


def _git_revision():
    """HEAD's short hash, with "+changes" where tracked files differ from it (a working tree, or a
    copy whose .git is older than its files: the hash alone would name code that did not run);
    None outside a git checkout."""
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=here,
                             timeout=10)
        rev = out.stdout.strip()
        if not rev:
            return None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True, cwd=here, timeout=30)
        return rev + ("+changes" if status.returncode != 0 or status.stdout.strip() else "")
    except Exception:
        return None


def print_table(problem, rows, check, grad, dtype=torch.float32, autocast=None):
    where = f"float32 models under autocast {autocast}" if autocast else str(dtype).replace('torch.', '')
    print(f"\nproblem {problem['name']} ({problem['title']}), mode={check['mode']}, "
          f"grad={'enabled' if grad else 'disabled (torch.no_grad)'}, {where}")
    print(f"{'side':<10}{'median ms':>11}{'min ms':>10}{'GEMM TFLOP/s':>14}{'speedup':>10}"
          f"{'time/eager':>12}{'rel err vs fp64':>17}{'sync ms':>10}{'sync speedup':>14}")
    for r in rows:
        err = "-" if math.isnan(r["rel_err_vs_fp64"]) else f"{r['rel_err_vs_fp64']:.2e}"
        print(f"{r['side']:<10}{r['median_ms']:>11.3f}{r['min_ms']:>10.3f}{r['gemm_tflops']:>14.1f}"
              f"{r['speedup_vs_eager']:>9.2f}x{r['time_ratio_vs_eager']:>12.3f}{err:>17}"
              f"{r['sync_median_ms']:>10.3f}{r['sync_speedup_vs_eager']:>13.2f}x")
    print(SYNC_NOTE)
    if "modelnew_time_over_floor" in check:
        print(f"floor: {check['floor']}; ModelNew takes {check['modelnew_time_over_floor']:.2f}x the floor's time")
    print(f"ModelNew vs eager: max |diff| {check['max_abs_diff_vs_eager']:.2e}, "
          f"{close_check(problem, DTYPES[autocast] if autocast else dtype)[1]}: "
          f"{'yes' if check['close_vs_eager'] else 'NO'}; "
          f"ModelNew path: {check['kernel_path']}")


def run_sweep(problem, args, modes):
    """Eager Model, ModelNew and the floor (make_floor: for float32 three cuBLAS
    float16 products over K padded to a multiple of 8) over SWEEP_SHAPES; returns
    the rows (one per shape and mode)."""
    rows = []
    dtype = DTYPES[args.dtype]
    print(f"\nproblem {problem['name']} ({problem['title']}); floor: {_floor_text(dtype)}")
    print(f"{'mode':<6}{'M':>6}{'K':>7}{'N':>7}{'eager ms':>11}{'ModelNew ms':>13}{'speedup':>9}"
          f"{'time/eager':>12}{'floor ms':>10}{'new/floor':>11}{'W read ms':>11}{'new/W read':>12}"
          f"{'sync speedup':>14}{'TFLOP/s':>9}{'rel err':>10}{'eager err':>11}{'host us: eager':>16}{'ModelNew':>10}")
    for mode in modes:
        for shape in SWEEP_SHAPES:
            m, k, n = shape
            if mode == "train" and m < 2:  # BatchNorm1d's batch statistics need two rows
                continue
            ref, new = build_models(problem, shape, mode, args.seed, dtype)
            inputs = [torch.rand(m, k, device=DEVICE).to(dtype) for _ in range(NUM_INPUTS)]
            with torch.no_grad():
                sides = {"eager": ref, "ModelNew": new}
                errors, check = check_accuracy(problem, sides, ref, torch.rand(m, k, device=DEVICE).to(dtype))
                floor = make_floor(m, k, n, dtype)
                if floor is not None:
                    sides["floor"] = floor
                sides["w_copy"] = w_read_floor(n, k, dtype)
                host = {}
                times = time_fn(sides, inputs, args.iters, args.warmup, host=host)
                sync = {name: fn for name, fn in sides.items() if name in ("eager", "ModelNew")}
                sync_times = time_fn(sync, inputs, args.iters, args.warmup, synchronized=True)
            eager_ms, new_ms = statistics.median(times["eager"]), statistics.median(times["ModelNew"])
            floor_ms = statistics.median(times["floor"]) if "floor" in times else None
            w_read_ms = statistics.median(times["w_copy"]) / 2
            sync_speedup = statistics.median(sync_times["eager"]) / statistics.median(sync_times["ModelNew"])
            host_us = {name: statistics.median(h["host_us"]) for name, h in host.items()}
            waited = {name: h["gpu_waited"] for name, h in host.items() if h["gpu_waited"]}
            row = {"mode": mode, "M": m, "K": k, "N": n, "eager_ms": eager_ms, "modelnew_ms": new_ms,
                   "speedup_vs_eager": eager_ms / new_ms, "time_ratio_vs_eager": new_ms / eager_ms,
                   "floor_ms": floor_ms, "modelnew_time_over_floor": new_ms / floor_ms if floor_ms else None,
                   "w_read_ms": w_read_ms, "modelnew_time_over_w_read": new_ms / w_read_ms,
                   "eager_sync_ms": statistics.median(sync_times["eager"]),
                   "modelnew_sync_ms": statistics.median(sync_times["ModelNew"]), "sync_speedup_vs_eager": sync_speedup,
                   "modelnew_gemm_tflops": 2.0 * m * n * k / (new_ms * 1e-3) / 1e12,
                   "rel_err_vs_fp64": errors["ModelNew"], "eager_rel_err_vs_fp64": errors["eager"],
                   "close_vs_eager": check["close_vs_eager"], "eager_host_us": host_us["eager"],
                   "modelnew_host_us": host_us["ModelNew"], "gpu_waited_on_host": waited}
            rows.append(row)
            floor_cols = (f"{floor_ms:>10.3f}{row['modelnew_time_over_floor']:>10.2f}x" if floor_ms
                          else f"{'-':>10}{'-':>11}")
            print(f"{mode:<6}{m:>6}{k:>7}{n:>7}{eager_ms:>11.3f}{new_ms:>13.3f}{eager_ms / new_ms:>8.2f}x"
                  f"{new_ms / eager_ms:>12.3f}{floor_cols}{w_read_ms:>11.3f}{new_ms / w_read_ms:>11.2f}x"
                  f"{sync_speedup:>13.2f}x{row['modelnew_gemm_tflops']:>9.1f}"
                  f"{errors['ModelNew']:>10.1e}{errors['eager']:>11.1e}{host_us['eager']:>16.1f}"
                  f"{host_us['ModelNew']:>10.1f}"
                  + (f"  (GPU reached the call before its launches: {waited})" if waited else ""), flush=True)
            del ref, new, inputs, sides, floor
            torch.cuda.empty_cache()
    return rows


def plot_sweep(rows, path, env):
    """Two panels against M, one line per (K = N) feature size and mode, tails as
    points: speedup over eager, and ModelNew's time over the floor's (where the
    rows have a floor)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no plot written")
        return None
    panels = [("speedup_vs_eager", "speedup over eager Model (x)", "ModelNew vs eager")]
    if all(r.get("modelnew_time_over_floor") for r in rows):
        panels.append(("modelnew_time_over_floor", "ModelNew time / floor time (x)", "ModelNew vs floor"))
    fig, axes = plt.subplots(1, len(panels), figsize=(8 * len(panels), 5), squeeze=False)
    for ax, (key, ylabel, title) in zip(axes[0], panels):
        for mode in sorted({r["mode"] for r in rows}):
            for f in sorted({r["N"] for r in rows if r["K"] == r["N"]}):
                pts = sorted((r["M"], r[key]) for r in rows if r["mode"] == mode and r["K"] == r["N"] == f)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                        linestyle="-" if mode == "train" else "--", label=f"{mode}, K = N = {f}")
            tails = [r for r in rows if r["mode"] == mode and r["K"] != r["N"]]
            ax.scatter([r["M"] for r in tails], [r[key] for r in tails], marker="x",
                       label=f"{mode}, tails (K != N)")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch M")
        ax.set_ylabel(ylabel)
        ax.set_title(f"problem {env['model']}: {title}, {env['dtype']}, {env['device']}, torch {env['torch']}",
                     fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def load_problem(name):
    """PROBLEMS[name] with its Model and ModelNew classes (imports build the extension)."""
    problem = dict(PROBLEMS[name], name=name)
    problem["Model"] = importlib.import_module(problem["reference"]).Model
    problem["ModelNew"] = importlib.import_module(problem["model_new"]).ModelNew
    return problem


def sweep_problem(problem, args, modes, env):
    rows = run_sweep(problem, args, modes)
    out_dir = os.path.dirname(args.json) or "."
    os.makedirs(out_dir, exist_ok=True)
    stem = "sweep" if problem["name"] == "33" else f"sweep_{problem['name']}"
    json_path = os.path.join(out_dir, f"{stem}.json")
    with open(json_path, "w") as f:
        json.dump({"env": dict(env, model=problem["name"]), "args": vars(args), "rows": rows}, f, indent=2)
    png = plot_sweep(rows, os.path.join(out_dir, f"{stem}.png"), dict(env, model=problem["name"]))
    slower = [r for r in rows if r["time_ratio_vs_eager"] > 1.0]
    wrong = [r for r in rows if not r["close_vs_eager"]]
    print(f"\nwrote {json_path}" + (f" and {png}" if png else ""))
    slower_host = [r for r in rows if r["modelnew_host_us"] > r["eager_host_us"]]
    waited = [r for r in rows if r["gpu_waited_on_host"]]
    print(f"problem {problem['name']}: shapes where ModelNew is slower than eager: {len(slower)} of {len(rows)} "
          f"(GPU time); host time per call above eager's: {len(slower_host)}; not close: {len(wrong)}"
          + (f"; shapes where the GPU reached a timed call before its launches: {len(waited)}" if waited else ""))
    over_floor = [r["modelnew_time_over_floor"] for r in rows if r.get("modelnew_time_over_floor")]
    if over_floor:
        worst = max(rows, key=lambda r: r.get("modelnew_time_over_floor") or 0.0)
        print(f"problem {problem['name']}: ModelNew time / floor time: median {statistics.median(over_floor):.2f}x, "
              f"max {worst['modelnew_time_over_floor']:.2f}x ({worst['mode']} {worst['M']}x{worst['K']}x{worst['N']})")
    return not wrong


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.py: a CUDA GPU is needed (torch.cuda.is_available() is False); nothing was measured.",
              file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 GEMMs in eager and compiled sides (the default)
    # 16-bit eager GEMMs with float32 split-K reductions: eager rounds only where its ops say.
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    t0 = time.perf_counter()
    problems = [load_problem(name) for name in (("33", "84") if args.model == "both" else (args.model,))]
    build_s = time.perf_counter() - t0

    m, k, n = args.shape
    env = {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
           "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "git": _git_revision(), "allow_tf32": torch.backends.cuda.matmul.allow_tf32, "dtype": args.dtype,
           "extension_import_s": build_s, "l2_flush_bytes": L2_FLUSH_BYTES, "num_inputs": NUM_INPUTS}
    print(f"device {env['device']} (capability {env['capability'][0]}.{env['capability'][1]}), "
          f"torch {env['torch']}, CUDA {env['cuda']}, python {env['python']}, git {env['git']}")
    print(f"shape M={m} (batch), K={k} (in_features), N={n} (out_features), {args.dtype}; mode {args.mode}; "
          f"seed {args.seed}; {args.warmup} warm-up + {args.iters} timed repetitions; "
          f"extension import {build_s:.1f} s (excluded)")

    modes = ["train", "eval"] if args.mode == "both" else [args.mode]
    if args.sweep:
        ok = [sweep_problem(problem, args, modes, env) for problem in problems]
        return 0 if all(ok) else 1
    rows, checks = [], []
    for problem in problems:
        for mode in modes:
            if args.backward:
                mode_rows, check = bench_backward_mode(problem, args, mode)
                print_backward_table(problem, mode_rows, check)
            else:
                mode_rows, check = bench_mode(problem, args, mode)
                print_table(problem, mode_rows, check, args.grad, DTYPES[args.dtype], args.autocast)
            rows += [dict(r, model=problem["name"]) for r in mode_rows]
            checks.append(check)
            _reset_dynamo()
            torch.cuda.empty_cache()

    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"env": env, "args": dict(vars(args), shape=list(args.shape)), "rows": rows, "checks": checks},
                  f, indent=2)
    print(f"\nwrote {args.json}")

    failed = [c for c in checks if not c["close_vs_eager"]]
    for c in failed:
        detail = ("gradients" if args.backward else f"max |diff| {c['max_abs_diff_vs_eager']:.2e}")
        print(f"WARNING: problem {c['model']} ModelNew is not close to the reference Model in {c['mode']} mode "
              f"({detail})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
