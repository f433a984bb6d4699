// bn_backward.cu -- BatchNorm backward for the fused models: training mode
// (batch statistics) and eval mode (running statistics, below).  The training
// backward's batch statistics (stats) come from the training forward's
// bn_apply / bn_softmax_fold_train (write_batch_stats, bn_stats.cuh).
//
// Forward being differentiated (z = x @ W^T, no bias: the bias cancels), per
// feature j over the M rows of the batch, mu = mean(z), var = biased var(z):
//   scale_after_bn = false (problem 33: Linear -> scale -> BatchNorm):
//     y = (z - mu) * a + beta,   a = s * gamma / sigma,   sigma^2 = s^2 var + eps
//   scale_after_bn = true  (problem 84: Linear -> BatchNorm -> scale; y is the
//     pre-softmax logit):
//     y = s * (gamma * (z - mu) / sigma + beta),           sigma^2 = var + eps
// With g = dL/dy, S1 = sum_m g, S2 = sum_m g (z - mu), xhat = (z - mu)/sigma:
//   problem 33: dbeta = S1,   dgamma = s S2 / sigma,   dscale = gamma S2 eps / sigma^3
//               dz = a (g - S1 / M - (z - mu) s^2 S2 / (sigma^2 M))
//   problem 84: dbeta = s S1, dgamma = s S2 / sigma,   dscale = gamma S2 / sigma + beta S1
//               (beta S1 where bn.bias is given, else the caller's)
//               dz = a (g - S1 / M - (z - mu) S2 / (sigma^2 M)),  a = s gamma / sigma
// The Linear bias's gradient is exactly zero in training (sum_m dz = 0 in
// exact arithmetic) and is not computed.  dscale of problem 33 is exact in
// this form: the unfused chain computes it as a difference of two terms that
// agree to within eps / sigma^2, so PyTorch's value carries that cancellation.
//
// Tensors: g, z, dz (M, N) float32 row-major contiguous; stats (2, N) float32
// = [mu | var]; scale, gamma (N); outputs dscale, dgamma, dbeta (N).
// Reductions S1, S2 in float64 (each thread over its rows, then across the
// block's warps); coefficients and each dz in float64, dz rounded once to
// float32 (z - mu is exact in float64).
//
// One scale (a single number read at every feature, scale stride 0; problem 84's
// default): the terms of its gradient stay float64 (dscale_terms) and
// sum_scale_terms_kernel sums them, rounding once: grad_scale = [sum, 0, ..., 0]
// (scale_terms.cuh says why).
//
// Synchronized BatchNorm (model_new.py, _SyncFusedTrainFn) splits the kernel
// around an all_reduce: the batch is the union of every process's rows, mu and
// var in stats are the merged batch's, and C is its row count.
//   bn_backward_sums: this process's S1, S2 (float64, (2, N)) with the merged mu
//   bn_backward_grad: dz from the all-reduced sums and C (the formulas above
//     with S1, S2, M -> all processes' S1, S2 and C); dbeta, dgamma and problem
//     84's dscale from this process's sums (as nn.SyncBatchNorm returns them:
//     DDP then averages the gradients); problem 33's dscale = sum over this
//     process's rows of dL/du (z + bias), dL/du = dz / s, accumulated in float64
//     in pass 2 (per process it has no closed form: the eps / sigma^3 form above
//     holds for the sum over all processes).
//
// Eval mode (bn_backward_eval; model_new.py's _EvalFn): BatchNorm frozen, mu and
// var the running statistics, sigma = sqrt(var + eps), g = gamma / sigma, b the
// Linear's bias; the forward (forward_eval_saved) kept z = x @ W^T:
//   problem 33: y = (s (z + b) - mu) g + beta;   problem 84: v = s ((z + b - mu) g + beta)
// With G = dL/dy (33) or dL/dv (84: the row softmax's backward), a = s g, and
// S1 = sum_m G, S2 = sum_m G (z - center), center = -b (33) or mu - b (84):
//   both:       dz = a G,  dbias = a S1
//   problem 33: dscale = g S2,          dgamma = (s S2 - mu S1) / sigma,  dbeta = S1
//   problem 84: dscale = g S2 + beta S1, dgamma = s S2 / sigma,          dbeta = s S1
// No term depends on the batch, so one pass: each dz (a in float64, rounded
// once) is written as its G is read, S1 and S2 summed in float64 (z - center
// exact in float64 but for the last bits of a three-term sum); each parameter
// gradient rounded once.  Problem 84's one scale as in training (dscale_terms,
// sum_scale_terms_kernel).  The two-pass kernel's layout: one CTA per 32
// features, its 8 warps over the rows.
//
// Kernels (bn_backward_train picks one: resident_strip_pays, heuristics_common.cuh):
//   two-pass: one CTA per 32 features (a warp reads 128 contiguous bytes of a
//     row); its 8 warps take every 8th row.  Pass 1 reduces S1 and S2, pass 2
//     re-reads g and z (from L2 while the strips in flight fit it) and writes
//     dz.  Every mode (kFull, kSums, kGrad).
//   resident strip (kFull, M <= 1024): one CTA per 16 features holds its
//     strip of g and z in registers between the passes: g and z read once.
// Memory-bound: dz written once; g and z read once (resident) or twice.

