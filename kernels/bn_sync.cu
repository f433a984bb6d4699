// bn_sync.cu -- synchronized BatchNorm's per-feature statistics: this
// process's, for the all_gather, and the merge of every process's into the
// normalisation coefficients and the running-statistics update (model_new.py,
// _SyncFusedTrainFn; the all_gather itself runs in Python between the two).
//
// Exchanged per feature j, by every process r of the group: (c_r, mean_r, M2_r)
// of v = x W^T + bias over its c_r rows, float64 (the torch-op path,
// _sync_local_stats, exchanges the same quantity, so processes may take either path).
//
// bn_local_stats: from the training GEMM's per-tile statistics of z = x W^T
//   (part_mean, part_m2: (num_m_tiles, N) float32, tile t holding
//   min(block_m, M - t * block_m) rows) -> local (3, N) float64 =
//   [M | mean_z + bias | M2_z] (merge_tile_statistics, bn_stats.cuh; the bias
//   shifts the mean only).
//
// sync_bn_finalize: gathered (world, 3, N) float64 in rank order ->
//   C = sum_r c_r,  mean_v = sum_r c_r mean_r / C,  M2 = sum_r (M2_r + c_r (mean_r - mean_v)^2)
//   (the two-pass parallel formula of Chan, Golub and LeVeque 1979, float64;
//   processes with c_r = 0 add nothing), then with mean_z = mean_v - bias and
//   var_z = M2 / C (biased):
//     stats (2, N) float32 = [mean_z | var_z]        (what bn_backward_grad reads)
//     problem 33: coeff (2, N) = [mean_z | a],       a = s gamma / sqrt(s^2 var_z + eps)
//     problem 84: coeff (3, N) = [mean_z | a | c],   a = s gamma / sqrt(var_z + eps), c = s beta
//   (the coefficients bn_apply_folded and softmax_rows take; each rounded to
//   float32 once), and nn.BatchNorm1d's update of the running statistics of
//   the BatchNorm input u = s v (33) or v (84):
//     running_mean = (1 - f) running_mean + f s mean_v
//     running_var  = (1 - f) running_var  + f s^2 M2 / (C - 1)      (unbiased)
//   f = momentum, or 1 / num_batches_tracked (momentum < 0: momentum=None; the
//   counter already incremented for this call).  count (1) float64 = C.
//   Precondition: C >= 2 (the caller guarantees it: this process has >= 2 rows).
//
// One thread per feature; reads world * 3 values and five vectors, writes
// about 7 N floats: a few microseconds at N = 8192.

#include <cuda_runtime.h>
#include <stdint.h>

#include "bn_stats.cuh"
#include "launchers.cuh"

namespace fused_gemm_bn {
namespace {

constexpr int kSyncThreads = 256;

__global__ void __launch_bounds__(kSyncThreads)
    bn_local_stats_kernel(const float* part_mean, const float* part_m2, int num_m_tiles, int block_m, int M, int N,
                          const float* bias, double* local) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= N) return;
  double mean, m2;
  merge_tile_statistics(part_mean, part_m2, num_m_tiles, block_m, M, N, j, mean, m2);
  local[j] = static_cast<double>(M);
  local[N + j] = mean + static_cast<double>(bias[j]);
  local[2 * N + j] = m2;
}

struct SyncFinalizeArgs {
  const double* gathered;
  int world, N;
  BatchNormArgs bn;  // every field
  float* stats;
  float* coeff;
  double* count;
};

__global__ void __launch_bounds__(kSyncThreads) sync_bn_finalize_kernel(const SyncFinalizeArgs p) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= p.N) return;
  const size_t rank_stride = 3 * static_cast<size_t>(p.N);
  double count = 0.0, mean = 0.0;
  for (int r = 0; r < p.world; ++r) {
    const double c = p.gathered[r * rank_stride + j];
    count += c;
    mean += c * p.gathered[r * rank_stride + p.N + j];
  }
  mean /= count;
  double m2 = 0.0;
  for (int r = 0; r < p.world; ++r) {
    const double c = p.gathered[r * rank_stride + j];
    if (c == 0.0) continue;
    const double d = p.gathered[r * rank_stride + p.N + j] - mean;
    m2 += p.gathered[r * rank_stride + 2 * p.N + j] + c * d * d;
  }
  const double mean_z = mean - static_cast<double>(p.bn.bias[j]);
  const double var_z = m2 / count;
  const double s = p.bn.scale[static_cast<size_t>(j) * p.bn.scale_stride], gamma = p.bn.bn_weight[j];
  p.stats[j] = static_cast<float>(mean_z);
  p.stats[p.N + j] = static_cast<float>(var_z);
  p.coeff[j] = static_cast<float>(mean_z);
  const double s_u = p.bn.scale_after_bn ? 1.0 : s;  // u = s_u v
  p.coeff[p.N + j] = static_cast<float>(s * gamma / sqrt(s_u * s_u * var_z + static_cast<double>(p.bn.eps)));
  if (p.bn.scale_after_bn) p.coeff[2 * p.N + j] = static_cast<float>(s * static_cast<double>(p.bn.bn_bias[j]));
  const double f = p.bn.momentum >= 0.f ? static_cast<double>(p.bn.momentum)
                                        : 1.0 / static_cast<double>(*p.bn.num_batches_tracked);
  p.bn.running_mean[j] = static_cast<float>((1.0 - f) * p.bn.running_mean[j] + f * s_u * mean);
  p.bn.running_var[j] = static_cast<float>((1.0 - f) * p.bn.running_var[j] + f * s_u * s_u * (m2 / (count - 1.0)));
  if (j == 0) *p.count = count;
}

}  // namespace
}  // namespace fused_gemm_bn

// local (3, N) float64 = [M | mean_z + bias | M2_z] from the per-tile statistics.
cudaError_t fused_gemm_bn::bn_local_stats(const float* part_mean, const float* part_m2, int num_m_tiles, int block_m,
                                          int M, int N, const float* bias, double* local, cudaStream_t stream) {
  if (M == 0 || N == 0) return cudaSuccess;
  bn_local_stats_kernel<<<(N + kSyncThreads - 1) / kSyncThreads, kSyncThreads, 0, stream>>>(
      part_mean, part_m2, num_m_tiles, block_m, M, N, bias, local);
  return cudaGetLastError();
}

// The merged batch's stats, coeff and count, and the running-statistics update (header).
cudaError_t fused_gemm_bn::sync_bn_finalize(const double* gathered, int world, int N, const BatchNormArgs& bn,
                                            float* stats, float* coeff, double* count, cudaStream_t stream) {
  if (N == 0) return cudaSuccess;
  if (world < 1) return cudaErrorInvalidValue;
  const SyncFinalizeArgs p{gathered, world, N, bn, stats, coeff, count};
  sync_bn_finalize_kernel<<<(N + kSyncThreads - 1) / kSyncThreads, kSyncThreads, 0, stream>>>(p);
  return cudaGetLastError();
}
