"""The dispatch decision (model_new.plan / dispatch / dispatch_gemm_nt): exact
path names for every row of its table, on simulated GPUs (CPU; runs in CI),
and on the real GPU the kernels a call launches match the path that
ModelNew.kernel_path named beforehand (profiler kernel names).

Simulated GPUs (DeviceFacts): an H200 with and without the sm_90a kernel, an
A100 (8.0), an Ada card (8.9) and a Turing card (7.5, refused).
"""
import os
import re
import types

import pytest
import torch

import model_new
from level2_84_gemm_batchnorm_scaling_softmax import model_new as model_new_84
from model_new import Call, DeviceFacts, Switches, plan
from tests.problems import GEMM_PATHS, gemm_switches, launched_kernels

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEFAULT = Switches(portable=False, weight_cache=True)
PORTABLE = DEFAULT._replace(portable=True)
SMALL_M = DEFAULT._replace(small_m=True)  # FUSED_GEMM_BN_SMALL_M=1

H200 = DeviceFacts(capability=(9, 0), num_sms=132, sm90_gemm=True)
H200_NO_SM90A = H200._replace(sm90_gemm=False)  # a build without the sm_90a image
A100 = DeviceFacts(capability=(8, 0), num_sms=108, sm90_gemm=False)
ADA = DeviceFacts(capability=(8, 9), num_sms=128, sm90_gemm=False)
TURING = DeviceFacts(capability=(7, 5), num_sms=40, sm90_gemm=False)

F32 = torch.float32


def call(m=1024, k=8192, n=8192, *, dtype=F32, device="cuda", training=True, grad=False, problem=33):
    return Call(device, dtype, m, n, k, training, grad, problem == 84)


