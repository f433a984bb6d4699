// bn_stats.cuh -- per-feature BatchNorm math shared by the
// multi-kernel training paths (bn_apply.cu for Linear -> scale -> BatchNorm,
// bn_softmax.cu for Linear -> BatchNorm -> scale -> Softmax, bn_sync.cu,
// bn_backward.cu) and the eval-mode fold used by both GEMMs' epilogues
// (sm80_gemm_3xtf32_bn.cuh, sm90_gemm_tiles.cuh), and the backward's per-feature
// sum over a CTA's row groups (bn_backward.cu, lowp/bn_16bit_backward.cu:
// row_groups_total).  Device functions only; the training statistics are float64
// throughout.
//
// Algebra (training mode, scale before BatchNorm), z = x @ W^T for one feature
// over the batch of M rows:
//   u = scale * (z + bias)  has  mean_u = scale * (mean_z + bias),
//                                 var_u  = scale^2 * var_z   (biased)
//   out = (z - mean_z) * a + bn_bias,  a = scale * bn_weight / sqrt(scale^2 var_z + eps)
//   running_mean = (1 - f) running_mean + f mean_u
//   running_var  = (1 - f) running_var  + f scale^2 var_z M / (M - 1)
//   f = momentum, or 1 / num_batches_tracked for momentum=None (momentum < 0 here).
#pragma once
#include <stdint.h>

namespace fused_gemm_bn {

// Merges the per-tile statistics of feature j, as the GEMMs' kTrain epilogues
// write them (part_mean / part_m2: (num_m_tiles, N), tile t holding
// min(block_m, M - t * block_m) rows), by the two-pass parallel formula
//   mean = sum_t n_t mean_t / M,   m2 = sum_t (m2_t + n_t (mean_t - mean)^2)
// in float64 (Chan, Golub & LeVeque 1979): no E[z^2] - E[z]^2 cancellation.
__device__ __forceinline__ void merge_tile_statistics(const float* part_mean, const float* part_m2,
                                                      int num_m_tiles, int block_m, int M, int N, int j,
                                                      double& mean, double& m2) {
  mean = 0.0;
  for (int t = 0; t < num_m_tiles; ++t) {
    const double n_t = static_cast<double>(min(block_m, M - t * block_m));
    mean += n_t * static_cast<double>(part_mean[static_cast<size_t>(t) * N + j]);
  }
  mean /= static_cast<double>(M);
  m2 = 0.0;
  for (int t = 0; t < num_m_tiles; ++t) {
    const double n_t = static_cast<double>(min(block_m, M - t * block_m));
    const double d = static_cast<double>(part_mean[static_cast<size_t>(t) * N + j]) - mean;
    m2 += static_cast<double>(part_m2[static_cast<size_t>(t) * N + j]) + n_t * d * d;
  }
}

// merge_tile_statistics for the four features col .. col + 3 at once
// (num_m_tiles <= kMaxTiles; part_mean, part_m2 and col 16-byte aligned, N % 4
// == 0): all tiles' means are loaded together (16-byte loads), then all m2s,
// so two L2 round trips replace 2 num_m_tiles dependent loads per feature.
// The same operations in the same order per feature: bit-identical results.
template <int kMaxTiles>
__device__ __forceinline__ void merge_tile_statistics4(const float* part_mean, const float* part_m2, int num_m_tiles,
                                                       int block_m, int M, int N, int col, double (&mean)[4],
                                                       double (&m2)[4]) {
  float4 tm[kMaxTiles];
#pragma unroll
  for (int t = 0; t < kMaxTiles; ++t)
    if (t < num_m_tiles) tm[t] = __ldg(reinterpret_cast<const float4*>(part_mean + static_cast<size_t>(t) * N + col));
#pragma unroll
  for (int c = 0; c < 4; ++c) mean[c] = 0.0;
#pragma unroll
  for (int t = 0; t < kMaxTiles; ++t)
    if (t < num_m_tiles) {
      const double n_t = static_cast<double>(min(block_m, M - t * block_m));
      mean[0] += n_t * static_cast<double>(tm[t].x);
      mean[1] += n_t * static_cast<double>(tm[t].y);
      mean[2] += n_t * static_cast<double>(tm[t].z);
      mean[3] += n_t * static_cast<double>(tm[t].w);
    }
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    mean[c] /= static_cast<double>(M);
    m2[c] = 0.0;
  }
  float4 t2[kMaxTiles];
#pragma unroll
  for (int t = 0; t < kMaxTiles; ++t)
    if (t < num_m_tiles) t2[t] = __ldg(reinterpret_cast<const float4*>(part_m2 + static_cast<size_t>(t) * N + col));
#pragma unroll
  for (int t = 0; t < kMaxTiles; ++t)
    if (t < num_m_tiles) {
      const double n_t = static_cast<double>(min(block_m, M - t * block_m));
      const double d0 = static_cast<double>(tm[t].x) - mean[0], d1 = static_cast<double>(tm[t].y) - mean[1];
      const double d2 = static_cast<double>(tm[t].z) - mean[2], d3 = static_cast<double>(tm[t].w) - mean[3];
      m2[0] += static_cast<double>(t2[t].x) + n_t * d0 * d0;
      m2[1] += static_cast<double>(t2[t].y) + n_t * d1 * d1;
      m2[2] += static_cast<double>(t2[t].z) + n_t * d2 * d2;
      m2[3] += static_cast<double>(t2[t].w) + n_t * d3 * d3;
    }
}

