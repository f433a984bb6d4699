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
// Numerics: tiles are merged with Chan et al.'s pairwise update ("Updating
// formulae and a pairwise algorithm for computing sample variances", 1979) in
// float64, so no E[z^2] - E[z]^2 cancellation; coefficients are rounded to
// float32 once.  One thread per feature; the work is O(num_m_tiles * N).
// Precondition: M >= 2 (the caller raises PyTorch's error for M == 1).

#include <cuda_runtime.h>
#include <stdint.h>

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
  for (int t = 0; t < num_m_tiles; ++t) {
    const double n_b = static_cast<double>(min(block_m, M - t * block_m));
    const double mean_b = part_mean[static_cast<size_t>(t) * N + j];
    const double m2_b = part_m2[static_cast<size_t>(t) * N + j];
    const double n = count + n_b;
    const double delta = mean_b - mean;
    mean += delta * (n_b / n);
    m2 += m2_b + delta * delta * (count * n_b / n);
    count = n;
  }
  const double var_biased = m2 / count;
  const double var_unbiased = m2 / (count - 1.0);

  const double s = scale[j];
  const double a = s * bn_weight[j] / sqrt(s * s * var_biased + static_cast<double>(eps));
  coef_a[j] = static_cast<float>(a);
  coef_mean[j] = static_cast<float>(mean);

  const double f = momentum >= 0.f ? static_cast<double>(momentum)
                                   : 1.0 / static_cast<double>(*num_batches_tracked);
  const double batch_mean_u = s * (mean + static_cast<double>(bias[j]));
  const double batch_var_u = s * s * var_unbiased;
  running_mean[j] = static_cast<float>((1.0 - f) * running_mean[j] + f * batch_mean_u);
  running_var[j] = static_cast<float>((1.0 - f) * running_var[j] + f * batch_var_u);
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
