// torch_binding.cpp -- PyTorch entry points of the float32 extension: the fused
// forwards of Linear -> scale -> BatchNorm1d (problem 33) and Linear ->
// BatchNorm1d -> scale -> Softmax (problem 84), and the backward's pieces.
// Passed to load_inline as cpp_sources (torch/extension.h is prepended there);
// the launchers it calls are declared in launchers.cuh and take raw pointers.
//
// This file carries out a decision made elsewhere: the first argument of each
// forward and of gemm_nt names the GEMM kernel that model_new.py's dispatch
// chose (`gemm`, one of the names below); nothing here picks another one.  Each
// entry point checks every tensor (device, dtype, shape, contiguity), takes a
// device guard for x's GPU, launches on that GPU's current stream, and turns
// any launch error into a RuntimeError naming the launcher.  Nothing here
// synchronises.  scale_after_bn selects the problem everywhere: false = problem
// 33 (Linear -> scale -> BatchNorm), true = problem 84 (Linear -> BatchNorm ->
// scale -> Softmax).
//
//   gemm name             kernels
//   --------------------  ------------------------------------------------------------
//   sm90_fp16x3           sm90_prepass_fp16x3 over W's rows unless the caller passes
//                         w_parts (its cached result), then over x (fp16 parts and row
//                         scales; training: num_batches_tracked += 1), then
//                         sm90_gemm_fp16x3_{train,eval,plain} (wgmma, TMA; sm_90a).
//                         Any in_features K >= 1 and weight alignment: the parts'
//                         rows are K_pad = round_up(K, 8) fp16 words, zeros past K
//   sm80_3xtf32           the forwards: row_sums over W's rows unless the caller passes
//                         w_parts (its cached result), row_centers over x; then
//                         sm80_prepass_3xtf32 (x's TF32 parts; training: += 1), then
//                         sm80_gemm_3xtf32_{train,eval} (mma.sync, any sm_80+); gemm_nt uncentred
//
//   forward_train(gemm, x, weight, bias, scale, bn_weight, bn_bias, running_mean,
//                 running_var, num_batches_tracked, momentum, eps, scale_after_bn,
//                 w_parts) -> out (M, N)
//       w_parts (every forward's last argument): None, or made while the weight held
//       its current values: fp16x3_weight_parts(weight) for sm90_fp16x3,
//       weight_row_sums(weight) for sm80_3xtf32 (its centring, centring.cuh).
//       the pre-pass and the training GEMM: z = x @ weight^T and per-tile mean / M2;
//       problem 33: bn_apply (merge statistics, running statistics, normalise in place);
//       problem 84: bn_softmax_fold_train (per-feature mean_z, a, c; running
//       statistics), then softmax_rows in place.
//       momentum < 0 means momentum=None (cumulative average).  A one-number scale
//       viewed as N (stride 0) is read in place by every route (BatchNormArgs::scale_stride).
//   forward_eval(gemm, x, weight, bias, scale, bn_weight, bn_bias, running_mean,
//                running_var, eps, scale_after_bn, w_parts) -> out (M, N)
//       the pre-pass, then one GEMM launch with the folded per-feature affine
//       epilogue; problem 84: then softmax_rows.
//   forward_train_saved(same arguments as forward_train) -> [out, z (M, N), stats (2, N)]
//       forward_train's work keeping z = x @ weight^T (no bias) and stats =
//       [mean_z | biased var_z] for the backward, which reads them only as z - stats[0]
//       and stats[1]: small_m_fp64 returns them centred (z - mean_z rounded once, and 0).
//   forward_eval_saved(same arguments as forward_eval) -> [out, z (M, N)]: eval with
//       gradients; z by gemm_nt's route, out from z with the running statistics' fold
//       (bn_fold_eval, then bn_apply_folded or softmax_rows)
//   gemm_nt(gemm, a (M, K), b (N, K), any strides, b_parts) -> a @ b^T (3xTF32, fp16x3, or
//       small_m_fp64 for M <= 16: float64 sums rounded once; b_parts as gemm_nn's)
//   gemm_nn(gemm, a (M, N), b (N, K), b_parts) -> a @ b: grad_x = grad_z W; on
//       sm90_fp16x3 b's fp16x3 parts (b_parts: cached, or None) read MN-major,
//       a split with b's row scales folded in (prepass_fp16x3_backward.cu)
//   gemm_tn(gemm, a (M, N), b (M, K)) -> a^T @ b: grad_W = grad_z^T x; on
//       sm90_fp16x3 both split per column and read MN-major; small_m_fp64 (M <= 16):
//       small_m_grad_w.cu, float64 sums rounded once
//   (both: other GEMM kernels, or N or K not a multiple of 8: gemm_nt on transposed copies)
//   fp16x3_weight_parts(weight (N, K)) -> float32 (N K_pad + N rounded up to 4 + 2 N),
//       K_pad = K rounded up to a multiple of 8: W's fp16x3 parts [w_hi | w_lo |
//       w_inv_scale | w_row_sum], rows of K_pad fp16 words (zeros past K), for w_parts
//   weight_row_sums(weight (N, K)) -> float32 (2 N): W's row sums as (hi, lo) pairs,
//       sm80_3xtf32's w_parts
//   bn_backward_train(grad_y, z, stats, scale, bn_weight, eps, scale_after_bn, bn_bias)
//       -> [grad_z, grad_scale, grad_bn_weight, grad_bn_bias]  (bn_backward.cu;
//       bn_bias None: problem 84's grad_scale without its bn_bias * sum(grad_y) term;
//       a one-number scale viewed as N: grad_scale = [its gradient, 0, ..., 0])
//   bn_backward_eval(grad_y, z, bias, scale, bn_weight, bn_bias, running_mean, running_var,
//       eps, scale_after_bn) -> [grad_z, grad_bias, grad_scale, grad_bn_weight, grad_bn_bias]
//       (bn_backward.cu's eval mode; grad_y of problem 84 is dL/dv, the softmax's backward)
//   softmax_rows_backward(out, grad_out) -> grad_v = out * (grad_out - sum_n grad_out * out)
//       per row (softmax_rows_backward.cu): problem 84's row softmax backward
//   Synchronized BatchNorm (statistics merged across processes in Python between calls):
//   sync_forward_local(gemm, x, weight, bias, num_batches_tracked, w_parts) -> [z (M, N),
//       local (3, N) float64 = [M | mean_z + bias | M2_z]]: the pre-pass (+= 1) and training GEMM
//   sync_bn_apply(z, gathered (world, 3, N), bias, scale, bn_weight, bn_bias, running_mean,
//       running_var, num_batches_tracked, momentum, eps, scale_after_bn) -> [out, stats (2, N),
//       count (1) float64]: the merge (bn_sync.cu), running statistics, then the
//       normalisation (problem 84: and the row softmax)
//   bn_backward_sums(grad_y, z, stats) -> (2, N) float64; bn_backward_grad(grad_y, z,
//       stats, bias, scale, bn_weight, eps, scale_after_bn, count (1-element float64 tensor),
//       local_sums, total_sums, bn_bias)
//       -> as bn_backward_train: the backward split around the all_reduce
//   sm90_gemm_available(device) -> bool: the device fact the dispatch reads (a query,
//       no launch).

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <string>

#include "binding_checks.cuh"
#include "launchers.cuh"

namespace {

namespace fgb = fused_gemm_bn;
using namespace fgb::binding;  // check_training, current_stream, feature_vector, num_sms

// The GEMM kernels a `gemm` name selects.  small_m_fp64 (small batches, small_m_fp64.cu) runs
// the forwards only (forward_train, forward_eval, forward_train_saved, sync_forward_local, and
// gemm_nt: eval with gradients' z).
enum class Gemm { kSm80, kFp16x3, kSmallM };

Gemm parse_gemm(const std::string& name, bool forward = false) {
  if (name == "sm90_fp16x3") return Gemm::kFp16x3;
  if (name == "sm80_3xtf32") return Gemm::kSm80;
  if (forward && name == "small_m_fp64") return Gemm::kSmallM;
  TORCH_CHECK(false, "fused_gemm_bn: unknown GEMM kernel '", name, "' (expected sm90_fp16x3, sm80_3xtf32",
              forward ? " or small_m_fp64)" : ")");
}

bool is_fp16x3(Gemm g) { return g == Gemm::kFp16x3; }

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "fused_gemm_bn: launch of ", what, " failed: ", cudaGetErrorString(err));
}

// broadcast_ok: a stride-0 view of one number passes too (scale_of_one_number, binding_checks.cuh).
void check_vector(const torch::Tensor& t, const char* name, int64_t n, const torch::Tensor& x,
                  bool broadcast_ok = false) {
  TORCH_CHECK(t.device() == x.device(), name, " must be on ", x.device(), ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, name, " must have shape (", n, "), got ", t.sizes());
  TORCH_CHECK(t.is_contiguous() || (broadcast_ok && t.stride(0) == 0), name, " must be contiguous");
}

// scale_for_kernel (binding_checks.cuh): the forwards and bn_backward_train read a one-number
// scale in place (BatchNormArgs::scale_stride 0); synchronized BatchNorm's take N floats
// (feature_vector copies).

