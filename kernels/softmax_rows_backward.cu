// softmax_rows_backward.cu -- the backward of problem 84's row softmax (KernelBench
// level 2, problem 84: out = softmax(v) along dim 1), in one kernel:
//
//   grad_v[m, n] = out[m, n] * (grad_out[m, n] - s_m),   s_m = sum_n grad_out[m, n] out[m, n]
//
// (torch ops spell it out * (grad_out - (grad_out * out).sum(1, keepdim=True)):
// five passes over (M, N) tensors; this is two reads of each input, the second
// mostly from L2, and one write).
//
// Tensors: out, grad_out, grad_v (M, N) float32, row-major, contiguous; 16-byte
// accesses when N % 4 == 0 and all three are 16-byte aligned, else 4-byte.
// One CTA per row.  Any M >= 0, N >= 0.
// Rows of 16-byte groups that fit kRegGroups per thread (N <= 8192 at 512
// threads) are held in registers, every load issued before the first use: one
// read of each input from DRAM (Form::kRegisters, row_in_registers; the loop
// form's dependent float64 sum kept few loads in flight: 53 us at 1024 x 8192
// on an H100, docs/perf.md v38).  Other rows: the loop form (row_in_loop), whose
// second pass reads the row again (mostly from L2).
//
// Numerics: each product grad_out * out is exact in float64 and s_m is summed
// in float64 (per thread, then a warp and CTA tree), then held as two floats
// s_hi + s_lo (s_hi = rn(s_m), s_lo = rn(s_m - s_hi)); grad_out - s_m is kept
// unrounded as t + c (TwoSum) and grad_v = fma(out, t, out c), rounded once
// (times_grad_minus_sum).  torch's form (s_m rounded to float32, grad_out - s_m
// rounded, then the product) rounds the difference first, and that rounding is
// shared by the row: grad_out's elements lie on float32's grid and s_m is one
// number, so every element of a binade loses the same low bits of s_m.  Summed
// against any y over the row (problem 84's scale gradient is sum grad_v y), it does
// not average out: 5x eager's scale-gradient error at 16 x 8192 x 8192, against
// 0.07x with one rounding (docs/perf.md v45).
// NaN or Inf in a row propagates through s_m to the whole row, as torch's.

#include <cuda_runtime.h>
#include <stdint.h>

#include "launchers.cuh"
#include "pdl.cuh"

