// prepass_3xtf32.cu -- the one pre-pass kernel before each 3xTF32 GEMM.  Each
// launch does three jobs, so that a forward pays one small launch for them:
//   1. split x into its TF32 parts (below; the GEMM then reads them);
//   2. training only: bn.num_batches_tracked += 1 (thread 0 of block 0), which is
//      nn.BatchNorm1d's first step; the call's later kernels (bn_apply.cu,
//      bn_softmax.cu, the cluster GEMM) read the new value by stream order;
//   3. sm90 only: zero the Hopper GEMM's split-tile arrival counts.
// The launchers take num_batches_tracked (null: not a training call) and the
// ints to zero by those names, so every call site shows the side effects.
//
// sm80_prepass_3xtf32 (portable GEMM and the sm_90 cluster GEMM): x split into
// TF32 big and small parts, written in the mma.m16n8k8 A-fragment order that
// the GEMM reads.
//
//   v     = x, or rn(x - c_m) when center is given (the forwards: the centred
//           split, centring.cuh; c_m from row_centers in centring.cu)
//   big   = cvt.rna.tf32(v)          (round to nearest, ties away)
//   small = cvt.rna.tf32(v - big)    (the difference is exact in fp32)
//
// x: (M, K) float32 with arbitrary element strides (row_stride, col_stride), so a
// non-contiguous caller tensor is read in place and never copied or written.
//
// Output layout (big and small alike), "fragment-native":
//   [M_pad / 16][K_pad / 32][4 k-steps][32 lanes][4 registers], float32,
//   M_pad = round_up(M, 16), K_pad = round_up(K, 32), zero outside (M, K).
// Block (mb, slab) holds rows 16 mb .. +15 and columns 32 slab .. +31.  Lane
// l = 4 g + t, k-step s, register r holds
//   r = 0: x[16 mb + g,     32 slab + 8 t + 2 s]      (mma a0: row g,   k t)
//   r = 1: x[16 mb + g + 8, 32 slab + 8 t + 2 s]      (mma a1: row g+8, k t)
//   r = 2: x[16 mb + g,     32 slab + 8 t + 2 s + 1]  (mma a2: row g,   k t+4)
//   r = 3: x[16 mb + g + 8, 32 slab + 8 t + 2 s + 1]  (mma a3: row g+8, k t+4)
// i.e. mma k-step s of the slab sees logical column kl at physical column
// 8 (kl % 4) + 2 s + kl / 4, the permutation the GEMM applies to w (see
// sm80_gemm_3xtf32_bn.cuh).  One 16-byte shared load is then one A operand.
// Memory-bound: reads M*K floats, writes 2*M_pad*K_pad.
//
// sm90_prepass_3xtf32 (Hopper GEMM): x's remainder, and x_centred = rn(x - c_m)
// itself when centring (below, at its kernel).

#include <cuda_runtime.h>
#include <stdint.h>

#include "launchers.cuh"

namespace fused_gemm_bn {

constexpr int kSplitThreads = 256;
constexpr int kFragRows = 16;   // rows of one fragment block (MMA_M)
constexpr int kFragSlabK = 32;  // columns of one fragment block (the GEMM's BLOCK_K)

__device__ __forceinline__ void split_rna_tf32(float v, float& big, float& small) {
  uint32_t b, s;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(b) : "f"(v));
  big = __uint_as_float(b);
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(s) : "f"(v - big));
  small = __uint_as_float(s);
}

// One thread per output float4 (one lane's registers for one k-step).
__global__ void __launch_bounds__(kSplitThreads)
    sm80_prepass_3xtf32_kernel(const float* __restrict__ x, int64_t row_stride, int64_t col_stride, int M, int K,
                      int num_slabs, int64_t num_quads, const float* __restrict__ center,
                      float* __restrict__ big, float* __restrict__ small, int64_t* num_batches_tracked) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if (num_batches_tracked != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *num_batches_tracked += 1;
  const int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (q >= num_quads) return;
  const int lane = static_cast<int>(q % 32);
  const int step = static_cast<int>((q / 32) % 4);
  const int64_t block = q / 128;
  const int slab = static_cast<int>(block % num_slabs);
  const int mb = static_cast<int>(block / num_slabs);
  const int g = lane / 4, t = lane % 4;
  const int row0 = mb * kFragRows + g;
  const int col0 = slab * kFragSlabK + 8 * t + 2 * step;
  const int rows[4] = {row0, row0 + 8, row0, row0 + 8};
  const int cols[4] = {col0, col0, col0 + 1, col0 + 1};
  float b[4], s[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    float v = 0.f;
    if (rows[r] < M && cols[r] < K) {
      v = x[rows[r] * row_stride + cols[r] * col_stride];
      if (center != nullptr) v -= center[rows[r]];
    }
    split_rna_tf32(v, b[r], s[r]);
  }
  reinterpret_cast<float4*>(big)[q] = make_float4(b[0], b[1], b[2], b[3]);
  reinterpret_cast<float4*>(small)[q] = make_float4(s[0], s[1], s[2], s[3]);
#endif
}

__device__ __forceinline__ float remainder_rna_tf32(float v) {
  const float r = v - __uint_as_float(__float_as_uint(v) & 0xffffe000u);
  uint32_t b = __float_as_uint(r);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(b) : "f"(r));
#endif
  return __uint_as_float(b);
}

