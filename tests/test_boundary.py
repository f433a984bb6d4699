"""The host/device boundary: kernels/launchers.cuh declares every launcher once;
the .cu files define them with qualified names (a definition that matches no
declaration does not compile) and both bindings call them through it.  CPU
only (nvcc and g++, no GPU); .ci/run compiles every .cu and runs
tools/check_boundary.py on both bindings.  Here, on a copy of kernels/:
  - positive control: the unmodified copy compiles (bn_apply.cu with nvcc, the
    float32 binding with tools/check_boundary.py), so the failures below are
    the prototype's doing;
  - negative controls: one extra parameter in launchers.cuh's bn_apply
    prototype fails both the .cu that defines it and the binding that calls it;
    a binding that declares its own, different prototype (the old hand copy)
    fails too.
"""
import os
import re
import shutil
import subprocess

import pytest

from tools import check_boundary

REPO = check_boundary.REPO
KERNEL_DIR = check_boundary.KERNEL_DIR

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


def test_every_launcher_is_declared_once_and_defined_qualified():
    """Each `cudaError_t fused_gemm_bn::name(` definition in kernels/ has one
    declaration in launchers.cuh, and no binding or .cu re-declares a launcher."""
    header = open(os.path.join(KERNEL_DIR, "launchers.cuh"), encoding="utf-8").read()
    declared = re.findall(r"^(?:cudaError_t|int|int64_t|bool|void) (\w+)\(", header, flags=re.M)
    assert len(declared) == len(set(declared))
    defined = []
    for root, _, files in os.walk(KERNEL_DIR):
        for name in files:
            text = open(os.path.join(root, name), encoding="utf-8").read()
            defined += re.findall(r"^(?:cudaError_t|int|int64_t|bool|void) fused_gemm_bn::(\w+)\(", text, flags=re.M)
            if name != "launchers.cuh":
                for launcher in declared:  # a bare prototype `type name(...);` outside the header is a hand copy
                    assert not re.search(rf"^(?:cudaError_t|int|int64_t|bool|void) {launcher}\([^{{]*\);", text,
                                         flags=re.M), f"{name} re-declares {launcher}"
            if name.endswith((".cu", ".cpp")) and "fused_gemm_bn::" in text and name != "launchers.cuh":
                assert '#include "launchers.cuh"' in text, name
    assert sorted(defined) == sorted(declared)


def _copy_kernels(tmp_path):
    dst = tmp_path / "kernels"
    shutil.copytree(KERNEL_DIR, dst)
    return dst


def _nvcc(cu, include_dir):
    std = check_boundary.torch_std()["nvcc"]  # the installed torch's standard, as load_inline compiles the .cu
    cmd = ["nvcc", "-c", f"-std={std}", "-I", str(include_dir), "-gencode=arch=compute_90a,code=sm_90a", "-o",
           os.devnull, str(cu)]
    return subprocess.run(cmd, capture_output=True, text=True)


def _add_parameter_to_bn_apply(kernels):
    header = kernels / "launchers.cuh"
    text = header.read_text()
    old = "cudaError_t bn_apply(const float* z, float* out,"
    assert text.count(old) == 1
    header.write_text(text.replace(old, "cudaError_t bn_apply(const float* z, float* out, int extra,"))


@needs_nvcc
def test_prototype_mismatch_fails_the_defining_cu(tmp_path):
    kernels = _copy_kernels(tmp_path)
    ok = _nvcc(kernels / "bn_apply.cu", kernels)
    assert ok.returncode == 0, ok.stderr
    _add_parameter_to_bn_apply(kernels)
    bad = _nvcc(kernels / "bn_apply.cu", kernels)
    assert bad.returncode != 0
    assert "bn_apply" in bad.stderr, bad.stderr


@needs_nvcc
def test_prototype_mismatch_fails_the_binding(tmp_path):
    kernels = _copy_kernels(tmp_path)
    functions = check_boundary.exported_functions("_EXTENSION_FUNCTIONS")
    ok, log = check_boundary.compile_binding(str(kernels / "torch_binding.cpp"), functions, str(kernels))
    assert ok, log
    _add_parameter_to_bn_apply(kernels)
    ok, log = check_boundary.compile_binding(str(kernels / "torch_binding.cpp"), functions, str(kernels))
    assert not ok
    assert "bn_apply" in log


@needs_nvcc
def test_binding_exports_what_model_new_loads(tmp_path):
    """A name in _EXTENSION_FUNCTIONS that the binding does not define fails the compile."""
    functions = check_boundary.exported_functions("_EXTENSION_FUNCTIONS") + ["forward_softmax_train"]
    ok, log = check_boundary.compile_binding(os.path.join(KERNEL_DIR, "torch_binding.cpp"), functions)
    assert not ok and "forward_softmax_train" in log
