// prepass_fp16x3_backward.cu -- the pre-passes of the backward's two fp16x3
// products (sm90_gemm_fp16x3_plain, sm90_gemm_fp16x3_bn.cu), which read their
// operands where they lie instead of transposed copies:
//
//   grad_x = grad_z W, (M, K): grad_x[m, k] = sum_n grad_z[m, n] W[n, k].
//     W's cached parts (prepass_fp16x3.cu over W's rows: W[n, k] = (hi + lo)[n, k]
//     2^-e_n, the forward's K-major (N, K) words) are the GEMM's w operand as
//     they are: MN-major (rows k, reduction n), unscaled.  Their row scales move
//     to the other operand, which the sum over n allows:
//       grad_x[m, k] = sum_n (grad_z[m, n] 2^-e_n) (hi + lo)[n, k],
//     so sm90_prepass_fp16x3_scaled splits the rows of g'[m, n] = grad_z[m, n]
//     2^-e_n (K-major).  No copy of W, no split of it in the backward.
//   grad_W = grad_z^T x, (N, K): grad_W[n, k] = sum_m grad_z[m, n] x[m, k].
//     Both operands reduce over their stored rows, so sm90_prepass_fp16x3_columns
//     splits each (M, C) matrix per column c (the GEMM's rows) with a scale per
//     column and stores the parts as the matrix lies (MN-major).
//
// Tensors (fp32 inputs rows contiguous, any row stride; read, never written)
//   _scaled:  a (M, K) fp32, col_scale (K) fp32 powers of two -> hi, lo (M, K) fp16
//             words row-major, inv_scale (M) fp32
//   _columns: a (R, C) fp32 -> hi, lo (R, C) fp16 words row-major, inv_scale (C)
// Both zero zero_ints[0 .. num_zero_ints) (the GEMM's split-tile arrival counts).
//
// Numerics (fp16x3_split.cuh: the split and its error, <= 2^-22 |v| per element
// above the subnormal range of lo, as the forward's):
//   _scaled: v = a[m, k] col_scale[k] and its row's scale s_m = 2^f_m are applied
//     as one product in float64, (float)(a (col_scale s_m)): exact wherever the
//     result is a normal float (a power-of-two scaling), so g' needs no fp32 range
//     of its own (|grad_z| |W| down to 2^-1000 keeps its bits); s_m from max_k |v|
//     (fp16x3_scale: clamped to [2^-126, 2^126]).
//   _columns: s_c from max_r |a[r, c]|, v s_c one exact fp32 product.
//   No centring: these products feed no batch statistic (the forward centres x
//   because BatchNorm's mean would keep the tensor cores' truncation bias).
//   Non-finite inputs: Inf gives hi = Inf, lo = NaN, so the products are NaN
//   where they involve it (NaN where eager has +-Inf), as in the forward.
//
// Structure: _scaled is one 256-thread block per row, two passes over the row
// (the second from L1 / L2); _columns is one 512-thread block per 64 columns
// (a lane owns 2 adjacent columns, 32 warps stride over the rows, 8 rows'
// loads in flight per warp: with 16 warps and 4 rows the pair of column splits
// of the KernelBench backward took 2 x 38 us on an H100, docs/perf.md v38), the
// column maxima through shared memory, then a second pass (L2 hits: R x 256
// bytes per block).  Memory traffic: 8 bytes read and 4 written per element.

#include <cuda_runtime.h>
#include <stdint.h>

#include "centring.cuh"
#include "fp16x3_split.cuh"
#include "launchers.cuh"
#include "pdl.cuh"

