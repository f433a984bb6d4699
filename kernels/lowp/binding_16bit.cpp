// binding_16bit.cpp -- PyTorch entry points of the 16-bit forwards (the two
// 16-bit float dtypes of CUDA tensors) of Linear -> scale -> BatchNorm1d
// (problem 33) and Linear -> BatchNorm1d -> scale -> Softmax (problem 84), with
// the names and arguments of the float32 extension's forwards
// (../torch_binding.cpp).  Passed to load_inline as cpp_sources (torch/extension.h
// is prepended there) of the second, 16-bit extension that model_new.py builds
// on the first 16-bit call; the launchers are declared in ../launchers.cuh.
//
// `gemm` names the kernel model_new.py's dispatch chose: lowp_sm90 (wgmma and
// TMA, sm_90a: sm90_gemm_bn_16bit.cu; K padded to a multiple of 8 in copies
// where it is not), lowp_sm80 (mma.sync m16n8k16, sm_80+, any K:
// sm80_gemm_bn_16bit.cu), or lowp_cublas (the product by at::linear, which
// is eager nn.Linear's own call, then the chain kernels of bn_16bit_chain.cu);
// all three write the same outputs.  Each entry
// point checks every tensor (device; dtype float16 or bfloat16, the same for x,
// the parameters and the running statistics; shape; contiguity of the vectors),
// copies a non-contiguous x or weight to a contiguous tensor (never writing the
// caller's; for lowp_sm90 and lowp_cublas also one whose data is not 16-byte aligned), takes a device guard for x's GPU, launches on that GPU's current
// stream, and turns any launch error into a RuntimeError naming the kernel.
// Nothing here synchronises.  scale_after_bn: false = problem 33, true = problem 84.
//
// Autocast: with 16-bit x and weight but float32 vectors (gemm.bias, scale,
// BatchNorm's parameters and running statistics: all float32), the call is a
// float32 module's forward under torch.autocast in x's dtype (lowp_sm90 only):
// the GEMM in x's dtype on the 16-bit bias, what follows in float32 as
// torch's type promotion runs it, out float32 (sm90_gemm_bn_16bit.cu lists
// the rounding points; lowp_cublas takes this form too).  In that form gemm.weight may also be float32 (forward_train
// and forward_eval): the kernel rounds it to x's dtype as it loads it, the value
// autocast's cast of the weight gives, instead of a cast pass over the weight.
//
//   forward_train(gemm, x, weight, bias, scale, bn_weight, bn_bias, running_mean,
//                 running_var, num_batches_tracked, momentum, eps, scale_after_bn) -> out (M, N)
//       problem 33: u = rnd(rnd(x @ weight^T + bias) * scale), problem 84:
//         u = rnd(x @ weight^T + bias), and u's per-tile statistics;
//         num_batches_tracked += 1                    (sm80_gemm_bn_16bit.cu, kTrain)
//       batch mean / invstd, running statistics       (bn_16bit.cu, fold)
//       problem 33: out = rnd(fma(w (u - mean), invstd, b)) in place (bn_16bit.cu, apply)
//       problem 84: one CTA per row: rnd(softmax(rnd(rnd(BatchNorm(u)) * scale)))
//   forward_train_saved(same arguments) -> (out, z, coeff)
//       forward_train, also keeping the Linear output z = rnd(x @ weight^T + bias)
//       (M, N) in x's dtype and the batch coefficients coeff (4, N) float32 (rows) =
//       {mean, invstd, bn.weight, bn.bias} for bn_backward_train.
//   bn_backward_train(grad_y, z, coeff, scale, scale_after_bn)
//       -> (grad_z, grad_scale, grad_bn_weight, grad_bn_bias)      (bn_16bit_backward.cu)
//   forward_eval(gemm, x, weight, bias, scale, bn_weight, bn_bias, running_mean,
//                running_var, eps, scale_after_bn) -> out (M, N)
//       one GEMM launch with the whole chain in its epilogue (kEval); problem 84:
//       then the row softmax.  lowp_cublas: at::linear, then problem 33 the chain
//       kernel (bn_16bit_chain.cu), problem 84 one row-softmax launch that applies
//       BatchNorm and the scale as it reads z (bn_16bit.cu, kEval; the autocast
//       form keeps the chain kernel, its z and out being of two dtypes).
//   forward_eval_saved(same arguments) -> (out, z, coeff)    (lowp_cublas; lowp_sm90 with 16-bit vectors)
//       forward_eval, also keeping z (M, N) in x's dtype and coeff (4, N) float32 (rows) =
//       {running_mean, rsqrtf(running_var + eps), bn.weight, bn.bias} for bn_backward_eval;
//       lowp_cublas, problem 84 (16-bit vectors): one row-softmax launch reads z and writes out and
//       coeff; lowp_sm90: the GEMM's epilogue also stores z and coeff (kEvalSaved), then 84's softmax.
//   bn_backward_eval(grad_y, z, coeff, scale, scale_after_bn)
//       -> (grad_z, grad_bias, grad_scale, grad_bn_weight, grad_bn_bias)  (bn_16bit_backward.cu, eval)
//   softmax_rows_backward(out, grad_out) -> grad_v (M, N): problem 84's row softmax backward,
//       out (grad_out - sum_n grad_out out) per row    (softmax_16bit_backward.cu)
//   forward_grad(gemm, training, x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var,
//                num_batches_tracked, momentum, eps, scale_after_bn, weight_cast) -> out (M, N)
//       the forward with gradients in one call and one autograd node (GradForward below):
//       forward_train_saved or forward_eval_saved, and a backward of
//       bn_backward_train / _eval and two cuBLAS products.  weight_cast: None for a 16-bit
//       module; under autocast (training, float32 module) gemm.weight's cast to the autocast
//       dtype (model_new's weight cache), x being cast here.
//   backward_16bit(training, scale_after_bn, grad_out, x16, w16, scale, z, coeff, out, needs)
//       -> [the wanted gradients]: that node's backward in one call, for the operators
//   The scale may come as one number, of shape (1) or as a stride-0 (N) view, which every kernel here
//   reads in place (scale_stride 0 in LowpBatchNormArgs: no copy per call); its gradient has the
//   scale's shape: (1), or [the gradient, 0, ..., 0] for the (N) view, which autograd's expand
//   backward sums exactly (kernels/scale_terms.cuh).
// momentum < 0 means momentum=None (cumulative average).  rnd: rounding to the
// 16-bit type; the kernel headers list the rounding points, PyTorch's own.

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/autograd/custom_function.h>

#include <array>
#include <string>
#include <vector>

