// small_m_check.cu -- standalone GPU check of kernels/small_m_fp64.cu (no torch):
// correctness of both launchers against a host reference, determinism, and the
// train launcher's time next to the W-read floor.
//
// Build and run (repository root):
//   nvcc -std=c++17 -O3 -I kernels -arch=sm_90a tools/small_m_check.cu -o /tmp/small_m_check && /tmp/small_m_check
//   (sm_80 .. sm_89: -arch=sm_80; optional argument: a seed, default 1)
// Host-only self-test of the reference and comparison logic (no GPU; the
// launchers replaced by a float64 CPU emulation of the kernel's arithmetic):
//   g++ -std=c++17 -O2 -x c++ -DSMALL_M_CHECK_HOST_ONLY tools/small_m_check.cu -o /tmp/small_m_check_host -lpthread
// (exit 0); with -DSMALL_M_CHECK_NEGATIVE_CONTROL too, the emulation sums in float32
// and leaves one z unwritten: it must exit 1 (the check can tell).
// The kernel source itself on the host (no GPU): python3 tools/small_m_emulate.py
// builds this file with -DSMALL_M_CHECK_EMULATE against a CUDA shim and runs the
// launchers on small shapes (slow: one OS thread per CUDA thread).
//
// For each case: x (M, K) and W (N, K) seeded standard normal (x + 100 in the
// cancellation case; some cases give x a row stride > K), outputs poisoned with
// NaN, then small_m_fp64_train and small_m_fp64_eval (problem 33 and 84 folds;
// one case with null bias / bn_weight / bn_bias).  Reference: products exact in
// double, sums in long double (z_ref, Sigma|x w|), statistics and eval fold in
// long double.  Each output element must be written (not NaN) and within the
// header's bound of small_m_fp64.cu:
//   |z - z_ref| <= 0.5 ulp(z_ref) + (K + 8) 2^-53 Sigma_k |x w|   (+ what that error
//   does to mean, M2 and the fold, see allowed_* below)
// and two runs of each launcher must give the same bits; first, the kernel's
// exact float -> double conversions are compared with ldexp on 2^24 bit patterns.  Printed per case: max
// error in float32 ulps of the reference (z, eval out, part_mean, part_m2), the
// train launcher's median time of 20 (after 3 warm-ups, cudaEvent), the floor
// (half the median time of a device-to-device cudaMemcpyAsync of W's bytes, same
// run) and their ratio.  L2 is not flushed (W of the small cases stays in L2 for
// both the kernel and the copy).  Exit status 1 on a bound violation, an unwritten
// element or a non-deterministic output; 2 on a CUDA error.

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
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

constexpr long double kU64 = 1.1102230246251565404e-16L;  // 2^-53

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
  float x_offset = 0.f;      // added to every x (cancellation)
  int64_t x_row_stride = 0;  // 0: K
  bool null_vectors = false; // eval with null bias / bn_weight / bn_bias
  bool w_non_finite = false; // W[1][K / 3] = +inf, W[N - 2][K / 2] = NaN: those features' outputs must be NaN
};

// The features a w_non_finite case poisons (N >= 3).
bool poisoned_feature(const Case& c, int n) { return c.w_non_finite && (n == 1 || n == c.N - 2); }

