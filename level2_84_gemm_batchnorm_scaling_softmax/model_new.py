"""Drop-in replacement for KernelBench level 2 problem 84 (`reference.Model` in
this folder): Linear -> BatchNorm1d -> multiply by `scale` -> Softmax(dim=1),
float32.  Shares the kernels, the build, the dispatch and the forward /
backward with problem 33 through the engine's documented surface: the
model_new.py one folder up, found by location (_engine: under the package above
this folder when there is one, so the two files can be vendored together).  The
self-contained form, for harnesses that execute a file's text,
is dist/model_new.py in this folder (tools/bundle.py: the engine's text and
this module's, kernels embedded).

Names: M = batch, N = out_features, K = in_features.  x is (M, K) row-major,
gemm.weight (N, K) row-major (both K-major); the output is (M, N), each row a
probability distribution over the N features.

Data path of `ModelNew.forward` (the root model_new.py's docstring has the map,
the README's support matrix the routes): check_input, then
fused_forward(..., scale_after_bn=True), whose dispatch() picks the GEMM kernel
(ModelNew.kernel_path(x) names it):

  Model.forward step         kernel file (../kernels/)            launcher
  -------------------------  -----------------------------------  ------------------------------
  gemm(x) = x W^T (+ b)      Hopper: prepass_fp16x3.cu, then      sm90_prepass_fp16x3,
                             sm90_gemm_fp16x3_bn.cu               sm90_gemm_fp16x3_train / _eval
                             sm_80-89 (and Hopper by switch):     row_centers (+ row_sums, cached),
                             centring.cu, prepass_3xtf32.cu,      sm80_prepass_3xtf32,
                             sm80_gemm_3xtf32_bn.cu               sm80_gemm_3xtf32_train / _eval
  training:
  bn (batch statistics),     GEMM epilogue: z and per-tile mean / M2
  running statistics         bn_softmax.cu                        bn_softmax_fold_train
  * scale, softmax           bn_softmax.cu                        softmax_rows (one CTA per row)
  eval:
  bn, * scale                folded into the GEMM epilogue        the GEMM's _eval (scale_after_bn)
  softmax                    bn_softmax.cu                        softmax_rows
  checks, stream             torch_binding.cpp                    forward_train / forward_eval

On a 16-bit CUDA tensor: ../model_new_lowp.py and ../kernels/lowp/ (rounding to
the 16-bit type where the reference's eager ops do; docs/numerics.md).

Algebra (training): BatchNorm sees y = z + b (z = x W^T): mean_y = mean_z + b,
var_y = var_z, so the softmax input is
    v = scale * (bn.weight * (z - mean_z) / sqrt(var_z + eps) + bn.bias)
      = (z - mean_z) * a + c,   a = scale * bn.weight / sqrt(var_z + eps),  c = scale * bn.bias:
the Linear bias cancels from the output and only enters running_mean; scale
does not enter the running statistics.
Eval: v = a z + c with a = scale * g, c = scale * (bn.bias + (b - running_mean) * g),
g = bn.weight / sqrt(running_var + eps).
Softmax: exp(v - max v) / sum exp(v - max v) per row, float32.

Backward (training; ../model_new.py `_train_backward`): the row softmax's
backward grad_v = out * (grad_out - sum_n grad_out * out) (one kernel on float32
CUDA tensors, torch ops elsewhere), then bn_backward_train(scale_after_bn=True,
bn.bias) for grad_z, grad_scale (its bn.bias * sum_m grad_v term included),
grad_bn.weight, grad_bn.bias, then gemm_nn for grad_x and gemm_tn for grad_W;
grad_gemm.bias = 0.  Eval differentiates
softmax((z + b - running_mean) a + scale bn.bias) (`_eval_with_grad`).

`scale` may have any shape that multiplies each feature by one number:
numel 1 (the default (1,)) or N ((N,) or (1, N)); its gradient is summed to
that shape.  Everything after the input checks is the engine's fused_forward
with scale_after_bn=True: the CUDA extension, or on CPU (and float64 CUDA) the
same decomposed math in plain PyTorch (`_torch_*`); torch.compile traces the
fused_gemm_bn:: custom operators.  Tests: ../test_equivalence.py (both
problems), test_equivalence.py in this folder (problem 84's own checks),
../tests/test_backward.py.
"""
import torch
from torch import nn

