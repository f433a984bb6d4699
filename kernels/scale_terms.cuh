// scale_terms.cuh -- the gradient of one scale read at every feature (a scale of
// one number, scale stride 0: problem 84's default shape (1,)), shared by the
// float32 backward (bn_backward.cu) and the 16-bit one (lowp/bn_16bit_backward.cu).
//
// That gradient is the sum over the N features of dscale's per-feature terms.
// Rounded per feature and then summed (autograd's expand backward: in float32, or
// in the 16-bit dtype with every term rounded to it first), it carried ~sqrt(N)
// roundings of terms that largely cancel: 3.9x eager's error in float32 at
// 16 x 8192 x 8192 (docs/perf.md v44), 1.2-8x in 16-bit training (v75).  Here the
// backward kernel keeps the N terms in float64 (an (N) float64 scratch), and one
// CTA sums them in float64 and rounds once: grad_scale = [sum, 0, ..., 0] (len
// elements: N, or 1 for a gradient of shape (1)), whose sum over the features, in
// any order and dtype, is that rounded sum exactly.
//
// Order: thread t adds terms t, t + kScaleSumThreads, ... in order, then
// block_reduce's fixed tree: the same bits on every call.
#pragma once

#include "block_reduce.cuh"

namespace fused_gemm_bn {

constexpr int kScaleSumThreads = 1024;  // the one CTA that sums the terms

// Called by every thread of a one-CTA launch of kScaleSumThreads threads:
// write(j, 0.0) for 0 < j < min(len, N), then write(0, the float64 sum of terms[0, N)).
template <typename Write>
__device__ __forceinline__ void sum_scale_terms(const double* terms, int N, int len, Write&& write) {
  __shared__ double red[kScaleSumThreads / 32];
  double sum = 0.0;
  for (int j = threadIdx.x; j < N; j += kScaleSumThreads) {
    sum += terms[j];
    if (j > 0 && j < len) write(j, 0.0);
  }
  sum = block_reduce<false>(sum, red);
  if (threadIdx.x == 0) write(0, sum);
}

}  // namespace fused_gemm_bn