// Checks x and weight and returns (M, N, K).  x may have any strides: the
// pre-pass reads it in place (the caller's tensor is never written).
std::tuple<int, int, int> check_gemm_operands(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor, got ", x.device());
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, "x must have shape (batch, in_features), got ", x.sizes());
  TORCH_CHECK(weight.device() == x.device(), "gemm.weight must be on ", x.device(), ", got ", weight.device());
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32, "gemm.weight must be float32, got ", weight.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == x.size(1), "gemm.weight must have shape (out_features, ",
              x.size(1), "), got ", weight.sizes());
  TORCH_CHECK(weight.is_contiguous(), "gemm.weight must be contiguous");
  TORCH_CHECK(x.size(0) <= INT32_MAX && weight.size(0) <= INT32_MAX && x.size(1) <= INT32_MAX,
              "sizes must fit in int32, got x ", x.sizes(), " and gemm.weight ", weight.sizes());
  const fgb::DeviceFacts facts = fgb::binding::facts_of(x);
  TORCH_CHECK(facts.cc_major >= 8, "fused_gemm_bn needs compute capability >= 8.0 (tensor-core TF32), got ",
              facts.cc_major, ".", facts.cc_minor, " on ", x.device());
  return {static_cast<int>(x.size(0)), static_cast<int>(weight.size(0)), static_cast<int>(x.size(1))};
}

// The per-feature vectors every forward takes, checked against x and N.
struct BnTensors {
  torch::Tensor bias, scale, bn_weight, bn_bias, running_mean, running_var;
};

void check_bn_tensors(const BnTensors& t, int N, const torch::Tensor& x, bool scale_broadcast_ok = false) {
  check_vector(t.bias, "gemm.bias", N, x);
  check_vector(t.scale, "scale", N, x, scale_broadcast_ok);
  check_vector(t.bn_weight, "bn.weight", N, x);
  check_vector(t.bn_bias, "bn.bias", N, x);
  check_vector(t.running_mean, "bn.running_mean", N, x);
  check_vector(t.running_var, "bn.running_var", N, x);
}

// The call's BatchNorm side as the launchers take it (launchers.cuh), filled
// once from the checked tensors.  num_batches_tracked: training (the counter the
// pre-pass increments), else null; momentum: training only.
fgb::BatchNormArgs batch_norm_args(const BnTensors& t, int scale_stride, double eps, bool scale_after_bn,
                                   const torch::Tensor* num_batches_tracked = nullptr, double momentum = 0.0) {
  fgb::BatchNormArgs bn;
  bn.bias = t.bias.data_ptr<float>();
  bn.scale = t.scale.data_ptr<float>();
  bn.scale_stride = scale_stride;
  bn.bn_weight = t.bn_weight.data_ptr<float>();
  bn.bn_bias = t.bn_bias.data_ptr<float>();
  bn.running_mean = t.running_mean.data_ptr<float>();
  bn.running_var = t.running_var.data_ptr<float>();
  bn.num_batches_tracked = num_batches_tracked != nullptr ? num_batches_tracked->data_ptr<int64_t>() : nullptr;
  bn.momentum = static_cast<float>(momentum);
  bn.eps = static_cast<float>(eps);
  bn.scale_after_bn = scale_after_bn;
  return bn;
}

// x's row centres c_m (centring.cuh) into center (M floats), or nothing (null).
void launch_row_centers(const torch::Tensor& x, int M, int K, float* center, cudaStream_t stream) {
  if (center != nullptr)
    check_launch(fgb::row_centers(x.data_ptr<float>(), x.stride(0), x.stride(1), M, K, center, stream),
                 "row_centers");
}

// x's TF32 parts in mma fragment order for the sm80 kernel
// (sm80_prepass_3xtf32), when centred its row centres, and the (M, K) x (N, K)
// GEMM's split-K workspace (its arrival counts zeroed by the pre-pass): one allocation.
struct FragmentX {
  torch::Tensor storage;
  const float* big;
  const float* small;
  const float* center;  // null: not centred
  float* workspace;     // null: K not split
};

// `num_batches_tracked`: incremented by the pre-pass in training, else null.
// centred: the parts are those of rn(x - c_m) (the forwards; not gemm_nt).
FragmentX sm80_prepass(const torch::Tensor& x, int M, int N, int K, int64_t* num_batches_tracked, bool centred,
                       cudaStream_t stream) {
  centred = centred && M >= 1 && K >= 1;
  const int64_t elems = fgb::sm80_prepass_elems(M, K);
  int64_t workspace_floats = 0;
  int zero_ints = 0;
  check_launch(fgb::sm80_gemm_3xtf32_workspace(M, N, K, &workspace_floats, &zero_ints), "sm80_gemm_3xtf32_workspace");
  const int64_t center_floats = centred ? M : 0;
  torch::Tensor storage = torch::empty({2 * elems + center_floats + workspace_floats}, x.options());
  float* big = storage.data_ptr<float>();
  float* small = big + elems;
  float* center = centred ? small + elems : nullptr;
  float* workspace = workspace_floats > 0 ? small + elems + center_floats : nullptr;
  int* arrivals = zero_ints > 0 ? reinterpret_cast<int*>(workspace + workspace_floats - zero_ints) : nullptr;
  launch_row_centers(x, M, K, center, stream);
  check_launch(fgb::sm80_prepass_3xtf32(x.data_ptr<float>(), x.stride(0), x.stride(1), M, K, center, big, small,
                                        num_batches_tracked, arrivals, zero_ints, stream),
               "sm80_prepass_3xtf32");
  return {storage, big, small, center, workspace};
}

// gemm.weight's row sums (N (hi, lo) fp32 pairs, 2 N floats: row_sums in
// centring.cu) for the 3xTF32 forwards' centring: the given tensor (checked;
// model_new.py keeps it while the weight is unchanged) or one made now.
struct WeightRowSums {
  torch::Tensor packed;
  const float2* row_sum;
};

WeightRowSums weight_row_sums_of(const torch::Tensor& weight, const c10::optional<torch::Tensor>& given, int N, int K,
                                 cudaStream_t stream) {
  WeightRowSums w;
  if (given.has_value() && given->defined()) {
    w.packed = *given;
    TORCH_CHECK(w.packed.device() == weight.device() && w.packed.scalar_type() == torch::kFloat32 &&
                    w.packed.dim() == 1 && w.packed.numel() == 2 * static_cast<int64_t>(N) &&
                    w.packed.is_contiguous(),
                "fused_gemm_bn: w_parts of a 3xTF32 GEMM must be weight_row_sums(gemm.weight): a contiguous float32 "
                "tensor of ", 2 * static_cast<int64_t>(N), " elements on ", weight.device());
  } else if (K < 1) {
    w.packed = torch::zeros({2 * static_cast<int64_t>(N)}, weight.options());  // unused: x is not centred
  } else {
    w.packed = torch::empty({2 * static_cast<int64_t>(N)}, weight.options());
    check_launch(fgb::row_sums(weight.data_ptr<float>(), weight.stride(0), weight.stride(1), N, K,
                               reinterpret_cast<float2*>(w.packed.data_ptr<float>()), stream),
                 "row_sums");
  }
  w.row_sum = reinterpret_cast<const float2*>(w.packed.data_ptr<float>());
  return w;
}

// The centring terms of a 3xTF32 forward (K >= 1: x centred, w's row sums) or none.
fgb::Centring centring_of(const float* center, const WeightRowSums& w) {
  return center != nullptr ? fgb::Centring{center, w.row_sum} : fgb::Centring{nullptr, nullptr};
}

// in_features as the fp16x3 operands' row length K_pad = round_up(K, 8)
// (fgb::fp16x3_padded_k): the pre-pass writes x's and W's parts in rows of K_pad
// fp16 words, zeros past K, and the GEMM runs over K_pad (sm90_gemm_fp16x3_bn.cu).
// `operand` names the (rows, K) tensor being split, for the message.
int fp16x3_k_pad(int64_t K, const char* operand) {
  TORCH_CHECK(K >= 1 && K <= INT32_MAX - 7, "fused_gemm_bn: sm90_fp16x3 needs ", operand,
              " of shape (rows, K) with 1 <= K <= ", INT32_MAX - 7, ", got K = ", K);
  return static_cast<int>(fgb::fp16x3_padded_k(K));
}

// x's fp16x3 parts for the fp16x3 kernel: x_hi, x_lo (M, K_pad) fp16 words,
// x_inv_scale (M), center (M), then the GEMM's split-tile workspace for an (M,
// K_pad) x (N, K_pad) product (null if it needs none), one allocation; the
// pre-pass reads x in place (any strides and alignment) and zeroes the
// workspace's arrival counts.
struct SplitX {
  torch::Tensor storage;
  fgb::Fp16x3Parts parts;
  float* workspace;
  int k_pad;  // the parts' row length: the K the GEMM runs over
};

