// bn_16bit_strip.cuh -- the training BatchNorm of a small batch (at most 8 or 32 rows) from
// the 16-bit Linear output z, a thread owning features and every row of them: rows_group, a
// group of 8 features (bn_16bit_strip.cu's bn16_strip_train_rows, z read from global memory),
// and rows_feature, one feature (the small-batch product's epilogue, small_m_16bit.cu, z read
// from shared memory).  Both run the same per-feature steps (feature_stats's, written out in
// rows_group) and the same coefficient and output steps, so they give the same bits.
// finish_group is also the tail of bn_16bit_strip.cu's sliced kernel.  Device code only; the formulas are bn_16bit_strip.cu's header's.
#pragma once

#include <stdint.h>

#include "lowp_chain.cuh"
#include "lowp_coeff.cuh"
#include "lowp_types.cuh"

namespace fused_gemm_bn {
namespace lowp {
namespace strip {

constexpr int kVec = 8;          // features of a group (16-byte accesses of z and out)
constexpr int kThreadRows = 8;   // rows_group: rows a thread holds, the batches it takes
constexpr int kPairStride = 16;  // bn_16bit_strip.cu's kParts: its slices q, q + 16, ... meet first

// z: the Linear output in global memory (M, N) T (out may be z: in place); vectors (N) of S;
// coeff (4, N) float32.
struct Args {
  const uint16_t* z;
  void* out;
  const void* scale;
  const void* bn_weight;
  const void* bn_bias;
  void* running_mean;
  void* running_var;
  int64_t* num_batches_tracked;
  float* coeff;  // (4, N)
  float momentum, eps;
  bool scale_after_bn;
  int M, N;
  int scale_stride;  // 1, or 0: one number for every feature
};

// The tail of both kernels: the group's 8 coefficients from mean64 and m2 (every thread of a
// group computes the same values; `writer` stores them and the running statistics), then
// (33) out = rnd_S(fma(w (u - mean), invstd, b)), bn16_apply's value, or (84, out apart from
// z) out = u, for the thread's rows row0, row0 + row_step, ... below M.
template <typename S, int kRows>
__device__ __forceinline__ void finish_group(const Args& p, int f0, bool writer, const float (&v)[kRows][kVec],
                                             const double (&mean64)[kVec], const double (&m2)[kVec], int row0,
                                             int row_step) {
  using St = Storage<S>;
  using W = word_t<S>;
  const float f = running_factor(p.momentum, p.num_batches_tracked);
  float4 c[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j)
    c[j] = train_coeff<S>(mean64[j], m2[j], p.M, f, p.eps, St::load(static_cast<const W*>(p.bn_weight) + f0 + j),
                          St::load(static_cast<const W*>(p.bn_bias) + f0 + j),
                          static_cast<W*>(p.running_mean) + f0 + j, static_cast<W*>(p.running_var) + f0 + j, writer);
  if (writer) coeff_store8(p.coeff, p.N, f0, c);
  const bool store_u = p.scale_after_bn && p.out != static_cast<const void*>(p.z);
  if (p.scale_after_bn && !store_u) return;
  W* out = static_cast<W*>(p.out);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = row0 + r * row_step;
    if (row >= p.M) break;
    float o[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j)  // 33: bn16_apply's fma(w (u - mean), invstd, b); 84: u
      o[j] = p.scale_after_bn ? v[r][j] : bn_affine(v[r][j], c[j]);
    store_group<S>(out + static_cast<size_t>(row) * p.N + f0, o);
  }
}

// One feature's statistics over rows 0 .. M - 1 (M <= kRows <= 32) of v, z's values, which
// become u = train_u(z): float64 sums, u then the squares (d d rounded, then added), in the
// sliced kernel's order (bn_16bit_strip.cu's header: a slice a row there, the slices' sums
// meeting in slice_sums, kParts = kPairStride apart, then in order): at M <= 16 the rows in
// order; at M = 17 .. 32 the pairs (q, q + 16) summed first, then the 16 pairs in order.  The
// sliced kernel's other terms are exact zeros, so both give the same numbers by construction.
// v(r): row r's value, a float& (a register of the caller's, unrolled).
template <typename S, int kRows, class Value>
__device__ __forceinline__ void feature_stats(Value v, int M, float scale, bool scale_after_bn, double& mean64,
                                              double& m2) {
  static_assert(kRows <= 2 * kPairStride, "at most two rows meet before the pairs' sum");
  double sum = 0.0;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (r >= M) break;
    v(r) = train_u<S>(v(r), scale, scale_after_bn);
    if constexpr (kRows <= kPairStride) sum += v(r);
  }
  if constexpr (kRows > kPairStride) {
#pragma unroll
    for (int r = 0; r < kPairStride; ++r) {
      if (r >= M) break;
      sum += r + kPairStride < M ? static_cast<double>(v(r)) + static_cast<double>(v(r + kPairStride))
                                 : static_cast<double>(v(r));
    }
  }
  mean64 = sum / static_cast<double>(M);
  double q = 0.0;
  const auto square = [&](int r) {
    const double d = static_cast<double>(v(r)) - mean64;
    return __dmul_rn(d, d);
  };
#pragma unroll
  for (int r = 0; r < (kRows <= kPairStride ? kRows : kPairStride); ++r) {
    if (r >= M) break;
    if constexpr (kRows <= kPairStride) {
      q = __dadd_rn(q, square(r));
    } else {
      q = __dadd_rn(q, r + kPairStride < M ? __dadd_rn(square(r), square(r + kPairStride)) : square(r));
    }
  }
  m2 = q;
}

// The group of features f0 .. f0 + 7 (f0 % 8 == 0, f0 + 8 <= N) over rows 0 .. M - 1 (M <= kThreadRows)
// in one thread: z's rows read from z_rows + r z_row_stride (16-byte aligned), then feature_stats's
// steps for each feature, and finish_group's outputs.
template <typename T, typename S>
__device__ __forceinline__ void rows_group(const Args& p, int f0, const uint16_t* z_rows, size_t z_row_stride) {
  using St = Storage<S>;
  using W = word_t<S>;
  float v[kThreadRows][kVec];
#pragma unroll
  for (int r = 0; r < kThreadRows; ++r)  // every load first
    if (r < p.M) load_group<T>(z_rows + static_cast<size_t>(r) * z_row_stride, v[r]);
  float scale[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) scale[j] = St::load(static_cast<const W*>(p.scale) + (f0 + j) * p.scale_stride);
  double mean64[kVec], m2[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) {  // feature_stats's steps written out: through feature_stats (an accessor) this kernel took
    // 6-8 more registers and its PTX changed (docs/perf.md v102); written out, its PTX is v101's
    double sum = 0.0;
#pragma unroll
    for (int r = 0; r < kThreadRows; ++r) {
      if (r >= p.M) break;
      v[r][j] = train_u<S>(v[r][j], scale[j], p.scale_after_bn);
      sum += v[r][j];
    }
    mean64[j] = sum / static_cast<double>(p.M);
    double q = 0.0;
#pragma unroll
    for (int r = 0; r < kThreadRows; ++r) {
      if (r >= p.M) break;
      const double d = static_cast<double>(v[r][j]) - mean64[j];
      q = __dadd_rn(q, __dmul_rn(d, d));
    }
    m2[j] = q;
  }
  finish_group<S>(p, f0, true, v, mean64, m2, 0, 1);
}

// Feature n alone over rows 0 .. M - 1 (M <= kRows, 32 at most) in one thread, z's values read
// from z_col + r z_row_stride (any memory): the statistics, running statistics, coeff and out
// that rows_group (M <= 8) or the sliced kernel (M <= 32: header of feature_stats) gives feature
// n, by the same operations (feature_stats, train_coeff, bn_affine).
// It holds an eighth of rows_group's values: the small-batch product's epilogue runs it
// (small_m_16bit.cu) under the two-CTA register cap of 128, where rows_group's stack frame
// (the float64 division's slow path under register pressure) fails the CI's ptxas check.
template <typename T, typename S, int kRows>
__device__ __forceinline__ void rows_feature(const Args& p, int n, const uint16_t* z_col, int z_row_stride) {
  using St = Storage<S>;
  using W = word_t<S>;
  float v[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) v[r] = r < p.M ? load_float<T>(z_col + r * z_row_stride) : 0.f;
  double mean64, m2;
  feature_stats<S, kRows>([&](int r) -> float& { return v[r]; }, p.M,
                          St::load(static_cast<const W*>(p.scale) + static_cast<size_t>(n) * p.scale_stride),
                          p.scale_after_bn, mean64, m2);
  const float f = running_factor(p.momentum, p.num_batches_tracked);
  const float4 c = train_coeff<S>(mean64, m2, p.M, f, p.eps, St::load(static_cast<const W*>(p.bn_weight) + n),
                                  St::load(static_cast<const W*>(p.bn_bias) + n), static_cast<W*>(p.running_mean) + n,
                                  static_cast<W*>(p.running_var) + n, true);
  coeff_store1(p.coeff, p.N, n, c);
  const bool store_u = p.scale_after_bn && p.out != static_cast<const void*>(p.z);
  if (p.scale_after_bn && !store_u) return;
  W* out = static_cast<W*>(p.out);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (r >= p.M) break;
    St::store(out + static_cast<size_t>(r) * p.N + n, p.scale_after_bn ? v[r] : bn_affine(v[r], c));
  }
}

}  // namespace strip
}  // namespace lowp
}  // namespace fused_gemm_bn
