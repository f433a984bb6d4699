// torch_binding.cpp -- PyTorch entry points for the fused forwards of
// Linear -> scale -> BatchNorm1d (problem 33: forward_train / forward_eval) and
// Linear -> BatchNorm1d -> scale -> Softmax (problem 84: forward_softmax_*).
// Passed to load_inline as cpp_sources (torch/extension.h
// is prepended there); the kernels in kernels/*.cu take raw pointers only.
//
// Each entry point checks every tensor (device, dtype, shape, contiguity),
// takes a device guard for x's GPU, launches on that GPU's current stream, and
// turns any launch error into a RuntimeError.  Nothing here synchronises.
//
//   forward_train(x, weight, bias, scale, bn_weight, bn_bias, running_mean,
//                 running_var, num_batches_tracked, momentum, eps) -> out (M, N)
//     Hopper (sm_90a build, K % 4 == 0):
//       x_small = rna_tf32(x - tf32_trunc(x))           (split_tf32.cu, remainder)
//       z = x @ weight^T with per-tile statistics      (sm90_gemm_3xtf32_bn.cu)
//     otherwise:
//       x -> TF32 big / small parts, fragment order     (split_tf32.cu)
//       sm_90 and M <= 1024 where it costs no extra wave: one cluster-launched
//         GEMM with the whole BatchNorm in its epilogue (sm80_gemm_3xtf32_bn.cu, kTrainFused)
//       else z = x @ weight^T with per-tile statistics (sm80_gemm_3xtf32_bn.cu)
//     then (both multi-pass paths), one kernel:
//       merge statistics, update running statistics,
//       out = (z - mean_z) * a + bn_bias in place      (bn_apply.cu)
//     momentum < 0 means momentum=None (cumulative average).  The first
//     kernel (the x split) increments num_batches_tracked, as nn.BatchNorm1d
//     does before using it; the caller must not.
//   forward_eval(x, weight, bias, scale, bn_weight, bn_bias, running_mean,
//                running_var, eps) -> out (M, N)
//       split pre-pass (as above), then one GEMM launch (Hopper or portable)
//       with the folded per-feature affine epilogue.
//   forward_softmax_train(same arguments as forward_train) -> out (M, N)
//       split pre-pass and the multi-pass GEMM (as above, never the cluster
//       path: its epilogue is problem 33's), then
//       per-feature (mean_z, a, c) and running statistics  (bn_softmax.cu, fold)
//       out = softmax((z - mean_z) * a + c) per row, in place (bn_softmax.cu, rows)
//   forward_softmax_eval(same arguments as forward_eval) -> out (M, N)
//       GEMM with the folded epilogue (scale after BatchNorm), then the row softmax.
// For the autograd backward (called only when a gradient is needed):
//   forward_train_saved / forward_softmax_train_saved(same arguments as the
//       training forwards) -> [out, z (M, N), stats (2, N) = [mean_z | var_z]]
//   gemm_nt(a (M, K), b (N, K), any strides) -> a @ b^T, 3xTF32 (the Hopper
//       kernel's plain epilogue, or the portable one's identity fold)
//   bn_backward_train(grad_y, z, stats, scale, bn_weight, eps, scale_after_bn)
//       -> [grad_z, grad_scale, grad_bn_weight, grad_bn_bias]  (bn_backward.cu;
//       problem 84's grad_scale without its bn_bias * sum(grad_y) term)

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <cstdlib>

int sm80_gemm_block_m();
int sm90_gemm_block_m();
bool sm90_gemm_supported(const float* w, int M, int N, int K);
cudaError_t split_tf32_remainder(const float* x, int M, int K, float* x_small, int64_t* counter, int* zero_ints,
                                 int num_zero_ints, cudaStream_t stream);
void sm90_gemm_workspace(int M, int N, int K, int64_t* floats, int* zero_ints);
cudaError_t sm90_gemm_3xtf32_train(const float* x, const float* x_small, const float* w, float* out,
                                   float* part_mean, float* part_m2, int M, int N, int K, float* workspace,
                                   cudaStream_t stream);