namespace fused_gemm_bn {
namespace {

constexpr int kColumnsWarps = 32;
constexpr int kColumnsThreads = 32 * kColumnsWarps;
constexpr int kColumnsPerBlock = 64;  // 32 lanes x 2 adjacent columns
constexpr int kScaledRegGroups = 8;   // float4 groups per thread of _scaled's register form: K <= 8192

__device__ __forceinline__ void zero_arrivals(int* zero_ints, int num_zero_ints) {
  if (blockIdx.x == 0)
    for (int j = threadIdx.x; j < num_zero_ints; j += blockDim.x) zero_ints[j] = 0;
}

// |v c| as a float, from the exact float64 product: exact in the normal range,
// Inf / 0 beyond it, which fp16x3_scale's clamp handles.
__device__ __forceinline__ float abs_scaled(float v, float c) {
  return static_cast<float>(fabs(static_cast<double>(v) * static_cast<double>(c)));
}

// The split of (v0 c0 s, v1 c1 s) into one word of each part (v c s: one
// float64 product of exact factors, rounded once).
__device__ __forceinline__ void split_scaled_pair(float v0, float v1, float c0, float c1, double sd, uint32_t& hi,
                                                  uint32_t& lo) {
  const float y0 = static_cast<float>(static_cast<double>(v0) * (static_cast<double>(c0) * sd));
  const float y1 = static_cast<float>(static_cast<double>(v1) * (static_cast<double>(c1) * sd));
  split_fp16x2(y0, y1, hi, lo);
}

// Row m of g' = a diag(col_scale), split with its own scale (header).  kRegs:
// rows of float4 groups (16-byte aligned, K <= 4 kScaledRegGroups kRowThreads)
// held in registers, every load issued before the first use (one read of the
// row; the loop form, which reads it again from L1 / L2, took 30 us at 1024 x
// 8192 on an H100, docs/perf.md v38).  Both forms give the same bits.
template <bool kRegs>
__global__ void __launch_bounds__(kRowThreads, 2)
    sm90_prepass_fp16x3_scaled_kernel(const float* __restrict__ a, int64_t row_stride, int K,
                                      const float* __restrict__ col_scale, uint32_t* __restrict__ hi,
                                      uint32_t* __restrict__ lo, float* __restrict__ inv_scale, int* zero_ints,
                                      int num_zero_ints) {
  pdl_wait_then_release();
  __shared__ float scratch[kRowWarps];
  zero_arrivals(zero_ints, num_zero_ints);
  const int64_t m = blockIdx.x;
  const float* row = a + m * row_stride;
  uint32_t* hi_row = hi + m * (K / 2);
  uint32_t* lo_row = lo + m * (K / 2);
  // Pass 1: max_k |a col_scale|.
  float amax = 0.f;
  float4 v[kRegs ? kScaledRegGroups : 1];
  const float4* c4 = reinterpret_cast<const float4*>(col_scale);  // every row's: L1 / L2 hits
  if constexpr (kRegs) {
#pragma unroll
    for (int g = 0; g < kScaledRegGroups; ++g) {
      const int i = threadIdx.x + g * kRowThreads;
      if (i < K / 4) v[g] = reinterpret_cast<const float4*>(row)[i];
    }
#pragma unroll
    for (int g = 0; g < kScaledRegGroups; ++g) {
      const int i = threadIdx.x + g * kRowThreads;
      if (i < K / 4) {
        const float4 c = c4[i];
        amax = fmaxf(fmaxf(amax, fmaxf(abs_scaled(v[g].x, c.x), abs_scaled(v[g].y, c.y))),
                     fmaxf(abs_scaled(v[g].z, c.z), abs_scaled(v[g].w, c.w)));
      }
    }
  } else {
#pragma unroll 4
    for (int k = threadIdx.x; k < K; k += kRowThreads) amax = fmaxf(amax, abs_scaled(row[k], col_scale[k]));
  }
  amax = row_block_reduce<1>(amax, scratch);
  float s, inv_s;
  fp16x3_scale(amax, s, inv_s);
  if (threadIdx.x == 0) inv_scale[m] = inv_s;

  // Pass 2 (from registers, else L1 / L2 hits): the split of a col_scale s,
  // two columns per word.
  const double sd = static_cast<double>(s);
  if constexpr (kRegs) {
#pragma unroll
    for (int g = 0; g < kScaledRegGroups; ++g) {
      const int i = threadIdx.x + g * kRowThreads;
      if (i < K / 4) {
        const float4 c = c4[i];
        uint2 h, l;
        split_scaled_pair(v[g].x, v[g].y, c.x, c.y, sd, h.x, l.x);
        split_scaled_pair(v[g].z, v[g].w, c.z, c.w, sd, h.y, l.y);
        reinterpret_cast<uint2*>(hi_row)[i] = h;
        reinterpret_cast<uint2*>(lo_row)[i] = l;
      }
    }
  } else {
#pragma unroll 2
    for (int p = threadIdx.x; p < K / 2; p += kRowThreads) {
      const float2 vp = *reinterpret_cast<const float2*>(row + 2 * p);
      const float2 cp = *reinterpret_cast<const float2*>(col_scale + 2 * p);
      split_scaled_pair(vp.x, vp.y, cp.x, cp.y, sd, hi_row[p], lo_row[p]);
    }
  }
}

// Columns [64 b, 64 b + 64) of a (R, C), split per column (header).  kVec:
// rows 8-byte aligned (float2 loads).
template <bool kVec>
__global__ void __launch_bounds__(kColumnsThreads)
    sm90_prepass_fp16x3_columns_kernel(const float* __restrict__ a, int64_t row_stride, int R, int C,
                                       uint32_t* __restrict__ hi, uint32_t* __restrict__ lo,
                                       float* __restrict__ inv_scale, int* zero_ints, int num_zero_ints) {
  pdl_wait_then_release();
  __shared__ float col_max[kColumnsWarps][kColumnsPerBlock];
  __shared__ float col_scale[kColumnsPerBlock];
  zero_arrivals(zero_ints, num_zero_ints);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int c0 = blockIdx.x * kColumnsPerBlock + 2 * lane;  // this lane's columns c0, c0 + 1 (C is even)
  const bool live = c0 < C;
  auto load = [&](int r) {
    const float* p = a + static_cast<int64_t>(r) * row_stride + c0;
    if constexpr (kVec) return *reinterpret_cast<const float2*>(p);
    else return make_float2(p[0], p[1]);
  };
  // Pass 1: the column maxima.
  float m0 = 0.f, m1 = 0.f;
  if (live) {
#pragma unroll 8
    for (int r = warp; r < R; r += kColumnsWarps) {
      const float2 v = load(r);
      m0 = fmaxf(m0, fabsf(v.x));
      m1 = fmaxf(m1, fabsf(v.y));
    }
  }
  col_max[warp][2 * lane] = m0;
  col_max[warp][2 * lane + 1] = m1;
  __syncthreads();
  if (threadIdx.x < kColumnsPerBlock) {
    float amax = 0.f;
#pragma unroll
    for (int w = 0; w < kColumnsWarps; ++w) amax = fmaxf(amax, col_max[w][threadIdx.x]);
    float s, inv_s;
    fp16x3_scale(amax, s, inv_s);
    col_scale[threadIdx.x] = s;
    const int c = blockIdx.x * kColumnsPerBlock + threadIdx.x;
    if (c < C) inv_scale[c] = inv_s;
  }
  __syncthreads();
  if (!live) return;
  // Pass 2 (L2 hits): the split, one fp16 pair per lane and row.
  const float s0 = col_scale[2 * lane], s1 = col_scale[2 * lane + 1];
#pragma unroll 8
  for (int r = warp; r < R; r += kColumnsWarps) {
    const float2 v = load(r);
    const int64_t word = (static_cast<int64_t>(r) * C + c0) / 2;
    split_fp16x2(v.x * s0, v.y * s1, hi[word], lo[word]);
  }
}

}  // namespace
}  // namespace fused_gemm_bn