struct Inputs {
  std::vector<float> x, w, bias, scale, bn_weight, bn_bias, running_mean, running_var;
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

// The eval fold of feature n in long double (small_m_fp64.cu's formulas).
void reference_fold(const Inputs& in, int n, bool scale_after_bn, bool null_vectors, long double& a,
                    long double& c) {
  const long double bias = null_vectors ? 0.L : in.bias[n], gamma = null_vectors ? 1.L : in.bn_weight[n],
                    beta = null_vectors ? 0.L : in.bn_bias[n];
  const long double s = in.scale[n], rm = in.running_mean[n];
  const long double g = gamma / sqrtl(static_cast<long double>(in.running_var[n]) + static_cast<long double>(in.eps));
  a = s * g;
  c = scale_after_bn ? s * (beta + (bias - rm) * g) : beta + (s * bias - rm) * g;
}

struct Outputs {
  std::vector<float> z, part_mean, part_m2, out33, out84;
};

struct Errors {
  double z = 0, eval = 0, mean = 0, m2 = 0;  // max |err| / ulp_f32(ref)
  long long unwritten = 0, violations = 0;
  bool deterministic = true;
};

void note(double& max_ulps, long long& violations, long double got, long double ref, long double allowed,
          const char* what, const Case& c, int m, int n) {
  const long double err = fabsl(got - ref);
  max_ulps = std::max(max_ulps, static_cast<double>(err / ulp_f32(ref)));
  if (err > allowed) {
    if (violations < 5)
      fprintf(stderr, "  %s M=%d K=%d N=%d m=%d n=%d: got %.9g ref %.12Lg err %.3Lg > allowed %.3Lg\n", what, c.M, c.K,
              c.N, m, n, static_cast<double>(got), ref, err, allowed);
    ++violations;
  }
}

Errors compare(const Case& c, const Inputs& in, const Outputs& o) {
  std::vector<long double> z_ref, abs_sum;
  reference_gemm(c, in, z_ref, abs_sum);
  Errors e;
  const long double K8 = static_cast<long double>(c.K + 8);
  for (int n = 0; n < c.N; ++n) {
    if (poisoned_feature(c, n)) {  // a non-finite W row: every output of the feature NaN
      long long not_nan = !std::isnan(o.part_mean[n]) + !std::isnan(o.part_m2[n]);
      for (int m = 0; m < c.M; ++m) {
        const size_t i = static_cast<size_t>(m) * c.N + n;
        not_nan += !std::isnan(o.z[i]) + !std::isnan(o.out33[i]) + !std::isnan(o.out84[i]);
      }
      if (not_nan) fprintf(stderr, "  feature %d with a non-finite W row: %lld outputs not NaN\n", n, not_nan);
      e.violations += not_nan;
      continue;
    }
    long double mean = 0.L, delta_max = 0.L, delta_sum = 0.L;
    for (int m = 0; m < c.M; ++m) {
      const size_t i = static_cast<size_t>(m) * c.N + n;
      mean += z_ref[i];
      const long double delta = K8 * kU64 * abs_sum[i];  // bound on |z64 - z_ref|
      delta_max = std::max(delta_max, delta);
      delta_sum += delta;
      if (std::isnan(o.z[i])) {
        ++e.unwritten;
        continue;
      }
      note(e.z, e.violations, o.z[i], z_ref[i], 0.5L * ulp_f32(z_ref[i]) + delta, "z", c, m, n);
    }
    mean /= c.M;
    long double m2 = 0.L, abs_z = 0.L;
    for (int m = 0; m < c.M; ++m) {
      const long double d = z_ref[static_cast<size_t>(m) * c.N + n] - mean;
      m2 += d * d;
      abs_z += fabsl(z_ref[static_cast<size_t>(m) * c.N + n]);
    }
    // mean64 = (sum z64) / M: the z64 errors plus M + 1 roundings of float64.
    const long double allowed_mean = 0.5L * ulp_f32(mean) + delta_sum / c.M + (c.M + 2) * kU64 * abs_z / c.M;
    // m2_64 = sum (z64 - mean64)^2: each deviation off by <= 2 delta_max (z64 and mean64), plus roundings.
    const long double dev = 2.L * delta_max + (c.M + 2) * kU64 * abs_z;
    const long double allowed_m2 =
        0.5L * ulp_f32(m2) + 2.L * sqrtl(c.M * m2) * dev + c.M * dev * dev + 2.L * (c.M + 2) * kU64 * m2;
    if (std::isnan(o.part_mean[n]) || std::isnan(o.part_m2[n])) {
      ++e.unwritten;
    } else {
      note(e.mean, e.violations, o.part_mean[n], mean, allowed_mean, "part_mean", c, -1, n);
      note(e.m2, e.violations, o.part_m2[n], m2, allowed_m2, "part_m2", c, -1, n);
    }
    for (int p84 = 0; p84 < 2; ++p84) {
      long double a, cc;
      reference_fold(in, n, p84 == 1, c.null_vectors, a, cc);
      const std::vector<float>& out = p84 ? o.out84 : o.out33;
      for (int m = 0; m < c.M; ++m) {
        const size_t i = static_cast<size_t>(m) * c.N + n;
        if (std::isnan(out[i])) {
          ++e.unwritten;
          continue;
        }
        const long double ref = a * z_ref[i] + cc;
        const long double delta = K8 * kU64 * abs_sum[i];
        // a and c carry a few float64 roundings each (sqrt, divide, products, sums).
        const long double allowed =
            0.5L * ulp_f32(ref) + fabsl(a) * delta + 16.L * kU64 * (fabsl(a * z_ref[i]) + fabsl(cc));
        note(e.eval, e.violations, out[i], ref, allowed, p84 ? "eval (84)" : "eval (33)", c, m, n);
      }
    }
  }
  return e;
}

#ifdef SMALL_M_CHECK_EMULATE
// The launchers themselves, their kernels run on the host by the shim of
// tools/small_m_emulate.py (one OS thread per CUDA thread, DMMA fragments exchanged per warp).
Outputs run_launchers_emulated(const Case& c, const Inputs& in) {
  using namespace fused_gemm_bn;
  const int64_t ld = c.x_row_stride ? c.x_row_stride : c.K;
  Outputs o;
  const size_t MN = static_cast<size_t>(c.M) * c.N;
  o.z.assign(MN, NAN), o.out33.assign(MN, NAN), o.out84.assign(MN, NAN);
  o.part_mean.assign(c.N, NAN), o.part_m2.assign(c.N, NAN);
  const int64_t ws_bytes = small_m_fp64_workspace_bytes(c.M, c.N, c.K, g_emu_num_sms);
  std::vector<double> ws(std::max<int64_t>(1, ws_bytes / 8), NAN);
  if (small_m_fp64_train(in.x.data(), ld, in.w.data(), c.M, c.N, c.K, o.z.data(), o.part_mean.data(),
                         o.part_m2.data(), nullptr, ws_bytes ? ws.data() : nullptr, nullptr) != cudaSuccess)
    abort();
  BatchNormArgs bn;
  bn.bias = c.null_vectors ? nullptr : in.bias.data();
  bn.scale = in.scale.data();
  bn.bn_weight = c.null_vectors ? nullptr : in.bn_weight.data();
  bn.bn_bias = c.null_vectors ? nullptr : in.bn_bias.data();
  bn.running_mean = const_cast<float*>(in.running_mean.data());
  bn.running_var = const_cast<float*>(in.running_var.data());
  bn.eps = in.eps;
  for (int p84 = 0; p84 < 2; ++p84) {
    bn.scale_after_bn = p84 == 1;
    if (small_m_fp64_eval(in.x.data(), ld, in.w.data(), c.M, c.N, c.K, bn, (p84 ? o.out84 : o.out33).data(),
                          ws_bytes ? ws.data() : nullptr, nullptr) != cudaSuccess)
      abort();
  }
  return o;
}
#endif

#ifdef SMALL_M_CHECK_HOST_ONLY
// The kernel's arithmetic on the host: float64 sums of exact products (in k
// order here), z rounded once, statistics and the fold in float64.
Outputs run_emulated(const Case& c, const Inputs& in) {
  const int64_t ld = c.x_row_stride ? c.x_row_stride : c.K;
  Outputs o;
  const size_t MN = static_cast<size_t>(c.M) * c.N;
  o.z.assign(MN, NAN), o.out33.assign(MN, NAN), o.out84.assign(MN, NAN);
  o.part_mean.assign(c.N, NAN), o.part_m2.assign(c.N, NAN);
  std::vector<double> zd(c.M);
  for (int n = 0; n < c.N; ++n) {
    double mean = 0.0;
    for (int m = 0; m < c.M; ++m) {
      double s = 0.0;
      for (int k = 0; k < c.K; ++k)
        s = std::fma(static_cast<double>(in.x[m * ld + k]), static_cast<double>(in.w[static_cast<size_t>(n) * c.K + k]), s);
#ifdef SMALL_M_CHECK_NEGATIVE_CONTROL
      // float32 accumulation (what the check must reject)
      float sf = 0.f;
      for (int k = 0; k < c.K; ++k) sf = std::fma(in.x[m * ld + k], in.w[static_cast<size_t>(n) * c.K + k], sf);
      s = sf;
#endif
      zd[m] = s;
      mean += s;
      o.z[static_cast<size_t>(m) * c.N + n] = static_cast<float>(s);
    }
    mean /= c.M;
    double m2 = 0.0;
    for (int m = 0; m < c.M; ++m) m2 = std::fma(zd[m] - mean, zd[m] - mean, m2);
#ifdef SMALL_M_CHECK_NEGATIVE_CONTROL
    if (n == 0) o.z[0] = NAN;  // an unwritten element
#endif
    o.part_mean[n] = static_cast<float>(mean);
    o.part_m2[n] = static_cast<float>(m2);
    for (int p84 = 0; p84 < 2; ++p84) {
      const double bias = c.null_vectors ? 0.0 : in.bias[n], gamma = c.null_vectors ? 1.0 : in.bn_weight[n],
                   beta = c.null_vectors ? 0.0 : in.bn_bias[n];
      const double s = in.scale[n], rm = in.running_mean[n];
      const double g = gamma / std::sqrt(static_cast<double>(in.running_var[n]) + static_cast<double>(in.eps));
      const double a = s * g;
      const double cc = p84 ? s * std::fma(bias - rm, g, beta) : std::fma(std::fma(s, bias, -rm), g, beta);
      for (int m = 0; m < c.M; ++m)
        (p84 ? o.out84 : o.out33)[static_cast<size_t>(m) * c.N + n] = static_cast<float>(std::fma(a, zd[m], cc));
    }
  }
  return o;
}
#else
struct Timing {
  double kernel_us = 0, floor_us = 0;
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

// Bitwise equality (NaN outputs of a non-finite W row compare equal to themselves).
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

template <class T>
T* to_device(const std::vector<T>& v) {
  T* d = nullptr;
  CUDA_OK(cudaMalloc(&d, std::max<size_t>(1, v.size()) * sizeof(T)));
  CUDA_OK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

std::vector<float> to_host(const float* d, size_t n) {
  std::vector<float> v(n);
  CUDA_OK(cudaMemcpy(v.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost));
  return v;
}

void poison(float* d, size_t n, cudaStream_t stream) {
  CUDA_OK(cudaMemsetAsync(d, 0xff, n * sizeof(float), stream));  // 0xffffffff: a NaN
}

Outputs run_gpu(const Case& c, const Inputs& in, bool& deterministic, Timing& timing) {
  using namespace fused_gemm_bn;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  int device = 0, num_sms = 0;
  CUDA_OK(cudaGetDevice(&device));
  CUDA_OK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t ld = c.x_row_stride ? c.x_row_stride : c.K;
  const size_t MN = static_cast<size_t>(c.M) * c.N;
  float *x = to_device(in.x), *w = to_device(in.w);
  float *bias = to_device(in.bias), *scale = to_device(in.scale), *bn_weight = to_device(in.bn_weight),
        *bn_bias = to_device(in.bn_bias), *running_mean = to_device(in.running_mean),
        *running_var = to_device(in.running_var);
  float *z, *part_mean, *part_m2, *out, *copy;
  CUDA_OK(cudaMalloc(&z, MN * sizeof(float)));
  CUDA_OK(cudaMalloc(&out, MN * sizeof(float)));
  CUDA_OK(cudaMalloc(&part_mean, c.N * sizeof(float)));
  CUDA_OK(cudaMalloc(&part_m2, c.N * sizeof(float)));
  CUDA_OK(cudaMalloc(&copy, in.w.size() * sizeof(float)));
  const int64_t ws_bytes = small_m_fp64_workspace_bytes(c.M, c.N, c.K, num_sms);
  double* workspace = nullptr;
  if (ws_bytes > 0) CUDA_OK(cudaMalloc(&workspace, ws_bytes));

  Outputs o;
  auto train = [&] {
    CUDA_OK(small_m_fp64_train(x, ld, w, c.M, c.N, c.K, z, part_mean, part_m2, nullptr, workspace, stream));
  };
  poison(z, MN, stream), poison(part_mean, c.N, stream), poison(part_m2, c.N, stream);
  train();
  CUDA_OK(cudaStreamSynchronize(stream));
  o.z = to_host(z, MN), o.part_mean = to_host(part_mean, c.N), o.part_m2 = to_host(part_m2, c.N);
  poison(z, MN, stream), poison(part_mean, c.N, stream), poison(part_m2, c.N, stream);
  train();
  CUDA_OK(cudaStreamSynchronize(stream));
  deterministic = same_bits(to_host(z, MN), o.z) && same_bits(to_host(part_mean, c.N), o.part_mean) &&
                  same_bits(to_host(part_m2, c.N), o.part_m2);

  BatchNormArgs bn;
  bn.bias = c.null_vectors ? nullptr : bias;
  bn.scale = scale;
  bn.bn_weight = c.null_vectors ? nullptr : bn_weight;
  bn.bn_bias = c.null_vectors ? nullptr : bn_bias;
  bn.running_mean = running_mean;
  bn.running_var = running_var;
  bn.eps = in.eps;
  for (int p84 = 0; p84 < 2; ++p84) {
    bn.scale_after_bn = p84 == 1;
    poison(out, MN, stream);
    CUDA_OK(small_m_fp64_eval(x, ld, w, c.M, c.N, c.K, bn, out, workspace, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    (p84 ? o.out84 : o.out33) = to_host(out, MN);
    poison(out, MN, stream);
    CUDA_OK(small_m_fp64_eval(x, ld, w, c.M, c.N, c.K, bn, out, workspace, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    deterministic = deterministic && same_bits(to_host(out, MN), p84 ? o.out84 : o.out33);
  }

  timing.kernel_us = median_us(train, stream);
  timing.floor_us = 0.5 * median_us(
                              [&] {
                                CUDA_OK(cudaMemcpyAsync(copy, w, in.w.size() * sizeof(float),
                                                        cudaMemcpyDeviceToDevice, stream));
                              },
                              stream);

  for (float* p : {x, w, bias, scale, bn_weight, bn_bias, running_mean, running_var, z, out, part_mean, part_m2, copy})
    CUDA_OK(cudaFree(p));
  if (workspace) CUDA_OK(cudaFree(workspace));
  CUDA_OK(cudaStreamDestroy(stream));
  return o;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  const uint64_t seed = argc > 1 ? strtoull(argv[1], nullptr, 10) : 1;
  std::vector<Case> cases;
#if defined(SMALL_M_CHECK_EMULATE)
  // Small shapes (the emulation runs 512 OS threads per CTA): both batch-block
  // boundary (8 | 9) and the largest batch (16), K tails, 16- and 4-byte W loads, split and unsplit K
  // (argument 2: the SM count the launchers plan with; 1 leaves K unsplit).
  const int Ms[] = {1, 5, 8, 9, 16};
  const int KN[][2] = {{1, 3}, {37, 70}, {1000, 100}, {2001, 65}, {4096, 96}};
  if (argc > 2) fused_gemm_bn::g_emu_num_sms = atoi(argv[2]);
  if (argc > 3) fused_gemm_bn::g_emu_smem_optin = atoi(argv[3]);  // below 4 stages' bytes: the 2-stage ring
#elif defined(SMALL_M_CHECK_HOST_ONLY)
  const int Ms[] = {1, 3, 9, 16};
  const int KN[][2] = {{257, 33}, {4095, 13}, {64, 100}};
#else
  const int Ms[] = {1, 2, 3, 4, 8, 9, 12, 15, 16};
  const int KN[][2] = {{8192, 8192}, {4095, 513}, {4096, 512}, {1024, 1000}};
#endif
  // SMALL_M_CHECK_CASE=MxKxN: that one case only (to profile one shape, e.g. under ncu).
  const char* only = getenv("SMALL_M_CHECK_CASE");
  for (const auto& kn : KN)
    for (int M : Ms) {
      Case c{M, kn[0], kn[1]};
      char name[64];
      snprintf(name, sizeof name, "%dx%dx%d", M, kn[0], kn[1]);
      if (only != nullptr && strcmp(only, name) != 0) continue;
      if (kn[0] % 2 == 1) c.x_row_stride = kn[0] + 5;  // odd K: rows of x apart (stride > K)
      cases.push_back(c);
    }
  if (only == nullptr) {
#ifdef SMALL_M_CHECK_EMULATE
    Case c{16, 4096, 96}, d{15, 1000, 100};
#else
    Case c{16, 4096, 512}, d{15, 1024, 1000};
#endif
    c.x_offset = 100.f;  // cancellation: x + 100
    cases.push_back(c);
    d.null_vectors = true;  // null bias / bn_weight / bn_bias in eval
    cases.push_back(d);
#if !defined(SMALL_M_CHECK_HOST_ONLY) || defined(SMALL_M_CHECK_EMULATE)
    Case f = c, g = d;  // the kernel's non-finite W handling (split and unsplit K)
    f.x_offset = 0.f, g.null_vectors = false;
    f.w_non_finite = g.w_non_finite = true;
    cases.push_back(f);
    cases.push_back(g);
#endif
  }

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
  printf("%4s %6s %6s %7s %7s %7s %7s %10s %10s %7s  %s\n", "M", "K", "N", "z_ulp", "eval", "mean", "m2",
         "kernel_us", "floor_us", "ratio", "note");
  bool fail = false;
#ifndef SMALL_M_CHECK_HOST_ONLY
  fail = bad_conversions != 0;
#endif
  for (const Case& c : cases) {
    const Inputs in = make_inputs(c, seed);
    bool deterministic = true;
    double kernel_us = 0, floor_us = 0;
#if defined(SMALL_M_CHECK_EMULATE)
    const Outputs o = run_launchers_emulated(c, in);
#elif defined(SMALL_M_CHECK_HOST_ONLY)
    const Outputs o = run_emulated(c, in);
#else
    Timing timing;
    const Outputs o = run_gpu(c, in, deterministic, timing);
    kernel_us = timing.kernel_us, floor_us = timing.floor_us;
#endif
    const Errors e = compare(c, in, o);
    const bool bad = e.unwritten > 0 || e.violations > 0 || !deterministic;
    fail = fail || bad;
    char note_text[160];
    snprintf(note_text, sizeof note_text, "%s%s%s%s%s%s", c.x_offset != 0.f ? "x+100 " : "",
             c.x_row_stride ? "strided-x " : "", c.null_vectors ? "null-vectors " : "",
             c.w_non_finite ? "non-finite-W " : "",
             deterministic ? "" : "NONDETERMINISTIC ", bad ? "FAIL" : "ok");
    printf("%4d %6d %6d %7.3f %7.3f %7.3f %7.3f %10.1f %10.1f %7.3f  %s", c.M, c.K, c.N, e.z, e.eval, e.mean, e.m2,
           kernel_us, floor_us, floor_us > 0 ? kernel_us / floor_us : 0.0, note_text);
    if (e.unwritten || e.violations) printf(" (unwritten %lld, bound violations %lld)", e.unwritten, e.violations);
    printf("\n");
    fflush(stdout);
  }
  return fail ? 1 : 0;
}
