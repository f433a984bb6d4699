"""Synchronized BatchNorm for ModelNew (model_new.py loads this module when it
lies beside it; the self-contained files have none): the training forward and
backward of both problems when bn is a SyncBatchNorm
(nn.SyncBatchNorm.convert_sync_batchnorm) and several processes share one
batch.  docs/multi-gpu.md has the design and the measurements.

Names as in model_new.py: M = batch (this process's rows), N = out_features,
K = in_features; scale_after_bn selects problem 84.

Entry points (model_new.py calls them): BATCHNORM_BASE (the base class of
BatchNormState: torch's _BatchNorm, which convert_sync_batchnorm converts),
bind(engine), process_group(bn), path_name(x, weight, grad), forward(group,
params, buffers, momentum, eps, scale_after_bn).  This module imports nothing of
the core: the core that loads it hands it its face (model_new.Engine) through bind().
"""
import functools
import importlib
import types

import torch
from torch import nn
# The core's BatchNormState derives from it.
from torch.nn.modules.batchnorm import _BatchNorm as BATCHNORM_BASE  # noqa: F401

engine = None  # the core's face (model_new.Engine), set by bind()


def bind(core_engine):
    """Called once by the core that loaded this module, with its face."""
    global engine
    engine = core_engine

# One function per step, the same code for CPU (gloo) and CUDA (NCCL):
#   _sync_local_forward   v = x W^T + b (M, N) and this process's (count, mean, M2)
#                         of v (the BatchNorm input u is v * scale (33) or v (84):
#                         _sync_input_stats turns merged v statistics into u's)
#   _sync_all_gather      one all_gather of the (3, N) float64 statistics
#   _sync_merge_stats     the union's (count, mean, M2), Chan et al.'s formula; count
#                         stays a device tensor (no host synchronisation)
#   _sync_check_batch     a merged batch of one row raises, as BatchNorm does (reads
#                         the merged count on the host only when this process has < 2 rows)
#   _sync_update_running  running statistics from the merged ones (unbiased variance)
#   _sync_normalize       (u - mean) invstd bn.weight + bn.bias; 84: softmax of it * scale
#   backward: _sync_backward_sums (local sum_m g, sum_m g (v - mean_v), g the
#   gradient of the BatchNorm output (33) or of the softmax input (84)), one
#   all_reduce of both, _sync_bn_sums (as SyncBatchNorm's sum_dy, sum_dy_xmu),
#   _sync_grad_u with the merged count, then the GEMMs (_sync_gemm).
# Elementwise work runs in x's dtype (float32 for 16-bit x, whose GEMM alone is
# 16-bit); per-feature statistics and sums in float64.
#
# float32 CUDA batches of at least two rows take the fused kernels instead
# (_sync_fused_gemm decides; _SyncFusedTrainFn): the training GEMM with its tile
# statistics (sync_forward_local), the same all_gather, then one call that
# merges in float64, updates the running statistics and normalises
# (sync_bn_apply: bn_sync.cu, then bn_apply's streaming kernel or softmax_rows),
# and in the backward bn_backward_sums -> the same all_reduce ->
# bn_backward_grad, then the backward's GEMMs as in the unsynchronized path.
# The host never waits for the GPU on this path (the merged count stays on the
# device; with >= 2 local rows the merged batch has >= 2).  Both paths exchange
# the same statistics in the same collectives, so processes may take different
# ones (a process with fewer than two rows takes the torch ops).


def process_group(bn):
    """The process group whose batches a training call with `bn` normalises as
    one batch, or None (this process's batch alone).  Decided as
    nn.SyncBatchNorm.forward decides its need_sync: bn is a SyncBatchNorm (what
    convert_sync_batchnorm makes of BatchNormState), bn.training,
    torch.distributed available and initialized, and the group (bn.process_group,
    else the default group) has more than one process.  Unlike SyncBatchNorm,
    CPU tensors are accepted (gloo).  Reads no tensor and runs no collective."""
    if not (isinstance(bn, nn.SyncBatchNorm) and bn.training):
        return None
    if engine.world_size(bn.process_group) <= 1:
        return None
    return bn.process_group or torch.distributed.group.WORLD


def _sync_work_dtype(dtype):
    """The dtype of the elementwise work: float32 for 16-bit x (as Model's
    BatchNorm statistics), else x's own."""
    return torch.float32 if engine.is_16bit_dtype(dtype) else dtype