#include "binding_checks.cuh"
#include "launchers.cuh"
namespace {

namespace fgb = fused_gemm_bn;
using namespace fgb::binding;  // check_training, current_stream, feature_vector, num_sms

// The GEMM a call names.  kCublas and kSmallM form the product z first (at::linear, or
// small_m_16bit.cu's kernel at a few rows), then run the same chain kernels over it.
enum class Gemm { kSm80, kSm90, kCublas, kSmallM };

Gemm parse_gemm(const std::string& gemm) {
  if (gemm == "lowp_sm90") return Gemm::kSm90;
  if (gemm == "lowp_sm80") return Gemm::kSm80;
  if (gemm == "lowp_small_m") return Gemm::kSmallM;
  TORCH_CHECK(gemm == "lowp_cublas", "fused_gemm_bn (16-bit): unknown GEMM kernel '", gemm,
              "' (expected lowp_sm90, lowp_sm80, lowp_cublas or lowp_small_m)");
  return Gemm::kCublas;
}

// Whether the route forms the product z before the chain kernels (lowp_cublas, lowp_small_m).
bool product_first(Gemm g) { return g == Gemm::kCublas || g == Gemm::kSmallM; }

const char* gemm_kernel_name(Gemm g, bool train) {
  if (g == Gemm::kSm90) return train ? "sm90_gemm_bn_16bit_kernel (training)" : "sm90_gemm_bn_16bit_kernel (eval)";
  if (g == Gemm::kSm80) return train ? "sm80_gemm_bn_16bit_kernel (training)" : "sm80_gemm_bn_16bit_kernel (eval)";
  return train ? "bn16_chain_train_kernel" : "bn16_chain_eval_kernel";
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "fused_gemm_bn (16-bit): launch of ", what, " failed: ", cudaGetErrorString(err));
}

// The launchers' dtype code (lowp::Dtype in lowp_types.cuh).
int dtype_code(c10::ScalarType t) { return t == torch::kHalf ? 0 : 1; }

// x and weight checked and made contiguous (copies only where they are not).
// w_float32: a float32 weight with 16-bit x (the autocast form on lowp_sm90 or lowp_cublas).
struct Operands {
  torch::Tensor x, weight;
  int M, N, K, dtype;
  bool w_float32;
};

// lowp_sm90: the TMA loads also need 16-byte aligned data (a misaligned x or weight is copied)
// and K % 8 == 0 (otherwise both are copied with K zero-padded to a multiple of 8).
// lowp_cublas and lowp_small_m: contiguous and 16-byte aligned too (copies otherwise), the layout eager's
// nn.Linear usually gets: cuBLAS picks its algorithm, hence its summation order, by the
// operands' alignment, and a misaligned bfloat16 x was measured 3% of problem 33's outputs
// past the 16-bit tests' tolerance against eager on the aligned x (130 x 264 x 200).
Operands check_operands(const torch::Tensor& x, const torch::Tensor& weight, Gemm gemm) {
  TORCH_CHECK(gemm != Gemm::kSmallM || (x.dim() == 2 && x.size(0) <= fgb::lowp_small_m_max_rows() &&
                                        x.size(1) % 8 == 0),
              "fused_gemm_bn (16-bit): lowp_small_m takes at most ", fgb::lowp_small_m_max_rows(),
              " rows and in_features a multiple of 8, got x ", x.sizes());
  const bool sm90 = gemm == Gemm::kSm90, autocast_form = gemm != Gemm::kSm80;
  TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor, got ", x.device());
  TORCH_CHECK(x.scalar_type() == torch::kHalf || x.scalar_type() == torch::kBFloat16,
              "x must be float16 or bfloat16 (the 16-bit extension), got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, "x must have shape (batch, in_features), got ", x.sizes());
  TORCH_CHECK(weight.device() == x.device(), "gemm.weight must be on ", x.device(), ", got ", weight.device());
  const bool w_float32 = autocast_form && weight.scalar_type() == torch::kFloat32;
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() || w_float32, "gemm.weight must be ", x.scalar_type(),
              autocast_form ? " (or float32 under autocast)" : "", ", got ", weight.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == x.size(1), "gemm.weight must have shape (out_features, ",
              x.size(1), "), got ", weight.sizes());
  TORCH_CHECK(x.size(0) <= INT32_MAX && weight.size(0) <= INT32_MAX && x.size(1) <= INT32_MAX,
              "sizes must fit in int32, got x ", x.sizes(), " and gemm.weight ", weight.sizes());
  const fgb::DeviceFacts facts = fgb::binding::facts_of(x);
  TORCH_CHECK(facts.cc_major >= 8, "the 16-bit kernels need compute capability >= 8.0 (mma.sync with bfloat16), got ",
              facts.cc_major, ".", facts.cc_minor, " on ", x.device());
  const int K = static_cast<int>(x.size(1));
  if (sm90 && K % 8 != 0) {
    // TMA rows need 16-byte strides: both operands zero-padded along K to a multiple
    // of 8 (the zeros add exact zeros to every product).
    const int64_t pad = 8 - K % 8;
    return {at::constant_pad_nd(x, {0, pad}), at::constant_pad_nd(weight, {0, pad}), static_cast<int>(x.size(0)),
            static_cast<int>(weight.size(0)), static_cast<int>(K + pad), dtype_code(x.scalar_type()), w_float32};
  }
  auto ready = [gemm](const torch::Tensor& t) {
    return t.is_contiguous() && (gemm == Gemm::kSm80 || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0);
  };
  return {ready(x) ? x : x.clone(at::MemoryFormat::Contiguous),
          ready(weight) ? weight : weight.clone(at::MemoryFormat::Contiguous), static_cast<int>(x.size(0)),
          static_cast<int>(weight.size(0)), K, dtype_code(x.scalar_type()), w_float32};
}

// A scale of one number, which every 16-bit kernel reads in place (scale_stride 0): shape (1,), as
// model_new passes a one-number scale to this extension (no view, so no autograd node, per call), or
// a stride-0 (N) view of one number (per_feature_scale's, as the operators pass it).
bool one_number_scale(const torch::Tensor& scale) {
  return scale.dim() == 1 && (scale.size(0) == 1 || scale_of_one_number(scale));
}

// The scale's stride for LowpBatchNormArgs: 0 for one number, else 1 (N words; copied to a
// contiguous vector here where they are not).
int scale_in_place(torch::Tensor& scale) {
  if (one_number_scale(scale)) return 0;
  scale = feature_vector(scale);
  return 1;
}

