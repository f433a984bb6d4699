// block_reduce.cuh -- the row softmax's CTA-wide max and sum, shared by the
// float32 softmax (bn_softmax.cu), the 16-bit one (lowp/bn_16bit.cu) and the
// small-batch route's float64 one (small_m_fp64.cu), and the one-scale gradient
// sum (scale_terms.cuh).  The
// block size is read at run time (blockDim.x, a multiple of 32); centring.cuh's
// row_block_reduce is the fixed-size form (kRowThreads, unrolled over its warps),
// kept apart so that neither kernel's code changes.
//
// Result: every thread gets the reduction over all threads, a tree in T (float
// or double: a butterfly within each warp, then a butterfly over the warps'
// values, each warp reducing them all), the same order on every call and the same
// bits in every thread (each pairing is a commutative a op b).  fmaxf / fmax ignore
// NaN; a NaN in a sum propagates.  The second butterfly replaced a loop over the
// warps' values in warp order (31 dependent shared-memory loads and adds at 1024
// threads: the 16-bit row softmax's walk kernel spent ~40% of each row there,
// docs/perf.md v46).

#pragma once

#include <cuda_runtime.h>
#include <math.h>

namespace fused_gemm_bn {

__device__ __forceinline__ float reduce_max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double reduce_max(double a, double b) { return fmax(a, b); }

template <bool kMax, class T>
__device__ __forceinline__ T warp_butterfly(T v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const T other = __shfl_xor_sync(0xffffffffu, v, offset);
    v = kMax ? reduce_max(v, other) : v + other;
  }
  return v;
}

// Max (kMax) or sum over the CTA, returned to every thread.  `red` (shared)
// holds one value per warp: blockDim.x / 32 values of T.  One barrier: `red` is
// this reduction's own, not written by another reduction of the pass (a row's
// max and sum each get a buffer), and a buffer is reused only after a barrier
// that every thread reaches after reading it (the walking softmax's next row
// writes its max buffer after this row's sum reduction).  Until v81 one buffer
// served both, behind a second, leading barrier (docs/perf.md v81).
template <bool kMax, class T>
__device__ __forceinline__ T block_reduce(T v, T* red) {
  v = warp_butterfly<kMax>(v);
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (lane == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  // The identity past the last warp: -inf for max, +0 for a sum (x + 0 == x).
  const T identity = kMax ? static_cast<T>(-INFINITY) : static_cast<T>(0);
  return warp_butterfly<kMax>(lane < static_cast<int>(blockDim.x / 32) ? red[lane] : identity);
}

}  // namespace fused_gemm_bn