cudaError_t sm90_gemm_3xtf32_eval(const float* x, const float* x_small, const float* w, float* out,
                                  const float* bias, const float* scale, const float* bn_weight,
                                  const float* bn_bias, const float* running_mean, const float* running_var,
                                  float eps, bool scale_after_bn, int M, int N, int K, float* workspace,
                                  cudaStream_t stream);
cudaError_t sm90_gemm_3xtf32_plain(const float* x, const float* x_small, const float* w, float* out, int M, int N,
                                   int K, float* workspace, cudaStream_t stream);
int64_t split_tf32_elems(int M, int K);
cudaError_t split_tf32(const float* x, int64_t row_stride, int64_t col_stride, int M, int K, float* big,
                       float* small, int64_t* counter, cudaStream_t stream);
cudaError_t sm80_gemm_3xtf32_train(const float* x_big, const float* x_small, const float* w,
                                   float* out, float* part_mean, float* part_m2, int M, int N, int K,
                                   cudaStream_t stream);
cudaError_t sm80_gemm_3xtf32_eval(const float* x_big, const float* x_small, const float* w,
                                  float* out, const float* bias,
                                  const float* scale, const float* bn_weight, const float* bn_bias,
                                  const float* running_mean, const float* running_var, float eps,
                                  bool scale_after_bn, int M, int N, int K, cudaStream_t stream);
cudaError_t sm90_gemm_3xtf32_train_fused(const float* x_big, const float* x_small, const float* w, float* out,
                                         const float* bias, const float* scale, const float* bn_weight,
                                         const float* bn_bias, float* running_mean, float* running_var,
                                         const int64_t* num_batches_tracked, float momentum, float eps, int M,
                                         int N, int K, cudaStream_t stream);
cudaError_t bn_apply(const float* z, float* out, const float* part_mean, const float* part_m2, int num_m_tiles,
                     int block_m, int M, int N, const float* bias, const float* scale, const float* bn_weight, const float* bn_bias,
                     const int64_t* num_batches_tracked, float momentum, float eps, float* running_mean,
                     float* running_var, cudaStream_t stream);
cudaError_t bn_softmax_fold_train(const float* part_mean, const float* part_m2, int num_m_tiles, int block_m, int M,
                                  int N, const float* bias, const float* scale, const float* bn_weight,
                                  const float* bn_bias, const int64_t* num_batches_tracked, float momentum, float eps,
                                  float* running_mean, float* running_var, float* coeff, cudaStream_t stream);
cudaError_t softmax_rows(float* out, const float* coeff, int M, int N, cudaStream_t stream);
cudaError_t bn_batch_stats(const float* part_mean, const float* part_m2, int num_m_tiles, int block_m, int M, int N,
                           float* stats, cudaStream_t stream);
cudaError_t bn_backward_train_launch(const float* g, const float* z, const float* stats, const float* scale,
                                     const float* gamma, float eps, bool scale_after_bn, int M, int N, float* dz,
                                     float* dscale, float* dgamma, float* dbeta, cudaStream_t stream);

namespace {

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "fused_gemm_bn: launch of ", what, " failed: ", cudaGetErrorString(err));
}