namespace fused_gemm_bn {
namespace softmax_backward {

constexpr int kThreads = 256;     // the loop form
constexpr int kRegThreads = 512;  // the register form, at most
constexpr int kRegGroups = 4;     // float4 groups per input and thread (register form)

// s_m as s_hi + s_lo, two floats (s_lo = 0 where s_hi is not finite: NaN / Inf propagate).
struct RowSum {
  float hi, lo;
};

__device__ __forceinline__ RowSum row_sum_of(double s) {
  const float hi = static_cast<float>(s);
  return {hi, isfinite(hi) ? static_cast<float>(s - static_cast<double>(hi)) : 0.f};
}

// o (g - (s.hi + s.lo)), rounded once (to within a hair of half an ulp): TwoSum (Knuth, TAOCP
// vol. 2, 4.2.2; Ogita, Rump, Oishi, "Accurate sum and dot product", 2005) gives g - s.hi
// exactly as t + e; c = e - s.lo (both below half an ulp of t or s.hi, so c is nearly exact);
// fma(o, t, o c) then rounds the product once.  Seven float operations; nvcc neither
// reassociates the additions nor contracts them (no fast-math, no product among them).
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

// How a CTA goes over its row: held in registers (16-byte groups, at most
// kRegGroups per thread, kRegThreads threads at most), or in a loop of 16-byte
// or of 4-byte accesses (kThreads threads).
enum class Form { kRegisters, kLoopVec4, kLoop };

template <Form kForm>
constexpr int kBlockThreads = kForm == Form::kRegisters ? kRegThreads : kThreads;  // at most

// The row in registers: thread t holds groups t, t + blockDim.x, ... of both
// inputs (num_groups = N / 4 <= kRegGroups blockDim.x).
__device__ __forceinline__ void row_in_registers(const float* __restrict__ out, const float* __restrict__ grad_out,
                                                 float* __restrict__ grad_v, size_t base, int N, double* red) {
  const float4* o4 = reinterpret_cast<const float4*>(out + base);
  const float4* g4 = reinterpret_cast<const float4*>(grad_out + base);
  const int num_groups = N / 4;
  float4 o[kRegGroups], g[kRegGroups];
#pragma unroll
  for (int r = 0; r < kRegGroups; ++r) {
    const int i = threadIdx.x + r * blockDim.x;
    if (i < num_groups) {
      o[r] = o4[i];
      g[r] = g4[i];
    }
  }
  double dot = 0.0;
#pragma unroll
  for (int r = 0; r < kRegGroups; ++r) {
    if (threadIdx.x + r * blockDim.x < num_groups) {
      dot += static_cast<double>(o[r].x) * g[r].x;
      dot += static_cast<double>(o[r].y) * g[r].y;
      dot += static_cast<double>(o[r].z) * g[r].z;
      dot += static_cast<double>(o[r].w) * g[r].w;
    }
  }
  const RowSum s = row_sum_of(block_sum(dot, red));
  float4* v4 = reinterpret_cast<float4*>(grad_v + base);
#pragma unroll
  for (int r = 0; r < kRegGroups; ++r) {
    const int i = threadIdx.x + r * blockDim.x;
    if (i < num_groups)
      v4[i] = make_float4(times_grad_minus_sum(o[r].x, g[r].x, s), times_grad_minus_sum(o[r].y, g[r].y, s),
                          times_grad_minus_sum(o[r].z, g[r].z, s), times_grad_minus_sum(o[r].w, g[r].w, s));
  }
}

// The row in a loop (kThreads threads), read twice: 16-byte accesses (kVec4) or 4-byte.
template <bool kVec4>
__device__ __forceinline__ void row_in_loop(const float* __restrict__ out, const float* __restrict__ grad_out,
                                            float* __restrict__ grad_v, size_t base, int N, double* red) {
  double dot = 0.0;
  if constexpr (kVec4) {
    const float4* o4 = reinterpret_cast<const float4*>(out + base);
    const float4* g4 = reinterpret_cast<const float4*>(grad_out + base);
    for (int i = threadIdx.x; i < N / 4; i += kThreads) {
      const float4 o = o4[i], g = g4[i];
      dot += static_cast<double>(o.x) * g.x;
      dot += static_cast<double>(o.y) * g.y;
      dot += static_cast<double>(o.z) * g.z;
      dot += static_cast<double>(o.w) * g.w;
    }
  } else {
    for (int i = threadIdx.x; i < N; i += kThreads) dot += static_cast<double>(out[base + i]) * grad_out[base + i];
  }
  const RowSum s = row_sum_of(block_sum(dot, red));
  if constexpr (kVec4) {
    const float4* o4 = reinterpret_cast<const float4*>(out + base);
    const float4* g4 = reinterpret_cast<const float4*>(grad_out + base);
    float4* v4 = reinterpret_cast<float4*>(grad_v + base);
    for (int i = threadIdx.x; i < N / 4; i += kThreads) {
      const float4 o = o4[i], g = g4[i];
      v4[i] = make_float4(times_grad_minus_sum(o.x, g.x, s), times_grad_minus_sum(o.y, g.y, s),
                          times_grad_minus_sum(o.z, g.z, s), times_grad_minus_sum(o.w, g.w, s));
    }
  } else {
    for (int i = threadIdx.x; i < N; i += kThreads)
      grad_v[base + i] = times_grad_minus_sum(out[base + i], grad_out[base + i], s);
  }
}

// One CTA per row (blockIdx.x), in the given form.
template <Form kForm>
__global__ void __launch_bounds__(kBlockThreads<kForm>)
    softmax_rows_backward_kernel(const float* __restrict__ out, const float* __restrict__ grad_out,
                                 float* __restrict__ grad_v, int N) {
  pdl_wait_then_release();
  __shared__ double red[kBlockThreads<kForm> / 32];
  const size_t base = static_cast<size_t>(blockIdx.x) * N;
  if constexpr (kForm == Form::kRegisters)
    row_in_registers(out, grad_out, grad_v, base, N, red);
  else
    row_in_loop<kForm == Form::kLoopVec4>(out, grad_out, grad_v, base, N, red);
}

}  // namespace softmax_backward
}  // namespace fused_gemm_bn

// ---------------------------------------------------------------------------
// Host launcher (declared in launchers.cuh)
// ---------------------------------------------------------------------------

cudaError_t fused_gemm_bn::softmax_rows_backward(const float* out, const float* grad_out, float* grad_v, int M, int N,
                                                 cudaStream_t stream) {
  using namespace softmax_backward;
  if (M < 0 || N < 0) return cudaErrorInvalidValue;
  if (M == 0 || N == 0) return cudaSuccess;
  const bool vec4 = N % 4 == 0 && (reinterpret_cast<uintptr_t>(out) | reinterpret_cast<uintptr_t>(grad_out) |
                                   reinterpret_cast<uintptr_t>(grad_v)) % 16 == 0;
  const int num_groups = N / 4;
  // Four groups per thread where the row allows (N = 8192: 512 threads), at least one warp.
  const int reg_threads = min(kRegThreads, max(32, (num_groups / kRegGroups + 31) / 32 * 32));
  if (vec4 && num_groups <= kRegGroups * reg_threads)
    return launch_kernel(softmax_rows_backward_kernel<Form::kRegisters>, M, reg_threads, 0, stream, out, grad_out,
                         grad_v, N);
  return launch_kernel(vec4 ? softmax_rows_backward_kernel<Form::kLoopVec4> : softmax_rows_backward_kernel<Form::kLoop>,
                       M, kThreads, 0, stream, out, grad_out, grad_v, N);
}