#include <cuda_runtime.h>
#include <stdint.h>

#include "bn_stats.cuh"
#include "cp_async.cuh"
#include "heuristics_common.cuh"
#include "launchers.cuh"
#include "pdl.cuh"
#include "scale_terms.cuh"

namespace fused_gemm_bn {

constexpr int kBwdCols = 32;   // features per CTA (one warp's width)
constexpr int kBwdWarps = 8;   // row groups per CTA
constexpr int kBwdRowBatch = 16;  // rows loaded per thread before use (8 was 3-12% slower from 1024 rows up, docs/perf.md v38)

// kFull: one process's batch (bn_backward_train); kSums: pass 1 only
// (bn_backward_sums); kGrad: pass 2 from given sums (bn_backward_grad).
enum class BwdMode { kFull, kSums, kGrad };

struct BnBackwardArgs {
  const float* g;
  const float* z;
  const float* stats;
  // scale, bn_weight, eps, scale_after_bn; kGrad, problem 33: bias (the Linear's, v = z + bias);
  // problem 84: bn_bias (dscale's beta S1 term), or null (the caller adds it)
  BatchNormArgs bn;
  int M, N;
  double count;                 // rows the statistics cover (kFull, kSums: M)
  const double* merged_count;   // kGrad: the merged batch's C, a device scalar
  float* dz;
  float* dscale;
  float* dgamma;
  float* dbeta;
  const double* local_sums;  // kGrad: (2, N) this process's S1, S2
  const double* total_sums;  // kGrad: (2, N) every process's
  double* sums_out;          // kSums: (2, N)
  double* dscale_terms = nullptr;    // kFull, one scale: dscale's N per-feature terms, unrounded
};

// bn_backward_eval's arguments: bn's bias, scale (scale_stride), bn_weight, bn_bias,
// running_mean, running_var, eps and scale_after_bn are read.
struct BnBackwardEvalArgs {
  const float* g;
  const float* z;
  BatchNormArgs bn;
  int M, N;
  float* dz;
  float* dbias;
  float* dscale;
  float* dgamma;
  float* dbeta;
  double* dscale_terms;  // one scale: dscale's N per-feature terms, unrounded; else null
};

// dscale's term of feature j: rounded into dscale, or kept in float64 for one scale's sum.
template <class Args>  // BnBackwardArgs or BnBackwardEvalArgs
__device__ __forceinline__ void write_dscale(const Args& p, int j, double term) {
  if (p.dscale_terms != nullptr)
    p.dscale_terms[j] = term;
  else
    p.dscale[j] = static_cast<float>(term);
}

// Rows row + r * kBwdWarps (r < kBwdRowBatch) of g and z at feature j, all
// loads issued before any is used; rows past M read as g = 0, z = z_pad.
template <class Args>  // BnBackwardArgs or BnBackwardEvalArgs: g, z, M, N
__device__ __forceinline__ void load_rows(const Args& p, int row, int j, float z_pad,
                                          float (&gv)[kBwdRowBatch], float (&zv)[kBwdRowBatch]) {
#pragma unroll
  for (int r = 0; r < kBwdRowBatch; ++r) {
    const int m = row + r * kBwdWarps;
    const size_t idx = static_cast<size_t>(m) * p.N + j;
    gv[r] = m < p.M ? p.g[idx] : 0.f;
    zv[r] = m < p.M ? p.z[idx] : z_pad;
  }
}

// Pass 1 over a thread's kRows rows of feature j (rows past M hold g = 0, z =
// mu): S1 += g, S2 += g (z - mu), in float64, in row order.
template <int kRows>
__device__ __forceinline__ void add_sums(const float (&gv)[kRows], const float (&zv)[kRows], float mu, double& s1,
                                         double& s2) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    s1 += gv[r];
    s2 += static_cast<double>(gv[r]) * static_cast<double>(zv[r] - mu);
  }
}