// broadcast_ok: one number passes too (the scale: one_number_scale).
void check_vector(const torch::Tensor& t, const char* name, int64_t n, const torch::Tensor& x, c10::ScalarType type,
                  bool broadcast_ok = false) {
  TORCH_CHECK(t.device() == x.device(), name, " must be on ", x.device(), ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == type, name, " must be ", type,
              " (as gemm.bias: x's dtype, or float32 under autocast), got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && (t.size(0) == n || (broadcast_ok && t.size(0) == 1)), name, " must have shape (", n,
              broadcast_ok ? ") or (1)" : ")", ", got ", t.sizes());
  TORCH_CHECK(t.is_contiguous() || (broadcast_ok && t.stride(0) == 0), name, " must be contiguous");
}

struct BnTensors {
  torch::Tensor bias, scale, bn_weight, bn_bias, running_mean, running_var;
};

// Checks the vectors; returns true for the autocast form (float32 vectors), which
// lowp_sm90 and lowp_cublas run; a float32 weight (w_float32) needs that form.
bool check_bn_tensors(const BnTensors& t, int N, const torch::Tensor& x, Gemm gemm, bool w_float32) {
  const bool float32_io = t.bias.scalar_type() == torch::kFloat32;
  const c10::ScalarType type = float32_io ? torch::kFloat32 : x.scalar_type();
  check_vector(t.bias, "gemm.bias", N, x, type);
  check_vector(t.scale, "scale", N, x, type, true);
  check_vector(t.bn_weight, "bn.weight", N, x, type);
  check_vector(t.bn_bias, "bn.bias", N, x, type);
  check_vector(t.running_mean, "bn.running_mean", N, x, type);
  check_vector(t.running_var, "bn.running_var", N, x, type);
  TORCH_CHECK(!float32_io || gemm != Gemm::kSm80, "fused_gemm_bn (16-bit): float32 parameters with ",
              x.scalar_type(), " x (the autocast form) need lowp_sm90 or lowp_cublas");
  TORCH_CHECK(!w_float32 || float32_io, "fused_gemm_bn (16-bit): a float32 gemm.weight with ", x.scalar_type(),
              " x is the autocast form: gemm.bias, scale and BatchNorm's tensors must be float32 too, got ",
              t.bias.scalar_type());
  return float32_io;
}

// The BatchNorm side of one call, filled once and passed whole to every launcher of
// the call.  num_batches_tracked, momentum: training only (eval: null, 0); scale_stride:
// scale_in_place's.
fgb::LowpBatchNormArgs bn_args(int dtype, bool float32_io, const BnTensors& t, int scale_stride,
                               int64_t* num_batches_tracked, double momentum, double eps, bool scale_after_bn) {
  fgb::LowpBatchNormArgs a{dtype,
          float32_io,
          t.bias.data_ptr(),
          t.scale.data_ptr(),
          t.bn_weight.data_ptr(),
          t.bn_bias.data_ptr(),
          t.running_mean.data_ptr(),
          t.running_var.data_ptr(),
          num_batches_tracked,
          static_cast<float>(momentum),
          static_cast<float>(eps),
          scale_after_bn};
  a.scale_stride = scale_stride;
  return a;
}

// lowp_cublas's product: z = rnd(x w^T + bias) (M, N) in x's dtype by at::linear, eager
// nn.Linear's call (under autocast, the weight and bias cast to x's dtype first, as
// autocast casts them), so z is eager's, bit for bit.
torch::Tensor cublas_linear(const Operands& op, const BnTensors& t, bool float32_io) {
  const c10::ScalarType type = op.x.scalar_type();
  const torch::Tensor w = op.w_float32 ? op.weight.to(type) : op.weight;
  const torch::Tensor b = float32_io ? t.bias.to(type) : t.bias;
  return at::linear(op.x, w, b).contiguous();
}

// lowp_small_m's product (small_m_16bit.cu): the same z as cublas_linear's (its header says
// where the bits may differ), W read once at the memory's rate.  The autocast form's float32
// weight is cast first, as cublas_linear casts it; its float32 bias is rounded in the kernel.
torch::Tensor small_m_linear(const Operands& op, const BnTensors& t, bool float32_io) {
  const c10::ScalarType type = op.x.scalar_type();
  const torch::Tensor w = op.w_float32 ? op.weight.to(type) : op.weight;
  torch::Tensor z = torch::empty({op.M, op.N}, op.x.options());
  const int sms = num_sms(op.x);
  const int64_t workspace_floats = fgb::lowp_small_m_workspace_floats(op.M, op.N, op.K, sms);
  const torch::Tensor workspace =
      workspace_floats > 0 ? torch::empty({workspace_floats}, op.x.options().dtype(torch::kFloat32)) : torch::Tensor();
  check_launch(fgb::lowp_small_m_linear(op.dtype, float32_io, op.x.data_ptr(), w.data_ptr(), t.bias.data_ptr(),
                                        z.data_ptr(), workspace_floats > 0 ? workspace.data_ptr<float>() : nullptr,
                                        op.M, op.N, op.K, sms, current_stream(op.x)),
               "small_m_16bit_kernel");
  return z;
}

// The product of a product-first route (lowp_cublas, lowp_small_m).
torch::Tensor linear_product(Gemm gemm, const Operands& op, const BnTensors& t, bool float32_io) {
  return gemm == Gemm::kSmallM ? small_m_linear(op, t, float32_io) : cublas_linear(op, t, float32_io);
}

// The GEMM launch of either fused kernel (the same arguments and outputs; not lowp_cublas).
// coeff_out: lowp_sm90's eval with z_out only.
cudaError_t launch_gemm(bool sm90, bool train, const Operands& op, torch::Tensor& out,
                        const fgb::LowpBatchNormArgs& bn, float* part_mean, float* part_m2, void* z_out,
                        cudaStream_t stream, float* coeff_out = nullptr) {
  if (!sm90)
    return fgb::lowp_gemm_bn(bn, train, op.x.data_ptr(), op.weight.data_ptr(), out.data_ptr(), op.M, op.N, op.K,
                             part_mean, part_m2, z_out, stream);
  // The split tiles' workspace (small grids only), its arrival counts zeroed.
  int64_t workspace_floats = 0;
  int zero_ints = 0;
  fgb::lowp_sm90_workspace(op.M, op.N, op.K, &workspace_floats, &zero_ints);
  torch::Tensor workspace;
  if (workspace_floats > 0) {
    workspace = torch::empty({workspace_floats}, op.x.options().dtype(torch::kFloat32));
    const cudaError_t err = cudaMemsetAsync(workspace.data_ptr<float>() + (workspace_floats - zero_ints), 0,
                                            static_cast<size_t>(zero_ints) * sizeof(int), stream);
    if (err != cudaSuccess) return err;
  }
  return fgb::lowp_sm90_gemm_bn(bn, train, op.w_float32, op.x.data_ptr(), op.weight.data_ptr(), out.data_ptr(),
                                op.M, op.N, op.K, part_mean, part_m2, z_out, coeff_out,
                                workspace_floats > 0 ? workspace.data_ptr<float>() : nullptr, stream);
}

// What a training forward returns: out (M, N) in the vectors' dtype; with
// `saved`, also the Linear output z (M, N) in x's dtype and coeff (4, N) float32
// = {mean, invstd, bn.weight, bn.bias} per feature (bn_16bit.cu), for the backward.
struct TrainResult {
  torch::Tensor out, z, coeff;
};

// lowp_cublas training takes bn_16bit_strip.cu's one kernel (batches of at most 1024
// rows) for problem 33 at every N, and for problem 84 up to this N.  Measured against
// the chain + fold kernels (H200, bfloat16, GPU time of the whole call, docs/perf.md v33):
// 84 at N <= 4096 0.85-0.96 of their time; at N >= 5000 1.02-1.05 (the strip kernel's
// 2-4 CTAs per SM with their serial reductions cost more than the fold's launch
// there); problem 33 (where it also replaces bn16_apply) 0.71-1.01 everywhere.  Batches of
// at most lowp_bn_strip_small_rows() rows take its small-batch forms at any N: at 12-128 rows
// x 8192 x 8192, problem 84's call takes 0.89-0.95 of its time on the chain + fold kernels back
// to back, 0.88-0.96 synchronized (H200, float16 and bfloat16, docs/perf.md v106).
constexpr int kStripMaxFeatures84 = 4096;

// The training forward of either problem.
TrainResult train(Gemm gemm, const torch::Tensor& x_in, const torch::Tensor& weight, BnTensors t,
                  torch::Tensor& num_batches_tracked, double momentum, double eps, bool scale_after_bn,
                  bool saved = false) {
  const int scale_stride = scale_in_place(t.scale);  // every 16-bit kernel reads one number in place
  const Operands op = check_operands(x_in, weight, gemm);
  const int M = op.M, N = op.N;
  check_training(op.x, M, N, num_batches_tracked);
  const bool float32_io = check_bn_tensors(t, N, op.x, gemm, op.w_float32);
  TORCH_CHECK(!saved || !op.w_float32, "forward_train_saved takes gemm.weight in x's dtype (", op.x.scalar_type(),
              "; the backward's products need it), got float32");
  const c10::cuda::CUDAGuard guard(op.x.device());
  const cudaStream_t stream = current_stream(op.x);
  const auto f32 = op.x.options().dtype(torch::kFloat32);
  TrainResult r;
  if (gemm == Gemm::kSmallM && N > 0 && !op.w_float32) {  // the strip's BatchNorm in the product's epilogue
    const fgb::LowpBatchNormArgs bn = bn_args(op.dtype, float32_io, t, scale_stride,
                                              num_batches_tracked.data_ptr<int64_t>(), momentum, eps, scale_after_bn);
    const int sms = num_sms(op.x);
    if (fgb::lowp_small_m_fuses(true, M, N, op.K, sms, bn)) {
      const torch::Tensor z = torch::empty({M, N}, op.x.options());
      r.coeff = torch::empty({4, N}, f32);
      r.out = saved ? torch::empty_like(z) : z;  // 16-bit vectors here: out in z's dtype, in place unless z is kept
      if (saved) r.z = z;
      if (momentum < 0) num_batches_tracked.add_(1);  // read by the kernel (momentum=None)
      check_launch(fgb::lowp_small_m_linear_bn(bn, true, op.x.data_ptr(), op.weight.data_ptr(), z.data_ptr(),
                                               r.out.data_ptr(), r.coeff.data_ptr<float>(), M, N, op.K, sms, stream),
                   "small_m_16bit_kernel (training, BatchNorm fused)");
      if (scale_after_bn)
        check_launch(fgb::lowp_softmax_rows(bn, r.out.data_ptr(), r.coeff.data_ptr<float>(), M, N, stream),
                     "bn16_softmax_rows_kernel (training)");
      return r;
    }
  }
  torch::Tensor z;  // product_first: the product, before the chain (launched before any allocation of this call)
  if (product_first(gemm) && N > 0) z = linear_product(gemm, op, t, float32_io);
  r.coeff = torch::empty({4, N}, f32);
  // product_first without saved z and 16-bit out: the chain runs in place over z.
  const bool in_place = z.defined() && !saved && !float32_io;
  r.out = in_place ? z : torch::empty({M, N}, op.x.options().dtype(t.bias.scalar_type()));
  if (saved) r.z = z.defined() ? z : torch::empty({M, N}, op.x.options());
  if (N == 0) {  // nothing to normalise; the call still counts, as nn.BatchNorm1d's
    num_batches_tracked.add_(1);
    return r;
  }
  torch::Tensor& out = r.out;
  float* coeff = r.coeff.data_ptr<float>();
  const fgb::LowpBatchNormArgs bn = bn_args(op.dtype, float32_io, t, scale_stride,
                                            num_batches_tracked.data_ptr<int64_t>(), momentum, eps, scale_after_bn);
  if (product_first(gemm) && (!scale_after_bn || N <= kStripMaxFeatures84 || M <= fgb::lowp_bn_strip_small_rows()) &&
      fgb::lowp_bn_strip_train_fits(M, N, z.data_ptr(), out.data_ptr())) {
    // One kernel for the statistics, the running statistics, coeff and (33) the output.
    if (momentum < 0) num_batches_tracked.add_(1);  // read by the kernel (momentum=None)
    check_launch(fgb::lowp_bn_strip_train(bn, z.data_ptr(), out.data_ptr(), M, N, coeff, stream),
                 "bn16_strip_train_kernel");
    if (scale_after_bn)
      check_launch(fgb::lowp_softmax_rows(bn, out.data_ptr(), coeff, M, N, stream),
                   "bn16_softmax_rows_kernel (training)");
    return r;
  }
  const int block_m = fgb::lowp_gemm_block_m();
  const int num_m_tiles = (M + block_m - 1) / block_m;
  // part_mean | part_m2 (num_m_tiles x N each).
  const int64_t part_floats = static_cast<int64_t>(num_m_tiles) * N;
  torch::Tensor scratch = torch::empty({2 * part_floats}, f32);
  float* part_mean = scratch.data_ptr<float>();
  float* part_m2 = part_mean + part_floats;
  if (product_first(gemm)) {
    check_launch(fgb::lowp_bn_chain_train(bn, z.data_ptr(), out.data_ptr(), M, N, part_mean, part_m2, stream),
                 gemm_kernel_name(gemm, true));
  } else {
    check_launch(launch_gemm(gemm == Gemm::kSm90, true, op, out, bn, part_mean, part_m2,
                             saved ? r.z.data_ptr() : nullptr, stream),
                 gemm_kernel_name(gemm, true));
  }
  check_launch(fgb::lowp_bn_fold_train(bn, part_mean, part_m2, num_m_tiles, block_m, M, N, coeff, stream),
               "bn16_fold_train_kernel");
  if (!scale_after_bn) {
    check_launch(fgb::lowp_bn_apply(bn, out.data_ptr(), coeff, M, N, stream), "bn16_apply_kernel");
  } else {
    check_launch(fgb::lowp_softmax_rows(bn, out.data_ptr(), coeff, M, N, stream),
                 "bn16_softmax_rows_kernel (training)");
  }
  return r;
}

// What an eval forward returns: out (M, N) in the vectors' dtype; with `saved` (the
// eval forward with gradients) also the Linear output z (M, N) in x's dtype and coeff
// (4, N) float32 (rows) = {running_mean, rsqrtf(running_var + eps), bn.weight, bn.bias}
// as the chain used them, for bn_backward_eval.
struct EvalResult {
  torch::Tensor out, z, coeff;
};

// The eval forward of either problem.  `saved` runs on lowp_cublas, and on lowp_sm90 for a
// 16-bit module (its kEvalSaved epilogue also stores z and coeff); lowp_sm80's eval keeps no z.
EvalResult eval(Gemm gemm, const torch::Tensor& x_in, const torch::Tensor& weight, BnTensors t, double eps,
                bool scale_after_bn, bool saved = false) {
  const int scale_stride = scale_in_place(t.scale);  // every 16-bit kernel reads one number in place
  const Operands op = check_operands(x_in, weight, gemm);
  const int M = op.M, N = op.N;
  const bool float32_io = check_bn_tensors(t, N, op.x, gemm, op.w_float32);
  TORCH_CHECK(!saved || product_first(gemm) || (gemm == Gemm::kSm90 && !float32_io),
              "forward_eval_saved runs on lowp_cublas or lowp_small_m, or lowp_sm90 with 16-bit parameters (lowp_sm80's eval epilogue "
              "keeps no Linear output)");
  TORCH_CHECK(!saved || !op.w_float32, "forward_eval_saved takes gemm.weight in x's dtype (", op.x.scalar_type(),
              "; the backward's products need it), got float32");
  const c10::cuda::CUDAGuard guard(op.x.device());
  const cudaStream_t stream = current_stream(op.x);
  EvalResult r;
  const fgb::LowpBatchNormArgs bn = bn_args(op.dtype, float32_io, t, scale_stride, nullptr, 0.0, eps, scale_after_bn);
  if (gemm == Gemm::kSmallM && M > 0 && N > 0 && !op.w_float32) {  // problem 33: the chain in the product's epilogue
    const int sms = num_sms(op.x);
    if (fgb::lowp_small_m_fuses(false, M, N, op.K, sms, bn)) {
      const torch::Tensor z = torch::empty({M, N}, op.x.options());
      r.out = saved ? torch::empty_like(z) : z;  // in place unless z is kept
      if (saved) r.z = z, r.coeff = torch::empty({4, N}, op.x.options().dtype(torch::kFloat32));
      check_launch(fgb::lowp_small_m_linear_bn(bn, false, op.x.data_ptr(), op.weight.data_ptr(), z.data_ptr(),
                                               r.out.data_ptr(), saved ? r.coeff.data_ptr<float>() : nullptr, M, N,
                                               op.K, sms, stream),
                   "small_m_16bit_kernel (eval, BatchNorm fused)");
      return r;
    }
  }
  const bool z_first = product_first(gemm) && M > 0 && N > 0;
  const torch::Tensor z = z_first ? linear_product(gemm, op, t, float32_io) : torch::Tensor();  // launched first
  if (saved) r.coeff = torch::empty({4, N}, op.x.options().dtype(torch::kFloat32));
  if (z_first) {
    if (scale_after_bn && !float32_io) {  // 84: BatchNorm, scale and softmax in one pass over z
      r.out = saved ? torch::empty_like(z) : z;  // saved: z kept for the backward, out apart; else in place
      if (saved) r.z = z;
      check_launch(fgb::lowp_bn_softmax_rows_eval(bn, z.data_ptr(), r.out.data_ptr(), M, N,
                                                  saved ? r.coeff.data_ptr<float>() : nullptr, stream),
                   "bn16_softmax_rows_kernel (eval, BatchNorm fused)");
      return r;
    }
    // In place over z unless z is kept or out is float32.
    r.out = float32_io || saved ? torch::empty({M, N}, op.x.options().dtype(t.bias.scalar_type())) : z;
    if (saved) r.z = z;
    check_launch(fgb::lowp_bn_chain_eval(bn, z.data_ptr(), r.out.data_ptr(), M, N,
                                         saved ? r.coeff.data_ptr<float>() : nullptr, stream),
                 gemm_kernel_name(gemm, false));
    if (scale_after_bn)
      check_launch(fgb::lowp_softmax_rows(bn, r.out.data_ptr(), nullptr, M, N, stream),
                   "bn16_softmax_rows_kernel (eval)");
    return r;
  }
  r.out = torch::empty({M, N}, op.x.options().dtype(t.bias.scalar_type()));
  if (saved) r.z = torch::empty({M, N}, op.x.options());
  if (M == 0 || N == 0) return r;  // (saved: coeff is never read, as no row has a gradient)
  check_launch(launch_gemm(gemm == Gemm::kSm90, false, op, r.out, bn, nullptr, nullptr,
                           saved ? r.z.data_ptr() : nullptr, stream, saved ? r.coeff.data_ptr<float>() : nullptr),
               gemm_kernel_name(gemm, false));
  if (scale_after_bn)
    check_launch(fgb::lowp_softmax_rows(bn, r.out.data_ptr(), nullptr, M, N, stream),
                 "bn16_softmax_rows_kernel (eval)");
  return r;
}

// The backward after the GEMM's outputs: grad_z (M, N) in z's dtype; the parameter gradients
// in the scale's dtype (the vectors': z's, or float32 under autocast), grad_bias in eval only
// (undefined in training, where it is 0).  grad_scale has the scale's shape ((N), or (1) for
// one number of shape (1)); a scale read as one number gives [its gradient, 0, ..., 0]
// (kernels/scale_terms.cuh).
struct BnGrads {
  torch::Tensor grad_z, grad_bias, grad_scale, grad_bn_weight, grad_bn_bias;
};

// The backward after the GEMM (bn_16bit_backward.cu), training (batch coefficients) or eval.
BnGrads bn_backward(torch::Tensor grad_y, torch::Tensor z, torch::Tensor coeff, torch::Tensor scale,
                    bool scale_after_bn, bool training) {
  const int scale_stride = scale_in_place(scale);  // every 16-bit kernel reads one number in place
  TORCH_CHECK(z.is_cuda() && (z.scalar_type() == torch::kHalf || z.scalar_type() == torch::kBFloat16) &&
                  z.dim() == 2 && z.is_contiguous(),
              "z must be a contiguous 2-D float16 or bfloat16 CUDA tensor, got ", z.scalar_type(), " ", z.sizes());
  const int64_t M = z.size(0), N = z.size(1);
  TORCH_CHECK(M <= INT32_MAX && N <= INT32_MAX, "sizes must fit in int32, got ", z.sizes());
  TORCH_CHECK(grad_y.device() == z.device() && grad_y.sizes() == z.sizes() &&
                  (grad_y.scalar_type() == torch::kFloat32 || grad_y.scalar_type() == z.scalar_type()),
              "grad_y must be a ", z.sizes(), " float32 or ", z.scalar_type(), " tensor on ", z.device(), ", got ",
              grad_y.scalar_type(), " ", grad_y.sizes());
  TORCH_CHECK(coeff.device() == z.device() && coeff.scalar_type() == torch::kFloat32 && coeff.dim() == 2 &&
                  coeff.size(0) == 4 && coeff.size(1) == N && coeff.is_contiguous(),
              "coeff must be a contiguous (4, ", N, ") float32 tensor on ", z.device());
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 || scale.scalar_type() == z.scalar_type(), "scale must be ",
              z.scalar_type(), " or float32, got ", scale.scalar_type());
  check_vector(scale, "scale", N, z, scale.scalar_type(), true);
  const torch::Tensor g = grad_y.contiguous();
  const c10::cuda::CUDAGuard guard(z.device());
  const cudaStream_t stream = current_stream(z);
  // Separate tensors (no views: the operators' outputs may not alias); a batch of no rows
  // gives zero parameter gradients (no kernel runs).
  const int64_t scale_len = scale.size(0);
  const auto vectors = z.options().dtype(scale.scalar_type());
  auto vector = [&](int64_t n) { return M == 0 ? torch::zeros({n}, vectors) : torch::empty({n}, vectors); };
  BnGrads r{torch::empty_like(z), training ? torch::Tensor() : vector(N), vector(scale_len), vector(N), vector(N)};
  const torch::Tensor terms = scale_stride == 0 && M > 0 ? torch::empty({N}, z.options().dtype(torch::kFloat64))
                                                         : torch::Tensor();
  // The backward reads the scale of the call's BatchNorm side (coeff holds the rest).
  fgb::LowpBatchNormArgs bn{};
  bn.dtype = dtype_code(z.scalar_type());
  bn.float32_io = scale.scalar_type() == torch::kFloat32;
  bn.scale = scale.data_ptr();
  bn.scale_stride = scale_stride;
  bn.scale_after_bn = scale_after_bn;
  const fgb::LowpBnGrads out{r.grad_z.data_ptr(),
                             training ? nullptr : r.grad_bias.data_ptr(),
                             r.grad_scale.data_ptr(),
                             static_cast<int>(scale_len),
                             r.grad_bn_weight.data_ptr(),
                             r.grad_bn_bias.data_ptr(),
                             terms.defined() ? terms.data_ptr<double>() : nullptr};
  check_launch(fgb::lowp_bn_backward(bn, g.scalar_type() == torch::kFloat32, training, g.data_ptr(), z.data_ptr(),
                                     coeff.data_ptr<float>(), static_cast<int>(M), static_cast<int>(N), out, stream),
               training ? "bn16_backward_kernel (training)" : "bn16_backward_kernel (eval)");
  return r;
}

