// lowp_coeff.cuh -- the 16-bit paths' batch coefficients coeff: (4, N) float32,
// row-major, one row per quantity: coeff[0][j] = mean, [1][j] = invstd =
// rsqrtf(var + eps), [2][j] = f(bn_weight), [3][j] = f(bn_bias) of feature j
// (written by bn16_fold_train / bn16_strip_train; read by bn16_apply, the row
// softmax and bn16_backward_kernel).  Rows rather than a float4 per feature: a
// warp's 16-byte loads of 8 consecutive features then cover whole 32-byte sectors
// of one row (a float4 per feature put each thread's 8 loads in 8 lines of their
// own: 32 L1 wavefronts per warp load, the row softmax's bottleneck, docs/perf.md v33).
// Also one feature's training coefficients from its batch statistics, with the
// running-statistics update (train_coeff: bn16_fold_train and bn16_strip_train, so
// both round alike), and BatchNorm's affine step from them (bn_affine: also the
// forward's BatchNorm output the backward recomputes, bn_16bit_backward.cu).
// Device helpers only; {x, y, z, w} of the float4s below = {mean, invstd, w, b}.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "lowp_types.cuh"

namespace fused_gemm_bn {
namespace lowp {

__device__ __forceinline__ float4 coeff_load1(const float* coeff, int N, int j) {
  return make_float4(coeff[j], coeff[N + j], coeff[2 * static_cast<size_t>(N) + j],
                     coeff[3 * static_cast<size_t>(N) + j]);
}

__device__ __forceinline__ void coeff_store1(float* coeff, int N, int j, const float4& c) {
  coeff[j] = c.x;
  coeff[N + j] = c.y;
  coeff[2 * static_cast<size_t>(N) + j] = c.z;
  coeff[3 * static_cast<size_t>(N) + j] = c.w;
}

// Features j0 .. j0 + 7; j0 % 8 == 0, N % 8 == 0 and coeff 16-byte aligned: two
// 16-byte accesses per row.
__device__ __forceinline__ void coeff_load8(const float* coeff, int N, int j0, float4 (&c)[8]) {
  float v[4][8];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float4* p = reinterpret_cast<const float4*>(coeff + q * static_cast<size_t>(N) + j0);
    const float4 a = p[0], b = p[1];
    v[q][0] = a.x, v[q][1] = a.y, v[q][2] = a.z, v[q][3] = a.w;
    v[q][4] = b.x, v[q][5] = b.y, v[q][6] = b.z, v[q][7] = b.w;
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) c[e] = make_float4(v[0][e], v[1][e], v[2][e], v[3][e]);
}

__device__ __forceinline__ void coeff_store8(float* coeff, int N, int j0, const float4 (&c)[8]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = q == 0 ? c[e].x : q == 1 ? c[e].y : q == 2 ? c[e].z : c[e].w;
    float4* p = reinterpret_cast<float4*>(coeff + q * static_cast<size_t>(N) + j0);
    p[0] = make_float4(v[0], v[1], v[2], v[3]);
    p[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
}

// The running statistics' factor: momentum, or for momentum < 0 (momentum=None)
// float32(1 / num_batches_tracked), the count after this call's increment.
__device__ __forceinline__ float running_factor(float momentum, const int64_t* num_batches_tracked) {
  return momentum >= 0.f ? momentum : static_cast<float>(1.0 / static_cast<double>(*num_batches_tracked));
}

// One feature's training coefficients {mean, invstd, w, b} from its batch
// statistics over M rows (mean64 and m2 = sum of squared deviations, float64), as
// PyTorch's native CUDA batch_norm rounds them:
//   mean = float32(mean64),  var = float32(m2 / M)  (biased),  invstd = rsqrtf(var + eps)
// and, with `update`, the running statistics (S words) in place, f = running_factor:
//   running_mean = rnd(mean f + (1 - f) f(running_mean))
//   running_var  = rnd(var c f + (1 - f) f(running_var)),  c = float32(M / (M - 1))
template <typename S>
__device__ __forceinline__ float4 train_coeff(double mean64, double m2, int M, float f, float eps, float bn_weight,
                                              float bn_bias, word_t<S>* running_mean, word_t<S>* running_var,
                                              bool update) {
  using St = Storage<S>;
  const float mean = static_cast<float>(mean64);
  const float var = static_cast<float>(m2 / static_cast<double>(M));
  if (update) {
    const float bessel = static_cast<float>(static_cast<double>(M) / static_cast<double>(M - 1));
    const float rm = St::load(running_mean), rv = St::load(running_var);
    St::store(running_mean, mean * f + (1.f - f) * rm);
    St::store(running_var, var * bessel * f + (1.f - f) * rv);
  }
  return make_float4(mean, rsqrtf(var + eps), bn_weight, bn_bias);
}

// BatchNorm of one element u from its coefficients c = {mean, invstd, w, b}, before
// rounding: the channels-last elementwise kernel's `w * (x - mean) * invstd + b`.
__device__ __forceinline__ float bn_affine(float u, const float4& c) { return fmaf(c.z * (u - c.x), c.y, c.w); }

}  // namespace lowp
}  // namespace fused_gemm_bn