// Feature j's BatchNorm vectors as finish_feature reads them: scale, bn.weight,
// the batch variance, bn.bias (0 where bn.bias is not given).
struct FeatureVectors {
  float s, gamma, var, beta;
};

__device__ __forceinline__ FeatureVectors feature_vectors(const BnBackwardArgs& p, int j) {
  return {p.bn.scale[static_cast<size_t>(j) * p.bn.scale_stride], p.bn.bn_weight[j], p.stats[p.N + j],
          p.bn.bn_bias != nullptr ? p.bn.bn_bias[j] : 0.f};
}

// Feature j, once its sums are known: the coefficients of dz = a (g - c1 - (z
// - mu) c2) from the sums dz needs (T1, T2 over `count` rows: every process's
// in the synchronized backward), and the parameter gradients from this
// process's S1, S2 (problem 33's dscale only where kScaleFromSums: the
// synchronized backward sums it in pass 2).
template <bool kScaleFromSums>
__device__ __forceinline__ void finish_feature(const BnBackwardArgs& p, int j, const FeatureVectors& v, double S1,
                                               double S2, double T1, double T2, double count, double& a, double& c1,
                                               double& c2) {
  const double s = v.s, gamma = v.gamma, var = v.var;
  const double s2_var = p.bn.scale_after_bn ? var : s * s * var;
  const double sigma2 = s2_var + static_cast<double>(p.bn.eps);
  const double sigma = sqrt(sigma2);
  a = s * gamma / sigma;
  c1 = T1 / count;
  c2 = (p.bn.scale_after_bn ? 1.0 : s * s) * T2 / (sigma2 * count);
  if (p.bn.scale_after_bn) {
    p.dbeta[j] = static_cast<float>(s * S1);
    p.dgamma[j] = static_cast<float>(s * S2 / sigma);
    write_dscale(p, j, gamma * S2 / sigma + static_cast<double>(v.beta) * S1);
  } else {
    p.dbeta[j] = static_cast<float>(S1);
    p.dgamma[j] = static_cast<float>(s * S2 / sigma);
    if constexpr (kScaleFromSums)
      write_dscale(p, j, gamma * S2 * static_cast<double>(p.bn.eps) / (sigma2 * sigma));
  }
}

