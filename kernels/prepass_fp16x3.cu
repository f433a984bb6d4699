// prepass_fp16x3.cu -- the pre-pass before each fp16x3 GEMM (sm90_gemm_fp16x3_bn.cu):
// x's fp16 parts and per-row power-of-two scales, and the call's bookkeeping.
// The same kernel splits gemm.weight's rows (N, K) for the GEMM's other operand
// (no bookkeeping: null counters); model_new.py keeps those parts while the
// weight is unchanged.
//
//   x            (M, K) fp32, any strides (read, never written)
//   x_hi, x_lo   (M, K) fp16 words, row-major (K % 8 == 0, 16-byte aligned)
//   x_inv_scale  (M) fp32
// Row m: e_m from amax_m = max_k |x[m, k]| (fp16x3_split.cuh: s = 2^e_m puts
// amax_m s in [2^14, 2^15)); x_hi = rn_fp16(x s), x_lo = rn_fp16(x s - x_hi),
// x_inv_scale[m] = 2^-e_m.  Both scalings are exact.
// Bookkeeping in the same launch: num_batches_tracked += 1 when not null (a
// training call) and zero_ints[0 .. num_zero_ints) = 0 (the GEMM's split-tile
// arrival counts).
//
// One 256-thread block per row: a pass for amax (block reduction), then a
// second read of the row (L1 / L2 hits: 32 KB at K = 8192) for the split.
// Memory traffic per call: 4 M K bytes read, 4 M K written.

#include <cuda_runtime.h>
#include <stdint.h>

#include "fp16x3_split.cuh"
#include "launchers.cuh"

namespace fused_gemm_bn {
namespace {

constexpr int kPrepassThreads = 256;

// kVec: rows contiguous and 16-byte aligned (float4 loads).
template <bool kVec>
__global__ void __launch_bounds__(kPrepassThreads)
    sm90_prepass_fp16x3_kernel(const float* __restrict__ x, int64_t row_stride, int64_t col_stride, int K,
                               uint32_t* __restrict__ x_hi, uint32_t* __restrict__ x_lo,
                               float* __restrict__ x_inv_scale, int64_t* num_batches_tracked, int* zero_ints,
                               int num_zero_ints) {
  __shared__ float warp_max[kPrepassThreads / 32];
  if (blockIdx.x == 0) {
    if (num_batches_tracked != nullptr && threadIdx.x == 0) *num_batches_tracked += 1;
    for (int j = threadIdx.x; j < num_zero_ints; j += blockDim.x) zero_ints[j] = 0;
  }
  const int64_t m = blockIdx.x;
  const float* row = x + m * row_stride;
  float amax = 0.f;
  if constexpr (kVec) {
    const float4* row4 = reinterpret_cast<const float4*>(row);
    for (int i = threadIdx.x; i < K / 4; i += kPrepassThreads) {
      const float4 v = row4[i];
      amax = fmaxf(amax, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    }
  } else {
    for (int k = threadIdx.x; k < K; k += kPrepassThreads) amax = fmaxf(amax, fabsf(row[k * col_stride]));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = warp_max[0];
#pragma unroll
  for (int w = 1; w < kPrepassThreads / 32; ++w) amax = fmaxf(amax, warp_max[w]);
  float s, inv_s;
  fp16x3_scale(amax, s, inv_s);
  if (threadIdx.x == 0) x_inv_scale[m] = inv_s;

  uint32_t* hi_row = x_hi + m * (K / 2);
  uint32_t* lo_row = x_lo + m * (K / 2);
  if constexpr (kVec) {
    const float4* row4 = reinterpret_cast<const float4*>(row);
    for (int i = threadIdx.x; i < K / 4; i += kPrepassThreads) {
      const float4 v = row4[i];
      uint2 hi, lo;
      split_fp16x2(v.x * s, v.y * s, hi.x, lo.x);
      split_fp16x2(v.z * s, v.w * s, hi.y, lo.y);
      reinterpret_cast<uint2*>(hi_row)[i] = hi;
      reinterpret_cast<uint2*>(lo_row)[i] = lo;
    }
  } else {
    for (int p = threadIdx.x; p < K / 2; p += kPrepassThreads) {
      const float v0 = row[(2 * p) * col_stride], v1 = row[(2 * p + 1) * col_stride];
      split_fp16x2(v0 * s, v1 * s, hi_row[p], lo_row[p]);
    }
  }
}

}  // namespace
}  // namespace fused_gemm_bn

// ---------------------------------------------------------------------------
// Host launcher (declared in launchers.cuh)
// ---------------------------------------------------------------------------

// Preconditions: M >= 1, K % 8 == 0, x_hi and x_lo 16-byte aligned.
cudaError_t fused_gemm_bn::sm90_prepass_fp16x3(const float* x, int64_t row_stride, int64_t col_stride, int M, int K,
                                               uint16_t* x_hi, uint16_t* x_lo, float* x_inv_scale, int* zero_ints,
                                               int num_zero_ints, int64_t* num_batches_tracked, cudaStream_t stream) {
  if (M < 1 || K % 8 != 0 || reinterpret_cast<uintptr_t>(x_hi) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(x_lo) % 16 != 0)
    return cudaErrorInvalidValue;
  const bool vec = col_stride == 1 && row_stride % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  auto hi = reinterpret_cast<uint32_t*>(x_hi);
  auto lo = reinterpret_cast<uint32_t*>(x_lo);
  if (vec) {
    sm90_prepass_fp16x3_kernel<true><<<M, kPrepassThreads, 0, stream>>>(
        x, row_stride, col_stride, K, hi, lo, x_inv_scale, num_batches_tracked, zero_ints, num_zero_ints);
  } else {
    sm90_prepass_fp16x3_kernel<false><<<M, kPrepassThreads, 0, stream>>>(
        x, row_stride, col_stride, K, hi, lo, x_inv_scale, num_batches_tracked, zero_ints, num_zero_ints);
  }
  return cudaGetLastError();
}
