// lowp_softmax_times.cu -- problem 84's 16-bit row softmax (kernels/lowp/bn_16bit.cu, the
// launchers lowp_softmax_rows and lowp_bn_softmax_rows_eval) alone: its time per launch, its
// error against float64 next to the error of PyTorch's own formula, its special values, and a
// hash of its output to compare two builds bit for bit (docs/perf.md v93).  No torch.
//
// Build and run (repository root, a GPU of compute capability 8.0+; -I another kernels/
// folder first to build a base):
//   nvcc -std=c++17 -O3 -I kernels -I kernels/lowp -arch=sm_90a tools/lowp_softmax_times.cu \
//     -o /tmp/lowp_softmax_times && /tmp/lowp_softmax_times [M N] [f16|bf16] [train|plain|eval] [launches]
//   (default 1024 8192 f16 train 51: the KernelBench shape; M >= 512 takes the walk kernel
//   in train and eval, fewer rows and plain the register kernel)
//
// Modes: train: in place over out = u, coeff (4, N) {mean, invstd, w, b} given (the training
// forward after the fold); plain: in place over out = v (eval after lowp_sm90's epilogue);
// eval: from z, kept, into out, the running statistics read (eval after cuBLAS's product).
// Inputs: u uniform in [-3, 3) rounded to the 16-bit type, the vectors seeded; rows 1-5 carry
// special values (a NaN; +inf; every element -inf; one element at the type's largest finite
// value; every odd element -inf), which must come out as PyTorch's softmax gives them.
// Timing: each launch after a device-to-device copy of the input into out (so the input sits
// in L2, as after the GEMM), CUDA events around the launch alone; the median of `launches`,
// beside the median of the same copy timed alone (one read and one write of M x N: the
// pass's traffic).  Error: relative Frobenius error against the softmax of the same logits
// in float64, for the kernel and for PyTorch's formula rnd(expf(v - max) / sum) in float32
// on the host; the count of elements where the two differ, and the largest difference in
// units of the last place.  Exit status 1 when a special value or the error bound (1.02x
// the formula's + 1e-6) fails, 2 on a CUDA error.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "lowp/bn_16bit.cu"
#include "phase_tool_common.cuh"

namespace {

bool g_bf16 = false;

float to_float(uint16_t b) {
  if (g_bf16) {
    uint32_t w = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &w, 4);
    return f;
  }
  return __half2float(__ushort_as_half(b));
}

uint16_t from_float(float v) {  // round to nearest even
  if (g_bf16) return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  return __half_as_ushort(__float2half_rn(v));
}

float round16(float v) { return to_float(from_float(v)); }

// Units in the last place between two finite 16-bit values of one sign (their patterns' distance).
int ulps(uint16_t a, uint16_t b) { return std::abs(static_cast<int>(a) - static_cast<int>(b)); }

}  // namespace

