"""Drop-in replacement for KernelBench level 2 problem 33 (`reference.Model`):
Linear -> multiply by a per-feature `scale` -> BatchNorm1d, float32.

Names: M = batch, N = out_features, K = in_features.  x is (M, K) row-major,
gemm.weight is (N, K) row-major (both K-major); the output is (M, N).

Data path of `ModelNew.forward` on a CUDA tensor (float32):

  Model.forward step            kernel file                      launcher / binding
  ----------------------------  -------------------------------  -----------------------------------
  Hopper (sm_90a, K % 4 == 0):
  x -> x - tf32_trunc(x)        kernels/split_tf32.cu            split_tf32_remainder (x sweep)
  gemm(x) = x W^T + b           kernels/sm90_gemm_3xtf32_bn.cu   sm90_gemm_3xtf32_train / _eval
                                (wgmma, TMA, warp-specialised; w split in registers)
  Other GPUs (sm_80+), or FUSED_GEMM_BN_PORTABLE=1:
  x -> TF32 big/small parts     kernels/split_tf32.cu            split_tf32 (x sweep, fragment order)
  gemm(x) = x W^T + b           kernels/sm80_gemm_3xtf32_bn.cu   sm80_gemm_3xtf32_train / _eval
  * scale, bn (training),       the portable GEMM, cluster-launched, where it costs no extra wave:
    sm_90 and batch <= 1024     sm90_gemm_3xtf32_train_fused (statistics over DSMEM, one write)
  Both:
  * scale, bn (training)        the GEMM epilogue writes z = x W^T and per-tile mean / M2;
    batch stats, running stats, kernels/bn_apply.cu              bn_apply (in place over z)
    normalise + affine
  * scale, bn (eval)            folded into the GEMM epilogue    *_gemm_3xtf32_eval
  statistics math               kernels/bn_stats.cuh             shared by the training paths
  PTX wrappers (wgmma, TMA)     kernels/sm90_primitives.cuh
  input checks, device guard,   kernels/torch_binding.cpp        forward_train / forward_eval
  current stream, dispatch

Algebra (training): with z = x W^T, u = scale * (z + b) has batch mean
scale * (mean_z + b) and biased variance scale^2 var_z, so
    out = (z - mean_z) * a + bn.bias,   a = scale * bn.weight / sqrt(scale^2 var_z + eps):
the Linear bias cancels from the output and only enters running_mean.
Eval: out = a z + c with a = scale * bn.weight / sqrt(running_var + eps) and
c = bn.bias + (scale * b - running_mean) * bn.weight / sqrt(running_var + eps).

The GEMM is float32-accurate 3xTF32 on tensor cores (header of the .cu file:
split, rounding, expected error).  CPU tensors take `_cpu_forward`, the same
decomposed math in plain PyTorch (per-tile partial statistics merged with
Chan's formula), in the module's dtype.  Tests: test_equivalence.py.

Build: at import, the sources (kernels/*.cu, *.cuh, *.cpp) are located and, when
a GPU is visible, compiled once by torch.utils.cpp_extension.load_inline with
-gencode flags for the GPUs present (TORCH_CUDA_ARCH_LIST is ignored) into
$TORCH_EXTENSIONS_DIR (or torch's default extension root)/fused_gemm_bn_<hash>,
the hash covering sources, flags and versions; torch's file lock there makes
concurrent imports build once.  The sources are found at
$FUSED_GEMM_BN_KERNEL_DIR, else kernels/ next to this file, else ./kernels (this
text executed without __file__); `python tools/bundle.py` writes
dist/model_new.py, this file with the sources embedded, needing no repository.
"""
import hashlib
import math
import os
import sys

import torch
from torch import nn

# ---------------------------------------------------------------------------
# Build
# ---------------------------------------------------------------------------

_KERNEL_DIR_ENV = "FUSED_GEMM_BN_KERNEL_DIR"
_KERNEL_SUFFIXES = (".cu", ".cuh", ".cpp")
_EXTENSION_FUNCTIONS = ["forward_train", "forward_eval", "forward_softmax_train", "forward_softmax_eval",
                        "forward_train_saved", "forward_softmax_train_saved", "gemm_nt", "bn_backward_train"]

# The kernel sources, {file name: text}.  None: read from kernels/ at import.
# tools/bundle.py writes a copy of this file with the sources in their place.
_EMBEDDED_SOURCES = None


