// sm90_wgmma_16bit.cuh -- the 16-bit wgmma forms of the Hopper 16-bit GEMM
// (sm90_gemm_bn_16bit.cu): D(64 x N, fp32) += A(64 x 16) B(16 x N), N = 128
// or 256, T = __half or __nv_bfloat16 (fp16 / bf16 inputs, exact products,
// fp32 accumulation in the tensor core).  B is a K-major tile written by TMA
// with 128-byte swizzle, addressed by desc_kmajor_sw128 (../sm90_primitives.cuh);
// A is either such a tile too (the "SS" form) or four registers of T pairs per
// thread (the "RS" form: the kernel converted float32 w to T itself).
//
// A fragment of the RS form (PTX ISA 9.7.15.5.2, "wgmma .m64nNk16 A
// fragments", 16-bit types): warp w, lane 4 g + t holds a[0] = A(16 w + g,
// 2 t .. 2 t + 1), a[1] = A(16 w + g + 8, 2 t ..), a[2] = A(16 w + g, 2 t + 8 ..),
// a[3] = A(16 w + g + 8, 2 t + 8 ..), the lower k in the low half.
//
// Accumulator layout (PTX ISA 9.7.15.5.2, "wgmma .m64nNk16 D fragments"):
// warp w of the warpgroup, lane l = 4 g + t holds d[4 i + 2 h + e] = D(16 w +
// g + 8 h, 8 i + 2 t + e), i = 0 .. N / 8 - 1.
//
// Sources: PTX ISA 8.x section 9.7.15 (wgmma.mma_async: 9.7.15.5 register
// fragments and matrix descriptors).  Compiles to nothing off sm_90a, like
// every wrapper of sm90_primitives.cuh; the kernel traps there.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#include "sm90_primitives.cuh"

// The accumulator operands of one wgmma: "{%0, ..., %(R-1)}" and R "+f" constraints over d[];
// the 128-register forms extend the 64-register ones.
#define FGB_LOWP_D0_63 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, " \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, " \
  "%56, %57, %58, %59, %60, %61, %62, %63"
#define FGB_LOWP_D64_LIST "{" FGB_LOWP_D0_63 "}"
#define FGB_LOWP_D128_LIST \
  "{" FGB_LOWP_D0_63 ", " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, " \
  "%82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, " \
  "%100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, " \
  "%115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127" \
  "}"
#define FGB_LOWP_D64_CONS \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), \
  "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), \
  "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), \
  "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), \
  "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), \
  "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), \
  "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), \
  "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define FGB_LOWP_D128_CONS \
  FGB_LOWP_D64_CONS, \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), \
  "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), \
  "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), \
  "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), \
  "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), \
  "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), \
  "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), \
  "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
  "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), \
  "+f"(d[127])

namespace fused_gemm_bn {
namespace sm90 {

// scale-d = 1 (D accumulates: the caller zeroes D first), no negation, no
// transposition (both operands K-major).
// REGS accumulator registers; IA, IB, IP: the operand numbers of desc_a, desc_b and the scale-d flag.
#define FGB_LOWP_WGMMA_SS(SHAPE, TYPE, REGS, IA, IB, IP)                                          \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IP ", 0;\n"                                 \
               "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " " FGB_LOWP_D##REGS##_LIST \
               ", %" #IA ", %" #IB ", p, 1, 1, 0, 0;\n}\n"                                       \
               : FGB_LOWP_D##REGS##_CONS                                                          \
               : "l"(desc_a), "l"(desc_b), "n"(1))

template <typename T>
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
#if FUSED_GEMM_BN_SM90A
  if constexpr (std::is_same_v<T, __half>) {
    FGB_LOWP_WGMMA_SS("m64n128k16", "f16", 64, 64, 65, 66);
  } else {
    FGB_LOWP_WGMMA_SS("m64n128k16", "bf16", 64, 64, 65, 66);
  }
#endif
}

template <typename T>
__device__ __forceinline__ void wgmma_m64n256k16_ss(float (&d)[128], uint64_t desc_a, uint64_t desc_b) {
#if FUSED_GEMM_BN_SM90A
  if constexpr (std::is_same_v<T, __half>) {
    FGB_LOWP_WGMMA_SS("m64n256k16", "f16", 128, 128, 129, 130);
  } else {
    FGB_LOWP_WGMMA_SS("m64n256k16", "bf16", 128, 128, 129, 130);
  }
#endif
}

#undef FGB_LOWP_WGMMA_SS

// The RS form: A from the four registers a[] (IA .. IA + 3), B from shared memory (IB).
#define FGB_LOWP_WGMMA_RS(SHAPE, TYPE, REGS, IA0, IA1, IA2, IA3, IB, IP)                        \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IP ", 0;\n"                                 \
               "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " " FGB_LOWP_D##REGS##_LIST \
               ", {%" #IA0 ", %" #IA1 ", %" #IA2 ", %" #IA3 "}, %" #IB ", p, 1, 1, 0;\n}\n"           \
               : FGB_LOWP_D##REGS##_CONS                                                          \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1))

template <typename T>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b) {
#if FUSED_GEMM_BN_SM90A
  if constexpr (std::is_same_v<T, __half>) {
    FGB_LOWP_WGMMA_RS("m64n128k16", "f16", 64, 64, 65, 66, 67, 68, 69);
  } else {
    FGB_LOWP_WGMMA_RS("m64n128k16", "bf16", 64, 64, 65, 66, 67, 68, 69);
  }
#endif
}

template <typename T>
__device__ __forceinline__ void wgmma_m64n256k16_rs(float (&d)[128], const uint32_t (&a)[4], uint64_t desc_b) {
#if FUSED_GEMM_BN_SM90A
  if constexpr (std::is_same_v<T, __half>) {
    FGB_LOWP_WGMMA_RS("m64n256k16", "f16", 128, 128, 129, 130, 131, 132, 133);
  } else {
    FGB_LOWP_WGMMA_RS("m64n256k16", "bf16", 128, 128, 129, 130, 131, 132, 133);
  }
#endif
}

#undef FGB_LOWP_WGMMA_RS

}  // namespace sm90
}  // namespace fused_gemm_bn