SplitX fp16x3_prepass(const torch::Tensor& x, int M, int N, int K, int64_t* num_batches_tracked,
                      cudaStream_t stream) {
  const int k_pad = fp16x3_k_pad(K, "x");
  const int64_t part_floats = static_cast<int64_t>(M) * k_pad / 2;    // M K_pad fp16 words each: 16-byte multiple
  const int64_t scale_floats = (static_cast<int64_t>(M) + 3) / 4 * 4;  // keeps the workspace 16-byte aligned
  int64_t workspace_floats = 0;
  int zero_ints = 0;
  fgb::sm90_gemm_fp16x3_workspace(M, N, k_pad, &workspace_floats, &zero_ints);
  torch::Tensor storage = torch::empty({2 * part_floats + 2 * scale_floats + workspace_floats}, x.options());
  float* base = storage.data_ptr<float>();
  uint16_t* hi = reinterpret_cast<uint16_t*>(base);
  uint16_t* lo = reinterpret_cast<uint16_t*>(base + part_floats);
  float* inv_scale = base + 2 * part_floats;
  float* center = inv_scale + scale_floats;
  float* workspace = workspace_floats > 0 ? center + scale_floats : nullptr;
  int* arrivals = workspace != nullptr ? reinterpret_cast<int*>(workspace + workspace_floats - zero_ints) : nullptr;
  check_launch(fgb::sm90_prepass_fp16x3(x.data_ptr<float>(), x.stride(0), x.stride(1), M, K, hi, lo, inv_scale,
                                        center, nullptr, arrivals, arrivals ? zero_ints : 0, num_batches_tracked,
                                        stream),
               "sm90_prepass_fp16x3");
  return {storage, {hi, lo, inv_scale, center, nullptr}, workspace, k_pad};
}

// gemm.weight's fp16x3 parts as one float32 tensor: [w_hi (N, K_pad) fp16 words
// (N K_pad / 2 floats) | w_lo (N K_pad / 2) | w_inv_scale (N, padded to a
// multiple of 4) | w_row_sum (N (hi, lo) pairs)], K_pad = round_up(K, 8) with
// zeros in columns K .. K_pad - 1: the pre-pass run over W's rows.  model_new.py
// keeps it between calls (_weight_parts).
int64_t weight_parts_floats(int64_t N, int64_t K) {
  return N * fgb::fp16x3_padded_k(K) + (N + 3) / 4 * 4 + 2 * N;
}

// The fp16x3 parts inside a packed weight tensor (layout above; 16-byte aligned base).
fgb::Fp16x3Parts packed_weight_parts(float* base, int64_t N, int64_t K) {
  const int64_t part_floats = N * fgb::fp16x3_padded_k(K) / 2;
  float* inv_scale = base + 2 * part_floats;
  return {reinterpret_cast<const uint16_t*>(base), reinterpret_cast<const uint16_t*>(base + part_floats), inv_scale,
          nullptr, reinterpret_cast<const float2*>(inv_scale + (N + 3) / 4 * 4)};
}

// w (N, K) float32, any strides and alignment.
torch::Tensor split_weight(const torch::Tensor& w, int N, int K, cudaStream_t stream) {
  fp16x3_k_pad(K, "gemm.weight");
  torch::Tensor packed = torch::empty({weight_parts_floats(N, K)}, w.options());
  const fgb::Fp16x3Parts p = packed_weight_parts(packed.data_ptr<float>(), N, K);
  check_launch(fgb::sm90_prepass_fp16x3(w.data_ptr<float>(), w.stride(0), w.stride(1), N, K,
                                        const_cast<uint16_t*>(p.hi), const_cast<uint16_t*>(p.lo),
                                        const_cast<float*>(p.inv_scale), nullptr, const_cast<float2*>(p.row_sum),
                                        nullptr, 0, nullptr, stream),
               "sm90_prepass_fp16x3 (weight)");
  return packed;
}

// The parts of `weight` (N, K): the given packed tensor (checked), or a split made now.
struct WeightParts {
  torch::Tensor packed;
  fgb::Fp16x3Parts parts;
};

WeightParts weight_parts(const torch::Tensor& weight, const c10::optional<torch::Tensor>& given, int N, int K,
                         cudaStream_t stream) {
  WeightParts w;
  if (given.has_value() && given->defined()) {
    w.packed = *given;
    const int64_t floats = weight_parts_floats(N, K);
    TORCH_CHECK(w.packed.device() == weight.device() && w.packed.scalar_type() == torch::kFloat32 &&
                    w.packed.dim() == 1 && w.packed.numel() == floats && w.packed.is_contiguous() &&
                    reinterpret_cast<uintptr_t>(w.packed.data_ptr()) % 16 == 0,
                "fused_gemm_bn: w_parts must be fp16x3_weight_parts(gemm.weight) of the (", N, ", ", K,
                ") weight: a contiguous, 16-byte aligned float32 tensor of shape (", floats, ") on ",
                weight.device(), ", got ", w.packed.scalar_type(), " ", w.packed.sizes(), " on ", w.packed.device());
  } else {
    w.packed = split_weight(weight, N, K, stream);
  }
  w.parts = packed_weight_parts(w.packed.data_ptr<float>(), N, K);
  return w;
}

// The training GEMM (sm80_3xtf32 or sm90_fp16x3): the pre-pass
// (num_batches_tracked += 1 where `counter` is not null), then z = x @ weight^T into `z` with per-tile
// mean / M2 of z (part_mean, part_m2: num_m_tiles x N each; bn_apply /
// bn_softmax merge them, and write the backward's stats).  One allocation, which
// also holds `coeff` (3 N floats): the BatchNorm kernels' per-feature scratch.
struct TrainGemm {
  torch::Tensor storage;
  float *part_mean, *part_m2, *coeff;
  int block_m, num_m_tiles;
};

// x with unit column stride (small_m_fp64 reads rows of x through a row stride).
torch::Tensor with_unit_column_stride(const torch::Tensor& x) {
  return x.stride(1) == 1 || x.size(1) <= 1 ? x : x.contiguous();
}

// small_m_fp64's workspace (split K's partial sums, problem 84's float64 softmax input), or an
// undefined tensor where it needs none.
torch::Tensor small_m_workspace(const torch::Tensor& x, int M, int N, int K, bool scale_after_bn) {
  const int64_t bytes = fgb::small_m_fp64_workspace_bytes(M, N, K, fgb::binding::num_sms(x), scale_after_bn);
  return bytes > 0 ? torch::empty({bytes / 8}, x.options().dtype(torch::kFloat64)) : torch::Tensor();
}

void* data_or_null(const torch::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

TrainGemm train_gemm(Gemm gemm, const torch::Tensor& x, const torch::Tensor& weight,
                     const c10::optional<torch::Tensor>& w_parts, torch::Tensor& z, int64_t* counter, int M, int N,
                     int K, cudaStream_t stream) {
  const float* w = weight.data_ptr<float>();
  TrainGemm g;
  g.block_m = is_fp16x3(gemm) ? fgb::sm90_gemm_block_m() : fgb::sm80_gemm_block_m(M);
  g.num_m_tiles = (M + g.block_m - 1) / g.block_m;
  const int64_t part_floats = static_cast<int64_t>(g.num_m_tiles) * N;
  g.storage = torch::empty({2 * part_floats + 3 * static_cast<int64_t>(N)}, x.options());
  g.part_mean = g.storage.data_ptr<float>();
  g.part_m2 = g.part_mean + part_floats;
  g.coeff = g.part_m2 + part_floats;
  if (is_fp16x3(gemm)) {
    const WeightParts wp = weight_parts(weight, w_parts, N, K, stream);
    const SplitX xs = fp16x3_prepass(x, M, N, K, counter, stream);
    check_launch(fgb::sm90_gemm_fp16x3_train(xs.parts, wp.parts, z.data_ptr<float>(), g.part_mean, g.part_m2, M, N,
                                             xs.k_pad, xs.workspace, stream),
                 "sm90_gemm_fp16x3_train");
  } else {
    const WeightRowSums ws = weight_row_sums_of(weight, w_parts, N, K, stream);
    const FragmentX xs = sm80_prepass(x, M, N, K, counter, true, stream);
    check_launch(fgb::sm80_gemm_3xtf32_train(xs.big, xs.small, w, centring_of(xs.center, ws), z.data_ptr<float>(),
                                             g.part_mean, g.part_m2, M, N, K, xs.workspace, stream),
                 "sm80_gemm_3xtf32_train");
  }
  return g;
}

// Problem 33's BatchNorm after the training GEMM: out = BatchNorm(scale (z + bias)),
// running statistics updated, stats (2, N) = [mean_z | biased var_z] written
// when not null (out may be z: in place).
void bn_apply(const TrainGemm& g, const torch::Tensor& z, torch::Tensor& out, float* stats, int M, int N,
              const fgb::BatchNormArgs& bn, cudaStream_t stream) {
  check_launch(fgb::bn_apply(z.data_ptr<float>(), out.data_ptr<float>(), g.part_mean, g.part_m2, g.num_m_tiles,
                             g.block_m, M, N, bn, g.coeff, stats, stream),
               "bn_apply");
}

// Problem 84's BatchNorm, scale and softmax after the training GEMM: per-feature
// [mean_z | a | c] and the running-statistics update (bn_softmax_fold_train),
// and stats when not null, then out = softmax((z - mean_z) * a + c) per row
// (out may be z: in place).
void bn_softmax(const TrainGemm& g, const torch::Tensor& z, torch::Tensor& out, float* stats, int M, int N,
                const fgb::BatchNormArgs& bn, cudaStream_t stream) {
  check_launch(
      fgb::bn_softmax_fold_train(g.part_mean, g.part_m2, g.num_m_tiles, g.block_m, M, N, bn, g.coeff, stats, stream),
      "bn_softmax_fold_train");
  check_launch(fgb::softmax_rows(z.data_ptr<float>(), out.data_ptr<float>(), g.coeff, M, N, stream), "softmax_rows");
}

// forward_train and forward_train_saved: the checks, the training GEMM into z, then
// BatchNorm (problem 84: and the row softmax) into out.  saved: returns [out, z, stats
// (2, N) = [mean_z | biased var_z]] for the backward; else [out], BatchNorm in place (out is z).
std::vector<torch::Tensor> train_forward(bool saved, const std::string& gemm_name, const torch::Tensor& x,
                                         const torch::Tensor& weight, BnTensors t,
                                         const torch::Tensor& num_batches_tracked, double momentum, double eps,
                                         bool scale_after_bn, const c10::optional<torch::Tensor>& w_parts) {
  const Gemm gemm = parse_gemm(gemm_name, true);
  const int scale_stride = scale_for_kernel(t.scale);
  const auto [M, N, K] = check_gemm_operands(x, weight);
  check_training(x, M, N, num_batches_tracked);
  check_bn_tensors(t, N, x, scale_stride == 0);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = current_stream(x);
  const fgb::BatchNormArgs bn = batch_norm_args(t, scale_stride, eps, scale_after_bn, &num_batches_tracked, momentum);
  torch::Tensor stats = saved ? torch::empty({2, N}, x.options()) : torch::Tensor();
  if (gemm == Gemm::kSmallM) {  // the whole forward, BatchNorm (and softmax) in float64: small_m_fp64.cu
    torch::Tensor out = torch::empty({M, N}, x.options());
    torch::Tensor z = saved ? torch::empty({M, N}, x.options()) : torch::Tensor();
    const torch::Tensor xr = with_unit_column_stride(x);
    const torch::Tensor workspace = small_m_workspace(x, M, N, K, scale_after_bn);
    check_launch(fgb::small_m_fp64_train(xr.data_ptr<float>(), xr.stride(0), weight.data_ptr<float>(), M, N, K, bn,
                                         num_batches_tracked.data_ptr<int64_t>(),
                                         out.data_ptr<float>(),
                                         saved ? z.data_ptr<float>() : nullptr,
                                         saved ? stats.data_ptr<float>() : nullptr, data_or_null(workspace), stream),
                 "small_m_fp64_train");
    if (saved) return {out, z, stats};
    return {out};
  }
  torch::Tensor z = torch::empty({M, N}, x.options());
  const TrainGemm g = train_gemm(gemm, x, weight, w_parts, z, num_batches_tracked.data_ptr<int64_t>(), M, N, K, stream);
  torch::Tensor out = saved ? torch::empty({M, N}, x.options()) : z;
  float* const stats_out = saved ? stats.data_ptr<float>() : nullptr;
  if (scale_after_bn) {
    bn_softmax(g, z, out, stats_out, M, N, bn, stream);
  } else {
    bn_apply(g, z, out, stats_out, M, N, bn, stream);
  }
  if (saved) return {out, z, stats};
  return {out};
}

}  // namespace

