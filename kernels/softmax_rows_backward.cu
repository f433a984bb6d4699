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
// One CTA of kThreads per row.  Any M >= 0, N >= 0.
//
// Numerics: each product grad_out * out is exact in float64 and s_m is summed
// in float64 (per thread, then a warp and CTA tree), then rounded to float32
// once; grad_v is then one float32 subtraction and one multiply, each rounded
// to nearest, as torch's (whose s_m is a float32 tree sum).  NaN or Inf in a
// row propagates through s_m to the whole row, as torch's.

#include <cuda_runtime.h>
#include <stdint.h>

#include "launchers.cuh"

namespace fused_gemm_bn {
namespace softmax_backward {

constexpr int kThreads = 256;

// Sum over the CTA, returned to every thread.
__device__ __forceinline__ double block_sum(double v, double* red) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  double total = 0.0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) total += red[w];
  return total;
}

template <bool kVec4>
__global__ void __launch_bounds__(kThreads) softmax_rows_backward_kernel(const float* __restrict__ out,
                                                                         const float* __restrict__ grad_out,
                                                                         float* __restrict__ grad_v, int N) {
  __shared__ double red[kThreads / 32];
  const size_t base = static_cast<size_t>(blockIdx.x) * N;
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
  const float s = static_cast<float>(block_sum(dot, red));
  if constexpr (kVec4) {
    const float4* o4 = reinterpret_cast<const float4*>(out + base);
    const float4* g4 = reinterpret_cast<const float4*>(grad_out + base);
    float4* v4 = reinterpret_cast<float4*>(grad_v + base);
    for (int i = threadIdx.x; i < N / 4; i += kThreads) {
      const float4 o = o4[i], g = g4[i];
      v4[i] = make_float4(o.x * (g.x - s), o.y * (g.y - s), o.z * (g.z - s), o.w * (g.w - s));
    }
  } else {
    for (int i = threadIdx.x; i < N; i += kThreads) grad_v[base + i] = out[base + i] * (grad_out[base + i] - s);
  }
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
  if (vec4) {
    softmax_rows_backward_kernel<true><<<M, kThreads, 0, stream>>>(out, grad_out, grad_v, N);
  } else {
    softmax_rows_backward_kernel<false><<<M, kThreads, 0, stream>>>(out, grad_out, grad_v, N);
  }
  return cudaGetLastError();
}