template <BwdMode kMode>
__global__ void __launch_bounds__(kBwdCols* kBwdWarps) bn_backward_train_kernel(const BnBackwardArgs p) {
  pdl_wait_then_release();
  __shared__ double red[2][kBwdWarps][kBwdCols];
  __shared__ double coef[3][kBwdCols];  // per feature: a, c1 = S1 / C, c2 (slope of the xhat term)
  const int lane = threadIdx.x % kBwdCols, warp = threadIdx.x / kBwdCols;
  const int j = blockIdx.x * kBwdCols + lane;
  const bool valid = j < p.N;
  const float mu = valid ? p.stats[j] : 0.f;

  if constexpr (kMode != BwdMode::kGrad) {
    double s1 = 0.0, s2 = 0.0;
    if (valid) {
      for (int row = warp; row < p.M; row += kBwdWarps * kBwdRowBatch) {
        float gv[kBwdRowBatch], zv[kBwdRowBatch];
        load_rows(p, row, j, mu, gv, zv);
        add_sums(gv, zv, mu, s1, s2);
      }
    }
    red[0][warp][lane] = s1;
    red[1][warp][lane] = s2;
    __syncthreads();
  }
  if (warp == 0 && valid) {
    double S1 = 0.0, S2 = 0.0;  // this process's sums
    if constexpr (kMode == BwdMode::kGrad) {
      S1 = p.local_sums[j];
      S2 = p.local_sums[p.N + j];
    } else {
#pragma unroll
      for (int w = 0; w < kBwdWarps; ++w) {
        S1 += red[0][w][lane];
        S2 += red[1][w][lane];
      }
    }
    if constexpr (kMode == BwdMode::kSums) {
      p.sums_out[j] = S1;
      p.sums_out[p.N + j] = S2;
    } else {
      // The sums dz needs: every process's (kGrad) or this one's.
      const double T1 = kMode == BwdMode::kGrad ? p.total_sums[j] : S1;
      const double T2 = kMode == BwdMode::kGrad ? p.total_sums[p.N + j] : S2;
      const double count = kMode == BwdMode::kGrad ? fmax(*p.merged_count, 1.0) : p.count;
      finish_feature<kMode == BwdMode::kFull>(p, j, feature_vectors(p, j), S1, S2, T1, T2, count, coef[0][lane],
                                               coef[1][lane], coef[2][lane]);
    }
  }
  if constexpr (kMode == BwdMode::kSums) return;
  __syncthreads();
  // kGrad, problem 33: this process's sum of (dz / a) (z + bias), in float64.
  constexpr bool kScaleSum = kMode == BwdMode::kGrad;
  double scale_sum = 0.0;
  if (valid) {
    // float64 per element, dz rounded once: in float32 (four roundings) the batch
    // sum of dz, zero in exact arithmetic, kept about eager's error, which the
    // weight gradient carries into the next batch's mean (docs/perf.md v24).
    const double a = coef[0][lane], c1 = coef[1][lane], c2 = coef[2][lane], mud = mu;
    const double b = kScaleSum && !p.bn.scale_after_bn ? static_cast<double>(p.bn.bias[j]) : 0.0;
    for (int row = warp; row < p.M; row += kBwdWarps * kBwdRowBatch) {
      float gv[kBwdRowBatch], zv[kBwdRowBatch];
      load_rows(p, row, j, mu, gv, zv);
#pragma unroll
      for (int r = 0; r < kBwdRowBatch; ++r) {
        const int m = row + r * kBwdWarps;
        if (m < p.M) {
          const double zd = zv[r];
          const double inner = static_cast<double>(gv[r]) - c1 - (zd - mud) * c2;
          p.dz[static_cast<size_t>(m) * p.N + j] = static_cast<float>(a * inner);
          if (kScaleSum && !p.bn.scale_after_bn) scale_sum += inner * (zd + b);
        }
      }
    }
  }
  if constexpr (kScaleSum) {
    if (p.bn.scale_after_bn) return;  // uniform over the grid
    row_groups_total(scale_sum, red[0], warp, lane, warp == 0 && valid, [&](double total) {
      // dL/du = dz / s = (gamma / sigma) (g - c1 - (z - mu) c2); a / s = gamma / sigma.
      const double s = p.bn.scale[static_cast<size_t>(j) * p.bn.scale_stride], gamma = p.bn.bn_weight[j];
      const double sigma = sqrt(s * s * static_cast<double>(p.stats[p.N + j]) + static_cast<double>(p.bn.eps));
      p.dscale[j] = static_cast<float>(gamma / sigma * total);
    });
  }
}

// kFull for batches of at most kResMaxRows rows: the strip of kResCols features
// is read once and held in registers between the passes (512 threads, 32 row
// groups of 16 features; each thread keeps its kResRows rows of g and z, 64
// floats, all loads issued before the first use; 118 registers, one CTA per
// SM).  The two-pass kernel above re-reads the strip for pass 2, from DRAM once
// the strips in flight outgrow L2 (at 1024 x 8192 all 256 CTAs are resident:
// 64 MB); this one moves g and z once.  Same formulas (finish_feature); S1 and
// S2 are summed per row group, then over the 32 groups in order, in float64.
// The strip's FeatureVectors come into shared memory by cp.async beside its
// loads and the groups' sums are read back in one unrolled run, so the serial
// section between the two barriers (group 0 alone) waits on no global load
// (H200, the same bits: 1024 x 8192 44.8 -> 39.2 us, 768 x 8192 37.7 -> 33.2
// against the vectors loaded there, after the sums; docs/perf.md v119).
constexpr int kResCols = 16;                          // features per CTA (64 bytes of a row)
constexpr int kResThreads = 512;
constexpr int kResRowGroups = kResThreads / kResCols;  // 32
constexpr int kResRows = 32;                           // rows per thread
constexpr int kResMaxRows = kResRowGroups * kResRows;  // 1024
static_assert(kResMaxRows == kResidentStripMaxRows, "resident_strip_pays (heuristics_common.cuh) counts these rows");