def _sync_gemm_kernel(a, b):
    """The GEMM kernel of a @ b^T on this path: dispatch_gemm_nt's for float32
    CUDA tensors, "torch_ops" otherwise (CPU, float64, and 16-bit CUDA, whose
    product torch computes in the 16-bit type, as Model's Linear)."""
    if a.is_cuda and a.dtype == torch.float32:
        return engine.dispatch_gemm_nt(a, b)
    return "torch_ops"


def _sync_gemm(a, b):
    """a (M, K) @ b (N, K)^T -> (M, N) in a's dtype, any strides, on
    _sync_gemm_kernel's kernel; zeros when M, N or K is 0 (no kernel runs)."""
    if a.numel() == 0 or b.numel() == 0:
        return a.new_zeros((a.shape[0], b.shape[0]))
    gemm = _sync_gemm_kernel(a, b)
    return engine.kernels("torch" if gemm == "torch_ops" else "ext").gemm_nt(gemm, a, b, None)


def path_name(x, weight, grad):
    """ModelNew.kernel_path's name under synchronized BatchNorm: <gemm>_sync_fused_train[_grad]
    on the fused kernels (_sync_fused_gemm), else <gemm>_sync_train[_grad] with
    <gemm> the torch-op path's product kernel (_sync_gemm_kernel; "empty" for a batch of 0)."""
    fused = _sync_fused_gemm(x, weight)
    if fused is not None:
        return f"{fused}_sync_fused_train" + ("_grad" if grad else "")
    gemm = "empty" if x.shape[0] == 0 else _sync_gemm_kernel(x, weight)
    return f"{gemm}_sync_train" + ("_grad" if grad else "")


def _sync_local_stats(u):
    """This process's per-feature statistics of u (M, N) (the product plus bias v),
    as one (3, N) float64 tensor: row 0 the count M (in every column), row 1 the
    mean, row 2 M2 = sum_m (u - mean)^2.  M == 0 gives zeros (the process still
    takes part in the all-gather, as SyncBatchNorm's does)."""
    u64 = u.double()
    m = u.shape[0]
    mean = u64.sum(dim=0) / max(m, 1)
    m2 = ((u64 - mean) ** 2).sum(dim=0)
    return torch.stack((torch.full_like(mean, float(m)), mean, m2))


def _sync_local_forward(x, weight, bias, scale, scale_after_bn, work_dtype):
    """The steps before the collective: (v, local) with v = x weight^T + bias
    (M, N) in work_dtype (x weight^T rounded to x's dtype first: the 16-bit GEMM)
    and local = _sync_local_stats(v).  Both synchronized paths exchange v's
    statistics (the fused one from its GEMM's tile statistics of x weight^T,
    shifted by the bias), so processes may take different paths."""
    v = _sync_gemm(x, weight).to(work_dtype) + bias.to(work_dtype)
    return v, _sync_local_stats(v)


def _sync_all_gather(local, group):
    """Every process's (3, N) statistics in `group`, as (world, 3, N) in rank
    order: one all_gather (float64, which gloo and NCCL both carry; on NCCL
    all_gather_into_tensor, straight into the one output).  Every process of the
    group calls it once per training call, also with an empty batch."""
    dist = torch.distributed
    world = dist.get_world_size(group)
    gathered = local.new_empty((world,) + tuple(local.shape))
    if dist.get_backend(group) == "nccl":
        dist.all_gather_into_tensor(gathered, local.contiguous(), group=group)
    else:
        dist.all_gather(list(gathered.unbind(0)), local.contiguous(), group=group)
    return gathered


def _sync_merge_stats(gathered):
    """(count, mean, m2) of the union of the batches from their (world, 3, N)
    statistics: count a 0-dim float64 tensor on their device (reading it would
    synchronise with the GPU), mean and m2 (N,) float64, by Chan, Golub
    and LeVeque's combination over all processes at once:
      count = sum_r c_r,  mean = sum_r c_r mean_r / count,
      m2 = sum_r (m2_r + c_r (mean_r - mean)^2).
    Processes with c_r = 0 add nothing (uneven and empty batches, as
    SyncBatchNorm drops them); count 0 gives mean 0, m2 0.  Every process
    computes it from the same values in the same order: the same result everywhere."""
    counts, means, m2s = gathered[:, 0], gathered[:, 1], gathered[:, 2]
    count = counts[:, 0].sum()
    mean = (counts * means).sum(dim=0) / count.clamp(min=1.0)
    m2 = (m2s + counts * (means - mean) ** 2).sum(dim=0)
    return count, mean, m2


