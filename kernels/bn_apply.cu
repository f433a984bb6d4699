// bn_apply.cu -- training-mode BatchNorm from the GEMM's per-tile statistics:
// merge them per feature, update the running statistics, and normalise z
// (in place, or into a separate `out` when the caller keeps z for backward).
// One launch while num_m_tiles <= kFusedMaxTiles (it replaced a separate
// finalize kernel: -7 us at the KernelBench shape, docs/perf.md); above that,
// two: bn_fold_kernel merges each feature once into coeff, then the apply
// kernel only streams z (every block of the one-launch form merges its
// columns' tiles again, num_m_tiles x row blocks work that grows as M^2: at
// M = 16384, N = 4096 it took 1.04 ms for a pass that moves 537 MB).
//
// Inputs (float32, row-major, contiguous)
//   z                   (M, N): x @ W^T without bias, from a GEMM's kTrain epilogue
//   part_mean, part_m2  (num_m_tiles, N): mean and sum of squared deviations of
//                       z over the rows of each M tile (tile t holds
//                       min(block_m, M - t * block_m) rows)
//   bias, scale, bn_weight, bn_bias  (N)
//   num_batches_tracked  int64 scalar, already incremented for this call
// Outputs
//   out (M, N, may be z itself): out[m, n] = (z[m, n] - mean_z[n]) * a[n] + bn_bias[n]
//        a = scale * bn_weight / sqrt(scale^2 * var_z + eps)   (var_z biased)
//   running_mean, running_var (N): updated in place as nn.BatchNorm1d
//   (bn_stats.cuh has the algebra; the Linear bias only enters running_mean).
//
// Numerics: the tiles are combined in float64 (merge_tile_statistics in
// bn_stats.cuh: no E[z^2] - E[z]^2 cancellation); a and mean_z are rounded to
// float32 once.  Subtracting the mean before scaling
// keeps the output accurate when |mean_z| is large against the spread of z.
//
// Work split (both forms): each thread owns fixed columns (4 with 16-byte accesses when
// N % 4 == 0 and all pointers are 16-byte aligned, else 1; with 4, the one-launch form
// loads all tiles' statistics of its columns at once) and walks
// rows_per_block rows (64 in the one-launch form, 16 in the two-launch form, fewer for
// small M * N so the grid fills the GPU); every block merges the statistics of its own columns
// (num_m_tiles * 2 loads each, from L2), and the blocks of row 0 write the
// running statistics, once per feature.  Memory-bound: one read and one write
// of z.  Precondition: M >= 2 (the caller raises PyTorch's error for M == 1).

#include <cuda_runtime.h>
#include <stdint.h>

#include "bn_stats.cuh"
#include "launchers.cuh"
#include "pdl.cuh"