void check_vector(const torch::Tensor& t, const char* name, int64_t n, const torch::Tensor& x,
                  c10::ScalarType dtype = torch::kFloat32) {
  TORCH_CHECK(t.device() == x.device(), name, " must be on ", x.device(), ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, name, " must have shape (", n, "), got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// Checks x and weight and returns (M, N, K).  x may have any strides: the
// split pre-pass reads it in place (the caller's tensor is never written).
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
  const auto props = at::cuda::getDeviceProperties(x.get_device());
  TORCH_CHECK(props->major >= 8, "fused_gemm_bn needs compute capability >= 8.0 (tensor-core TF32), got ",
              props->major, ".", props->minor, " on ", props->name);
  return {static_cast<int>(x.size(0)), static_cast<int>(weight.size(0)), static_cast<int>(x.size(1))};
}

// x split into TF32 big / small parts in mma fragment order (split_tf32.cu).
struct SplitX {
  torch::Tensor storage;
  const float* big;
  const float* small;
};

// `counter`: bn.num_batches_tracked in training (incremented by the split
// kernel, see split_tf32.cu), else null.
SplitX split_x(const torch::Tensor& x, int M, int K, int64_t* counter, cudaStream_t stream) {
  const int64_t elems = split_tf32_elems(M, K);
  torch::Tensor storage = torch::empty({2 * elems}, x.options());
  float* big = storage.data_ptr<float>();
  float* small = big + elems;
  check_launch(split_tf32(x.data_ptr<float>(), x.stride(0), x.stride(1), M, K, big, small, counter, stream),
               "split_tf32");
  return {storage, big, small};
}

// The Hopper kernel where it applies.  FUSED_GEMM_BN_PORTABLE=1 forces the
// portable kernel, so both paths can be tested on one Hopper GPU.
bool use_sm90(const float* w, int M, int N, int K) {
  const char* force_portable = std::getenv("FUSED_GEMM_BN_PORTABLE");
  if (force_portable != nullptr && force_portable[0] == '1') return false;
  return sm90_gemm_supported(w, M, N, K);
}

// x and its TF32 remainder for the Hopper kernel, whose TMA loads need
// contiguous, 16-byte aligned rows: the caller's x is used in place when it is
// so, otherwise copied (never written).  `workspace` is the GEMM's split-tile
// scratch for an (M, K) x (N, K) product (null if it needs none), allocated
// with x_small and its arrival counts zeroed by the same split kernel.
struct RemainderX {
  torch::Tensor x;
  torch::Tensor storage;  // x_small, then the workspace
  const float* small;
  float* workspace;
};

RemainderX remainder_x(const torch::Tensor& x, int M, int N, int K, int64_t* counter, cudaStream_t stream) {
  const bool ready = x.is_contiguous() && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
  torch::Tensor xc = ready ? x : x.clone(at::MemoryFormat::Contiguous);
  const int64_t small_floats = static_cast<int64_t>(M) * K;  // a multiple of 4: the workspace stays 16-byte aligned
  int64_t workspace_floats = 0;
  int zero_ints = 0;
  sm90_gemm_workspace(M, N, K, &workspace_floats, &zero_ints);
  torch::Tensor storage = torch::empty({small_floats + workspace_floats}, x.options());
  float* small = storage.data_ptr<float>();
  float* workspace = workspace_floats > 0 ? small + small_floats : nullptr;
  int* arrivals = workspace != nullptr ? reinterpret_cast<int*>(workspace + workspace_floats - zero_ints) : nullptr;
  check_launch(split_tf32_remainder(xc.data_ptr<float>(), M, K, small, counter, arrivals, arrivals ? zero_ints : 0,
                                    stream),
               "split_tf32_remainder");
  return {xc, storage, small, workspace};
}

// Per-tile statistics for the multi-pass training path: part_mean, part_m2
// (num_m_tiles x N each), one allocation.
struct TrainScratch {
  torch::Tensor storage;
  float *part_mean, *part_m2;
};

TrainScratch train_scratch(const torch::Tensor& x, int num_m_tiles, int N) {
  TrainScratch s;
  s.storage = torch::empty({2 * static_cast<int64_t>(num_m_tiles) * N}, x.options());
  s.part_mean = s.storage.data_ptr<float>();
  s.part_m2 = s.part_mean + static_cast<int64_t>(num_m_tiles) * N;
  return s;
}

// The per-feature vectors every entry point takes, checked against x and N.
struct BnTensors {
  torch::Tensor bias, scale, bn_weight, bn_bias, running_mean, running_var;
};

void check_bn_tensors(const BnTensors& t, int N, const torch::Tensor& x) {
  check_vector(t.bias, "gemm.bias", N, x);
  check_vector(t.scale, "scale", N, x);
  check_vector(t.bn_weight, "bn.weight", N, x);
  check_vector(t.bn_bias, "bn.bias", N, x);
  check_vector(t.running_mean, "bn.running_mean", N, x);
  check_vector(t.running_var, "bn.running_var", N, x);
}

void check_training(const torch::Tensor& x, int M, int N, const torch::Tensor& num_batches_tracked) {
  TORCH_CHECK(M > 1, "Expected more than 1 value per channel when training, got input size ",
              torch::IntArrayRef({M, N}));
  TORCH_CHECK(num_batches_tracked.device() == x.device() && num_batches_tracked.scalar_type() == torch::kInt64 &&
                  num_batches_tracked.numel() == 1,
              "bn.num_batches_tracked must be a one-element int64 tensor on ", x.device());
}

// z = x @ weight^T into out, and z's per-tile statistics into scratch (kTrain
// epilogue): the Hopper kernel when `sm90`, else the portable one from x's
// split parts `xs` (made by the caller, who then passes a null counter).
// The Hopper path's split kernel increments `counter` (num_batches_tracked).
// Returns the GEMM's BLOCK_M (rows per statistics tile).
int gemm_train(const torch::Tensor& x, bool sm90, const SplitX& xs, const float* w, torch::Tensor& out,
               TrainScratch& scratch, int M, int N, int K, int64_t* counter, cudaStream_t stream) {
  const int block_m = sm90 ? sm90_gemm_block_m() : sm80_gemm_block_m();
  scratch = train_scratch(x, (M + block_m - 1) / block_m, N);
  if (sm90) {
    const RemainderX xr = remainder_x(x, M, N, K, counter, stream);
    check_launch(sm90_gemm_3xtf32_train(xr.x.data_ptr<float>(), xr.small, w, out.data_ptr<float>(),
                                        scratch.part_mean, scratch.part_m2, M, N, K, xr.workspace, stream),
                 "sm90_gemm_3xtf32_train");
  } else {
    check_launch(sm80_gemm_3xtf32_train(xs.big, xs.small, w, out.data_ptr<float>(), scratch.part_mean,
                                        scratch.part_m2, M, N, K, stream),
                 "sm80_gemm_3xtf32_train");
  }
  return block_m;
}

// out = a * (x @ weight^T) + c with the eval-mode fold (bn_stats.cuh, bn_eval_affine).
torch::Tensor gemm_eval(const torch::Tensor& x, const torch::Tensor& weight, const BnTensors& t, double eps,
                        bool scale_after_bn) {
  const auto [M, N, K] = check_gemm_operands(x, weight);
  check_bn_tensors(t, N, x);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(x.get_device()).stream();
  torch::Tensor out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const float* w = weight.data_ptr<float>();
  const float* bias = t.bias.data_ptr<float>();
  const float* scale = t.scale.data_ptr<float>();
  const float* bn_weight = t.bn_weight.data_ptr<float>();
  const float* bn_bias = t.bn_bias.data_ptr<float>();
  const float* running_mean = t.running_mean.data_ptr<float>();
  const float* running_var = t.running_var.data_ptr<float>();
  if (use_sm90(w, M, N, K)) {
    const RemainderX xr = remainder_x(x, M, N, K, nullptr, stream);
    check_launch(sm90_gemm_3xtf32_eval(xr.x.data_ptr<float>(), xr.small, w, out.data_ptr<float>(), bias, scale,
                                       bn_weight, bn_bias, running_mean, running_var, static_cast<float>(eps),
                                       scale_after_bn, M, N, K, xr.workspace, stream),
                 "sm90_gemm_3xtf32_eval");
    return out;
  }
  const SplitX xs = split_x(x, M, K, nullptr, stream);
  check_launch(sm80_gemm_3xtf32_eval(xs.big, xs.small, w, out.data_ptr<float>(), bias, scale, bn_weight, bn_bias,
                                     running_mean, running_var, static_cast<float>(eps), scale_after_bn, M, N, K,
                                     stream),
               "sm80_gemm_3xtf32_eval");
  return out;
}

}  // namespace

