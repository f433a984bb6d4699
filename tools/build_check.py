"""Builds both CUDA extensions for sm_90a and sm_80 exactly as a GPU machine's
first import does (model_new._load_extension: load_inline with torch's own C++
standard and flags), on a machine without a GPU: compile and link must succeed
with the installed torch and the nvcc found through $CUDA_HOME or PATH.
Loading the built module may then fail for want of a driver; that is reported
and does not count as a failure.

    python tools/build_check.py                      # both extensions; exit status 1 on a failure
    python tools/build_check.py --force-std c++17    # negative control, see below

Every run builds in a fresh $TORCH_EXTENSIONS_DIR (a temporary folder, removed
after; --keep keeps it and prints it), so an earlier build is never loaded.

--force-std STD appends -std=STD to the host compiler's and nvcc's flags (the
compiler takes the last -std, so torch's own choice is overridden) and expects
the build to FAIL: with torch >= 2.14, whose headers need C++20, `--force-std
c++17` shows that the build would catch a standard torch no longer accepts.
Exit status 0 when every extension fails to build, 1 when one builds.

The extensions are described by one small function each (float32_extension,
lowp_extension): where model_new keeps an extension's sources, exported
functions and module prefix changes, only that function changes.
"""
import argparse
import contextlib
import glob
import os
import re
import shutil
import sys
import tempfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tools.check_boundary import cuda_home  # noqa: E402

ARCH_FLAGS = ["-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_80,code=sm_80"]


def float32_extension():
    """(sources, exported functions, module prefix) of the float32 extension (kernels/)."""
    import model_new

    return model_new._KERNEL_SOURCES, model_new._EXTENSION_FUNCTIONS, model_new._EXTENSION_PREFIX


def lowp_extension():
    """(sources, exported functions, module prefix) of the 16-bit extension (kernels/lowp/)."""
    import model_new

    return model_new._LOWP.sources(), model_new._LOWP.FUNCTIONS, model_new._LOWP.PREFIX


EXTENSIONS = {"float32": float32_extension, "16-bit": lowp_extension}


@contextlib.contextmanager
def forced_std(std):
    """While active, load_inline gets -std=`std` last in its host and nvcc flags."""
    if std is None:
        yield
        return
    from torch.utils import cpp_extension

    load_inline = cpp_extension.load_inline

    def with_std(*args, **kwargs):
        kwargs["extra_cflags"] = list(kwargs.get("extra_cflags") or []) + [f"-std={std}"]
        kwargs["extra_cuda_cflags"] = list(kwargs.get("extra_cuda_cflags") or []) + [f"-std={std}"]
        return load_inline(*args, **kwargs)

    cpp_extension.load_inline = with_std
    try:
        yield
    finally:
        cpp_extension.load_inline = load_inline


def _compiler_output(exc):
    """The longest message of an exception chain: load_inline's, which holds the
    compiler output (model_new's wraps it; ninja's exit status lies beneath)."""
    messages = []
    while exc is not None:
        messages.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    return max(messages, key=len)


# torch's headers refusing the standard (ATen.h, torch/all.h: "#error C++20 or later compatible compiler is required")
STANDARD_REFUSED = re.compile(r"#error .*C\+\+\d+ or later")


def build(label, extension, root, std=None):
    """('loaded' | 'built' (the module links; importing it failed) | 'failed',
    the compiler output or error); prints what happened."""
    import model_new

    sources, functions, prefix = extension()
    start = time.monotonic()
    try:
        with forced_std(std):
            model_new._load_extension(sources, functions, prefix, arch_flags=ARCH_FLAGS)
        outcome, detail = "loaded", ""
    except Exception as exc:  # noqa: BLE001 - sorted out below: no module file means compile or link failed
        built = glob.glob(os.path.join(root, prefix + "*", prefix + "*.so"))
        outcome = "built" if built else "failed"
        detail = _compiler_output(exc)
        if built:
            detail = f"{type(exc).__name__}: {detail.strip().splitlines()[-1] if detail.strip() else ''}"
    seconds = time.monotonic() - start
    print(f"== {label} extension ({len(sources)} sources, {' '.join(ARCH_FLAGS)}"
          f"{', forced -std=' + std if std else ''}): {outcome} in {seconds:.0f} s", flush=True)
    if outcome == "built":
        print(f"   compile and link succeeded; loading the module failed (expected without a GPU driver): {detail}")
    elif outcome == "failed":
        lines = detail.splitlines()
        errors = [line for line in lines if "error:" in line.lower() or "error " in line.lower()[:20]]
        shown = [line if len(line) <= 300 else line[:300] + " ..." for line in (errors or lines)[:12 if std else 60]]
        print("   " + "\n   ".join(shown))
    return outcome, detail


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--force-std", metavar="STD", help="negative control: force -std=STD, expect failure")
    parser.add_argument("--keep", action="store_true", help="keep the build folder")
    parser.add_argument("--only", choices=sorted(EXTENSIONS), help="build one extension")
    args = parser.parse_args()

    os.environ.setdefault("CUDA_HOME", cuda_home())  # before torch.utils.cpp_extension reads it
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    root = tempfile.mkdtemp(prefix="build_check_")
    os.environ["TORCH_EXTENSIONS_DIR"] = root
    import torch

    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), CUDA_HOME={os.environ['CUDA_HOME']}, "
          f"TORCH_EXTENSIONS_DIR={root}, GPU: {torch.cuda.is_available()}", flush=True)
    try:
        outcomes = {label: build(label, EXTENSIONS[label], root, args.force_std)
                    for label in EXTENSIONS if args.only in (None, label)}
    except Exception:  # noqa: BLE001 - a failure outside the build (import, sources) fails either way
        traceback.print_exc()
        sys.exit(1)
    finally:
        if args.keep:
            print(f"build folder kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    if args.force_std:
        unexpected = [label for label, (outcome, _) in outcomes.items() if outcome != "failed"]
        if unexpected:
            print(f"NEGATIVE CONTROL FAILED: the build succeeded with -std={args.force_std} ({', '.join(unexpected)})")
            sys.exit(1)
        other = [label for label, (_, detail) in outcomes.items() if not STANDARD_REFUSED.search(detail)]
        if other:
            print(f"NEGATIVE CONTROL FAILED: the build of {', '.join(other)} failed, but not on torch's "
                  f"C++ standard check (no '{STANDARD_REFUSED.pattern}' in the compiler output)")
            sys.exit(1)
        print(f"negative control ok: every build failed with -std={args.force_std} as expected, on torch's "
              f"headers' C++ standard check")
        sys.exit(0)
    sys.exit(0 if all(outcome != "failed" for outcome, _ in outcomes.values()) else 1)


if __name__ == "__main__":
    main()
