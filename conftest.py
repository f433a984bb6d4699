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