def _sync_merged_rows(count, local_rows):
    """The merged batch's row count as a Python int where it matters, None
    otherwise: with local_rows >= 2 here the merged batch has >= 2 rows and the
    count is not read (reading the device tensor would make the host wait for
    the GPU in every training call); with fewer it is read."""
    return None if local_rows >= 2 else int(count)


def _sync_check_batch(count, n, local_rows):
    """BatchNorm's refusal of a batch of one row, for the merged batch (every
    process raises the same ValueError, after the all-gather and before any
    buffer changes); count the merged count tensor, local_rows this process's."""
    if _sync_merged_rows(count, local_rows) == 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size "
                         f"{torch.Size([1, n])}")


def _sync_input_stats(mean_v, m2_v, scale, scale_after_bn):
    """The BatchNorm input's merged (mean, M2) from v's (float64): u = v * scale
    (problem 33: scale mean_v, scale^2 M2_v) or u = v (84)."""
    if scale_after_bn:
        return mean_v, m2_v
    s = scale.double()
    return s * mean_v, s * s * m2_v


def _sync_update_running(buffers, count, mean, m2, momentum, local_rows):
    """BatchNorm's update from the merged batch (count the merged count tensor,
    mean and m2 the BatchNorm input's): num_batches_tracked += 1, then
    with factor = momentum (or 1 / num_batches_tracked for momentum < 0, i.e.
    None), in float64:
      running_mean = (1 - factor) running_mean + factor mean
      running_var  = (1 - factor) running_var  + factor m2 / (count - 1)   (unbiased).
    count 0 (every batch empty) only counts the call, as BatchNorm1d on an empty batch.
    No host synchronisation when this process has >= 2 rows (_sync_merged_rows)."""
    running_mean, running_var, num_batches_tracked = buffers
    num_batches_tracked.add_(1)
    rows = _sync_merged_rows(count, local_rows)
    if rows is not None and rows < 2:
        return
    factor = momentum if momentum >= 0 else 1.0 / num_batches_tracked.double()
    running_mean.copy_((1.0 - factor) * running_mean.double() + factor * mean)
    running_var.copy_((1.0 - factor) * running_var.double() + factor * (m2 / (count - 1.0)))


def _sync_normalize(u, mean, invstd, bn_weight, bn_bias):
    """y = (u - mean) invstd bn_weight + bn_bias (M, N) in u's dtype, the
    per-feature factor invstd bn_weight formed in float64; mean, invstd (N,) float64."""
    dt = u.dtype
    return (u - mean.to(dt)) * (invstd * bn_weight.double()).to(dt) + bn_bias.to(dt)


def _sync_backward_sums(g, vmu):
    """This process's (2, N) float64 sums over its rows, [sum_m g | sum_m g (v - mean_v)]:
    g (M, N) the gradient with respect to the BatchNorm output (33) or to the
    softmax's input, scale times it (84), vmu = v - mean_v (M, N).  What every
    path all-reduces (bn_backward_sums computes the same from z - mean_z =
    v - mean_v), so processes may take different paths."""
    return torch.stack((g.sum(dim=0, dtype=torch.float64), (g * vmu).sum(dim=0, dtype=torch.float64)))


def _sync_bn_sums(sums, scale, scale_after_bn):
    """_sync_backward_sums' (S1, S2) as SyncBatchNorm's (sum_dy, sum_dy_xmu) with
    dy the gradient of the BatchNorm output and xmu = u - mean_u: (S1, s S2) for
    problem 33 (u = s v), (s S1, s S2) for 84 (dy = s g); float64, no division."""
    s = scale.double()
    return torch.stack((s * sums[0] if scale_after_bn else sums[0], s * sums[1]))


def _sync_all_reduce(sums, group):
    """The (2, N) sums added over `group`: one all_reduce (SUM), in place, as
    SyncBatchNorm's backward does; every process calls it, also with an empty batch."""
    torch.distributed.all_reduce(sums, torch.distributed.ReduceOp.SUM, group=group)
    return sums