// The normalisation slope a (see above) from z's batch statistics.
__device__ __forceinline__ float bn_train_slope(double m2, double count, float scale, float bn_weight, float eps) {
  const double s = scale;
  return static_cast<float>(s * bn_weight / sqrt(s * s * (m2 / count) + static_cast<double>(eps)));
}

// The training backward's saved statistics of feature j, when stats is given:
// stats (2, N) = [mean_z | biased var_z], each rounded once to float32.
__device__ __forceinline__ void write_batch_stats(float* stats, int N, int j, double mean, double m2, double count) {
  if (stats == nullptr) return;
  stats[j] = static_cast<float>(mean);
  stats[N + j] = static_cast<float>(m2 / count);
}

// Updates one feature's running statistics in place (scale = 1 for a
// BatchNorm that sees z + bias directly).
__device__ __forceinline__ void bn_update_running(double mean, double m2, double count, float bias, float scale,
                                                  float momentum, const int64_t* num_batches_tracked,
                                                  float* running_mean, float* running_var) {
  const double s = scale;
  const double f =
      momentum >= 0.f ? static_cast<double>(momentum) : 1.0 / static_cast<double>(*num_batches_tracked);
  *running_mean = static_cast<float>((1.0 - f) * *running_mean + f * s * (mean + static_cast<double>(bias)));
  *running_var = static_cast<float>((1.0 - f) * *running_var + f * s * s * (m2 / (count - 1.0)));
}

// The per-feature parameters and running statistics a GEMM epilogue reads
// (float32 vectors of N; eps as nn.BatchNorm1d's): the eval launchers copy
// them from the call's BatchNormArgs (launchers.cuh) into the kernel's arguments.
struct BnParams {
  const float* bias;  // Linear bias
  const float* scale;
  const float* bn_weight;
  const float* bn_bias;
  const float* running_mean;
  const float* running_var;
  float eps;
  bool scale_after_bn;  // false: Linear -> scale -> BatchNorm; true: Linear -> BatchNorm -> scale
  int scale_stride;     // 1: N scales; 0: one number for every feature
};

// Eval-mode fold of Linear bias, scale and BatchNorm into out = a * z + c for
// feature j (z = x @ W^T), with g = bn_weight / sqrt(running_var + eps):
//   scale before BatchNorm:  a = scale * g,  c = bn_bias + (scale * bias - running_mean) * g
//   scale after BatchNorm:   a = scale * g,  c = scale * (bn_bias + (bias - running_mean) * g)
// float32, as PyTorch's eval BatchNorm.
__device__ __forceinline__ void bn_eval_affine(const BnParams& p, int j, float& a, float& c) {
  const float gw = p.bn_weight[j] * (1.0f / sqrtf(p.running_var[j] + p.eps));
  const float s = p.scale[static_cast<size_t>(j) * p.scale_stride];
  a = s * gw;
  c = p.scale_after_bn ? s * fmaf(p.bias[j] - p.running_mean[j], gw, p.bn_bias[j])
                       : fmaf(fmaf(s, p.bias[j], -p.running_mean[j]), gw, p.bn_bias[j]);
}

// The backward's per-feature sum over the row groups of a CTA (bn_backward.cu,
// lowp/bn_16bit_backward.cu: warp w of the CTA takes rows w, w + kWarps, ...,
// lane l feature l): each thread's float64 partial v goes to red[warp][lane];
// after the barrier the threads with `active` (warp 0 of a feature in range)
// add the kWarps partials of their feature in warp order, the same order at
// every launch, and call use(total).  Every thread of the CTA calls it (a __syncthreads).
template <int kWarps, int kCols, typename Use>
__device__ __forceinline__ void row_groups_total(double v, double (&red)[kWarps][kCols], int warp, int lane,
                                                 bool active, Use&& use) {
  red[warp][lane] = v;
  __syncthreads();
  if (active) {
    double total = 0.0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += red[w][lane];
    use(total);
  }
}

}  // namespace fused_gemm_bn