# (case id, Call, facts, switches, expected Plan.name)
CASES = [
    # Hopper default: the fp16x3 wgmma kernel, every mode, both problems, any K (the prepass pads K to 8)
    ("hopper-33-train", call(), H200, DEFAULT, "sm90_fp16x3_train"),
    ("hopper-33-eval", call(training=False), H200, DEFAULT, "sm90_fp16x3_eval"),
    ("hopper-33-train-grad", call(grad=True), H200, DEFAULT, "sm90_fp16x3_train_grad"),
    ("hopper-33-eval-grad", call(training=False, grad=True), H200, DEFAULT, "sm90_fp16x3_eval_grad"),
    ("hopper-84-train", call(problem=84), H200, DEFAULT, "sm90_fp16x3_train"),
    ("hopper-84-eval", call(problem=84, training=False), H200, DEFAULT, "sm90_fp16x3_eval"),
    ("hopper-small", call(m=17, k=8, n=8), H200, DEFAULT, "sm90_fp16x3_train"),
    # small batches on Hopper: small_m_fp64 (W read once, float64 products) at every shape up to
    # SMALL_M_MAX_ROWS rows
    ("small-m-auto-train", call(m=2, k=8, n=8), H200, DEFAULT, "small_m_fp64_train"),
    ("small-m-auto-8", call(m=8, k=4096, n=4096), H200, DEFAULT, "small_m_fp64_train"),
    ("small-m-auto-12-narrow", call(m=12, k=4095, n=513), H200, DEFAULT, "small_m_fp64_train"),
    ("small-m-auto-13-narrow", call(m=13, k=4096, n=4096), H200, DEFAULT, "small_m_fp64_train"),
    ("small-m-auto-16-narrow", call(m=16, k=4095, n=513, training=False), H200, DEFAULT, "small_m_fp64_eval"),
    ("small-m-auto-16-wide", call(m=16, k=8192, n=8192), H200, DEFAULT, "small_m_fp64_train"),
    ("small-m-auto-17", call(m=17, k=8192, n=8192), H200, DEFAULT, "sm90_fp16x3_train"),
    ("small-m-auto-eval-1", call(m=1, k=8192, n=8192, training=False), H200, DEFAULT, "small_m_fp64_eval"),
    ("small-m-auto-84-grad", call(m=7, k=4095, n=513, problem=84, grad=True), H200, DEFAULT,
     "small_m_fp64_train_grad"),
    # "auto" replaces sm90_fp16x3 only: not the portable kernel (A100, the portable switch), where
    # it was not measured
    ("small-m-auto-a100", call(m=4, k=4096, n=4096), A100, DEFAULT, "sm80_3xtf32_train"),
    ("small-m-auto-portable", call(m=4, k=4096, n=4096), H200, PORTABLE, "sm80_3xtf32_train"),
    # FUSED_GEMM_BN_SMALL_M=1: every batch of at most SMALL_M_MAX_ROWS rows on a full-rate FP64 GPU
    ("small-m-on-16-narrow", call(m=16, k=4096, n=4096), H200, SMALL_M, "small_m_fp64_train"),
    ("small-m-on-a100", call(m=4, k=4096, n=4096), A100, SMALL_M, "small_m_fp64_train"),
    ("small-m-on-portable", call(m=4, k=4096, n=4096), H200, PORTABLE._replace(small_m=True), "small_m_fp64_train"),
    ("small-m-on-17", call(m=17, k=8192, n=8192), H200, SMALL_M, "sm90_fp16x3_train"),
    # FUSED_GEMM_BN_SMALL_M=0: never
    ("small-m-off", call(m=4, k=4096, n=4096), H200, DEFAULT._replace(small_m=False), "sm90_fp16x3_train"),
    # eval with gradients: z by small_m_fp64's gemm_nt, by the same rule; GPUs without full-rate FP64 keep
    # the tensor-core kernels
    ("small-m-eval-grad", call(m=4, k=64, n=64, training=False, grad=True), H200, DEFAULT,
     "small_m_fp64_eval_grad"),
    ("small-m-eval-grad-13", call(m=13, k=4096, n=4096, training=False, grad=True), H200, DEFAULT,
     "small_m_fp64_eval_grad"),
    ("small-m-eval-grad-17", call(m=17, k=4096, n=4096, training=False, grad=True), H200, DEFAULT,
     "sm90_fp16x3_eval_grad"),
    ("small-m-on-eval-grad", call(m=4, k=4096, n=4096, training=False, grad=True), H200, SMALL_M,
     "small_m_fp64_eval_grad"),
    ("small-m-on-eval-grad-84", call(m=16, k=4095, n=513, problem=84, training=False, grad=True), A100, SMALL_M,
     "small_m_fp64_eval_grad"),
    ("small-m-ada", call(m=4, k=4096, n=4096), ADA, SMALL_M, "sm80_3xtf32_train"),
    ("hopper-k4", call(m=64, k=36, n=64), H200, DEFAULT, "sm90_fp16x3_train"),
    ("hopper-k4-84-eval", call(m=64, k=8188, n=64, problem=84, training=False), H200, DEFAULT, "sm90_fp16x3_eval"),
    ("hopper-odd-k", call(m=33, k=37, n=515), H200, DEFAULT, "sm90_fp16x3_train"),
    ("hopper-odd-k-84-grad", call(m=77, k=4095, n=513, problem=84, grad=True), H200, DEFAULT,
     "sm90_fp16x3_train_grad"),
    ("hopper-k1", call(m=25, k=1, n=3, training=False), H200, DEFAULT, "sm90_fp16x3_eval"),
    # the portable switch and a build without the sm_90a image: what an sm_80 GPU runs
    ("portable-train", call(), H200, PORTABLE, "sm80_3xtf32_train"),
    ("portable-eval", call(training=False), H200, PORTABLE, "sm80_3xtf32_eval"),
    ("portable-small-odd-k", call(m=33, k=37, n=515), H200, PORTABLE, "sm80_3xtf32_train"),
    ("hopper-no-sm90a", call(), H200_NO_SM90A, DEFAULT, "sm80_3xtf32_train"),
    # other GPUs: the portable kernel
    ("a100-train", call(), A100, DEFAULT, "sm80_3xtf32_train"),
    ("a100-eval-grad", call(training=False, grad=True), A100, DEFAULT, "sm80_3xtf32_eval_grad"),
    ("a100-small-odd-k", call(m=33, k=37, n=515), A100, DEFAULT, "sm80_3xtf32_train"),
    ("ada-84-train", call(problem=84), ADA, DEFAULT, "sm80_3xtf32_train"),
    # 16-bit (model_new_lowp.route): eval with gradients on Hopper by hopper_gemm's rule, as eval
    # (lowp_sm90's kEvalSaved and cuBLAS's product both keep the Linear output z), lowp_cublas
    # elsewhere (lowp_sm80's eval keeps no z)
    ("hopper-float16", call(dtype=torch.float16), H200, DEFAULT, "lowp_sm90_train"),
    ("hopper-bfloat16-eval-grad", call(dtype=torch.bfloat16, training=False, grad=True), H200, DEFAULT,
     "lowp_sm90_eval_grad"),
    ("hopper-float16-eval-grad-small-grid", call(m=130, k=1024, n=264, dtype=torch.float16, training=False,
                                                 grad=True), H200, DEFAULT, "lowp_cublas_eval_grad"),
    ("hopper-float16-84-eval-grad-portable", call(dtype=torch.float16, problem=84, training=False, grad=True),
     H200, PORTABLE, "lowp_cublas_eval_grad"),
    ("hopper-float16-eval-grad-forced-cublas", call(dtype=torch.float16, training=False, grad=True), H200,
     DEFAULT._replace(lowp_gemm="cublas"), "lowp_cublas_eval_grad"),
    ("a100-bfloat16-eval-grad", call(dtype=torch.bfloat16, training=False, grad=True), A100, DEFAULT,
     "lowp_cublas_eval_grad"),
    ("a100-float16-train-grad", call(dtype=torch.float16, training=True, grad=True), A100, DEFAULT,
     "lowp_sm80_train_grad"),
    ("hopper-float16-84-eval", call(dtype=torch.float16, problem=84, training=False), H200, DEFAULT,
     "lowp_sm90_eval"),
    # any K on Hopper (the binding pads K % 8 != 0 for TMA); the portable switch and a build
    # without the sm_90a image take the mma.sync kernel
    ("hopper-float16-k4", call(m=2048, k=36, n=64, dtype=torch.float16), H200, DEFAULT, "lowp_sm90_train"),
    ("hopper-bfloat16-portable", call(dtype=torch.bfloat16), H200, PORTABLE, "lowp_sm80_train"),
    ("hopper-float16-no-sm90a", call(dtype=torch.float16), H200_NO_SM90A, DEFAULT, "lowp_sm80_train"),
    ("a100-float16-84", call(dtype=torch.float16, problem=84), A100, DEFAULT, "lowp_sm80_train"),
    # Hopper's 16-bit routes (model_new_lowp.hopper_gemm): cuBLAS's product and the chain kernels where
    # lowp_sm90's grid fills the GPU poorly (256-row tiles under 90% of the SMs: 80 tiles), in eval on the
    # small-grid plan (128-row tiles at most half the SMs), and in training on batches of at most 1024 rows
    # with M N K <= 2^33 (bn_16bit_strip.cu); SWITCHES.lowp_gemm forces either route
    ("hopper-float16-partial-wave", call(m=333, k=8192, n=5000, dtype=torch.float16), H200, DEFAULT,
     "lowp_cublas_train"),
    ("hopper-bfloat16-full-wave", call(m=512, k=8192, n=8192, dtype=torch.bfloat16, training=False), H200,
     DEFAULT, "lowp_sm90_eval"),  # 128 tiles of 256 rows: 97% of 132 SMs
    ("hopper-bfloat16-tall", call(m=16384, k=4096, n=4096, dtype=torch.bfloat16, training=False), H200, DEFAULT,
     "lowp_sm90_eval"),  # 64 batch tiles of 256 rows: the persistent grid, grouped tile order
    ("hopper-bfloat16-tall-train", call(m=16384, k=4096, n=4096, dtype=torch.bfloat16), H200, DEFAULT,
     "lowp_sm90_train"),  # 64 batch tiles of 256 rows: grouped tile order
    ("hopper-float16-tall-minus-one", call(m=8191, k=4096, n=4096, dtype=torch.float16), H200, DEFAULT,
     "lowp_sm90_train"),
    ("hopper-float16-small-eval", call(m=1024, k=1024, n=1024, dtype=torch.float16, training=False), H200,
     DEFAULT, "lowp_cublas_eval"),  # 64 tiles of 128 rows
    ("hopper-float16-small-train", call(m=1024, k=1024, n=1024, dtype=torch.float16), H200, DEFAULT,
     "lowp_cublas_train"),
    ("hopper-bfloat16-small-train-128-rows", call(m=128, k=8192, n=8192, dtype=torch.bfloat16, problem=84), H200,
     DEFAULT, "lowp_cublas_train"),  # M N K = 2^33
    ("hopper-bfloat16-train-256-rows", call(m=256, k=8192, n=8192, dtype=torch.bfloat16), H200, DEFAULT,
     "lowp_sm90_train"),  # M N K = 2^34
    ("hopper-float16-train-1025-rows", call(m=1025, k=1024, n=1024, dtype=torch.float16), H200, DEFAULT,
     "lowp_sm90_train"),  # more rows than the strip kernel takes
    ("hopper-float16-eval-128-tiles", call(m=2048, k=1024, n=1024, dtype=torch.float16, training=False),
     H200, DEFAULT, "lowp_sm90_eval"),  # 128 tiles of 128 rows (more than half the SMs), 64 of 256
    ("hopper-float16-forced-sm90", call(m=333, k=8192, n=5000, dtype=torch.float16), H200,
     DEFAULT._replace(lowp_gemm="sm90"), "lowp_sm90_train"),
    ("hopper-bfloat16-forced-cublas", call(dtype=torch.bfloat16, problem=84), H200,
     DEFAULT._replace(lowp_gemm="cublas"), "lowp_cublas_train"),
    # batches of at most SMALL_M_ROWS rows with K % 8 == 0: lowp_small_m's product (W read once), every
    # mode; K % 8 != 0 and 33 rows keep the rule above; off Hopper lowp_sm80 as before
    ("hopper-float16-small-m", call(m=8, k=8192, n=8192, dtype=torch.float16), H200, DEFAULT,
     "lowp_small_m_train"),
    ("hopper-bfloat16-small-m-84-eval-grad", call(m=1, k=1024, n=10, dtype=torch.bfloat16, problem=84,
                                                   training=False, grad=True), H200, DEFAULT,
     "lowp_small_m_eval_grad"),
    ("hopper-float16-small-m-odd-k", call(m=4, k=36 + 1, n=64, dtype=torch.float16), H200, DEFAULT,
     "lowp_cublas_train"),
    ("hopper-float16-16-rows", call(m=16, k=8192, n=8192, dtype=torch.float16, problem=84, training=False), H200,
     DEFAULT, "lowp_small_m_eval"),
    ("hopper-float16-17-rows", call(m=17, k=8192, n=8192, dtype=torch.float16), H200, DEFAULT,
     "lowp_small_m_train"),
    ("hopper-bfloat16-32-rows", call(m=32, k=4096, n=4096, dtype=torch.bfloat16, problem=84), H200, DEFAULT,
     "lowp_small_m_train"),
    ("hopper-float16-33-rows", call(m=33, k=8192, n=8192, dtype=torch.float16), H200, DEFAULT,
     "lowp_cublas_train"),
    ("hopper-float16-small-m-forced-sm90", call(m=8, k=8192, n=8192, dtype=torch.float16), H200,
     DEFAULT._replace(lowp_gemm="sm90"), "lowp_sm90_train"),
    ("hopper-float16-forced-small-m-large", call(dtype=torch.float16), H200, DEFAULT._replace(lowp_gemm="small_m"),
     "lowp_cublas_train"),
    ("hopper-float16-small-m-portable", call(m=8, k=8192, n=8192, dtype=torch.float16), H200, PORTABLE,
     "lowp_sm80_train"),
    ("a100-float16-small-m", call(m=8, k=8192, n=8192, dtype=torch.float16), A100, DEFAULT, "lowp_sm80_train"),
    ("cuda-float64", call(dtype=torch.float64), H200, DEFAULT, "torch_ops_train"),
    ("cuda-float64-eval-grad", call(dtype=torch.float64, training=False, grad=True), H200, DEFAULT,
     "torch_ops_eval_grad"),
    ("cpu-float32", call(device="cpu"), None, DEFAULT, "torch_ops_train"),
    ("cpu-float16-eval", call(device="cpu", dtype=torch.float16, training=False), None, DEFAULT,
     "torch_ops_eval"),
    # an empty batch runs no kernel
    ("empty-train", call(m=0), H200, DEFAULT, "empty_train"),
    ("empty-eval-grad", call(m=0, training=False, grad=True), A100, DEFAULT, "empty_eval_grad"),
]


