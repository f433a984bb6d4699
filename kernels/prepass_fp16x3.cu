// prepass_fp16x3.cu -- the pre-pass before each fp16x3 GEMM (sm90_gemm_fp16x3_bn.cu):
// x's fp16 parts and per-row power-of-two scales, and the call's bookkeeping.
// The same kernel splits gemm.weight's rows (N, K) for the GEMM's other operand
// (no bookkeeping: null counters); model_new.py keeps those parts while the
// weight is unchanged.
//
//   x            (M, K) fp32, any strides (read, never written)
//   x_hi, x_lo   (M, K) fp16 words, row-major (K % 8 == 0, 16-byte aligned)
//   x_inv_scale  (M) fp32
//   center       (M) fp32, the x side only: c_m
//   row_sum      (M) fp32 pairs, the w side only: sum_k x[m, k] in float64,
//                stored as hi = rn_fp32(sum), lo = rn_fp32(sum - hi)
// Row m, x side: c_m = rn(sum_k x[m, k]) / K (fp32; 0 when max |x[m, :]| >= 2^32
// or the sum is not finite), v = rn(x - c_m) (round to nearest: unbiased, error
// <= 2^-24 |v|); w side: v = x.  e_m from max_k |v| (fp16x3_split.cuh:
// s = 2^e_m puts it in [2^14, 2^15)); x_hi = rn_fp16(v s), x_lo = rn_fp16(v s - x_hi),
// x_inv_scale[m] = 2^-e_m.  Both scalings are exact.
// Why centre x: z[m, n] = sum_k (x[m, k] - c_m) w[n, k] + c_m sum_k w[n, k]
// exactly, and the GEMM adds the last term back (sm90_gemm_fp16x3_bn.cu).
// The tensor core's accumulation truncates towards zero, so on inputs whose
// rows share a level (uniform [0, 1), 100 + uniform, exponential) every row
// of a feature lost the same signed amount and the batch mean kept it: z's
// per-feature mean over 1024 rows was 7.7e-8 from float64 (eager SGEMM 5.8e-8);
// centred, 7.5e-9 (H200, 1024 x 8192 x 8192, docs/perf.md v21).
// Bookkeeping in the same launch: num_batches_tracked += 1 when not null (a
// training call) and zero_ints[0 .. num_zero_ints) = 0 (the GEMM's split-tile
// arrival counts).
//
// One 256-thread block per row: a pass for max, min and sum (block reductions),
// then a second read of the row (L1 / L2 hits: 32 KB at K = 8192) for the split.
// Memory traffic per call: 4 M K bytes read, 4 M K written.

#include <cuda_runtime.h>
#include <stdint.h>

#include "fp16x3_split.cuh"
#include "launchers.cuh"

