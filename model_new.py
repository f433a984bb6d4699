"""Drop-in replacement for KernelBench level 2 problem 33 (`reference.Model`):
Linear -> multiply by a per-feature `scale` -> BatchNorm1d, float32; and the
float32 core of problem 84 (level2_84_gemm_batchnorm_scaling_softmax/model_new.py:
Linear -> BatchNorm1d -> scale -> Softmax), which imports it.

Names: M = batch, N = out_features, K = in_features.  x is (M, K) row-major,
gemm.weight is (N, K) row-major (both K-major); the output is (M, N).
scale_after_bn selects the problem everywhere: False = problem 33, True = 84.

This file is the float32 core, its sections in call order: Build (load_inline
of kernels/ at import), Extras, Parameters, Input checks, Dispatch, Forward,
Weight cache, Backward (autograd), Custom operators, Torch-op path, ModelNew
and the KernelBench interface.  Beside it, found by location and bound to
this core whatever its module name (_load_extra; each gets ENGINE, the core's
face, through bind(); tools/bundle.py's self-contained files are this file with
the kernels embedded, and have none of them): model_new_lowp.py (16-bit
modules, kernels/lowp/), model_new_autocast.py (mixed precision),
model_new_sync.py (synchronized BatchNorm).

From ModelNew.forward to the kernels (docs/design.md has the whole map):

  ModelNew.forward -> _plain_call (the common CUDA call, same decision) or fused_forward: module_call,
    check_input, per_feature_scale, dispatch() -> Plan; then _run_plan:
    no gradient:          forward_train / forward_eval (torch_binding.cpp), one extension call
    training + gradient:  _TrainFn: forward_train_saved; backward bn_backward_train, gemm_nn, gemm_tn
    eval + gradient:      _EvalFn: forward_eval_saved; backward bn_backward_eval, gemm_nn, gemm_tn
    torch.compile, jit.trace: the same through the fused_gemm_bn:: custom operators

  gemm          kernels/                                     steps of Model.forward
  ------------  -------------------------------------------  -----------------------------------
  sm90_fp16x3   prepass_fp16x3.cu (x's and W's fp16 parts;   gemm: wgmma, TMA, three fp16
                W's kept: _weight_parts), sm90_gemm_fp16x3_  products (fp16x3); eval folds
                bn.cu                                        * scale and bn into the epilogue
  sm80_3xtf32   centring.cu, prepass_3xtf32.cu,              gemm: mma.sync, 3xTF32; eval
                sm80_gemm_3xtf32_bn.cu                       as above
  small_m_fp64  small_m_fp64.cu (small batches, _small_m_  gemm: W read once, float64
                gemm; no split of x or W first)            products (DMMA); all of bn (and
                                                           84's softmax) in float64 after it
  after the GEMM in training (the tensor-core routes): bn_apply.cu (problem 33: statistics,
  running statistics, bn), bn_softmax.cu (84: the same, * scale, softmax); backward: softmax_rows_backward.cu (84),
  bn_backward.cu, prepass_fp16x3_backward.cu and the GEMM: grad_x = grad_z W, grad_W = grad_z^T x.
  kernels/launchers.cuh declares every launcher (both sides include it).

Algebra (training): with z = x W^T, u = scale * (z + b) has batch mean
scale * (mean_z + b) and biased variance scale^2 var_z, so
    out = (z - mean_z) * a + bn.bias,   a = scale * bn.weight / sqrt(scale^2 var_z + eps):
the Linear bias cancels from the output and only enters running_mean.  Eval
folds everything after the GEMM into out = a' z + c' (_torch_forward_eval); the
backward's formulas are _torch_bn_backward_train's and _torch_bn_backward_eval's.  The GEMMs' numerics
(split, rounding, expected error) are in the .cu headers and docs/numerics.md.

Surface for problem 84's module and for users (documented, stable): FusedModule, LinearParams,
BatchNormState, fused_forward, kernel_path, module_call, module_fields, check_input, per_feature_scale,
sync_process_group, clear_weight_cache; dispatch, dispatch_gemm_nt, dispatch_gemm_tn, plan, Call,
Plan, DeviceFacts, device_facts, Switches, SWITCHES; extra, extra_missing, extension_sources.
Surface for the extras: Engine / ENGINE only (docs/design.md, "The core and its extras").
Tests: test_equivalence.py, tests/.
"""
import collections
import contextlib
import functools
import hashlib
import importlib.util
import math
import os
import socket
import sys
import time
import types
import warnings
import weakref

import torch
from torch import nn
from torch.optim import optimizer as torch_optimizer

# ---------------------------------------------------------------------------
# Build
# ---------------------------------------------------------------------------

_KERNEL_DIR_ENV = "FUSED_GEMM_BN_KERNEL_DIR"
_KERNEL_SUFFIXES = (".cu", ".cuh", ".cpp")
_EXTENSION_PREFIX = "fused_gemm_bn_"
_EXTENSION_FUNCTIONS = ["forward_train", "forward_eval", "forward_train_saved", "forward_eval_saved", "gemm_nt",
                        "gemm_nn", "gemm_tn", "bn_backward_train", "bn_backward_eval", "softmax_rows_backward",
                        "fp16x3_weight_parts", "weight_row_sums", "sync_forward_local", "sync_bn_apply", "bn_backward_sums", "bn_backward_grad",
                        "sm90_gemm_available"]

# The kernel sources, {file name: text}.  None: read from kernels/ at import.
# tools/bundle.py writes a copy of this file with the sources in their place, and
# the SHA-256 of its engine text (above the "Problem 33" banner, as in this file)
# in place of _EMBEDDED_ENGINE_SHA256's None: what _engine_identity reads of the
# Python where the text runs without a file.
_EMBEDDED_SOURCES = None
_EMBEDDED_ENGINE_SHA256 = None


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


def _read_sources(folder):
    """{file name: text} of every *.cu, *.cuh and *.cpp directly in `folder`,
    read as bytes and decoded as UTF-8 (no newline translation)."""
    sources = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(_KERNEL_SUFFIXES):
            with open(os.path.join(folder, name), "rb") as f:
                sources[name] = f.read().decode("utf-8")
    return sources


def _kernel_sources():
    """{file name: text} of every kernels/*.cu, *.cuh and *.cpp (top level), or
    the embedded copy."""
    if _EMBEDDED_SOURCES is not None:
        return dict(_EMBEDDED_SOURCES)
    return _read_sources(_kernel_dir())


def extension_sources(subdir, binding):
    """{file name: text} of a second extension whose sources lie in kernels/<subdir>/
    (the 16-bit one: "lowp", "binding_16bit.cpp"): its *.cu, *.cuh and *.cpp, and the
    headers of kernels/ they #include by name, directly or through another
    header.  None where kernels/<subdir>/<binding> is missing (a copy of kernels/
    without it, and the self-contained files)."""
    if _EMBEDDED_SOURCES is not None:
        return None
    folder = os.path.join(_kernel_dir(), subdir)
    if not os.path.isfile(os.path.join(folder, binding)):
        return None
    found = _read_sources(folder)
    while True:
        text = "".join(found.values())
        added = {name: t for name, t in _KERNEL_SOURCES.items()
                 if name.endswith(".cuh") and name not in found and f'"{name}"' in text}
        if not added:
            return found
        found.update(added)


def _arch_flags():
    """-gencode flags for every visible GPU.  Passed explicitly so that
    TORCH_CUDA_ARCH_LIST (often set by harnesses to another GPU) is not used;
    Hopper gets sm_90a, the target with wgmma and setmaxnreg."""
    flags = []
    for major, minor in sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}):
        arch = f"{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
    return flags


def _extension_name(sources, cuda_flags, prefix=_EXTENSION_PREFIX):
    """<prefix><16 hex digits of SHA-256 over the sources, the flags and the
    torch / CUDA / Python versions>: a changed kernel never loads an old build."""
    h = hashlib.sha256()
    for name, text in sorted(sources.items()):
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    versions = [torch.__version__, str(torch.version.cuda), sys.version.split()[0]]
    h.update("\0".join(cuda_flags + versions).encode())
    return prefix + h.hexdigest()[:16]


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


class _BuildFailure(contextlib.AbstractContextManager):
    """Context manager around the compile: a failure is re-raised as one
    RuntimeError naming nvcc and a log file holding the compiler's output."""

    def __init__(self, build_dir, nvcc):
        self.build_dir, self.nvcc = build_dir, nvcc

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None or not issubclass(exc_type, Exception):
            return False
        log = os.path.join(self.build_dir, "build.log")
        with open(log, "w") as f:
            f.write(str(exc))
        raise RuntimeError(
            f"model_new: compiling the CUDA kernels with {self.nvcc} failed; the compiler output is in {log}"
        ) from exc


_LOCK_TIMEOUT_ENV = "FUSED_GEMM_BN_BUILD_LOCK_TIMEOUT"
_LOCK_TIMEOUT_DEFAULT_S = 900.0  # a compile takes about a minute


class _BuildLock:
    """Context manager: an exclusive lock on `build_dir` across processes, taken
    around load_inline.  torch's own lock (<build_dir>/lock) makes every other
    importer wait forever once a compile is killed outright.  This lock
    (<build_dir>/model_new.lock) holds "<pid> <host>" of its owner: a lock whose
    owner on this host is gone is removed; otherwise the importer waits up to
    timeout_s ($FUSED_GEMM_BN_BUILD_LOCK_TIMEOUT, default 900 s), then raises
    RuntimeError naming the file.  Once held, torch's lock can only be a killed
    compile's: it is removed.  Exiting removes the lock."""

    def __init__(self, build_dir, timeout_s=None):
        self.path = os.path.join(build_dir, "model_new.lock")
        self.torch_lock = os.path.join(build_dir, "lock")
        if timeout_s is None:
            timeout_s = float(os.environ.get(_LOCK_TIMEOUT_ENV, _LOCK_TIMEOUT_DEFAULT_S))
        self.timeout_s = timeout_s

    def _owner(self):
        """(pid, host) written in the lock file, or None if it is gone or unreadable."""
        text = None
        with contextlib.suppress(FileNotFoundError):
            with open(self.path) as f:
                text = f.read().split()
        if not text or len(text) != 2 or not text[0].isdigit():
            return None
        return int(text[0]), text[1]

    def _owner_is_dead(self):
        owner = self._owner()
        return (owner is not None and owner[1] == socket.gethostname() and os.path.isdir("/proc")
                and not os.path.exists(f"/proc/{owner[0]}"))

    def _try_create(self):
        with contextlib.suppress(FileExistsError):
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.write(fd, f"{os.getpid()} {socket.gethostname()}".encode())
            os.close(fd)
            return True
        return False

    def __enter__(self):
        deadline = time.monotonic() + self.timeout_s
        while not self._try_create():
            if self._owner_is_dead():
                print(f"model_new: removing {self.path}, left by a compile that was killed", file=sys.stderr)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.path)
                continue
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"model_new: waited {self.timeout_s:.0f} s for the build lock {self.path} (owner: "
                    f"{self._owner()}). If no process is compiling the kernels, delete that file and import "
                    f"again; ${_LOCK_TIMEOUT_ENV} sets the wait in seconds"
                )
            time.sleep(0.2)
        if os.path.exists(self.torch_lock):
            print(f"model_new: removing {self.torch_lock}, left by a compile that was killed", file=sys.stderr)
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.torch_lock)
        return self

    def __exit__(self, exc_type, exc, tb):
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)
        return False


