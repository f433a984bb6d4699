// bn_stats.cuh -- per-feature BatchNorm statistics math shared by the
// multi-pass statistics-and-apply kernel (bn_apply.cu) and the fused cluster epilogue
// (sm80_gemm_3xtf32_bn.cu).  Device functions only; float64 throughout.
//
// Algebra (training mode), z = x @ W^T for one feature over the batch of M rows:
//   u = scale * (z + bias)  has  mean_u = scale * (mean_z + bias),
//                                 var_u  = scale^2 * var_z   (biased)
//   out = (z - mean_z) * a + bn_bias,  a = scale * bn_weight / sqrt(scale^2 var_z + eps)
//   running_mean = (1 - f) running_mean + f mean_u
//   running_var  = (1 - f) running_var  + f scale^2 var_z M / (M - 1)
//   f = momentum, or 1 / num_batches_tracked for momentum=None (momentum < 0 here).
#pragma once
#include <stdint.h>

namespace fused_gemm_bn {

// Chan, Golub and LeVeque's pairwise update ("Updating formulae and a pairwise
// algorithm for computing sample variances", 1979): merges the statistics
// (n_b, mean_b, m2_b) of one tile into (count, mean, m2); m2 is the sum of
// squared deviations.  No E[z^2] - E[z]^2 cancellation.
__device__ __forceinline__ void merge_chan(double& count, double& mean, double& m2, double n_b, double mean_b,
                                           double m2_b) {
  const double n = count + n_b;
  const double delta = mean_b - mean;
  mean += delta * (n_b / n);
  m2 += m2_b + delta * delta * (count * n_b / n);
  count = n;
}

// The normalisation slope a (see above) from z's batch statistics.
__device__ __forceinline__ float bn_train_slope(double m2, double count, float scale, float bn_weight, float eps) {
  const double s = scale;
  return static_cast<float>(s * bn_weight / sqrt(s * s * (m2 / count) + static_cast<double>(eps)));
}

// Updates one feature's running statistics in place.
__device__ __forceinline__ void bn_update_running(double mean, double m2, double count, float bias, float scale,
                                                  float momentum, const int64_t* num_batches_tracked,
                                                  float* running_mean, float* running_var) {
  const double s = scale;
  const double f =
      momentum >= 0.f ? static_cast<double>(momentum) : 1.0 / static_cast<double>(*num_batches_tracked);
  *running_mean = static_cast<float>((1.0 - f) * *running_mean + f * s * (mean + static_cast<double>(bias)));
  *running_var = static_cast<float>((1.0 - f) * *running_var + f * s * s * (m2 / (count - 1.0)));
}

}  // namespace fused_gemm_bn
