"""torch.autocast for ModelNew (model_new.py loads this module when it lies
beside it; the self-contained files have none, and under autocast they run
the float32 kernels).

Inside torch.autocast (CUDA or CPU) Model's nn.Linear runs in the autocast
dtype and the ops after it follow torch's type promotion.  On Hopper ModelNew
runs that function on the 16-bit extension's kernels in their autocast form
(lowp_sm90; eval at a few rows without gradients lowp_small_m, eval with gradients
lowp_cublas; fused_gemm decides; kernels/lowp/binding_16bit.cpp): x cast to the
autocast dtype as autocast casts it, gemm.weight's cast kept between calls
(model_new._weight_parts), the GEMM in that dtype, everything after it in float32
with Model's rounding points, out float32.  Otherwise it calls Model's own ops in
Model's order (_model_forward), so its outputs, running statistics and gradients
are Model's.

Entry points (model_new.py calls them): bind(engine), autocast_dtype(x), check(x,
gemm, scale, bn, group), forward(x, gemm, scale, bn, scale_after_bn, dtype),
path_name(x, gemm, scale, bn, grad); and for the core's common-call lane
(model_new._plain_call) X_DTYPES, route(dtype, training, grad, facts, switches, m, n, k),
plan_name(route, training, grad) and run(route, dtype, training, grad, params, buffers,
momentum, eps, scale_after_bn);
fused_gemm(...) is the decision, for tests.
This module imports nothing of the core: the core that loads it hands it its
face (model_new.Engine, whose `lowp` is the 16-bit extra) through bind().
"""
import torch
import torch.nn.functional as F

engine = None  # the core's face (model_new.Engine), set by bind()


def bind(core_engine):
    """Called once by the core that loaded this module, with its face."""
    global engine
    engine = core_engine


_GET_AUTOCAST_DTYPE = hasattr(torch, "get_autocast_dtype")
# Whether autocast is on for any device type: one call where the checks below take ~0.7 us of host time
# per forward (torch 2.0 through 2.13 have it; where a torch lacks it, the checks run).
_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None)


# The dtypes of x the fused routes take (autocast casts them to its dtype).
X_DTYPES = frozenset((torch.float32, torch.float16, torch.bfloat16))


def autocast_dtype(x):
    """The autocast dtype of x's device type when torch.autocast is on there and
    would cast x (a floating tensor other than float64), else None."""
    if _ANY_AUTOCAST is not None and not _ANY_AUTOCAST():
        return None
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype == torch.float64:
        return None
    device = "cuda" if x.is_cuda else "cpu" if x.is_cpu else None  # (x.device costs ~0.5 us a call)
    if device is None:
        return None
    if _GET_AUTOCAST_DTYPE:  # torch >= 2.4
        return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    if device == "cuda":
        return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None
    return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None


def fused_gemm(x, gemm, scale, bn, dtype, grad=False, facts=None, switches=None):
    """The 16-bit route that runs this autocast call, or None (Model's ops run it):
    "lowp_sm90" in training (bn.training; with gradients
    model_new_lowp.forward_autocast_grad, the fused forward and backward); in eval
    without gradients "lowp_small_m" at a few rows, else "lowp_sm90" (route()), with
    gradients "lowp_cublas" (cuBLAS's product, then the chain kernel that also keeps z
    and the running statistics' coefficients for the fused eval backward: lowp_sm90's
    kEvalSaved epilogue has no float32-vector form).  Each needs a CUDA batch of at
    least one row, the autocast dtype float16 or bfloat16, x float32 or 16-bit (cast as
    autocast casts it), every parameter and running
    statistic float32 (the module Model's autocast is made for), the 16-bit
    kernels present (model_new_lowp), not SWITCHES.autocast_fused off,
    dispatch's conditions for lowp_sm90 (compute capability 9.0, the sm_90a
    image, not SWITCHES.portable), and not under torch.compile or
    torch.jit.trace (Model's ops are what those record).  Runs no kernel."""
    switches = engine.switches() if switches is None else switches
    if engine.tracing():  # the extension calls cannot be recorded; Model's ops can (fullgraph=True works)
        return None
    if not x.is_cuda or x.shape[0] == 0 or x.dtype not in X_DTYPES:
        return None
    tensors = (gemm.weight, gemm.bias, scale, bn.weight, bn.bias, bn.running_mean, bn.running_var)
    if any(t is None or t.dtype != torch.float32 for t in tensors):
        return None
    m, k = x.shape
    return route(dtype, bn.training, grad, engine.device_facts(x.get_device()) if facts is None else facts,
                 switches, m, gemm.weight.shape[0], k)