// Linear -> scale -> BatchNorm1d (problem 33) or Linear -> BatchNorm1d -> scale
// -> Softmax (problem 84), training mode: batch statistics, running statistics
// and num_batches_tracked updated.
torch::Tensor forward_train(const std::string& gemm_name, torch::Tensor x, torch::Tensor weight, torch::Tensor bias,
                            torch::Tensor scale, torch::Tensor bn_weight, torch::Tensor bn_bias,
                            torch::Tensor running_mean, torch::Tensor running_var, torch::Tensor num_batches_tracked,
                            double momentum, double eps, bool scale_after_bn, c10::optional<torch::Tensor> w_parts) {
  return train_forward(false, gemm_name, x, weight, BnTensors{bias, scale, bn_weight, bn_bias, running_mean,
                       running_var}, num_batches_tracked, momentum, eps, scale_after_bn, w_parts)[0];
}

// Eval mode of either problem: out = a * (x @ weight^T) + c with the folded
// BatchNorm (running statistics) in the GEMM epilogue; problem 84 then takes
// the row softmax.
torch::Tensor forward_eval(const std::string& gemm_name, torch::Tensor x, torch::Tensor weight, torch::Tensor bias,
                           torch::Tensor scale, torch::Tensor bn_weight, torch::Tensor bn_bias,
                           torch::Tensor running_mean, torch::Tensor running_var, double eps, bool scale_after_bn,
                           c10::optional<torch::Tensor> w_parts) {
  const Gemm gemm = parse_gemm(gemm_name, true);
  const int scale_stride = scale_for_kernel(scale);
  const auto [M, N, K] = check_gemm_operands(x, weight);
  const BnTensors t{bias, scale, bn_weight, bn_bias, running_mean, running_var};
  check_bn_tensors(t, N, x, scale_stride == 0);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = current_stream(x);
  torch::Tensor out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const float* w = weight.data_ptr<float>();
  const fgb::BatchNormArgs bn = batch_norm_args(t, scale_stride, eps, scale_after_bn);
  if (gemm == Gemm::kSmallM) {
    const torch::Tensor xr = with_unit_column_stride(x);
    const torch::Tensor workspace = small_m_workspace(x, M, N, K, scale_after_bn);
    check_launch(fgb::small_m_fp64_eval(xr.data_ptr<float>(), xr.stride(0), w, M, N, K, bn,
                                        out.data_ptr<float>(), data_or_null(workspace), stream),
                 "small_m_fp64_eval");
    return out;  // problem 84: the launcher ran the (float64) softmax
  } else if (is_fp16x3(gemm)) {
    const WeightParts wp = weight_parts(weight, w_parts, N, K, stream);
    const SplitX xs = fp16x3_prepass(x, M, N, K, nullptr, stream);
    check_launch(fgb::sm90_gemm_fp16x3_eval(xs.parts, wp.parts, out.data_ptr<float>(), bn, M, N, xs.k_pad,
                                            xs.workspace, stream),
                 "sm90_gemm_fp16x3_eval");
  } else {
    const WeightRowSums ws = weight_row_sums_of(weight, w_parts, N, K, stream);
    const FragmentX xs = sm80_prepass(x, M, N, K, nullptr, true, stream);
    check_launch(fgb::sm80_gemm_3xtf32_eval(xs.big, xs.small, w, centring_of(xs.center, ws), out.data_ptr<float>(),
                                            bn, M, N, K, xs.workspace, stream),
                 "sm80_gemm_3xtf32_eval");
  }
  if (scale_after_bn)
    check_launch(fgb::softmax_rows(out.data_ptr<float>(), out.data_ptr<float>(), nullptr, M, N, stream),
                 "softmax_rows");
  return out;
}

// ---------------------------------------------------------------------------
// Entry points for the autograd backward (model_new.py: _TrainFn, _EvalFn, _eval_with_grad)
// ---------------------------------------------------------------------------

// forward_train, also returning z = x @ weight^T (M, N, without bias) and
// stats (2, N) float32 = [mean_z | biased var_z] for the backward (small_m_fp64: centred,
// z - mean_z and [0 | biased var_z]; the backward reads only z - stats[0] and stats[1]).
std::vector<torch::Tensor> forward_train_saved(const std::string& gemm_name, torch::Tensor x, torch::Tensor weight,
                                               torch::Tensor bias, torch::Tensor scale, torch::Tensor bn_weight,
                                               torch::Tensor bn_bias, torch::Tensor running_mean,
                                               torch::Tensor running_var, torch::Tensor num_batches_tracked,
                                               double momentum, double eps, bool scale_after_bn,
                                               c10::optional<torch::Tensor> w_parts) {
  return train_forward(true, gemm_name, x, weight, BnTensors{bias, scale, bn_weight, bn_bias, running_mean,
                       running_var}, num_batches_tracked, momentum, eps, scale_after_bn, w_parts);
}

torch::Tensor gemm_nt(const std::string& gemm_name, torch::Tensor a, torch::Tensor b,
                      c10::optional<torch::Tensor> b_parts);

// Eval mode with gradients (BatchNorm frozen): z = x @ weight^T (M, N, no bias) by
// gemm_nt on the call's route (w_parts: its cached weight parts, as forward_eval's),
// then out from z with the running statistics' fold, coeff = [0 | a | c]
// (bn_fold_eval: the eval epilogues' bn_eval_affine): problem 33 out = z a + c
// (bn_apply_folded), problem 84 out = softmax(z a + c) per row (softmax_rows).
// Returns [out, z], both (M, N); the backward (bn_backward_eval) reads z.
std::vector<torch::Tensor> forward_eval_saved(const std::string& gemm_name, torch::Tensor x, torch::Tensor weight,
                                              torch::Tensor bias, torch::Tensor scale, torch::Tensor bn_weight,
                                              torch::Tensor bn_bias, torch::Tensor running_mean,
                                              torch::Tensor running_var, double eps, bool scale_after_bn,
                                              c10::optional<torch::Tensor> w_parts) {
  parse_gemm(gemm_name, true);
  const int scale_stride = scale_for_kernel(scale);
  const auto [M, N, K] = check_gemm_operands(x, weight);
  const BnTensors t{bias, scale, bn_weight, bn_bias, running_mean, running_var};
  check_bn_tensors(t, N, x, scale_stride == 0);
  (void)K;
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = current_stream(x);
  // (small_m_fp64 past its rows: gemm_nt's TORCH_CHECK, before anything is launched)
  const torch::Tensor z = gemm_nt(gemm_name, x, weight, w_parts);
  torch::Tensor out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return {out, z};
  const torch::Tensor coeff = torch::empty({3 * static_cast<int64_t>(N)}, x.options());
  float* const c = coeff.data_ptr<float>();
  check_launch(fgb::bn_fold_eval(batch_norm_args(t, scale_stride, eps, scale_after_bn), N, c, stream),
               "bn_fold_eval");
  if (scale_after_bn)
    check_launch(fgb::softmax_rows(z.data_ptr<float>(), out.data_ptr<float>(), c, M, N, stream), "softmax_rows");
  else
    check_launch(fgb::bn_apply_folded(z.data_ptr<float>(), out.data_ptr<float>(), c, c + 2 * static_cast<int64_t>(N),
                                      M, N, stream),
                 "bn_apply_folded");
  return {out, z};
}