// Linear -> scale -> BatchNorm1d, training mode (problem 33).
torch::Tensor forward_train(torch::Tensor x, torch::Tensor weight, torch::Tensor bias, torch::Tensor scale,
                            torch::Tensor bn_weight, torch::Tensor bn_bias, torch::Tensor running_mean,
                            torch::Tensor running_var, torch::Tensor num_batches_tracked, double momentum,
                            double eps) {
  const auto [M, N, K] = check_gemm_operands(x, weight);
  check_training(x, M, N, num_batches_tracked);
  check_bn_tensors({bias, scale, bn_weight, bn_bias, running_mean, running_var}, N, x);

  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(x.get_device()).stream();
  torch::Tensor out = torch::empty({M, N}, x.options());
  const float* w = weight.data_ptr<float>();

  int64_t* counter = num_batches_tracked.data_ptr<int64_t>();
  const bool sm90 = use_sm90(w, M, N, K);
  SplitX xs{};
  if (!sm90) {
    xs = split_x(x, M, K, counter, stream);
    // Hopper with M <= 8 * BLOCK_M: one cluster-launched kernel does everything.
    const cudaError_t fused = sm90_gemm_3xtf32_train_fused(
        xs.big, xs.small, w, out.data_ptr<float>(), bias.data_ptr<float>(), scale.data_ptr<float>(),
        bn_weight.data_ptr<float>(), bn_bias.data_ptr<float>(), running_mean.data_ptr<float>(),
        running_var.data_ptr<float>(), num_batches_tracked.data_ptr<int64_t>(), static_cast<float>(momentum),
        static_cast<float>(eps), M, N, K, stream);
    if (fused != cudaErrorNotSupported) {
      check_launch(fused, "sm90_gemm_3xtf32_train_fused");
      return out;
    }
  }
  TrainScratch scratch;
  const int block_m = gemm_train(x, sm90, xs, w, out, scratch, M, N, K, sm90 ? counter : nullptr, stream);
  // Merge the per-tile statistics, update the running statistics, normalise in place (one kernel).
  check_launch(bn_apply(out.data_ptr<float>(), out.data_ptr<float>(), scratch.part_mean, scratch.part_m2, (M + block_m - 1) / block_m,
                        block_m, M, N, bias.data_ptr<float>(), scale.data_ptr<float>(), bn_weight.data_ptr<float>(),
                        bn_bias.data_ptr<float>(), num_batches_tracked.data_ptr<int64_t>(),
                        static_cast<float>(momentum), static_cast<float>(eps), running_mean.data_ptr<float>(),
                        running_var.data_ptr<float>(), stream),
               "bn_apply");
  return out;
}