// Problem 84's row softmax backward (softmax_16bit_backward.cu): grad_v = out (grad_out -
// sum_n grad_out out) per row, out and grad_out (M, N) CUDA tensors of one dtype (float16,
// bfloat16, or float32: a float32 module under autocast), grad_v contiguous in that dtype.
// The row's sum in float64, each element rounded once from float32 (torch's 16-bit kernel
// rounds grad_out out to the 16-bit type first).
torch::Tensor softmax_rows_backward(torch::Tensor out, torch::Tensor grad_out) {
  const auto dtype = out.scalar_type();
  TORCH_CHECK(out.is_cuda() && grad_out.device() == out.device(),
              "softmax_rows_backward: out and grad_out must be CUDA tensors on one device, got ", out.device(),
              " and ", grad_out.device());
  TORCH_CHECK((dtype == torch::kHalf || dtype == torch::kBFloat16 || dtype == torch::kFloat32) &&
                  grad_out.scalar_type() == dtype,
              "softmax_rows_backward: out and grad_out must be of one dtype, float16, bfloat16 or float32, got ",
              dtype, " and ", grad_out.scalar_type());
  TORCH_CHECK(out.dim() == 2 && grad_out.sizes() == out.sizes(),
              "softmax_rows_backward: expected out and grad_out of one (M, N) shape, got ", out.sizes(), " and ",
              grad_out.sizes());
  TORCH_CHECK(out.size(0) <= INT32_MAX && out.size(1) <= INT32_MAX, "softmax_rows_backward: sizes must fit in int32");
  const torch::Tensor o = out.contiguous(), g = grad_out.contiguous();
  torch::Tensor grad_v = torch::empty_like(o);
  const c10::cuda::CUDAGuard guard(out.device());
  check_launch(fgb::lowp_softmax_rows_backward(dtype == torch::kFloat32 ? 0 : dtype_code(dtype), dtype == torch::kFloat32,
                                               o.data_ptr(), g.data_ptr(), grad_v.data_ptr(),
                                               static_cast<int>(out.size(0)), static_cast<int>(out.size(1)),
                                               current_stream(out)),
               "softmax_rows_backward_kernel");
  return grad_v;
}