namespace fused_gemm_bn {
namespace {

constexpr int kPrepassThreads = 256;
constexpr int kPrepassWarps = kPrepassThreads / 32;
// Rows whose max |x| reaches this are split without centring (c = 0): keeps
// |c_m| below 2^32, so c_m * sum_k w[n, k] cannot overflow for any W whose row
// sums stay below 2^95 in magnitude.
constexpr float kMaxCentredAmax = 4294967296.f;  // 2^32

// The GEMM operand a row belongs to (header).
enum class Side { kX, kW };

// The block-wide sum (kOp = 0), max (1) or min (2) of one value per thread
// (max / min for float only).
template <int kOp, typename T>
__device__ __forceinline__ T block_reduce(T v, T* scratch) {
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
  for (int w = 1; w < kPrepassWarps; ++w) v = op(v, scratch[w]);
  return v;
}

// kVec: rows contiguous and 16-byte aligned (float4 loads).  kSide: kX centres
// each row on c_m and writes center[m]; kW writes row_sum[m] (float64 sum as an
// fp32 (hi, lo) pair) and splits the row as it is.
template <bool kVec, Side kSide>
__global__ void __launch_bounds__(kPrepassThreads)
    sm90_prepass_fp16x3_kernel(const float* __restrict__ x, int64_t row_stride, int64_t col_stride, int K,
                               uint32_t* __restrict__ x_hi, uint32_t* __restrict__ x_lo,
                               float* __restrict__ x_inv_scale, float* __restrict__ center,
                               float2* __restrict__ row_sum, int64_t* num_batches_tracked, int* zero_ints,
                               int num_zero_ints) {
  __shared__ float scratch_f[kPrepassWarps];
  __shared__ double scratch_d[kPrepassWarps];
  if (blockIdx.x == 0) {
    if (num_batches_tracked != nullptr && threadIdx.x == 0) *num_batches_tracked += 1;
    for (int j = threadIdx.x; j < num_zero_ints; j += blockDim.x) zero_ints[j] = 0;
  }
  const int64_t m = blockIdx.x;
  const float* row = x + m * row_stride;
  // Pass 1: the row's max and min (fmaxf / fminf skip NaN) and its sum.
  const float inf = __int_as_float(0x7f800000);
  float vmax = -inf, vmin = inf, sum_f = 0.f;
  double sum_d = 0.0;
  auto take = [&](float v) {
    vmax = fmaxf(vmax, v);
    vmin = fminf(vmin, v);
    if constexpr (kSide == Side::kX) sum_f += v;
    else sum_d += static_cast<double>(v);
  };
  if constexpr (kVec) {
    const float4* row4 = reinterpret_cast<const float4*>(row);
    for (int i = threadIdx.x; i < K / 4; i += kPrepassThreads) {
      const float4 v = row4[i];
      take(v.x), take(v.y), take(v.z), take(v.w);
    }
  } else {
    for (int k = threadIdx.x; k < K; k += kPrepassThreads) take(row[k * col_stride]);
  }
  vmax = block_reduce<1>(vmax, scratch_f);
  vmin = block_reduce<2>(vmin, scratch_f);
  const float amax = fmaxf(fmaxf(vmax, -vmin), 0.f);  // max |x|; 0 for an all-NaN row
  float c = 0.f;
  if constexpr (kSide == Side::kX) {
    sum_f = block_reduce<0>(sum_f, scratch_f);
    // c is any float (the GEMM adds c_m sum_k w back); the mean removes what
    // every row has in common.  Not for huge or non-finite rows (c = 0: those
    // keep the uncentred split, an Inf making the row NaN as before).
    if (amax < kMaxCentredAmax && isfinite(sum_f)) c = sum_f * (1.f / static_cast<float>(K));
    if (threadIdx.x == 0) center[m] = c;
  } else {
    sum_d = block_reduce<0>(sum_d, scratch_d);
    if (threadIdx.x == 0) {
      const float hi = static_cast<float>(sum_d);
      row_sum[m] = make_float2(hi, static_cast<float>(sum_d - static_cast<double>(hi)));
    }
  }
  // max |rn(x - c)| <= max(rn(vmax - c), rn(c - vmin)): rounding is monotonic.
  const float amax_c = kSide == Side::kX ? fmaxf(fmaxf(vmax - c, c - vmin), 0.f) : amax;
  float s, inv_s;
  fp16x3_scale(amax_c, s, inv_s);
  if (threadIdx.x == 0) x_inv_scale[m] = inv_s;

  // Pass 2 (L1 / L2 hits): the split of (x - c) s.
  uint32_t* hi_row = x_hi + m * (K / 2);
  uint32_t* lo_row = x_lo + m * (K / 2);
  if constexpr (kVec) {
    const float4* row4 = reinterpret_cast<const float4*>(row);
    for (int i = threadIdx.x; i < K / 4; i += kPrepassThreads) {
      const float4 v = row4[i];
      uint2 hi, lo;
      split_fp16x2((v.x - c) * s, (v.y - c) * s, hi.x, lo.x);
      split_fp16x2((v.z - c) * s, (v.w - c) * s, hi.y, lo.y);
      reinterpret_cast<uint2*>(hi_row)[i] = hi;
      reinterpret_cast<uint2*>(lo_row)[i] = lo;
    }
  } else {
    for (int p = threadIdx.x; p < K / 2; p += kPrepassThreads) {
      const float v0 = row[(2 * p) * col_stride], v1 = row[(2 * p + 1) * col_stride];
      split_fp16x2((v0 - c) * s, (v1 - c) * s, hi_row[p], lo_row[p]);
    }
  }
}

}  // namespace
}  // namespace fused_gemm_bn

// ---------------------------------------------------------------------------
// Host launcher (declared in launchers.cuh)
// ---------------------------------------------------------------------------

// Preconditions: M >= 1, K % 8 == 0, x_hi and x_lo 16-byte aligned, exactly one
// of center / row_sum.
cudaError_t fused_gemm_bn::sm90_prepass_fp16x3(const float* x, int64_t row_stride, int64_t col_stride, int M, int K,
                                               uint16_t* x_hi, uint16_t* x_lo, float* x_inv_scale, float* center,
                                               float2* row_sum, int* zero_ints, int num_zero_ints,
                                               int64_t* num_batches_tracked, cudaStream_t stream) {
  if (M < 1 || K % 8 != 0 || reinterpret_cast<uintptr_t>(x_hi) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(x_lo) % 16 != 0 || (center == nullptr) == (row_sum == nullptr))
    return cudaErrorInvalidValue;
  const bool vec = col_stride == 1 && row_stride % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  auto hi = reinterpret_cast<uint32_t*>(x_hi);
  auto lo = reinterpret_cast<uint32_t*>(x_lo);
  auto launch = [&](auto kernel) {
    kernel<<<M, kPrepassThreads, 0, stream>>>(x, row_stride, col_stride, K, hi, lo, x_inv_scale, center, row_sum,
                                              num_batches_tracked, zero_ints, num_zero_ints);
  };
  if (center != nullptr) {
    if (vec) launch(sm90_prepass_fp16x3_kernel<true, Side::kX>);
    else launch(sm90_prepass_fp16x3_kernel<false, Side::kX>);
  } else {
    if (vec) launch(sm90_prepass_fp16x3_kernel<true, Side::kW>);
    else launch(sm90_prepass_fp16x3_kernel<false, Side::kW>);
  }
  return cudaGetLastError();
}
