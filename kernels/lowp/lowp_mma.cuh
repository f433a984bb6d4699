// lowp_mma.cuh -- the warp-level 16-bit tensor-core product the mma.sync kernels of
// kernels/lowp/ issue (sm80_gemm_bn_16bit.cu, small_m_16bit.cu): one
// mma.sync.aligned.m16n8k16.row.col with float32 accumulators, in T = __half or
// __nv_bfloat16 (sm_80+; callers compile it under __CUDA_ARCH__ >= 800 or for
// sm_80+ only).
//
// mma16816<T>(d, a, b0, b1): d += A B, A 16 x 16 (rows x k), B 16 x 8 (k x columns),
// exact products, float32 accumulation.  Fragments (PTX ISA, "Warp Level Matrix
// Multiply-Accumulate Instructions", "Matrix Fragments for mma.m16n8k16 with
// floating point type"), lane = 4 g + t: a[0..3] = A rows g, g + 8, g, g + 8 at
// k 2t, 2t + 1 (a[0], a[1]) and 2t + 8, 2t + 9 (a[2], a[3]), two values per
// register, the lower k in the low half; b0, b1 = B column g at k 2t, 2t + 1 and
// 2t + 8, 2t + 9; d[0..3] = C rows g (d[0], d[1]) and g + 8 (d[2], d[3]) at
// columns 2t, 2t + 1.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace fused_gemm_bn {
namespace lowp {

template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                        uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace lowp
}  // namespace fused_gemm_bn