// ---------------------------------------------------------------------------
// The forward with gradients: one autograd node (torch::autograd::Function)
// ---------------------------------------------------------------------------
// Eager calls with gradients come here in one extension call: the node is made in
// C++, so the first kernel launches ~20 us sooner than through a Python
// torch.autograd.Function (docs/perf.md v47).  torch.compile, torch.export and
// torch.jit.trace record the fused_gemm_bn:: operators instead, whose backward is one
// operator, fused_gemm_bn::backward_16bit: backward_grads below through backward_16bit
// (tests/test_lowp.py checks the two paths give the same bits).

// a @ b of 16-bit operands (cuBLAS, float32 accumulation) as out_dtype: the 16-bit
// product itself; for float32 (a float32 module's gradients under autocast)
// aten::mm.dtype (torch >= 2.8: the float32 accumulator written once), else the
// 16-bit product cast.
torch::Tensor mm_16bit(const torch::Tensor& a, const torch::Tensor& b, c10::ScalarType out_dtype) {
  if (out_dtype == a.scalar_type()) return at::mm(a, b);
  if (out_dtype == torch::kFloat32) {
    static const c10::optional<c10::OperatorHandle> mm_dtype =
        c10::Dispatcher::singleton().findSchema({"aten::mm", "dtype"});
    if (mm_dtype.has_value())
      return mm_dtype->typed<at::Tensor(const at::Tensor&, const at::Tensor&, c10::ScalarType)>().call(
          a, b, torch::kFloat32);
  }
  return at::mm(a, b).to(out_dtype);
}

