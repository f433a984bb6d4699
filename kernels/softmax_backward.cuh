// softmax_backward.cuh -- the backward of problem 84's row softmax (out = softmax(v)
// along dim 1) in one kernel, shared by the float32 extension (softmax_rows_backward.cu)
// and the 16-bit one (lowp/softmax_16bit_backward.cu: 16-bit tensors, and float32 ones
// under torch.autocast):
//
//   grad_v[m, n] = out[m, n] * (grad_out[m, n] - s_m),   s_m = sum_n grad_out[m, n] out[m, n]
//
// (torch ops spell it out * (grad_out - (grad_out * out).sum(1, keepdim=True)): five
// passes over (M, N) tensors; torch's own 16-bit kernel makes two, rounding grad_out * out
// to the 16-bit type between them.  This is two reads of each input, the second mostly
// from L2, and one write.)
//
// Elements (the policy E): FloatElems here, float32 words, 16-byte groups of 4; the 16-bit
// extension's policy, 16-byte groups of 8 (lowp/softmax_16bit_backward.cu).  E::Group is a
// group as loaded (4 registers either way), E::unpack gives its values as floats (exact),
// E::store rounds kGroup floats to the element type (nearest even) and stores them;
// load1 / store1 one element.
// Tensors: out, grad_out, grad_v (M, N) of E, row-major, contiguous; 16-byte groups when
// N % kGroup == 0 and all three are 16-byte aligned, else one element at a time.
// One CTA per row.  Any M >= 0, N >= 0.
// Rows of groups that fit kRegGroups per thread (float32: N <= 8192, 16-bit: N <= 16384 at
// 512 threads) are held in registers, every load issued before the first use: one read of
// each input from DRAM (Form::kRegisters, row_in_registers; the loop form's dependent
// float64 sum kept few loads in flight: 53 us at 1024 x 8192 float32 on an H100,
// docs/perf.md v38).  Other rows: the loop form (row_in_loop), whose second pass reads the
// row again (mostly from L2).
//
// Numerics: each product grad_out * out is exact in float64 and s_m is summed in float64
// (per thread, then a warp and CTA tree), then held as two floats s_hi + s_lo (s_hi =
// rn(s_m), s_lo = rn(s_m - s_hi)); grad_out - s_m is kept unrounded as t + c (TwoSum) and
// grad_v = fma(out, t, out c), rounded once to float32 (times_grad_minus_sum), then for
// 16-bit elements once more, to the element type (the float32 value is within a hair of
// half a float32 ulp: the 16-bit result is the correctly rounded one but where the
// float32 value sits on a 16-bit tie).  torch's float32 form (s_m rounded to float32,
// grad_out - s_m rounded, then the product) rounds the difference first, and that rounding
// is shared by the row: grad_out's elements lie on float32's grid and s_m is one number, so
// every element of a binade loses the same low bits of s_m.  Summed against any y over the
// row (problem 84's scale gradient is sum grad_v y), it does not average out: 5x eager's
// scale-gradient error at 16 x 8192 x 8192, against 0.07x with one rounding (docs/perf.md
// v45).  torch's 16-bit kernel also rounds grad_out * out to the 16-bit type first.
// NaN or Inf in a row propagates through s_m to the whole row, as torch's.
// Sources: Knuth, TAOCP vol. 2, 4.2.2 (TwoSum); Ogita, Rump, Oishi, "Accurate sum and
// dot product", SIAM J. Sci. Comput. 26(6), 2005.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "launchers.cuh"
#include "pdl.cuh"