int main(int argc, char** argv) {
  const int M = argc > 1 ? std::atoi(argv[1]) : 1024;
  const int N = argc > 2 ? std::atoi(argv[2]) : 8192;
  g_bf16 = argc > 3 && std::string(argv[3]) == "bf16";
  const std::string mode = argc > 4 ? argv[4] : "train";
  const int launches = argc > 5 ? std::atoi(argv[5]) : 51;
  if (M < 6 || N < 16 || N % 8 != 0 || (mode != "train" && mode != "plain" && mode != "eval")) {
    std::fprintf(stderr, "usage: %s [M >= 6] [N, a multiple of 8] [f16|bf16] [train|plain|eval] [launches]\n",
                 argv[0]);
    return 2;
  }
  const size_t count = static_cast<size_t>(M) * N;

  // Inputs: u, the coefficients (train) or running statistics and parameters (eval), the scale.
  std::vector<float> uf(count), mean(N), invstd(N), w(N), b(N), scale_f(N), rv(N);
  fill_uniform(uf, 1, -3.f, 3.f);
  fill_uniform(mean, 2, -0.2f, 0.2f);
  fill_uniform(invstd, 3, 0.7f, 1.3f);
  fill_uniform(w, 4, 0.5f, 1.5f);
  fill_uniform(b, 5, -0.5f, 0.5f);
  fill_uniform(scale_f, 6, 0.5f, 2.f);
  fill_uniform(rv, 7, 0.6f, 2.f);
  std::vector<uint16_t> u(count), scale(N), w16(N), b16(N), rm16(N), rv16(N);
  for (size_t e = 0; e < count; ++e) u[e] = from_float(uf[e]);
  const float big = g_bf16 ? 3.3895e38f : 65504.f;
  auto at = [&](int row, int col) -> uint16_t& { return u[static_cast<size_t>(row) * N + col]; };
  at(1, 7) = from_float(NAN);  // through BatchNorm's affine step (w, invstd, scale > 0) as they are
  at(2, N / 3) = from_float(INFINITY);
  for (int j = 0; j < N; ++j) at(3, j) = from_float(-INFINITY);
  at(4, N / 2) = from_float(big);
  for (int j = 1; j < N; j += 2) at(5, j) = from_float(-INFINITY);
  for (int j = 0; j < N; ++j) {
    scale[j] = from_float(scale_f[j]);
    w16[j] = from_float(w[j]);
    b16[j] = from_float(b[j]);
    rm16[j] = from_float(mean[j]);
    rv16[j] = from_float(rv[j]);
  }
  const float eps = 1e-5f;
  std::vector<float> coeff(4 * static_cast<size_t>(N));  // (4, N) {mean, invstd, w, b}
  for (int j = 0; j < N; ++j) {
    coeff[j] = mean[j];
    coeff[N + j] = invstd[j];
    coeff[2 * N + j] = w[j];
    coeff[3 * N + j] = b[j];
  }

  // The logits the kernel forms (bn_16bit.cu's header): v = rnd(rnd(fma(w (u - mean), invstd, b)) * scale).
  std::vector<float> v(count);
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      const size_t e = static_cast<size_t>(i) * N + j;
      const float x = to_float(u[e]);
      if (mode == "plain") {
        v[e] = x;
        continue;
      }
      float mu = mean[j], is = invstd[j], wj = w[j], bj = b[j];
      if (mode == "eval") {
        mu = to_float(rm16[j]);
        is = 1.f / std::sqrt(to_float(rv16[j]) + eps);  // rsqrtf's value to float32 rounding
        wj = to_float(w16[j]);
        bj = to_float(b16[j]);
      }
      v[e] = round16(round16(std::fma(wj * (x - mu), is, bj)) * to_float(scale[j]));
    }

  uint16_t *d_u = upload(u), *d_out = nullptr, *d_copy = nullptr;
  uint16_t *d_scale = upload(scale), *d_w = upload(w16), *d_b = upload(b16), *d_rm = upload(rm16),
           *d_rv = upload(rv16);
  float* d_coeff = upload(coeff);
  CHECK(cudaMalloc(&d_out, count * 2));
  CHECK(cudaMalloc(&d_copy, count * 2));
  fused_gemm_bn::LowpBatchNormArgs bn{};
  bn.dtype = g_bf16 ? 1 : 0;
  bn.float32_io = false;
  bn.scale = d_scale;
  bn.bn_weight = d_w;
  bn.bn_bias = d_b;
  bn.running_mean = d_rm;
  bn.running_var = d_rv;
  bn.eps = eps;
  bn.scale_after_bn = true;
  bn.scale_stride = 1;
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  auto launch = [&]() {
    if (mode == "eval") return fused_gemm_bn::lowp_bn_softmax_rows_eval(bn, d_u, d_out, M, N, nullptr, stream);
    return fused_gemm_bn::lowp_softmax_rows(bn, d_out, mode == "train" ? d_coeff : nullptr, M, N, stream);
  };

  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  std::vector<double> kernel_us, copy_us;
  for (int it = 0; it < launches + 3; ++it) {
    CHECK(cudaMemcpyAsync(d_out, d_u, count * 2, cudaMemcpyDeviceToDevice, stream));
    CHECK(cudaEventRecord(start, stream));
    CHECK(launch());
    CHECK(cudaEventRecord(stop, stream));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0.f;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (it >= 3) kernel_us.push_back(1e3 * ms);
    CHECK(cudaEventRecord(start, stream));
    CHECK(cudaMemcpyAsync(d_copy, d_out, count * 2, cudaMemcpyDeviceToDevice, stream));
    CHECK(cudaEventRecord(stop, stream));
    CHECK(cudaEventSynchronize(stop));
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (it >= 3) copy_us.push_back(1e3 * ms);
  }
  // The checked output: a launch over a poisoned out (eval writes out apart from z; in place
  // the copy is the input), so an element not written shows.
  CHECK(cudaMemsetAsync(d_out, 0xff, count * 2, stream));  // NaN patterns
  if (mode != "eval") CHECK(cudaMemcpyAsync(d_out, d_u, count * 2, cudaMemcpyDeviceToDevice, stream));
  CHECK(launch());
  CHECK(cudaStreamSynchronize(stream));
  std::vector<uint16_t> out(count);
  CHECK(cudaMemcpy(out.data(), d_out, count * 2, cudaMemcpyDeviceToHost));

  // Against float64, beside PyTorch's formula in float32 (sum in row order).
  double err_k = 0, err_f = 0, norm = 0;
  size_t differ = 0;
  int worst_ulps = 0, bad = 0;
  for (int i = 0; i < M; ++i) {
    const float* r = v.data() + static_cast<size_t>(i) * N;
    float fmax_ = -INFINITY;
    bool nan = false;
    for (int j = 0; j < N; ++j) {
      nan = nan || std::isnan(r[j]);
      fmax_ = std::fmax(fmax_, r[j]);
    }
    float fsum = 0.f;
    double dsum = 0.0;
    for (int j = 0; j < N; ++j) {
      fsum += std::exp(r[j] - fmax_);
      dsum += std::exp(static_cast<double>(r[j]) - fmax_);
    }
    const bool nan_row = nan || std::isnan(fsum) || fsum == 0.f;  // NaN; +inf - +inf; every element -inf
    for (int j = 0; j < N; ++j) {
      const size_t e = static_cast<size_t>(i) * N + j;
      const float got = to_float(out[e]);
      if (nan_row) {
        if (!std::isnan(got)) {
          if (bad++ < 5) std::printf("row %d col %d: %g where PyTorch gives NaN\n", i, j, got);
        }
        continue;
      }
      const uint16_t formula = from_float(std::exp(r[j] - fmax_) / fsum);
      const double want = std::exp(static_cast<double>(r[j]) - fmax_) / dsum;
      if (!std::isfinite(got) || got < 0.f) {
        if (bad++ < 5) std::printf("row %d col %d: %g (want %g)\n", i, j, got, want);
        continue;
      }
      err_k += (got - want) * (got - want);
      err_f += (to_float(formula) - want) * (to_float(formula) - want);
      norm += want * want;
      if (out[e] != formula) {
        ++differ;
        worst_ulps = std::max(worst_ulps, ulps(out[e], formula));
      }
    }
  }
  err_k = std::sqrt(err_k / norm);
  err_f = std::sqrt(err_f / norm);
  const bool within = err_k <= 1.02 * err_f + 1e-6;
  std::printf("%s M=%d N=%d %s: kernel %.2f us (median of %d), copy of M x N %.2f us; error vs float64 %.4e, "
              "formula's %.4e (ratio %.4f%s); %zu of %zu elements differ from the formula, at most %d ulp; "
              "special values %s; hash %016llx\n",
              g_bf16 ? "bf16" : "f16", M, N, mode.c_str(), median(kernel_us), launches, median(copy_us), err_k, err_f,
              err_k / err_f, within ? "" : ", OVER 1.02x", differ, count, worst_ulps, bad ? "WRONG" : "as PyTorch",
              static_cast<unsigned long long>(fnv1a(out.data(), count * 2)));
  return bad || !within ? 1 : 0;
}