def _sync_grad_u(grad_y, xmu, total, count, invstd, bn_weight):
    """BatchNorm's input gradient with the merged batch: with the global sums
    total = (sum_dy, sum_dy_xmu) (2, N) and the merged count C,
      grad_u = bn_weight invstd (grad_y - sum_dy / C) - xmu bn_weight invstd^3 sum_dy_xmu / C
    in grad_y's dtype (per-feature factors in float64)."""
    dt = grad_y.dtype
    c = count.clamp(min=1.0)
    a = bn_weight.double() * invstd
    return grad_y * a.to(dt) - (a * total[0] / c).to(dt) - xmu * (a * invstd * invstd * total[1] / c).to(dt)


def _sync_backward(scale_after_bn, group, count, grad_out, x, weight, scale, bn_weight, bn_bias, v, mean_v, invstd,
                   out, needs):
    """Gradients of _SyncTrainFn with respect to (x, gemm.weight, gemm.bias,
    scale, bn.weight, bn.bias), `needs` saying which are wanted, in the work
    dtype of v (cast by the caller).  With u = v * scale (33) or v (84),
    xmu = u - mean_u, y = _sync_normalize(u, ...):
      problem 84: grad_soft = out * (grad_out - sum_n grad_out out) (softmax backward),
        grad_scale = sum_m grad_soft y, grad_y = grad_soft * scale; problem 33: grad_y = grad_out
      sums = _sync_bn_sums(_sync_backward_sums(grad_soft or grad_out, v - mean_v)):
      grad_bn.weight = invstd sum_m grad_y xmu, grad_bn.bias = sum_m grad_y   (this process's rows
        only, as SyncBatchNorm returns them: DDP averages gradients over processes)
      grad_u = _sync_grad_u with the all-reduced sums and the merged count (the
        gradient of every process's loss with respect to this process's u)
      problem 33: grad_scale = sum_m grad_u v, grad_v = grad_u scale; problem 84: grad_v = grad_u
      grad_x = grad_v weight, grad_W = grad_v^T x (in x's dtype, _sync_gemm)
      grad_gemm.bias = 0: its gradient through the merged batch mean sums to exactly
        0 over the processes (each process's share would be sum_m grad_v), so every
        process returns 0 and any sum or average of them is that sum.
    The all_reduce runs when a gradient through u is wanted (x, gemm.weight, or
    33's scale): the same decision on every process, as SyncBatchNorm's."""
    need_x, need_w, need_b, need_s, need_g, need_beta = needs
    dt = v.dtype
    grad_out = grad_out.to(dt)
    u = v if scale_after_bn else v * scale
    mean_u = mean_v if scale_after_bn else scale.double() * mean_v
    vmu = v - mean_v.to(dt)
    xmu = vmu if scale_after_bn else u - mean_u.to(dt)
    grad_scale = None
    if scale_after_bn:
        grad_soft = engine.softmax_rows_backward(out, grad_out)
        if need_s:
            y = _sync_normalize(u, mean_u, invstd, bn_weight, bn_bias)
            grad_scale = (grad_soft * y).sum(dim=0, dtype=torch.float64).to(dt)
        g, grad_y = grad_soft, grad_soft * scale
    else:
        g = grad_y = grad_out
    local = _sync_backward_sums(g, vmu)
    sums = _sync_bn_sums(local, scale, scale_after_bn)
    grad_g = (invstd * sums[1]).to(dt) if need_g else None
    grad_beta = sums[0].to(dt) if need_beta else None
    grad_x = grad_w = None
    if need_x or need_w or (need_s and not scale_after_bn):
        total = _sync_bn_sums(_sync_all_reduce(local.clone(), group), scale, scale_after_bn)
        grad_u = _sync_grad_u(grad_y, xmu, total, count, invstd, bn_weight)
        if not scale_after_bn:
            grad_scale = (grad_u * v).sum(dim=0, dtype=torch.float64).to(dt) if need_s else None
            grad_u = grad_u * scale
        grad_v = grad_u.to(x.dtype)
        grad_x = _sync_gemm(grad_v, weight.t()) if need_x else None
        grad_w = _sync_gemm(grad_v.t(), x.t()) if need_w else None
    grad_b = torch.zeros_like(bn_bias) if need_b else None
    return (grad_x, grad_w, grad_b, grad_scale, grad_g, grad_beta)