namespace fused_gemm_bn {
namespace softmax_backward {

constexpr int kThreads = 256;     // the loop form
constexpr int kRegThreads = 512;  // the register form, at most
constexpr int kRegGroups = 4;     // 16-byte groups per input and thread (register form)

// float32 elements.
struct FloatElems {
  using word = float;
  using Group = float4;
  static constexpr int kGroup = 4;
  static __device__ __forceinline__ void unpack(const float4& g, float (&v)[4]) {
    v[0] = g.x, v[1] = g.y, v[2] = g.z, v[3] = g.w;
  }
  static __device__ __forceinline__ void store(float* p, const float (&v)[4]) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  }
  static __device__ __forceinline__ float load1(const float* p) { return *p; }
  static __device__ __forceinline__ void store1(float* p, float v) { *p = v; }
};

// s_m as s_hi + s_lo, two floats (s_lo = 0 where s_hi is not finite: NaN / Inf propagate).
struct RowSum {
  float hi, lo;
};

__device__ __forceinline__ RowSum row_sum_of(double s) {
  const float hi = static_cast<float>(s);
  return {hi, isfinite(hi) ? static_cast<float>(s - static_cast<double>(hi)) : 0.f};
}

// o (g - (s.hi + s.lo)), rounded once (to within a hair of half an ulp): TwoSum gives
// g - s.hi exactly as t + e; c = e - s.lo (both below half an ulp of t or s.hi, so c is
// nearly exact); fma(o, t, o c) then rounds the product once.  Seven float operations;
// nvcc neither reassociates the additions nor contracts them (no fast-math, no product
// among them).
__device__ __forceinline__ float times_grad_minus_sum(float o, float g, RowSum s) {
  const float t = g - s.hi;
  const float b = t - g;
  const float e = (g - (t - b)) + (-s.hi - b);
  const float c = e - s.lo;
  return fmaf(o, t, o * c);
}

// Sum over the CTA (blockDim.x a multiple of 32), returned to every thread.
__device__ __forceinline__ double block_sum(double v, double* red) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  double total = 0.0;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total += red[w];
  return total;
}

// How a CTA goes over its row: held in registers (16-byte groups, at most kRegGroups per
// thread, kRegThreads threads at most), or in a loop of 16-byte groups or of single
// elements (kThreads threads).
enum class Form { kRegisters, kLoopVec, kLoop };

template <Form kForm>
constexpr int kBlockThreads = kForm == Form::kRegisters ? kRegThreads : kThreads;  // at most

// The row in registers: thread t holds groups t, t + blockDim.x, ... of both inputs
// (num_groups = N / kGroup <= kRegGroups blockDim.x).
template <class E>
__device__ __forceinline__ void row_in_registers(const typename E::word* __restrict__ out,
                                                 const typename E::word* __restrict__ grad_out,
                                                 typename E::word* __restrict__ grad_v, size_t base, int N,
                                                 double* red) {
  using Group = typename E::Group;
  constexpr int kGroup = E::kGroup;
  const Group* og = reinterpret_cast<const Group*>(out + base);
  const Group* gg = reinterpret_cast<const Group*>(grad_out + base);
  const int num_groups = N / kGroup;
  Group o[kRegGroups], g[kRegGroups];
#pragma unroll
  for (int r = 0; r < kRegGroups; ++r) {
    const int i = threadIdx.x + r * blockDim.x;
    if (i < num_groups) {
      o[r] = og[i];
      g[r] = gg[i];
    }
  }
  double dot = 0.0;
#pragma unroll
  for (int r = 0; r < kRegGroups; ++r) {
    if (threadIdx.x + r * blockDim.x < num_groups) {
      float ov[kGroup], gv[kGroup];
      E::unpack(o[r], ov);
      E::unpack(g[r], gv);
#pragma unroll
      for (int e = 0; e < kGroup; ++e) dot += static_cast<double>(ov[e]) * gv[e];
    }
  }
  const RowSum s = row_sum_of(block_sum(dot, red));
#pragma unroll
  for (int r = 0; r < kRegGroups; ++r) {
    const int i = threadIdx.x + r * blockDim.x;
    if (i < num_groups) {
      float ov[kGroup], gv[kGroup];
      E::unpack(o[r], ov);
      E::unpack(g[r], gv);
#pragma unroll
      for (int e = 0; e < kGroup; ++e) ov[e] = times_grad_minus_sum(ov[e], gv[e], s);
      E::store(grad_v + base + static_cast<size_t>(i) * kGroup, ov);
    }
  }
}

