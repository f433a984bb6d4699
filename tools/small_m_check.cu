// small_m_check.cu -- standalone GPU check of kernels/small_m_fp64.cu (no torch):
// correctness of both launchers for both problems against a host reference,
// determinism, and the training launchers' times next to the W-read floor.
//
// Build and run (repository root):
//   nvcc -std=c++17 -O3 -I kernels -arch=sm_90a tools/small_m_check.cu -o /tmp/small_m_check && /tmp/small_m_check
//   (sm_80 .. sm_89: -arch=sm_80; optional argument: a seed, default 1;
//   SMALL_M_CHECK_CASE=MxKxN: that one case of the grid only, e.g. to profile it under ncu;
//   SMALL_M_CHECK_NO_TIMING=1: no timed launches, e.g. under compute-sanitizer)
// Host-only self-test of the reference and comparison logic (no GPU; the
// launchers replaced by a float64 CPU emulation of the kernel's arithmetic):
//   g++ -std=c++17 -O2 -x c++ -DSMALL_M_CHECK_HOST_ONLY tools/small_m_check.cu -o /tmp/small_m_check_host -lpthread
// (exit 0); with -DSMALL_M_CHECK_NEGATIVE_CONTROL too, the emulation sums in float32
// and leaves one eval output unwritten: it must exit 1 (the check can tell).
// The kernel source itself on the host (no GPU): python3 tools/small_m_emulate.py
// builds this file with -DSMALL_M_CHECK_EMULATE against a CUDA shim and runs the
// launchers on small shapes (slow: one OS thread per CUDA thread).
//
// For each case: x (M, K) and W (N, K) seeded standard normal (x + 100 in the
// cancellation case; odd K gives x the row stride K + 5), the BatchNorm vectors and
// nonzero running statistics seeded, outputs poisoned with NaN.  Then, for problem 33
// and problem 84 each, small_m_fp64_train (momentum 0.1, or momentum=None in one case:
// f = 1 / 4; num_batches_tracked from 3, the running statistics from their seeded
// values) and small_m_fp64_eval (the seeded running statistics).  One case passes null
// bias / bn_weight / bn_bias to every call and null z / stats to problem 84's training; the
// momentum=None case passes one scale for every feature (scale_stride 0, NaN past it);
// two give W rows an infinity and a NaN.  Checked:
//   - M >= 2: every output element written (not NaN) and within its bound below
//     (train: out, the backward's centred z = z - mean and stats = [0 | biased var],
//     running_mean, running_var;
//     eval: out), num_batches_tracked = 4; M = 1: the training launcher returns
//     cudaErrorInvalidValue and writes nothing (out, z, stats still poisoned, the
//     running statistics and the counter as they were);
//   - features with a non-finite W row: NaN in z, stats, running statistics and
//     problem 33's outputs; problem 84's outputs NaN in every row (its softmax);
//   - on the GPU, two runs of each launcher (the running statistics and counter
//     reset between them) give the same bits, and first, the kernel's exact
//     float -> double conversions agree with ldexp on 2^24 bit patterns.
//
// Reference: products exact in double, sums in long double (z_ref, A = Sigma_k |x w|),
// then the batch statistics, BatchNorm, running statistics, eval fold and softmax in
// long double from z_ref.  Bounds, from small_m_fp64.cu's numerics (u = 2^-53, first
// order in u; the constants are rounded up for the second-order terms and for the
// reference's own long double roundings): every output is a float64 value y64 rounded
// once to float32, so with E a bound on |y64 - ref|
//   |y - ref| <= 0.5 ulp_f32(|ref| + E) + E     (at |ref| + E: y64 may lie past a binade edge)
// and E propagates delta = |z64 - z_ref| <= (K + 8) u A (+ the reference's K 2^-64 A):
//   z     E = delta;  the saved z - mean: E = delta + E_mean, plus its rounding
//   mean  E_mean = Sigma_m delta / M + (M + 1) u Sigma_m |z| / M      (M terms summed, divided)
//   M2    with d = z - mean, e = z64 - z, eps = mean64 - mean and Sigma d = 0:
//         Sigma (z64 - mean64)^2 - M2 = 2 Sigma d e + Sigma e^2 - 2 eps Sigma e + M eps^2, so
//         E_M2 = P + (M + 3) u (M2 + P), P = 2 Sigma |d| delta + Sigma delta^2 + 2 E_mean Sigma delta
//         + M E_mean^2 (the mean's error enters squared);  var: E_M2 / M + u var
//   a     BatchNorm's factor s gamma / sqrt(q) (q = s^2 var + eps or var + eps): relative
//         rho_a = sqrt(q / (q - E_q)) - 1 + 4 u, E_q from E_var;  eval (q = running_var + eps): 4 u
//   out33, v84 = a (z - shift) + c:  |a| (D (1 + rho_a) + |z - shift| rho_a) + E_c, plus its
//         rounding; D = delta (+ E_mean + u |d| in training), E_c c's own roundings
//   softmax(v)_i: relative expm1(L_i + max_j L_j + (N + 8) u) (+ 2^-1074 for exp's underflow),
//         L_j = E(v_j) + u |v_j - max v| (the rounded exponent argument; the N-term sum, exp's
//         1 ulp and the divide in (N + 8) u): softmax(v + dv)_i / softmax(v)_i lies within
//         exp(+-(|dv_i| + max_j |dv_j|))
//   running_mean  f s_u E_mean + 4 u (|(1 - f) r| + |f s_u| (|mean| + |bias|)),
//   running_var   f s_u^2 E_M2 / (M - 1) + 6 u (the terms) (+ f's rounding at momentum=None)
// The negative control's float32 sums exceed delta by orders of magnitude.
// Printed per case: max error in float32 ulps of the reference (z; train out of 33 and
// 84; eval out of 33 and 84; stats; running statistics), the training launchers'
// median times of 20 (after 3 warm-ups, cudaEvent; problem 84's includes its softmax:
// in the GEMM kernel's cooperative grid, or its own kernel where the grid does not fit
// at once, as at N = 8512 on 132 SMs), the floor (half the median time of a device-to-device cudaMemcpyAsync of
// W's bytes, same run) and problem 33's time over it.  L2 is not flushed (W of the small
// cases stays in L2 for both the kernel and the copy).  Exit status 1 on a bound
// violation, an unwritten element, a wrong counter or refusal, or a non-deterministic
// output; 2 on a CUDA error.

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <random>
#include <thread>
#include <vector>

