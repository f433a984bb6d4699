// split_tf32.cu -- pre-pass: split x into TF32 big and small parts once per forward.
//
//   big[m, k]   = cvt.rna.tf32(x[m, k])                 (round to nearest, ties away)
//   small[m, k] = cvt.rna.tf32(x[m, k] - big[m, k])     (the difference is exact in fp32)
//   for k < K; columns K <= k < K_pad are written as 0.
//
// x: (M, K) float32 with arbitrary element strides (row_stride, col_stride), so a
// non-contiguous caller tensor is read in place and never copied or written.
// big, small: (M, K_pad) float32, row-major, contiguous, K_pad = round_up(K, 4):
// every row starts 16-byte aligned, which the GEMM's cp.async loads need.
// Memory-bound: reads M*K floats, writes 2*M*K_pad.  The GEMM (sm80_gemm_3xtf32_bn.cu)
// then needs no split arithmetic for its x operand.

#include <cuda_runtime.h>
#include <stdint.h>

namespace fused_gemm_bn {

constexpr int kSplitThreads = 256;

__device__ __forceinline__ void split_rna_tf32(float v, float& big, float& small) {
  uint32_t b, s;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(b) : "f"(v));
  big = __uint_as_float(b);
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(s) : "f"(v - big));
  small = __uint_as_float(s);
}

// One thread per 4 consecutive output columns of one row.
__global__ void __launch_bounds__(kSplitThreads)
    split_tf32_kernel(const float* __restrict__ x, int64_t row_stride, int64_t col_stride, int M, int K,
                      int K_pad, float* __restrict__ big, float* __restrict__ small) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const int quads_per_row = K_pad / 4;
  const int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (q >= static_cast<int64_t>(M) * quads_per_row) return;
  const int m = static_cast<int>(q / quads_per_row);
  const int k0 = static_cast<int>(q % quads_per_row) * 4;
  const float* row = x + m * row_stride;
  float v[4];
  const bool vec = col_stride == 1 && k0 + 4 <= K && (reinterpret_cast<uintptr_t>(row + k0) % 16 == 0);
  if (vec) {
    const float4 f = *reinterpret_cast<const float4*>(row + k0);
    v[0] = f.x; v[1] = f.y; v[2] = f.z; v[3] = f.w;
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = k0 + i < K ? row[(k0 + i) * col_stride] : 0.f;
  }
  float b[4], s[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) split_rna_tf32(v[i], b[i], s[i]);
  const size_t o = static_cast<size_t>(m) * K_pad + k0;
  *reinterpret_cast<float4*>(big + o) = make_float4(b[0], b[1], b[2], b[3]);
  *reinterpret_cast<float4*>(small + o) = make_float4(s[0], s[1], s[2], s[3]);
#endif
}

}  // namespace fused_gemm_bn

cudaError_t split_tf32(const float* x, int64_t row_stride, int64_t col_stride, int M, int K, int K_pad,
                       float* big, float* small, cudaStream_t stream) {
  using namespace fused_gemm_bn;
  if (K_pad % 4 != 0 || K_pad < K) return cudaErrorInvalidValue;
  const int64_t quads = static_cast<int64_t>(M) * (K_pad / 4);
  const int64_t blocks = (quads + kSplitThreads - 1) / kSplitThreads;
  if (blocks == 0) return cudaSuccess;
  if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  split_tf32_kernel<<<static_cast<unsigned>(blocks), kSplitThreads, 0, stream>>>(x, row_stride, col_stride, M, K,
                                                                                K_pad, big, small);
  return cudaGetLastError();
}