// Linear -> scale -> BatchNorm1d, eval mode (problem 33).
torch::Tensor forward_eval(torch::Tensor x, torch::Tensor weight, torch::Tensor bias, torch::Tensor scale,
                           torch::Tensor bn_weight, torch::Tensor bn_bias, torch::Tensor running_mean,
                           torch::Tensor running_var, double eps) {
  return gemm_eval(x, weight, {bias, scale, bn_weight, bn_bias, running_mean, running_var}, eps, false);
}

namespace {

// The multi-pass training GEMM: z = x @ weight^T into `z` with its per-tile
// statistics and, when `stats` is not null, stats (2, N) = [mean_z | biased
// var_z] for the backward.  The x split increments num_batches_tracked.
struct TrainGemm {
  TrainScratch scratch;
  int block_m;
  int num_m_tiles(int M) const { return (M + block_m - 1) / block_m; }
};

TrainGemm train_gemm(const torch::Tensor& x, const float* w, torch::Tensor& z, float* stats,
                     const torch::Tensor& num_batches_tracked, int M, int N, int K, cudaStream_t stream) {
  int64_t* counter = num_batches_tracked.data_ptr<int64_t>();
  const bool sm90 = use_sm90(w, M, N, K);
  const SplitX xs = sm90 ? SplitX{} : split_x(x, M, K, counter, stream);
  TrainGemm g;
  g.block_m = gemm_train(x, sm90, xs, w, z, g.scratch, M, N, K, sm90 ? counter : nullptr, stream);
  if (stats != nullptr)
    check_launch(bn_batch_stats(g.scratch.part_mean, g.scratch.part_m2, g.num_m_tiles(M), g.block_m, M, N, stats,
                                stream),
                 "bn_batch_stats");
  return g;
}

// Problem 84's per-feature [mean_z | a | c] for softmax_rows, and the
// running-statistics update (bn_softmax.cu).
torch::Tensor softmax_coefficients(const TrainGemm& g, const torch::Tensor& x, int M, int N, const BnTensors& t,
                                   const torch::Tensor& num_batches_tracked, double momentum, double eps,
                                   cudaStream_t stream) {
  torch::Tensor coeff = torch::empty({3 * static_cast<int64_t>(N)}, x.options());
  check_launch(bn_softmax_fold_train(g.scratch.part_mean, g.scratch.part_m2, g.num_m_tiles(M), g.block_m, M, N,
                                     t.bias.data_ptr<float>(), t.scale.data_ptr<float>(),
                                     t.bn_weight.data_ptr<float>(), t.bn_bias.data_ptr<float>(),
                                     num_batches_tracked.data_ptr<int64_t>(), static_cast<float>(momentum),
                                     static_cast<float>(eps), t.running_mean.data_ptr<float>(),
                                     t.running_var.data_ptr<float>(), coeff.data_ptr<float>(), stream),
               "bn_softmax_fold_train");
  return coeff;
}

}  // namespace

