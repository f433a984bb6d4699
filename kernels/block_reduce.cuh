// block_reduce.cuh -- the row softmax's CTA-wide max and sum, shared by the
// float32 softmax (bn_softmax.cu), the 16-bit one (lowp/bn_16bit.cu) and the
// small-batch route's float64 one (small_m_fp64.cu).  The
// block size is read at run time (blockDim.x, a multiple of 32); centring.cuh's
// row_block_reduce is the fixed-size form (kRowThreads, unrolled over its warps),
// kept apart so that neither kernel's code changes.
//
// Result: every thread gets the reduction over all threads, a tree in T (float
// or double: a butterfly within each warp, then the warps' values in warp order),
// the same order on every call.  fmaxf / fmax ignore NaN; a NaN in a sum propagates.

#pragma once

#include <cuda_runtime.h>

namespace fused_gemm_bn {

__device__ __forceinline__ float reduce_max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double reduce_max(double a, double b) { return fmax(a, b); }

// Max (kMax) or sum over the CTA, returned to every thread.  `red` (shared)
// holds one value per warp: blockDim.x / 32 values of T.
template <bool kMax, class T>
__device__ __forceinline__ T block_reduce(T v, T* red) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const T other = __shfl_xor_sync(0xffffffffu, v, offset);
    v = kMax ? reduce_max(v, other) : v + other;
  }
  __syncthreads();  // red is reused by consecutive reductions
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  v = red[0];
  for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) v = kMax ? reduce_max(v, red[w]) : v + red[w];
  return v;
}

}  // namespace fused_gemm_bn
