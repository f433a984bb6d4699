"""16-bit float modules for ModelNew (model_new.py loads this module when it
lies beside it; the self-contained files have none): the second extension,
kernels/lowp/ (compiled on the first 16-bit CUDA call), its routes, its forward
with gradients and backward, and its custom operators.

A 16-bit module (model.half() or .to(bfloat16): x, the parameters and the
running statistics in one 16-bit dtype T) runs Model's function with Model's
rounding points: z = rnd_T(x W^T + b) (float32 accumulation), BatchNorm's
statistics in float32 (float64 sums in the kernels), its output and `* scale`
rounded to T where Model's eager ops round (docs/numerics.md lists them).
Routes (route(); README support matrix):
  lowp_sm90    Hopper: lowp/sm90_gemm_bn_16bit.cu (wgmma, TMA), the chain in its epilogue
  lowp_cublas  cuBLAS's product (at::linear, eager's own call), then the chain
               kernels (lowp/bn_16bit_chain.cu, lowp/bn_16bit_strip.cu, lowp/bn_16bit.cu);
               Hopper where hopper_gemm says lowp_sm90 is slower, and eval with
               gradients on sm_80-89 (forward_eval_saved keeps z)
  lowp_small_m Hopper, batches of at most SMALL_M_ROWS rows: the product by
               lowp/small_m_16bit.cu (W read once, the same z as cuBLAS's up to the
               order of float32 sums), with the BatchNorm in its epilogue where it runs
               in one K piece, else followed by lowp_cublas's chain kernels
  lowp_sm80    sm_80-89: lowp/sm80_gemm_bn_16bit.cu (mma.sync)
With gradients: the extension's forward_grad, one call that makes its autograd
node in C++ (forward_train_saved / forward_eval_saved, then lowp/bn_16bit_backward.cu
and two cuBLAS products); under torch.compile the fused_gemm_bn:: operators of
those names, whose backward is one operator, backward_16bit (the node's backward).

Entry points (model_new.py calls them): bind(engine), available(), kernels(),
route(call, facts, switches), forward(...), and for the custom operators
OPERATORS / SCHEMAS and the 16-bit branch of the shared forward_train_saved
(setup_forward_train_saved, backward_forward_train_saved); model_new_autocast reaches
hopper_gemm, CAST_KIND and forward_autocast_grad through the core's face (Engine.lowp).
This module imports nothing of the core: the core that loads it
hands it its face (model_new.Engine) through bind().
"""
import torch

SUBDIR = "lowp"
BINDING = "binding_16bit.cpp"
PREFIX = "fused_gemm_bn_lowp_"
FUNCTIONS = ["forward_train", "forward_eval", "forward_train_saved", "bn_backward_train", "forward_eval_saved",
             "bn_backward_eval", "forward_grad", "softmax_rows_backward", "backward_16bit"]

# ---------------------------------------------------------------------------
# Build: kernels/lowp/ next to the float32 sources, compiled on first use
# ---------------------------------------------------------------------------

engine = None    # the core's face (model_new.Engine), set by bind()
_SOURCES = None  # {file name: text}: kernels/lowp/ and the kernels/ headers it includes
_ext = None


def bind(core_engine):
    """Called once by the core that loaded this module, with its face: reads the
    16-bit sources (None where kernels/lowp/ is missing)."""
    global engine, _SOURCES
    engine = core_engine
    _SOURCES = engine.extension_sources(SUBDIR, BINDING)


def available():
    """Whether the 16-bit kernels' sources were found (16-bit CUDA input runs)."""
    return _SOURCES is not None


def sources():
    """{file name: text} of the 16-bit extension: kernels/lowp/*.cu, *.cuh,
    *.cpp, and the headers of kernels/ that they #include, directly or through
    another header (launchers.cuh, bn_stats.cuh, sm90_gemm_tiles.cuh, ...)."""
    return dict(_SOURCES)


