// bn_finalize.cu -- merge per-tile BatchNorm partial statistics, update the
// running statistics, and produce the per-feature normalisation coefficients.
//
// Inputs (float32, row-major)
//   part_mean, part_m2  (num_m_tiles, N): mean and sum of squared deviations of
//                       z = x @ W^T over the rows of each M tile (tile t holds
//                       min(block_m, M - t * block_m) rows), from the GEMM epilogue
//   bias, scale, bn_weight (N)
//   num_batches_tracked  int64 scalar, already incremented for this call
// Outputs
//   running_mean, running_var (N, float32): updated in place, as nn.BatchNorm1d:
//       f = momentum            (momentum >= 0)
//       f = 1 / num_batches_tracked   (momentum < 0 encodes momentum=None)
//       running_mean = (1 - f) * running_mean + f * scale * (mean_z + bias)
//       running_var  = (1 - f) * running_var  + f * scale^2 * var_z * M / (M - 1)
//   coef_a, coef_mean (N, float32): the training-mode output is
//       out = (z - coef_mean) * coef_a + bn_bias,
//       coef_mean = mean_z,  coef_a = scale * bn_weight / sqrt(scale^2 * var_z + eps)
//   (the Linear bias cancels: u = scale * (z + bias) has mean scale * (mean_z + bias)
//   and variance scale^2 * var_z, var_z biased).
//
// Numerics: tiles are merged with Chan et al.'s pairwise update in float64
// (bn_stats.cuh), so no E[z^2] - E[z]^2 cancellation; coefficients are rounded
// to float32 once.  One thread per feature; the work is O(num_m_tiles * N).
// Precondition: M >= 2 (the caller raises PyTorch's error for M == 1).

#include <cuda_runtime.h>
#include <stdint.h>

#include "bn_stats.cuh"

namespace fused_gemm_bn {

constexpr int kFinalizeThreads = 64;  // small blocks: N = 8192 features spread over 128 SMs

__global__ void __launch_bounds__(kFinalizeThreads)
    bn_finalize_kernel(const float* __restrict__ part_mean, const float* __restrict__ part_m2,
                       int num_m_tiles, int block_m, int M, int N, const float* __restrict__ bias,
                       const float* __restrict__ scale, const float* __restrict__ bn_weight,
                       const int64_t* __restrict__ num_batches_tracked, float momentum, float eps,
                       float* __restrict__ running_mean, float* __restrict__ running_var,
                       float* __restrict__ coef_a, float* __restrict__ coef_mean) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= N) return;

  double count = 0.0, mean = 0.0, m2 = 0.0;
#pragma unroll 8
  for (int t = 0; t < num_m_tiles; ++t) {
    merge_chan(count, mean, m2, static_cast<double>(min(block_m, M - t * block_m)),
               part_mean[static_cast<size_t>(t) * N + j], part_m2[static_cast<size_t>(t) * N + j]);
  }
  coef_a[j] = bn_train_slope(m2, count, scale[j], bn_weight[j], eps);
  coef_mean[j] = static_cast<float>(mean);
  bn_update_running(mean, m2, count, bias[j], scale[j], momentum, num_batches_tracked, running_mean + j,
                    running_var + j);
}

}  // namespace fused_gemm_bn

cudaError_t bn_finalize(const float* part_mean, const float* part_m2, int num_m_tiles, int block_m, int M,
                        int N, const float* bias, const float* scale, const float* bn_weight,
                        const int64_t* num_batches_tracked, float momentum, float eps, float* running_mean,
                        float* running_var, float* coef_a, float* coef_mean, cudaStream_t stream) {
  using namespace fused_gemm_bn;
  const int blocks = (N + kFinalizeThreads - 1) / kFinalizeThreads;
  bn_finalize_kernel<<<blocks, kFinalizeThreads, 0, stream>>>(part_mean, part_m2, num_m_tiles, block_m, M, N,
                                                              bias, scale, bn_weight, num_batches_tracked,
                                                              momentum, eps, running_mean, running_var,
                                                              coef_a, coef_mean);
  return cudaGetLastError();
}