// ---------------------------------------------------------------------------
// Host launchers (declared in launchers.cuh)
// ---------------------------------------------------------------------------

// Preconditions: M >= 1, K % 8 == 0, a's rows and col_scale 8-byte aligned with
// an even row stride, hi and lo 16-byte aligned.
cudaError_t fused_gemm_bn::sm90_prepass_fp16x3_scaled(const float* a, int64_t row_stride, int M, int K,
                                                      const float* col_scale, uint16_t* hi, uint16_t* lo,
                                                      float* inv_scale, int* zero_ints, int num_zero_ints,
                                                      cudaStream_t stream) {
  if (M < 1 || K % 8 != 0 || row_stride % 2 != 0 || reinterpret_cast<uintptr_t>(a) % 8 != 0 ||
      reinterpret_cast<uintptr_t>(col_scale) % 8 != 0 || reinterpret_cast<uintptr_t>(hi) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(lo) % 16 != 0)
    return cudaErrorInvalidValue;
  const bool regs = K <= 4 * kScaledRegGroups * kRowThreads && row_stride % 4 == 0 &&
                    (reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(col_scale)) % 16 == 0;
  auto h = reinterpret_cast<uint32_t*>(hi);
  auto l = reinterpret_cast<uint32_t*>(lo);
  return launch_kernel(regs ? sm90_prepass_fp16x3_scaled_kernel<true> : sm90_prepass_fp16x3_scaled_kernel<false>, M,
                       kRowThreads, 0, stream, a, row_stride, K, col_scale, h, l, inv_scale, zero_ints, num_zero_ints);
}

// Preconditions: R >= 1, C >= 1, C % 8 == 0, hi and lo 16-byte aligned.
cudaError_t fused_gemm_bn::sm90_prepass_fp16x3_columns(const float* a, int64_t row_stride, int R, int C,
                                                       uint16_t* hi, uint16_t* lo, float* inv_scale, int* zero_ints,
                                                       int num_zero_ints, cudaStream_t stream) {
  if (R < 1 || C < 1 || C % 8 != 0 || reinterpret_cast<uintptr_t>(hi) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(lo) % 16 != 0)
    return cudaErrorInvalidValue;
  const bool vec = row_stride % 2 == 0 && reinterpret_cast<uintptr_t>(a) % 8 == 0;
  const unsigned blocks = static_cast<unsigned>((C + kColumnsPerBlock - 1) / kColumnsPerBlock);
  auto h = reinterpret_cast<uint32_t*>(hi);
  auto l = reinterpret_cast<uint32_t*>(lo);
  return launch_kernel(vec ? sm90_prepass_fp16x3_columns_kernel<true> : sm90_prepass_fp16x3_columns_kernel<false>,
                       blocks, kColumnsThreads, 0, stream, a, row_stride, R, C, h, l, inv_scale, zero_ints,
                       num_zero_ints);
}