def _load_extension(sources, functions=_EXTENSION_FUNCTIONS, prefix=_EXTENSION_PREFIX, arch_flags=None):
    """Compiles (or loads the earlier build of) `sources` ({file name: text}; .cpp
    as cpp_sources, .cu as cuda_sources, .cuh written to an include folder)
    exporting `functions`, as the module <prefix><hash>.  arch_flags: the
    -gencode flags (default: the visible GPUs'; tools/build_check.py passes its
    own).  No -std flag: the C++ standard is torch's choice (C++20 from 2.14)."""
    from torch.utils.cpp_extension import CUDA_HOME, load_inline

    cuda_flags = ["-O3"] + (_arch_flags() if arch_flags is None else list(arch_flags))
    name = _extension_name(sources, cuda_flags, prefix)
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
    with _BuildLock(build_dir), _BuildFailure(build_dir, nvcc):
        return load_inline(
            name=name,
            cpp_sources=[text for n, text in sorted(sources.items()) if n.endswith(".cpp")],
            cuda_sources=[text for n, text in sorted(sources.items()) if n.endswith(".cu")],
            functions=functions,
            extra_cflags=["-O3"],
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
# Extras: the optional modules beside this file (none in the self-contained files)
# ---------------------------------------------------------------------------
# Dependencies run one way: this core finds each extra by location (the file
# beside its own), executes it, and at the end of the engine hands it ENGINE,
# the documented face below (bind); an extra imports nothing of the core and
# reads no module name, so the files work under any module name, vendored into
# a package, and as two copies in one process, each copy with its own extras
# (docs/design.md, "The core and its extras").

_EXTRAS = ("model_new_sync", "model_new_lowp", "model_new_autocast")  # the files' names, less ".py"
_EXTRAS_MISSING = {}  # extra -> why it is not loaded (the message names the missing file)


def _own_file():
    """This file's absolute path, or None for text executed without a file (the self-contained files)."""
    return os.path.abspath(__file__) if "__file__" in globals() else None


def _load_extra(extra_name):
    """The extra `extra_name` (of _EXTRAS), executed from <extra_name>.py beside
    this file, or None (its reason in _EXTRAS_MISSING).  It is registered in
    sys.modules under this module's name followed by the extra's suffix
    ("model_new" -> "model_new_lowp", "pkg.model_new" -> "pkg.model_new_lowp",
    "other" -> "other_lowp"); a name held by another copy gets "_2", "_3", ...  A
    module already there from the same file and not yet bound (a user imported
    the extra first) is taken as it is."""
    own = _own_file()
    if _EMBEDDED_SOURCES is not None or own is None:
        _EXTRAS_MISSING[extra_name] = "self-contained"
        return None
    path = os.path.join(os.path.dirname(own), extra_name + ".py")
    if not os.path.isfile(path):
        _EXTRAS_MISSING[extra_name] = f"{path} is missing"
        return None
    base = __name__ + extra_name[len("model_new"):]
    for n in range(1, 1000):
        name = base if n == 1 else f"{base}_{n}"
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, path)
            module = sys.modules[name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        if getattr(module, "__file__", None) == path and getattr(module, "engine", True) is None:
            return module
    raise RuntimeError(f"model_new: no free module name for {path} (tried {base} to {base}_999)")


_SYNC = _load_extra("model_new_sync")            # synchronized BatchNorm (SyncBatchNorm conversion, DDP)
_LOWP = _load_extra("model_new_lowp")            # 16-bit float modules (kernels/lowp/)
_AUTOCAST = _load_extra("model_new_autocast")    # mixed precision


def extra(extra_name):
    """The extra module "model_new_sync", "model_new_lowp" or "model_new_autocast"
    (its file's name) that this core loaded and bound, or None where its file is
    missing (extra_missing says which) or in the self-contained files."""
    return dict(zip(_EXTRAS, (_SYNC, _LOWP, _AUTOCAST)))[extra_name]


def extra_missing(extra_name):
    """Why extra(extra_name) is None: "self-contained" for the self-contained
    files, else "<path> is missing"; None when the extra is loaded."""
    return _EXTRAS_MISSING.get(extra_name)


# ---------------------------------------------------------------------------
# Parameters: same names, shapes and random draws as torch's Linear / BatchNorm1d
# ---------------------------------------------------------------------------


class LinearParams(nn.Module):
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


_PLAIN_FIELDS = {}  # (type, names) -> no class of the type defines one of the names


def _plain_fields(cls, names):
    """No class of cls defines one of `names` (torch's parametrizations put a property there),
    so nn.Module's tables hold them; cached per (cls, names)."""
    key = (cls, names)
    plain = _PLAIN_FIELDS.get(key)
    if plain is None:
        plain = _PLAIN_FIELDS[key] = not any(hasattr(cls, n) for n in names)
    return plain


def module_fields(module, names):
    """(module.<name> for name in names), each what attribute access reads (the parameter,
    buffer or submodule of that name, else an instance attribute, else AttributeError), at a
    seventh of nn.Module.__getattr__'s host time (~0.13 against ~0.9 us a name; a small batch's
    call reads ten).  Reads nn.Module's tables of parameters, buffers and submodules itself
    where that gives the same: no class of the module defines one of the names (torch's
    parametrizations put a property there), and nn.Module keeps each name in one place."""
    plain = _plain_fields(type(module), names)
    d = module.__dict__
    parameters, buffers, modules = d.get("_parameters"), d.get("_buffers"), d.get("_modules")
    if not (plain and isinstance(parameters, dict) and isinstance(buffers, dict) and isinstance(modules, dict)):
        return tuple(getattr(module, name) for name in names)
    fields = []
    for name in names:
        if name in parameters:
            fields.append(parameters[name])
        elif name in buffers:
            fields.append(buffers[name])
        elif name in modules:
            fields.append(modules[name])
        else:
            fields.append(getattr(module, name))  # an instance attribute, or nn.Module's AttributeError
    return tuple(fields)


# With model_new_sync.py, torch's _BatchNorm: nn.SyncBatchNorm.convert_sync_batchnorm converts its
# instances.  The harness rules forbid naming that class in a self-contained file's text.
_BatchNormBase = nn.Module if _SYNC is None else _SYNC.BATCHNORM_BASE


class BatchNormState(_BatchNormBase):
    """bn.weight, bn.bias (N) and the buffers running_mean, running_var (N) and
    num_batches_tracked of torch's BatchNorm1d(N, eps, momentum): the same names,
    registration order, initial values and state_dict keys.  `eps` and
    `momentum` are read at every call (momentum=None: cumulative average).  A
    parameter container: calling it raises RuntimeError.  With
    model_new_sync.py it derives from torch's _BatchNorm, so SyncBatchNorm
    conversion replaces it by a SyncBatchNorm holding the same tensors."""

    def __init__(self, num_features, eps, momentum):
        # The state _NormBase.__init__ registers, written out because the base
        # may be nn.Module (the self-contained files); the same code either way.
        nn.Module.__init__(self)
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.affine = True
        self.track_running_stats = True
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    def forward(self, input):
        raise RuntimeError("BatchNormState holds BatchNorm1d's parameters and running statistics for ModelNew, whose "
                           "forward runs the fused kernels; it computes nothing itself: call the ModelNew holding it")

    def _check_input_dim(self, input):
        """BatchNorm1d's check: (M, N) or (M, N, L) input, else ValueError."""
        if input.dim() not in (2, 3):
            raise ValueError(f"expected 2D or 3D input (got {input.dim()}D input)")

    def extra_repr(self):
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
                f"track_running_stats={self.track_running_stats}")


# ---------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------


# The float dtypes of 16 bits, found once at import (torch.finfo per call costs ~0.5 us of host
# time): a constant set, never filled lazily, so that torch.compile's guards on it hold (a dict
# filled during tracing made a process's first compiled 16-bit call fail its own guard).
_SIXTEEN_BIT_FLOATS = frozenset(d for d in vars(torch).values()
                                if isinstance(d, torch.dtype) and d.is_floating_point and torch.finfo(d).bits == 16)


def _is_16bit_dtype(dtype):
    """True for the two 16-bit float dtypes."""
    return dtype in _SIXTEEN_BIT_FLOATS


def _runs_16bit_kernels(t):
    """t is what the 16-bit extension takes (a 16-bit CUDA tensor); 16-bit CPU tensors take
    the torch-op functions, whose statistics are the float32 path's (2, N)."""
    return t.is_cuda and t.dtype in _SIXTEEN_BIT_FLOATS


def _cuda_dtype_problem(dtype):
    """None when ModelNew runs CUDA tensors of `dtype`, else the error message:
    float32 (the fused kernels) and float64 (torch ops) always; the two 16-bit
    float dtypes with model_new_lowp.py beside this file and kernels/lowp/ (never
    in the self-contained files)."""
    if dtype in (torch.float32, torch.float64):
        return None
    sixteen = _is_16bit_dtype(dtype)
    if sixteen and _LOWP is not None and _LOWP.available():
        return None
    if sixteen and extra_missing("model_new_lowp") == "self-contained":
        return (f"ModelNew: 16-bit CUDA input ({dtype}) needs the repository's model_new_lowp.py and "
                f"kernels/lowp/ (the 16-bit kernels, compiled on first use), which this self-contained copy of "
                f"ModelNew leaves out. Use model_new.py from the repository for 16-bit input; here ModelNew "
                f"supports float32 on CUDA (the fused kernels), float64 on CUDA (plain torch ops) and any float "
                f"dtype on CPU")
    if sixteen:
        missing = extra_missing("model_new_lowp")
        if missing is None:  # the extra is here, its sources are not
            missing = os.path.join(_kernel_dir(), "lowp", getattr(_LOWP, "BINDING", "")) + " is missing"
        return (f"ModelNew: 16-bit CUDA input ({dtype}) needs the 16-bit kernels (model_new_lowp.py beside "
                f"model_new.py, kernels/lowp/ beside kernels/), and {missing}. Copy it from the repository; "
                f"float32 on CUDA (the fused kernels), float64 on CUDA (plain torch ops) and any float dtype on "
                f"CPU run without it")
    return (f"ModelNew on CUDA supports float32 (the fused kernels), float64 (plain torch ops) and the 16-bit "
            f"float dtypes (kernels/lowp/), got {dtype}")


def check_input(x, weight, training, cast=False):
    """Raises what PyTorch raises for an input the Linear -> BatchNorm1d chain
    cannot take (rank, feature count, device, dtype; a batch of 1 in training),
    before any buffer is touched; a 3-D input, which Model's BatchNorm1d
    normalizes over dim 1, raises RuntimeError.  cast: mixed precision casts x and
    the weight to one dtype, so their dtypes are not checked."""
    n, k = weight.shape
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"ModelNew expects a torch.Tensor, got {type(x).__name__}")
    dim = x.dim()
    if dim == 0:  # torch's own message (it names matmul up to torch 2.0, linear after)
        torch.ops.aten.linear(x, weight)
        raise RuntimeError("both arguments to linear need to be at least 1D, but they are 0D and 2D")
    if dim == 3:
        raise RuntimeError(f"ModelNew takes x of shape (batch, {k}), got {tuple(x.shape)}: on a 3D input "
                           f"BatchNorm1d would normalize over dim 1, which the fused kernels do not compute")
    if dim != 2:
        raise ValueError(f"expected 2D or 3D input (got {dim}D input)")
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
    if x.dtype != weight.dtype and not cast:
        raise RuntimeError(f"mat1 and mat2 must have the same dtype, but got {x.dtype} and {weight.dtype}")
    problem = _cuda_dtype_problem(x.dtype) if x.is_cuda and not cast else None
    if problem is not None:
        raise RuntimeError(problem)
    if training and x.shape[0] == 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size {torch.Size([x.shape[0], n])}"
        )


def per_feature_scale(scale, n, one_number=False):
    """The `scale` parameter as (N,), never a copy: itself when it is (N,); one
    element with at most 2 dims ((), (1,), (1, 1)) as a stride-0 view (the bindings
    materialize it, or read it in place), or (1, N) as an (N,) view; autograd sums
    its gradient back.  one_number: a scale of shape (1,) comes back as itself, for
    the 16-bit extension, which reads one number in place and sums its gradient
    (the view of a scale that requires gradients records an autograd node: 5-10 us
    of host time per call, docs/perf.md v47).
    Other shapes (per-row scales, 3 or more dims) raise RuntimeError before any
    buffer is touched."""
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"unsupported operand type(s) for *: 'Tensor' and '{type(scale).__name__}'")
    shape = scale.shape
    if len(shape) == 1:  # the common shapes, without a view's host time (~1-2 us)
        if shape[0] == n or (one_number and shape[0] == 1):
            return scale
        if shape[0] == 1:
            return scale.expand(n)
    per_feature = scale.dim() <= 2 and (scale.numel() == 1 or (scale.shape[-1] == n and scale.numel() == n))
    if not per_feature:
        raise RuntimeError(
            f"ModelNew supports a scale of one number or one per feature (shape (), (1,), (1, 1), ({n},) or "
            f"(1, {n})), got shape {tuple(scale.shape)}"
        )
    s = scale.reshape(-1)
    return s if s.shape == (n,) else s.expand(n)


_LinearCall = collections.namedtuple("_LinearCall", "weight bias in_features out_features")
_BatchNormCall = collections.namedtuple("_BatchNormCall", "training weight bias running_mean running_var "
                                                          "num_batches_tracked momentum eps")


_new_tuple = tuple.__new__
_LINEAR_FIELDS = ("weight", "bias")
_BATCH_NORM_FIELDS = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


