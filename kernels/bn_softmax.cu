// bn_softmax.cu -- after the GEMM, the rest of Linear -> BatchNorm1d -> scale ->
// Softmax(dim=1) (KernelBench level 2, problem 84).
//
// bn_softmax_fold_train (training; one thread per feature j)
//   Inputs: part_mean, part_m2 (num_m_tiles, N) from a GEMM's kTrain epilogue
//   over z = x @ W^T (no bias); bias, scale, bn_weight, bn_bias (N);
//   num_batches_tracked (int64, already incremented).
//   BatchNorm sees y = z + bias: mean_y = mean_z + bias, var_y = var_z, so
//     v[m, j] = scale_j * (bn_weight_j (y - mean_y) / sqrt(var_y + eps) + bn_bias_j)
//             = (z[m, j] - mean_z[j]) * a_j + c_j,
//     a_j = scale_j bn_weight_j / sqrt(var_z + eps)  (var biased),  c_j = scale_j bn_bias_j.
//   Writes coeff = [mean_z | a | c] (3 N floats) and updates running_mean /
//   running_var as nn.BatchNorm1d (unbiased variance; momentum < 0 means
//   momentum=None, the cumulative average).
//   Numerics: statistics merged in float64 (merge_tile_statistics,
//   bn_stats.cuh); mean_z, a, c rounded to float32 once each.  Subtracting
//   mean_z before scaling keeps v accurate when |mean_z| >> std(z).
//
// softmax_rows (training and eval; one CTA per row m, from in (M, N) to out (M, N),
// which may be the same tensor)
//   out[m, :] = softmax(v[m, :]),  v = (in - mean_z) * a + c with coeff, or
//   v = in without (eval: the GEMM epilogue already wrote v).
//   softmax(v)_j = exp(v_j - max v) / sum_i exp(v_i - max v): the row maximum
//   is subtracted (no overflow), expf is IEEE float32 (no fast-math), the
//   division rounds as IEEE's from one reciprocal a row (RowDivisor,
//   row_divisor.cuh), the row sum is a float32 tree reduction; error about
//   1e-7 relative per element, as PyTorch's own softmax.
//   Memory: one read and one write of the row.  Rows of N <= 8192 (N % 4 == 0,
//   16-byte aligned) stay in registers, 16 floats per thread, all loads issued
//   at once (softmax_rows_regs_kernel); otherwise the CTA keeps v (then its
//   exponentials) in shared memory, N * 4 bytes (32 KB for N = 8192); rows
//   longer than the device's shared memory allows take the online variant
//   (running max and rescaled sum, Milakov & Gimelshein 2018, "Online
//   normalizer calculation for softmax"), which reads the row twice.
//   NaN anywhere in a row makes the whole row NaN (through the sum), as
//   PyTorch.
//
// Layout: row-major, contiguous float32.  16-byte accesses when N % 4 == 0
// and out and coeff are 16-byte aligned, else 4-byte.  Any M >= 1, N >= 1.

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "block_reduce.cuh"
#include "bn_stats.cuh"
#include "load_hints.cuh"
#include "launchers.cuh"
#include "pdl.cuh"
#include "row_divisor.cuh"