// Hopper path (sm90_gemm_3xtf32_bn.cu): the tensor core reads x itself as the
// truncated big part, so only the remainder is materialised:
//   x_small = rna_tf32(x - tf32_trunc(x))   (the difference is exact in fp32;
//   tf32_trunc clears the low 13 bits; rounding it to TF32 here instead of
//   letting the tensor core truncate it halves that part's error, <= 2^-22 |x|)
// x and x_small: (M, K) float32, contiguous, same layout.  n4 = M*K/4 float4s
// (the caller guarantees 16-byte alignment and K % 4 == 0).
__device__ __forceinline__ float4 remainder_rna_tf32(float4 v) {
  return make_float4(remainder_rna_tf32(v.x), remainder_rna_tf32(v.y), remainder_rna_tf32(v.z),
                     remainder_rna_tf32(v.w));
}

// Two float4 per thread and iteration, both loads issued first: twice the
// bytes in flight of one (the kernel is bound by HBM bandwidth).  kCentred:
// the parts are those of v = rn(x - c_m), and v itself is written to
// x_centred (the GEMM's TMA reads it in place of x); k4 = K / 4.
template <bool kCentred>
__global__ void __launch_bounds__(kSplitThreads)
    sm90_prepass_3xtf32_kernel(const float4* __restrict__ x, const float* __restrict__ center, int64_t k4,
                               float4* __restrict__ x_centred, float4* __restrict__ x_small, int64_t n4,
                               int64_t* num_batches_tracked, int* zero_ints, int num_zero_ints) {
  if (num_batches_tracked != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *num_batches_tracked += 1;
  if (blockIdx.x == 0)
    for (int j = threadIdx.x; j < num_zero_ints; j += blockDim.x) zero_ints[j] = 0;
  auto split = [&](int64_t i, float4 v) {
    if constexpr (kCentred) {
      const float c = center[i / k4];
      v = make_float4(v.x - c, v.y - c, v.z - c, v.w - c);
      x_centred[i] = v;
    }
    x_small[i] = remainder_rna_tf32(v);
  };
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + stride < n4; i += 2 * stride) {
    const float4 v0 = x[i];
    const float4 v1 = x[i + stride];
    split(i, v0);
    split(i + stride, v1);
  }
  if (i < n4) split(i, x[i]);
}

}  // namespace fused_gemm_bn

// ---------------------------------------------------------------------------
// Host launchers (declared in launchers.cuh)
// ---------------------------------------------------------------------------

int64_t fused_gemm_bn::sm80_prepass_elems(int M, int K) {
  const int64_t m_pad = (static_cast<int64_t>(M) + kFragRows - 1) / kFragRows * kFragRows;
  const int64_t k_pad = (static_cast<int64_t>(K) + kFragSlabK - 1) / kFragSlabK * kFragSlabK;
  return m_pad * k_pad;
}

cudaError_t fused_gemm_bn::sm80_prepass_3xtf32(const float* x, int64_t row_stride, int64_t col_stride, int M, int K,
                                               const float* center, float* x_big, float* x_small,
                                               int64_t* num_batches_tracked, cudaStream_t stream) {
  const int num_slabs = (K + kFragSlabK - 1) / kFragSlabK;
  const int64_t num_quads = sm80_prepass_elems(M, K) / 4;
  int64_t blocks = (num_quads + kSplitThreads - 1) / kSplitThreads;
  if (blocks == 0 && num_batches_tracked == nullptr) return cudaSuccess;
  if (blocks == 0) blocks = 1;  // still counts the call
  if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  sm80_prepass_3xtf32_kernel<<<static_cast<unsigned>(blocks), kSplitThreads, 0, stream>>>(
      x, row_stride, col_stride, M, K, num_slabs, num_quads, center, x_big, x_small, num_batches_tracked);
  return cudaGetLastError();
}

// Preconditions: x, x_centred and x_small contiguous and 16-byte aligned,
// K % 4 == 0; x_centred given exactly when center is.
cudaError_t fused_gemm_bn::sm90_prepass_3xtf32(const float* x, int M, int K, const float* center, float* x_centred,
                                               float* x_small, int* zero_ints, int num_zero_ints,
                                               int64_t* num_batches_tracked, cudaStream_t stream) {
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (K % 4 != 0 || !aligned(x) || !aligned(x_small) || (center == nullptr) != (x_centred == nullptr) ||
      !aligned(x_centred))
    return cudaErrorInvalidValue;
  const int64_t n4 = static_cast<int64_t>(M) * K / 4;
  if (n4 == 0 && num_batches_tracked == nullptr && num_zero_ints == 0) return cudaSuccess;
  int device = 0, num_sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  const int64_t wanted = (n4 + kSplitThreads - 1) / kSplitThreads;
  const int blocks = static_cast<int>(wanted < 1 ? 1 : wanted < 8LL * num_sms ? wanted : 8LL * num_sms);
  auto x4 = reinterpret_cast<const float4*>(x);
  auto small4 = reinterpret_cast<float4*>(x_small);
  if (center != nullptr)
    sm90_prepass_3xtf32_kernel<true><<<blocks, kSplitThreads, 0, stream>>>(
        x4, center, K / 4, reinterpret_cast<float4*>(x_centred), small4, n4, num_batches_tracked, zero_ints,
        num_zero_ints);
  else
    sm90_prepass_3xtf32_kernel<false><<<blocks, kSplitThreads, 0, stream>>>(
        x4, nullptr, K / 4, nullptr, small4, n4, num_batches_tracked, zero_ints, num_zero_ints);
  return cudaGetLastError();
}