// Linear -> BatchNorm1d -> scale -> Softmax(dim=1), training mode (problem 84).
torch::Tensor forward_softmax_train(torch::Tensor x, torch::Tensor weight, torch::Tensor bias, torch::Tensor scale,
                                    torch::Tensor bn_weight, torch::Tensor bn_bias, torch::Tensor running_mean,
                                    torch::Tensor running_var, torch::Tensor num_batches_tracked, double momentum,
                                    double eps) {
  const auto [M, N, K] = check_gemm_operands(x, weight);
  check_training(x, M, N, num_batches_tracked);
  const BnTensors t{bias, scale, bn_weight, bn_bias, running_mean, running_var};
  check_bn_tensors(t, N, x);

  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(x.get_device()).stream();
  torch::Tensor out = torch::empty({M, N}, x.options());
  const TrainGemm g = train_gemm(x, weight.data_ptr<float>(), out, nullptr, num_batches_tracked, M, N, K, stream);
  const torch::Tensor coeff = softmax_coefficients(g, x, M, N, t, num_batches_tracked, momentum, eps, stream);
  check_launch(softmax_rows(out.data_ptr<float>(), coeff.data_ptr<float>(), M, N, stream), "softmax_rows");
  return out;
}

// Linear -> BatchNorm1d -> scale -> Softmax(dim=1), eval mode (problem 84):
// the GEMM epilogue writes the folded logits, one row kernel the softmax.
torch::Tensor forward_softmax_eval(torch::Tensor x, torch::Tensor weight, torch::Tensor bias, torch::Tensor scale,
                                   torch::Tensor bn_weight, torch::Tensor bn_bias, torch::Tensor running_mean,
                                   torch::Tensor running_var, double eps) {
  torch::Tensor out = gemm_eval(x, weight, {bias, scale, bn_weight, bn_bias, running_mean, running_var}, eps, true);
  if (out.numel() == 0) return out;
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(x.get_device()).stream();
  check_launch(softmax_rows(out.data_ptr<float>(), nullptr, static_cast<int>(out.size(0)),
                            static_cast<int>(out.size(1)), stream),
               "softmax_rows");
  return out;
}

// ---------------------------------------------------------------------------
// Entry points for the autograd backward (model_new.py: _TrainFn, _eval_with_grad)
// ---------------------------------------------------------------------------