// a @ b^T, float32-accurate (3xTF32 or fp16x3; small_m_fp64, M <= 16: correctly rounded but
// for heavy cancellation) for float32 CUDA a (M, K) and b (N, K) of
// any strides (non-contiguous operands are copied first) and any K (sm90_fp16x3:
// the parts padded to K_pad = round_up(K, 8) with zeros).  b_parts: on
// sm90_fp16x3, fp16x3_weight_parts(b) made while b held its current values (the
// cached split of gemm.weight), or None (split now); ignored by sm80_3xtf32.
// Returns (M, N).
torch::Tensor gemm_nt(const std::string& gemm_name, torch::Tensor a, torch::Tensor b,
                      c10::optional<torch::Tensor> b_parts) {
  const Gemm gemm = parse_gemm(gemm_name, true);
  TORCH_CHECK(a.is_cuda() && b.is_cuda() && a.device() == b.device(),
              "gemm_nt: a and b must be CUDA tensors on one device, got ", a.device(), " and ", b.device());
  TORCH_CHECK(a.scalar_type() == torch::kFloat32 && b.scalar_type() == torch::kFloat32,
              "gemm_nt: a and b must be float32, got ", a.scalar_type(), " and ", b.scalar_type());
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(1),
              "gemm_nt: expected a (M, K) and b (N, K), got ", a.sizes(), " and ", b.sizes());
  TORCH_CHECK(a.size(0) <= INT32_MAX && b.size(0) <= INT32_MAX && a.size(1) <= INT32_MAX,
              "gemm_nt: sizes must fit in int32, got ", a.sizes(), " and ", b.sizes());
  const c10::cuda::CUDAGuard guard(a.device());
  const cudaStream_t stream = current_stream(a);
  const int M = static_cast<int>(a.size(0)), N = static_cast<int>(b.size(0)), K = static_cast<int>(a.size(1));
  torch::Tensor out = torch::empty({M, N}, a.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
  const torch::Tensor ac = a.contiguous(), bc = b.contiguous();
  const float* w = bc.data_ptr<float>();
  if (is_fp16x3(gemm)) {
    const WeightParts wp = weight_parts(bc, b_parts, N, K, stream);
    const SplitX xs = fp16x3_prepass(ac, M, N, K, nullptr, stream);
    check_launch(fgb::sm90_gemm_fp16x3_plain(xs.parts, wp.parts, out.data_ptr<float>(), M, N, xs.k_pad, xs.workspace,
                                             stream),
                 "sm90_gemm_fp16x3_plain");
    return out;
  }
  // The portable and small-batch kernels' eval epilogues with the identity fold: a = 1 / sqrt(1 + 0)
  // = 1, c = 0 exactly (small_m_fp64: z's float64 sums rounded once).
  const torch::Tensor ones = torch::ones({N}, a.options()), zeros = torch::zeros({N}, a.options());
  fgb::BatchNormArgs identity;
  identity.bias = identity.bn_bias = zeros.data_ptr<float>();
  identity.scale = identity.bn_weight = ones.data_ptr<float>();
  identity.running_mean = zeros.data_ptr<float>();  // read only by the eval epilogue
  identity.running_var = ones.data_ptr<float>();
  identity.eps = 0.f;
  if (gemm == Gemm::kSmallM) {
    TORCH_CHECK(M <= fgb::small_m_fp64_max_rows(), "gemm_nt: small_m_fp64 takes at most ",
                fgb::small_m_fp64_max_rows(), " rows, got ", M);
    const torch::Tensor workspace = small_m_workspace(ac, M, N, K, false);
    check_launch(fgb::small_m_fp64_eval(ac.data_ptr<float>(), ac.stride(0), w, M, N, K, identity,
                                        out.data_ptr<float>(), data_or_null(workspace), stream),
                 "small_m_fp64_eval");
    return out;
  }
  const FragmentX xs = sm80_prepass(ac, M, N, K, nullptr, false, stream);
  check_launch(fgb::sm80_gemm_3xtf32_eval(xs.big, xs.small, w, fgb::Centring{nullptr, nullptr}, out.data_ptr<float>(),
                                          identity, M, N, K, xs.workspace, stream),
               "sm80_gemm_3xtf32_eval");
  return out;
}

namespace {

// The checks of gemm_nn / gemm_tn: float32 CUDA a and b on one device, 2-D, a's
// dim `a_dim` matching b's dim 0 (the reduction), sizes within int32.
void check_backward_operands(const char* fn, const torch::Tensor& a, const torch::Tensor& b, int a_dim,
                             const char* expected) {
  TORCH_CHECK(a.is_cuda() && b.is_cuda() && a.device() == b.device(), fn,
              ": a and b must be CUDA tensors on one device, got ", a.device(), " and ", b.device());
  TORCH_CHECK(a.scalar_type() == torch::kFloat32 && b.scalar_type() == torch::kFloat32, fn,
              ": a and b must be float32, got ", a.scalar_type(), " and ", b.scalar_type());
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(a_dim) == b.size(0), fn, ": expected ", expected, ", got ",
              a.sizes(), " and ", b.sizes());
  TORCH_CHECK(a.size(0) <= INT32_MAX && a.size(1) <= INT32_MAX && b.size(1) <= INT32_MAX, fn,
              ": sizes must fit in int32, got ", a.sizes(), " and ", b.sizes());
}

// t with contiguous rows (t itself when its columns have stride 1 and its rows
// start 8-byte aligned, else a contiguous copy).
torch::Tensor with_contiguous_rows(const torch::Tensor& t) {
  const bool ok = t.stride(1) == 1 && t.stride(0) % 2 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 8 == 0;
  return ok ? t : t.contiguous();
}

}  // namespace

// a @ b, float32-accurate, for float32 CUDA a (M, N) and b (N, K): the
// backward's grad_x = grad_z W.  On sm90_fp16x3 with N % 8 == 0 and
// K % 8 == 0, b's fp16x3 parts (b_parts: fp16x3_weight_parts(b), the forward's
// cached split, or made now; rows of K_pad = K words, the MN-major operand's
// row stride) are the GEMM's MN-major w operand and a's rows (N words: TMA's
// 16-byte row stride) are split with b's row scales folded in
// (sm90_prepass_fp16x3_scaled): no transposed copy of b.  Otherwise
// gemm_nt(a, b^T), which copies b transposed (sm90_fp16x3 then pads the
// reduction N; sm80_3xtf32 takes any shape).  Returns (M, K).
torch::Tensor gemm_nn(const std::string& gemm_name, torch::Tensor a, torch::Tensor b,
                      c10::optional<torch::Tensor> b_parts) {
  const Gemm gemm = parse_gemm(gemm_name);
  check_backward_operands("gemm_nn", a, b, 1, "a (M, N) and b (N, K)");
  const int M = static_cast<int>(a.size(0)), N = static_cast<int>(a.size(1)), K = static_cast<int>(b.size(1));
  if (!is_fp16x3(gemm) || N % 8 != 0 || K % 8 != 0 || M == 0 || K == 0 || N == 0)
    return gemm_nt(gemm_name, a, b.t(), c10::nullopt);
  const c10::cuda::CUDAGuard guard(a.device());
  const cudaStream_t stream = current_stream(a);
  const WeightParts wp = weight_parts(b, b_parts, N, K, stream);  // K % 8 == 0: K_pad == K
  const torch::Tensor ar = with_contiguous_rows(a);
  // One allocation: a's parts (M N / 2 floats each), inv_scale (M, padded to 4), the GEMM's workspace.
  const int64_t part_floats = static_cast<int64_t>(M) * N / 2;
  const int64_t scale_floats = (static_cast<int64_t>(M) + 3) / 4 * 4;
  int64_t workspace_floats = 0;
  int zero_ints = 0;
  fgb::sm90_gemm_fp16x3_workspace(M, K, N, &workspace_floats, &zero_ints);
  torch::Tensor storage = torch::empty({2 * part_floats + scale_floats + workspace_floats}, a.options());
  float* base = storage.data_ptr<float>();
  uint16_t* hi = reinterpret_cast<uint16_t*>(base);
  uint16_t* lo = reinterpret_cast<uint16_t*>(base + part_floats);
  float* inv_scale = base + 2 * part_floats;
  float* workspace = workspace_floats > 0 ? inv_scale + scale_floats : nullptr;
  int* arrivals = workspace != nullptr ? reinterpret_cast<int*>(workspace + workspace_floats - zero_ints) : nullptr;
  check_launch(fgb::sm90_prepass_fp16x3_scaled(ar.data_ptr<float>(), ar.stride(0), M, N, wp.parts.inv_scale, hi, lo,
                                               inv_scale, arrivals, arrivals ? zero_ints : 0, stream),
               "sm90_prepass_fp16x3_scaled");
  const fgb::Fp16x3Parts x{hi, lo, inv_scale, nullptr, nullptr, false};
  const fgb::Fp16x3Parts w{wp.parts.hi, wp.parts.lo, nullptr, nullptr, nullptr, true};  // scales folded into x
  torch::Tensor out = torch::empty({M, K}, a.options());
  check_launch(fgb::sm90_gemm_fp16x3_plain(x, w, out.data_ptr<float>(), M, K, N, workspace, stream),
               "sm90_gemm_fp16x3_plain (w MN-major)");
  return out;
}