def route(dtype, training, grad, facts, switches, m, n, k):
    """fused_gemm's decision once the call itself qualifies (x, the module's tensors,
    not tracing): the route, or None.  Also the core's common-call lane's
    (model_new._plain_call, which checks the rest as fused_gemm does).  Pure in its
    arguments: facts (DeviceFacts of x's GPU), switches (SWITCHES), the product's
    M, N, K.  Eval without gradients: lowp_small_m where the 16-bit modules' rule takes it
    (model_new_lowp.hopper_gemm: 1-32 rows, K % 8 == 0; docs/perf.md v109, H200, 8192 x
    8192: 0.67-0.81x lowp_sm90's time back to back, 0.82-0.98x synchronized per call),
    else lowp_sm90 (where that rule takes lowp_cublas, its autocast form, with the bias
    cast and cuBLAS's host path, took 0.79-0.97x lowp_sm90's time back to back but
    1.16-1.37x synchronized at 64-128 rows, v109).  Training: lowp_sm90, whose kernel
    rounds a float32 weight as it loads it where the weight changed since the last call
    (a product-first route casts it first: 1.5-1.7x the call's time at 16-64 x 8192 x
    8192, v109), so a call's bits do not depend on whether the cast was cached.  Eval
    with gradients: lowp_cublas."""
    if (dtype not in (torch.float16, torch.bfloat16) or not switches.autocast_fused or engine.lowp is None
            or not engine.lowp.available()):
        return None
    if switches.portable or facts.capability != (9, 0) or not facts.sm90_gemm:
        return None
    if training:
        return "lowp_sm90"
    if grad:
        return "lowp_cublas"
    small_m = engine.lowp.hopper_gemm(m, n, k, training, facts, switches) == "lowp_small_m"
    return "lowp_small_m" if small_m else "lowp_sm90"


def plan_name(route_name, training, grad):
    """The name of an autocast call's path, as kernel_path gives it:
    <route>_autocast_<train|eval>[_grad] on a fused route (lowp_sm90, or
    lowp_cublas for eval with gradients), torch_ops_autocast_<train|eval>[_grad]
    where route_name is None (Model's ops).  Also the core's lane's Plan name."""
    return ((route_name or "torch_ops") + "_autocast_" + ("train" if training else "eval")
            + ("_grad" if grad else ""))


def path_name(x, gemm, scale, bn, grad):
    """kernel_path's name under autocast (plan_name of fused_gemm's route)."""
    return plan_name(fused_gemm(x, gemm, scale, bn, autocast_dtype(x), grad), bn.training, grad)


def _model_forward(x, gemm, scale, bn, scale_after_bn):
    """Model's forward under autocast, op for op: nn.Linear's F.linear (in the
    autocast dtype), `* scale` (torch's type promotion: a float32 scale of one
    or more dims makes the product float32), BatchNorm1d's F.batch_norm with its
    num_batches_tracked / momentum handling (bn.training decides, as in
    Model), and problem 84's softmax over dim 1 (float32 under autocast).
    Returns what Model returns, in its dtype; autograd differentiates the ops."""
    v = F.linear(x, gemm.weight, gemm.bias)
    factor = 0.0
    if bn.training:
        bn.num_batches_tracked.add_(1)
        factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum

    def batch_norm(u):
        return F.batch_norm(u, bn.running_mean, bn.running_var, bn.weight, bn.bias, bn.training, factor, bn.eps)

    if not scale_after_bn:
        return batch_norm(v * scale)
    return torch.softmax(scale * batch_norm(v), dim=1)


