"""A/B of two kernel trees in one process, without switches in the kernels: this
checkout's kernels/ ("new") against another copy of them ("base": a folder, or a git
revision's kernels/), each compiled into its own copy of model_new.py, timed side by side.

    python tools/ab_kernels.py --base REV        [options]   # git archive REV kernels/ (needs .git)
    python tools/ab_kernels.py --base-dir DIR    [options]   # DIR holds torch_binding.cpp (a kernels/ copy)
    python tools/ab_kernels.py --base-tree DIR   [options]   # DIR holds model_new.py, its extras, kernels/ and
                                                             # problem 84's folder (git archive REV | tar -x -C DIR)
      --model 33|84|both  --dtype float32|float16|bfloat16  --mode train|eval|both
      --shape M,K,N (repeatable; default 1024,8192,8192)  --grad  --backward  --iters N  --warmup N  --rounds R
      --seed S
      --autocast float16|bfloat16  (with --dtype float32: each call of each side in its own
                                    torch.autocast region, as bench.py --autocast times it)

How: model_new.py is imported a second time under another module name with
$FUSED_GEMM_BN_KERNEL_DIR set to the base folder for that import only (the core reads its
kernel sources, and binds its extras, the 16-bit one included, at import: docs/design.md),
or with --base-tree the base tree's own model_new.py (its extras and kernels found by its
location: the base's Python with its kernels, for changes to a binding's entry points, whose
names the Python lists);
problem 84's module text is executed against each copy in turn, as a harness executes a
file without __file__ (it then imports model_new by name).  Both sides get the same
parameters and buffers (the base side loads the new side's state_dict).  Both extensions
build before timing (a first call each).

Checked, then timed: per (problem, dtype, mode, shape), one call of each side on the same
input (and with --grad a backward with the same gradient) from the same state: outputs,
buffers and gradients compared bit for bit, else the largest difference and each side's
error against a float64 reference are printed.  Then bench.time_fn's interleaved rounds
(balanced orders, L2 flushed) of eager, the floor, new and base, in both protocols (back to
back and synchronized per call), --rounds times: the medians per round, new / base and
new / floor.  --backward times forward + backward instead (model(x).backward(g), x requiring
grad, the gradients cleared before each call outside the timing, as bench.py --backward; the
floor is bench.gemm_floor_step's three products).  Needs a CUDA GPU (exit 2 without one).
"""
import argparse
import contextlib
import copy
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import bench  # noqa: E402

KERNEL_DIR_ENV = "FUSED_GEMM_BN_KERNEL_DIR"
PROBLEM_84_RELATIVE = os.path.join("level2_84_gemm_batchnorm_scaling_softmax", "model_new.py")
PROBLEM_84_FILE = os.path.join(ROOT, PROBLEM_84_RELATIVE)


def kernels_of_revision(rev, into):
    """git archive's kernels/ of `rev`, extracted under `into`; returns the folder."""
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "kernels"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return os.path.join(into, "kernels")


def load_engine(name, kernel_dir, root=ROOT):
    """root's model_new.py (the checkout's by default) imported as module `name`, its kernel
    sources (and its extras') read from kernel_dir, or from root's kernels/ when kernel_dir
    is None."""
    if name in sys.modules:
        raise RuntimeError(f"module name {name} is taken")
    saved = os.environ.pop(KERNEL_DIR_ENV, None)
    if kernel_dir is not None:
        os.environ[KERNEL_DIR_ENV] = kernel_dir
    try:
        spec = importlib.util.spec_from_file_location(name, os.path.join(root, "model_new.py"))
        module = sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    finally:
        os.environ.pop(KERNEL_DIR_ENV, None)
        if saved is not None:
            os.environ[KERNEL_DIR_ENV] = saved
    return module


@contextlib.contextmanager
def _model_new_bound_to(engine):
    saved = sys.modules.get("model_new")
    sys.modules["model_new"] = engine
    try:
        yield
    finally:
        if saved is None:
            sys.modules.pop("model_new", None)
        else:
            sys.modules["model_new"] = saved


def module_classes(engine, problem_84_file=PROBLEM_84_FILE):
    """{"33": ModelNew, "84": ModelNew} on `engine`: problem 33's from the engine itself,
    problem 84's from its file's text (the checkout's, or problem_84_file) executed without
    __file__ while the name model_new is bound to `engine`."""
    with open(problem_84_file, encoding="utf-8") as f:
        text = f.read()
    namespace = {"__name__": f"ab_kernels_84_{engine.__name__}"}
    with _model_new_bound_to(engine):
        exec(compile(text, problem_84_file + " (text)", "exec"), namespace)
    return {"33": engine.ModelNew, "84": namespace["ModelNew"]}


