"""Issue 39 item 1: the calls tools/ncu_profile.sh profiles, one process per run.

    python3 tools/ncu_profile_driver.py --shape 1024,8192,8192 --model 33 --mode train [--warmup 5]
        under `ncu --profile-from-start off`: builds ModelNew (seeded, on the GPU, float32),
        warms both sides up, then inside ONE cudaProfilerStart/Stop range runs
          1. ModelNew's forward, once (torch.no_grad(), the KernelBench call: in train
             mode the prepass, the fp16x3 GEMM and bn_apply / bn_softmax);
          2. a marker kernel, torch.cuda._sleep (aten's `spin_kernel`): everything before
             it is ModelNew's, everything after it the floor's;
          3. the floor, once: ONE cuBLAS float16 product with float32 output,
             torch.mm(a16, b16.t(), out_dtype=torch.float32) over K padded with zero
             columns to a multiple of 8 (bench.py's floor is three such products);
             where mm has no out_dtype, torch.mm(a16, b16.t()).float() (two kernels).
    python3 tools/ncu_profile_driver.py --kineto RUN [RUN ...]
        no ncu: per run (M,K,N:model:mode), each side's kernels and their mean times under
        torch.profiler over 5 back-to-back calls (no L2 flush), to cross-check ncu's
        kernel list and attribution; prints a table.
    python3 tools/ncu_profile_driver.py --dry-run ...   prints what it would run, needs no GPU.

M = batch, K = in_features, N = out_features.  Inputs torch.rand, seed 0.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

DEVICE = "cuda"  # a CPU smoke test sets "cpu" (and stubs the torch.cuda calls)
MARKER_CYCLES = 1000  # the separator kernel's spin: short, and its name is known (spin_kernel)
EVAL_TRAIN_STEPS = 3  # as bench.py: eval runs after a few training steps


def parse_shape(text):
    m, k, n = (int(v) for v in text.split(","))
    return m, k, n


def parse_run(text):
    """'M,K,N:model:mode' -> (shape, model, mode)."""
    shape, model, mode = text.split(":")
    if model not in ("33", "84") or mode not in ("train", "eval"):
        raise argparse.ArgumentTypeError(f"bad run {text!r}: expected M,K,N:33|84:train|eval")
    return parse_shape(shape), model, mode


def padded_k(k):
    """K rounded up to a multiple of 8 (sm90_fp16x3's prepass pads K with zeros)."""
    return -(-k // 8) * 8


def build_model(shape, model, mode, seed=0):
    """ModelNew of problem `model` on the GPU in float32, in `mode`; eval after
    EVAL_TRAIN_STEPS training calls."""
    m, k, n = shape
    if model == "33":
        from model_new import ModelNew
        args = (k, n, (n,))
    else:
        from level2_84_gemm_batchnorm_scaling_softmax.model_new import ModelNew
        args = (k, n)
    torch.manual_seed(seed)
    new = ModelNew(*args).to(DEVICE).train()
    if mode == "eval":
        with torch.no_grad():
            for _ in range(EVAL_TRAIN_STEPS):
                new(torch.rand(m, k, device=DEVICE))
        new.eval()
    return new


def build_floor(shape):
    """(callable running one floor product, its description)."""
    m, k, n = shape
    kp = padded_k(k)
    a = torch.zeros(m, kp, device=DEVICE, dtype=torch.float16)
    a[:, :k] = torch.rand(m, k, device=DEVICE)
    b = torch.zeros(n, kp, device=DEVICE, dtype=torch.float16)
    b[:, :k] = torch.rand(n, k, device=DEVICE)
    try:
        torch.mm(a[:1], b[:1].t(), out_dtype=torch.float32)
    except (TypeError, RuntimeError):
        return (lambda: torch.mm(a, b.t()).float()), f"torch.mm(a16, b16.t()).float() over K={kp} (no out_dtype)"
    return (lambda: torch.mm(a, b.t(), out_dtype=torch.float32)), f"torch.mm(a16, b16.t(), out_dtype=float32) over K={kp}"


def kernel_path(new, x):
    try:
        with torch.no_grad():
            return new.kernel_path(x)
    except Exception as e:  # the interface may change under the restructuring
        return f"? ({type(e).__name__})"


def profile_once(shape, model, mode, warmup):
    """The ncu run: warm-up outside, then the one profiled range (module docstring)."""
    m, k, n = shape
    new = build_model(shape, model, mode)
    x = torch.rand(m, k, device=DEVICE)
    floor, floor_text = build_floor(shape)
    with torch.no_grad():
        for _ in range(warmup):
            new(x)
            floor()
    torch.cuda.synchronize()
    print(f"ncu_profile_driver: {m}x{k}x{n} problem {model} {mode}: ModelNew path {kernel_path(new, x)}; "
          f"floor {floor_text}; profiling one call of each", flush=True)
    torch.cuda.empty_cache()  # less memory for kernel replay to save and restore
    torch.cuda.profiler.start()
    with torch.no_grad():
        new(x)
        torch.cuda._sleep(MARKER_CYCLES)
        floor()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def kineto(runs, warmup, calls=5):
    """Per run and side, torch.profiler's kernels: name, calls, mean us."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for shape, model, mode in runs:
        m, k, n = shape
        new = build_model(shape, model, mode)
        x = torch.rand(m, k, device=DEVICE)
        floor, floor_text = build_floor(shape)
        sides = {"ModelNew": lambda: new(x), "floor": floor}
        with torch.no_grad():
            for _ in range(warmup):
                for fn in sides.values():
                    fn()
            torch.cuda.synchronize()
            print(f"\n== kineto {m}x{k}x{n} problem {model} {mode} (ModelNew path {kernel_path(new, x)}; "
                  f"floor: {floor_text}); {calls} back-to-back calls per side, no L2 flush")
            for name, fn in sides.items():
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(calls):
                        fn()
                    torch.cuda.synchronize()
                total = 0.0
                events = list(prof.key_averages())
                # the kernels (device-side events); CPU ops carry their kernels' time too
                kernels = [e for e in events if getattr(e, "device_type", None) == DeviceType.CUDA]
                if not kernels:
                    kernels = [e for e in events if not e.key.startswith(("aten::", "cuda", "Activity"))]
                for evt in kernels:
                    us = getattr(evt, "device_time_total", None)
                    if us is None:
                        us = getattr(evt, "cuda_time_total", 0.0)
                    if not us:
                        continue
                    per_call = us / calls
                    total += per_call
                    print(f"  {name:<9} {per_call:>10.1f} us/call  x{evt.count // calls:<2} {evt.key[:110]}")
                print(f"  {name:<9} {total:>10.1f} us/call  total")
        del new, x, floor, sides
        torch.cuda.empty_cache()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", type=parse_shape, default=(1024, 8192, 8192), metavar="M,K,N")
    p.add_argument("--model", choices=("33", "84"), default="33")
    p.add_argument("--mode", choices=("train", "eval"), default="train")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--kineto", nargs="+", type=parse_run, metavar="M,K,N:MODEL:MODE")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    if args.dry_run:
        if args.kineto:
            print("would list kernels with torch.profiler for", args.kineto)
        else:
            m, k, n = args.shape
            print(f"would profile {m}x{k}x{n} problem {args.model} {args.mode}: {args.warmup} warm-up calls, then "
                  f"ModelNew once, spin_kernel marker, floor once (K padded to {padded_k(k)})")
        return 0
    if not torch.cuda.is_available():
        print("ncu_profile_driver: no CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.kineto:
        kineto(args.kineto, args.warmup)
    else:
        profile_once(args.shape, args.model, args.mode, args.warmup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