// a^T @ b, float32-accurate, for float32 CUDA a (M, N) and b (M, K): the
// backward's grad_W = grad_z^T x.  small_m_fp64 (M <= small_m_fp64_max_rows()):
// small_m_grad_w.cu, each output the float64 sum of its M exact products rounded
// once (a and b read in place where their columns have unit stride).  On sm90_fp16x3 with N % 8 == 0 and
// K % 8 == 0 (the MN-major operands' rows of N and K words: TMA's 16-byte
// row strides), both are split per column (sm90_prepass_fp16x3_columns) and
// read as MN-major operands where they lie; otherwise gemm_nt(a^T, b^T), which
// copies both transposed (sm90_fp16x3 then pads the reduction M).  Returns (N, K).
torch::Tensor gemm_tn(const std::string& gemm_name, torch::Tensor a, torch::Tensor b) {
  const Gemm gemm = parse_gemm(gemm_name, true);
  check_backward_operands("gemm_tn", a, b, 0, "a (M, N) and b (M, K)");
  const int M = static_cast<int>(a.size(0)), N = static_cast<int>(a.size(1)), K = static_cast<int>(b.size(1));
  if (gemm == Gemm::kSmallM) {
    TORCH_CHECK(M <= fgb::small_m_fp64_max_rows(), "gemm_tn: small_m_fp64 takes at most ",
                fgb::small_m_fp64_max_rows(), " rows, got ", M);
    const c10::cuda::CUDAGuard guard(a.device());
    torch::Tensor out = torch::empty({N, K}, a.options());
    if (N == 0 || K == 0) return out;
    if (M == 0) return out.zero_();
    const torch::Tensor ar = with_unit_column_stride(a), br = with_unit_column_stride(b);
    check_launch(fgb::small_m_grad_w(ar.data_ptr<float>(), ar.stride(0), br.data_ptr<float>(), br.stride(0), M, N, K,
                                     out.data_ptr<float>(), current_stream(a)),
                 "small_m_grad_w");
    return out;
  }
  if (!is_fp16x3(gemm) || N % 8 != 0 || K % 8 != 0 || M == 0 || K == 0 || N == 0)
    return gemm_nt(gemm_name, a.t(), b.t(), c10::nullopt);
  const c10::cuda::CUDAGuard guard(a.device());
  const cudaStream_t stream = current_stream(a);
  const torch::Tensor ar = with_contiguous_rows(a), br = with_contiguous_rows(b);
  // One allocation: a's parts (M N / 2 floats each), b's (M K / 2 each), their
  // column scales (N, K, padded to 4), the GEMM's workspace.
  const int64_t a_floats = static_cast<int64_t>(M) * N / 2, b_floats = static_cast<int64_t>(M) * K / 2;
  const int64_t a_scale_floats = (static_cast<int64_t>(N) + 3) / 4 * 4;
  const int64_t b_scale_floats = (static_cast<int64_t>(K) + 3) / 4 * 4;
  int64_t workspace_floats = 0;
  int zero_ints = 0;
  fgb::sm90_gemm_fp16x3_workspace(N, K, M, &workspace_floats, &zero_ints);
  torch::Tensor storage =
      torch::empty({2 * a_floats + 2 * b_floats + a_scale_floats + b_scale_floats + workspace_floats}, a.options());
  float* base = storage.data_ptr<float>();
  uint16_t* a_hi = reinterpret_cast<uint16_t*>(base);
  uint16_t* a_lo = reinterpret_cast<uint16_t*>(base + a_floats);
  uint16_t* b_hi = reinterpret_cast<uint16_t*>(base + 2 * a_floats);
  uint16_t* b_lo = reinterpret_cast<uint16_t*>(base + 2 * a_floats + b_floats);
  float* a_inv = base + 2 * a_floats + 2 * b_floats;
  float* b_inv = a_inv + a_scale_floats;
  float* workspace = workspace_floats > 0 ? b_inv + b_scale_floats : nullptr;
  int* arrivals = workspace != nullptr ? reinterpret_cast<int*>(workspace + workspace_floats - zero_ints) : nullptr;
  check_launch(fgb::sm90_prepass_fp16x3_columns(ar.data_ptr<float>(), ar.stride(0), M, N, a_hi, a_lo, a_inv, arrivals,
                                                arrivals ? zero_ints : 0, stream),
               "sm90_prepass_fp16x3_columns (a)");
  check_launch(fgb::sm90_prepass_fp16x3_columns(br.data_ptr<float>(), br.stride(0), M, K, b_hi, b_lo, b_inv, nullptr,
                                                0, stream),
               "sm90_prepass_fp16x3_columns (b)");
  // The GEMM's x operand (rows: its M = N here) is a, its w operand (rows: K) is b; both MN-major.
  const fgb::Fp16x3Parts x{a_hi, a_lo, a_inv, nullptr, nullptr, true};
  const fgb::Fp16x3Parts w{b_hi, b_lo, b_inv, nullptr, nullptr, true};
  torch::Tensor out = torch::empty({N, K}, a.options());
  check_launch(fgb::sm90_gemm_fp16x3_plain(x, w, out.data_ptr<float>(), N, K, M, workspace, stream),
               "sm90_gemm_fp16x3_plain (both MN-major)");
  return out;
}

namespace {

// The weight argument of the two cache makers below: (N, K) float32 CUDA, any
// strides, N >= 1, sizes within int32.  Returns (N, K).
std::pair<int, int> check_cached_weight(const char* fn, const torch::Tensor& weight) {
  TORCH_CHECK(weight.is_cuda() && weight.scalar_type() == torch::kFloat32 && weight.dim() == 2, fn,
              ": weight must be a float32 CUDA (N, K) tensor, got ", weight.scalar_type(), " ", weight.sizes(), " on ",
              weight.device());
  TORCH_CHECK(weight.size(0) >= 1 && weight.size(0) <= INT32_MAX && weight.size(1) <= INT32_MAX, fn,
              ": sizes must fit in int32 and N >= 1, got ", weight.sizes());
  return {static_cast<int>(weight.size(0)), static_cast<int>(weight.size(1))};
}

}  // namespace

// gemm.weight's fp16x3 parts (weight_parts_floats floats: [w_hi (N, K_pad) fp16
// words | w_lo | w_inv_scale (N, padded to 4) | w_row_sum (N (hi, lo) pairs)],
// K_pad = round_up(K, 8), zeros in columns K ..), for forward_*'s w_parts and
// gemm_nt's / gemm_nn's b_parts: weight (N, K) float32 CUDA, any strides and
// alignment, K >= 1.  The caller keeps it while the weight is unchanged
// (model_new.py: _weight_parts).
torch::Tensor fp16x3_weight_parts(torch::Tensor weight) {
  const auto [N, K] = check_cached_weight("fp16x3_weight_parts", weight);
  const c10::cuda::CUDAGuard guard(weight.device());
  return split_weight(weight, N, K, current_stream(weight));
}

// gemm.weight's row sums (2 N floats: (hi, lo) pairs of the float64 sums), for
// the 3xTF32 forwards' w_parts: weight (N, K) float32 CUDA, any strides.  The
// caller keeps it while the weight is unchanged (model_new.py: _weight_parts).
torch::Tensor weight_row_sums(torch::Tensor weight) {
  const auto [N, K] = check_cached_weight("weight_row_sums", weight);
  const c10::cuda::CUDAGuard guard(weight.device());
  return weight_row_sums_of(weight, c10::nullopt, N, K, current_stream(weight)).packed;
}

