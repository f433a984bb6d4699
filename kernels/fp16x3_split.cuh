// fp16x3_split.cuh -- the operand split of the fp16x3 GEMM (sm90_gemm_fp16x3_bn.cu,
// prepass_fp16x3.cu): an fp32 value as the sum of two IEEE binary16 ("fp16")
// parts after an exact power-of-two scaling.  Device functions only; fp16 values
// travel as raw 16-bit words (two per uint32_t, the lower-addressed element in
// the low half), converted by PTX cvt (PTX ISA 9.7.9.21).
//
// Numerics (Ootomo & Yokota, "Recovering single precision accuracy from Tensor
// Cores while surpassing the FP32 theoretical peak performance", IJHPCA 2022;
// their fix for fp16's narrow range is a scaled small part, ours a power-of-two
// scale of the whole row or block, as DeepGEMM scales FP8 blocks):
//   s = 2^(14 - floor(log2(amax))), amax = max |v| over the row (or block), so
//     |v s| < 2^15 <= 65504 (fp16's largest finite value);  s is clamped to
//     [2^-126, 2^126] so that s and 1 / s are normal fp32 (rows with amax below
//     2^-112 are then scaled less than their maximum allows; amax = 0 gives s = 2^126).
//   hi = rn_fp16(v s);  lo = rn_fp16(v s - hi)   (v s - hi is exact in fp32).
//   |v s - hi| <= 2^-11 |v s| and |v s - (hi + lo)| <= 2^-11 |v s - hi| <= 2^-22 |v s|
//     while lo is a normal fp16 (|v s| >= 2^-3, i.e. v within 2^17 of amax);
//     below that lo is subnormal and the absolute error is <= 2^-25 = 2^-39 amax s.
//   Non-finite v: Inf gives hi = Inf, lo = NaN, so every product with it is NaN;
//     NaN stays NaN (amax ignores NaN: fmaxf).
//   v = (hi + lo) / s to 22 bits; a GEMM sums hi_a hi_b + hi_a lo_b + lo_a hi_b
//     (lo_a lo_b, < 2^-22 |ab|, dropped) and divides by s_a s_b (exact).

#pragma once

#include <stdint.h>

namespace fused_gemm_bn {

// Two fp32 values rounded to nearest-even fp16, packed: `even` in the low half.
__device__ __forceinline__ uint32_t pack_rn_fp16x2(float even, float odd) {
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(odd), "f"(even));
  return r;
}

// The two fp16 words of r as fp32 (exact): .x the low half.
__device__ __forceinline__ float2 unpack_fp16x2(uint32_t r) {
  float2 v;
  asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %2;\ncvt.f32.f16 %0, lo;\ncvt.f32.f16 %1, hi;\n}\n"
      : "=f"(v.x), "=f"(v.y)
      : "r"(r));
  return v;
}

// The power-of-two scale s of a row (or block) with max |v| = amax, and 1 / s
// (header: s = 2^(14 - floor(log2 amax)) clamped to [2^-126, 2^126]).
// Bit arithmetic on amax's exponent: s = 2^(141 - e) for biased exponent e.
__device__ __forceinline__ void fp16x3_scale(float amax, float& s, float& inv_s) {
  const int e = (__float_as_int(amax) >> 23) & 0xff;  // 0 for zero and subnormals, 255 for Inf
  const int es = min(max(268 - e, 1), 253);           // biased exponent of s
  s = __int_as_float(es << 23);
  inv_s = __int_as_float((254 - es) << 23);
}

// (even, odd), already scaled, as packed fp16 hi and lo parts.
__device__ __forceinline__ void split_fp16x2(float even, float odd, uint32_t& hi, uint32_t& lo) {
  hi = pack_rn_fp16x2(even, odd);
  const float2 h = unpack_fp16x2(hi);
  lo = pack_rn_fp16x2(even - h.x, odd - h.y);
}

}  // namespace fused_gemm_bn