def kernels():
    """The 16-bit extension (forward_train, forward_eval, ... with the float32
    extension's arguments), compiled or loaded on the first call."""
    global _ext
    if _ext is None:
        _ext = engine.load_extension(sources(), FUNCTIONS, PREFIX)
    return _ext


# ---------------------------------------------------------------------------
# Routes
# ---------------------------------------------------------------------------

MIN_FILL = 0.9     # 256-row grids filling less of the SMs than this go to lowp_cublas
STRIP_ROWS = 1024  # training batches up to this many rows: bn_16bit_strip.cu after cuBLAS ...
SMALL_MNK = 1 << 33  # ... when M N K is at most this (17.2 GFLOP): lowp_cublas
SMALL_M_ROWS = 32  # batches up to this many rows (in_features a multiple of 8): lowp_small_m


def hopper_gemm(m, n, k, training, facts, switches):
    """The 16-bit product on Hopper: "lowp_sm90" (the project's wgmma kernel, the
    chain in its epilogue) or "lowp_cublas" (cuBLAS through at::linear, eager
    nn.Linear's own call, then the chain kernels of lowp/bn_16bit_chain.cu, or in
    training batches of at most 1024 rows lowp/bn_16bit_strip.cu's one kernel; problem
    84's 16-bit eval: one row softmax that applies BatchNorm, lowp/bn_16bit.cu), by
    switches.lowp_gemm ("sm90", "cublas" or "small_m": tests and tools run each; "small_m"
    where it takes the call, else "cublas"), or for "auto" by this rule, fitted to the
    routes' times over bench.py's sweep (H200, both dtypes, problems and modes; docs/perf.md
    v31, v98):
      - batches of at most SMALL_M_ROWS rows with in_features a multiple of 8:
        lowp_small_m (docs/perf.md v98, K = N = 8192: the module 1.06-1.13x faster than
        on lowp_cublas back to back in float16, 0.98-1.02x in bfloat16, and 1.15-1.57x
        synchronized per call, cuBLAS's host path left out); at 9-16 rows its product
        runs 3-6% slower than cuBLAS's back to back, and the module gains it back with
        the BatchNorm in the product's epilogue (v101-v102: problem 33's eval 0.95-0.99
        of lowp_cublas's time; training below) except in problem 84's eval
        at 8192 x 8192 (1.02-1.06x back to back, 0.74-0.86x synchronized per call);
        at 17-32 rows (v103-v104: 32 rows a CTA, 64 features where N / 64 CTAs fill
        the SMs) eval takes 0.80-1.10 of lowp_cublas's time back to back and
        0.64-0.91 synchronized.  Training at 9-32 rows (v107, against lowp_cublas with
        bn_16bit_strip.cu's mid form, v106, which took ~10 us off that route): 0.94-1.04
        back to back at 8192 x 8192 and 4096 x 4096, 1.04-1.16 where K is split (13 and
        29 x 8200 x 2080), and 0.62-0.89 synchronized per call everywhere, so it stays;
    and where lowp_sm90 is slower:
      - lowp_sm90's 256-row tiles (its plan when they fill at least half of the
        SMs) filling less than MIN_FILL of them: one partial wave, where
        cuBLAS splits K (333 x 8192 x 5000: 0.58-0.77; 1000 x 3000 x 3000: 0.71-0.94);
      - eval on the 128-row plan cut along K (128-row tiles at most half the SMs;
        1024 x 1024 x 1024: 0.77-0.85).  Training there stays on lowp_sm90 (its
        epilogue computes the statistics without another read of u: 1.08-1.24).
      - training batches of at most STRIP_ROWS rows with M N K at most
        SMALL_MNK, where cuBLAS's product beats the 128-row split-tile plan's
        by more than the epilogue's statistics save, and the chain after it is one
        kernel (bn_16bit_strip.cu; docs/perf.md v33, GPU time: problem 33
        0.65-1.00 of lowp_sm90's time, 84 0.77-1.01; at 256 x 8192 x 8192 lowp_sm90
        takes 0.93-0.96 of cuBLAS's route's).
    Elsewhere lowp_sm90 is within 3% of the other route or faster (2048 x 1028 x 8190:
    cuBLAS's route 1.13-1.27; eval at 8192-16384 rows since its persistent grid, v71:
    cuBLAS's route 1.01-1.08x its time without gradients; with them 0.99-1.01x back to
    back, 1.01-1.05x synchronized; docs/perf.md v72; training there since v62's grouped
    tile order)."""
    small_m = m <= SMALL_M_ROWS and k % 8 == 0
    if switches.lowp_gemm == "small_m":
        return "lowp_small_m" if small_m else "lowp_cublas"
    if switches.lowp_gemm in ("sm90", "cublas"):
        return "lowp_" + switches.lowp_gemm
    if small_m:
        return "lowp_small_m"
    sms = facts.num_sms
    tiles_256 = -(-m // 256) * -(-n // 128)
    tiles_128 = -(-m // 128) * -(-n // 128)
    if training and m <= STRIP_ROWS and m * n * k <= SMALL_MNK:
        return "lowp_cublas"
    if 2 * tiles_256 >= sms:
        return "lowp_cublas" if tiles_256 < MIN_FILL * sms else "lowp_sm90"
    return "lowp_cublas" if not training and 2 * tiles_128 <= sms else "lowp_sm90"


def route(call, facts, switches):
    """The 16-bit GEMM route of a CUDA call (model_new.Call): on Hopper (compute
    capability 9.0, the sm_90a image, not switches.portable) hopper_gemm's choice
    (eval with gradients too: lowp_sm90's kEvalSaved epilogue keeps z, as
    lowp_cublas's product does); elsewhere lowp_sm80, or lowp_cublas for eval with
    gradients (lowp_sm80's eval keeps no z).  RuntimeError below compute
    capability 8.0."""
    if facts.capability < (8, 0):
        raise RuntimeError(f"ModelNew's 16-bit CUDA kernels need compute capability >= 8.0, got "
                           f"{facts.capability[0]}.{facts.capability[1]}")
    if not switches.portable and facts.capability == (9, 0) and facts.sm90_gemm:
        return hopper_gemm(call.m, call.n, call.k, call.training, facts, switches)
    return "lowp_cublas" if call.grad and not call.training else "lowp_sm80"


# ---------------------------------------------------------------------------
# Forward and backward
# ---------------------------------------------------------------------------


def forward(plan, params, buffers, momentum, eps, scale_after_bn):
    """A 16-bit module's eager forward on the plan's route, one extension call:
    with gradients (plan.grad) forward_grad, else forward_train / forward_eval."""
    ext = kernels()
    if plan.grad:
        return ext.forward_grad(plan.gemm, plan.training, *params, *buffers, momentum, eps, scale_after_bn, None)
    return engine.forward_call(ext, plan.gemm, scale_after_bn, plan.training, buffers, momentum, eps, params)


# The weight cache's kind of gemm.weight's cast to a 16-bit dtype (model_new._weight_parts): "cast_<dtype>",
# one string per dtype, shared by the autocast calls with and without gradients (a dtype's str costs host time).
CAST_KIND = {dtype: f"cast_{dtype}" for dtype in (torch.float16, torch.bfloat16)}


def forward_autocast_grad(gemm, training, params, buffers, momentum, eps, scale_after_bn, dtype):
    """A float32 module's forward with gradients under autocast in `dtype` on the
    route `gemm` (model_new_autocast.fused_gemm's: lowp_sm90 in training, lowp_cublas
    in eval, whose forward_eval_saved keeps z and the running statistics'
    coefficients in the float32-vector form): forward_grad with gemm.weight's cast
    from the weight cache (kind cast_<dtype>, shared with the calls without
    gradients; made here, detached, where the cache holds none); x is cast in the
    extension.  The gradients come back in the parameters' and x's dtypes."""
    weight = params[1]
    cast = engine.weight_parts(weight, split=lambda w: w.detach().to(dtype), kind=CAST_KIND[dtype])
    cast = weight.detach().to(dtype) if cast is None else cast
    return kernels().forward_grad(gemm, training, *params, *buffers, momentum, eps, scale_after_bn, cast)


def backward(training, scale_after_bn, grad_out, x16, w16, scale, z, coeff, out, needs, dtypes):
    """Gradients of the 16-bit operators forward_train_saved and forward_eval_saved
    (a 16-bit CUDA module under torch.compile, torch.export, torch.jit.trace or
    SWITCHES.eager_ops) with respect to (x, gemm.weight, gemm.bias, scale,
    bn.weight, bn.bias), from the saved tensors: x16, w16 the GEMM's operands
    (in the 16-bit dtype T), z (M, N) T the Linear output, coeff (4, N) the
    forward's {mean, invstd, bn.weight, bn.bias} (the batch's in training, the
    running statistics' in eval: `training` says which), out (problem 84) the
    softmax output, else None; needs: which of the six are wanted (the others
    None); dtypes: the six inputs' dtypes, which their gradients are returned in.
    One operator, backward_16bit: the eager node's backward (backward_grads in
    kernels/lowp/binding_16bit.cpp), so compiled and eager steps give the same bits:
      problem 84: g = the row softmax's backward (softmax_16bit_backward.cu)
      grad_z, [eval: grad_bias,] grad_scale, grad_bn_weight, grad_bn_bias from
        lowp/bn_16bit_backward.cu (float64 sums, each output rounded once)
      grad_x = grad_z w16, grad_W = grad_z^T x16: one T product each (cuBLAS's,
        float32 accumulation, as Model's backward)
      grad_bias: training 0 exactly (BatchNorm subtracts the batch mean, which
        holds the bias); eval sum_m grad_z."""
    grads = iter(engine.ops.backward_16bit(training, scale_after_bn, grad_out, x16, w16, scale, z, coeff, out,
                                           list(needs)))
    return tuple(_in_dtype(next(grads), dtype) if need else None for need, dtype in zip(needs, dtypes))


def _in_dtype(t, dtype):
    return t if t.dtype == dtype else t.to(dtype)


# ---------------------------------------------------------------------------
# Custom operators: the 16-bit ones, and the 16-bit branches of the shared ones
# ---------------------------------------------------------------------------

SCHEMAS = {
    "forward_eval_saved": "(Tensor x, Tensor weight, Tensor bias, Tensor scale, Tensor bn_weight, Tensor bn_bias, "
                          "Tensor running_mean, Tensor running_var, float eps, bool scale_after_bn) "
                          "-> (Tensor, Tensor, Tensor)",
    "backward_16bit": "(bool training, bool scale_after_bn, Tensor grad_out, Tensor x16, Tensor w16, Tensor scale, "
                      "Tensor z, Tensor coeff, Tensor? out, bool[] needs) -> Tensor[]",
}


def _require_cuda_16bit(name, t):
    """The 16-bit-only operators refuse other tensors before any kernel or build runs."""
    if not (t.is_cuda and engine.is_16bit_dtype(t.dtype)):
        raise RuntimeError(f"the fused_gemm_bn operator {name} takes 16-bit CUDA tensors (the 16-bit extension), "
                           f"got {t.dtype} on {t.device}; float32 and float64 eval with gradients is gemm_nt with "
                           f"the fold in elementwise ops")


def _op_forward_eval_saved(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, eps,
                           scale_after_bn):
    """(out, z, coeff): the 16-bit extension's forward_eval_saved on dispatch's route
    for eval with gradients (the eager forward_grad's): forward_eval's out, the Linear
    output z (M, N) in x's dtype, and coeff (4, N) float32, the running statistics'
    {mean, invstd, bn.weight, bn.bias} as the forward used them.  16-bit CUDA x only;
    an empty batch gives empty out and z."""
    _require_cuda_16bit("forward_eval_saved", x)
    n = weight.shape[0]
    if x.shape[0] == 0:
        return x.new_empty((0, n), dtype=bias.dtype), x.new_empty((0, n)), x.new_zeros((4, n), dtype=torch.float32)
    plan = engine.dispatch(x, weight, False, True, scale_after_bn)
    return tuple(kernels().forward_eval_saved(plan.gemm, x, weight, bias, scale, bn_weight, bn_bias,
                                              running_mean, running_var, eps, scale_after_bn))


def _op_backward_16bit(training, scale_after_bn, grad_out, x16, w16, scale, z, coeff, out, needs):
    """The 16-bit extension's backward_16bit: the wanted gradients (backward()), as a list."""
    _require_cuda_16bit("backward_16bit", z)
    return list(kernels().backward_16bit(training, scale_after_bn, grad_out, x16, w16, scale, z, coeff, out,
                                         list(needs)))


def _fake_forward_eval_saved(x, weight, bias, *args):
    m, n = x.shape[0], weight.shape[0]
    return x.new_empty((m, n), dtype=bias.dtype), x.new_empty((m, n)), x.new_empty((4, n), dtype=torch.float32)


def _fake_backward_16bit(training, scale_after_bn, grad_out, x16, w16, scale, z, coeff, out, needs):
    n = z.shape[1]
    like = ((x16.shape, x16.dtype), (w16.shape, w16.dtype), ((n,), scale.dtype), (scale.shape, scale.dtype),
            ((n,), scale.dtype), ((n,), scale.dtype))
    return [z.new_empty(shape, dtype=dtype) for (shape, dtype), need in zip(like, needs) if need]


def _setup_forward_eval_saved(ctx, inputs, output):
    """Saves what forward_grad's node saves in eval; z and coeff are not differentiable."""
    x, weight, _, scale = inputs[:4]
    out, z, coeff = output
    ctx.mark_non_differentiable(z, coeff)
    ctx.scale_after_bn = inputs[9]
    ctx.dtypes = tuple(t.dtype for t in inputs[:6])
    ctx.save_for_backward(x, weight, scale, z, coeff, out if ctx.scale_after_bn else None)


def _backward_forward_eval_saved(ctx, grad_out, *unused):
    grads = backward(False, ctx.scale_after_bn, grad_out, *ctx.saved_tensors, ctx.needs_input_grad[:6], ctx.dtypes)
    return tuple(grads) + (None,) * 4


# name -> (implementation, fake, (backward, setup_context)): model_new._define_ops registers them.
OPERATORS = {
    "forward_eval_saved": (_op_forward_eval_saved, _fake_forward_eval_saved,
                           (_backward_forward_eval_saved, _setup_forward_eval_saved)),
    "backward_16bit": (_op_backward_16bit, _fake_backward_16bit, None),
}


def setup_forward_train_saved(ctx, inputs, output):
    """fused_gemm_bn::forward_train_saved's setup_context for 16-bit CUDA x: saves what forward_grad's node
    saves (coeff holds bn.weight and eps)."""
    x, weight, _, scale = inputs[:4]
    out, z, coeff = output[:3]
    ctx.dtypes = tuple(t.dtype for t in inputs[:6])
    ctx.save_for_backward(x, weight, scale, z, coeff, out if ctx.scale_after_bn else None)


def backward_forward_train_saved(ctx, grad_out):
    """fused_gemm_bn::forward_train_saved's backward for 16-bit CUDA x (six gradients)."""
    return backward(True, ctx.scale_after_bn, grad_out, *ctx.saved_tensors, ctx.needs_input_grad[:6], ctx.dtypes)
