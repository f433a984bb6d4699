"""Compiles the two torch bindings (kernels/torch_binding.cpp and
kernels/lowp/binding_16bit.cpp) the way load_inline does, on a machine without
a GPU: torch/extension.h first, then the binding, then the pybind11 module that
load_inline generates for the exported functions (model_new.py's
_EXTENSION_FUNCTIONS, model_new_lowp.py's FUNCTIONS), syntax and types only (g++
-fsyntax-only), against the installed torch's headers and the CUDA headers of
the nvcc on PATH (or $CUDA_HOME).  With kernels/launchers.cuh included by the
bindings and by every .cu that defines a launcher (compiled by .ci/run), a
signature that drifts on either side fails here, not at load_inline on a GPU.

    python tools/check_boundary.py            # both bindings; exit status 1 on a failure
    python tools/check_boundary.py --std nvcc # prints the -std value load_inline gives nvcc (c++17, c++20)

The C++ standard is the installed torch's choice (seen: C++17 on torch 2.0.1,
C++20 on 2.13.0 and 2.14.1, whose headers refuse C++17): torch_std() reads it
from the build.ninja that torch.utils.cpp_extension writes for a probe
extension, so it is never written here.

A CPU-only torch wheel ships c10/cuda's headers but not the one header CMake
generates for CUDA builds (c10/cuda/impl/cuda_cmake_macros.h, one export macro):
a stand-in with that macro is written to a temporary include folder when the
wheel lacks it.  tests/test_boundary.py holds the negative control (a changed
prototype must fail this compile).
"""
import ast
import inspect
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL_DIR = os.path.join(REPO, "kernels")
# binding source (relative to the kernel folder) -> (the module, its list of the exported functions)
BINDINGS = {"torch_binding.cpp": ("model_new.py", "_EXTENSION_FUNCTIONS"),
            os.path.join("lowp", "binding_16bit.cpp"): ("model_new_lowp.py", "FUNCTIONS")}
CMAKE_MACROS = os.path.join("c10", "cuda", "impl", "cuda_cmake_macros.h")


def exported_functions(list_name, module="model_new.py"):
    """The literal list `list_name = [...]` of the repository's `module`."""
    with open(os.path.join(REPO, module), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == list_name for t in node.targets):
            return ast.literal_eval(node.value)
    raise ValueError(f"{module} has no {list_name}")


def torch_std():
    """{"cxx": ..., "nvcc": ...}: the -std= values (e.g. "c++20") that the installed
    torch's load_inline passes to the host compiler and to nvcc, read from the
    build.ninja its writer (torch.utils.cpp_extension._write_ninja_file_to_build_library,
    private: its arguments differ between releases, so they are passed by name,
    those it lacks left out) produces for a probe of one .cpp and one .cu; nothing
    is compiled.  So that torch asks no GPU for its architecture flags, the probe
    passes -gencode (read by recent torch) and sets TORCH_CUDA_ARCH_LIST (read
    by torch 2.0, which ignores the flags) when unset; a CPU-only torch has no
    CUDA_HOME, so the writer is given cuda_home().  Both restored after."""
    from torch.utils import cpp_extension

    writer = cpp_extension._write_ninja_file_to_build_library
    saved_cuda_home = cpp_extension.CUDA_HOME
    with tempfile.TemporaryDirectory() as tmp:
        sources = [os.path.join(tmp, "probe.cpp"), os.path.join(tmp, "probe_cuda.cu")]
        for s in sources:
            open(s, "w").close()
        args = dict(path=os.path.join(tmp, "build.ninja"), name="std_probe", sources=sources, extra_cflags=[],
                    extra_cuda_cflags=["-gencode=arch=compute_80,code=sm_80"], extra_sycl_cflags=[],
                    extra_ldflags=[], extra_include_paths=[], with_cuda=True, with_sycl=False,
                    is_python_module=True, is_standalone=False)
        params = inspect.signature(writer).parameters
        missing = [p for p in params if p not in args and params[p].default is inspect.Parameter.empty]
        if missing:
            raise RuntimeError(f"torch {torch_version()}: {writer.__name__} takes arguments unknown here: {missing}")
        saved_arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
        try:
            cpp_extension.CUDA_HOME = saved_cuda_home or cuda_home()
            os.environ["TORCH_CUDA_ARCH_LIST"] = saved_arch_list or "8.0"
            writer(**{k: v for k, v in args.items() if k in params})
        finally:
            cpp_extension.CUDA_HOME = saved_cuda_home
            if saved_arch_list is None:
                del os.environ["TORCH_CUDA_ARCH_LIST"]
        with open(args["path"], encoding="utf-8") as f:
            ninja = f.read()
    found = {}
    for key, var in (("cxx", "cflags"), ("nvcc", "cuda_cflags")):
        line = re.search(rf"^{var} = (.*)$", ninja, flags=re.M)
        stds = re.findall(r"(?:^|\s)-std=(\S+)", line.group(1)) if line else []
        if not stds:
            raise RuntimeError(f"torch {torch_version()}: no -std= in the {var} of its build.ninja:\n{ninja}")
        found[key] = stds[-1]  # the compiler takes the last one
    return found