namespace fused_gemm_bn {
namespace softmax {

constexpr int kFoldThreads = 256;
constexpr int kRowThreads = 512;  // N = 8192: four float4 per thread
constexpr int kStaticSmemBytes = 1024;  // reserve for the block reductions' static arrays
constexpr int kRegGroups = 4;           // float4 groups per thread held in registers (softmax_rows_regs_kernel)
// softmax_rows_regs_kernel's minimum CTAs per SM: 3 (<= 40 registers, three
// 512-thread CTAs per SM) on sm_90, where ptxas fits both forms in 40 without
// spills; sm_80's ptxas spills the affine form at 40, so 2 there (<= 64).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr int kRegMinBlocks = 2;
#else
constexpr int kRegMinBlocks = 3;
#endif

struct FoldArgs {
  const float* part_mean;
  const float* part_m2;
  int num_m_tiles, block_m, M, N;
  BatchNormArgs bn;  // bias, scale, bn_weight, bn_bias, running statistics, momentum, eps
  float* coeff;  // [mean_z | a | c], 3 N
  float* stats;  // (2, N) [mean_z | biased var_z] for the backward, or null
};

__global__ void __launch_bounds__(kFoldThreads) bn_softmax_fold_train_kernel(const FoldArgs p) {
  pdl_wait_then_release();
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= p.N) return;
  double mean, m2;
  merge_tile_statistics(p.part_mean, p.part_m2, p.num_m_tiles, p.block_m, p.M, p.N, j, mean, m2);
  const double count = static_cast<double>(p.M);
  const double s = p.bn.scale[static_cast<size_t>(j) * p.bn.scale_stride];
  p.coeff[j] = static_cast<float>(mean);
  p.coeff[p.N + j] = static_cast<float>(s * p.bn.bn_weight[j] / sqrt(m2 / count + static_cast<double>(p.bn.eps)));
  p.coeff[2 * p.N + j] = static_cast<float>(s * p.bn.bn_bias[j]);
  // BatchNorm normalises z + bias itself: the scale does not enter the running statistics.
  bn_update_running(mean, m2, count, p.bn.bias[j], 1.0f, p.bn.momentum, p.bn.num_batches_tracked,
                    p.bn.running_mean + j, p.bn.running_var + j);
  write_batch_stats(p.stats, p.N, j, mean, m2, count);
}

template <int kVec>
struct Vec;
template <>
struct Vec<4> {
  using type = float4;
};
template <>
struct Vec<1> {
  using type = float;
};

__device__ __forceinline__ float& elem(float4& v, int e) { return (&v.x)[e]; }
__device__ __forceinline__ float& elem(float& v, int) { return v; }

struct RowArgs {
  const float* in;     // v's source rows (may be out: in place)
  float* out;
  const float* coeff;  // [mean_z | a | c] or nullptr
  int N;
};

// v for the kVec elements of group i of the row.
template <int kVec, bool kAffine>
__device__ __forceinline__ typename Vec<kVec>::type load_v(const RowArgs& p, const float* row, int i) {
  using V = typename Vec<kVec>::type;
  V v = reinterpret_cast<const V*>(row)[i];
  if constexpr (kAffine) {
    V mean = reinterpret_cast<const V*>(p.coeff)[i];
    V a = reinterpret_cast<const V*>(p.coeff + p.N)[i];
    V c = reinterpret_cast<const V*>(p.coeff + 2 * p.N)[i];
#pragma unroll
    for (int e = 0; e < kVec; ++e) elem(v, e) = fmaf(elem(v, e) - elem(mean, e), elem(a, e), elem(c, e));
  }
  return v;
}

// kCached: v kept in dynamic shared memory (one global read); else online
// max / sum and a second read of the row.
template <int kVec, bool kAffine, bool kCached>
__global__ void __launch_bounds__(kRowThreads) softmax_rows_kernel(const RowArgs p) {
  pdl_wait_then_release();
  using V = typename Vec<kVec>::type;
  extern __shared__ float4 dynamic_smem[];
  V* cache = reinterpret_cast<V*>(dynamic_smem);
  __shared__ float red_max[kRowThreads / 32], red_sum[kRowThreads / 32];  // block_reduce's, one each
  const float* row = p.in + static_cast<size_t>(blockIdx.x) * p.N;
  float* out_row = p.out + static_cast<size_t>(blockIdx.x) * p.N;
  const int num_groups = p.N / kVec;

  float thread_max = -INFINITY, thread_sum = 0.f;
  for (int i = threadIdx.x; i < num_groups; i += blockDim.x) {
    V v = load_v<kVec, kAffine>(p, row, i);
    if constexpr (kCached) {
      cache[i] = v;
#pragma unroll
      for (int e = 0; e < kVec; ++e) thread_max = fmaxf(thread_max, elem(v, e));
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float x = elem(v, e);
        const float new_max = fmaxf(thread_max, x);
        thread_sum = thread_sum * expf(thread_max - new_max) + expf(x - new_max);
        thread_max = new_max;
      }
    }
  }
  const float row_max = block_reduce<true>(thread_max, red_max);

