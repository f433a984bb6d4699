// row_divisor.cuh -- a softmax row's division by its sum, shared by the float32
// row softmax (bn_softmax.cu) and the 16-bit ones (lowp/bn_16bit.cu).
//
// a / b as IEEE division rounds it (div.rn.f32), for many a over one b >= 1 (a
// softmax row's sum of exp(v - max v), whose largest term is 1): from the rounded
// reciprocal r = 1 / b, q = a r and one correction by the exact remainder
// fma(-q, b, a) (Markstein's final step, IBM J. Res. Dev. 34(1), 1990; Muller et
// al., Handbook of Floating-Point Arithmetic, ch. on division: correctly rounded
// when q is within an ulp of a / b and nothing underflows; the compiler's own
// div.rn fast path is this step after a refined reciprocal).  Three instructions
// an element instead of the division's ~8 and its range check.  a / b below
// 2^-126 (a softmax output of a logit 87 under the row's max) may differ in its
// last subnormal bit.  A NaN b gives NaN, as the division.
#pragma once

namespace fused_gemm_bn {

struct RowDivisor {
  float b, r;
  __device__ __forceinline__ explicit RowDivisor(float b_) : b(b_), r(1.0f / b_) {}
  __device__ __forceinline__ float operator()(float a) const {
    const float q = a * r;
    return fmaf(fmaf(-q, b, a), r, q);
  }
};

}  // namespace fused_gemm_bn