def _fused_forward(x, gemm, scale, bn, scale_after_bn, dtype, route, grad=False):
    """The fused autocast forward of the general path (forward): run()'s arguments read off
    the module's containers."""
    momentum = -1.0 if bn.momentum is None else float(bn.momentum)  # < 0: cumulative average
    buffers = (bn.running_mean, bn.running_var, bn.num_batches_tracked)
    scale = engine.per_feature_scale(scale, gemm.out_features, one_number=True)  # (1,): read in place
    params = (x, gemm.weight, gemm.bias, scale, bn.weight, bn.bias)
    return run(route, dtype, bn.training, grad, params, buffers, momentum, float(bn.eps), scale_after_bn)


def run(route, dtype, training, grad, params, buffers, momentum, eps, scale_after_bn):
    """The fused autocast forward on fused_gemm's `route` in `dtype`, for forward() and
    the core's common-call lane (model_new._plain_call, _run_plan): params (x, gemm.weight,
    gemm.bias, scale ((N,) or (1,)), bn.weight, bn.bias), x float32 or 16-bit, the rest
    float32; buffers (running_mean, running_var, num_batches_tracked); momentum (< 0:
    cumulative average) and eps as floats; training: batch statistics; grad: gradients
    needed.  Returns out (M, N) float32.
    Without gradients: x cast to dtype (autocast's cast of F.linear's input; no copy when
    x already is), then one extension call.  The GEMM's weight operand is
    gemm.weight's cast to dtype from the weight cache (_weight_parts, kind
    model_new_lowp.CAST_KIND[dtype]):
      - in eval the cast is made and cached at once where the cache holds none for the
        current weight; where nothing can be cached (a CUDA graph being captured, a
        side stream, the cache switched off) the call takes the float32 gemm.weight:
        lowp_small_m (the product first) casts it in the extension, as autocast casts
        it, and lowp_sm90 rounds it as below.  The same 16-bit operand either way, so
        the same bits;
      - lowp_sm90 in training takes the float32 gemm.weight itself where the cache holds
        no cast, and the kernel rounds it to dtype as it loads each tile (the values
        autocast's cast gives, with no separate sweep over the weight; 1.19-1.27x the
        call time with the cached cast, against ~1.5x for casting first: docs/perf.md v30); the
        weight is expected to change between training calls, so the cast is made and
        cached only when a later call finds the weight unchanged (a loop of calls in
        training mode without an optimizer step).
    Model casts the weight once per autocast region.  With gradients:
    model_new_lowp.forward_autocast_grad, whose backward needs the cast, takes it from
    the cache (lowp_sm90 in training, lowp_cublas in eval)."""
    if grad:
        return engine.lowp.forward_autocast_grad(route, training, params, buffers, momentum, eps, scale_after_bn,
                                                 dtype)
    x, weight = params[0], params[1]
    cast = engine.weight_parts(weight, split=lambda w: w.to(dtype), kind=engine.lowp.CAST_KIND[dtype],
                               make="reused" if training else True)
    params = (x.to(dtype), weight if cast is None else cast) + params[2:]
    return engine.forward_call(engine.lowp.kernels(), route, scale_after_bn, training, buffers, momentum, eps,
                               params)


def check(x, gemm, scale, bn, group):
    """The checks of a call under autocast: the input's (check_input without
    the dtype rules: the cast makes x and the weight one dtype) and the
    scale's; synchronized BatchNorm has no mixed-precision path and raises
    RuntimeError (nothing touched)."""
    engine.check_input(x, gemm.weight, bn.training, cast=True)
    engine.per_feature_scale(scale, gemm.out_features, one_number=True)  # (the check alone: no view)
    if group is not None:
        raise RuntimeError("ModelNew has no mixed-precision path with synchronized BatchNorm "
                           "(nn.SyncBatchNorm.convert_sync_batchnorm across processes); run it in float32")


def forward(x, gemm, scale, bn, scale_after_bn, dtype):
    """ModelNew's forward under autocast (dtype: the autocast dtype, from
    autocast_dtype(x)), after check(): the fused kernels where fused_gemm says so, else
    Model's ops."""
    grad = engine.needs_grad((x, gemm.weight, gemm.bias, scale, bn.weight, bn.bias))
    route = fused_gemm(x, gemm, scale, bn, dtype, grad)
    if route is not None:
        return _fused_forward(x, gemm, scale, bn, scale_after_bn, dtype, route, grad)
    return _model_forward(x, gemm, scale, bn, scale_after_bn)