  if constexpr (kCached) {
    for (int i = threadIdx.x; i < num_groups; i += blockDim.x) {
      V v = cache[i];
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        elem(v, e) = expf(elem(v, e) - row_max);
        thread_sum += elem(v, e);
      }
      cache[i] = v;
    }
  } else {
    thread_sum = thread_max == -INFINITY ? 0.f : thread_sum * expf(thread_max - row_max);
  }
  const RowDivisor divide(block_reduce<false>(thread_sum, red_sum));

  for (int i = threadIdx.x; i < num_groups; i += blockDim.x) {
    V v;
    if constexpr (kCached) {
      v = cache[i];
    } else {
      v = load_v<kVec, kAffine>(p, row, i);
#pragma unroll
      for (int e = 0; e < kVec; ++e) elem(v, e) = expf(elem(v, e) - row_max);
    }
#pragma unroll
    for (int e = 0; e < kVec; ++e) elem(v, e) = divide(elem(v, e));
    reinterpret_cast<V*>(out_row)[i] = v;
  }
}

// The row held in registers: kRegGroups float4 groups per thread (thread t holds
// groups t, t + blockDim.x, ...), every load of the row issued before the first
// is used (the smem-cached kernel's loop issues one load per thread at a time,
// docs/perf.md v22), for 16-byte aligned rows of N <= 16 kRowThreads.  Each
// thread visits its elements in the cached kernel's order: bit-identical output.
// Occupancy (docs/perf.md v23): at 47 registers only two 512-thread CTAs fit
// an SM (two rows in flight); kRegMinBlocks = 3 holds both forms at 40.  The
// affine form loads the row with an evict-first hint (read once): with plain
// loads ptxas spilled 16 bytes at 40 registers (21.9 us at the KernelBench
// shape against 19.8-20.0 with the hint; 20.8-21.0 before).
template <bool kAffine>
__global__ void __launch_bounds__(kRowThreads, kRegMinBlocks) softmax_rows_regs_kernel(const RowArgs p) {
  pdl_wait_then_release();
  __shared__ float red_max[kRowThreads / 32], red_sum[kRowThreads / 32];  // block_reduce's, one each
  const float* row = p.in + static_cast<size_t>(blockIdx.x) * p.N;
  float* out_row = p.out + static_cast<size_t>(blockIdx.x) * p.N;
  const int num_groups = p.N / 4;
  float4 v[kRegGroups];
#pragma unroll
  for (int g = 0; g < kRegGroups; ++g) {
    const int i = threadIdx.x + g * blockDim.x;
    if (i < num_groups) v[g] = kAffine ? ld_evict_first_f4(row + 4 * i) : reinterpret_cast<const float4*>(row)[i];
  }
  float thread_max = -INFINITY, thread_sum = 0.f;
#pragma unroll
  for (int g = 0; g < kRegGroups; ++g) {
    const int i = threadIdx.x + g * blockDim.x;
    if (i < num_groups) {
      if constexpr (kAffine) {
        float4 mean = reinterpret_cast<const float4*>(p.coeff)[i];
        float4 a = reinterpret_cast<const float4*>(p.coeff + p.N)[i];
        float4 c = reinterpret_cast<const float4*>(p.coeff + 2 * p.N)[i];
#pragma unroll
        for (int e = 0; e < 4; ++e) elem(v[g], e) = fmaf(elem(v[g], e) - elem(mean, e), elem(a, e), elem(c, e));
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) thread_max = fmaxf(thread_max, elem(v[g], e));
    }
  }
  const float row_max = block_reduce<true>(thread_max, red_max);
#pragma unroll
  for (int g = 0; g < kRegGroups; ++g) {
    const int i = threadIdx.x + g * blockDim.x;
    if (i < num_groups) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        elem(v[g], e) = expf(elem(v[g], e) - row_max);
        thread_sum += elem(v[g], e);
      }
    }
  }
  const RowDivisor divide(block_reduce<false>(thread_sum, red_sum));
