// prepass_3xtf32.cu -- the one pre-pass kernel before each 3xTF32 GEMM
// (sm80_gemm_3xtf32_bn.cu).  Each launch does two jobs, so that a forward pays
// one small launch for them:
//   1. split x into its TF32 parts (below; the GEMM then reads them);
//   2. training only: bn.num_batches_tracked += 1 (thread 0 of block 0), which is
//      nn.BatchNorm1d's first step; the call's later kernels (bn_apply.cu,
//      bn_softmax.cu) read the new value by stream order;
//   3. zero_ints[0 .. num_zero_ints) = 0 (block 0): the GEMM's split-K arrival
//      counts (sm80_gemm_3xtf32_bn.cuh, "Split K").
// The launcher takes num_batches_tracked (null: not a training call) by that
// name, so every call site shows the side effect.
//
// sm80_prepass_3xtf32: x split into TF32 big and small parts, written in the
// mma.m16n8k8 A-fragment order that the GEMM reads.
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
                      float* __restrict__ big, float* __restrict__ small, int64_t* num_batches_tracked,
                      int* zero_ints, int num_zero_ints) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if (num_batches_tracked != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *num_batches_tracked += 1;
  if (blockIdx.x == 0)
    for (int j = threadIdx.x; j < num_zero_ints; j += blockDim.x) zero_ints[j] = 0;
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
                                               int64_t* num_batches_tracked, int* zero_ints, int num_zero_ints,
                                               cudaStream_t stream) {
  if (num_zero_ints < 0 || (num_zero_ints > 0 && zero_ints == nullptr)) return cudaErrorInvalidValue;
  const int num_slabs = (K + kFragSlabK - 1) / kFragSlabK;
  const int64_t num_quads = sm80_prepass_elems(M, K) / 4;
  int64_t blocks = (num_quads + kSplitThreads - 1) / kSplitThreads;
  if (blocks == 0 && num_batches_tracked == nullptr && num_zero_ints == 0) return cudaSuccess;
  if (blocks == 0) blocks = 1;  // still counts the call / zeroes the counts
  if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  sm80_prepass_3xtf32_kernel<<<static_cast<unsigned>(blocks), kSplitThreads, 0, stream>>>(
      x, row_stride, col_stride, M, K, num_slabs, num_quads, center, x_big, x_small, num_batches_tracked, zero_ints,
      num_zero_ints);
  return cudaGetLastError();
}