def torch_version():
    import torch

    return torch.__version__


def _nvcc_dryrun():
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError("no nvcc on PATH and no $CUDA_HOME: the bindings need the CUDA headers")
    r = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull], capture_output=True,
                       text=True)
    return nvcc, r.stdout + r.stderr


def cuda_home():
    """$CUDA_HOME, else the toolkit root of the nvcc on PATH (its --dryrun TOP, so
    a wrapper script such as /usr/local/bin/nvcc resolves to the real toolkit)."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    nvcc, out = _nvcc_dryrun()
    top = re.search(r"^#\$ TOP=(.*)$", out, flags=re.M)
    if top is None:
        raise RuntimeError(f"could not read the toolkit root from `{nvcc} --dryrun`:\n{out}")
    return os.path.normpath(top.group(1).strip())


def cuda_includes():
    """The include folders nvcc itself uses (its --dryrun INCLUDES / SYSTEM_INCLUDES),
    so a wrapper script on PATH or a non-standard install is handled; else $CUDA_HOME/include."""
    if os.environ.get("CUDA_HOME"):
        return [os.path.join(os.environ["CUDA_HOME"], "include")]
    nvcc, out = _nvcc_dryrun()
    found = []
    for line in out.splitlines():
        if "INCLUDES=" in line:
            found += re.findall(r'(?:-I|-isystem"? ")"?([^" ]+)', line)
    if not found:
        raise RuntimeError(f"could not read nvcc's include folders from `{nvcc} --dryrun`:\n{out}")
    return found


def translation_unit(source_text, functions):
    """What load_inline compiles for a cpp source: extension.h, the source, the module."""
    defs = "".join(f'm.def("{f}", torch::wrap_pybind_function({f}), "{f}");\n' for f in functions)
    return f"#include <torch/extension.h>\n{source_text}\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{\n{defs}}}\n"


def compile_binding(source_path, functions, kernel_dir=KERNEL_DIR):
    """(ok, compiler output) of g++ -fsyntax-only on the binding's translation unit."""
    from torch.utils.cpp_extension import include_paths

    with open(source_path, encoding="utf-8") as f:
        text = f.read()
    with tempfile.TemporaryDirectory() as tmp:
        torch_includes = include_paths()
        if not any(os.path.isfile(os.path.join(p, CMAKE_MACROS)) for p in torch_includes):
            stand_in = os.path.join(tmp, "stand_in", CMAKE_MACROS)
            os.makedirs(os.path.dirname(stand_in))
            with open(stand_in, "w") as f:
                f.write("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
            torch_includes = torch_includes + [os.path.join(tmp, "stand_in")]
        tu = os.path.join(tmp, "main.cpp")
        with open(tu, "w", encoding="utf-8") as f:
            f.write(translation_unit(text, functions))
        cmd = [os.environ.get("CXX", "g++"), "-fsyntax-only", f"-std={torch_std()['cxx']}",
               "-DTORCH_EXTENSION_NAME=boundary_check"]
        cmd += [arg for p in torch_includes for arg in ("-isystem", p)]
        cmd += ["-isystem", sysconfig.get_paths()["include"]] + [a for p in cuda_includes() for a in ("-isystem", p)]
        cmd += ["-I", kernel_dir, "-I", os.path.dirname(source_path), tu]
        r = subprocess.run(cmd, capture_output=True, text=True)
        return r.returncode == 0, r.stdout + r.stderr


def main():
    if sys.argv[1:2] == ["--std"]:
        print(torch_std()[sys.argv[2] if len(sys.argv) > 2 else "cxx"])
        return
    failed = False
    for rel, (module, list_name) in BINDINGS.items():
        ok, log = compile_binding(os.path.join(KERNEL_DIR, rel), exported_functions(list_name, module))
        print(f"{'ok  ' if ok else 'FAIL'} kernels/{rel} ({list_name})", flush=True)
        if not ok:
            print(log)
            failed = True
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