def module_call(gemm, bn):
    """(gemm, bn) as one call sees them, as torch's Linear and BatchNorm1d read them:
    a None gemm.bias, bn.weight, bn.bias (affine=False) reads as zeros / ones /
    zeros; `training` is BatchNorm1d's bn_training (bn.training, or both running
    statistics None); buffers BatchNorm1d would not write (track_running_stats False, running
    statistics or num_batches_tracked None) are replaced by scratch tensors the kernels may write,
    whose contents reach no output (made per call).  Raises torch's exception
    (TypeError: gemm.weight None; ValueError / RuntimeError: one running statistic None) first."""
    weight, bias = module_fields(gemm, _LINEAR_FIELDS)
    bn_weight, bn_bias, mean, var, tracked = module_fields(bn, _BATCH_NORM_FIELDS)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"linear(): argument 'weight' must be Tensor, not {type(weight).__name__}")
    if (mean is None) != (var is None):
        if bn.training:
            raise ValueError("running_mean and running_var must either both be None or neither be None")
        raise RuntimeError(f"{'running_mean' if mean is None else 'running_var'} must be defined in evaluation mode")
    n, k = weight.shape
    training, momentum = bn.training, bn.momentum
    if mean is not None and bias is not None and bn_weight is not None and bn_bias is not None and not (
            training and (tracked is None or not bn.track_running_stats)):  # the common case: as they are
        # (tuple.__new__: the namedtuples without their Python __new__, ~0.3 us of host time a call)
        return (_new_tuple(_LinearCall, (weight, bias, k, n)),
                _new_tuple(_BatchNormCall, (training, bn_weight, bn_bias, mean, var, tracked, momentum, bn.eps)))
    like = next((t for t in (mean, bn_weight, bn_bias, bias) if t is not None), weight)
    filled = functools.partial(torch.full, (n,), dtype=like.dtype, device=like.device)
    tracking = training and bn.track_running_stats
    training = training or mean is None
    if training and not (tracking and mean is not None and (tracked is not None or momentum is not None)):
        mean, var = filled(0.0), filled(1.0)  # (momentum and num_batches_tracked None: BatchNorm1d's factor is 0)
    if training and not (tracking and tracked is not None):
        tracked = torch.zeros((), dtype=torch.long, device=weight.device)
    return (_LinearCall(weight, torch.zeros(n, dtype=weight.dtype, device=weight.device) if bias is None else bias,
                        weight.shape[1], n),
            _BatchNormCall(training, filled(1.0) if bn_weight is None else bn_weight,
                           filled(0.0) if bn_bias is None else bn_bias, mean, var, tracked, momentum, bn.eps))


# ---------------------------------------------------------------------------
# Dispatch: the one place that decides which kernels a call runs
# ---------------------------------------------------------------------------
#
# plan() turns (device, compute capability, dtype, training/eval, gradients
# needed, problem, shape, SWITCHES) into a Plan whose name says the path; the
# extensions carry out the GEMM kernel it names and pick nothing themselves.
# The routes are described once, in the README's support matrix, which
# tests/test_readme.py checks against plan().

Switches = collections.namedtuple("Switches", ["portable", "weight_cache", "sync_fused", "autocast_fused",
                                              "lowp_gemm", "eager_ops", "small_m"],
                                  defaults=(True, True, "auto", False, "auto"))
Switches.__doc__ = """What a user (portable, weight_cache and small_m, from the environment at
import) or a test (the rest: tests and tools replace SWITCHES) changes about the
routes; nothing reads the environment per call:
  portable       FUSED_GEMM_BN_PORTABLE=1: the portable sm80_3xtf32 kernel (and
                 lowp_sm80) on Hopper too
  weight_cache   False with FUSED_GEMM_BN_NO_WEIGHT_CACHE=1: gemm.weight's parts
                 are made in every call instead of kept (_weight_parts)
  sync_fused     False: synchronized BatchNorm on float32 CUDA runs its torch-op
                 path instead of the fused kernels (model_new_sync.py)
  autocast_fused False: under mixed precision ModelNew runs Model's own ops
                 instead of the fused 16-bit kernels (model_new_autocast.py)
  lowp_gemm      "auto", or the Hopper 16-bit route every shape takes (lowp_<name>;
                 "small_m" where it takes the call: model_new_lowp.hopper_gemm)
  eager_ops      True: eager calls go through the fused_gemm_bn:: operators,
                 as under torch.compile (tests run the operators' autograd)
  small_m        "auto": float32 batches of at most SMALL_M_MAX_ROWS rows take
                 small_m_fp64 on Hopper in place of sm90_fp16x3 (_small_m_gemm: the
                 forward's z and the backward's grad_W); True
                 (FUSED_GEMM_BN_SMALL_M=1): every float32 batch of at most
                 SMALL_M_MAX_ROWS rows on a full-rate FP64 GPU (the A100 too, not
                 measured there); False (FUSED_GEMM_BN_SMALL_M=0): never, so that every
                 batch size runs the same tensor-core kernel"""
SWITCHES = Switches(portable=os.environ.get("FUSED_GEMM_BN_PORTABLE") == "1",
                    weight_cache=os.environ.get("FUSED_GEMM_BN_NO_WEIGHT_CACHE") != "1",
                    small_m={"1": True, "0": False}.get(os.environ.get("FUSED_GEMM_BN_SMALL_M"), "auto"))

DeviceFacts = collections.namedtuple("DeviceFacts", ["capability", "num_sms", "sm90_gemm"])
DeviceFacts.__doc__ = """What the dispatch needs to know about a GPU (device_facts):
  capability  (major, minor)
  num_sms     streaming multiprocessors
  sm90_gemm   the Hopper kernels of this build run here (sm_90a image, compute
              capability 9.0, shared memory, tensor-map encoder)"""

Call = collections.namedtuple("Call", ["device_type", "dtype", "m", "n", "k", "training", "grad", "scale_after_bn"])
Call.__doc__ = """What dispatch() reads off a call: x's device type ("cuda", "cpu", ...)
and dtype; M, N, K; training (batch statistics); grad (gradients needed);
scale_after_bn (problem 84)."""

Plan = collections.namedtuple("Plan", ["name", "gemm", "kernels", "training", "grad", "mixed_dtype"],
                              defaults=(None,))
Plan.__doc__ = """A call's path, from dispatch() (or, under mixed precision, _plain_call's lane):
  name      <gemm>_<train|eval>[_grad]: what ModelNew.kernel_path returns
            (<gemm>_autocast_<train|eval>[_grad] under mixed precision)
  gemm      the GEMM kernel: sm90_fp16x3, sm80_3xtf32, small_m_fp64, lowp_sm90,
            lowp_cublas, lowp_small_m, lowp_sm80, torch_ops, or empty (batch of 0)
  kernels   who runs it: "ext" (the float32 extension), "lowp" (the 16-bit
            extension), "torch" (the _torch_* functions), or None (empty)
  training  batch statistics (True) or running statistics
  grad      gradients needed: the autograd path (saved tensors, backward)
  mixed_dtype  None, or the 16-bit dtype of mixed precision a float32 module's call runs
            in (the 16-bit extension's float32-vector form, model_new_autocast.run)"""

_DEVICE_FACTS = {}


def device_facts(device):
    """DeviceFacts of a CUDA device (torch.device or index), read once per
    device from torch and the extension's query (no kernel runs)."""
    facts = _DEVICE_FACTS.get(device)  # a CUDA tensor's get_device(), the per-call case
    if facts is not None:
        return facts
    index = device if isinstance(device, int) else torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if index not in _DEVICE_FACTS:
        props = torch.cuda.get_device_properties(index)
        _DEVICE_FACTS[index] = DeviceFacts(capability=(props.major, props.minor), num_sms=props.multi_processor_count,
                                           sm90_gemm=bool(_ext.sm90_gemm_available(index)))
    return _DEVICE_FACTS[index]


def _float32_gemm(facts, switches):
    """The GEMM kernel of a float32 product on a CUDA device (any M, N, K >= 1:
    sm90_fp16x3's prepass pads K to a multiple of 8, and the portable kernel
    takes any shape)."""
    if facts.capability < (8, 0):
        major, minor = facts.capability
        raise RuntimeError(f"ModelNew's float32 CUDA kernels need compute capability >= 8.0 (tensor-core TF32), "
                           f"got {major}.{minor}; use the module on the CPU or in float64")
    if not switches.portable and facts.capability == (9, 0) and facts.sm90_gemm:
        return "sm90_fp16x3"
    return "sm80_3xtf32"


# The small-batch route (kernels/small_m_fp64.cu): float32 forwards of a few rows read W once,
# with float64 products on the FP64 tensor cores (within 0.5 ulp of the correctly rounded z).
SMALL_M_MAX_ROWS = 16
# "auto" takes it on Hopper instead of sm90_fp16x3 at every shape up to SMALL_M_MAX_ROWS rows:
# faster at 1-12 rows everywhere measured and at 13-16 where N K >= 2^26 (H200, docs/perf.md
# v43: 0.51-0.99x sm90_fp16x3's time), and at 13-16 rows of narrow shapes (4095 x 513: 1.10-1.15x
# sm90_fp16x3's time there, still ahead of eager) the one route whose output error is at most half
# of eager's: sm90_fp16x3's measured up to 3.6x eager's there, where eager runs cuBLAS's
# gemmSN kernels (docs/perf.md v100, issue 50).
# GPUs with full-rate FP64 (the route's DMMA): A100 (8.0), H100 / H200 (9.0); sm_86 / sm_89 run
# FP64 at 1/64 of that and keep the tensor-core GEMM.
_FULL_RATE_FP64 = ((8, 0), (9, 0))


def _small_m_gemm(m, facts, switches, gemm):
    """Whether a float32 CUDA product of m rows (the forward's z, or the backward's
    grad_W) takes small_m_fp64 instead of `gemm` (the tensor-core kernel it would run):
    at most SMALL_M_MAX_ROWS rows, a full-rate FP64 GPU, and switches.small_m: True, or
    "auto" where gemm is sm90_fp16x3 (docs/perf.md v43, v58, v100).  Eval with gradients
    takes its gemm_nt for z (docs/perf.md v57)."""
    if not switches.small_m or m > SMALL_M_MAX_ROWS or facts.capability not in _FULL_RATE_FP64:
        return False
    return switches.small_m is True or gemm == "sm90_fp16x3"


def plan(call, facts=None, switches=None):
    """The Plan of `call` (a Call) on a GPU described by `facts` (DeviceFacts;
    needed for CUDA calls) under `switches` (default SWITCHES): the README's support matrix.
    Raises RuntimeError for CUDA input on a GPU below compute capability 8.0,
    and for 16-bit CUDA input without model_new_lowp.py.  Pure: tests give it
    simulated GPUs."""
    mode = ("train" if call.training else "eval") + ("_grad" if call.grad else "")
    if call.m == 0:
        return Plan(f"empty_{mode}", "empty", None, call.training, call.grad)
    if call.device_type != "cuda" or call.dtype == torch.float64:
        return Plan(f"torch_ops_{mode}", "torch_ops", "torch", call.training, call.grad)
    switches = SWITCHES if switches is None else switches
    if _is_16bit_dtype(call.dtype):
        problem = _cuda_dtype_problem(call.dtype)
        if problem is not None:
            raise RuntimeError(problem)
        gemm = _LOWP.route(call, facts, switches)
        return Plan(f"{gemm}_{mode}", gemm, "lowp", call.training, call.grad)
    gemm = _float32_gemm(facts, switches)
    if _small_m_gemm(call.m, facts, switches, gemm):
        gemm = "small_m_fp64"
    return Plan(f"{gemm}_{mode}", gemm, "ext", call.training, call.grad)


# dispatch's memo: plan() is pure in (call, facts, switches), and a call's host
# time matters at small sizes (docs/perf.md v32).  Cleared whole when full.
_PLANS = {}
_PLANS_MAX = 4096


def dispatch(x, weight, training, grad, scale_after_bn, facts=None, switches=None):
    """The Plan of a forward: x (M, K), weight (N, K); training: batch statistics;
    grad: gradients needed; scale_after_bn: problem 84.  Runs no kernel."""
    # (x.device costs ~0.5 us a call: a CUDA tensor's device index or a device type string instead)
    device = x.get_device() if x.is_cuda else x.device.type
    return _dispatch_memo(device, x.dtype, x.shape, weight.shape[0], training, grad, scale_after_bn, facts, switches)