__global__ void __launch_bounds__(kResThreads, 1) bn_backward_resident_kernel(const BnBackwardArgs p) {
  pdl_wait_then_release();
  __shared__ double red[2][kResRowGroups][kResCols];
  __shared__ double coef[3][kResCols];
  __shared__ float vecs[4][kResCols];  // FeatureVectors
  const int c = threadIdx.x % kResCols, group = threadIdx.x / kResCols;
  const int j = blockIdx.x * kResCols + c;
  const bool valid = j < p.N;
  const float mu = valid ? p.stats[j] : 0.f;
  // The strip's FeatureVectors (s, gamma, var, beta) into shared memory as the
  // strip's own loads are issued, so that finish_feature does not wait for them
  // after the sums (zero past N and for a missing bn.bias).
  if (group == 0) {
    const int jc = valid ? j : 0;
    const bool beta = valid && p.bn.bn_bias != nullptr;
    cp_async<4>(&vecs[0][c], p.bn.scale + static_cast<size_t>(jc) * p.bn.scale_stride, valid);
    cp_async<4>(&vecs[1][c], p.bn.bn_weight + jc, valid);
    cp_async<4>(&vecs[2][c], p.stats + p.N + jc, valid);
    cp_async<4>(&vecs[3][c], beta ? p.bn.bn_bias + jc : p.stats, beta);
    cp_async_commit();
  }
  // This thread's rows: group + i kResRowGroups for i < rows (M * N < 2^31: int
  // offsets).  Every load is issued (rows past M and features past N read row
  // M - 1 / feature N - 1 again) and masked afterwards: g = 0, z = mu.
  const int rows = valid ? (p.M - group + kResRowGroups - 1) / kResRowGroups : 0;
  const int row_step = kResRowGroups * p.N;
  const int first = min(group, p.M - 1) * p.N + min(j, p.N - 1);
  const float* gp = p.g + first;
  const float* zp = p.z + first;
  float gv[kResRows], zv[kResRows];
#pragma unroll
  for (int i = 0; i < kResRows; ++i) {
    gv[i] = __ldg(gp);
    zv[i] = __ldg(zp);
    if (i + 1 < rows) gp += row_step, zp += row_step;
  }
#pragma unroll
  for (int i = 0; i < kResRows; ++i) {
    if (i >= rows) gv[i] = 0.f, zv[i] = mu;
  }
  double s1 = 0.0, s2 = 0.0;
  add_sums(gv, zv, mu, s1, s2);
  red[0][group][c] = s1;
  red[1][group][c] = s2;
  cp_async_wait<0>();  // vecs (group 0's copies)
  __syncthreads();
  if (group == 0 && valid) {
    double S1 = 0.0, S2 = 0.0;
#pragma unroll
    for (int w = 0; w < kResRowGroups; ++w) {
      S1 += red[0][w][c];
      S2 += red[1][w][c];
    }
    const FeatureVectors v{vecs[0][c], vecs[1][c], vecs[2][c], vecs[3][c]};
    finish_feature<true>(p, j, v, S1, S2, S1, S2, p.count, coef[0][c], coef[1][c], coef[2][c]);
  }
  __syncthreads();
  if (!valid) return;
  // Keep g and z as float32 between the passes (the compiler otherwise keeps
  // pass 1's float64 conversions alive: twice the registers, and spills).
#pragma unroll
  for (int i = 0; i < kResRows; ++i) asm volatile("" : "+f"(gv[i]), "+f"(zv[i]));
  const double a = coef[0][c], c1 = coef[1][c], c2 = coef[2][c], mud = mu;
  float* dzp = p.dz + first;
#pragma unroll
  for (int i = 0; i < kResRows; ++i) {
    if (i < rows) {
      const double inner = static_cast<double>(gv[i]) - c1 - (static_cast<double>(zv[i]) - mud) * c2;
      *dzp = static_cast<float>(a * inner);
      dzp += row_step;
    }
  }
}