def build_pair(problem, classes, shape, mode, seed, dtype):
    """(Model, new, base) on the GPU in dtype: new built as bench.build_models builds
    ModelNew (eval: after training steps), base given new's state_dict."""
    ref, new = bench.build_models(dict(problem, ModelNew=classes["new"]), shape, mode, seed, dtype)
    m, k, n = shape
    torch.manual_seed(seed)
    base = classes["base"](*problem["init"](k, n)).to(bench.DEVICE, dtype)
    base.load_state_dict(new.state_dict())
    base.train(new.training)
    return ref, new, base


def one_call(model, x, g):
    """Output, buffers and (with g) the gradients of x and the parameters after one call of a
    deep copy of model (so every side starts from the same state)."""
    model = copy.deepcopy(model)
    xi = x.clone().requires_grad_(g is not None)
    with torch.set_grad_enabled(g is not None):
        y = model(xi)
        if g is not None:
            y.backward(g)
    result = {"out": y.detach()}
    result.update({"buffer " + k: v.detach().clone() for k, v in model.named_buffers()})
    if g is not None:
        result["grad x"] = xi.grad
        result.update({"grad " + k: p.grad for k, p in model.named_parameters() if p.grad is not None})
    return result


def compare(ref, new, base, x, grad):
    """'bit-identical', or the differing entries with their largest difference and the two
    sides' output errors against float64."""
    g = torch.randn(x.shape[0], new.gemm.weight.shape[0], device=x.device, dtype=x.dtype) if grad else None
    a, b = one_call(new, x, g), one_call(base, x, g)
    differing = [k for k in a if not torch.equal(a[k], b[k])]
    if not differing:
        return "bit-identical"
    ref64 = copy.deepcopy(ref).double()
    with torch.no_grad():
        y64 = ref64(x.double())
    err = {s: (r["out"].double() - y64).abs().max().item() for s, r in (("new", a), ("base", b))}
    diffs = ", ".join(f"{k} {(a[k].double() - b[k].double()).abs().max().item():.3g}" for k in differing)
    return f"differ: {diffs}; output error vs float64: new {err['new']:.3g}, base {err['base']:.3g}"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--base", metavar="REV", help="git revision whose kernels/ is the base side")
    source.add_argument("--base-dir", metavar="DIR", help="a kernels/ folder (holding torch_binding.cpp)")
    source.add_argument("--base-tree", metavar="DIR", help="a tree holding model_new.py, its model_new_*.py, kernels/ "
                        "and problem 84's folder, whose own Python runs the base side")
    p.add_argument("--model", choices=("33", "84", "both"), default="both")
    p.add_argument("--dtype", choices=tuple(bench.DTYPES), default="float16")
    p.add_argument("--mode", choices=("train", "eval", "both"), default="both")
    p.add_argument("--shape", type=bench.parse_shape, action="append", metavar="M,K,N")
    p.add_argument("--grad", action="store_true", help="forward with gradients, and a backward in the check")
    p.add_argument("--backward", action="store_true",
                   help="time forward + backward (model(x).backward(g), x requiring grad); implies --grad")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--autocast", choices=("float16", "bfloat16"), default=None,
                   help="float32 models, every call in its own torch.autocast region of this dtype; in train mode "
                        "each side's cached weight cast is dropped before its calls (bench.weight_cast_drop's rule)")
    args = p.parse_args(argv)
    if args.autocast is not None and args.dtype != "float32":
        p.error("--autocast runs float32 models: it needs --dtype float32")
    args.grad = args.grad or args.backward
    return args


def region(dtype):
    """torch.autocast("cuda", dtype), or no context for dtype None."""
    return contextlib.nullcontext() if dtype is None else torch.autocast("cuda", dtype=dtype)


def in_region(fn, dtype):
    """fn with each call in its own torch.autocast("cuda", dtype) region (fn itself for dtype None)."""
    if dtype is None:
        return fn

    def call(x):
        with region(dtype):
            return fn(x)

    return call