#ifdef SMALL_M_CHECK_EMULATE
#include "small_m_fp64_emulated.cpp"  // written by tools/small_m_emulate.py
#endif
#ifndef SMALL_M_CHECK_HOST_ONLY
#include "small_m_fp64.cu"
#define CUDA_OK(call)                                                                      \
  do {                                                                                     \
    const cudaError_t err_ = (call);                                                       \
    if (err_ != cudaSuccess) {                                                             \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
      exit(2);                                                                             \
    }                                                                                      \
  } while (0)
#endif

namespace {

constexpr long double kU64 = 0x1p-53L;             // float64's unit roundoff
constexpr long double kULd = LDBL_EPSILON / 2;     // long double's (the reference's sums)
constexpr long double kExpUnderflow = 0x1p-1074L;  // an exp result below 2^-1022: absolute error
constexpr float kMomentum = 0.1f;
constexpr int64_t kBatchesTracked = 3;  // num_batches_tracked before a training call
constexpr uint32_t kPoisonBits = 0xffffffffu;  // a NaN (cudaMemset 0xff)

// The spacing of float32 values at |v| (the ulp of v's binade; 2^-149 below 2^-126).
long double ulp_f32(long double v) {
  v = fabsl(v);
  if (v < 0x1p-126L) return 0x1p-149L;
  int e;
  frexpl(v, &e);  // v = f 2^e, 0.5 <= f < 1
  return ldexpl(1.0L, e - 24);
}

struct Case {
  int M, K, N;
  float x_offset = 0.f;        // added to every x (cancellation)
  int64_t x_row_stride = 0;    // 0: K
  bool null_vectors = false;   // null bias / bn_weight / bn_bias, and no z / stats in 84's training
  bool momentum_none = false;  // momentum < 0: f = 1 / (kBatchesTracked + 1)
  bool scale_one_number = false;  // scale_stride 0: one scale for every feature (the launchers get
                                  // {scale, NaN, NaN, ...}: reading past it poisons the outputs)
  bool w_non_finite = false;   // W[1][K / 3] = +inf, W[N - 2][K / 2] = NaN: those features' outputs must be NaN
};

// The features a w_non_finite case poisons (N >= 3).
bool poisoned_feature(const Case& c, int n) { return c.w_non_finite && (n == 1 || n == c.N - 2); }

// BatchNormArgs::scale_stride: 0 where one number serves every feature.
int scale_stride(const Case& c) { return c.scale_one_number ? 0 : 1; }

// Problem 84's training without z / stats in the null-vectors case (the launcher's null outputs).
bool saves_z_stats(const Case& c, int p84) { return !(c.null_vectors && p84 == 1); }

struct Inputs {
  std::vector<float> x, w, bias, scale, bn_weight, bn_bias, running_mean, running_var;
  std::vector<float> scale_arg;  // what the launchers read: scale, or scale[0] then NaNs (scale_one_number)
  float eps = 1e-5f;
};

Inputs make_inputs(const Case& c, uint64_t seed) {
  Inputs in;
  const int64_t ld = c.x_row_stride ? c.x_row_stride : c.K;
  std::mt19937_64 gen(seed * 1000003u + static_cast<uint64_t>(c.M) * 7919u + static_cast<uint64_t>(c.K) * 131u + c.N);
  std::normal_distribution<float> normal(0.f, 1.f);
  in.x.assign(static_cast<size_t>(ld) * (c.M - 1) + c.K, 0.f);
  for (int m = 0; m < c.M; ++m)
    for (int k = 0; k < c.K; ++k) in.x[m * ld + k] = normal(gen) + c.x_offset;
  in.w.resize(static_cast<size_t>(c.N) * c.K);
  for (auto& v : in.w) v = normal(gen);
  if (c.w_non_finite) {
    in.w[static_cast<size_t>(1) * c.K + c.K / 3] = INFINITY;
    in.w[static_cast<size_t>(c.N - 2) * c.K + c.K / 2] = NAN;
  }
  std::uniform_real_distribution<float> uni(0.5f, 2.f);
  for (int n = 0; n < c.N; ++n) {
    in.bias.push_back(normal(gen));
    in.scale.push_back(normal(gen));  // either sign
    in.bn_weight.push_back(uni(gen));
    in.bn_bias.push_back(normal(gen));
    in.running_mean.push_back(normal(gen));
    in.running_var.push_back(uni(gen));
  }
  in.scale_arg = in.scale;
  if (c.scale_one_number)
    for (int n = 1; n < c.N; ++n) in.scale[n] = in.scale[0], in.scale_arg[n] = NAN;
  return in;
}

// z_ref (M, N) = sum_k x w in long double (each product exact in double), abs_sum = sum_k |x w|.
void reference_gemm(const Case& c, const Inputs& in, std::vector<long double>& z_ref,
                    std::vector<long double>& abs_sum) {
  const int64_t ld = c.x_row_stride ? c.x_row_stride : c.K;
  z_ref.assign(static_cast<size_t>(c.M) * c.N, 0.L);
  abs_sum.assign(static_cast<size_t>(c.M) * c.N, 0.L);
  const int num_threads = std::max(1u, std::min(64u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (int th = 0; th < num_threads; ++th)
    pool.emplace_back([&, th] {
      for (int n = th; n < c.N; n += num_threads) {
        const float* wr = in.w.data() + static_cast<size_t>(n) * c.K;
        for (int m = 0; m < c.M; ++m) {
          const float* xr = in.x.data() + m * ld;
          long double s = 0.L, a = 0.L;
          for (int k = 0; k < c.K; ++k) {
            const double p = static_cast<double>(xr[k]) * static_cast<double>(wr[k]);  // exact
            s += p;
            a += fabsl(p);
          }
          z_ref[static_cast<size_t>(m) * c.N + n] = s;
          abs_sum[static_cast<size_t>(m) * c.N + n] = a;
        }
      }
    });
  for (auto& t : pool) t.join();
}

float poison_value() {
  float f;
  memcpy(&f, &kPoisonBits, sizeof f);
  return f;
}

std::vector<float> poisoned(size_t n) { return std::vector<float>(n, poison_value()); }

bool all_poisoned(const std::vector<float>& v) {
  for (float f : v) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    if (b != kPoisonBits) return false;
  }
  return true;
}

// Bitwise equality (NaN outputs of a non-finite W row compare equal to themselves).
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// One training call's outputs (z, stats empty where not asked for).
struct TrainOutputs {
  bool rejected = false;  // the launcher returned cudaErrorInvalidValue
  std::vector<float> out, z, stats, running_mean, running_var;
  int64_t num_batches_tracked = 0;
};

// Before the call: out, z, stats poisoned, the running statistics and the counter as seeded.
TrainOutputs fresh_train_outputs(const Case& c, const Inputs& in, bool with_z_stats) {
  TrainOutputs t;
  const size_t MN = static_cast<size_t>(c.M) * c.N;
  t.out = poisoned(MN);
  if (with_z_stats) t.z = poisoned(MN), t.stats = poisoned(2 * static_cast<size_t>(c.N));
  t.running_mean = in.running_mean, t.running_var = in.running_var;
  t.num_batches_tracked = kBatchesTracked;
  return t;
}

struct Outputs {
  TrainOutputs train[2];       // problem 33, 84
  std::vector<float> eval[2];  // problem 33, 84
};

struct Errors {
  // max |err| / ulp_f32(ref): z, train out 33 / 84, eval out 33 / 84, stats, running statistics
  double z = 0, t33 = 0, t84 = 0, e33 = 0, e84 = 0, stats = 0, run = 0;
  long long unwritten = 0, violations = 0;
};

// A float64 value within err of x, rounded once to float64: within this of x.
long double rounded64(long double x, long double err) { return err + kU64 * (fabsl(x) + err); }

// The same value rounded once to float32: |y - x| <= this (the ulp at |x| + err: it may lie past a binade edge).
long double rounded_bound(long double x, long double err) { return 0.5L * ulp_f32(fabsl(x) + err) + err; }

// |sqrt(q / q') - 1| for every q' within e of q > 0 (the relative error of 1 / sqrt(q'));
// NaN where e >= q (no bound: the element is reported as a violation).
long double rsqrt_rel(long double q, long double e) { return e < q ? sqrtl(q / (q - e)) - 1.L : NAN; }

// |a64 x64 - a x| for |a64 - a| <= rho |a| and |x64 - x| <= dx.
long double product_err(long double a, long double rho, long double x, long double dx) {
  return fabsl(a) * (dx * (1.L + rho) + fabsl(x) * rho);
}

void note(double& max_ulps, long long& violations, long double got, long double ref, long double allowed,
          const char* what, const Case& c, int m, int n) {
  const long double err = fabsl(got - ref);
  max_ulps = std::max(max_ulps, static_cast<double>(err / ulp_f32(ref)));
  if (!(err <= allowed)) {
    if (violations < 5)
      fprintf(stderr, "  %s M=%d K=%d N=%d m=%d n=%d: got %.9g ref %.12Lg err %.3Lg > allowed %.3Lg\n", what, c.M, c.K,
              c.N, m, n, static_cast<double>(got), ref, err, allowed);
    ++violations;
  }
}

// An element expected finite: counted as unwritten where NaN, else checked against its bound.
void check(Errors& e, double& max_ulps, float got, long double ref, long double err64, const char* what,
           const Case& c, int m, int n) {
  if (std::isnan(got))
    ++e.unwritten;
  else
    note(max_ulps, e.violations, got, ref, rounded_bound(ref, err64), what, c, m, n);
}

// Problem 84's softmax of row m of v (v64 within v_err of v elementwise) against out's row.
void check_softmax_row(Errors& e, double& max_ulps, const long double* v, const long double* v_err, const float* out,
                       const char* what, const Case& c, int m) {
  const int N = c.N;
  long double v_max = -HUGE_VALL, err_max = 0.L, t_max = 0.L;
  for (int j = 0; j < N; ++j) v_max = std::max(v_max, v[j]), err_max = std::max(err_max, v_err[j]);
  long double sum = 0.L;
  for (int j = 0; j < N; ++j) sum += expl(v[j] - v_max), t_max = std::max(t_max, v_max - v[j]);
  // L_j: input j's error and the rounding of v64_j - max64 (|v64_j - max64| <= v_max - v_j + 2 err_max).
  const long double l_max = err_max + kU64 * (t_max + 2.L * err_max);
  for (int j = 0; j < N; ++j) {
    const long double p = expl(v[j] - v_max) / sum;
    const long double l = v_err[j] + kU64 * (v_max - v[j] + 2.L * err_max);
    check(e, max_ulps, out[j], p, p * expm1l(l + l_max + (N + 8) * kU64) + kExpUnderflow, what, c, m, j);
  }
}

Errors compare(const Case& c, const Inputs& in, const Outputs& o) {
  std::vector<long double> z_ref, abs_sum;
  reference_gemm(c, in, z_ref, abs_sum);
  Errors e;
  const int M = c.M, N = c.N;
  const size_t MN = static_cast<size_t>(M) * N;
  const long double u = kU64, eps = in.eps;
  const long double delta_per_abs = (c.K + 8) * u + c.K * kULd;  // delta / A
  // f: the float momentum converts exactly; 1.0 / (count + 1) is rounded once.
  const long double f = c.momentum_none ? 1.L / (kBatchesTracked + 1) : static_cast<long double>(kMomentum);
  const long double f_err = c.momentum_none ? u * f : 0.L;

  for (int p84 = 0; p84 < 2; ++p84) {
    const TrainOutputs& t = o.train[p84];
    bool ok = t.rejected == (M < 2);
    if (M < 2)  // the refused call writes nothing
      ok = ok && all_poisoned(t.out) && all_poisoned(t.z) && all_poisoned(t.stats) &&
           same_bits(t.running_mean, in.running_mean) && same_bits(t.running_var, in.running_var) &&
           t.num_batches_tracked == kBatchesTracked;
    else
      ok = ok && t.num_batches_tracked == kBatchesTracked + 1;
    if (!ok) {
      fprintf(stderr, "  train (%d) M=%d: %s, num_batches_tracked %lld\n", p84 ? 84 : 33, M,
              t.rejected ? "refused" : "ran", static_cast<long long>(t.num_batches_tracked));
      ++e.violations;
    }
  }

  // Problem 84's softmax inputs v, [0] train and [1] eval, and bounds on their float64 errors.
  std::vector<long double> v84[2], v84_err[2];
  for (int mode = 0; mode < 2; ++mode) v84[mode].assign(MN, 0.L), v84_err[mode].assign(MN, 0.L);
  std::vector<long double> delta(M), dev(M);
  for (int n = 0; n < N; ++n) {
    const auto at = [&](int m) { return static_cast<size_t>(m) * N + n; };
    if (poisoned_feature(c, n)) {  // a non-finite W row: the feature's outputs NaN (84's: every row, below)
      long long not_nan = 0;
      for (int m = 0; m < M; ++m) not_nan += !std::isnan(o.eval[0][at(m)]);
      for (int p84 = 0; p84 < 2 && M >= 2; ++p84) {
        const TrainOutputs& t = o.train[p84];
        not_nan += !std::isnan(t.running_mean[n]) + !std::isnan(t.running_var[n]);
        if (!t.stats.empty()) not_nan += !std::isnan(t.stats[n]) + !std::isnan(t.stats[N + n]);
        for (int m = 0; m < M; ++m) {
          if (!t.z.empty()) not_nan += !std::isnan(t.z[at(m)]);
          if (p84 == 0) not_nan += !std::isnan(t.out[at(m)]);
        }
      }
      if (not_nan) fprintf(stderr, "  feature %d with a non-finite W row: %lld outputs not NaN\n", n, not_nan);
      e.violations += not_nan;
      continue;
    }
    const long double bias = c.null_vectors ? 0.L : in.bias[n], gamma = c.null_vectors ? 1.L : in.bn_weight[n],
                      beta = c.null_vectors ? 0.L : in.bn_bias[n], s = in.scale[n];
    long double mean = 0.L, sum_delta = 0.L, abs_z = 0.L;
    for (int m = 0; m < M; ++m) {
      delta[m] = delta_per_abs * abs_sum[at(m)];
      mean += z_ref[at(m)];
      sum_delta += delta[m];
      abs_z += fabsl(z_ref[at(m)]) + delta[m];
    }
    mean /= M;

    // Eval: y64 = fma(z64, a, c), a = s g, g = gamma / sqrt(running_var + eps) (radicand, sqrt
    // and divide rounded: rho_g; a: one more), c per problem as small_m_feature_epilogue forms it.
    const long double rm0 = in.running_mean[n], rv0 = in.running_var[n];
    const long double q_eval = rv0 + eps, g_eval = gamma / sqrtl(q_eval), a_eval = s * g_eval;
    const long double rho_g = rsqrt_rel(q_eval, u * q_eval) + 2.L * u;
    for (int p84 = 0; p84 < 2; ++p84) {
      // 33: c = fma(fma(s, bias, -rm), g, beta);  84: c = s fma(bias - rm, g, beta).
      const long double h = p84 ? bias - rm0 : s * bias - rm0, inner = h * g_eval + beta;
      const long double inner_err = rounded64(inner, product_err(g_eval, rho_g, h, u * fabsl(h)));
      const long double cc = p84 ? s * inner : inner, cc_err = p84 ? rounded64(cc, fabsl(s) * inner_err) : inner_err;
      for (int m = 0; m < M; ++m) {
        const long double ref = a_eval * z_ref[at(m)] + cc;
        const long double err = rounded64(ref, product_err(a_eval, rho_g + u, z_ref[at(m)], delta[m]) + cc_err);
        if (p84)
          v84[1][at(m)] = ref, v84_err[1][at(m)] = err;
        else
          check(e, e.e33, o.eval[0][at(m)], ref, err, "eval (33)", c, m, n);
      }
    }
    if (M < 2) continue;  // training refused (checked above)

    // Training: the batch statistics of z64 (E_mean, E_M2 of the header).
    long double m2 = 0.L, dev_delta = 0.L, delta_sq = 0.L;
    for (int m = 0; m < M; ++m) {
      dev[m] = z_ref[at(m)] - mean;
      m2 += dev[m] * dev[m], dev_delta += fabsl(dev[m]) * delta[m], delta_sq += delta[m] * delta[m];
    }
    const long double var = m2 / M;
    const long double mean_err = sum_delta / M + (M + 1) * u * abs_z / M;
    const long double pert = 2.L * dev_delta + delta_sq + 2.L * mean_err * sum_delta + M * mean_err * mean_err;
    const long double m2_err = pert + (M + 3) * u * (m2 + pert);
    const long double var_err = rounded64(var, m2_err / M);
    for (int p84 = 0; p84 < 2; ++p84) {
      const TrainOutputs& t = o.train[p84];
      // The backward's z and mean, centred: z - mean (z64 - mean64, one float64 rounding) and 0.
      for (int m = 0; m < M && !t.z.empty(); ++m)
        check(e, e.z, t.z[at(m)], dev[m], rounded64(dev[m], delta[m] + mean_err), "z - mean", c, m, n);
      if (!t.stats.empty()) {
        check(e, e.stats, t.stats[n], 0.L, 0.L, "stats mean (0)", c, -1, n);
        check(e, e.stats, t.stats[N + n], var, var_err, "stats var", c, -1, n);
      }
      // Running statistics of s_u (z + bias): (1 - f) r + f s_u (mean + bias), (1 - f) r + f s_u^2 M2 / (M - 1).
      const long double su = p84 ? 1.L : s, unbiased = m2 / (M - 1), unbiased_err = m2_err / (M - 1);
      const long double rm1 = (1.L - f) * rm0 + f * su * (mean + bias);
      const long double rm_err =
          fabsl(f * su) * mean_err + f_err * (fabsl(rm0) + fabsl(su * (mean + bias))) +
          4.L * u * (fabsl((1.L - f) * rm0) + fabsl(f * su) * (fabsl(mean) + fabsl(bias) + mean_err));
      const long double rv1 = (1.L - f) * rv0 + f * su * su * unbiased;
      const long double rv_err = f * su * su * unbiased_err + f_err * (rv0 + su * su * unbiased) +
                                 6.L * u * ((1.L - f) * rv0 + f * su * su * (unbiased + unbiased_err));
      check(e, e.run, t.running_mean[n], rm1, rm_err, "running_mean", c, -1, n);
      check(e, e.run, t.running_var[n], rv1, rv_err, "running_var", c, -1, n);
      // BatchNorm: y64 = fma(z64 - mean64, a, c); 33: a = s gamma / sqrt(s^2 var + eps), c = beta;
      // 84: a = s (gamma / sqrt(var + eps)), c = s beta.
      const long double q = p84 ? var + eps : s * s * var + eps;
      const long double q_err =
          p84 ? rounded64(q, var_err) : s * s * var_err + 4.L * u * (s * s * (var + var_err) + eps);
      const long double a = s * gamma / sqrtl(q), rho_a = rsqrt_rel(q, q_err) + 4.L * u;
      const long double cc = p84 ? s * beta : beta, cc_err = p84 ? u * fabsl(cc) : 0.L;
      for (int m = 0; m < M; ++m) {
        const long double ref = a * dev[m] + cc;
        const long double dev_err = rounded64(dev[m], delta[m] + mean_err);  // z64 - mean64
        const long double err = rounded64(ref, product_err(a, rho_a, dev[m], dev_err) + cc_err);
        if (p84)
          v84[0][at(m)] = ref, v84_err[0][at(m)] = err;
        else
          check(e, e.t33, t.out[at(m)], ref, err, "train (33)", c, m, n);
      }
    }
  }

  // Problem 84's outputs: the softmax of each row (a non-finite W row makes every row NaN).
  for (int mode = 0; mode < 2; ++mode) {
    if (mode == 0 && M < 2) continue;
    const std::vector<float>& out = mode ? o.eval[1] : o.train[1].out;
    for (int m = 0; m < M; ++m) {
      const size_t row = static_cast<size_t>(m) * N;
      if (!c.w_non_finite) {
        check_softmax_row(e, mode ? e.e84 : e.t84, v84[mode].data() + row, v84_err[mode].data() + row,
                          out.data() + row, mode ? "eval (84)" : "train (84)", c, m);
        continue;
      }
      long long not_nan = 0;
      for (int j = 0; j < N; ++j) not_nan += !std::isnan(out[row + j]);
      if (not_nan) fprintf(stderr, "  %s row %d with a non-finite W row: %lld outputs not NaN\n",
                           mode ? "eval (84)" : "train (84)", m, not_nan);
      e.violations += not_nan;
    }
  }
  return e;
}

#if !defined(SMALL_M_CHECK_HOST_ONLY) || defined(SMALL_M_CHECK_EMULATE)
// The vectors as the launchers see them (device pointers, or host ones under the emulation).
struct VectorPointers {
  const float *bias, *scale, *bn_weight, *bn_bias;
};

// The BatchNorm side of a call of problem 84 (p84) or 33 on the given running statistics.
fused_gemm_bn::BatchNormArgs batch_norm_args(const Case& c, const Inputs& in, bool p84, const VectorPointers& v,
                                             float* running_mean, float* running_var) {
  fused_gemm_bn::BatchNormArgs bn;
  bn.bias = c.null_vectors ? nullptr : v.bias;
  bn.scale = v.scale;
  bn.bn_weight = c.null_vectors ? nullptr : v.bn_weight;
  bn.bn_bias = c.null_vectors ? nullptr : v.bn_bias;
  bn.running_mean = running_mean;
  bn.running_var = running_var;
  bn.momentum = c.momentum_none ? -1.f : kMomentum;
  bn.eps = in.eps;
  bn.scale_after_bn = p84;
  bn.scale_stride = scale_stride(c);
  return bn;
}
#endif

#if defined(SMALL_M_CHECK_EMULATE)
float* data_or_null(std::vector<float>& v) { return v.empty() ? nullptr : v.data(); }

// The launchers themselves, their kernels run on the host by the shim of
// tools/small_m_emulate.py (one OS thread per CUDA thread, DMMA fragments exchanged per warp).
Outputs run_launchers_emulated(const Case& c, const Inputs& in) {
  using namespace fused_gemm_bn;
  const int64_t ld = c.x_row_stride ? c.x_row_stride : c.K;
  const VectorPointers vectors{in.bias.data(), in.scale_arg.data(), in.bn_weight.data(), in.bn_bias.data()};
  Outputs o;
  for (int p84 = 0; p84 < 2; ++p84) {
    const int64_t ws_bytes = small_m_fp64_workspace_bytes(c.M, c.N, c.K, g_emu_num_sms, p84 == 1);
    std::vector<double> ws(std::max<int64_t>(1, ws_bytes / 8), NAN);
    void* workspace = ws_bytes ? ws.data() : nullptr;
    TrainOutputs& t = o.train[p84];
    t = fresh_train_outputs(c, in, saves_z_stats(c, p84));
    const cudaError_t err = small_m_fp64_train(
        in.x.data(), ld, in.w.data(), c.M, c.N, c.K,
        batch_norm_args(c, in, p84 == 1, vectors, t.running_mean.data(), t.running_var.data()),
        &t.num_batches_tracked, t.out.data(), data_or_null(t.z), data_or_null(t.stats), workspace, nullptr);
    t.rejected = err == cudaErrorInvalidValue;
    if (err != cudaSuccess && !t.rejected) abort();
    std::vector<float> running_mean = in.running_mean, running_var = in.running_var;  // eval only reads them
    o.eval[p84] = poisoned(static_cast<size_t>(c.M) * c.N);
    if (small_m_fp64_eval(in.x.data(), ld, in.w.data(), c.M, c.N, c.K,
                          batch_norm_args(c, in, p84 == 1, vectors, running_mean.data(), running_var.data()),
                          o.eval[p84].data(), workspace, nullptr) != cudaSuccess)
      abort();
  }
  return o;
}
#elif defined(SMALL_M_CHECK_HOST_ONLY)
// The kernel's arithmetic on the host: float64 sums of exact products (in k order
// here), then small_m_fp64.cu's epilogue and softmax formulas in float64, each
// output rounded once.

// Feature n's epilogue (small_m_feature_epilogue) from the float64 sums zd (M, N): y (M, N)
// = problem 33's out or 84's softmax input in float64; training (t not null): t's z,
// stats and running statistics, from the counter before this call's increment.
void emulated_epilogue(const Case& c, const Inputs& in, bool p84, TrainOutputs* t, int n,
                       const std::vector<double>& zd, std::vector<double>& y) {
  const int M = c.M, N = c.N;
  const double bias = c.null_vectors ? 0.0 : in.bias[n], gamma = c.null_vectors ? 1.0 : in.bn_weight[n];
  const double beta = c.null_vectors ? 0.0 : in.bn_bias[n], s = in.scale[n], eps = in.eps;
  double a, cc, shift = 0.0;
  if (t == nullptr) {
    const double g = gamma / std::sqrt(static_cast<double>(in.running_var[n]) + eps);
    const double rm = in.running_mean[n];
    a = s * g;
    cc = p84 ? s * std::fma(bias - rm, g, beta) : std::fma(std::fma(s, bias, -rm), g, beta);
  } else {
    double mean = 0.0;
    for (int m = 0; m < M; ++m) mean += zd[static_cast<size_t>(m) * N + n];
    mean /= M;
    double m2 = 0.0;
    for (int m = 0; m < M; ++m) {
      const double z = zd[static_cast<size_t>(m) * N + n];
      m2 = std::fma(z - mean, z - mean, m2);
      if (!t->z.empty()) t->z[static_cast<size_t>(m) * N + n] = static_cast<float>(z - mean);
    }
    const double var = m2 / M;
    if (!t->stats.empty()) t->stats[n] = static_cast<float>(mean - mean), t->stats[N + n] = static_cast<float>(var);
    const double su = p84 ? 1.0 : s;
    const double f = c.momentum_none ? 1.0 / static_cast<double>(t->num_batches_tracked + 1) : kMomentum;
    t->running_mean[n] = static_cast<float>((1.0 - f) * t->running_mean[n] + f * su * (mean + bias));
    t->running_var[n] = static_cast<float>((1.0 - f) * t->running_var[n] + f * su * su * (m2 / (M - 1)));
    a = p84 ? s * (gamma / std::sqrt(var + eps)) : s * gamma / std::sqrt(s * s * var + eps);
    cc = p84 ? s * beta : beta;
    shift = mean;
  }
  for (int m = 0; m < M; ++m)
    y[static_cast<size_t>(m) * N + n] = std::fma(zd[static_cast<size_t>(m) * N + n] - shift, a, cc);
}

// out from the float64 y: rounded once (33), or each row's softmax in float64 (84,
// small_m_softmax_fp64_kernel; summed in order here).
void emulated_output(const Case& c, bool p84, const std::vector<double>& y, std::vector<float>& out) {
  for (int m = 0; m < c.M; ++m) {
    const double* row = y.data() + static_cast<size_t>(m) * c.N;
    float* out_row = out.data() + static_cast<size_t>(m) * c.N;
    if (!p84) {
      for (int j = 0; j < c.N; ++j) out_row[j] = static_cast<float>(row[j]);
      continue;
    }
    double row_max = -INFINITY, sum = 0.0;
    for (int j = 0; j < c.N; ++j) row_max = std::fmax(row_max, row[j]);
    for (int j = 0; j < c.N; ++j) sum += std::exp(row[j] - row_max);
    const double inv = 1.0 / sum;
    for (int j = 0; j < c.N; ++j) out_row[j] = static_cast<float>(std::exp(row[j] - row_max) * inv);
  }
}

Outputs run_emulated(const Case& c, const Inputs& in) {
  const int64_t ld = c.x_row_stride ? c.x_row_stride : c.K;
  const size_t MN = static_cast<size_t>(c.M) * c.N;
  std::vector<double> zd(MN), y(MN);
  for (int n = 0; n < c.N; ++n)
    for (int m = 0; m < c.M; ++m) {
      const float* xr = in.x.data() + m * ld;
      const float* wr = in.w.data() + static_cast<size_t>(n) * c.K;
#ifdef SMALL_M_CHECK_NEGATIVE_CONTROL
      float s = 0.f;  // float32 accumulation (what the check must reject)
#else
      double s = 0.0;
#endif
      for (int k = 0; k < c.K; ++k) s = std::fma(static_cast<decltype(s)>(xr[k]), static_cast<decltype(s)>(wr[k]), s);
      zd[static_cast<size_t>(m) * c.N + n] = s;
    }
  Outputs o;
  for (int p84 = 0; p84 < 2; ++p84) {
    TrainOutputs& t = o.train[p84];
    t = fresh_train_outputs(c, in, saves_z_stats(c, p84));
    t.rejected = c.M < 2;  // the training launcher's precondition
    if (!t.rejected) {
      for (int n = 0; n < c.N; ++n) emulated_epilogue(c, in, p84 == 1, &t, n, zd, y);
      ++t.num_batches_tracked;
      emulated_output(c, p84 == 1, y, t.out);
    }
    o.eval[p84] = poisoned(MN);
    for (int n = 0; n < c.N; ++n) emulated_epilogue(c, in, p84 == 1, nullptr, n, zd, y);
    emulated_output(c, p84 == 1, y, o.eval[p84]);
  }
#ifdef SMALL_M_CHECK_NEGATIVE_CONTROL
  o.eval[0][0] = poison_value();  // an unwritten element
#endif
  return o;
}
#else
struct Timing {
  double train33_us = 0, train84_us = 0, floor_us = 0;  // 0: not timed (M = 1: training refused)
};

double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <class F>
double median_us(F&& launch, cudaStream_t stream) {
  cudaEvent_t start, stop;
  CUDA_OK(cudaEventCreate(&start));
  CUDA_OK(cudaEventCreate(&stop));
  for (int r = 0; r < 3; ++r) launch();
  std::vector<float> ms;
  for (int r = 0; r < 20; ++r) {
    CUDA_OK(cudaEventRecord(start, stream));
    launch();
    CUDA_OK(cudaEventRecord(stop, stream));
    CUDA_OK(cudaEventSynchronize(stop));
    float t = 0;
    CUDA_OK(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  CUDA_OK(cudaEventDestroy(start));
  CUDA_OK(cudaEventDestroy(stop));
  return 1000.0 * median(ms);
}

// The exact conversions of small_m_fp64.cu against ldexp, on every 256th float
// bit pattern (subnormals, zeros, non-finite values and the extremes included), and the
// integer-only x conversion against the exact one: mismatches.
__global__ void conversion_check_kernel(unsigned long long* mismatches) {
  const uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint32_t bits = static_cast<uint32_t>(i * 256u + (i % 251u));  // vary the low bits too
  const uint32_t extremes[] = {0u, 0x80000000u, 1u, 0x80000001u, 0x007fffffu, 0x00800000u, 0x7f7fffffu, 0xff7fffffu};
  for (int j = 0; j < (i == 0 ? 9 : 1); ++j) {
    const float f = __uint_as_float(j == 8 || i != 0 ? bits : extremes[j]);
    const double lo = fused_gemm_bn::f32_to_f64_times_2m896(f), hi = fused_gemm_bn::f32_to_f64_times_2p896(f);
    bool subnormal = false;
    const double fast = fused_gemm_bn::f32_to_f64_times_2p896_fast(f, subnormal);
    // The integer-only form: flags exactly the subnormals, and equals the exact form elsewhere.
    const bool is_subnormal = f != 0.f && fabsf(f) < 0x1p-126f;
    const bool fast_ok = !isfinite(f) ? isinf(fast) == isinf(f) && isnan(fast) == isnan(f)
                                      : is_subnormal || __double_as_longlong(fast) == __double_as_longlong(hi);
    if (subnormal != is_subnormal || !fast_ok) atomicAdd(mismatches, 1ull);
    if (!isfinite(f)) {  // x's conversion keeps infinities and NaNs (W's does not: W must be finite)
      if (isinf(hi) != isinf(f) || isnan(hi) != isnan(f)) atomicAdd(mismatches, 1ull);
      continue;
    }
    if (__double_as_longlong(lo) != __double_as_longlong(ldexp(static_cast<double>(f), -896)) ||
        __double_as_longlong(hi) != __double_as_longlong(ldexp(static_cast<double>(f), 896)))
      atomicAdd(mismatches, 1ull);
  }
}

unsigned long long conversion_mismatches() {
  unsigned long long* d = nullptr;
  CUDA_OK(cudaMalloc(&d, sizeof *d));
  CUDA_OK(cudaMemset(d, 0, sizeof *d));
  conversion_check_kernel<<<(1u << 24) / 256, 256>>>(d);
  CUDA_OK(cudaGetLastError());
  unsigned long long n = 0;
  CUDA_OK(cudaMemcpy(&n, d, sizeof n, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaFree(d));
  return n;
}

bool same_train(const TrainOutputs& a, const TrainOutputs& b) {
  return a.rejected == b.rejected && same_bits(a.out, b.out) && same_bits(a.z, b.z) && same_bits(a.stats, b.stats) &&
         same_bits(a.running_mean, b.running_mean) && same_bits(a.running_var, b.running_var) &&
         a.num_batches_tracked == b.num_batches_tracked;
}

template <class T>
T* to_device(const std::vector<T>& v) {
  T* d = nullptr;
  CUDA_OK(cudaMalloc(&d, std::max<size_t>(1, v.size()) * sizeof(T)));
  CUDA_OK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

template <class T>
std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> v(n);
  CUDA_OK(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

void poison(void* d, size_t bytes, cudaStream_t stream) {
  CUDA_OK(cudaMemsetAsync(d, 0xff, bytes, stream));  // 0xffffffff: a NaN (kPoisonBits)
}

Outputs run_gpu(const Case& c, const Inputs& in, bool& deterministic, Timing& timing) {
  using namespace fused_gemm_bn;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  int device = 0, num_sms = 0;
  CUDA_OK(cudaGetDevice(&device));
  CUDA_OK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t ld = c.x_row_stride ? c.x_row_stride : c.K;
  const size_t MN = static_cast<size_t>(c.M) * c.N, N = c.N;
  float *x = to_device(in.x), *w = to_device(in.w);
  float *bias = to_device(in.bias), *scale = to_device(in.scale_arg), *bn_weight = to_device(in.bn_weight),
        *bn_bias = to_device(in.bn_bias);
  // eval reads the seeded running statistics; training updates its own copies, reset before each call
  float *running_mean = to_device(in.running_mean), *running_var = to_device(in.running_var);
  float *train_mean = to_device(in.running_mean), *train_var = to_device(in.running_var);
  int64_t* count = to_device(std::vector<int64_t>{kBatchesTracked});
  float *out, *z, *stats, *copy;
  CUDA_OK(cudaMalloc(&out, MN * sizeof(float)));
  CUDA_OK(cudaMalloc(&z, MN * sizeof(float)));
  CUDA_OK(cudaMalloc(&stats, 2 * N * sizeof(float)));
  CUDA_OK(cudaMalloc(&copy, in.w.size() * sizeof(float)));
  const int64_t ws_bytes = std::max(small_m_fp64_workspace_bytes(c.M, c.N, c.K, num_sms, false),
                                    small_m_fp64_workspace_bytes(c.M, c.N, c.K, num_sms, true));
  void* workspace = nullptr;
  if (ws_bytes > 0) {
    CUDA_OK(cudaMalloc(&workspace, ws_bytes));
    poison(workspace, ws_bytes, stream);
  }
  const VectorPointers vectors{bias, scale, bn_weight, bn_bias};

  auto launch_train = [&](int p84) {
    const bool saves = saves_z_stats(c, p84);
    return small_m_fp64_train(x, ld, w, c.M, c.N, c.K,
                              batch_norm_args(c, in, p84 == 1, vectors, train_mean, train_var),
                              count, out,
                              saves ? z : nullptr, saves ? stats : nullptr, workspace, stream);
  };
  // One training call from the seeded running statistics and counter, its outputs poisoned.
  auto run_train = [&](int p84) {
    TrainOutputs t = fresh_train_outputs(c, in, saves_z_stats(c, p84));
    CUDA_OK(cudaMemcpyAsync(train_mean, in.running_mean.data(), N * sizeof(float), cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaMemcpyAsync(train_var, in.running_var.data(), N * sizeof(float), cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaMemcpyAsync(count, &kBatchesTracked, sizeof(int64_t), cudaMemcpyHostToDevice, stream));
    poison(out, MN * sizeof(float), stream), poison(z, MN * sizeof(float), stream);
    poison(stats, 2 * N * sizeof(float), stream);
    const cudaError_t err = launch_train(p84);
    if (err != cudaErrorInvalidValue) CUDA_OK(err);
    t.rejected = err == cudaErrorInvalidValue;
    CUDA_OK(cudaStreamSynchronize(stream));
    t.out = to_host(out, MN);
    if (!t.z.empty()) t.z = to_host(z, MN), t.stats = to_host(stats, 2 * N);
    t.running_mean = to_host(train_mean, N), t.running_var = to_host(train_var, N);
    t.num_batches_tracked = to_host(count, 1)[0];
    return t;
  };
  auto run_eval = [&](int p84) {
    poison(out, MN * sizeof(float), stream);
    CUDA_OK(small_m_fp64_eval(x, ld, w, c.M, c.N, c.K,
                              batch_norm_args(c, in, p84 == 1, vectors, running_mean, running_var),
                              out, workspace, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    return to_host(out, MN);
  };

  Outputs o;
  deterministic = true;
  for (int p84 = 0; p84 < 2; ++p84) {
    o.train[p84] = run_train(p84);
    deterministic = deterministic && same_train(run_train(p84), o.train[p84]);
    o.eval[p84] = run_eval(p84);
    deterministic = deterministic && same_bits(run_eval(p84), o.eval[p84]);
  }

  if (c.M >= 2 && getenv("SMALL_M_CHECK_NO_TIMING") == nullptr) {
    timing.train33_us = median_us([&] { CUDA_OK(launch_train(0)); }, stream);
    timing.train84_us = median_us([&] { CUDA_OK(launch_train(1)); }, stream);
    timing.floor_us = 0.5 * median_us(
                                [&] {
                                  CUDA_OK(cudaMemcpyAsync(copy, w, in.w.size() * sizeof(float),
                                                          cudaMemcpyDeviceToDevice, stream));
                                },
                                stream);
  }

  for (float* p : {x, w, bias, scale, bn_weight, bn_bias, running_mean, running_var, train_mean, train_var, out, z,
                   stats, copy})
    CUDA_OK(cudaFree(p));
  CUDA_OK(cudaFree(count));
  if (workspace) CUDA_OK(cudaFree(workspace));
  CUDA_OK(cudaStreamDestroy(stream));
  return o;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  const uint64_t seed = argc > 1 ? strtoull(argv[1], nullptr, 10) : 1;
  std::vector<Case> cases;
  // The grid of shapes (M x (K, N)), then, without SMALL_M_CHECK_CASE, the special
  // cases: cancellation (x + 100), null vectors, momentum=None, non-finite W rows.
#if defined(SMALL_M_CHECK_EMULATE)
  // Small shapes (the emulation runs 512 OS threads per GEMM CTA, 1024 per softmax row):
  // the smallest training batch (2), both sides of the batch-block boundary (8 | 9) and
  // the largest batch (16), K tails, 16- and 4-byte loads, split and unsplit K
  // (argument 2: the SM count the launchers plan with; 1 leaves K unsplit: 8, 9, 16 and
  // 32 stages a piece, the 4-stage ring read in pairs, 9 ending on a single stage).
  const int Ms[] = {1, 2, 8, 9, 16};
  const int KN[][2] = {{1, 3}, {37, 70}, {1000, 100}, {1100, 70}, {2001, 65}, {4096, 96}};
  const Case cancel{16, 4096, 96}, null_vectors{15, 1000, 100}, momentum_none{9, 2001, 65};
  if (argc > 2) fused_gemm_bn::g_emu_num_sms = atoi(argv[2]);
  if (argc > 3) fused_gemm_bn::g_emu_smem_optin = atoi(argv[3]);  // below 4 stages' bytes: the 2-stage ring
  if (argc > 4) g_emu_binary_version = atoi(argv[4]);  // 80: no sm_90a image, the cp.async ring on Hopper too
#elif defined(SMALL_M_CHECK_HOST_ONLY)
  const int Ms[] = {1, 3, 9, 16};
  const int KN[][2] = {{257, 33}, {4095, 13}, {64, 100}};
  const Case cancel{16, 4096, 512}, null_vectors{15, 1024, 1000}, momentum_none{12, 4095, 513};
#else
  const int Ms[] = {1, 2, 3, 4, 8, 9, 12, 15, 16};
  // (K = 4096, N = 8192: the 8192 x 8192 grid's CTAs over half the stages; the two give the
  // launch's fixed and per-stage costs, docs/perf.md v56.  N = 8512: 133 feature blocks, more
  // than a 132-SM GPU holds at once: the kernels one after another instead of the cooperative grid.)
  const int KN[][2] = {{8192, 8192}, {4096, 8192}, {8000, 4096}, {4095, 513}, {4096, 512}, {1024, 1000},
                       {1024, 8512}};
  const Case cancel{16, 4096, 512}, null_vectors{15, 1024, 1000}, momentum_none{12, 4095, 513};
#endif
  // SMALL_M_CHECK_CASE=MxKxN: that one case only (to profile one shape, e.g. under ncu).
  const char* only = getenv("SMALL_M_CHECK_CASE");
  for (const auto& kn : KN)
    for (int M : Ms) {
      Case c{M, kn[0], kn[1]};
      char name[64];
      snprintf(name, sizeof name, "%dx%dx%d", M, kn[0], kn[1]);
      if (only != nullptr && strcmp(only, name) != 0) continue;
      cases.push_back(c);
    }
  if (only == nullptr) {
    Case c = cancel, d = null_vectors, m = momentum_none;
    c.x_offset = 100.f;
    d.null_vectors = true;
    m.momentum_none = m.scale_one_number = true;
    cases.push_back(c);
    cases.push_back(d);
    cases.push_back(m);
#if !defined(SMALL_M_CHECK_HOST_ONLY) || defined(SMALL_M_CHECK_EMULATE)
    Case f = cancel, g = null_vectors;  // the kernel's non-finite W handling (split and unsplit K)
    f.w_non_finite = g.w_non_finite = true;
    cases.push_back(f);
    cases.push_back(g);
#endif
  }
  for (Case& c : cases)
    if (c.K % 2 == 1) c.x_row_stride = c.K + 5;  // odd K: rows of x apart (stride > K)

#ifndef SMALL_M_CHECK_HOST_ONLY
  cudaDeviceProp prop;
  int device = 0;
  CUDA_OK(cudaGetDevice(&device));
  CUDA_OK(cudaGetDeviceProperties(&prop, device));
  printf("device %s (cc %d.%d, %d SMs), seed %llu\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount,
         static_cast<unsigned long long>(seed));
  const unsigned long long bad_conversions = conversion_mismatches();
  printf("exact float -> double conversions (2^24 bit patterns): %llu mismatches\n", bad_conversions);
#endif
  printf("max error in float32 ulps: z; out of train 33 / 84, eval 33 / 84; stats; running stats.  "
         "us: train launchers 33 / 84, floor; ratio: t33 / floor\n");
  printf("%4s %5s %5s %6s %6s %6s %6s %6s %6s %6s %7s %7s %7s %6s  %s\n", "M", "K", "N", "z", "t33", "t84", "e33",
         "e84", "stats", "run", "t33_us", "t84_us", "floor", "ratio", "note");
  bool fail = false;
#ifndef SMALL_M_CHECK_HOST_ONLY
  fail = bad_conversions != 0;
#endif
  for (const Case& c : cases) {
    const Inputs in = make_inputs(c, seed);
    bool deterministic = true;
    char times[40] = "      -       -       -      -";
#if defined(SMALL_M_CHECK_EMULATE)
    const Outputs o = run_launchers_emulated(c, in);
#elif defined(SMALL_M_CHECK_HOST_ONLY)
    const Outputs o = run_emulated(c, in);
#else
    Timing timing;
    const Outputs o = run_gpu(c, in, deterministic, timing);
    if (timing.floor_us > 0)
      snprintf(times, sizeof times, "%7.1f %7.1f %7.1f %6.3f", timing.train33_us, timing.train84_us, timing.floor_us,
               timing.train33_us / timing.floor_us);
#endif
    const Errors e = compare(c, in, o);
    const bool bad = e.unwritten > 0 || e.violations > 0 || !deterministic;
    fail = fail || bad;
    char note_text[160];
    snprintf(note_text, sizeof note_text, "%s%s%s%s%s%s%s%s", c.x_offset != 0.f ? "x+100 " : "",
             c.x_row_stride ? "strided-x " : "", c.null_vectors ? "null-vectors " : "",
             c.momentum_none ? "momentum-None " : "", c.scale_one_number ? "one-scale " : "",
             c.w_non_finite ? "non-finite-W " : "",
             deterministic ? "" : "NONDETERMINISTIC ", bad ? "FAIL" : "ok");
    printf("%4d %5d %5d", c.M, c.K, c.N);
    const double errors[] = {e.z, e.t33, e.t84, e.e33, e.e84, e.stats, e.run};
    const bool trained[] = {true, true, true, false, false, true, true};  // "-" at M = 1 (training refused)
    for (int i = 0; i < 7; ++i)
      if (c.M < 2 && trained[i])
        printf(" %6s", "-");
      else
        printf(errors[i] < 999.9995 ? " %6.3f" : " %6.0e", errors[i]);  // a failure's huge error keeps the width
    printf(" %s  %s", times, note_text);
    if (e.unwritten || e.violations) printf(" (unwritten %lld, violations %lld)", e.unwritten, e.violations);
    printf("\n");
    fflush(stdout);
  }
  return fail ? 1 : 0;
}