// The gradients with respect to (x, gemm.weight, gemm.bias, scale, bn.weight, bn.bias)
// (undefined where `needs` is false), from what the forward kept: x16, w16 the GEMM's
// 16-bit operands, z (M, N) the Linear output, coeff (4, N), out (problem 84's softmax
// output; undefined for 33):
//   problem 84: dy = softmax_rows_backward(out, grad_out) (softmax_16bit_backward.cu)
//   grad_z (z's dtype), grad_bias (eval), grad_scale, grad_bn_weight, grad_bn_bias (the
//   scale's dtype, rounded once from float64) = bn_backward(dy, ...)
//   grad_x = grad_z w16 and grad_W = grad_z^T x16 (mm_16bit, in x's and the weight's dtype)
//   grad_bias: training exactly 0 (BatchNorm subtracts the batch mean, which holds the
//   bias); eval sum_m grad_z, from bn_backward's float64 sums.
// The vectors' gradients are returned in vector_dtype (the parameters': 16-bit, or
// float32 under autocast; the scale's, so no copy is made).
std::array<torch::Tensor, 6> backward_grads(bool training, bool scale_after_bn, const torch::Tensor& grad_out,
                                            const torch::Tensor& x16, const torch::Tensor& w16,
                                            const torch::Tensor& scale, const torch::Tensor& z,
                                            const torch::Tensor& coeff, const torch::Tensor& out,
                                            const std::array<bool, 6>& needs, c10::ScalarType x_dtype,
                                            c10::ScalarType weight_dtype, c10::ScalarType vector_dtype) {
  std::array<torch::Tensor, 6> grads;
  if (needs[2] && training) grads[2] = torch::zeros({z.size(1)}, coeff.options().dtype(vector_dtype));
  if (!(needs[0] || needs[1] || needs[3] || needs[4] || needs[5] || (needs[2] && !training))) return grads;
  torch::Tensor dy = grad_out.contiguous();
  if (scale_after_bn) dy = softmax_rows_backward(out, dy);
  const BnGrads r = bn_backward(dy, z, coeff, scale, scale_after_bn, training);
  if (needs[2] && !training) grads[2] = r.grad_bias.to(vector_dtype);
  if (needs[0]) grads[0] = mm_16bit(r.grad_z, w16, x_dtype);
  if (needs[1]) grads[1] = mm_16bit(r.grad_z.t(), x16, weight_dtype);
  if (needs[3]) grads[3] = r.grad_scale.to(vector_dtype);  // the scale's shape: (N), or (1) for one number
  if (needs[4]) grads[4] = r.grad_bn_weight.to(vector_dtype);
  if (needs[5]) grads[5] = r.grad_bn_bias.to(vector_dtype);
  return grads;
}