@pytest.mark.parametrize("case_call,facts,switches,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_plan_table(case_call, facts, switches, expected):
    result = plan(case_call, facts, switches)
    assert result.name == expected
    assert result.name.startswith(result.gemm)
    assert result.kernels == {"torch_ops": "torch", "lowp_sm80": "lowp", "lowp_sm90": "lowp", "lowp_cublas": "lowp",
                              "lowp_small_m": "lowp", "empty": None}.get(result.gemm, "ext")


@pytest.mark.parametrize("dtype", [F32, torch.float16, torch.bfloat16])
def test_plan_refuses_old_gpus(dtype):
    with pytest.raises(RuntimeError, match="compute capability >= 8.0"):
        plan(call(dtype=dtype), TURING, DEFAULT)


def test_switches_read_once_at_import():
    assert isinstance(model_new.SWITCHES, Switches)
    assert plan(call(), H200).name == plan(call(), H200, model_new.SWITCHES).name


def test_no_getenv_on_a_forward_path():
    """Environment switches are read at import only: no getenv in the kernels, and
    dispatch / fused_forward read model_new.SWITCHES."""
    kernels = os.path.join(os.path.dirname(model_new.__file__), "kernels")
    for root, _, files in os.walk(kernels):
        for name in files:
            with open(os.path.join(root, name)) as f:
                assert not re.search(r"\bgetenv\b", f.read()), name


def test_dispatch_reads_tensors_cpu():
    """dispatch() on real CPU tensors, and both modules' kernel_path."""
    x, w = torch.rand(5, 8), torch.rand(6, 8)
    assert model_new.dispatch(x, w, True, False, False).name == "torch_ops_train"
    assert model_new.dispatch(x[:0], w, True, False, False).name == "empty_train"
    for module in (model_new.ModelNew(8, 6, (6,)), model_new_84.ModelNew(8, 6)):
        with torch.no_grad():
            assert module.kernel_path(x) == "torch_ops_train"
        assert module.kernel_path(x) == "torch_ops_train_grad"  # parameters require grad
        module.eval()
        assert module.double().kernel_path(x.double()) == "torch_ops_eval_grad"
        with pytest.raises(ValueError, match="more than 1 value per channel"):
            module.train().kernel_path(x[:1].double())


def test_backward_products_dispatch():
    """The backward's products take the float32 table: sm90_fp16x3 on Hopper
    for any shape (the binding reads operands MN-major where N and K are
    multiples of 8 and copies them transposed otherwise), sm80_3xtf32 with the
    portable switch or elsewhere; CPU and float64 tensors take torch_ops."""
    gemm = model_new._float32_gemm
    assert gemm(H200, DEFAULT) == "sm90_fp16x3"
    assert gemm(H200, PORTABLE) == gemm(H200_NO_SM90A, DEFAULT) == gemm(A100, DEFAULT) == "sm80_3xtf32"
    with pytest.raises(RuntimeError, match="compute capability >= 8.0"):
        gemm(TURING, DEFAULT)
    a, b = torch.rand(64, 32), torch.rand(48, 32)
    assert model_new.dispatch_gemm_nt(a, b) == model_new.dispatch_gemm_nt(a.double(), b.double()) == "torch_ops"
    assert model_new.dispatch_gemm_tn(a, b.t()) == "torch_ops"


@pytest.mark.parametrize("m,facts,switches,want", [
    (16, H200, SMALL_M, "small_m_fp64"), (1, A100, SMALL_M, "small_m_fp64"), (17, H200, SMALL_M, "sm90_fp16x3"),
    (4, H200, DEFAULT, "small_m_fp64"), (16, H200, DEFAULT, "small_m_fp64"), (17, H200, DEFAULT, "sm90_fp16x3"),
    (4, A100, DEFAULT, "sm80_3xtf32"), (4, H200, DEFAULT._replace(small_m=False), "sm90_fp16x3"),
    (4, ADA, SMALL_M, "sm80_3xtf32"), (4, H200, PORTABLE, "sm80_3xtf32"),
    (4, H200, PORTABLE._replace(small_m=True), "small_m_fp64")])
def test_grad_weight_dispatch(m, facts, switches, want):
    """grad_W = grad_z^T x (dispatch_gemm_tn): small_m_fp64's outer-product kernel up to
    SMALL_M_MAX_ROWS rows on full-rate FP64 GPUs, by default where the table's GEMM is
    sm90_fp16x3 (not the A100's sm80_3xtf32: not measured there), under
    FUSED_GEMM_BN_SMALL_M=1 on every such GPU; the table's GEMM otherwise.  a is a stand-in CUDA float32
    (M, N) operand: only its type, dtype and shape are read when facts are given."""
    a = types.SimpleNamespace(is_cuda=True, dtype=torch.float32, shape=(m, 256), device=None)
    assert model_new.dispatch_gemm_tn(a, None, facts, switches) == want


def test_every_route_is_a_default():
    """Each float32 and 16-bit route is what plan() chooses by default
    (SWITCHES as read at import, no switch set) on some GPU for some input."""
    default = model_new.Switches(portable=False, weight_cache=True)
    seen = set()
    for facts in (H200, A100):
        for m, k, n in [(1024, 8192, 8192), (333, 8192, 5000), (7, 4095, 513), (7, 4096, 512), (16384, 4096, 4096)]:
            for dtype in (F32, torch.float16):
                for training, grad in [(True, False), (False, False), (True, True), (False, True)]:
                    seen.add(plan(call(m=m, k=k, n=n, dtype=dtype, training=training, grad=grad), facts,
                                  default).gemm)
    assert seen == {"sm90_fp16x3", "sm80_3xtf32", "small_m_fp64", "lowp_sm90", "lowp_cublas", "lowp_small_m",
                    "lowp_sm80"}


# ---------------------------------------------------------------------------
# GPU: the kernels launched are the ones the path names
# ---------------------------------------------------------------------------

# Kernel-name fragments each GEMM kernel launches, and those it must not.
LAUNCHES = {
    "sm90_fp16x3": ["sm90_prepass_fp16x3_kernel", "sm90_gemm_fp16x3_bn_kernel"],
    "sm80_3xtf32": ["sm80_prepass_3xtf32_kernel", "sm80_gemm_3xtf32_bn_kernel"],
    "lowp_sm80": ["sm80_gemm_bn_16bit_kernel"],
    "lowp_sm90": ["sm90_gemm_bn_16bit_kernel"],
    # after the library's product, no project GEMM kernel: the chain kernels, or problem 84
    # eval's row softmax with BatchNorm fused (bn16_softmax_rows_*)
    "lowp_cublas": ["bn16_"],
    # the project's small-batch product: in one K piece with the BatchNorm in its epilogue
    # (lowp_small_m_linear_bn; problem 84's row softmax after it), else with K split
    # (small_m_16bit_finish_kernel after it) and the chain kernels
    "lowp_small_m": ["small_m_16bit_kernel"],
    # the cp.async ring (small_m_fp64_kernel) or, on Hopper with 16-byte rows, the TMA ring
    # (small_m_fp64_tma_kernel); with K split, small_m_fp64_finish_kernel after it
    "small_m_fp64": ["small_m_fp64_"],
}
GEMM_KERNELS = ["sm90_gemm_fp16x3_bn_kernel", "sm80_gemm_3xtf32_bn_kernel", "sm80_gemm_bn_16bit_kernel",
                "sm90_gemm_bn_16bit_kernel", "small_m_fp64_", "small_m_16bit_kernel"]


GPU_CASES = [  # (problem, m, k, n, dtype, misaligned weight)
    ("33", 256, 512, 384, F32, False), ("84", 256, 512, 384, F32, False), ("33", 33, 37, 515, F32, False),
    ("84", 33, 37, 515, F32, False), ("33", 300, 1000, 520, F32, True), ("33", 64, 96, 80, torch.float16, False),
    ("84", 64, 96, 80, torch.bfloat16, False),
    # small batches (small_m_fp64 on Hopper by default; the misaligned W takes its 4-byte copies)
    ("33", 4, 512, 384, F32, False), ("84", 7, 37, 515, F32, True),
    # 16-bit small batches (lowp_small_m on Hopper by default; the misaligned W copied by the binding)
    ("33", 4, 512, 384, torch.float16, False), ("84", 7, 96, 80, torch.bfloat16, True),
    ("33", 12, 512, 384, torch.float16, False),  # 9-16 rows: the 16-row CTA
    ("84", 24, 512, 384, torch.bfloat16, False),  # 17-32 rows: the 32-row CTA (32 features at this N)
]


def gpu_module(problem, k, n, dtype, misaligned):
    torch.manual_seed(0)
    module = (model_new.ModelNew(k, n, (n,)) if problem == "33" else model_new_84.ModelNew(k, n)).cuda().to(dtype)
    if misaligned:  # gemm.weight as a contiguous view one float past a 16-byte boundary
        storage = torch.empty(n * k + 1, device="cuda", dtype=dtype)
        view = storage[1:].view(n, k)
        view.copy_(module.gemm.weight.detach())
        module.gemm.weight = torch.nn.Parameter(view)
        assert module.gemm.weight.data_ptr() % 16 != 0
    return module


@requires_cuda
@pytest.mark.parametrize("path_switch", GEMM_PATHS)
@pytest.mark.parametrize("mode", ["train", "eval", "train_grad", "eval_grad"])
@pytest.mark.parametrize("problem,m,k,n,dtype,misaligned", GPU_CASES,
                         ids=[f"{c[0]}-{c[1]}x{c[2]}x{c[3]}-{str(c[4])[6:]}{'-misaligned' if c[5] else ''}"
                              for c in GPU_CASES])
def test_gpu_kernel_path_names_the_launched_kernels(problem, m, k, n, dtype, misaligned, mode, path_switch,
                                                    monkeypatch):
    monkeypatch.setattr(model_new, "SWITCHES", gemm_switches(path_switch))
    portable = path_switch == "portable"
    module = gpu_module(problem, k, n, dtype, misaligned)
    module.train(mode.startswith("train"))
    x = torch.rand(m, k, device="cuda").to(dtype)
    grad = mode.endswith("grad")
    buffers = [b.clone() for b in module.buffers()]
    with torch.set_grad_enabled(grad):
        path = module.kernel_path(x)
    for a, b in zip(module.buffers(), buffers):
        assert torch.equal(a, b), "kernel_path touched a buffer"
    plan_ = model_new.dispatch(x, module.gemm.weight, module.training, grad, problem == "84")
    assert path == plan_.name and path.endswith(mode)

    def run():
        with torch.set_grad_enabled(grad):
            out = module(x)
            if grad:
                out.sum().backward()

    names = launched_kernels(run)
    gemm_names = sorted({name for name in names if any(g in name for g in GEMM_KERNELS)})
    print(f"\n[{path}] {gemm_names}")
    expected = LAUNCHES[plan_.gemm]
    for fragment in expected:
        assert any(fragment in name for name in names), (path, fragment, sorted(set(names)))
    if not grad:  # exactly the forward's GEMM kernel (the backward's products take their own dispatch)
        assert all(expected[-1] in name for name in gemm_names), (path, gemm_names)
    if plan_.gemm == "lowp_small_m" and problem == "33" and not grad:
        # GPU_CASES' 16-bit small batches run in one K piece: the BatchNorm in the product's epilogue
        assert not any("bn16_" in name for name in names), (path, sorted(set(names)))
    if portable and dtype == F32:
        assert plan_.gemm == "sm80_3xtf32"
        assert not any("sm90" in name for name in names), (path, gemm_names)
    on_hopper = torch.cuda.get_device_capability() == (9, 0)
    if dtype == F32 and not portable and on_hopper:
        small = m <= model_new.SMALL_M_MAX_ROWS
        assert plan_.gemm == ("small_m_fp64" if small else "sm90_fp16x3"), (path, m)