// Eval mode (formulas above): one pass over g and z, dz written as g is read.
__global__ void __launch_bounds__(kBwdCols* kBwdWarps) bn_backward_eval_kernel(const BnBackwardEvalArgs p) {
  pdl_wait_then_release();
  __shared__ double red[2][kBwdWarps][kBwdCols];
  const int lane = threadIdx.x % kBwdCols, warp = threadIdx.x / kBwdCols;
  const int j = blockIdx.x * kBwdCols + lane;
  const bool valid = j < p.N;
  // (the per-feature values are read again after the loop: live across it, the float64
  // division's slow path spilled them)
  double a = 0.0, center = 0.0;
  if (valid) {
    const double s = p.bn.scale[static_cast<size_t>(j) * p.bn.scale_stride];
    a = s * p.bn.bn_weight[j] / sqrt(static_cast<double>(p.bn.running_var[j]) + static_cast<double>(p.bn.eps));
    const double b = p.bn.bias[j];
    center = p.bn.scale_after_bn ? static_cast<double>(p.bn.running_mean[j]) - b : -b;
  }
  double s1 = 0.0, s2 = 0.0;
  if (valid) {
    for (int row = warp; row < p.M; row += kBwdWarps * kBwdRowBatch) {
      float gv[kBwdRowBatch], zv[kBwdRowBatch];
      load_rows(p, row, j, 0.f, gv, zv);
#pragma unroll
      for (int r = 0; r < kBwdRowBatch; ++r) {
        const int m = row + r * kBwdWarps;
        if (m < p.M) {
          const double gd = gv[r];
          s1 += gd;
          s2 += gd * (static_cast<double>(zv[r]) - center);
          p.dz[static_cast<size_t>(m) * p.N + j] = static_cast<float>(a * gd);
        }
      }
    }
  }
  red[0][warp][lane] = s1;
  red[1][warp][lane] = s2;
  __syncthreads();
  if (warp != 0 || !valid) return;
  double S1 = 0.0, S2 = 0.0;
#pragma unroll
  for (int w = 0; w < kBwdWarps; ++w) {
    S1 += red[0][w][lane];
    S2 += red[1][w][lane];
  }
  const double s = p.bn.scale[static_cast<size_t>(j) * p.bn.scale_stride], gamma = p.bn.bn_weight[j];
  const double mu = p.bn.running_mean[j];
  const double sigma = sqrt(static_cast<double>(p.bn.running_var[j]) + static_cast<double>(p.bn.eps));
  p.dbias[j] = static_cast<float>(a * S1);
  if (p.bn.scale_after_bn) {
    p.dgamma[j] = static_cast<float>(s * S2 / sigma);
    p.dbeta[j] = static_cast<float>(s * S1);
    write_dscale(p, j, gamma / sigma * S2 + static_cast<double>(p.bn.bn_bias[j]) * S1);
  } else {
    p.dgamma[j] = static_cast<float>((s * S2 - mu * S1) / sigma);
    p.dbeta[j] = static_cast<float>(S1);
    write_dscale(p, j, gamma / sigma * S2);
  }
}

// One scale's gradient (scale_terms.cuh): grad_scale = [the float64 sum of dscale's N
// per-feature terms, rounded once, 0, ..., 0].  One CTA of kScaleSumThreads.
__global__ void __launch_bounds__(kScaleSumThreads) sum_scale_terms_kernel(const double* terms, int N,
                                                                           float* grad_scale) {
  pdl_wait_then_release();
  sum_scale_terms(terms, N, N, [grad_scale](int j, double v) { grad_scale[j] = static_cast<float>(v); });
}

}  // namespace fused_gemm_bn