# bundle: engine begins (tools/bundle.py puts the engine's text in place of this block)
import hashlib  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402


def _engine():
    """The shared engine: the model_new.py in the folder above this one, found by
    location.  Where this folder is a subpackage (pkg.level2_84_..., vendored) it is
    the parent package's module pkg.model_new; where it is a top-level package (the
    repository root on sys.path) the module model_new, or, when that name holds
    another file (this module itself imported as model_new, another copy),
    model_new_<8 hex digits of the path>.  Text executed without a file imports
    model_new by name."""
    if "__file__" not in globals():
        return importlib.import_module("model_new")
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model_new.py")
    parent = (__package__ or "").rpartition(".")[0]
    if parent:
        return importlib.import_module(parent + ".model_new")
    name = "model_new"
    if name in sys.modules and os.path.abspath(getattr(sys.modules[name], "__file__", None) or "") != path:
        name = "model_new_" + hashlib.sha256(path.encode()).hexdigest()[:8]
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


# The shared engine's documented surface (../model_new.py).
_ENGINE_MODULE = _engine()
BatchNormState, FusedModule, LinearParams = (_ENGINE_MODULE.BatchNormState, _ENGINE_MODULE.FusedModule,
                                             _ENGINE_MODULE.LinearParams)
# bundle: engine ends

# ---------------------------------------------------------------------------
# Module
# ---------------------------------------------------------------------------


class ModelNew(FusedModule):
    """Linear(in_features, out_features) -> BatchNorm1d(out_features, bn_eps,
    bn_momentum) -> * scale -> row softmax (dim=1).

    Same constructor, parameter/buffer names and order, random draws and
    train/eval behaviour as this folder's `reference.Model` (which also holds a
    softmax module; it has no state).  forward(x): x (M, in_features),
    float32 on CUDA (compute capability >= 8.0: the fused kernels), float64 on
    CUDA (plain torch ops), a 16-bit float dtype on CUDA (compute capability
    >= 8.0: the ../kernels/lowp/ extension, compiled on the first such call,
    rounding where the reference rounds) or any float dtype on CPU, matching the
    parameters' dtype; returns (M, out_features).  Training mode updates
    bn.running_mean, bn.running_var (unbiased) and bn.num_batches_tracked.
    Differentiable with respect to x and every parameter in both modes;
    gemm.bias gets an exact zero gradient in training.  bn.training, not the module's flag,
    selects batch or running statistics, as in the reference (`model.bn.eval()`
    freezes BatchNorm); nn.SyncBatchNorm.convert_sync_batchnorm converts bn as in
    the reference, and training calls then merge the batch statistics of all
    processes (../model_new_sync.py; not in the self-contained file, which
    warns once).  kernel_path(x) names the path
    forward(x) would take.  M == 0 gives an empty output as the reference.
    Raises ValueError for M == 1 in training (PyTorch's message; synchronized:
    for a global batch of 1), Model's errors for a wrong rank, RuntimeError for
    a wrong feature count, dtype or device, or a `scale` that is not one number
    per feature; a rejected call leaves every buffer unchanged.
    """

    scale_after_bn = True  # the engine's problem selector: Linear -> BatchNorm -> scale -> Softmax

    def __init__(self, in_features, out_features, bn_eps=1e-5, bn_momentum=0.1, scale_shape=(1,)):
        super().__init__()
        self.gemm = LinearParams(in_features, out_features)
        self.bn = BatchNormState(out_features, eps=bn_eps, momentum=bn_momentum)
        self.scale = nn.Parameter(torch.ones(scale_shape))


# ---------------------------------------------------------------------------
# KernelBench interface (sizes default to the original's; names already set in
# the namespace, e.g. by a reference executed first, keep their values)
# ---------------------------------------------------------------------------

batch_size = globals().get("batch_size", 1024)
in_features = globals().get("in_features", 8192)
out_features = globals().get("out_features", 8192)
bn_eps = globals().get("bn_eps", 1e-5)
bn_momentum = globals().get("bn_momentum", 0.1)
scale_shape = globals().get("scale_shape", (1,))


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, bn_eps, bn_momentum, scale_shape]
