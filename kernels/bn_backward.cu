// bn_backward.cu -- training-mode BatchNorm backward for the fused models, and
// the per-feature batch statistics it needs from the forward.
//
// Forward being differentiated (z = x @ W^T, no bias: the bias cancels), per
// feature j over the M rows of the batch, mu = mean(z), var = biased var(z):
//   scale_after_bn = false (problem 33: Linear -> scale -> BatchNorm):
//     y = (z - mu) * a + beta,   a = s * gamma / sigma,   sigma^2 = s^2 var + eps
//   scale_after_bn = true  (problem 84: Linear -> BatchNorm -> scale; y is the
//     pre-softmax logit):
//     y = s * (gamma * (z - mu) / sigma + beta),           sigma^2 = var + eps
// With g = dL/dy, S1 = sum_m g, S2 = sum_m g (z - mu), xhat = (z - mu)/sigma:
//   problem 33: dbeta = S1,   dgamma = s S2 / sigma,   dscale = gamma S2 eps / sigma^3
//               dz = a (g - S1 / M - (z - mu) s^2 S2 / (sigma^2 M))
//   problem 84: dbeta = s S1, dgamma = s S2 / sigma,   dscale = gamma S2 / sigma (+ beta S1,
//               which the caller adds: it needs no pass over the batch)
//               dz = a (g - S1 / M - (z - mu) S2 / (sigma^2 M)),  a = s gamma / sigma
// The Linear bias's gradient is exactly zero in training (sum_m dz = 0 in
// exact arithmetic) and is not computed.  dscale of problem 33 is exact in
// this form: the unfused chain computes it as a difference of two terms that
// agree to within eps / sigma^2, so PyTorch's value carries that cancellation.
//
// Tensors: g, z, dz (M, N) float32 row-major contiguous; stats (2, N) float32
// = [mu | var]; scale, gamma (N); outputs dscale, dgamma, dbeta (N).
// Reductions S1, S2 in float64 (each thread over its rows, then across the
// block's warps); coefficients in float64; dz rounded once to float32.
//
// Kernel: one CTA per 32 features (a warp reads 128 contiguous bytes of a
// row); its 8 warps take every 8th row.  Pass 1 reduces S1 and S2, pass 2
// re-reads g and z (from L2: 2 x 128 KB per CTA at M = 1024) and writes dz.
// Memory-bound: reads g and z twice (the second time mostly from L2), writes dz.

#include <cuda_runtime.h>
#include <stdint.h>

#include "bn_stats.cuh"
#include "launchers.cuh"

