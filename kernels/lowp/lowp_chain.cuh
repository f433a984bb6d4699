// lowp_chain.cuh -- the per-element steps of the 16-bit chains after the Linear
// output z, shared by the kernels that run them: the Hopper GEMM's epilogue
// (sm90_gemm_bn_16bit.cu) and the chain kernels after a cuBLAS product
// (bn_16bit_chain.cu), so both round at the same points, bit for bit; the pair
// forms at the end serve the Hopper GEMM's epilogue.  Device helpers only.
//
// T: the 16-bit type of the product (z is a T value); S: the storage of the
// vectors and the output (T, or float under autocast: Storage in lowp_types.cuh).
// rnd_S = Storage<S>::round (none for float), rnd_T = round16<T>.  Problem 33:
// Linear -> scale -> BatchNorm1d; 84: Linear -> BatchNorm1d -> scale (scale_after_bn).
//   train_u: the BatchNorm input u.  33: rnd_S(z scale);  84: z.
//   eval_out: the eval chain's output (before 84's softmax), w, b, rm = BatchNorm's
//     weight, bias, running_mean, invstd = rsqrtf(running_var + eps):
//     33: fma(w (rnd_S(z scale) - rm), invstd, b)       (the store rounds to S)
//     84: rnd_T(fma(w (z - rm), invstd, b)) scale       (BatchNorm's output is T under autocast)
// These are PyTorch's eager ops on the same values: the multiply, then
// batch_norm's elementwise `w * (x - mean) * invstd + b` with its fma.
#pragma once

#include "lowp_types.cuh"

namespace fused_gemm_bn {
namespace lowp {

template <typename S>
__device__ __forceinline__ float train_u(float z, float scale, bool scale_after_bn) {
  return scale_after_bn ? z : Storage<S>::round(z * scale);
}

template <typename T, typename S>
__device__ __forceinline__ float eval_out(float z, float scale, float w, float b, float rm, float invstd,
                                          bool scale_after_bn) {
  if (!scale_after_bn) return fmaf(w * (Storage<S>::round(z * scale) - rm), invstd, b);
  return round16<T>(fmaf(w * (z - rm), invstd, b)) * scale;
}

// Pair forms, for two values of one feature (the same vectors) held as one packed
// pair of T patterns z2 (pack2_rn's layout), with the problem's order fixed at
// compile time (kScaleAfterBn: 84): the scalar forms' values, bit for bit, in
// fewer instructions.  A pair is rounded by one packed conversion (pack2_rn) and
// widened exactly (unpack2).  Where S is float16, rnd_S(z scale) is one
// mul.rn.f16x2 of the two float16 values: their float32 product is exact (11 + 11
// significand bits, and float32's exponent range holds every such product), so its
// one rounding to float16 is the rounding of the exact product, which mul.rn.f16x2
// computes.  (Not so for bfloat16: a product of two bfloat16 values below 2^-126
// is rounded once in float32 first, as eager's float32 arithmetic does.)
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t bits) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half22float2(*reinterpret_cast<const __half2*>(&bits));
  } else {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
  }
}

// rnd_S of both values (S float: none).
template <typename S>
__device__ __forceinline__ float2 round2(float lo, float hi) {
  if constexpr (std::is_same_v<S, float>) {
    return make_float2(lo, hi);
  } else {
    return unpack2<S>(pack2_rn<S>(lo, hi));
  }
}

// rnd_S(z scale) for both values of z2.
template <typename T, typename S>
__device__ __forceinline__ float2 scaled2(uint32_t z2, float scale) {
  if constexpr (std::is_same_v<S, __half>) {
    const uint32_t s2 = pack2_rn<__half>(scale, scale);  // exact: scale is a float16 value
    uint32_t r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(z2), "r"(s2));
    return unpack2<__half>(r);
  } else {
    const float2 z = unpack2<T>(z2);
    return round2<S>(z.x * scale, z.y * scale);
  }
}

template <typename T, typename S, bool kScaleAfterBn>
__device__ __forceinline__ float2 train_u2(uint32_t z2, float scale) {
  if constexpr (kScaleAfterBn) {
    return unpack2<T>(z2);
  } else {
    return scaled2<T, S>(z2, scale);
  }
}

template <typename T, typename S, bool kScaleAfterBn>
__device__ __forceinline__ float2 eval_out2(uint32_t z2, float scale, float w, float b, float rm, float invstd) {
  if constexpr (!kScaleAfterBn) {
    const float2 u = scaled2<T, S>(z2, scale);
    return make_float2(fmaf(w * (u.x - rm), invstd, b), fmaf(w * (u.y - rm), invstd, b));
  } else {
    const float2 z = unpack2<T>(z2);
    const uint32_t y2 = pack2_rn<T>(fmaf(w * (z.x - rm), invstd, b), fmaf(w * (z.y - rm), invstd, b));
    if constexpr (std::is_same_v<S, __half>) {
      return scaled2<T, S>(y2, scale);  // rnd_S(y scale): the store's rounding of y scale, done here
    } else {
      const float2 y = unpack2<T>(y2);
      return make_float2(y.x * scale, y.y * scale);
    }
  }
}

}  // namespace lowp
}  // namespace fused_gemm_bn