def as_steps(sides, models, prepare, m, n, dtype, seed):
    """sides' forwards as forward + backward calls with one fixed g ~ N(0, 1) (m, n), and
    prepare's per-call work (untimed) preceded by clearing x's and models[side]'s gradients."""
    gen = torch.Generator(device=bench.DEVICE).manual_seed(seed + 1)
    g = torch.randn(m, n, device=bench.DEVICE, generator=gen).to(dtype)
    steps, clears = {}, {}
    for s, fn in sides.items():
        steps[s] = lambda x, fn=fn: fn(x).backward(g)

        def clear(x, model=models[s], before=(prepare or {}).get(s)):
            x.grad = None
            model.zero_grad(set_to_none=True)
            if before is not None:
                before(x)
        clears[s] = clear
    return steps, clears


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("tools/ab_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        engines = {"new": load_engine("ab_kernels_new", None)}
        if args.base_tree:
            engines["base"] = load_engine("ab_kernels_base", None, root=args.base_tree)
        else:
            base_dir = args.base_dir if args.base_dir else kernels_of_revision(args.base, tmp)
            engines["base"] = load_engine("ab_kernels_base", base_dir)
        classes = {"new": module_classes(engines["new"]),
                   "base": module_classes(engines["base"], os.path.join(args.base_tree, PROBLEM_84_RELATIVE))
                   if args.base_tree else module_classes(engines["base"])}
    lowp = {side: engine.extra("model_new_lowp") for side, engine in engines.items()}
    if args.dtype != "float32" and all(m is not None and m.available() for m in lowp.values()) and \
            lowp["new"].sources() == lowp["base"].sources():
        print("note: both sides' 16-bit kernel sources (kernels/lowp/ and the headers they include) are identical")
    dtype = bench.DTYPES[args.dtype]
    mixed = None if args.autocast is None else bench.DTYPES[args.autocast]
    shapes = args.shape or [(1024, 8192, 8192)]
    modes = ("train", "eval") if args.mode == "both" else (args.mode,)
    names = ("33", "84") if args.model == "both" else (args.model,)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; new: {os.path.join(ROOT, 'kernels')}, "
          f"base: {args.base_tree or args.base_dir or args.base}; {args.iters} timed calls a side a round, "
          f"{args.rounds} rounds")
    for name in names:
        problem = dict(bench.PROBLEMS[name], name=name)
        problem["Model"] = importlib.import_module(problem["reference"]).Model
        for shape in shapes:
            m, k, n = shape
            for mode in modes:
                pair = {side: classes[side][name] for side in classes}
                ref, new, base = build_pair(problem, pair, shape, mode, args.seed, dtype)
                x = torch.randn(m, k, device=bench.DEVICE).to(dtype)
                with region(mixed):
                    verdict = compare(ref, new, base, x, args.grad)
                inputs = [torch.rand(m, k, device=bench.DEVICE).to(dtype).requires_grad_(args.backward)
                          for _ in range(bench.NUM_INPUTS)]
                sides = {"eager": in_region(ref, mixed), "new": in_region(new, mixed), "base": in_region(base, mixed)}
                prepare = None
                if mixed is not None and mode == "train":  # (as after an optimizer step, each call)
                    prepare = {s: lambda x: None for s in ("eager", "floor")}
                    prepare.update({s: (lambda x, e=engines[s]: e.clear_weight_cache()) for s in engines})
                if args.backward:
                    sides, prepare = as_steps(sides, {"eager": ref, "new": new, "base": base}, prepare, m, n,
                                              dtype, args.seed)
                floor = (bench.gemm_floor_step if args.backward else bench.make_floor)(
                    m, k, n, dtype if mixed is None else mixed)
                if floor is not None:
                    sides["floor"] = floor
                    if prepare is not None:
                        prepare["floor"] = lambda x: None
                with region(mixed), torch.set_grad_enabled(args.grad):  # (the paths timed below)
                    paths = new.kernel_path(x), base.kernel_path(x)
                print(f"\nproblem {name} {args.dtype}{'' if mixed is None else ' autocast ' + args.autocast} {mode}"
                      f"{' forward + backward' if args.backward else ' with gradients' if args.grad else ''} "
                      f"{m}x{k}x{n}: "
                      f"new path {paths[0]}, base path {paths[1]}; {verdict}")
                with torch.set_grad_enabled(args.grad):
                    for synchronized in (False, True):
                        per_round = {s: [] for s in sides}
                        for _ in range(args.rounds):
                            t = bench.time_fn(sides, inputs, args.iters, args.warmup, prepare=prepare,
                                              synchronized=synchronized)
                            for s, ts in t.items():
                                per_round[s].append(statistics.median(ts) * 1e3)
                        med = {s: statistics.median(v) for s, v in per_round.items()}
                        rounds = "  ".join(f"{s} {'/'.join(f'{v:.1f}' for v in vs)}" for s, vs in per_round.items())
                        ratio = f"new/base {med['new'] / med['base']:.3f}"
                        if "floor" in med:
                            ratio += (f", new/floor {med['new'] / med['floor']:.3f}, "
                                      f"base/floor {med['base'] / med['floor']:.3f}")
                        print(f"  {'synchronized' if synchronized else 'back to back':12s} us: {rounds}  ({ratio})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