class _SyncTrainFn(torch.autograd.Function):
    """The training forward under synchronized BatchNorm (sync_process_group),
    both problems, any device and float dtype:
      v, local = _sync_local_forward(...); count, mean_v, m2_v = _sync_merge_stats(_sync_all_gather(local, group))
      _sync_check_batch; mean, m2 = _sync_input_stats(...) (u's); _sync_update_running (the module's
      buffers, in place, once)
      invstd = 1 / sqrt(m2 / count + eps)   (biased variance of the merged batch, float64)
      out = _sync_normalize(u, ...) (33), softmax_rows(_sync_normalize(u, ...) * scale) (84), in x's dtype.
    One all_gather in the forward, one all_reduce in the backward (_sync_backward).
    Saved: x, gemm.weight, scale, bn.weight, bn.bias (the caller's tensors, or
    float32 copies for 16-bit x), v (M, N) in the work dtype, mean_v and invstd (N)
    float64, and for problem 84 out (M, N)."""

    @staticmethod
    def forward(ctx, scale_after_bn, group, buffers, momentum, eps, x, weight, bias, scale, bn_weight, bn_bias):
        dt = _sync_work_dtype(x.dtype)
        scale_w, bn_weight_w, bn_bias_w = scale.to(dt), bn_weight.to(dt), bn_bias.to(dt)
        v, local = _sync_local_forward(x, weight, bias, scale_w, scale_after_bn, dt)
        count, mean_v, m2_v = _sync_merge_stats(_sync_all_gather(local, group))
        _sync_check_batch(count, weight.shape[0], x.shape[0])
        mean, m2 = _sync_input_stats(mean_v, m2_v, scale_w, scale_after_bn)
        _sync_update_running(buffers, count, mean, m2, momentum, x.shape[0])
        invstd = torch.rsqrt(m2 / count.clamp(min=1.0) + eps)
        y = _sync_normalize(v if scale_after_bn else v * scale_w, mean, invstd, bn_weight_w, bn_bias_w)
        out = engine.softmax_rows(y * scale_w) if scale_after_bn else y
        ctx.scale_after_bn, ctx.group, ctx.count = scale_after_bn, group, count
        ctx.dtypes = [t.dtype for t in (x, weight, bias, scale, bn_weight, bn_bias)]
        ctx.save_for_backward(x, weight, scale_w, bn_weight_w, bn_bias_w, v, mean_v, invstd,
                              out if scale_after_bn else None)
        return out.to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        grads = _sync_backward(ctx.scale_after_bn, ctx.group, ctx.count, grad_out, *ctx.saved_tensors,
                               ctx.needs_input_grad[5:])
        return (None,) * 5 + tuple(g if g is None else g.to(d) for g, d in zip(grads, ctx.dtypes))


def _sync_fused_gemm(x, weight):
    """The GEMM kernel of the fused synchronized path for this process's batch,
    or None (the torch-op path, _SyncTrainFn): x float32 on CUDA with at least
    two rows (so the merged batch has two: no check that would read the merged
    count), the extension built, SWITCHES.sync_fused, and dispatch() choosing
    one of the extension's tile-statistics GEMMs (the training-with-gradients
    plan: never the cluster kernel)."""
    if not (engine.switches().sync_fused and x.is_cuda and x.dtype == torch.float32 and x.shape[0] >= 2
            and engine.extension is not None):
        return None
    plan = engine.dispatch(x, weight, True, True, False)
    return plan.gemm if plan.kernels == "ext" else None


def _sync_fused_bn_backward(group, count, bias, need_reduce, grad_y, z, stats, scale, bn_weight, eps,
                            scale_after_bn, bn_bias=None):
    """bn_backward_train's contract for the merged batch (bn_backward.cu):
    this process's sums, the all_reduce when `need_reduce` (the torch-op path's
    condition: the same collectives on every process), then grad_z from the
    global sums and the merged count (a float64 device tensor: no host synchronisation)."""
    local = engine.extension.bn_backward_sums(grad_y, z, stats)
    total = _sync_all_reduce(local.clone(), group) if need_reduce else local
    return engine.extension.bn_backward_grad(grad_y, z, stats, bias, scale, bn_weight, eps, scale_after_bn, count,
                                             local, total, bn_bias)


