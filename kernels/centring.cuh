// centring.cuh -- the per-row terms of the centred split, shared by the GEMMs'
// pre-passes (prepass_fp16x3.cu, centring.cu): one 256-thread block reads one
// row of x (the GEMM's x side) or of w (its w side) once and reduces it.
//
//   x side: c_m = rn(sum_k x[m, k]) / K in fp32 (any float is exact for what
//           follows; the mean removes what every row has in common), 0 when
//           max |x[m, :]| >= 2^32 or the sum is not finite (those rows keep the
//           uncentred split; an Inf then makes the row NaN as before).
//   w side: sum_k w[n, k] in float64, stored as the fp32 pair hi = rn(sum),
//           lo = rn(sum - hi).
// The GEMM splits rn(x[m, k] - c_m) (round to nearest: unbiased, error
// <= 2^-24 |x - c_m|) and its epilogue adds the centre's share back,
//   z[m, n] = fma(c_m, hi_n, fma(c_m, lo_n, sum_k (x[m, k] - c_m) w[n, k])),
// which is exact in real arithmetic.  Why: the tensor cores' accumulation
// truncates, so on rows that share a level (uniform [0, 1), 100 + uniform,
// exponential) every row of a feature lost the same signed amount and the
// batch mean -- BatchNorm's statistic -- kept it (docs/perf.md, v21 and v25).
// |c_m| < 2^32 keeps c_m hi_n finite for any w whose row sums stay below 2^95.

#pragma once

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

namespace fused_gemm_bn {

constexpr int kRowThreads = 256;
constexpr int kRowWarps = kRowThreads / 32;
constexpr float kMaxCentredAmax = 4294967296.f;  // 2^32

// The GEMM operand a row belongs to.
enum class RowSide { kX, kW };

// The block-wide sum (kOp = 0), max (1) or min (2) of one value per thread of a
// kRowThreads block (max / min for float only: fmaxf / fminf skip NaN).
template <int kOp, typename T>
__device__ __forceinline__ T row_block_reduce(T v, T* scratch) {
  auto op = [](T a, T b) {
    if constexpr (kOp == 0) return a + b;
    else if constexpr (kOp == 1) return fmaxf(a, b);
    else return fminf(a, b);
  };
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();  // scratch may still be read by an earlier reduction
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  v = scratch[0];
#pragma unroll
  for (int w = 1; w < kRowWarps; ++w) v = op(v, scratch[w]);
  return v;
}

// What one pass over a row leaves for the split: its max and min, and c (the
// x side's centre; 0 on the w side).
struct RowTerms {
  float vmax, vmin, c;
};

// One thread's share of a row's max, min and sum: take() its elements in the
// row order below, then finish_row_terms() reduces over the block.
template <RowSide kSide>
struct RowAccum {
  float vmax = -INFINITY, vmin = INFINITY, sum_f = 0.f;
  double sum_d = 0.0;
  __device__ __forceinline__ void take(float v) {
    vmax = fmaxf(vmax, v);
    vmin = fminf(vmin, v);
    if constexpr (kSide == RowSide::kX) sum_f += v;
    else sum_d += static_cast<double>(v);
  }
  __device__ __forceinline__ void take(const float4& v) { take(v.x), take(v.y), take(v.z), take(v.w); }
};

// The block-wide reductions of every thread's RowAccum for row m; thread 0
// writes center[m] (x side) or row_sum[m] (w side).  Every thread of the block
// must call it.
template <RowSide kSide>
__device__ __forceinline__ RowTerms finish_row_terms(RowAccum<kSide> a, int K, int64_t m, float* __restrict__ center,
                                                     float2* __restrict__ row_sum) {
  __shared__ float scratch_f[kRowWarps];
  __shared__ double scratch_d[kRowWarps];
  RowTerms r;
  r.vmax = row_block_reduce<1>(a.vmax, scratch_f);
  r.vmin = row_block_reduce<2>(a.vmin, scratch_f);
  r.c = 0.f;
  if constexpr (kSide == RowSide::kX) {
    const float amax = fmaxf(fmaxf(r.vmax, -r.vmin), 0.f);  // max |x|; 0 for an all-NaN row
    const float sum_f = row_block_reduce<0>(a.sum_f, scratch_f);
    if (amax < kMaxCentredAmax && isfinite(sum_f)) r.c = sum_f * (1.f / static_cast<float>(K));
    if (threadIdx.x == 0) center[m] = r.c;
  } else {
    const double sum_d = row_block_reduce<0>(a.sum_d, scratch_d);
    if (threadIdx.x == 0) {
      const float hi = static_cast<float>(sum_d);
      row_sum[m] = make_float2(hi, static_cast<float>(sum_d - static_cast<double>(hi)));
    }
  }
  return r;
}

// Reads row m (kVec: contiguous, 16-byte aligned and K % 4 == 0, float4 loads;
// else element stride col_stride) once.  Thread 0 writes center[m] (x side) or
// row_sum[m] (w side).  Every thread of the block must call it.  Both forms add
// the elements in one order (thread t: elements 4i .. 4i + 3 for i = t, t +
// kRowThreads, ...; then the K % 4 tail), so a strided, transposed or
// misaligned copy of a row gets the same sum, centre and parts, bit for bit
// (as does prepass_fp16x3.cu's register form, which takes them in this order).
template <bool kVec, RowSide kSide>
__device__ __forceinline__ RowTerms row_terms(const float* __restrict__ row, int64_t col_stride, int K, int64_t m,
                                              float* __restrict__ center, float2* __restrict__ row_sum) {
  RowAccum<kSide> a;
  if constexpr (kVec) {
    const float4* row4 = reinterpret_cast<const float4*>(row);
    for (int i = threadIdx.x; i < K / 4; i += kRowThreads) a.take(row4[i]);
  } else {
    for (int i = threadIdx.x; i < K / 4; i += kRowThreads) {
      const float* v = row + 4 * static_cast<int64_t>(i) * col_stride;
      a.take(v[0]), a.take(v[col_stride]), a.take(v[2 * col_stride]), a.take(v[3 * col_stride]);
    }
    for (int k = K / 4 * 4 + threadIdx.x; k < K; k += kRowThreads) a.take(row[k * col_stride]);
  }
  return finish_row_terms(a, K, m, center, row_sum);
}

}  // namespace fused_gemm_bn
