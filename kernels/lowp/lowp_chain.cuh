// lowp_chain.cuh -- the per-element steps of the 16-bit chains after the Linear
// output z, shared by the kernels that run them: the Hopper GEMM's epilogue
// (sm90_gemm_bn_16bit.cu) and the chain kernels after a cuBLAS product
// (bn_16bit_chain.cu), so both round at the same points, bit for bit.
// Device helpers only.
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

}  // namespace lowp
}  // namespace fused_gemm_bn