def _kernel_dir():
    """The kernels/ folder: $FUSED_GEMM_BN_KERNEL_DIR when set, else the one next
    to this file, else ./kernels (for this text executed without __file__)."""
    env = os.environ.get(_KERNEL_DIR_ENV)
    if env:
        candidates = [env]
    else:
        candidates = [os.path.join(os.getcwd(), "kernels")]
        if "__file__" in globals():
            candidates.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels"))
    for folder in candidates:
        if os.path.isfile(os.path.join(folder, "torch_binding.cpp")):
            return folder
    raise RuntimeError(
        f"model_new: kernel sources not found (looked for torch_binding.cpp in {', '.join(candidates)}); "
        f"set ${_KERNEL_DIR_ENV} to the repository's kernels/ folder, or use the self-contained "
        f"dist/model_new.py written by `python tools/bundle.py`"
    )


def _kernel_sources():
    """{file name: text} of every kernels/*.cu, *.cuh and *.cpp, read as bytes
    and decoded as UTF-8 (no newline translation), or the embedded copy."""
    if _EMBEDDED_SOURCES is not None:
        return dict(_EMBEDDED_SOURCES)
    folder = _kernel_dir()
    sources = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(_KERNEL_SUFFIXES):
            with open(os.path.join(folder, name), "rb") as f:
                sources[name] = f.read().decode("utf-8")
    return sources


def _arch_flags():
    """-gencode flags for every visible GPU.  Passed explicitly so that
    TORCH_CUDA_ARCH_LIST (often set by harnesses to another GPU) is not used;
    Hopper gets sm_90a, the target with wgmma and setmaxnreg."""
    flags = []
    for major, minor in sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}):
        arch = f"{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
    return flags


def _extension_name(sources, cuda_flags):
    """fused_gemm_bn_<16 hex digits of SHA-256 over the sources, the flags and
    the torch / CUDA / Python versions>: a changed kernel never loads an old build."""
    h = hashlib.sha256()
    for name, text in sorted(sources.items()):
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    versions = [torch.__version__, str(torch.version.cuda), sys.version.split()[0]]
    h.update("\0".join(cuda_flags + versions).encode())
    return "fused_gemm_bn_" + h.hexdigest()[:16]


def _build_directory(name):
    """$TORCH_EXTENSIONS_DIR/<name>, or torch's default extension root/<name>."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    return path


def _write_headers(include_dir, sources):
    """Writes the .cuh sources where the .cu files' #include finds them.  Each
    file is written under a per-process name and renamed into place, so
    processes importing at once never see a half-written header."""
    os.makedirs(include_dir, exist_ok=True)
    for name, text in sources.items():
        if not name.endswith(".cuh"):
            continue
        path = os.path.join(include_dir, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                if f.read() == text.encode():
                    continue
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(text.encode())
        os.replace(tmp, path)


class _BuildFailure:
    """Context manager around the compile: a failure is re-raised as one
    RuntimeError naming nvcc and a log file holding the compiler's output."""

    def __init__(self, build_dir, nvcc):
        self.build_dir = build_dir
        self.nvcc = nvcc

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None or not issubclass(exc_type, Exception):
            return False
        log = os.path.join(self.build_dir, "build.log")
        with open(log, "w") as f:
            f.write(str(exc))
        raise RuntimeError(
            f"model_new: compiling the CUDA kernels with {self.nvcc} failed; the compiler output is in {log}"
        ) from exc


def _load_extension(sources):
    from torch.utils.cpp_extension import CUDA_HOME, load_inline

    cuda_flags = ["-O3", "-std=c++17"] + _arch_flags()
    name = _extension_name(sources, cuda_flags)
    build_dir = _build_directory(name)
    include_dir = os.path.join(build_dir, "include")
    _write_headers(include_dir, sources)

    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else None
    built = any(f.startswith(name) and f.endswith((".so", ".pyd")) for f in os.listdir(build_dir))
    if not built:
        if nvcc is None or not os.path.isfile(nvcc):
            raise RuntimeError(
                f"model_new: nvcc not found (CUDA_HOME={CUDA_HOME}); the kernels are compiled at import "
                f"and need a CUDA toolkit matching torch's CUDA {torch.version.cuda} (set CUDA_HOME)"
            )
        print(f"model_new: compiling the CUDA kernels into {build_dir} (first import only, about a minute)",
              file=sys.stderr)
    with _BuildFailure(build_dir, nvcc):
        return load_inline(
            name=name,
            cpp_sources=[text for n, text in sorted(sources.items()) if n.endswith(".cpp")],
            cuda_sources=[text for n, text in sorted(sources.items()) if n.endswith(".cu")],
            functions=_EXTENSION_FUNCTIONS,
            extra_cflags=["-O3", "-std=c++17"],
            extra_cuda_cflags=cuda_flags,
            extra_include_paths=[include_dir],
            build_directory=build_dir,
            verbose=os.environ.get("FUSED_GEMM_BN_VERBOSE_BUILD") == "1",
        )