namespace {

// z and grad_y (M, N) float32 CUDA (z contiguous), stats (2, N) float32; returns (M, N).
std::pair<int, int> check_backward_operands(const char* fn, const torch::Tensor& grad_y, const torch::Tensor& z,
                                            const torch::Tensor& stats) {
  TORCH_CHECK(z.is_cuda() && z.scalar_type() == torch::kFloat32 && z.dim() == 2 && z.is_contiguous(), fn,
              ": z must be a contiguous float32 CUDA (M, N) tensor");
  TORCH_CHECK(grad_y.device() == z.device() && grad_y.scalar_type() == torch::kFloat32 && grad_y.sizes() == z.sizes(),
              fn, ": grad_y must be float32 of shape ", z.sizes(), " on ", z.device(), ", got ", grad_y.scalar_type(),
              " ", grad_y.sizes(), " on ", grad_y.device());
  TORCH_CHECK(stats.device() == z.device() && stats.scalar_type() == torch::kFloat32 && stats.is_contiguous() &&
                  stats.dim() == 2 && stats.size(0) == 2 && stats.size(1) == z.size(1),
              fn, ": stats must be a contiguous float32 (2, ", z.size(1), ") tensor on ", z.device());
  TORCH_CHECK(z.size(0) <= INT32_MAX && z.size(1) <= INT32_MAX, fn, ": sizes must fit in int32");
  return {static_cast<int>(z.size(0)), static_cast<int>(z.size(1))};
}

// What bn_backward_train and bn_backward_grad read of the BatchNorm: scale, bn.weight and
// (problem 84, optional) bn.bias checked against z's N and device, and the BatchNormArgs
// of those fields (bias, gemm.bias, left null: only bn_backward_grad reads it).  scale_stride:
// scale_for_kernel's (0: one number viewed as N, read in place).
fgb::BatchNormArgs backward_bn_args(const torch::Tensor& z, int N, const torch::Tensor& scale,
                                    const torch::Tensor& bn_weight, double eps, bool scale_after_bn,
                                    const c10::optional<torch::Tensor>& bn_bias, int scale_stride = 1) {
  check_vector(scale, "scale", N, z, scale_stride == 0);
  check_vector(bn_weight, "bn.weight", N, z);
  if (bn_bias.has_value()) check_vector(*bn_bias, "bn.bias", N, z);
  fgb::BatchNormArgs bn;
  bn.scale = scale.data_ptr<float>();
  bn.scale_stride = scale_stride;
  bn.bn_weight = bn_weight.data_ptr<float>();
  bn.eps = static_cast<float>(eps);
  bn.scale_after_bn = scale_after_bn;
  if (scale_after_bn && bn_bias.has_value()) bn.bn_bias = bn_bias->data_ptr<float>();
  return bn;
}

// The backward's outputs: grad_z (M, N) and grad_scale, grad_bn_weight, grad_bn_bias (N),
// four allocations, not views of one: custom operators may not return aliases.
struct BackwardGrads {
  torch::Tensor grad_z, grad_scale, grad_bn_weight, grad_bn_bias;
};

BackwardGrads backward_grads(const torch::Tensor& z, int M, int N) {
  return {torch::empty({M, N}, z.options()), torch::empty({N}, z.options()), torch::empty({N}, z.options()),
          torch::empty({N}, z.options())};
}

}  // namespace

// Training-mode BatchNorm backward (bn_backward.cu): from grad_y = dL/dy
// (M, N), z and stats of forward_train_saved, returns [grad_z (M, N),
// grad_scale, grad_bn_weight, grad_bn_bias (N each)].  scale_after_bn (problem
// 84): y = scale * BN(z + b), the pre-softmax logits; its grad_scale includes
// the bn_bias * sum_m grad_y term where bn_bias is given (else the caller adds it).
// A scale of one number viewed as N (stride 0, per_feature_scale's view) is read in
// place, and its grad_scale is [the float64 sum of the features' terms, rounded once,
// 0, ..., 0]: autograd's expand backward then sums it to that one number exactly.
std::vector<torch::Tensor> bn_backward_train(torch::Tensor grad_y, torch::Tensor z, torch::Tensor stats,
                                             torch::Tensor scale, torch::Tensor bn_weight, double eps,
                                             bool scale_after_bn, c10::optional<torch::Tensor> bn_bias) {
  const int scale_stride = scale_for_kernel(scale);
  const bool one_scale = scale_stride == 0;
  const auto [M, N] = check_backward_operands("bn_backward_train", grad_y, z, stats);
  const fgb::BatchNormArgs bn = backward_bn_args(z, N, scale, bn_weight, eps, scale_after_bn, bn_bias, scale_stride);
  const c10::cuda::CUDAGuard guard(z.device());
  const cudaStream_t stream = current_stream(z);
  const torch::Tensor g = grad_y.contiguous();
  const BackwardGrads r = backward_grads(z, M, N);
  const torch::Tensor terms = one_scale ? torch::empty({N}, z.options().dtype(torch::kFloat64)) : torch::Tensor();
  check_launch(fgb::bn_backward_train(g.data_ptr<float>(), z.data_ptr<float>(), stats.data_ptr<float>(), bn, M, N,
                                      r.grad_z.data_ptr<float>(), r.grad_scale.data_ptr<float>(),
                                      r.grad_bn_weight.data_ptr<float>(), r.grad_bn_bias.data_ptr<float>(),
                                      one_scale ? terms.data_ptr<double>() : nullptr, stream),
               "bn_backward_train");
  return {r.grad_z, r.grad_scale, r.grad_bn_weight, r.grad_bn_bias};
}

// Eval-mode BatchNorm backward (bn_backward.cu): from grad_y = dL/dy (problem 33) or
// dL/dv (problem 84: softmax_rows_backward's grad_v), z of forward_eval_saved, and the
// forward's per-feature tensors (running statistics as it read them), returns
// [grad_z (M, N), grad_bias, grad_scale, grad_bn_weight, grad_bn_bias (N each)];
// one scale viewed as N as bn_backward_train's ([its gradient, 0, ..., 0]).
std::vector<torch::Tensor> bn_backward_eval(torch::Tensor grad_y, torch::Tensor z, torch::Tensor bias,
                                            torch::Tensor scale, torch::Tensor bn_weight, torch::Tensor bn_bias,
                                            torch::Tensor running_mean, torch::Tensor running_var, double eps,
                                            bool scale_after_bn) {
  const int scale_stride = scale_for_kernel(scale);
  const bool one_scale = scale_stride == 0;
  TORCH_CHECK(z.is_cuda() && z.scalar_type() == torch::kFloat32 && z.dim() == 2 && z.is_contiguous(),
              "bn_backward_eval: z must be a contiguous float32 CUDA (M, N) tensor");
  TORCH_CHECK(grad_y.device() == z.device() && grad_y.scalar_type() == torch::kFloat32 && grad_y.sizes() == z.sizes(),
              "bn_backward_eval: grad_y must be float32 of shape ", z.sizes(), " on ", z.device(), ", got ",
              grad_y.scalar_type(), " ", grad_y.sizes(), " on ", grad_y.device());
  TORCH_CHECK(z.size(0) <= INT32_MAX && z.size(1) <= INT32_MAX, "bn_backward_eval: sizes must fit in int32");
  const int M = static_cast<int>(z.size(0)), N = static_cast<int>(z.size(1));
  const BnTensors t{bias, scale, bn_weight, bn_bias, running_mean, running_var};
  check_bn_tensors(t, N, z, one_scale);
  const fgb::BatchNormArgs bn = batch_norm_args(t, scale_stride, eps, scale_after_bn);
  const c10::cuda::CUDAGuard guard(z.device());
  const cudaStream_t stream = current_stream(z);
  const torch::Tensor g = grad_y.contiguous();
  const BackwardGrads r = backward_grads(z, M, N);
  const torch::Tensor grad_bias = torch::empty({N}, z.options());
  const torch::Tensor terms = one_scale ? torch::empty({N}, z.options().dtype(torch::kFloat64)) : torch::Tensor();
  check_launch(fgb::bn_backward_eval(g.data_ptr<float>(), z.data_ptr<float>(), bn, M, N, r.grad_z.data_ptr<float>(),
                                     grad_bias.data_ptr<float>(), r.grad_scale.data_ptr<float>(),
                                     r.grad_bn_weight.data_ptr<float>(), r.grad_bn_bias.data_ptr<float>(),
                                     one_scale ? terms.data_ptr<double>() : nullptr, stream),
               "bn_backward_eval");
  return {r.grad_z, grad_bias, r.grad_scale, r.grad_bn_weight, r.grad_bn_bias};
}

// The row softmax's backward: grad_v = out * (grad_out - sum_n grad_out * out)
// for float32 CUDA out and grad_out (M, N) on one device (any strides: copied
// contiguous where they are not).  Returns grad_v (M, N), contiguous.
torch::Tensor softmax_rows_backward(torch::Tensor out, torch::Tensor grad_out) {
  TORCH_CHECK(out.is_cuda() && grad_out.is_cuda() && out.device() == grad_out.device(),
              "softmax_rows_backward: out and grad_out must be CUDA tensors on one device, got ", out.device(),
              " and ", grad_out.device());
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && grad_out.scalar_type() == torch::kFloat32,
              "softmax_rows_backward: out and grad_out must be float32, got ", out.scalar_type(), " and ",
              grad_out.scalar_type());
  TORCH_CHECK(out.dim() == 2 && out.sizes() == grad_out.sizes(),
              "softmax_rows_backward: expected out and grad_out of one (M, N) shape, got ", out.sizes(), " and ",
              grad_out.sizes());
  TORCH_CHECK(out.size(0) <= INT32_MAX && out.size(1) <= INT32_MAX, "softmax_rows_backward: sizes must fit in int32");
  const c10::cuda::CUDAGuard guard(out.device());
  const torch::Tensor o = out.contiguous(), g = grad_out.contiguous();
  torch::Tensor grad_v = torch::empty_like(o);
  check_launch(fgb::softmax_rows_backward(o.data_ptr<float>(), g.data_ptr<float>(), grad_v.data_ptr<float>(),
                                          static_cast<int>(o.size(0)), static_cast<int>(o.size(1)),
                                          current_stream(o)),
               "softmax_rows_backward");
  return grad_v;
}

// ---------------------------------------------------------------------------
// Synchronized BatchNorm (model_new.py: _SyncFusedTrainFn).  The statistics of
// the batch are merged across processes between these calls (all_gather in the
// forward, all_reduce in the backward, both in Python); bn_backward.cu has the algebra.
// ---------------------------------------------------------------------------

