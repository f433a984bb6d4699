"""Drop-in replacement for KernelBench level 2 problem 84 (`reference.Model` in
this folder): Linear -> BatchNorm1d -> multiply by `scale` -> Softmax(dim=1),
float32.  Shares the kernels, the build and the parameter containers with
problem 33's ModelNew (../model_new.py, loaded as a module of its own).

Names: M = batch, N = out_features, K = in_features.  x is (M, K) row-major,
gemm.weight (N, K) row-major (both K-major); the output is (M, N), each row a
probability distribution over the N features.

Data path of `ModelNew.forward` on a CUDA tensor (float32):

  Model.forward step         kernel file                          launcher / binding
  -------------------------  -----------------------------------  ------------------------------
  gemm(x) = x W^T (+ b)      ../kernels/sm90_gemm_3xtf32_bn.cu    3xTF32 GEMM (Hopper), or the
                             ../kernels/sm80_gemm_3xtf32_bn.cu    portable one; x split first
                                                                  (../kernels/split_tf32.cu)
  training:
  bn (batch statistics),     GEMM epilogue: z and per-tile mean / M2
  running statistics         ../kernels/bn_softmax.cu             bn_softmax_fold_train
  * scale, softmax           ../kernels/bn_softmax.cu             softmax_rows (one CTA per row)
  eval:
  bn, * scale                folded into the GEMM epilogue        *_gemm_3xtf32_eval (scale after bn)
  softmax                    ../kernels/bn_softmax.cu             softmax_rows
  checks, stream, dispatch   ../kernels/torch_binding.cpp         forward_softmax_train / _eval

On a 16-bit CUDA tensor: ../kernels/lowp/gemm_bn_16bit.cu (z = rnd(x W^T + b),
per-tile statistics; eval: BatchNorm and scale in its epilogue), then
../kernels/lowp/bn_16bit.cu (statistics and running statistics, then one CTA
per row for rnd(softmax(rnd(rnd(BatchNorm(z)) * scale)))), rounding to the
16-bit type where the reference's eager ops do (../model_new.py's docstring).

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
backward grad_v = out * (grad_out - sum_n grad_out * out) in elementwise ops,
then bn_backward_train(scale_after_bn=True) for grad_z, grad_scale (plus
bn.bias * sum_m grad_v, added in Python), grad_bn.weight, grad_bn.bias, then
gemm_nt for grad_x and grad_W; grad_gemm.bias = 0.  Eval differentiates
softmax((z + b - running_mean) a + scale bn.bias) (`_eval_with_grad`).

`scale` may have any shape that multiplies each feature by one number:
numel 1 (the default (1,)) or N ((N,) or (1, N)); its gradient is summed to
that shape.  Everything after the input checks is ../model_new.py's
`_fused_forward` with softmax=True: the CUDA extension, or on CPU the same
decomposed math in plain PyTorch (`_cpu_*`); torch.compile traces the
fused_gemm_bn:: custom operators.  Tests: test_equivalence.py in this folder,
../tests/test_backward.py.  The kernels are found as ../model_new.py finds
them (next to it, or $FUSED_GEMM_BN_KERNEL_DIR).
"""
import importlib.util
import os
import sys

import torch
from torch import nn

# ---------------------------------------------------------------------------
# Problem 33's module: extension, parameter containers, input checks, the
# forward and backward of both problems, custom operators
# ---------------------------------------------------------------------------

_CORE_NAME = "fused_gemm_bn_core"


def _core_path():
    if "__file__" in globals():
        return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model_new.py")
    env = os.environ.get("FUSED_GEMM_BN_KERNEL_DIR")
    if env:
        return os.path.join(os.path.dirname(os.path.abspath(env)), "model_new.py")
    raise RuntimeError("executed without __file__: set $FUSED_GEMM_BN_KERNEL_DIR to the repository's kernels/ folder")


def _load_core():
    """../model_new.py as a module: the one already imported (as `model_new` or
    under _CORE_NAME) when there is one, so the extension loads once."""
    path = os.path.realpath(_core_path())
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and os.path.realpath(file) == path:
            return module
    spec = importlib.util.spec_from_file_location(_CORE_NAME, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[_CORE_NAME] = module
    spec.loader.exec_module(module)
    return module


_core = _load_core()

# ---------------------------------------------------------------------------
# Module
# ---------------------------------------------------------------------------


class ModelNew(nn.Module):
    """Linear(in_features, out_features) -> BatchNorm1d(out_features, bn_eps,
    bn_momentum) -> * scale -> Softmax(dim=1).

    Same constructor, parameter/buffer names and order, random draws and
    train/eval behaviour as this folder's `reference.Model` (which also holds an
    nn.Softmax module; it has no state).  forward(x): x (M, in_features),
    float32 on CUDA (compute capability >= 8.0: the fused kernels), float64 on
    CUDA (plain torch ops), a 16-bit float dtype on CUDA (compute capability
    >= 8.0: the ../kernels/lowp/ extension, compiled on the first such call,
    rounding where the reference rounds) or any float dtype on CPU, matching the
    parameters' dtype; returns (M, out_features).  Training mode updates
    bn.running_mean, bn.running_var (unbiased) and bn.num_batches_tracked.
    Differentiable with respect to x and every parameter in both modes (16-bit
    CUDA: the backward runs torch ops); gemm.bias gets an exact zero gradient
    in training (16-bit: rounding noise).
    M == 0 gives an empty output as the reference.
    Raises ValueError for M == 1 in training (PyTorch's message), RuntimeError
    for a wrong rank, feature count, dtype or device, or a `scale` that is not
    one number per feature; a rejected call leaves every buffer unchanged.
    """

    def __init__(self, in_features, out_features, bn_eps=1e-5, bn_momentum=0.1, scale_shape=(1,)):
        super().__init__()
        self.gemm = _core._LinearParams(in_features, out_features)
        self.bn = _core._BatchNormState(out_features, eps=bn_eps, momentum=bn_momentum)
        self.scale = nn.Parameter(torch.ones(scale_shape))

    def _scale_vector(self):
        """scale as an (N,) vector (a view when it already is one)."""
        n = self.gemm.out_features
        s = self.scale
        per_feature = s.dim() <= 2 and (s.numel() == 1 or (s.shape[-1] == n and s.numel() == n))
        if not per_feature:
            raise RuntimeError(
                f"ModelNew supports a scale of one number or one per feature (shape (1,), ({n},) or (1, {n})), "
                f"got shape {tuple(s.shape)}"
            )
        s = s.reshape(-1)
        return s if s.shape == (n,) else s.expand(n).contiguous()

    def forward(self, x):
        _core._check_input(x, self.gemm.weight, self.training)
        scale = self._scale_vector()  # raises for an unsupported shape before any buffer is touched
        return _core._fused_forward(x, self.gemm, scale, self.bn, self.training, softmax=True)


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