// The row in a loop (kThreads threads), read twice: 16-byte groups (kVec) or single elements.
template <class E, bool kVec>
__device__ __forceinline__ void row_in_loop(const typename E::word* __restrict__ out,
                                            const typename E::word* __restrict__ grad_out,
                                            typename E::word* __restrict__ grad_v, size_t base, int N, double* red) {
  using Group = typename E::Group;
  constexpr int kGroup = E::kGroup;
  // body(i, ov, gv) for this thread's groups i of the row, out's and grad_out's floats unpacked.
  auto each_group = [&](auto&& body) {
    const Group* og = reinterpret_cast<const Group*>(out + base);
    const Group* gg = reinterpret_cast<const Group*>(grad_out + base);
    for (int i = threadIdx.x; i < N / kGroup; i += kThreads) {
      float ov[kGroup], gv[kGroup];
      E::unpack(og[i], ov);
      E::unpack(gg[i], gv);
      body(i, ov, gv);
    }
  };
  double dot = 0.0;
  if constexpr (kVec) {
    each_group([&](int, const float(&ov)[kGroup], const float(&gv)[kGroup]) {
#pragma unroll
      for (int e = 0; e < kGroup; ++e) dot += static_cast<double>(ov[e]) * gv[e];
    });
  } else {
    for (int i = threadIdx.x; i < N; i += kThreads)
      dot += static_cast<double>(E::load1(out + base + i)) * E::load1(grad_out + base + i);
  }
  const RowSum s = row_sum_of(block_sum(dot, red));
  if constexpr (kVec) {
    each_group([&](int i, float(&ov)[kGroup], const float(&gv)[kGroup]) {
#pragma unroll
      for (int e = 0; e < kGroup; ++e) ov[e] = times_grad_minus_sum(ov[e], gv[e], s);
      E::store(grad_v + base + static_cast<size_t>(i) * kGroup, ov);
    });
  } else {
    for (int i = threadIdx.x; i < N; i += kThreads)
      E::store1(grad_v + base + i, times_grad_minus_sum(E::load1(out + base + i), E::load1(grad_out + base + i), s));
  }
}

// One CTA per row (blockIdx.x), in the given form.
template <class E, Form kForm>
__global__ void __launch_bounds__(kBlockThreads<kForm>)
    softmax_rows_backward_kernel(const typename E::word* __restrict__ out,
                                 const typename E::word* __restrict__ grad_out, typename E::word* __restrict__ grad_v,
                                 int N) {
  pdl_wait_then_release();
  __shared__ double red[kBlockThreads<kForm> / 32];
  const size_t base = static_cast<size_t>(blockIdx.x) * N;
  if constexpr (kForm == Form::kRegisters)
    row_in_registers<E>(out, grad_out, grad_v, base, N, red);
  else
    row_in_loop<E, kForm == Form::kLoopVec>(out, grad_out, grad_v, base, N, red);
}

// The launch for (M, N) tensors of E: the register form where the row's groups fit, else
// the loop form.  cudaErrorInvalidValue for negative sizes; M == 0 or N == 0 launches nothing.
template <class E>
cudaError_t launch_softmax_rows_backward(const typename E::word* out, const typename E::word* grad_out,
                                         typename E::word* grad_v, int M, int N, cudaStream_t stream) {
  if (M < 0 || N < 0) return cudaErrorInvalidValue;
  if (M == 0 || N == 0) return cudaSuccess;
  const bool vec = N % E::kGroup == 0 && (reinterpret_cast<uintptr_t>(out) | reinterpret_cast<uintptr_t>(grad_out) |
                                          reinterpret_cast<uintptr_t>(grad_v)) % 16 == 0;
  const int num_groups = N / E::kGroup;
  // kRegGroups groups per thread where the row allows (float32 N = 8192: 512 threads), at least one warp.
  const int reg_threads = min(kRegThreads, max(32, (num_groups / kRegGroups + 31) / 32 * 32));
  if (vec && num_groups <= kRegGroups * reg_threads)
    return launch_kernel(softmax_rows_backward_kernel<E, Form::kRegisters>, M, reg_threads, 0, stream, out, grad_out,
                         grad_v, N);
  return launch_kernel(vec ? softmax_rows_backward_kernel<E, Form::kLoopVec> : softmax_rows_backward_kernel<E, Form::kLoop>,
                       M, kThreads, 0, stream, out, grad_out, grad_v, N);
}

}  // namespace softmax_backward
}  // namespace fused_gemm_bn