namespace fused_gemm_bn {

// bn_fold_eval (eval mode with gradients, model_new.py's _EvalFn): one thread per
// feature writes coeff = [0 | a | c] (3 N floats) from the running statistics,
// bn_eval_affine's fold (bn_stats.cuh: the GEMM epilogues' eval fold, float32), so
// that out = z a + c: problem 33 through bn_apply_folded (bn_bias = coeff + 2 N),
// problem 84 through softmax_rows.

// Block shape, from timings of variants on an H200 (docs/perf.md v21): 128
// threads (the one-launch vec4 kernel needs ~166 registers for the batched
// statistics loads: three blocks per SM), 64 rows per block in the one-launch
// form (16 row blocks at M = 1024 re-merge the statistics 16x), 16 in the
// two-launch form (nothing to re-merge; more blocks in flight).
constexpr int kApplyThreads = 128;
constexpr int kApplyRowsPerBlock = 64;
constexpr int kFoldedRowsPerBlock = 16;
constexpr int kApplyTargetBlocks = 264;  // two per SM of an H100 / H200
// Rows loaded before any is stored (bn_apply_kernel): 16 with 16-byte accesses
// (64 KB in flight per SM at two blocks; free in registers, which the
// statistics merge bounds: 164 in the one-launch form; -0.6 us at the
// KernelBench shape, -3 us at 16384 x 4096, docs/perf.md v23), 8 with 4-byte ones.
constexpr int kRowBatchVec4 = 16;
constexpr int kRowBatchScalar = 8;
constexpr int kFusedMaxTiles = 8;        // up to here each block merges its own columns (M <= 1024 at BLOCK_M 128)
constexpr int kApplyFoldThreads = 256;

struct BnApplyArgs {
  const float* z;
  float* out;
  const float* part_mean;
  const float* part_m2;
  int num_m_tiles, block_m, M, N;
  BatchNormArgs bn;  // bias, scale, bn_weight, bn_bias, running statistics, momentum, eps
  int rows_per_block;
  float* coeff;  // two-launch form: [mean_z | a], 2 N floats, written by bn_fold_kernel
  float* stats;  // (2, N) [mean_z | biased var_z] for the backward, or null
};

// Feature j's merged batch statistics (mean, m2) of z -> (mean_z, a); updates
// its running statistics and writes its saved statistics (p.stats) when
// `update_running` (one thread per feature).
__device__ __forceinline__ void coefficients_from_stats(const BnApplyArgs& p, int j, double mean, double m2,
                                                        bool update_running, float& mu, float& a) {
  const double count = static_cast<double>(p.M);
  mu = static_cast<float>(mean);
  const float s = p.bn.scale[static_cast<size_t>(j) * p.bn.scale_stride];
  a = bn_train_slope(m2, count, s, p.bn.bn_weight[j], p.bn.eps);
  if (update_running) {
    bn_update_running(mean, m2, count, p.bn.bias[j], s, p.bn.momentum, p.bn.num_batches_tracked,
                      p.bn.running_mean + j, p.bn.running_var + j);
    write_batch_stats(p.stats, p.N, j, mean, m2, count);
  }
}

// Batch statistics of feature j -> (mean_z, a), one tile load after another.
__device__ __forceinline__ void feature_coefficients(const BnApplyArgs& p, int j, bool update_running, float& mu,
                                                     float& a) {
  double mean, m2;
  merge_tile_statistics(p.part_mean, p.part_m2, p.num_m_tiles, p.block_m, p.M, p.N, j, mean, m2);
  coefficients_from_stats(p, j, mean, m2, update_running, mu, a);
}

// The same for features col .. col + 3 (the vec4 one-launch form): every
// tile's statistics of the four features in two L2 round trips instead of
// 2 num_m_tiles dependent loads per feature (merge_tile_statistics4,
// bit-identical), docs/perf.md v21.
__device__ __forceinline__ void feature_coefficients4(const BnApplyArgs& p, int col, bool update_running,
                                                      float (&mu)[4], float (&a)[4]) {
  double mean[4], m2[4];
  merge_tile_statistics4<kFusedMaxTiles>(p.part_mean, p.part_m2, p.num_m_tiles, p.block_m, p.M, p.N, col, mean, m2);
#pragma unroll
  for (int c = 0; c < 4; ++c) coefficients_from_stats(p, col + c, mean[c], m2[c], update_running, mu[c], a[c]);
}

// Two-launch form, first launch: one thread per feature merges its tiles once,
// writes (mean_z, a) to coeff and updates the running statistics.
__global__ void __launch_bounds__(kApplyFoldThreads) bn_fold_kernel(const BnApplyArgs p) {
  pdl_wait_then_release();
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= p.N) return;
  float mu, a;
  feature_coefficients(p, j, true, mu, a);
  p.coeff[j] = mu;
  p.coeff[p.N + j] = a;
}