namespace fused_gemm_bn {

constexpr int kBwdCols = 32;   // features per CTA (one warp's width)
constexpr int kBwdWarps = 8;   // row groups per CTA
constexpr int kBwdRowBatch = 8;  // rows loaded per thread before use
constexpr int kStatsThreads = 256;

struct BnBackwardArgs {
  const float* g;
  const float* z;
  const float* stats;
  const float* scale;
  const float* gamma;
  float eps;
  bool scale_after_bn;
  int M, N;
  float* dz;
  float* dscale;
  float* dgamma;
  float* dbeta;
};

// Rows row + r * kBwdWarps (r < kBwdRowBatch) of g and z at feature j, all
// loads issued before any is used; rows past M read as g = 0, z = z_pad.
__device__ __forceinline__ void load_rows(const BnBackwardArgs& p, int row, int j, float z_pad,
                                          float (&gv)[kBwdRowBatch], float (&zv)[kBwdRowBatch]) {
#pragma unroll
  for (int r = 0; r < kBwdRowBatch; ++r) {
    const int m = row + r * kBwdWarps;
    const size_t idx = static_cast<size_t>(m) * p.N + j;
    gv[r] = m < p.M ? p.g[idx] : 0.f;
    zv[r] = m < p.M ? p.z[idx] : z_pad;
  }
}

__global__ void __launch_bounds__(kBwdCols* kBwdWarps) bn_backward_train_kernel(const BnBackwardArgs p) {
  __shared__ double red[2][kBwdWarps][kBwdCols];
  __shared__ double coef[3][kBwdCols];  // per feature: a, c1 = S1 / M, c2 (slope of the xhat term)
  const int lane = threadIdx.x % kBwdCols, warp = threadIdx.x / kBwdCols;
  const int j = blockIdx.x * kBwdCols + lane;
  const bool valid = j < p.N;
  const float mu = valid ? p.stats[j] : 0.f;

  double s1 = 0.0, s2 = 0.0;
  if (valid) {
    for (int row = warp; row < p.M; row += kBwdWarps * kBwdRowBatch) {
      float gv[kBwdRowBatch], zv[kBwdRowBatch];
      load_rows(p, row, j, mu, gv, zv);
#pragma unroll
      for (int r = 0; r < kBwdRowBatch; ++r) {
        s1 += gv[r];
        s2 += static_cast<double>(gv[r]) * static_cast<double>(zv[r] - mu);
      }
    }
  }
  red[0][warp][lane] = s1;
  red[1][warp][lane] = s2;
  __syncthreads();
  if (warp == 0 && valid) {
    double S1 = 0.0, S2 = 0.0;
#pragma unroll
    for (int w = 0; w < kBwdWarps; ++w) {
      S1 += red[0][w][lane];
      S2 += red[1][w][lane];
    }
    const double s = p.scale[j], gamma = p.gamma[j], var = p.stats[p.N + j], count = p.M;
    const double s2_var = p.scale_after_bn ? var : s * s * var;
    const double sigma2 = s2_var + static_cast<double>(p.eps);
    const double sigma = sqrt(sigma2);
    const double a = s * gamma / sigma;
    // dz = a (g - S1 / M - (z - mu) * c2)
    const double c2 = (p.scale_after_bn ? 1.0 : s * s) * S2 / (sigma2 * count);
    coef[0][lane] = a;
    coef[1][lane] = S1 / count;
    coef[2][lane] = c2;
    if (p.scale_after_bn) {
      p.dbeta[j] = static_cast<float>(s * S1);
      p.dgamma[j] = static_cast<float>(s * S2 / sigma);
      p.dscale[j] = static_cast<float>(gamma * S2 / sigma);
    } else {
      p.dbeta[j] = static_cast<float>(S1);
      p.dgamma[j] = static_cast<float>(s * S2 / sigma);
      p.dscale[j] = static_cast<float>(gamma * S2 * static_cast<double>(p.eps) / (sigma2 * sigma));
    }
  }
  __syncthreads();
  if (!valid) return;
  const float a = static_cast<float>(coef[0][lane]);
  const float c1 = static_cast<float>(coef[1][lane]);
  const float c2 = static_cast<float>(coef[2][lane]);
  for (int row = warp; row < p.M; row += kBwdWarps * kBwdRowBatch) {
    float gv[kBwdRowBatch], zv[kBwdRowBatch];
    load_rows(p, row, j, mu, gv, zv);
#pragma unroll
    for (int r = 0; r < kBwdRowBatch; ++r) {
      const int m = row + r * kBwdWarps;
      if (m < p.M) p.dz[static_cast<size_t>(m) * p.N + j] = a * (gv[r] - c1 - (zv[r] - mu) * c2);
    }
  }
}

// stats[0][j] = mean, stats[1][j] = biased variance of z[:, j], from the
// GEMM's per-tile statistics (bn_stats.cuh, merge_tile_statistics).
__global__ void __launch_bounds__(kStatsThreads)
    bn_batch_stats_kernel(const float* part_mean, const float* part_m2, int num_m_tiles, int block_m, int M, int N,
                          float* stats) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= N) return;
  double mean, m2;
  merge_tile_statistics(part_mean, part_m2, num_m_tiles, block_m, M, N, j, mean, m2);
  stats[j] = static_cast<float>(mean);
  stats[N + j] = static_cast<float>(m2 / static_cast<double>(M));
}

}  // namespace fused_gemm_bn

cudaError_t fused_gemm_bn::bn_batch_stats(const float* part_mean, const float* part_m2, int num_m_tiles, int block_m,
                                          int M, int N, float* stats, cudaStream_t stream) {
  if (M == 0 || N == 0) return cudaSuccess;
  bn_batch_stats_kernel<<<(N + kStatsThreads - 1) / kStatsThreads, kStatsThreads, 0, stream>>>(
      part_mean, part_m2, num_m_tiles, block_m, M, N, stats);
  return cudaGetLastError();
}

// grad_z (M, N) and grad_scale, grad_bn_weight, grad_bn_bias (N) from grad_y = dL/dy (formulas above).
cudaError_t fused_gemm_bn::bn_backward_train(const float* grad_y, const float* z, const float* stats,
                                             const float* scale, const float* bn_weight, float eps,
                                             bool scale_after_bn, int M, int N, float* grad_z, float* grad_scale,
                                             float* grad_bn_weight, float* grad_bn_bias, cudaStream_t stream) {
  if (N == 0) return cudaSuccess;
  const BnBackwardArgs p{grad_y, z, stats, scale, bn_weight, eps, scale_after_bn,
                         M,      N, grad_z, grad_scale, grad_bn_weight, grad_bn_bias};
  bn_backward_train_kernel<<<(N + kBwdCols - 1) / kBwdCols, kBwdCols * kBwdWarps, 0, stream>>>(p);
  return cudaGetLastError();
}