def _dispatch_memo(device, dtype, shape, n, training, grad, scale_after_bn, facts=None, switches=None):
    """dispatch() from what it reads off x and weight: device, a CUDA device's index
    (int) or a device type string; dtype; shape, x's (M, K); n, N."""
    switches = SWITCHES if switches is None else switches
    # The memo's key holds what the Call and the facts are made of (a CUDA device's index stands for its
    # facts): building the Call and hashing it costs ~1 us of host time a call, made only on a miss.
    key = (device, dtype, shape, n, training, grad, scale_after_bn, facts, switches)
    made = _PLANS.get(key)
    if made is None:
        cuda = type(device) is int
        call = Call("cuda" if cuda else device, dtype, shape[0], n, shape[1], training, grad, scale_after_bn)
        made = _memo_put(key, plan(call, device_facts(device) if facts is None and cuda else facts, switches))
    return made


def _memo_put(key, made):
    """Puts a made Plan (or None: _mixed_plan) into dispatch's memo, which is cleared whole
    when full; returns it."""
    if len(_PLANS) >= _PLANS_MAX:
        _PLANS.clear()
    _PLANS[key] = made
    return made


def dispatch_gemm_nt(a, b, facts=None, switches=None):
    """The GEMM kernel of a @ b^T (the backward's products, eval with
    gradients; a (M, K), b (N, K), any strides), or "torch_ops" for CPU /
    float64 tensors."""
    if not a.is_cuda or a.dtype == torch.float64:
        return "torch_ops"
    return _float32_gemm(device_facts(a.device) if facts is None else facts, SWITCHES if switches is None else switches)


def dispatch_gemm_tn(a, b, facts=None, switches=None):
    """The GEMM kernel of a^T @ b (grad_W = grad_z^T x; a (M, N), b (M, K)): at most
    SMALL_M_MAX_ROWS rows on a full-rate FP64 GPU, small_m_fp64 (small_m_grad_w.cu: the
    FP64 tensor cores, float64 sums rounded once) where switches.small_m is True, or
    "auto" and the table's GEMM is sm90_fp16x3 (measured faster at every M <= 16 and
    every shape tried: docs/perf.md v58); else dispatch_gemm_nt's (on sm90_fp16x3 the
    binding reads both operands MN-major where N % 8 == 0 and K % 8 == 0, else copies
    them transposed)."""
    gemm = dispatch_gemm_nt(a, b, facts, switches)
    if gemm == "torch_ops" or a.shape[0] > SMALL_M_MAX_ROWS:
        return gemm
    facts = device_facts(a.device) if facts is None else facts
    switches = SWITCHES if switches is None else switches
    return "small_m_fp64" if _small_m_gemm(a.shape[0], facts, switches, gemm) else gemm


def _kernels(plan_kernels):
    """The namespace running a Plan: the float32 extension, the 16-bit one (built on first use), or torch ops."""
    if plan_kernels == "torch":
        return _TORCH_PATH
    if _ext is None:
        raise RuntimeError("ModelNew: CUDA tensor given but the extension was not built (no GPU at import)")
    return _LOWP.kernels() if plan_kernels == "lowp" else _ext


# ---------------------------------------------------------------------------
# Forward: carries out a Plan
# ---------------------------------------------------------------------------


def _checked_params(x, gemm, scale, bn, synchronized=False, one_number=False):
    """(x, gemm.weight, gemm.bias, scale (N,), bn.weight, bn.bias) after the input checks.  synchronized:
    statistics merged across processes, so one row is a valid share of the batch (checked after the gather).
    one_number: a scale of shape (1,) stays (1,) (per_feature_scale; _per_feature makes it (N,))."""
    check_input(x, gemm.weight, bn.training and not synchronized)
    return (x, gemm.weight, gemm.bias, per_feature_scale(scale, gemm.out_features, one_number), bn.weight, bn.bias)


def _per_feature(params, n):
    """params with a (1,) scale (_checked_params' one_number) viewed as (N,), for the routes that take N."""
    scale = params[3]
    return params if scale.shape[0] == n else params[:3] + (scale.expand(n),) + params[4:]


def _needs_grad(params):
    """Gradients needed: grad mode on and one of the six tensors requires them (unrolled: ~0.4 us less)."""
    x, weight, bias, scale, bn_weight, bn_bias = params
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad
                                        or scale.requires_grad or bn_weight.requires_grad or bn_bias.requires_grad)


def sync_process_group(bn):
    """The process group whose batches a training call with `bn` normalises as
    one batch (model_new_sync.process_group), or None: this process's batch
    alone, and always without model_new_sync.py (the self-contained files)."""
    return None if _SYNC is None else _SYNC.process_group(bn)