#pragma unroll
  for (int g = 0; g < kRegGroups; ++g) {
    const int i = threadIdx.x + g * blockDim.x;
    if (i < num_groups) {
#pragma unroll
      for (int e = 0; e < 4; ++e) elem(v[g], e) = divide(elem(v[g], e));
      reinterpret_cast<float4*>(out_row)[i] = v[g];
    }
  }
}

template <int kVec, bool kAffine>
cudaError_t launch_softmax_rows(const RowArgs& p, int M, cudaStream_t stream) {
  const int num_groups = p.N / kVec;
  // Four groups per thread (N = 8192: 512 threads; N = 4096: 256, so eight
  // rows per SM are in flight, not four: 186 -> see docs/perf.md v21 at
  // M = 16384), at least one warp, at most kRowThreads.
  const int threads = min(kRowThreads, max(32, (num_groups / 4 + 31) / 32 * 32));
  if constexpr (kVec == 4) {
    if (num_groups <= threads * kRegGroups)
      return launch_kernel(softmax_rows_regs_kernel<kAffine>, M, threads, 0, stream, p);
  }
  int device = 0, max_optin = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  err = cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return err;
  const size_t cache_bytes = static_cast<size_t>(p.N) * sizeof(float);
  if (cache_bytes + kStaticSmemBytes <= static_cast<size_t>(max_optin)) {
    auto kernel = softmax_rows_kernel<kVec, kAffine, true>;
    if (cache_bytes > 48 * 1024) {
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(cache_bytes));
      if (err != cudaSuccess) return err;
    }
    return launch_kernel(kernel, M, threads, cache_bytes, stream, p);
  }
  return launch_kernel(softmax_rows_kernel<kVec, kAffine, false>, M, threads, 0, stream, p);
}

}  // namespace softmax
}  // namespace fused_gemm_bn

// Training: per-feature coefficients for softmax_rows and the running-statistics
// update, from the GEMM's per-tile statistics.  coeff: 3 N floats.
cudaError_t fused_gemm_bn::bn_softmax_fold_train(const float* part_mean, const float* part_m2, int num_m_tiles,
                                                 int block_m, int M, int N, const BatchNormArgs& bn, float* coeff,
                                                 float* stats, cudaStream_t stream) {
  using namespace fused_gemm_bn::softmax;
  if (M == 0 || N == 0) return cudaSuccess;
  const FoldArgs p{part_mean, part_m2, num_m_tiles, block_m, M, N, bn, coeff, stats};
  return launch_kernel(bn_softmax_fold_train_kernel, (N + kFoldThreads - 1) / kFoldThreads, kFoldThreads, 0, stream, p);
}

// out (M, N) <- softmax over each row of (in - mean_z) * a + c (coeff = [mean_z | a | c])
// or of in itself (coeff == nullptr); in may be out (in place).
cudaError_t fused_gemm_bn::softmax_rows(const float* in, float* out, const float* coeff, int M, int N,
                                        cudaStream_t stream) {
  using namespace fused_gemm_bn::softmax;
  if (M == 0 || N == 0) return cudaSuccess;
  const RowArgs p{in, out, coeff, N};
  const bool vec4 = N % 4 == 0 && (reinterpret_cast<uintptr_t>(in) | reinterpret_cast<uintptr_t>(out) |
                                   reinterpret_cast<uintptr_t>(coeff)) % 16 == 0;
  if (coeff != nullptr) {
    return vec4 ? launch_softmax_rows<4, true>(p, M, stream) : launch_softmax_rows<1, true>(p, M, stream);
  }
  return vec4 ? launch_softmax_rows<4, false>(p, M, stream) : launch_softmax_rows<1, false>(p, M, stream);
}