// forward_train, also returning z = x @ weight^T (M, N, without bias) and
// stats (2, N) float32 = [mean_z | biased var_z] for the backward.
std::vector<torch::Tensor> forward_train_saved(torch::Tensor x, torch::Tensor weight, torch::Tensor bias,
                                               torch::Tensor scale, torch::Tensor bn_weight, torch::Tensor bn_bias,
                                               torch::Tensor running_mean, torch::Tensor running_var,
                                               torch::Tensor num_batches_tracked, double momentum, double eps) {
  const auto [M, N, K] = check_gemm_operands(x, weight);
  check_training(x, M, N, num_batches_tracked);
  check_bn_tensors({bias, scale, bn_weight, bn_bias, running_mean, running_var}, N, x);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(x.get_device()).stream();
  torch::Tensor z = torch::empty({M, N}, x.options());
  torch::Tensor out = torch::empty({M, N}, x.options());
  torch::Tensor stats = torch::empty({2, N}, x.options());
  const TrainGemm g =
      train_gemm(x, weight.data_ptr<float>(), z, stats.data_ptr<float>(), num_batches_tracked, M, N, K, stream);
  check_launch(bn_apply(z.data_ptr<float>(), out.data_ptr<float>(), g.scratch.part_mean, g.scratch.part_m2,
                        g.num_m_tiles(M), g.block_m, M, N, bias.data_ptr<float>(), scale.data_ptr<float>(),
                        bn_weight.data_ptr<float>(), bn_bias.data_ptr<float>(),
                        num_batches_tracked.data_ptr<int64_t>(), static_cast<float>(momentum),
                        static_cast<float>(eps), running_mean.data_ptr<float>(), running_var.data_ptr<float>(),
                        stream),
               "bn_apply");
  return {out, z, stats};
}

// forward_softmax_train, also returning z and stats as forward_train_saved.
std::vector<torch::Tensor> forward_softmax_train_saved(torch::Tensor x, torch::Tensor weight, torch::Tensor bias,
                                                       torch::Tensor scale, torch::Tensor bn_weight,
                                                       torch::Tensor bn_bias, torch::Tensor running_mean,
                                                       torch::Tensor running_var, torch::Tensor num_batches_tracked,
                                                       double momentum, double eps) {
  const auto [M, N, K] = check_gemm_operands(x, weight);
  check_training(x, M, N, num_batches_tracked);
  const BnTensors t{bias, scale, bn_weight, bn_bias, running_mean, running_var};
  check_bn_tensors(t, N, x);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(x.get_device()).stream();
  torch::Tensor z = torch::empty({M, N}, x.options());
  torch::Tensor stats = torch::empty({2, N}, x.options());
  const TrainGemm g =
      train_gemm(x, weight.data_ptr<float>(), z, stats.data_ptr<float>(), num_batches_tracked, M, N, K, stream);
  const torch::Tensor coeff = softmax_coefficients(g, x, M, N, t, num_batches_tracked, momentum, eps, stream);
  torch::Tensor out = z.clone();  // softmax_rows works in place
  check_launch(softmax_rows(out.data_ptr<float>(), coeff.data_ptr<float>(), M, N, stream), "softmax_rows");
  return {out, z, stats};
}