class _SyncFusedTrainFn(torch.autograd.Function):
    """_SyncTrainFn's computation on the fused float32 CUDA kernels, the same
    collectives in the same order:
      z, local = sync_forward_local(x, W, bias)   (x split: num_batches_tracked += 1; GEMM;
                                                   local = this process's statistics of v = z + bias)
      out, stats, count = sync_bn_apply(z, _sync_all_gather(local, group), ...)
          (the merge, running statistics and coefficients in one kernel, bn_sync.cu;
           then 33: the BatchNorm apply; 84: the row softmax of it)
    The host never waits for the GPU (count stays on the device).
    Saved: x, gemm.weight, gemm.bias, scale, bn.weight, bn.bias (84), z (M, N),
    stats (2, N) of the merged batch, out (84).  Backward: _train_backward with
    bn_backward_train replaced by _sync_fused_bn_backward, whose all_reduce runs
    when a gradient through u is wanted (x, gemm.weight, or 33's scale), as in
    _sync_backward; grad_gemm.bias = 0 (as there)."""

    @staticmethod
    def forward(ctx, gemm, scale_after_bn, group, buffers, momentum, eps, x, weight, bias, scale, bn_weight,
                bn_bias):
        ext = engine.extension
        z, local = ext.sync_forward_local(gemm, x, weight, bias, buffers[2], *engine.weight_args(ext, gemm, weight))
        out, stats, count = ext.sync_bn_apply(z, _sync_all_gather(local, group), bias, scale, bn_weight,
                                              bn_bias, *buffers, momentum, eps, scale_after_bn)
        ctx.scale_after_bn, ctx.group, ctx.count, ctx.eps = scale_after_bn, group, count, eps
        ctx.save_for_backward(x, weight, bias, scale, bn_weight, bn_bias if scale_after_bn else None, z, stats,
                              out if scale_after_bn else None)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x, weight, bias, scale, bn_weight, bn_bias, z, stats, out = ctx.saved_tensors
        needs = ctx.needs_input_grad[6:]
        need_reduce = needs[0] or needs[1] or (needs[3] and not ctx.scale_after_bn)
        eager = engine.eager_backward
        ops = types.SimpleNamespace(gemm_nn=eager.gemm_nn, gemm_tn=eager.gemm_tn, bn_backward_train=functools.partial(
            _sync_fused_bn_backward, ctx.group, ctx.count, bias, need_reduce))
        grads = engine.train_backward(ops, ctx.scale_after_bn, ctx.eps, grad_out, x, weight, scale, bn_weight,
                                     bn_bias, z, stats, out, needs)
        return (None,) * 6 + tuple(grads)


_EAGER_FUNCTIONS = {}


def _eager(fn):
    """fn wrapped so that torch.compile runs it eagerly (a graph break), made on
    first use: torch.compiler.disable (torch._dynamo.disable before torch 2.1)
    imports torch._dynamo, about 1 s that importing model_new should not pay."""
    wrapped = _EAGER_FUNCTIONS.get(fn)
    if wrapped is None:
        disable = getattr(getattr(torch, "compiler", None), "disable", None)
        if disable is None:
            disable = importlib.import_module("torch._dynamo").disable
        wrapped = _EAGER_FUNCTIONS[fn] = disable(fn)
    return wrapped


def _forward(group, params, buffers, momentum, eps, scale_after_bn):
    """fused_forward's synchronized training path: _SyncTrainFn over params
    (x, gemm.weight, gemm.bias, scale (N,), bn.weight, bn.bias), collectives on
    `group`.  Eager also under torch.compile (a graph break; fullgraph=True
    refuses it): no custom operator carries the collectives.  float32 CUDA
    batches take _SyncFusedTrainFn (_sync_fused_gemm), others _SyncTrainFn."""
    gemm = _sync_fused_gemm(params[0], params[1])
    if gemm is not None:
        return _SyncFusedTrainFn.apply(gemm, scale_after_bn, group, buffers, momentum, eps, *params)
    return _SyncTrainFn.apply(scale_after_bn, group, buffers, momentum, eps, *params)


def forward(group, params, buffers, momentum, eps, scale_after_bn):
    """_forward, run eagerly under torch.compile (_eager)."""
    return _eager(_forward)(group, params, buffers, momentum, eps, scale_after_bn)