// Eval mode: coeff = [0 | a | c] of feature j (bn_eval_affine), one thread per feature.
__global__ void __launch_bounds__(kApplyFoldThreads) bn_fold_eval_kernel(const BnParams bn, int N, float* coeff) {
  pdl_wait_then_release();
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= N) return;
  float a, c;
  bn_eval_affine(bn, j, a, c);
  coeff[j] = 0.f;
  coeff[N + j] = a;
  coeff[2 * N + j] = c;
}

// kFolded: (mean_z, a) from coeff (bn_fold_kernel ran first); else merged here,
// and the blocks of row 0 update the running statistics.  The same float32
// values either way, so both forms give bit-identical outputs.
template <bool kVec4, bool kFolded>
__global__ void __launch_bounds__(kApplyThreads) bn_apply_kernel(const BnApplyArgs p) {
  pdl_wait_then_release();
  constexpr int kCols = kVec4 ? 4 : 1;
  constexpr int kRowBatch = kVec4 ? kRowBatchVec4 : kRowBatchScalar;
  const int col = (blockIdx.x * blockDim.x + threadIdx.x) * kCols;
  if (col >= p.N) return;
  const bool update_running = blockIdx.y == 0;
  float mu[kCols], a[kCols], b[kCols];
  if constexpr (kVec4 && !kFolded) feature_coefficients4(p, col, update_running, mu, a);
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    if constexpr (kFolded) {
      mu[c] = p.coeff[col + c];
      a[c] = p.coeff[p.N + col + c];
    } else if constexpr (!kVec4) {
      feature_coefficients(p, col + c, update_running, mu[c], a[c]);
    }
    b[c] = p.bn.bn_bias[col + c];
  }
  const int row0 = blockIdx.y * p.rows_per_block;
  const int row_end = min(p.M, row0 + p.rows_per_block);
  // kRowBatch rows are loaded before any is stored: the compiler may not move
  // a load above the previous row's store (z is read and written in place), so
  // a row-at-a-time loop keeps one load in flight per thread and runs at
  // memory latency, not bandwidth (docs/perf.md, v14).
  for (int row = row0; row < row_end; row += kRowBatch) {
    float v[kRowBatch][kCols];
#pragma unroll
    for (int r = 0; r < kRowBatch; ++r) {
      if (row + r >= row_end) break;
      const float* q = p.z + static_cast<size_t>(row + r) * p.N + col;
      if constexpr (kVec4) {
        const float4 t = *reinterpret_cast<const float4*>(q);
        v[r][0] = t.x, v[r][1] = t.y, v[r][2] = t.z, v[r][3] = t.w;
      } else {
        v[r][0] = *q;
      }
    }
#pragma unroll
    for (int r = 0; r < kRowBatch; ++r) {
      if (row + r >= row_end) break;
      float* q = p.out + static_cast<size_t>(row + r) * p.N + col;
#pragma unroll
      for (int c = 0; c < kCols; ++c) v[r][c] = fmaf(v[r][c] - mu[c], a[c], b[c]);
      if constexpr (kVec4) {
        *reinterpret_cast<float4*>(q) = make_float4(v[r][0], v[r][1], v[r][2], v[r][3]);
      } else {
        *q = v[r][0];
      }
    }
  }
}

// The apply kernel's grid for (M, N): blocks of kApplyThreads threads over the
// columns, each walking rows_per_block rows: up to max_rows, fewer where that
// would leave fewer than kApplyTargetBlocks blocks (small M * N: 8 blocks of 32
// rows took 12.5 us at M = 256, N = 1024 on an H200, docs/perf.md); grid.y is
// capped at 65535, so very tall inputs give each block more rows.
dim3 apply_grid(int M, int N, bool vec4, int max_rows, int& rows_per_block) {
  const int cols_per_thread = vec4 ? 4 : 1;
  const int blocks_x = ((N + cols_per_thread - 1) / cols_per_thread + kApplyThreads - 1) / kApplyThreads;
  const int rows_for_target = static_cast<int>((static_cast<int64_t>(M) * blocks_x + kApplyTargetBlocks - 1) /
                                               kApplyTargetBlocks);
  rows_per_block = max(max(1, min(max_rows, rows_for_target)), (M + 65534) / 65535);
  return dim3(blocks_x, (M + rows_per_block - 1) / rows_per_block);
}