// grad_z (M, N) and grad_scale, grad_bn_weight, grad_bn_bias (N) from grad_y = dL/dy (formulas above).
cudaError_t fused_gemm_bn::bn_backward_train(const float* grad_y, const float* z, const float* stats,
                                             const BatchNormArgs& bn, int M, int N, float* grad_z, float* grad_scale,
                                             float* grad_bn_weight, float* grad_bn_bias, double* grad_scale_terms,
                                             cudaStream_t stream) {
  const int scale_stride = bn.scale_stride;
  if (N == 0) return cudaSuccess;
  if (scale_stride != 0 && scale_stride != 1) return cudaErrorInvalidValue;
  if (scale_stride == 0 && grad_scale_terms == nullptr) return cudaErrorInvalidValue;
  BnBackwardArgs p{grad_y, z, stats, bn, M, N, static_cast<double>(M), nullptr, grad_z, grad_scale,
                   grad_bn_weight, grad_bn_bias, nullptr, nullptr, nullptr};
  p.dscale_terms = scale_stride == 0 ? grad_scale_terms : nullptr;
  const cudaError_t err =
      resident_strip_pays(M, N)
          ? launch_kernel(bn_backward_resident_kernel, (N + kResCols - 1) / kResCols, kResThreads, 0, stream, p)
          : launch_kernel(bn_backward_train_kernel<BwdMode::kFull>, (N + kBwdCols - 1) / kBwdCols,
                          kBwdCols * kBwdWarps, 0, stream, p);
  if (err != cudaSuccess || scale_stride != 0) return err;
  return launch_kernel(sum_scale_terms_kernel, 1, kScaleSumThreads, 0, stream,
                       static_cast<const double*>(grad_scale_terms), N, grad_scale);
}

// sums (2, N) float64 = this process's [S1 | S2], S2 about the merged mean stats[0].
cudaError_t fused_gemm_bn::bn_backward_sums(const float* grad_y, const float* z, const float* stats, int M, int N,
                                            double* sums, cudaStream_t stream) {
  if (N == 0) return cudaSuccess;
  const BnBackwardArgs p{grad_y, z, stats, BatchNormArgs{}, M, N, static_cast<double>(M), nullptr, nullptr, nullptr,
                         nullptr, nullptr, nullptr, nullptr, sums};
  return launch_kernel(bn_backward_train_kernel<BwdMode::kSums>, (N + kBwdCols - 1) / kBwdCols, kBwdCols * kBwdWarps,
                       0, stream, p);
}

// The synchronized backward's second half (formulas above): *count = C (device
// memory, read by the kernel: the host never waits for it; values below 1 read as 1).
cudaError_t fused_gemm_bn::bn_backward_grad(const float* grad_y, const float* z, const float* stats,
                                            const BatchNormArgs& bn, int M, int N, const double* count,
                                            const double* local_sums, const double* total_sums, float* grad_z,
                                            float* grad_scale, float* grad_bn_weight, float* grad_bn_bias,
                                            cudaStream_t stream) {
  if (N == 0) return cudaSuccess;
  if (count == nullptr) return cudaErrorInvalidValue;
  const BnBackwardArgs p{grad_y, z, stats, bn, M, N, 0.0, count, grad_z, grad_scale, grad_bn_weight, grad_bn_bias,
                         local_sums, total_sums, nullptr};
  return launch_kernel(bn_backward_train_kernel<BwdMode::kGrad>, (N + kBwdCols - 1) / kBwdCols, kBwdCols * kBwdWarps,
                       0, stream, p);
}

// Eval mode: grad_z (M, N) and grad_bias, grad_scale, grad_bn_weight, grad_bn_bias (N)
// from grad_y = dL/dy (problem 33) or dL/dv (84) and the forward's z (formulas above).
cudaError_t fused_gemm_bn::bn_backward_eval(const float* grad_y, const float* z, const BatchNormArgs& bn, int M, int N,
                                            float* grad_z, float* grad_bias, float* grad_scale, float* grad_bn_weight,
                                            float* grad_bn_bias, double* grad_scale_terms, cudaStream_t stream) {
  const int scale_stride = bn.scale_stride;
  if (N == 0) return cudaSuccess;
  if (scale_stride != 0 && scale_stride != 1) return cudaErrorInvalidValue;
  if (scale_stride == 0 && grad_scale_terms == nullptr) return cudaErrorInvalidValue;
  const BnBackwardEvalArgs p{grad_y,    z,          bn,         M, N, grad_z, grad_bias, grad_scale, grad_bn_weight,
                             grad_bn_bias, scale_stride == 0 ? grad_scale_terms : nullptr};
  const cudaError_t err = launch_kernel(bn_backward_eval_kernel, (N + kBwdCols - 1) / kBwdCols, kBwdCols * kBwdWarps,
                                        0, stream, p);
  if (err != cudaSuccess || scale_stride != 0) return err;
  return launch_kernel(sum_scale_terms_kernel, 1, kScaleSumThreads, 0, stream,
                       static_cast<const double*>(grad_scale_terms), N, grad_scale);
}