// a @ b^T, float32-accurate (3xTF32) for float32 CUDA a (M, K) and b (N, K) of
// any strides (non-contiguous operands are copied first).  Returns (M, N).
torch::Tensor gemm_nt(torch::Tensor a, torch::Tensor b) {
  TORCH_CHECK(a.is_cuda() && b.is_cuda() && a.device() == b.device(),
              "gemm_nt: a and b must be CUDA tensors on one device, got ", a.device(), " and ", b.device());
  TORCH_CHECK(a.scalar_type() == torch::kFloat32 && b.scalar_type() == torch::kFloat32,
              "gemm_nt: a and b must be float32, got ", a.scalar_type(), " and ", b.scalar_type());
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(1),
              "gemm_nt: expected a (M, K) and b (N, K), got ", a.sizes(), " and ", b.sizes());
  TORCH_CHECK(a.size(0) <= INT32_MAX && b.size(0) <= INT32_MAX && a.size(1) <= INT32_MAX,
              "gemm_nt: sizes must fit in int32, got ", a.sizes(), " and ", b.sizes());
  const c10::cuda::CUDAGuard guard(a.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(a.get_device()).stream();
  const int M = static_cast<int>(a.size(0)), N = static_cast<int>(b.size(0)), K = static_cast<int>(a.size(1));
  torch::Tensor out = torch::empty({M, N}, a.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
  const torch::Tensor ac = a.contiguous(), bc = b.contiguous();
  const float* w = bc.data_ptr<float>();
  if (use_sm90(w, M, N, K)) {
    const RemainderX xr = remainder_x(ac, M, N, K, nullptr, stream);
    check_launch(sm90_gemm_3xtf32_plain(xr.x.data_ptr<float>(), xr.small, w, out.data_ptr<float>(), M, N, K,
                                        xr.workspace, stream),
                 "sm90_gemm_3xtf32_plain");
    return out;
  }
  // The portable kernel's eval epilogue with the identity fold: a = 1 / sqrt(1 + 0) = 1, c = 0 exactly.
  const torch::Tensor ones = torch::ones({N}, a.options()), zeros = torch::zeros({N}, a.options());
  const float* one = ones.data_ptr<float>();
  const float* zero = zeros.data_ptr<float>();
  const SplitX xs = split_x(ac, M, K, nullptr, stream);
  check_launch(sm80_gemm_3xtf32_eval(xs.big, xs.small, w, out.data_ptr<float>(), zero, one, one, zero, zero, one, 0.f,
                                     false, M, N, K, stream),
               "sm80_gemm_3xtf32_eval");
  return out;
}

// Training-mode BatchNorm backward (bn_backward.cu): from grad_y = dL/dy
// (M, N), z and stats of forward_*_saved, returns [grad_z (M, N), grad_scale,
// grad_bn_weight, grad_bn_bias (N each)].  scale_after_bn selects problem 84's
// order (y = scale * BN(z + b), the pre-softmax logits) over problem 33's; its
// grad_scale then lacks the bn_bias * sum_m grad_y term, which the caller adds.
std::vector<torch::Tensor> bn_backward_train(torch::Tensor grad_y, torch::Tensor z, torch::Tensor stats,
                                             torch::Tensor scale, torch::Tensor bn_weight, double eps,
                                             bool scale_after_bn) {
  TORCH_CHECK(z.is_cuda() && z.scalar_type() == torch::kFloat32 && z.dim() == 2 && z.is_contiguous(),
              "bn_backward_train: z must be a contiguous float32 CUDA (M, N) tensor");
  const int64_t M = z.size(0), N = z.size(1);
  TORCH_CHECK(grad_y.device() == z.device() && grad_y.scalar_type() == torch::kFloat32 &&
                  grad_y.sizes() == z.sizes(),
              "bn_backward_train: grad_y must be float32 of shape ", z.sizes(), " on ", z.device(), ", got ",
              grad_y.scalar_type(), " ", grad_y.sizes(), " on ", grad_y.device());
  TORCH_CHECK(stats.device() == z.device() && stats.scalar_type() == torch::kFloat32 && stats.is_contiguous() &&
                  stats.dim() == 2 && stats.size(0) == 2 && stats.size(1) == N,
              "bn_backward_train: stats must be a contiguous float32 (2, ", N, ") tensor on ", z.device());
  TORCH_CHECK(M <= INT32_MAX && N <= INT32_MAX, "bn_backward_train: sizes must fit in int32");
  check_vector(scale, "scale", N, z);
  check_vector(bn_weight, "bn.weight", N, z);
  const c10::cuda::CUDAGuard guard(z.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(z.get_device()).stream();
  const torch::Tensor g = grad_y.contiguous();
  torch::Tensor grad_z = torch::empty({M, N}, z.options());
  // Three allocations, not views of one: custom operators may not return aliases.
  torch::Tensor grad_scale = torch::empty({N}, z.options()), grad_bn_weight = torch::empty({N}, z.options()),
                grad_bn_bias = torch::empty({N}, z.options());
  check_launch(bn_backward_train_launch(g.data_ptr<float>(), z.data_ptr<float>(), stats.data_ptr<float>(),
                                        scale.data_ptr<float>(), bn_weight.data_ptr<float>(), static_cast<float>(eps),
                                        scale_after_bn, static_cast<int>(M), static_cast<int>(N),
                                        grad_z.data_ptr<float>(), grad_scale.data_ptr<float>(),
                                        grad_bn_weight.data_ptr<float>(), grad_bn_bias.data_ptr<float>(), stream),
               "bn_backward_train");
  return {grad_z, grad_scale, grad_bn_weight, grad_bn_bias};
}