namespace {

void check_f64_rows(const torch::Tensor& t, const char* name, int64_t rows, int64_t N, const torch::Tensor& like) {
  TORCH_CHECK(t.device() == like.device() && t.scalar_type() == torch::kFloat64 && t.is_contiguous() &&
                  t.dim() == 2 && t.size(0) == rows && t.size(1) == N,
              name, " must be a contiguous float64 (", rows, ", ", N, ") tensor on ", like.device(), ", got ",
              t.scalar_type(), " ", t.sizes(), " on ", t.device());
}

}  // namespace

// This process's half of a synchronized training forward: the pre-pass
// (num_batches_tracked += 1) and the training GEMM, then the per-tile statistics
// merged.  Returns [z = x @ weight^T (M, N) float32 (no bias), local (3, N)
// float64 = [M | mean_z + bias | M2_z]] (bn_sync.cu).  M >= 2: the merged batch
// then has >= 2 rows whatever the other processes hold (model_new.py sends
// smaller local batches through the torch-op path, which checks the merged count first).
std::vector<torch::Tensor> sync_forward_local(const std::string& gemm_name, torch::Tensor x, torch::Tensor weight,
                                              torch::Tensor bias, torch::Tensor num_batches_tracked,
                                              c10::optional<torch::Tensor> w_parts) {
  const Gemm gemm = parse_gemm(gemm_name, true);
  const auto [M, N, K] = check_gemm_operands(x, weight);
  check_training(x, M, N, num_batches_tracked);
  check_vector(bias, "gemm.bias", N, x);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = current_stream(x);
  torch::Tensor z = torch::empty({M, N}, x.options());
  torch::Tensor local = torch::empty({3, N}, x.options().dtype(torch::kFloat64));
  const TrainGemm g = train_gemm(gemm, x, weight, w_parts, z, num_batches_tracked.data_ptr<int64_t>(), M, N, K, stream);
  check_launch(fgb::bn_local_stats(g.part_mean, g.part_m2, g.num_m_tiles, g.block_m, M, N, bias.data_ptr<float>(),
                                   local.data_ptr<double>(), stream),
               "bn_local_stats");
  return {z, local};
}

// The rest of a synchronized training forward, from every process's local
// statistics (gathered (world, 3, N) float64, the all_gather's output):
// sync_bn_finalize (merge, coefficients, running statistics updated in place),
// then problem 33: out = (z - mean_z) a + bn_bias (bn_apply_folded); problem 84:
// out = row softmax of (z - mean_z) a + c (softmax_rows from z).  z is
// not written.  Returns [out (M, N), stats (2, N) float32 = [mean_z | biased
// var_z] of the merged batch, count (1) float64 = its rows] for the backward.
std::vector<torch::Tensor> sync_bn_apply(torch::Tensor z, torch::Tensor gathered, torch::Tensor bias,
                                         torch::Tensor scale, torch::Tensor bn_weight, torch::Tensor bn_bias,
                                         torch::Tensor running_mean, torch::Tensor running_var,
                                         torch::Tensor num_batches_tracked, double momentum, double eps,
                                         bool scale_after_bn) {
  scale = feature_vector(scale);
  TORCH_CHECK(z.is_cuda() && z.scalar_type() == torch::kFloat32 && z.dim() == 2 && z.is_contiguous(),
              "sync_bn_apply: z must be a contiguous float32 CUDA (M, N) tensor");
  const int64_t M = z.size(0), N = z.size(1);
  TORCH_CHECK(M <= INT32_MAX && N <= INT32_MAX, "sync_bn_apply: sizes must fit in int32");
  TORCH_CHECK(gathered.device() == z.device() && gathered.scalar_type() == torch::kFloat64 &&
                  gathered.is_contiguous() && gathered.dim() == 3 && gathered.size(0) >= 1 &&
                  gathered.size(0) <= INT32_MAX && gathered.size(1) == 3 && gathered.size(2) == N,
              "sync_bn_apply: gathered must be a contiguous float64 (world, 3, ", N, ") tensor on ", z.device(),
              ", got ", gathered.scalar_type(), " ", gathered.sizes());
  const BnTensors t{bias, scale, bn_weight, bn_bias, running_mean, running_var};
  check_bn_tensors(t, static_cast<int>(N), z);
  check_training(z, static_cast<int>(M), static_cast<int>(N), num_batches_tracked);
  const c10::cuda::CUDAGuard guard(z.device());
  const cudaStream_t stream = current_stream(z);
  torch::Tensor stats = torch::empty({2, N}, z.options());
  torch::Tensor coeff = torch::empty({scale_after_bn ? 3 : 2, N}, z.options());
  torch::Tensor count = torch::empty({1}, z.options().dtype(torch::kFloat64));
  const fgb::BatchNormArgs bn = batch_norm_args(t, 1, eps, scale_after_bn, &num_batches_tracked, momentum);
  check_launch(fgb::sync_bn_finalize(gathered.data_ptr<double>(), static_cast<int>(gathered.size(0)),
                                     static_cast<int>(N), bn, stats.data_ptr<float>(), coeff.data_ptr<float>(),
                                     count.data_ptr<double>(), stream),
               "sync_bn_finalize");
  torch::Tensor out = torch::empty({M, N}, z.options());
  if (scale_after_bn) {
    check_launch(fgb::softmax_rows(z.data_ptr<float>(), out.data_ptr<float>(), coeff.data_ptr<float>(),
                                   static_cast<int>(M), static_cast<int>(N), stream),
                 "softmax_rows");
  } else {
    check_launch(fgb::bn_apply_folded(z.data_ptr<float>(), out.data_ptr<float>(), coeff.data_ptr<float>(),
                                      bn_bias.data_ptr<float>(), static_cast<int>(M), static_cast<int>(N), stream),
                 "bn_apply_folded");
  }
  return {out, stats, count};
}

// This process's backward sums (2, N) float64 = [sum_m grad_y | sum_m grad_y (z - stats[0])].
torch::Tensor bn_backward_sums(torch::Tensor grad_y, torch::Tensor z, torch::Tensor stats) {
  const auto [M, N] = check_backward_operands("bn_backward_sums", grad_y, z, stats);
  const c10::cuda::CUDAGuard guard(z.device());
  const torch::Tensor g = grad_y.contiguous();
  torch::Tensor sums = torch::empty({2, N}, z.options().dtype(torch::kFloat64));
  check_launch(fgb::bn_backward_sums(g.data_ptr<float>(), z.data_ptr<float>(), stats.data_ptr<float>(), M, N,
                                     sums.data_ptr<double>(), current_stream(z)),
               "bn_backward_sums");
  return sums;
}

// bn_backward_train with the merged batch: grad_z from total_sums (every process's
// bn_backward_sums added) and count (the merged batch's rows: a one-element
// float64 tensor on z's device, read by the kernel); grad_bn_weight,
// grad_bn_bias and problem 84's grad_scale from local_sums (this process's rows;
// its bn_bias term as bn_backward_train's);
// problem 33's grad_scale over this process's rows (bias: gemm.bias).
// Returns [grad_z (M, N), grad_scale, grad_bn_weight, grad_bn_bias (N)].
std::vector<torch::Tensor> bn_backward_grad(torch::Tensor grad_y, torch::Tensor z, torch::Tensor stats,
                                            torch::Tensor bias, torch::Tensor scale, torch::Tensor bn_weight,
                                            double eps, bool scale_after_bn, torch::Tensor count,
                                            torch::Tensor local_sums, torch::Tensor total_sums,
                                            c10::optional<torch::Tensor> bn_bias) {
  scale = feature_vector(scale);
  const auto [M, N] = check_backward_operands("bn_backward_grad", grad_y, z, stats);
  TORCH_CHECK(count.device() == z.device() && count.scalar_type() == torch::kFloat64 && count.numel() == 1,
              "bn_backward_grad: count must be a one-element float64 tensor on ", z.device(), " (the merged batch's "
              "rows), got ", count.scalar_type(), " ", count.sizes(), " on ", count.device());
  check_vector(bias, "gemm.bias", N, z);
  fgb::BatchNormArgs bn = backward_bn_args(z, N, scale, bn_weight, eps, scale_after_bn, bn_bias);
  bn.bias = bias.data_ptr<float>();
  check_f64_rows(local_sums, "bn_backward_grad: local_sums", 2, N, z);
  check_f64_rows(total_sums, "bn_backward_grad: total_sums", 2, N, z);
  const c10::cuda::CUDAGuard guard(z.device());
  const torch::Tensor g = grad_y.contiguous();
  const BackwardGrads r = backward_grads(z, M, N);
  check_launch(fgb::bn_backward_grad(g.data_ptr<float>(), z.data_ptr<float>(), stats.data_ptr<float>(), bn, M, N,
                                     count.data_ptr<double>(), local_sums.data_ptr<double>(),
                                     total_sums.data_ptr<double>(), r.grad_z.data_ptr<float>(),
                                     r.grad_scale.data_ptr<float>(), r.grad_bn_weight.data_ptr<float>(),
                                     r.grad_bn_bias.data_ptr<float>(), current_stream(z)),
               "bn_backward_grad");
  return {r.grad_z, r.grad_scale, r.grad_bn_weight, r.grad_bn_bias};
}

// ---------------------------------------------------------------------------
// Device facts for the dispatch (model_new.py: _device_facts); queries only
// ---------------------------------------------------------------------------

// Whether device `device` can run the Hopper kernel of this build.
bool sm90_gemm_available(int64_t device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  return fgb::sm90_gemm_available();
}
