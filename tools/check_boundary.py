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

A CPU-only torch wheel ships c10/cuda's headers but not the one header CMake
generates for CUDA builds (c10/cuda/impl/cuda_cmake_macros.h, one export macro):
a stand-in with that macro is written to a temporary include folder when the
wheel lacks it.  tests/test_boundary.py holds the negative control (a changed
prototype must fail this compile).
"""
import ast
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


def cuda_includes():
    """The include folders nvcc itself uses (its --dryrun INCLUDES / SYSTEM_INCLUDES),
    so a wrapper script on PATH or a non-standard install is handled; else $CUDA_HOME/include."""
    if os.environ.get("CUDA_HOME"):
        return [os.path.join(os.environ["CUDA_HOME"], "include")]
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError("no nvcc on PATH and no $CUDA_HOME: the bindings need the CUDA headers")
    r = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull], capture_output=True,
                       text=True)
    found = []
    for line in (r.stdout + r.stderr).splitlines():
        if "INCLUDES=" in line:
            found += re.findall(r'(?:-I|-isystem"? ")"?([^" ]+)', line)
    if not found:
        raise RuntimeError(f"could not read nvcc's include folders from `{nvcc} --dryrun`:\n{r.stdout}{r.stderr}")
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
        cmd = [os.environ.get("CXX", "g++"), "-fsyntax-only", "-std=c++17", "-DTORCH_EXTENSION_NAME=boundary_check"]
        cmd += [arg for p in torch_includes for arg in ("-isystem", p)]
        cmd += ["-isystem", sysconfig.get_paths()["include"]] + [a for p in cuda_includes() for a in ("-isystem", p)]
        cmd += ["-I", kernel_dir, "-I", os.path.dirname(source_path), tu]
        r = subprocess.run(cmd, capture_output=True, text=True)
        return r.returncode == 0, r.stdout + r.stderr


def main():
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
