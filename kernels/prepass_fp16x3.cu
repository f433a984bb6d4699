// prepass_fp16x3.cu -- the pre-pass before each fp16x3 GEMM (sm90_gemm_fp16x3_bn.cu):
// x's fp16 parts and per-row power-of-two scales, and the call's bookkeeping.
// The same kernel splits gemm.weight's rows (N, K) for the GEMM's other operand
// (no bookkeeping: null counters); model_new.py keeps those parts while the
// weight is unchanged.
//
//   x            (M, K) fp32, any K >= 1, any strides and alignment (read, never
//                written; float4 loads where rows are contiguous, 16-byte aligned
//                and K % 4 == 0, else one element at a time)
//   x_hi, x_lo   (M, K_pad) fp16 words, row-major, K_pad = fp16x3_padded_k(K) =
//                round_up(K, 8) (launchers.cuh): TMA needs 16-byte row strides;
//                columns K .. K_pad - 1 are written as zeros, which add nothing
//                to the GEMM's products (it runs over K_pad), 16-byte aligned
//   x_inv_scale  (M) fp32
//   center       (M) fp32, the x side only: c_m
//   row_sum      (M) fp32 pairs, the w side only: sum_k x[m, k] in float64,
//                stored as hi = rn_fp32(sum), lo = rn_fp32(sum - hi)
// Row m, x side: c_m and the centred v = rn(x - c_m) (centring.cuh: the rule,
// and why: the tensor core's truncating accumulation otherwise biases the
// batch mean); w side: v = x and the row's float64 sum.  The row's max, min,
// sum and c_m are over its K real elements only.  e_m from max_k |v|
// (fp16x3_split.cuh: s = 2^e_m puts it in [2^14, 2^15)); x_hi = rn_fp16(v s),
// x_lo = rn_fp16(v s - x_hi), x_inv_scale[m] = 2^-e_m.  Both scalings are exact.
// The GEMM adds c_m sum_k w[n, k] back (sm90_gemm_fp16x3_bn.cu).  Measured: z's
// per-feature mean over 1024 rows of uniform [0, 1) x was 7.7e-8 from float64
// uncentred (eager SGEMM 5.8e-8), 7.5e-9 centred (H200, 1024 x 8192 x 8192,
// docs/perf.md v21).
// Bookkeeping in the same launch: num_batches_tracked += 1 when not null (a
// training call) and zero_ints[0 .. num_zero_ints) = 0 (the GEMM's split-tile
// arrival counts).
//
// One 256-thread block per row: a pass for max, min and sum (block reductions),
// then the split.  Rows of contiguous, 16-byte aligned float4 groups that fit
// kPrepassRegGroups per thread (K <= 8192) are held in registers, every load issued
// before the first use (one read; the loop form's dependent float64 sum of the
// w side kept one load per thread in flight: the weight's split took 260 us at
// 8192 x 8192 on an H100, docs/perf.md v38); other rows are read a second time
// for the split (L1 / L2 hits: 32 KB at K = 8192).  Both forms give the same
// bits.  Memory traffic per call: 4 M K bytes read, 4 M K written.

#include <cuda_runtime.h>
#include <stdint.h>

#include "centring.cuh"
#include "fp16x3_split.cuh"
#include "launchers.cuh"
#include "pdl.cuh"

