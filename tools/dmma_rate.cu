// dmma_rate.cu -- the float64 multiply-add rates small_m_fp64.cu's performance
// model rests on, measured on the current GPU (no torch): mma.sync m8n8k4 .f64
// (sm_80+), m16n8k16 .f64 (sm_90+) and plain DFMA, each with 8 independent
// accumulator chains per warp, 8 warps a CTA, 4 CTAs a SM; median of 5 timed
// launches (cudaEvent) after a warm-up.  Printed: TFLOP/s (2 flops a FMA) and
// FMA per clock per SM at the SM clock the driver reports.
//
//   nvcc -std=c++17 -O3 -arch=sm_90a tools/dmma_rate.cu -o /tmp/dmma_rate && /tmp/dmma_rate
//   (sm_80 .. sm_89: -arch=sm_80; the m16n8k16 row is then skipped)
// Exit status 2 on a CUDA error.

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <vector>

#define CUDA_OK(call)                                                                          \
  do {                                                                                         \
    const cudaError_t err_ = (call);                                                           \
    if (err_ != cudaSuccess) {                                                                 \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
      exit(2);                                                                                 \
    }                                                                                          \
  } while (0)

constexpr int kChains = 8, kIters = 2048, kThreads = 256;

enum class Op { kMma884, kMma16816, kDfma };

template <Op kOp>
__global__ void __launch_bounds__(kThreads) rate_kernel(double* out, double seed) {
  double d[kChains][4];
#pragma unroll
  for (int c = 0; c < kChains; ++c)
#pragma unroll
    for (int v = 0; v < 4; ++v) d[c][v] = seed * (c + v + threadIdx.x);
  const double a = seed * 1.000001, b = seed * 0.999999;
  for (int it = 0; it < kIters; ++it) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) {
      if constexpr (kOp == Op::kMma884) {
        asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%0, %1};"
                     : "+d"(d[c][0]), "+d"(d[c][1])
                     : "d"(a), "d"(b));
      } else if constexpr (kOp == Op::kMma16816) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, "
            "{%4, %4, %4, %4, %4, %4, %4, %4}, {%5, %5, %5, %5}, {%0, %1, %2, %3};"
            : "+d"(d[c][0]), "+d"(d[c][1]), "+d"(d[c][2]), "+d"(d[c][3])
            : "d"(a), "d"(b));
#endif
      } else {
        d[c][0] = fma(d[c][0], a, b);
      }
    }
  }
  double s = 0;
#pragma unroll
  for (int c = 0; c < kChains; ++c) s += d[c][0] + d[c][1] + d[c][2] + d[c][3];
  if (s == 12345.678) out[0] = s;  // keeps the chains alive
}

template <Op kOp>
static void measure(const char* name, double fma_per_warp_op, int num_sms, double clock_ghz, double* out) {
  const int blocks = num_sms * 4;
  rate_kernel<kOp><<<blocks, kThreads>>>(out, 1.0);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaDeviceSynchronize());
  cudaEvent_t e0, e1;
  CUDA_OK(cudaEventCreate(&e0));
  CUDA_OK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int r = 0; r < 5; ++r) {
    CUDA_OK(cudaEventRecord(e0));
    rate_kernel<kOp><<<blocks, kThreads>>>(out, 1.0);
    CUDA_OK(cudaEventRecord(e1));
    CUDA_OK(cudaEventSynchronize(e1));
    float t = 0;
    CUDA_OK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  const double warps = static_cast<double>(blocks) * kThreads / 32;
  const double fma = warps * kIters * kChains * fma_per_warp_op;
  const double fma_per_s = fma / (ms[2] * 1e-3);
  printf("%-22s %8.3f ms  %7.1f TFLOP/s  %6.1f FMA/clk/SM\n", name, ms[2], 2 * fma_per_s * 1e-12,
         fma_per_s / (num_sms * clock_ghz * 1e9));
  CUDA_OK(cudaEventDestroy(e0));
  CUDA_OK(cudaEventDestroy(e1));
}

int main() {
  int device = 0, num_sms = 0, clock_khz = 0, major = 0, minor = 0;
  CUDA_OK(cudaGetDevice(&device));
  CUDA_OK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  CUDA_OK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device));
  CUDA_OK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  CUDA_OK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, device));
  const double clock_ghz = clock_khz * 1e-6;
  printf("device %s (cc %d.%d, %d SMs, %.3f GHz max SM clock)\n", prop.name, major, minor, num_sms, clock_ghz);
  double* out = nullptr;
  CUDA_OK(cudaMalloc(&out, sizeof(double)));
  measure<Op::kMma884>("mma.m8n8k4.f64", 8 * 8 * 4, num_sms, clock_ghz, out);
  if (major >= 9) measure<Op::kMma16816>("mma.m16n8k16.f64", 16 * 8 * 16, num_sms, clock_ghz, out);
  measure<Op::kDfma>("dfma (per lane)", 32, num_sms, clock_ghz, out);
  CUDA_OK(cudaFree(out));
  return 0;
}