// forward(ctx, gemm, training, x, weight, bias, scale, bn_weight, bn_bias, running_mean,
// running_var, num_batches_tracked, momentum, eps, scale_after_bn, weight_cast): the
// forward_train_saved / forward_eval_saved call (the running statistics updated in
// training, as forward_train); saved: x16, w16, scale, z, coeff and (84) out.  The
// buffers and weight_cast never require gradients (their gradients are undefined).
// backward: backward_grads, in the inputs' dtypes; with create_graph=True it raises
// (the kernels are not differentiable again, as a once_differentiable Function).
struct GradForward : public torch::autograd::Function<GradForward> {
  static constexpr int kNumArgs = 15;  // forward's arguments after ctx
  static constexpr int kFirstInput = 2;  // x's position among them (x, weight, bias, scale, bn_weight, bn_bias)

  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const std::string& gemm, bool training,
                               const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                               const torch::Tensor& scale, const torch::Tensor& bn_weight,
                               const torch::Tensor& bn_bias, const torch::Tensor& running_mean,
                               const torch::Tensor& running_var, const torch::Tensor& num_batches_tracked,
                               double momentum, double eps, bool scale_after_bn,
                               const c10::optional<torch::Tensor>& weight_cast) {
    const bool autocast = weight_cast.has_value() && weight_cast->defined();
    const torch::Tensor x16 = autocast ? x.to(weight_cast->scalar_type()) : x;
    const torch::Tensor w16 = autocast ? *weight_cast : weight;
    const BnTensors t{bias, scale, bn_weight, bn_bias, running_mean, running_var};
    torch::Tensor out, z, coeff;
    if (training) {
      torch::Tensor counter = num_batches_tracked;
      TrainResult r = train(parse_gemm(gemm), x16, w16, t, counter, momentum, eps, scale_after_bn, true);
      out = r.out, z = r.z, coeff = r.coeff;
    } else {
      EvalResult r = eval(parse_gemm(gemm), x16, w16, t, eps, scale_after_bn, true);
      out = r.out, z = r.z, coeff = r.coeff;
    }
    ctx->saved_data["training"] = training;
    ctx->saved_data["scale_after_bn"] = scale_after_bn;
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["weight_dtype"] = static_cast<int64_t>(weight.scalar_type());
    ctx->saved_data["vector_dtype"] = static_cast<int64_t>(bias.scalar_type());
    ctx->save_for_backward({x16, w16, scale, z, coeff, scale_after_bn ? out : torch::Tensor()});
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    TORCH_CHECK(!at::GradMode::is_enabled(), "ModelNew's 16-bit backward cannot be differentiated again "
                "(create_graph=True, double backward): its kernels have no derivative of their own");
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    std::array<bool, 6> needs;
    for (size_t i = 0; i < needs.size(); ++i) needs[i] = ctx->needs_input_grad(i);  // x .. bn_bias: edges 0-5
    auto dtype = [ctx](const char* key) { return static_cast<c10::ScalarType>(ctx->saved_data[key].toInt()); };
    const std::array<torch::Tensor, 6> grads =
        backward_grads(ctx->saved_data["training"].toBool(), ctx->saved_data["scale_after_bn"].toBool(),
                       grad_outputs[0], saved[0], saved[1], saved[2], saved[3], saved[4], saved[5], needs,
                       dtype("x_dtype"), dtype("weight_dtype"), dtype("vector_dtype"));
    torch::autograd::variable_list result(kNumArgs);
    for (size_t i = 0; i < grads.size(); ++i) result[kFirstInput + i] = grads[i];
    return result;
  }
};

}  // namespace