namespace fused_gemm_bn {
namespace {

constexpr int kPrepassThreads = kRowThreads;
constexpr int kPrepassRegGroups = 8;  // float4 groups per thread of the register form: K <= 8192

// The split of v = (x - c) s for the 4 elements of float4 group i into rows of
// fp16 word pairs (hi_row, lo_row).
__device__ __forceinline__ void split_group(const float4& v, float c, float s, int i, uint32_t* hi_row,
                                            uint32_t* lo_row) {
  uint2 hi, lo;
  split_fp16x2((v.x - c) * s, (v.y - c) * s, hi.x, lo.x);
  split_fp16x2((v.z - c) * s, (v.w - c) * s, hi.y, lo.y);
  reinterpret_cast<uint2*>(hi_row)[i] = hi;
  reinterpret_cast<uint2*>(lo_row)[i] = lo;
}

// kVec: rows contiguous and 16-byte aligned, K % 4 == 0 (float4 loads); kRegs
// (with kVec, K <= 4 kPrepassRegGroups kPrepassThreads): the row held in registers.
// kSide: kX centres each row on c_m and writes center[m]; kW writes row_sum[m]
// (float64 sum as an fp32 (hi, lo) pair) and splits the row as it is (centring.cuh).
template <bool kVec, bool kRegs, RowSide kSide>
__global__ void __launch_bounds__(kPrepassThreads)
    sm90_prepass_fp16x3_kernel(const float* __restrict__ x, int64_t row_stride, int64_t col_stride, int K,
                               uint32_t* __restrict__ x_hi, uint32_t* __restrict__ x_lo,
                               float* __restrict__ x_inv_scale, float* __restrict__ center,
                               float2* __restrict__ row_sum, int64_t* num_batches_tracked, int* zero_ints,
                               int num_zero_ints) {
  pdl_wait_then_release();
  if (blockIdx.x == 0) {
    if (num_batches_tracked != nullptr && threadIdx.x == 0) *num_batches_tracked += 1;
    for (int j = threadIdx.x; j < num_zero_ints; j += blockDim.x) zero_ints[j] = 0;
  }
  static_assert(kVec || !kRegs, "the register form reads float4 groups");
  const int64_t m = blockIdx.x;
  const float* row = x + m * row_stride;
  // Pass 1: the row's max, min and sum; c_m or the row's sum written.
  float4 held[kRegs ? kPrepassRegGroups : 1];
  RowTerms r;
  if constexpr (kRegs) {
    // Thread t holds groups t, t + kPrepassThreads, ...: row_terms' order.
    const float4* row4 = reinterpret_cast<const float4*>(row);
#pragma unroll
    for (int g = 0; g < kPrepassRegGroups; ++g) {
      const int i = threadIdx.x + g * kPrepassThreads;
      if (i < K / 4) held[g] = row4[i];
    }
    RowAccum<kSide> a;
#pragma unroll
    for (int g = 0; g < kPrepassRegGroups; ++g)
      if (threadIdx.x + g * kPrepassThreads < K / 4) a.take(held[g]);
    r = finish_row_terms(a, K, m, center, row_sum);
  } else {
    r = row_terms<kVec, kSide>(row, col_stride, K, m, center, row_sum);
  }
  const float vmax = r.vmax, vmin = r.vmin, c = r.c;
  const float amax = fmaxf(fmaxf(vmax, -vmin), 0.f);  // max |x|; 0 for an all-NaN row
  // max |rn(x - c)| <= max(rn(vmax - c), rn(c - vmin)): rounding is monotonic.
  const float amax_c = kSide == RowSide::kX ? fmaxf(fmaxf(vmax - c, c - vmin), 0.f) : amax;
  float s, inv_s;
  fp16x3_scale(amax_c, s, inv_s);
  if (threadIdx.x == 0) x_inv_scale[m] = inv_s;

  // Pass 2 (from registers, else L1 / L2 hits): the split of (x - c) s into
  // rows of K_pad words (K_pad / 2 word pairs); the pairs past K hold zeros
  // (rn_fp16(0) = 0 in both parts).
  const int pairs = (K + 7) / 8 * 4;  // K_pad / 2
  uint32_t* hi_row = x_hi + m * pairs;
  uint32_t* lo_row = x_lo + m * pairs;
  if constexpr (kRegs) {
#pragma unroll
    for (int g = 0; g < kPrepassRegGroups; ++g) {
      const int i = threadIdx.x + g * kPrepassThreads;
      if (i < K / 4) split_group(held[g], c, s, i, hi_row, lo_row);
    }
    for (int p = K / 2 + threadIdx.x; p < pairs; p += kPrepassThreads) hi_row[p] = lo_row[p] = 0u;  // K % 8 == 4
  } else if constexpr (kVec) {
    const float4* row4 = reinterpret_cast<const float4*>(row);
    for (int i = threadIdx.x; i < K / 4; i += kPrepassThreads) split_group(row4[i], c, s, i, hi_row, lo_row);
    for (int p = K / 2 + threadIdx.x; p < pairs; p += kPrepassThreads) hi_row[p] = lo_row[p] = 0u;  // K % 8 == 4
  } else {
    for (int p = threadIdx.x; p < pairs; p += kPrepassThreads) {
      const int k0 = 2 * p, k1 = 2 * p + 1;
      const float v0 = k0 < K ? (row[k0 * col_stride] - c) * s : 0.f;
      const float v1 = k1 < K ? (row[k1 * col_stride] - c) * s : 0.f;
      split_fp16x2(v0, v1, hi_row[p], lo_row[p]);
    }
  }
}

}  // namespace
}  // namespace fused_gemm_bn

// ---------------------------------------------------------------------------
// Host launcher (declared in launchers.cuh)
// ---------------------------------------------------------------------------

// Preconditions: M >= 1, 1 <= K <= INT32_MAX - 7, x_hi and x_lo 16-byte aligned
// ((M, fp16x3_padded_k(K)) words each), exactly one of center / row_sum.
cudaError_t fused_gemm_bn::sm90_prepass_fp16x3(const float* x, int64_t row_stride, int64_t col_stride, int M, int K,
                                               uint16_t* x_hi, uint16_t* x_lo, float* x_inv_scale, float* center,
                                               float2* row_sum, int* zero_ints, int num_zero_ints,
                                               int64_t* num_batches_tracked, cudaStream_t stream) {
  if (M < 1 || K < 1 || K > INT32_MAX - 7 || reinterpret_cast<uintptr_t>(x_hi) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(x_lo) % 16 != 0 || (center == nullptr) == (row_sum == nullptr))
    return cudaErrorInvalidValue;
  const bool vec = col_stride == 1 && row_stride % 4 == 0 && K % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  const bool regs = vec && K <= 4 * kPrepassRegGroups * kPrepassThreads;
  auto hi = reinterpret_cast<uint32_t*>(x_hi);
  auto lo = reinterpret_cast<uint32_t*>(x_lo);
  auto launch = [&](auto kernel) {
    return launch_kernel(kernel, M, kPrepassThreads, 0, stream, x, row_stride, col_stride, K, hi, lo, x_inv_scale,
                         center, row_sum, num_batches_tracked, zero_ints, num_zero_ints);
  };
  if (center != nullptr) {
    if (regs) return launch(sm90_prepass_fp16x3_kernel<true, true, RowSide::kX>);
    if (vec) return launch(sm90_prepass_fp16x3_kernel<true, false, RowSide::kX>);
    return launch(sm90_prepass_fp16x3_kernel<false, false, RowSide::kX>);
  }
  if (regs) return launch(sm90_prepass_fp16x3_kernel<true, true, RowSide::kW>);
  if (vec) return launch(sm90_prepass_fp16x3_kernel<true, false, RowSide::kW>);
  return launch(sm90_prepass_fp16x3_kernel<false, false, RowSide::kW>);
}