# Sources are located on every machine, so a missing kernels/ folder is reported
# at import; only a machine with a GPU compiles them.
_KERNEL_SOURCES = _kernel_sources()
_ext = _load_extension(_KERNEL_SOURCES) if torch.cuda.is_available() else None

# ---------------------------------------------------------------------------
# Parameters: same names, shapes and random draws as nn.Linear / nn.BatchNorm1d
# ---------------------------------------------------------------------------


class _LinearParams(nn.Module):
    """gemm.weight (N, K) and gemm.bias (N), initialised as torch's Linear layer
    does (kaiming_uniform_ with a = sqrt(5), then uniform bias in +-1/sqrt(K)),
    so one seed gives the reference's exact draws."""

    def __init__(self, in_features, out_features):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
        nn.init.uniform_(self.bias, -bound, bound)


class _BatchNormState(nn.Module):
    """bn.weight, bn.bias and the running-statistics buffers of torch's BatchNorm1d
    (affine=True, track_running_stats=True).  `eps` and `momentum` are read at
    every call; momentum=None selects the cumulative average."""

    def __init__(self, num_features, eps, momentum):
        super().__init__()
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))


# ---------------------------------------------------------------------------
# CPU path: the kernels' decomposed math in plain PyTorch
# ---------------------------------------------------------------------------

_CPU_STATS_BLOCK_M = 128  # rows per partial-statistics tile, as the GEMM's BLOCK_M


def _cpu_batch_stats(z):
    """Per-feature mean and biased/unbiased variance of z (M, N), from per-tile
    mean / M2 merged with Chan's pairwise formula in float64 (bn_apply.cu merges the
    GEMM's tiles the same way)."""
    count = mean = m2 = None
    for tile in z.split(_CPU_STATS_BLOCK_M):
        n_b = float(tile.shape[0])
        mean_b = tile.mean(0)
        m2_b = ((tile - mean_b) ** 2).sum(0)
        mean_b, m2_b = mean_b.double(), m2_b.double()
        if count is None:
            count, mean, m2 = n_b, mean_b, m2_b
            continue
        n = count + n_b
        delta = mean_b - mean
        mean = mean + delta * (n_b / n)
        m2 = m2 + m2_b + delta * delta * (count * n_b / n)
        count = n
    return mean, m2 / count, m2 / (count - 1.0)


def _cpu_forward(x, weight, bias, scale, bn, training, factor):
    z = x @ weight.t()
    if training:
        mean, var_biased, var_unbiased = _cpu_batch_stats(z)
        s = scale.double()
        a = s * bn.weight.double() / torch.sqrt(s * s * var_biased + bn.eps)
        with torch.no_grad():
            bn.running_mean.copy_((1.0 - factor) * bn.running_mean.double() + factor * s * (mean + bias.double()))
            bn.running_var.copy_((1.0 - factor) * bn.running_var.double() + factor * s * s * var_unbiased)
        return (z - mean.to(z.dtype)) * a.to(z.dtype) + bn.bias
    gw = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    return z * (scale * gw) + (bn.bias + (scale * bias - bn.running_mean) * gw)


# ---------------------------------------------------------------------------
# Module
# ---------------------------------------------------------------------------