// Linear -> scale -> BatchNorm1d (problem 33) or Linear -> BatchNorm1d -> scale
// -> Softmax (problem 84), training mode.
torch::Tensor forward_train(const std::string& gemm, torch::Tensor x, torch::Tensor weight, torch::Tensor bias,
                            torch::Tensor scale, torch::Tensor bn_weight, torch::Tensor bn_bias,
                            torch::Tensor running_mean, torch::Tensor running_var, torch::Tensor num_batches_tracked,
                            double momentum, double eps, bool scale_after_bn) {
  return train(parse_gemm(gemm), x, weight, {bias, scale, bn_weight, bn_bias, running_mean, running_var},
               num_batches_tracked, momentum, eps, scale_after_bn)
      .out;
}

// forward_train, also returning what the backward needs: (out, z, coeff) (TrainResult).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> forward_train_saved(
    const std::string& gemm, torch::Tensor x, torch::Tensor weight, torch::Tensor bias, torch::Tensor scale,
    torch::Tensor bn_weight, torch::Tensor bn_bias, torch::Tensor running_mean, torch::Tensor running_var,
    torch::Tensor num_batches_tracked, double momentum, double eps, bool scale_after_bn) {
  TrainResult r = train(parse_gemm(gemm), x, weight, {bias, scale, bn_weight, bn_bias, running_mean, running_var},
                        num_batches_tracked, momentum, eps, scale_after_bn, true);
  return {r.out, r.z, r.coeff};
}

// The training backward after the GEMM (bn_16bit_backward.cu): grad_y (M, N), dL/dout
// (problem 33) or dL/d(softmax input) (84), float32 or z's dtype; z (M, N) and coeff (4, N)
// from forward_train_saved; scale (N) of the vectors' dtype (z's, or float32 under
// autocast).  Returns (grad_z (M, N) in z's dtype, grad_scale, grad_bn_weight, grad_bn_bias
// in the scale's dtype; BnGrads: grad_scale has the scale's shape).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> bn_backward_train(
    torch::Tensor grad_y, torch::Tensor z, torch::Tensor coeff, torch::Tensor scale, bool scale_after_bn) {
  const BnGrads r = bn_backward(grad_y, z, coeff, scale, scale_after_bn, true);
  return {r.grad_z, r.grad_scale, r.grad_bn_weight, r.grad_bn_bias};
}

// bn_backward_train's eval counterpart: z and coeff from forward_eval_saved (running
// statistics); also the Linear bias's gradient, sum_m grad_z (from the float64 sums).
// Returns (grad_z, grad_bias, grad_scale, grad_bn_weight, grad_bn_bias).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> bn_backward_eval(
    torch::Tensor grad_y, torch::Tensor z, torch::Tensor coeff, torch::Tensor scale, bool scale_after_bn) {
  const BnGrads r = bn_backward(grad_y, z, coeff, scale, scale_after_bn, false);
  return {r.grad_z, r.grad_bias, r.grad_scale, r.grad_bn_weight, r.grad_bn_bias};
}

// The 16-bit backward in one call: model_new_lowp's fused_gemm_bn::backward_16bit operator,
// the backward of the 16-bit forward_train_saved / forward_eval_saved operators (what
// torch.compile, torch.export and torch.jit.trace record; one operator in place of three, two
// products and the conversions: ~150-250 us less host time a compiled step, docs/perf.md v84).
// backward_grads from what those operators keep (x16, w16, scale, z, coeff; out for problem 84,
// None for 33); needs: 6 flags, (x, gemm.weight, gemm.bias, scale, bn.weight, bn.bias).  Returns
// the wanted gradients only, in that order: x's in x16's dtype, the weight's in w16's, the four
// vectors' in the scale's.
std::vector<torch::Tensor> backward_16bit(bool training, bool scale_after_bn, torch::Tensor grad_out,
                                          torch::Tensor x16, torch::Tensor w16, torch::Tensor scale,
                                          torch::Tensor z, torch::Tensor coeff, c10::optional<torch::Tensor> out,
                                          std::vector<bool> needs) {
  TORCH_CHECK(needs.size() == 6, "backward_16bit: needs holds 6 flags (x, weight, bias, scale, bn_weight, bn_bias), "
              "got ", needs.size());
  const bool has_out = out.has_value() && out->defined();
  TORCH_CHECK(has_out == scale_after_bn, "backward_16bit: the softmax output is given exactly for problem 84 "
              "(scale_after_bn)");
  std::array<bool, 6> want;
  for (size_t i = 0; i < want.size(); ++i) want[i] = needs[i];
  const std::array<torch::Tensor, 6> grads =
      backward_grads(training, scale_after_bn, grad_out, x16, w16, scale, z, coeff, has_out ? *out : torch::Tensor(),
                     want, x16.scalar_type(), w16.scalar_type(), scale.scalar_type());
  std::vector<torch::Tensor> wanted;
  for (size_t i = 0; i < want.size(); ++i)
    if (want[i]) wanted.push_back(grads[i]);
  return wanted;
}

// Either problem, eval mode.
torch::Tensor forward_eval(const std::string& gemm, torch::Tensor x, torch::Tensor weight, torch::Tensor bias,
                           torch::Tensor scale, torch::Tensor bn_weight, torch::Tensor bn_bias,
                           torch::Tensor running_mean, torch::Tensor running_var, double eps, bool scale_after_bn) {
  return eval(parse_gemm(gemm), x, weight, {bias, scale, bn_weight, bn_bias, running_mean, running_var}, eps,
              scale_after_bn)
      .out;
}

// forward_eval, also returning what the backward needs: (out, z, coeff) (EvalResult); lowp_cublas, or
// lowp_sm90 with 16-bit vectors.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> forward_eval_saved(
    const std::string& gemm, torch::Tensor x, torch::Tensor weight, torch::Tensor bias, torch::Tensor scale,
    torch::Tensor bn_weight, torch::Tensor bn_bias, torch::Tensor running_mean, torch::Tensor running_var, double eps,
    bool scale_after_bn) {
  EvalResult r = eval(parse_gemm(gemm), x, weight, {bias, scale, bn_weight, bn_bias, running_mean, running_var}, eps,
                      scale_after_bn, true);
  return {r.out, r.z, r.coeff};
}

// The forward with gradients (eager): out (M, N), whose grad_fn is GradForward's node.
// Training: any route; eval: lowp_cublas or lowp_sm90 (forward_eval_saved's).  weight_cast: see
// GradForward (None for a 16-bit module).
torch::Tensor forward_grad(const std::string& gemm, bool training, torch::Tensor x, torch::Tensor weight,
                           torch::Tensor bias, torch::Tensor scale, torch::Tensor bn_weight, torch::Tensor bn_bias,
                           torch::Tensor running_mean, torch::Tensor running_var, torch::Tensor num_batches_tracked,
                           double momentum, double eps, bool scale_after_bn, c10::optional<torch::Tensor> weight_cast) {
  return GradForward::apply(gemm, training, x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var,
                            num_batches_tracked, momentum, eps, scale_after_bn, weight_cast);
}
