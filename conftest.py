"""Fixtures shared by every test file (pytest.ini's testpaths), and the markers
that skip a test the installed torch cannot run (CI runs the suite on torch 2.0.1
and on the newest release, .ci/run):

    @pytest.mark.requires_torch_compile
        skipped where torch.compile cannot run: no torch.compile, or dynamo
        refuses this Python (torch 2.0 supports Python <= 3.10).
    @pytest.mark.min_torch("2.2", reason="what older torch does differently")
        skipped on torch older than the given release.
"""
import re

import pytest
import torch


def torch_compile_problem():
    """Why torch.compile cannot run here, or None.  Imports torch._dynamo (about
    a second), so it is asked only when a collected test carries the marker."""
    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile"
    from torch._dynamo import eval_frame

    check = getattr(eval_frame, "check_if_dynamo_supported", None)
    try:
        if check is not None:
            check()
    except RuntimeError as exc:  # e.g. torch 2.0: "Python 3.11+ not yet supported for torch.compile"
        return f"torch {torch.__version__}: {exc}"
    return None


def release(version):
    """(major, minor, patch) of a version string: "2.14.1+cu130" -> (2, 14, 1)."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def pytest_collection_modifyitems(config, items):
    compile_problem = ...  # not asked yet
    for item in items:
        if item.get_closest_marker("requires_torch_compile") is not None:
            if compile_problem is ...:
                compile_problem = torch_compile_problem()
            if compile_problem is not None:
                item.add_marker(pytest.mark.skip(reason=compile_problem))
        for mark in item.iter_markers("min_torch"):
            if release(torch.__version__) < release(mark.args[0]):
                item.add_marker(pytest.mark.skip(
                    reason=f"needs torch >= {mark.args[0]} (this is {torch.__version__}): {mark.kwargs['reason']}"))


@pytest.fixture
def fp32_matmul():
    """Eager float32 references use true float32 GEMMs (no TF32); restored after."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture
def full_precision_reductions():
    """Eager 16-bit GEMMs without cuBLAS's reduced-precision split-K reductions
    (eager then rounds only where its ops say); restored after."""
    m = torch.backends.cuda.matmul
    saved = m.allow_fp16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction
    m.allow_fp16_reduced_precision_reduction = False
    m.allow_bf16_reduced_precision_reduction = False
    yield
    m.allow_fp16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction = saved
