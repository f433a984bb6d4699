"""Fixtures shared by every test file (pytest.ini's testpaths)."""
import pytest
import torch


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