template <bool kFolded>
cudaError_t launch_apply(const BnApplyArgs& p, dim3 grid, bool vec4, cudaStream_t stream) {
  return launch_kernel(vec4 ? bn_apply_kernel<true, kFolded> : bn_apply_kernel<false, kFolded>, grid, kApplyThreads, 0,
                       stream, p);
}

}  // namespace fused_gemm_bn

cudaError_t fused_gemm_bn::bn_apply(const float* z, float* out, const float* part_mean, const float* part_m2,
                                    int num_m_tiles, int block_m, int M, int N, const BatchNormArgs& bn,
                                    float* coeff, float* stats, cudaStream_t stream) {
  if (M == 0 || N == 0) return cudaSuccess;
  const bool folded = num_m_tiles > kFusedMaxTiles;
  if (folded && coeff == nullptr) return cudaErrorInvalidValue;
  auto aligned = [](const float* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  const bool vec4 = N % 4 == 0 && aligned(z) && aligned(out) && aligned(part_mean) && aligned(part_m2);
  BnApplyArgs p{z, out, part_mean, part_m2, num_m_tiles, block_m, M, N, bn, 0, coeff, stats};
  const dim3 grid = apply_grid(M, N, vec4, folded ? kFoldedRowsPerBlock : kApplyRowsPerBlock, p.rows_per_block);
  if (!folded) return launch_apply<false>(p, grid, vec4, stream);
  const cudaError_t err =
      launch_kernel(bn_fold_kernel, (N + kApplyFoldThreads - 1) / kApplyFoldThreads, kApplyFoldThreads, 0, stream, p);
  return err != cudaSuccess ? err : launch_apply<true>(p, grid, vec4, stream);
}

// out = (z - coeff[0]) * coeff[1] + bn_bias with given per-feature coeff = [mean_z | a]
// (2 N floats; synchronized BatchNorm computes them from the merged batch): the
// two-launch form's streaming kernel alone.  out must not overlap z unless it is z.
cudaError_t fused_gemm_bn::bn_apply_folded(const float* z, float* out, const float* coeff, const float* bn_bias,
                                           int M, int N, cudaStream_t stream) {
  if (M == 0 || N == 0) return cudaSuccess;
  auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  const bool vec4 = N % 4 == 0 && aligned(z) && aligned(out) && aligned(coeff) && aligned(bn_bias);
  BnApplyArgs p{};
  p.z = z, p.out = out, p.M = M, p.N = N, p.bn.bn_bias = bn_bias;
  p.coeff = const_cast<float*>(coeff);  // read only by the kFolded apply kernel
  return launch_apply<true>(p, apply_grid(M, N, vec4, kFoldedRowsPerBlock, p.rows_per_block), vec4, stream);
}

// coeff (3 N floats) = [0 | a | c]: the eval fold of the running statistics (bn: bias, scale,
// bn_weight, bn_bias, running_mean, running_var, eps, scale_after_bn, scale_stride).
cudaError_t fused_gemm_bn::bn_fold_eval(const BatchNormArgs& bn, int N, float* coeff, cudaStream_t stream) {
  if (N == 0) return cudaSuccess;
  const BnParams params{bn.bias,         bn.scale,       bn.bn_weight, bn.bn_bias,
                        bn.running_mean, bn.running_var, bn.eps,       bn.scale_after_bn, bn.scale_stride};
  return launch_kernel(bn_fold_eval_kernel, (N + kApplyFoldThreads - 1) / kApplyFoldThreads, kApplyFoldThreads, 0,
                       stream, params, N, coeff);
}
