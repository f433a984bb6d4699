// dmma_f64.cuh -- float64 tensor-core products (mma.sync .f64, sm_80+), shared by
// small_m_fp64.cu (the small batches' forward: W rows x batch rows) and
// small_m_grad_w.cu (their weight gradient: b columns x a columns).
//
// dmma_m8n8k4(d0, d1, a, b): D (8 x 8) += A (8 x 4) B (4 x 8), one mma.m8n8k4 .f64.
// dmma_chunk_16x8(d, alo, ahi, b): D (16 x 8) += A (16 x 16) B (16 x 8): on sm_90 one
//   mma.m16n8k16 .f64 (the FP64 tensor peak, 128 FMA / clk / SM on an H200), elsewhere
//   the same product as 8 mma.m8n8k4 (half that rate on an H200; the only form sm_80 has).
//   Both forms permute the k index the same way, so the caller loads one layout.
//
// Numerics: every product of two doubles is formed and accumulated in float64 (IEEE
// binary64 products and sums inside the tensor core); with float32 inputs converted
// exactly, each product is exact and only the additions round.
// Source: PTX ISA, "Warp-level matrix multiply-accumulate instructions", mma.m8n8k4 and
// mma.m16n8k16 with .f64 (matrix fragments for .f64).
#pragma once

#include <cuda_runtime.h>

namespace fused_gemm_bn {

// D = A B + D, A 8x4 (row), B 4x8 (col), float64 (PTX ISA mma.m8n8k4 .f64):
// lane = 4 g + t holds a = A[g][t], b = B[t][g], d = D[g][2t], D[g][2t + 1].
__device__ __forceinline__ void dmma_m8n8k4(double& d0, double& d1, double a, double b) {
  asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%0, %1};"
      : "+d"(d0), "+d"(d1)
      : "d"(a), "d"(b));
}

// D (16 x 8) += A (16 x 16) B (16 x 8), float64.  Lane (g, t) = (lane / 4, lane % 4)
// passes alo[i] = A[g][4t + i], ahi[i] = A[g + 8][4t + i] and b[i] = B[4t + i][g]
// (i = 0 .. 3), already converted, and holds d[v0 + 2 v1] = D[g + 8 v1][2t + v0].
// sm_90: one mma.m16n8k16 .f64, whose fragment k index t + 4i is taken as column 4t + i
// (A: a[v0 + 2 v1] = A[g + 8 v0][t + 4 v1]; B: b[i] = B[t + 4i][g]); elsewhere 8
// mma.m8n8k4 .f64, step i over the columns 4t + i.  The k order differs between the two.
__device__ __forceinline__ void dmma_chunk_16x8(double (&d)[4], const double (&alo)[4], const double (&ahi)[4],
                                                const double (&b)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm("mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7, %8, %9, %10, %11}, {%12, %13, %14, %15}, {%0, %1, %2, %3};"
      : "+d"(d[0]), "+d"(d[1]), "+d"(d[2]), "+d"(d[3])
      : "d"(alo[0]), "d"(ahi[0]), "d"(alo[1]), "d"(ahi[1]), "d"(alo[2]), "d"(ahi[2]), "d"(alo[3]), "d"(ahi[3]),
        "d"(b[0]), "d"(b[1]), "d"(b[2]), "d"(b[3]));
#else
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    dmma_m8n8k4(d[0], d[1], alo[i], b[i]);
    dmma_m8n8k4(d[2], d[3], ahi[i], b[i]);
  }
#endif
}

}  // namespace fused_gemm_bn