def _check_input(x, weight, training):
    """Raises what PyTorch raises for an input the Linear -> BatchNorm1d chain
    cannot take (x's rank, feature count, device, dtype; batch of 1 in
    training), before any buffer is touched.  Shared with problem 84's ModelNew."""
    n, k = weight.shape
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"ModelNew expects a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise RuntimeError(f"ModelNew expects x of shape (batch, {k}), got {tuple(x.shape)}")
    if x.shape[1] != k:
        raise RuntimeError(
            f"mat1 and mat2 shapes cannot be multiplied ({x.shape[0]}x{x.shape[1]} and {k}x{n}): "
            f"ModelNew expects x of shape (batch, {k})"
        )
    if x.device != weight.device:
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found x on {x.device} "
            f"and the parameters on {weight.device}"
        )
    if x.dtype != weight.dtype:
        raise RuntimeError(f"mat1 and mat2 must have the same dtype, but got {x.dtype} and {weight.dtype}")
    if x.is_cuda and x.dtype != torch.float32:
        raise RuntimeError(f"ModelNew's CUDA path supports float32 only, got {x.dtype}")
    if training and x.shape[0] == 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size {torch.Size([x.shape[0], n])}"
        )


class _NoBackward(torch.autograd.Function):
    """Runs the fused CUDA forward; backward is not implemented yet and says so."""

    @staticmethod
    def forward(ctx, fn, *tensors):
        return fn()

    @staticmethod
    def backward(ctx, *grad_outputs):
        raise RuntimeError(
            "ModelNew: the fused CUDA forward has no backward yet; use reference.Model for training "
            "with gradients, or call ModelNew under torch.no_grad()"
        )


class ModelNew(nn.Module):
    """Linear(in_features, out_features) -> * scale -> BatchNorm1d(out_features, eps, momentum).

    Same constructor, parameter/buffer names, random draws and train/eval
    behaviour as `reference.Model`.  forward(x): x (M, in_features), float32 on
    CUDA (compute capability >= 8.0) or any float dtype on CPU, matching the
    parameters' dtype; returns (M, out_features).  Training mode updates
    bn.running_mean, bn.running_var (unbiased) and bn.num_batches_tracked.

    M == 0 gives an empty output (num_batches_tracked still counts the call in
    training, running statistics are untouched), as torch's BatchNorm1d.
    Raises ValueError for M == 1 in training (PyTorch's message), and
    RuntimeError for a wrong rank, feature count, dtype or device; a rejected
    call leaves every buffer unchanged.
    """

    def __init__(self, in_features, out_features, scale_shape, eps=1e-5, momentum=0.1):
        super().__init__()
        self.gemm = _LinearParams(in_features, out_features)
        self.scale = nn.Parameter(torch.randn(scale_shape))
        self.bn = _BatchNormState(out_features, eps=eps, momentum=momentum)

    def _scale_vector(self):
        n = self.gemm.out_features
        s = self.scale
        return s if s.shape == (n,) else s.expand(n).contiguous()

    def forward(self, x):
        _check_input(x, self.gemm.weight, self.training)
        bn = self.bn
        momentum = bn.momentum
        if self.training and not (x.is_cuda and x.shape[0] > 0):
            # The CUDA training call increments it in its first kernel (split_tf32.cu).
            bn.num_batches_tracked.add_(1)
        if x.shape[0] == 0:  # as nn.BatchNorm1d: empty output, running statistics untouched
            return x.new_empty((0, self.gemm.out_features))
        if not x.is_cuda:
            factor = momentum if momentum is not None else 1.0 / float(bn.num_batches_tracked)
            return _cpu_forward(x, self.gemm.weight, self.gemm.bias, self.scale, bn, self.training, factor)
        if _ext is None:
            raise RuntimeError("ModelNew: CUDA tensor given but the extension was not built (no GPU at import)")

        params = (self.gemm.weight, self.gemm.bias, self._scale_vector(), bn.weight, bn.bias)
        if self.training:
            def run():
                return _ext.forward_train(x, *params, bn.running_mean, bn.running_var, bn.num_batches_tracked,
                                          -1.0 if momentum is None else float(momentum), float(bn.eps))
        else:
            def run():
                return _ext.forward_eval(x, *params, bn.running_mean, bn.running_var, float(bn.eps))
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
            return _NoBackward.apply(run, x, *params)
        return run()


# ---------------------------------------------------------------------------
# KernelBench interface (sizes default to the original's; names already set in
# the namespace, e.g. by a reference executed first, keep their values)
# ---------------------------------------------------------------------------

batch_size = globals().get("batch_size", 1024)
in_features = globals().get("in_features", 8192)
out_features = globals().get("out_features", 8192)
scale_shape = globals().get("scale_shape", (out_features,))


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, scale_shape]