def _distributed_world_size(group=None):
    """Processes in `group` (None: the default group) when torch.distributed runs, else 1."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group or dist.group.WORLD)


_UNSYNCHRONIZED_WARNED = False


def _warn_unsynchronized(bn):
    """Without model_new_sync.py (the self-contained files; the forwards call it only then):
    once per process, a training call under torch.distributed with more than one process warns
    that this copy keeps per-process batch statistics (SyncBatchNorm conversion cannot see its
    BatchNormState)."""
    global _UNSYNCHRONIZED_WARNED
    if _UNSYNCHRONIZED_WARNED or not bn.training:
        return
    world = _distributed_world_size()
    if world <= 1:
        return
    _UNSYNCHRONIZED_WARNED = True
    missing = extra_missing("model_new_sync")
    which = ("this self-contained copy leaves out model_new_sync.py" if missing == "self-contained"
             else f"synchronized BatchNorm needs model_new_sync.py beside model_new.py, and {missing}")
    warnings.warn(f"ModelNew: torch.distributed runs {world} processes, but this copy keeps per-process batch "
                  f"statistics ({which}): SyncBatchNorm conversion cannot see its BatchNorm. For synchronized "
                  f"BatchNorm use the repository's model_new.py with its model_new_sync.py (docs/multi-gpu.md).",
                  UserWarning, stacklevel=3)


def fused_forward(x, gemm, scale, bn, scale_after_bn):
    """The forward of both problems: x (M, K); gemm and bn the parameter
    containers (LinearParams, BatchNormState), read as torch's Linear and BatchNorm1d
    read theirs (module_call: batch or running statistics, optional state);
    scale the parameter (per_feature_scale's shapes); scale_after_bn selects
    problem 84.  Checks the input first (nothing is touched on an error);
    returns out (M, N) in x's dtype.  The path, first match: mixed precision on
    for x (model_new_autocast.py); SyncBatchNorm over several processes
    (model_new_sync.py); torch.compile or torch.jit.trace recording, or
    SWITCHES.eager_ops: the fused_gemm_bn:: operators (_ops_forward, which make
    dispatch()'s decision when they run, so a traced module generalises over the
    batch size); else dispatch()'s Plan: 16-bit model_new_lowp.forward; no
    gradient one forward_train / forward_eval call; training with gradients
    _TrainFn; eval with gradients _EvalFn.  Under torch.jit.trace the
    checks run once, at trace time, by design (their TracerWarnings are
    silenced); it raises RuntimeError where this torch has no custom operators (< 2.4)."""
    if not torch.jit.is_tracing():
        return _fused_forward(x, gemm, scale, bn, scale_after_bn, False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return _fused_forward(x, gemm, scale, bn, scale_after_bn, True)


def _fused_forward(x, gemm, scale, bn, scale_after_bn, tracing):
    group = sync_process_group(bn)
    gemm, bn = module_call(gemm, bn)
    autocast_dtype = None if _AUTOCAST is None else _AUTOCAST.autocast_dtype(x)
    if autocast_dtype is not None:
        _AUTOCAST.check(x, gemm, scale, bn, group)
        return _AUTOCAST.forward(x, gemm, scale, bn, scale_after_bn, autocast_dtype)
    # (a scale of shape (1,) stays (1,) until a route needs (N,): the 16-bit extension reads it in place)
    params = _checked_params(x, gemm, scale, bn, synchronized=group is not None, one_number=True)
    n = gemm.out_features
    training = bn.training
    momentum = -1.0 if bn.momentum is None else float(bn.momentum)  # < 0: cumulative average
    eps = float(bn.eps)
    buffers = (bn.running_mean, bn.running_var, bn.num_batches_tracked)
    grad = _needs_grad(params)
    if tracing:  # one graph for both grad modes (the trace check re-records under no_grad)
        grad = any(t.requires_grad for t in params)
    if tracing and _OPS is None:
        raise RuntimeError("torch.jit.trace of ModelNew needs the fused_gemm_bn:: custom operators (torch >= 2.4): "
                           "its kernels are extension calls the tracer cannot record; use torch.compile")
    if group is not None:
        return _SYNC.forward(group, _per_feature(params, n), buffers, momentum, eps, scale_after_bn)
    if _SYNC is None:
        _warn_unsynchronized(bn)
    if x.shape[0] == 0:  # as BatchNorm1d: empty output, the call counted, running statistics untouched
        if training:
            bn.num_batches_tracked.add_(1)  # (a scratch tensor where BatchNorm1d would not count: module_call)
        return x.new_empty((0, n))
    if _use_ops(tracing):
        return _ops_forward(_per_feature(params, n), buffers, momentum, eps, training, grad, scale_after_bn)
    plan = dispatch(x, gemm.weight, training, grad, scale_after_bn)
    return _run_plan(plan, params, buffers, momentum, eps, scale_after_bn)


def _run_plan(plan, params, buffers, momentum, eps, scale_after_bn):
    """The kernels of a checked call (fused_forward, _plain_call): plan from dispatch();
    params (x, gemm.weight, gemm.bias, scale ((N,) or (1,)), bn.weight, bn.bias);
    buffers (running_mean, running_var, num_batches_tracked); momentum (< 0: cumulative
    average) and eps as floats.  Returns out (M, N)."""
    if plan.mixed_dtype is not None:
        return _AUTOCAST.run(plan.gemm, plan.mixed_dtype, plan.training, plan.grad, params, buffers, momentum, eps,
                             scale_after_bn)
    if plan.kernels == "lowp":
        return _LOWP.forward(plan, params, buffers, momentum, eps, scale_after_bn)
    params = _per_feature(params, params[1].shape[0])
    kernels = _kernels(plan.kernels)
    if plan.training and plan.grad:
        return _TrainFn.apply(kernels, plan.gemm, scale_after_bn, buffers, momentum, eps, *params)
    if plan.grad:
        return _EvalFn.apply(kernels, plan.gemm, scale_after_bn, eps, *params, *buffers[:2])
    return _forward_call(kernels, plan.gemm, scale_after_bn, plan.training, buffers, momentum, eps, params)


_MISSING = object()


def _plain_call(module, x):
    """fused_forward's decision for the common call of a FusedModule, in fewer host steps
    (~3 us of Python against ~9 on the development CPU; a synchronized call waits for
    it before its first launch): (plan, params, buffers, momentum, eps, scale_after_bn)
    for _run_plan, or None where fused_forward must decide (and raise).  The common
    call: x a plain CUDA tensor (M, K) of float32 or a 16-bit dtype that runs here,
    gemm.weight's dtype and device, M >= 1 (>= 2 in training); module.gemm a
    LinearParams and module.bn a BatchNormState (not a SyncBatchNorm), every tensor
    present (bias, affine, running statistics; in training num_batches_tracked and
    track_running_stats True); scale a parameter of shape (N,) or (1,); no tracing,
    compiling or SWITCHES.eager_ops.  It reads what module_call and _checked_params read,
    and accepts only calls they let through unchanged, so both paths give the same plan
    and tensors.  Under mixed precision (on for x's device) the common
    call is a float32 module's with x float32 or 16-bit, taken where
    model_new_autocast's fused route runs it (the Plan's mixed_dtype: _mixed_plan).
    Nothing is written."""
    if type(x) is not torch.Tensor or not x.is_cuda or torch.jit.is_tracing() or _use_ops():
        return None
    mixed = None if _AUTOCAST is None else _AUTOCAST.autocast_dtype(x)
    if mixed is not None and _is_compiling():  # (Model's ops are what torch.compile records)
        return None
    if not _plain_fields(type(module), _FUSED_MODULE_FIELDS):
        return None
    d = module.__dict__
    modules, parameters = d.get("_modules"), d.get("_parameters")
    if not (isinstance(modules, dict) and isinstance(parameters, dict)):  # (OrderedDict in torch 2.0)
        return None
    gemm, bn, scale = modules.get("gemm"), modules.get("bn"), parameters.get("scale")
    if type(gemm) is not LinearParams or type(bn) is not BatchNormState or scale is None:
        return None
    linear = gemm.__dict__["_parameters"]
    weight, bias = linear.get("weight"), linear.get("bias")
    b = bn.__dict__
    bn_weight, bn_bias = b["_parameters"].get("weight"), b["_parameters"].get("bias")
    mean, var, tracked = (b["_buffers"].get("running_mean"), b["_buffers"].get("running_var"),
                          b["_buffers"].get("num_batches_tracked"))
    training, momentum, eps = b.get("training"), b.get("momentum", _MISSING), b.get("eps", _MISSING)
    if (weight is None or bias is None or bn_weight is None or bn_bias is None or mean is None or var is None
            or type(training) is not bool or momentum is _MISSING or eps is _MISSING
            or (training and (tracked is None or b.get("track_running_stats") is not True))):
        return None
    shape, w_shape, s_shape = x.shape, weight.shape, scale.shape
    if len(shape) != 2 or len(w_shape) != 2 or len(s_shape) != 1:
        return None
    m, k = shape
    n = w_shape[0]
    dtype, device = x.dtype, x.get_device()
    if (k != w_shape[1] or m < (2 if training else 1) or (s_shape[0] != n and s_shape[0] != 1)
            or device != weight.get_device()):
        return None
    params = (x, weight, bias, scale, bn_weight, bn_bias)
    if mixed is not None:  # model_new_autocast.fused_gemm's conditions on the tensors, then its route
        f32 = torch.float32
        if (dtype not in _AUTOCAST.X_DTYPES or weight.dtype is not f32 or bias.dtype is not f32
                or scale.dtype is not f32 or bn_weight.dtype is not f32 or bn_bias.dtype is not f32
                or mean.dtype is not f32 or var.dtype is not f32):
            return None
        plan = _mixed_plan(device, mixed, shape, n, training, _needs_grad(params))
        if plan is None:
            return None
    else:
        if (dtype is not weight.dtype
                or (dtype is not torch.float32 and (dtype is torch.float64 or _cuda_dtype_problem(dtype) is not None))):
            return None  # (float64 takes the torch-op route by fused_forward)
        if _SYNC is None:
            _warn_unsynchronized(bn)
        plan = _dispatch_memo(device, dtype, shape, n, training, _needs_grad(params), module.scale_after_bn)
    return (plan, params, (mean, var, tracked), -1.0 if momentum is None else float(momentum), float(eps),
            module.scale_after_bn)


def _mixed_plan(device, dtype, shape, n, training, grad):
    """The lane's Plan of a float32 module's call under mixed precision in `dtype` (_plain_call,
    which has checked the call's tensors as model_new_autocast.fused_gemm does) on the
    GPU of index `device`, x of `shape` (M, K), N = n: the fused route's Plan, named as
    kernel_path names it, or None where Model's ops run the call (fused_forward's general
    path).  Memoized in dispatch's memo under its own keys."""
    switches = SWITCHES
    key = ("mixed", device, dtype, shape, n, training, grad, switches)
    made = _PLANS.get(key, _MISSING)
    if made is _MISSING:
        gemm = _AUTOCAST.route(dtype, training, grad, device_facts(device), switches, shape[0], n, shape[1])
        made = _memo_put(key, None if gemm is None else Plan(_AUTOCAST.plan_name(gemm, training, grad), gemm, "lowp",
                                                             training, grad, dtype))
    return made


def kernel_path(x, gemm, scale, bn, scale_after_bn):
    """The Plan name fused_forward(x, ...) would take now (same arguments), from the same checks
    and dispatch() alone: nothing is updated.  Under mixed precision or synchronized BatchNorm,
    the extra's path_name, e.g. "lowp_sm90_autocast_eval" or "torch_ops_sync_train_grad"."""
    group = sync_process_group(bn)
    gemm, bn = module_call(gemm, bn)
    if _AUTOCAST is not None and _AUTOCAST.autocast_dtype(x) is not None:
        _AUTOCAST.check(x, gemm, scale, bn, group)
        params = (x, gemm.weight, gemm.bias, scale, bn.weight, bn.bias)
        return _AUTOCAST.path_name(x, gemm, scale, bn, _needs_grad(params))
    params = _checked_params(x, gemm, scale, bn, synchronized=group is not None)
    if group is not None:
        return _SYNC.path_name(x, gemm.weight, _needs_grad(params))
    return dispatch(x, gemm.weight, bn.training, _needs_grad(params), scale_after_bn).name


def _forward_call(kernels, gemm, scale_after_bn, training, buffers, momentum, eps, params):
    """The one extension call of a forward without gradients: forward_train (updates the buffers) or forward_eval."""
    extra = _weight_args(kernels, gemm, params[1])
    if training:
        return kernels.forward_train(gemm, *params, *buffers, momentum, eps, scale_after_bn, *extra)
    return kernels.forward_eval(gemm, *params, *buffers[:2], eps, scale_after_bn, *extra)


def _ops_forward(params, buffers, momentum, eps, training, grad, scale_after_bn):
    """fused_forward through the fused_gemm_bn:: operators (what torch.compile,
    torch.jit.trace and torch.export record).  The training operators return
    updated copies of the running statistics, copied back into the buffers here."""
    if training:
        if grad:
            out, _, _, *new_buffers = _OPS.forward_train_saved(*params, *buffers, momentum, eps, scale_after_bn)
        else:
            out, *new_buffers = _OPS.forward_train(*params, *buffers, momentum, eps, scale_after_bn)
        with torch.no_grad():
            for buffer, new in zip(buffers, new_buffers):
                buffer.copy_(new)
        return out
    if grad and params[0].is_cuda and _is_16bit_dtype(params[0].dtype):
        return _OPS.forward_eval_saved(*params, *buffers[:2], eps, scale_after_bn)[0]
    if grad:
        return _eval_with_grad(_OPS.gemm_nt, _OPS.softmax_rows if scale_after_bn else None, *params,
                               *buffers[:2], eps)
    return _OPS.forward_eval(*params, *buffers[:2], eps, scale_after_bn)


# ---------------------------------------------------------------------------
# Weight cache
# ---------------------------------------------------------------------------


# Entries keyed by id(weight) (checked through a weak reference that drops the
# entry with the weight), valid while kind, data pointer, version counter,
# shape, strides, device and stream match; the entry holds the weight's storage.
_WeightPartsEntry = collections.namedtuple("_WeightPartsEntry", ["ref", "key", "storage", "parts"])
_WEIGHT_PARTS = {}


def _weight_parts(weight, split=None, kind="fp16x3", make=True):
    """What the GEMM precomputes from gemm.weight, made on the first call and
    reused while the weight is unchanged.  kind "fp16x3": sm90_fp16x3's parts
    (fp16x3_weight_parts: about the size of the weight); "row_sums":
    sm80_3xtf32's centring sums (2 N floats); "cast_<dtype>": the weight cast
    for mixed precision (`split` given by model_new_autocast).
    None when the call must make them itself: caching off
    (SWITCHES.weight_cache), a CUDA graph being captured, work on a stream other
    than the device's default one (torch.compile's CUDA graphs, mode
    "reduce-overhead", warm a graph up on their own stream with its allocations
    in the graphs' memory pool: parts kept from there stay allocated in that
    pool, and the graph's recording then fails), or an inference-mode weight (no
    version counter).  Seen as changes: the weight's version counter
    (in-place ops, copy_, load_state_dict), every torch.optim step()
    (_drop_stepped_weights: fused optimizers keep the counter) and `.data`
    assignment.  Not seen: writes through `weight.data` outside an optimizer
    step; call clear_weight_cache() after those.  With make=False a missing or
    stale entry gives None; with make="reused" too, but the weight is noted,
    and a later call that finds it unchanged makes the parts."""
    if not SWITCHES.weight_cache or not _WEIGHT_CACHE_SAFE or weight.is_inference():
        return None
    if weight.is_cuda and (torch.cuda.is_current_stream_capturing() or not _on_default_stream(weight.get_device())):
        return None
    key = (kind, weight.data_ptr(), weight._version, tuple(weight.shape), weight.stride(), weight.device)
    wid = id(weight)
    entry = _WEIGHT_PARTS.get(wid)
    seen = entry is not None and entry.ref() is weight and entry.key == key
    if seen and (entry.parts is not None or not make):
        return entry.parts
    _WEIGHT_PARTS.pop(wid, None)  # the old parts go before the new ones are made
    if not make:
        return None

    def drop(ref, wid=wid):
        current = _WEIGHT_PARTS.get(wid)
        if current is not None and current.ref is ref:
            del _WEIGHT_PARTS[wid]

    if split is None:
        split = _ext.fp16x3_weight_parts if kind == "fp16x3" else _ext.weight_row_sums
    parts = None if make == "reused" and not seen else split(weight)
    _WEIGHT_PARTS[wid] = _WeightPartsEntry(weakref.ref(weight, drop), key, weight.untyped_storage(), parts)
    return parts


# The current and the default stream of a CUDA device as (stream id, device index, device type), by the
# functions torch.cuda.current_stream / default_stream call (every torch since 1.x; absent from CPU-only
# builds): compared as tuples, without the Stream objects and device parsing (8.6-9.1 against 0.6 us of host
# time a check on an H200 host, in every float32 and mixed-precision forward: docs/perf.md v96).
_STREAM_IDS = (getattr(torch._C, "_cuda_getCurrentStream", None), getattr(torch._C, "_cuda_getDefaultStream", None))


def _on_default_stream(device_index):
    """Work on CUDA device `device_index` goes to its default stream now."""
    current, default = _STREAM_IDS
    if current is None or default is None:
        return torch.cuda.current_stream(device_index) == torch.cuda.default_stream(device_index)
    return current(device_index) == default(device_index)


def _drop_stepped_weights(optimizer, args, kwargs):
    """Global optimizer step post-hook: drops the cached parts of every parameter
    the optimizer holds (fused optimizers leave the version counter unchanged)."""
    if not _WEIGHT_PARTS:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = _WEIGHT_PARTS.get(id(p))
            if entry is not None and entry.ref() is p:
                del _WEIGHT_PARTS[id(p)]


# Where this torch has no global optimizer hooks, nothing is cached.
_WEIGHT_CACHE_SAFE = hasattr(torch_optimizer, "register_optimizer_step_post_hook")
if _WEIGHT_CACHE_SAFE:
    torch_optimizer.register_optimizer_step_post_hook(_drop_stepped_weights)


def clear_weight_cache():
    """Drops everything cached from weights (_weight_parts), freeing its memory
    (up to one weight's size per cached weight); the next call makes it again."""
    _WEIGHT_PARTS.clear()


def _weight_args(kernels, gemm, weight):
    """The float32 forwards' last argument: gemm.weight's cached parts (fp16x3 or
    row sums; None: the extension makes them); nothing for the other namespaces."""
    if kernels is not _ext:
        return ()
    if gemm == "small_m_fp64":  # reads gemm.weight itself
        return (None,)
    return (_weight_parts(weight, kind="fp16x3" if gemm == "sm90_fp16x3" else "row_sums"),)


# ---------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------


def _fp16x3_parts(gemm, b):
    """The cached fp16x3 parts of b (N, K) (gemm.weight: _weight_parts) for a
    product on `gemm` that reads them, else None (the extension then splits b
    itself where it needs to)."""
    if gemm == "sm90_fp16x3" and b.shape[0] > 0:
        return _weight_parts(b)
    return None


def _gemm_nt(a, b):
    """a @ b^T (eval with gradients: x weight^T), on the kernel dispatch_gemm_nt
    picks, with b's cached fp16x3 parts on sm90_fp16x3."""
    gemm = dispatch_gemm_nt(a, b)
    return _kernels("torch" if gemm == "torch_ops" else "ext").gemm_nt(gemm, a, b, _fp16x3_parts(gemm, b))


def _gemm_nn(a, b):
    """a (M, N) @ b (N, K) for the backward (grad_x = grad_z W), on the kernel
    dispatch_gemm_nt picks for a @ (b^T)^T.  On sm90_fp16x3 the extension reads
    b's fp16x3 parts MN-major: gemm.weight's, kept from the forward (_weight_parts)."""
    gemm = dispatch_gemm_nt(a, b.t())
    return _kernels("torch" if gemm == "torch_ops" else "ext").gemm_nn(gemm, a, b, _fp16x3_parts(gemm, b))


def _gemm_tn(a, b):
    """a (M, N)^T @ b (M, K) for the backward (grad_W = grad_z^T x), on the
    kernel dispatch_gemm_tn picks."""
    gemm = dispatch_gemm_tn(a, b)
    return _kernels("torch" if gemm == "torch_ops" else "ext").gemm_tn(gemm, a, b)


def _bn_backward_train(grad_y, z, stats, scale, bn_weight, eps, scale_after_bn, bn_bias=None):
    """The extension's bn_backward_train (float32 CUDA) or _torch_bn_backward_train."""
    kernels = _kernels("ext" if z.is_cuda and z.dtype == torch.float32 else "torch")
    return kernels.bn_backward_train(grad_y, z, stats, scale, bn_weight, eps, scale_after_bn, bn_bias)


# What eager backward passes call (torch.compile's graphs call _OPS, same names).
_EAGER_BACKWARD = types.SimpleNamespace(gemm_nt=_gemm_nt, gemm_nn=_gemm_nn, gemm_tn=_gemm_tn,
                                        bn_backward_train=_bn_backward_train)


def _train_backward(ops, scale_after_bn, eps, grad_out, x, weight, scale, bn_weight, bn_bias, z, stats, out, needs):
    """Gradients of the training forward with respect to (x, gemm.weight,
    gemm.bias, scale, bn.weight, bn.bias), from the saved z (M, N), stats (2, N)
    and, for problem 84, out (M, N); `ops` is _EAGER_BACKWARD or the custom-op
    namespace _OPS; `needs` says which of the six are wanted (others None).
      problem 84: grad_v = out * (grad_out - sum_n grad_out * out)   (row softmax backward)
      grad_z, grad_scale, grad_bn_weight, grad_bn_bias = bn_backward_train(grad_v, z, stats, ...)
        (problem 84's grad_scale holds bn_bias * sum_m grad_v: bn_bias is given)
      grad_x = grad_z weight = gemm_nn(grad_z, weight)               (M, K)
      grad_weight = grad_z^T x = gemm_tn(grad_z, x)                  (N, K)
      grad_bias = 0 exactly: BatchNorm subtracts the batch mean, which holds the bias."""
    need_x, need_w, need_b, need_s, need_g, need_beta = needs
    grad_b = z.new_zeros(z.shape[1]) if need_b else None
    if not (need_x or need_w or need_s or need_g or need_beta):
        return (None, None, grad_b, None, None, None)
    grad_y = _softmax_rows_backward(out, grad_out) if scale_after_bn else grad_out.contiguous()
    grad_z, grad_s, grad_g, grad_beta = ops.bn_backward_train(grad_y, z, stats, scale, bn_weight, eps, scale_after_bn,
                                                              bn_bias if scale_after_bn else None)
    grad_x = ops.gemm_nn(grad_z, weight) if need_x else None
    grad_w = ops.gemm_tn(grad_z, x) if need_w else None
    return (grad_x, grad_w, grad_b, grad_s if need_s else None, grad_g if need_g else None,
            grad_beta if need_beta else None)


def _gemm_nt_backward(ops, grad, a, b, needs):
    """out = a b^T: grad_a = grad b = gemm_nn(grad, b), grad_b = grad^T a = gemm_tn(grad, a)."""
    return (ops.gemm_nn(grad, b) if needs[0] else None,
            ops.gemm_tn(grad, a) if needs[1] else None)


class _TrainFn(torch.autograd.Function):
    """Training forward with gradients, eager: one forward_train_saved call (which
    updates the running statistics).  Saved: x, gemm.weight, scale, bn.weight
    (no copies), z (M, N), stats (2, N), and for problem 84 bn.bias and out."""

    @staticmethod
    def forward(ctx, kernels, gemm, scale_after_bn, buffers, momentum, eps, x, weight, bias, scale, bn_weight,
                bn_bias):
        out, z, stats = kernels.forward_train_saved(gemm, x, weight, bias, scale, bn_weight, bn_bias, *buffers,
                                                    momentum, eps, scale_after_bn,
                                                    *_weight_args(kernels, gemm, weight))
        ctx.scale_after_bn, ctx.eps = scale_after_bn, eps
        ctx.save_for_backward(x, weight, scale, bn_weight, bn_bias if scale_after_bn else None, z, stats,
                              out if scale_after_bn else None)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        grads = _train_backward(_EAGER_BACKWARD, ctx.scale_after_bn, ctx.eps, grad_out, *ctx.saved_tensors,
                                ctx.needs_input_grad[6:])
        return (None,) * 6 + tuple(grads)


class _EvalFn(torch.autograd.Function):
    """Eval forward with gradients (BatchNorm frozen), eager: one forward_eval_saved
    call (z = x gemm.weight^T on the plan's GEMM, out from z with the running
    statistics' fold).  Saved: x, gemm.weight, gemm.bias, scale, bn.weight, bn.bias,
    running_mean, running_var (no copies: changing the running statistics in place
    before the backward raises, as for BatchNorm1d), z, and for problem 84 out."""

    @staticmethod
    def forward(ctx, kernels, gemm, scale_after_bn, eps, x, weight, bias, scale, bn_weight, bn_bias, running_mean,
                running_var):
        out, z = kernels.forward_eval_saved(gemm, x, weight, bias, scale, bn_weight, bn_bias, running_mean,
                                            running_var, eps, scale_after_bn, *_weight_args(kernels, gemm, weight))
        ctx.kernels, ctx.scale_after_bn, ctx.eps = kernels, scale_after_bn, eps
        ctx.save_for_backward(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, z,
                              out if scale_after_bn else None)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        grads = _eval_backward(ctx.kernels, ctx.scale_after_bn, ctx.eps, grad_out, *ctx.saved_tensors,
                               ctx.needs_input_grad[4:10])
        return (None,) * 4 + tuple(grads) + (None, None)


def _eval_backward(kernels, scale_after_bn, eps, grad_out, x, weight, bias, scale, bn_weight, bn_bias, running_mean,
                   running_var, z, out, needs):
    """Gradients of _EvalFn's forward with respect to (x, gemm.weight, gemm.bias,
    scale, bn.weight, bn.bias), `kernels` the forward's namespace (_ext or _TORCH_PATH);
    `needs` says which are wanted (others None):
      problem 84: grad_v = out * (grad_out - sum_n grad_out * out)   (row softmax backward)
      grad_z, grad_bias, grad_scale, grad_bn_weight, grad_bn_bias = bn_backward_eval(grad_y, z, ...)
      grad_x = grad_z weight = gemm_nn(grad_z, weight),  grad_weight = grad_z^T x = gemm_tn(grad_z, x)"""
    need_x, need_w, need_b, need_s, need_g, need_beta = needs
    if not any(needs):
        return (None,) * 6
    grad_y = _softmax_rows_backward(out, grad_out) if scale_after_bn else grad_out.contiguous()
    grad_z, grad_b, grad_s, grad_g, grad_beta = kernels.bn_backward_eval(
        grad_y, z, bias, scale, bn_weight, bn_bias, running_mean, running_var, eps, scale_after_bn)
    return (_gemm_nn(grad_z, weight) if need_x else None, _gemm_tn(grad_z, x) if need_w else None,
            grad_b if need_b else None, grad_s if need_s else None, grad_g if need_g else None,
            grad_beta if need_beta else None)


class _GemmNT(torch.autograd.Function):
    """z = a b^T (a (M, K), b (N, K)) by kernels.gemm_nt.  Saved: a, b (no copies).  Backward: _gemm_nt_backward."""

    @staticmethod
    def forward(ctx, kernels, gemm, a, b):
        ctx.save_for_backward(a, b)
        return kernels.gemm_nt(gemm, a, b, _fp16x3_parts(gemm, b))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        return (None, None) + _gemm_nt_backward(_EAGER_BACKWARD, grad, *ctx.saved_tensors, ctx.needs_input_grad[2:])


def _softmax_rows(v):
    """exp(v - max v) / sum exp(v - max v) along dim 1 of v (M, N), a new tensor
    (the row softmax of problem 84, spelled in elementwise ops and reductions)."""
    e = (v - v.amax(dim=1, keepdim=True)).exp()
    return e.div_(e.sum(dim=1, keepdim=True))


def _softmax_rows_backward(out, grad_out):
    """Row softmax backward: grad_v = out * (grad_out - sum_n grad_out * out); one extension
    kernel for plain float32 CUDA tensors (eager), torch ops otherwise (compile's traced ones)."""
    if type(out) is torch.Tensor and type(grad_out) is torch.Tensor and out.is_cuda and _ext is not None \
            and out.dtype == grad_out.dtype == torch.float32 and out.dim() == 2:
        return _ext.softmax_rows_backward(out, grad_out)
    return out * (grad_out - (grad_out * out).sum(dim=1, keepdim=True))


class _SoftmaxRows(torch.autograd.Function):
    """out = _softmax_rows(v), v (M, N).  Saved: out.  Backward:
    _softmax_rows_backward.  Eager only: under torch.compile (torch 2.11, CUDA)
    this Function's gradients all came out zero, so compiled graphs take the
    fused_gemm_bn::softmax_rows operator, which has the same backward."""

    @staticmethod
    def forward(ctx, v):
        out = _softmax_rows(v)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        (out,) = ctx.saved_tensors
        return _softmax_rows_backward(out, grad_out)


def _eval_with_grad(gemm_nt, softmax_rows, x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, eps):
    """Eval forward with gradients in operators: z = gemm_nt(x, weight) (differentiable),
    then the fold in elementwise ops (g = bn.weight / sqrt(running_var + eps)),
    whose autograd gives the fold's gradients:
      problem 33: out = z (scale g) + bn.bias + (scale gemm.bias - running_mean) g
      problem 84: out = softmax_rows((z + gemm.bias - running_mean) (scale g) + scale bn.bias)
    What torch.compile's graphs run (_ops_forward); eager calls take _EvalFn."""
    g = bn_weight / torch.sqrt(running_var + eps)
    z = gemm_nt(x, weight)
    if softmax_rows is not None:
        return softmax_rows((z + (bias - running_mean)) * (scale * g) + scale * bn_bias)
    return z * (scale * g) + (bn_bias + (scale * bias - running_mean) * g)


# ---------------------------------------------------------------------------
# Custom operators (torch >= 2.4): what torch.compile traces
# ---------------------------------------------------------------------------
#
# Every operator is functional (register_autograd refuses operators that mutate an input): the
# training operators run the kernels on copies of the running statistics and return them; the module
# copies them back.  forward_train_saved, forward_eval_saved, gemm_nt and softmax_rows have gradients;
# the others refuse inputs that require grad.  Each makes dispatch()'s decision for its real tensors.

_OP_NAMESPACE_BASE = "fused_gemm_bn"


def _engine_identity():
    """SHA-256 over what the operators' implementations run: the kernel sources (the
    16-bit extra's, kernels/lowp/, too: a copy given another kernels/ folder may
    differ there alone), the extras' files, and this file's text where it has one;
    executed from a self-contained file's text, the SHA-256 of its engine text that
    tools/bundle.py wrote (its extras are not there).  Two copies with the same
    identity run the same code, so they may share operators (_OP_NAMESPACE)."""
    h = hashlib.sha256()
    texts = dict(_KERNEL_SOURCES)
    if _LOWP is not None:  # the files its bind reads, below, from the same folder
        lowp_sources = extension_sources(_LOWP.SUBDIR, _LOWP.BINDING) or {}
        texts.update({_LOWP.SUBDIR + "/" + name: text for name, text in lowp_sources.items()})
    own = _own_file()
    if own is None:
        texts["<engine text's SHA-256>"] = _EMBEDDED_ENGINE_SHA256 or ""
    else:
        for path in [own] + [os.path.join(os.path.dirname(own), name + ".py") for name in _EXTRAS]:
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    texts[os.path.basename(path)] = f.read().decode("utf-8")
    for name, text in sorted(texts.items()):
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()


_OP_SCHEMAS = {
    "gemm_nt": "(Tensor a, Tensor b) -> Tensor",
    "gemm_nn": "(Tensor a, Tensor b) -> Tensor",
    "gemm_tn": "(Tensor a, Tensor b) -> Tensor",
    "softmax_rows": "(Tensor v) -> Tensor",
    "bn_backward_train": "(Tensor grad_y, Tensor z, Tensor stats, Tensor scale, Tensor bn_weight, float eps, "
                         "bool scale_after_bn, Tensor? bn_bias=None) -> (Tensor, Tensor, Tensor, Tensor)",
    "forward_train": "(Tensor x, Tensor weight, Tensor bias, Tensor scale, Tensor bn_weight, Tensor bn_bias, "
                     "Tensor running_mean, Tensor running_var, Tensor num_batches_tracked, float momentum, "
                     "float eps, bool scale_after_bn) -> (Tensor, Tensor, Tensor, Tensor)",
    "forward_train_saved": "(Tensor x, Tensor weight, Tensor bias, Tensor scale, Tensor bn_weight, Tensor bn_bias, "
                           "Tensor running_mean, Tensor running_var, Tensor num_batches_tracked, float momentum, "
                           "float eps, bool scale_after_bn) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    "forward_eval": "(Tensor x, Tensor weight, Tensor bias, Tensor scale, Tensor bn_weight, Tensor bn_bias, "
                    "Tensor running_mean, Tensor running_var, float eps, bool scale_after_bn) -> Tensor",
}


def _op_bn_backward_train(grad_y, z, stats, scale, bn_weight, eps, scale_after_bn, bn_bias=None):
    """The extension's bn_backward_train (contract: _torch_bn_backward_train), as a
    tuple: float32 and float64 z, and 16-bit CPU z (torch ops).  16-bit CUDA z is refused
    (its backward is model_new_lowp's backward_16bit operator, from the 16-bit coeff)."""
    if _runs_16bit_kernels(z):
        raise RuntimeError(f"{_OP_NAMESPACE}::bn_backward_train takes float32 or float64 CUDA tensors, got {z.dtype}: "
                           f"a 16-bit CUDA forward_train_saved's backward is {_OP_NAMESPACE}::backward_16bit")
    return tuple(_bn_backward_train(grad_y, z, stats, scale, bn_weight, eps, scale_after_bn, bn_bias))


def _op_forward_train(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, num_batches_tracked,
                      momentum, eps, scale_after_bn, saved=False):
    """(out, running_mean', running_var', num_batches_tracked'): the plan's
    forward_train run on copies of the buffers, which it returns updated;
    saved: forward_train_saved's (out, z, stats, the three buffers).  Refuses
    what the module refuses (a batch of fewer than 2 rows) before touching anything."""
    if x.shape[0] < 2:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size "
                         f"{torch.Size([x.shape[0], weight.shape[0]])}")
    plan = dispatch(x, weight, True, saved, scale_after_bn)
    buffers = (running_mean.clone(), running_var.clone(), num_batches_tracked.clone())
    kernels = _kernels(plan.kernels)
    run = kernels.forward_train_saved if saved else kernels.forward_train
    out = run(plan.gemm, x, weight, bias, scale, bn_weight, bn_bias, *buffers, momentum, eps, scale_after_bn,
              *_weight_args(kernels, plan.gemm, weight))
    return (*out, *buffers) if saved else (out, *buffers)


def _op_forward_eval(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, eps, scale_after_bn):
    """forward_eval: out (M, N); an empty batch gives an empty output, as the module's."""
    plan = dispatch(x, weight, False, False, scale_after_bn)
    if plan.kernels is None:
        return x.new_empty((0, weight.shape[0]))
    kernels = _kernels(plan.kernels)
    return kernels.forward_eval(plan.gemm, x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, eps,
                                scale_after_bn, *_weight_args(kernels, plan.gemm, weight))


def _fake_bn_backward_train(grad_y, z, stats, scale, bn_weight, eps, scale_after_bn, bn_bias=None):
    n = z.shape[1]
    return grad_y.new_empty(z.shape), grad_y.new_empty(n), grad_y.new_empty(n), grad_y.new_empty(n)


def _fake_forward_train(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, num_batches_tracked,
                        momentum, eps, scale_after_bn, saved=False):
    m, n = x.shape[0], weight.shape[0]
    buffers = (torch.empty_like(running_mean), torch.empty_like(running_var), torch.empty_like(num_batches_tracked))
    if not saved:
        return (x.new_empty((m, n)), *buffers)
    # 16-bit CUDA x: the 16-bit extension's (out, z, coeff (4, N) float32, model_new_lowp)
    stats = x.new_empty((4, n), dtype=torch.float32) if _runs_16bit_kernels(x) else x.new_empty((2, n))
    return (x.new_empty((m, n)), x.new_empty((m, n)), stats, *buffers)


def _setup_gemm_nt(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward_gemm_nt(ctx, grad):
    return _gemm_nt_backward(_OPS, grad, *ctx.saved_tensors, ctx.needs_input_grad)


def _setup_softmax_rows(ctx, inputs, output):
    ctx.save_for_backward(output)


def _backward_softmax_rows(ctx, grad):
    (out,) = ctx.saved_tensors
    return _softmax_rows_backward(out, grad)


def _setup_forward_train_saved(ctx, inputs, output):
    """Saves what _TrainFn saves (16-bit CUDA x: what model_new_lowp's forward_grad node saves,
    its backward the backward_16bit operator); z, stats and the buffer copies are not differentiable."""
    x, weight, _, scale, bn_weight, bn_bias = inputs[:6]
    eps, scale_after_bn = inputs[10], inputs[11]
    out, z, stats = output[:3]
    ctx.mark_non_differentiable(*output[1:])
    ctx.scale_after_bn, ctx.eps = scale_after_bn, eps
    ctx.lowp = _runs_16bit_kernels(z)
    if ctx.lowp:
        return _LOWP.setup_forward_train_saved(ctx, inputs, output)
    ctx.save_for_backward(x, weight, scale, bn_weight, bn_bias if scale_after_bn else None, z, stats,
                          out if scale_after_bn else None)


def _no_autograd(name):
    """setup_context for an operator without gradients: runs when an input
    requires grad with grad mode on, after the (functional) operator, and
    raises, so the call fails clearly and leaves the caller's tensors as they were."""
    def setup_context(ctx, inputs, output):
        raise RuntimeError(
            f"{_OP_NAMESPACE}::{name} has no autograd formula, and an input requires grad: call it under "
            f"torch.no_grad(), or use the differentiable operators (forward_train_saved, gemm_nt) as ModelNew does"
        )
    return setup_context


def _refused_backward(ctx, *grads):
    raise RuntimeError("fused_gemm_bn: this operator has no autograd formula")


def _backward_forward_train_saved(ctx, grad_out, *unused):
    if ctx.lowp:
        return tuple(_LOWP.backward_forward_train_saved(ctx, grad_out)) + (None,) * 6
    grads = _train_backward(_OPS, ctx.scale_after_bn, ctx.eps, grad_out, *ctx.saved_tensors,
                            ctx.needs_input_grad[:6])
    return tuple(grads) + (None,) * 6


def _define_ops():
    """Registers <_OP_NAMESPACE>::{gemm_nt, gemm_nn, gemm_tn, softmax_rows,
    bn_backward_train, forward_train, forward_train_saved, forward_eval}
    (_OP_SCHEMAS), and with model_new_lowp.py its forward_eval_saved and
    backward_16bit, once per process, with one implementation for every
    device (dispatch() picks the extension or the _torch_* functions;
    softmax_rows is torch ops on both), fake implementations, autograd for
    gemm_nt, softmax_rows, forward_train_saved and forward_eval_saved, and a
    call-time refusal of inputs that require grad for the others.  An operator
    already registered (by a copy of the same identity: _OP_NAMESPACE) is
    reused.  Returns torch.ops.<_OP_NAMESPACE>."""
    namespace = getattr(torch.ops, _OP_NAMESPACE)
    schemas = dict(_OP_SCHEMAS, **({} if _LOWP is None else _LOWP.SCHEMAS))
    impls = {"gemm_nt": (_gemm_nt, lambda a, b: a.new_empty((a.shape[0], b.shape[0])),
                         (_backward_gemm_nt, _setup_gemm_nt)),
             "gemm_nn": (_gemm_nn, lambda a, b: a.new_empty((a.shape[0], b.shape[1])), None),
             "gemm_tn": (_gemm_tn, lambda a, b: a.new_empty((a.shape[1], b.shape[1])), None),
             "softmax_rows": (lambda v: _softmax_rows(v).contiguous(), lambda v: v.new_empty(v.shape),
                              (_backward_softmax_rows, _setup_softmax_rows)),
             "bn_backward_train": (_op_bn_backward_train, _fake_bn_backward_train, None),
             "forward_train": (_op_forward_train, _fake_forward_train, None),
             "forward_train_saved": (functools.partial(_op_forward_train, saved=True),
                                     functools.partial(_fake_forward_train, saved=True),
                                     (_backward_forward_train_saved, _setup_forward_train_saved)),
             "forward_eval": (_op_forward_eval, lambda x, weight, *args: x.new_empty((x.shape[0], weight.shape[0])),
                              None),
             **({} if _LOWP is None else _LOWP.OPERATORS)}
    for name, (impl, fake, autograd) in impls.items():
        if hasattr(namespace, name):
            continue
        op = torch.library.custom_op(f"{_OP_NAMESPACE}::{name}", impl, mutates_args=(), schema=schemas[name])
        op.register_fake(fake)
        backward, setup_context = autograd if autograd is not None else (_refused_backward, _no_autograd(name))
        op.register_autograd(backward, setup_context=setup_context)
    return namespace


# The operators' namespace, "fused_gemm_bn_" and the first 16 hex digits of the engine's identity:
# custom operators are process-wide, and torch.compile's caches on disk key a graph by its operators'
# names, so a copy that runs other code (another version, other extras) must not reuse, nor replace,
# another copy's operators, and a graph cached by one version must not be served to another (its
# backward is traced from the operators' Python; tests/test_vendoring.py).  Copies of one identity
# (a harness executing the text again, both problems' files) share one namespace.  torch.ops.<it>,
# or None where this torch has no torch.library.custom_op (< 2.4).
_OP_NAMESPACE = f"{_OP_NAMESPACE_BASE}_{_engine_identity()[:16]}"
_OPS = _define_ops() if hasattr(torch.library, "custom_op") else None


# torch.compiler.is_compiling from torch 2.3 on; before, torch._dynamo's (only once
# something imported torch._dynamo: nothing compiles before that).
_IS_COMPILING = getattr(getattr(torch, "compiler", None), "is_compiling", None)


def _is_compiling():
    if _IS_COMPILING is not None:
        return _IS_COMPILING()
    dynamo = sys.modules.get("torch._dynamo")
    return dynamo is not None and dynamo.is_compiling()


def _tracing():
    """torch.compile (dynamo) or torch.jit.trace is recording this call."""
    return _is_compiling() or torch.jit.is_tracing()


def _use_ops(tracing=False):
    """The call goes through the fused_gemm_bn:: operators (tracing: torch.jit.trace records it)."""
    return _OPS is not None and (tracing or SWITCHES.eager_ops or _is_compiling())


# ---------------------------------------------------------------------------
# Torch-op path: the extension's functions in plain PyTorch, same names and
# arguments (CPU tensors, float64 on CUDA, and the 16-bit gradient recompute)
# ---------------------------------------------------------------------------

_TORCH_STATS_BLOCK_M = 128  # rows per partial-statistics tile, as the GEMM's BLOCK_M


def _torch_batch_stats(z):
    """Per-feature mean and biased/unbiased variance of z (M, N), from per-tile
    mean / M2 merged with Chan's pairwise formula in float64 (bn_apply.cu merges the
    GEMM's tiles the same way)."""
    count = mean = m2 = None
    for tile in z.split(_TORCH_STATS_BLOCK_M):
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


def _torch_gemm_nt(gemm, a, b, b_parts=None):
    """a (M, K) @ b (N, K)^T -> (M, N), contiguous, in a's dtype; any strides
    (gemm: the dispatch's name, "torch_ops"; b_parts: the extension's argument, unused)."""
    return (a @ b.t()).contiguous()


def _torch_gemm_nn(gemm, a, b, b_parts=None):
    """a (M, N) @ b (N, K) -> (M, K), contiguous, in a's dtype; any strides (b_parts unused)."""
    return (a @ b).contiguous()


def _torch_gemm_tn(gemm, a, b):
    """a (M, N)^T @ b (M, K) -> (N, K), contiguous, in a's dtype; any strides."""
    return (a.t() @ b).contiguous()


def _torch_forward_train_saved(gemm, x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var,
                               num_batches_tracked, momentum, eps, scale_after_bn):
    """The training forward of either problem: [out (M, N), z = x weight^T (M, N),
    stats (2, N): batch mean and biased variance of z], updating the running
    statistics in place as the extension does (num_batches_tracked += 1, then
    the momentum or cumulative-average update with the unbiased variance of the
    BatchNorm input).  Statistics in float64 (per tile, Chan-merged)."""
    z = x @ weight.t()
    mean, var_biased, var_unbiased = _torch_batch_stats(z)
    num_batches_tracked.add_(1)
    factor = momentum if momentum >= 0 else 1.0 / float(num_batches_tracked)
    s = scale.double()
    if scale_after_bn:  # BatchNorm sees z + bias; scale multiplies its output
        a = s * bn_weight.double() / torch.sqrt(var_biased + eps)
        new_mean = (1.0 - factor) * running_mean.double() + factor * (mean + bias.double())
        new_var = (1.0 - factor) * running_var.double() + factor * var_unbiased
        out = _softmax_rows((z - mean.to(z.dtype)) * a.to(z.dtype) + scale * bn_bias)
    else:  # BatchNorm sees scale * (z + bias)
        a = s * bn_weight.double() / torch.sqrt(s * s * var_biased + eps)
        new_mean = (1.0 - factor) * running_mean.double() + factor * s * (mean + bias.double())
        new_var = (1.0 - factor) * running_var.double() + factor * s * s * var_unbiased
        out = (z - mean.to(z.dtype)) * a.to(z.dtype) + bn_bias
    with torch.no_grad():
        running_mean.copy_(new_mean)
        running_var.copy_(new_var)
    return [out, z.contiguous(), torch.stack((mean, var_biased)).to(z.dtype)]


def _torch_forward_train(gemm, x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var,
                         num_batches_tracked, momentum, eps, scale_after_bn):
    """out (M, N) of _torch_forward_train_saved."""
    return _torch_forward_train_saved(gemm, x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var,
                                      num_batches_tracked, momentum, eps, scale_after_bn)[0]


def _torch_forward_eval(gemm, x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, eps,
                        scale_after_bn):
    """With g = bn_weight / sqrt(running_var + eps) and z = x weight^T:
    problem 33: out = a z + c, a = scale g, c = bn_bias + (scale bias - running_mean) g;
    problem 84: softmax((z + bias - running_mean) scale g + scale bn_bias) per row."""
    return _torch_forward_eval_saved(gemm, x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var,
                                     eps, scale_after_bn)[0]


def _torch_forward_eval_saved(gemm, x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, eps,
                              scale_after_bn):
    """[out, z]: _torch_forward_eval's out and z = x weight^T (the extension's forward_eval_saved)."""
    z = x @ weight.t()
    g = bn_weight / torch.sqrt(running_var + eps)
    if scale_after_bn:
        return [_softmax_rows((z + (bias - running_mean)) * (scale * g) + scale * bn_bias), z]
    return [z * (scale * g) + (bn_bias + (scale * bias - running_mean) * g), z]


def _torch_bn_backward_eval(grad_y, z, bias, scale, bn_weight, bn_bias, running_mean, running_var, eps,
                            scale_after_bn):
    """Eval-mode BatchNorm backward, the contract of the extension's bn_backward_eval
    (kernels/bn_backward.cu has the algebra): grad_y = dL/dy (problem 33) or dL/dv
    (problem 84), z (M, N); per-feature sums and coefficients in float64.  Returns
    [grad_z (M, N), grad_bias, grad_scale, grad_bn_weight, grad_bn_bias (N)] in grad_y's dtype."""
    dt = grad_y.dtype
    s, gamma, b, mu = scale.double(), bn_weight.double(), bias.double(), running_mean.double()
    sigma = torch.sqrt(running_var.double() + eps)
    a = s * gamma / sigma
    g = grad_y.double()
    sum_g = g.sum(0)
    sum_gz = (g * (z.double() - ((mu - b) if scale_after_bn else -b))).sum(0)
    if scale_after_bn:
        grad_scale = gamma / sigma * sum_gz + bn_bias.double() * sum_g
        grad_gamma, grad_beta = s * sum_gz / sigma, s * sum_g
    else:
        grad_scale = gamma / sigma * sum_gz
        grad_gamma, grad_beta = (s * sum_gz - mu * sum_g) / sigma, sum_g
    return [(g * a).to(dt), (a * sum_g).to(dt), grad_scale.to(dt), grad_gamma.to(dt), grad_beta.to(dt)]


def _torch_bn_backward_train(grad_y, z, stats, scale, bn_weight, eps, scale_after_bn, bn_bias=None):
    """Training-mode BatchNorm backward with batch statistics, the contract of the
    extension's bn_backward_train.  grad_y, z (M, N); stats (2, N) = (mu, var),
    biased (z and mu enter only as z - mu: small_m_fp64's forward saves them centred);
    scale, bn_weight (N).  Returns [grad_z (M, N), grad_scale, grad_bn_weight,
    grad_bn_bias (N)] in grad_y's dtype; per-feature sums in float64.
    With d = z - mu, S_g = sum_m grad_y, S_gd = sum_m grad_y d:
      scale_after_bn False (problem 33), y = a d + bn_bias, r = 1 / sqrt(scale^2 var + eps),
        a = scale bn_weight r:
        grad_z = a (grad_y - S_g / M) - scale^3 bn_weight r^3 S_gd d / M
        grad_scale = bn_weight eps r^3 S_gd,  grad_bn_weight = scale r S_gd,  grad_bn_bias = S_g
      scale_after_bn True (problem 84), y = scale (bn_weight d r + bn_bias), r = 1 / sqrt(var + eps):
        grad_z = a (grad_y - S_g / M) - scale bn_weight r^3 S_gd d / M
        grad_scale = bn_weight r S_gd + bn_bias S_g   (the last term only where bn_bias is given)
        grad_bn_weight = scale r S_gd,  grad_bn_bias = scale S_g."""
    m = z.shape[0]
    mean, var = stats[0], stats[1].double()
    d = z - mean
    sum_g = grad_y.sum(0, dtype=torch.float64)
    sum_gd = (grad_y * d).sum(0, dtype=torch.float64)
    s, gamma = scale.double(), bn_weight.double()
    if scale_after_bn:
        r = torch.rsqrt(var + eps)
        grad_scale = gamma * r * sum_gd + (0.0 if bn_bias is None else bn_bias.double() * sum_g)
        grad_beta = s * sum_g
        coeff_d = s * gamma * r ** 3 * sum_gd / m
    else:
        r = torch.rsqrt(s * s * var + eps)
        grad_scale = gamma * eps * r ** 3 * sum_gd
        grad_beta = sum_g
        coeff_d = s ** 3 * gamma * r ** 3 * sum_gd / m
    a = s * gamma * r
    dt = grad_y.dtype
    # float64 per element, grad_z rounded once (as the kernel; docs/perf.md v24)
    grad_z = (grad_y.double() * a - a * sum_g / m - (z.double() - stats[0].double()) * coeff_d).to(dt)
    return [grad_z, grad_scale.to(dt), (s * r * sum_gd).to(dt), grad_beta.to(dt)]


# The torch-op stand-in for `_ext`: the extension's functions by the same names and arguments.
_TORCH_PATH = types.SimpleNamespace(
    forward_train=_torch_forward_train, forward_eval=_torch_forward_eval,
    forward_train_saved=_torch_forward_train_saved, forward_eval_saved=_torch_forward_eval_saved,
    gemm_nt=_torch_gemm_nt, gemm_nn=_torch_gemm_nn, gemm_tn=_torch_gemm_tn, bn_backward_train=_torch_bn_backward_train,
    bn_backward_eval=_torch_bn_backward_eval)


# ---------------------------------------------------------------------------
# Module behaviour shared by both problems' ModelNew
# ---------------------------------------------------------------------------


_FUSED_MODULE_FIELDS = ("gemm", "scale", "bn")


class FusedModule(nn.Module):
    """The module behaviour both problems' ModelNew share.  A subclass creates
    `gemm` (LinearParams), `scale` and `bn` (BatchNormState) and sets
    `scale_after_bn` (False: problem 33; True: problem 84)."""

    scale_after_bn = False

    def forward(self, x):
        call = _plain_call(self, x)
        if call is not None:
            return _run_plan(*call)
        return fused_forward(x, *module_fields(self, _FUSED_MODULE_FIELDS), self.scale_after_bn)

    def kernel_path(self, x):
        """The path forward(x) would take now, e.g. "sm90_fp16x3_train" (see
        dispatch's table), without running a kernel or touching a buffer."""
        return kernel_path(x, *module_fields(self, _FUSED_MODULE_FIELDS), self.scale_after_bn)

    def __prepare_scriptable__(self):
        raise RuntimeError("torch.jit.script does not support ModelNew (its forward calls CUDA extension functions "
                           "and custom operators TorchScript cannot compile); use torch.compile, torch.export, or "
                           "torch.jit.trace (torch >= 2.4), which generalises over the batch size")


# ---------------------------------------------------------------------------
# The face the extras see: everything model_new_sync.py, model_new_lowp.py and
# model_new_autocast.py use of the core, handed to each one's bind()
# ---------------------------------------------------------------------------


def _current_switches():
    return SWITCHES  # read per call: tests and tools replace SWITCHES


Engine = collections.namedtuple("Engine", [
    "extension_sources", "load_extension", "extension", "kernels", "ops", "switches", "device_facts",
    "dispatch", "dispatch_gemm_nt", "check_input", "per_feature_scale", "needs_grad", "tracing", "is_16bit_dtype",
    "forward_call", "weight_parts", "weight_args", "train_backward", "eager_backward", "softmax_rows",
    "softmax_rows_backward", "world_size", "lowp"])
Engine.__doc__ = """The core's face to its extras (docs/design.md, "The core and its
extras"), one ENGINE per copy of the core, handed to each extra's bind().
Build:
  extension_sources(subdir, binding)  {file: text} of kernels/<subdir>/ and the headers it includes, or None
  load_extension(sources, functions, prefix)  compile / load an extension (content-hashed build folder)
  extension          the float32 extension (None without a GPU at import)
  kernels(where)     "ext" | "lowp" | "torch": the namespace that runs a Plan
  ops                torch.ops.<this copy's operator namespace>, or None (torch < 2.4)
Decisions:
  switches()         the current SWITCHES
  device_facts(device), dispatch(x, weight, training, grad, scale_after_bn), dispatch_gemm_nt(a, b)
  check_input(x, weight, training, cast), per_feature_scale(scale, n, one_number): the checks, as in fused_forward
  needs_grad(params), tracing(), is_16bit_dtype(dtype)
Forward:
  forward_call(kernels, gemm, scale_after_bn, training, buffers, momentum, eps, params)
                     one forward_train / forward_eval call (no gradients)
  weight_parts(weight, split, kind, make), weight_args(kernels, gemm, weight): the weight cache
Backward:
  train_backward(ops, scale_after_bn, eps, grad_out, x, weight, scale, bn_weight, bn_bias, z, stats, out, needs)
  eager_backward     the namespace (gemm_nn, gemm_tn, bn_backward_train) eager backwards run
  softmax_rows(v), softmax_rows_backward(out, grad_out)
Other extras:
  world_size(group)  processes in a torch.distributed group (1 without one)
  lowp               the bound 16-bit extra (model_new_lowp), or None"""

ENGINE = Engine(
    extension_sources=extension_sources, load_extension=_load_extension, extension=_ext, kernels=_kernels,
    ops=_OPS, switches=_current_switches, device_facts=device_facts, dispatch=dispatch,
    dispatch_gemm_nt=dispatch_gemm_nt, check_input=check_input, per_feature_scale=per_feature_scale,
    needs_grad=_needs_grad, tracing=_tracing, is_16bit_dtype=_is_16bit_dtype, forward_call=_forward_call,
    weight_parts=_weight_parts, weight_args=_weight_args, train_backward=_train_backward,
    eager_backward=_EAGER_BACKWARD, softmax_rows=_softmax_rows, softmax_rows_backward=_softmax_rows_backward,
    world_size=_distributed_world_size, lowp=_LOWP)

for _module in (_SYNC, _LOWP, _AUTOCAST):
    if _module is not None:
        _module.bind(ENGINE)


# ===========================================================================
# Problem 33: ModelNew and the KernelBench interface.  Everything above is the
# shared engine (problem 84's module imports it; tools/bundle.py copies the
# text above this banner into problem 84's self-contained file).
# ===========================================================================


class ModelNew(FusedModule):
    """Linear(in_features, out_features) -> * scale -> BatchNorm1d(out_features, eps, momentum).

    Same constructor, parameter and buffer names, random draws and train/eval
    behaviour as `reference.Model` (FusedModule.forward: fused_forward).
    x (M, in_features): float32 on CUDA (compute capability >= 8.0), float64 on
    CUDA, 16-bit float on CUDA (model_new_lowp.py) or any float dtype on CPU,
    matching the parameters; returns (M, out_features).  Differentiable in both
    modes; gemm.bias gets an exact zero gradient in training.  `scale` may have
    any per-feature shape ((), (1,), (1, 1), (N,), (1, N)).  M == 0 gives an
    empty output, as BatchNorm1d.  Raises what Model raises for a batch of one
    row in training, a wrong rank, feature count, dtype or device, and
    RuntimeError for a scale that is not per-feature; a rejected call leaves
    every buffer unchanged.  gemm.bias, bn.weight, bn.bias may be None and
    bn.track_running_stats False, as in Model (module_call)."""

    def __init__(self, in_features, out_features, scale_shape, eps=1e-5, momentum=0.1):
        super().__init__()
        self.gemm = LinearParams(in_features, out_features)
        self.scale = nn.Parameter(torch.randn(scale_shape))
        self.bn = BatchNormState(out_features, eps=eps, momentum=momentum)


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
