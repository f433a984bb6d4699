// small_m_phase_times.cu -- where a small batch's time goes in kernels/small_m_fp64.cu's TMA ring
// (issue 50; docs/perf.md v88): the kernel built with FUSED_GEMM_BN_SMALL_M_PHASE defined to
// stamp each CTA's phases (thread 0, %globaltimer), for problems 33 and 84, training and eval.
// Per configuration: 21 plain launches timed one at a time (cudaEvent median: a kernel-level
// A/B of two builds), then one stamped launch read back: for each phase, over the CTAs, its
// time after the earliest CTA's start (min / median / max, us), so that both a CTA's own phases
// and the spread across CTAs (which CTA the kernel's end waits for) show.  The floor beside it:
// half the median time of a device-to-device copy of W's bytes.  A hash of the outputs (and
// training's running statistics) lets two builds be compared bit for bit.  No torch.
//
// Build and run (repository root, an sm_90a GPU):
//   nvcc -std=c++17 -O3 -I kernels -arch=sm_90a tools/small_m_phase_times.cu -o /tmp/small_m_phase_times &&
//     /tmp/small_m_phase_times [M K N] [timed launches]     (default 8 8192 8192 21)
//   SMALL_M_PHASE_CTAS=1: every CTA's mainloop end too, by SM (whether the slow CTAs are
//   the same SMs from run to run).
//
// Phases (the kernel's FUSED_GEMM_BN_SMALL_M_PHASE points, thread 0 of each CTA): 0 start (past
// the dependent-launch wait), 1 the first stage landed, 2 warp 0's last stage read, 3 every
// warp's (the CTA barrier after the ring), 4 the K slices summed, 5 v in shared memory, 6 the
// row's (max, sum) pair written, 7 past the grid barrier (5-7: problem 84's cooperative tail
// only), 8 the end.  %globaltimer is one clock for the whole GPU (ns); the stamps add a few
// instructions to thread 0 only.  Inputs: x, w uniform in [-1, 1) (w scaled by 1 / 64), the
// vectors seeded, running statistics 0 / 1, momentum 0.1.
#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

constexpr int kPhases = 9;
constexpr int kSlots = 10;  // per CTA: globaltimer of phases 0 .. 8, %smid
__device__ unsigned long long* g_phase_stamps;

__device__ __forceinline__ void small_m_phase_stamp(int p) {
  if (threadIdx.x != 0 || g_phase_stamps == nullptr) return;
  unsigned long long* slot = g_phase_stamps + (static_cast<size_t>(blockIdx.y) * gridDim.x + blockIdx.x) * kSlots;
  unsigned long long gt = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(gt));
  slot[p] = gt;
  if (p == 0) {
    unsigned sm = 0;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    slot[kPhases] = sm;
  }
}
#define FUSED_GEMM_BN_SMALL_M_PHASE(p) small_m_phase_stamp(p)
#include "small_m_fp64.cu"
#include "phase_tool_common.cuh"


int main(int argc, char** argv) {
  using namespace fused_gemm_bn;
  int M = 8, K = 8192, N = 8192;
  if (argc >= 4) M = std::atoi(argv[1]), K = std::atoi(argv[2]), N = std::atoi(argv[3]);
  const int timed_launches = argc >= 5 ? std::max(1, std::atoi(argv[4])) : 21;
  if (M < 1 || M > small_m_fp64_max_rows() || K < 1 || N < 1) {
    std::fprintf(stderr, "M must be 1 .. %d, K and N positive\n", small_m_fp64_max_rows());
    return 2;
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs; M x K x N = %d x %d x %d\n", prop.name, prop.multiProcessorCount, M, K, N);

  std::vector<float> hx(static_cast<size_t>(M) * K), hw(static_cast<size_t>(N) * K), hv(N);
  fill_uniform(hx, 1, -1.f, 1.f);
  fill_uniform(hw, 2, -1.f / 64, 1.f / 64);
  float* x = upload(hx);
  float* w = upload(hw);
  fill_uniform(hv, 3, -0.5f, 0.5f);
  float* bias = upload(hv);
  fill_uniform(hv, 4, 0.5f, 1.5f);
  float* scale = upload(hv);
  fill_uniform(hv, 5, 0.5f, 1.5f);
  float* bn_weight = upload(hv);
  fill_uniform(hv, 6, -0.5f, 0.5f);
  float* bn_bias = upload(hv);
  const std::vector<float> zeros(N, 0.f), ones(N, 1.f);
  float* running_mean = upload(zeros);
  float* running_var = upload(ones);
  float *out = nullptr, *z = nullptr, *stats = nullptr, *copy = nullptr;
  CHECK(cudaMalloc(&out, static_cast<size_t>(M) * N * sizeof(float)));
  CHECK(cudaMalloc(&z, static_cast<size_t>(M) * N * sizeof(float)));
  CHECK(cudaMalloc(&stats, 2 * static_cast<size_t>(N) * sizeof(float)));
  CHECK(cudaMalloc(&copy, hw.size() * sizeof(float)));
  int64_t* nbt = nullptr;
  CHECK(cudaMalloc(&nbt, sizeof(int64_t)));
  CHECK(cudaMemset(nbt, 0, sizeof(int64_t)));
  const int64_t ws_bytes = small_m_fp64_workspace_bytes(M, N, K, prop.multiProcessorCount, true);
  void* workspace = nullptr;
  if (ws_bytes > 0) CHECK(cudaMalloc(&workspace, ws_bytes));

  constexpr int kMaxCtas = 1 << 14;
  unsigned long long* stamps = nullptr;
  CHECK(cudaMalloc(&stamps, static_cast<size_t>(kMaxCtas) * kSlots * sizeof(unsigned long long)));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  auto timed_us = [&](auto&& launch, unsigned long long* stamp_buffer) {  // one launch, stamping or not
    CHECK(cudaMemcpyToSymbol(g_phase_stamps, &stamp_buffer, sizeof(stamp_buffer)));
    CHECK(cudaEventRecord(e0));
    launch();
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    float ms = 0.f;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    return 1e3 * ms;
  };
  auto median_us = [&](auto&& launch) {
    for (int i = 0; i < 3; ++i) timed_us(launch, nullptr);  // warm-up
    std::vector<double> t;
    for (int i = 0; i < timed_launches; ++i) t.push_back(timed_us(launch, nullptr));
    return median(t);
  };
  const double floor_us = 0.5 * median_us([&] {
    CHECK(cudaMemcpyAsync(copy, w, hw.size() * sizeof(float), cudaMemcpyDeviceToDevice));
  });
  std::printf("floor (half a copy of W): %.1f us\n", floor_us);

  const char* names[kPhases] = {"start",       "first stage", "warp 0 last stage", "all warps' last", "K slices summed",
                                "v in smem",   "pair written", "past grid barrier", "end"};
  for (int problem84 = 0; problem84 < 2; ++problem84)
    for (int train = 1; train >= 0; --train) {
      if (train && M < 2) continue;  // training needs two rows
      BatchNormArgs bn;
      bn.bias = bias, bn.scale = scale, bn.bn_weight = bn_weight, bn.bn_bias = bn_bias;
      bn.running_mean = running_mean, bn.running_var = running_var;
      bn.momentum = 0.1f, bn.eps = 1e-5f, bn.scale_after_bn = problem84 == 1, bn.scale_stride = problem84 ? 0 : 1;
      auto launch = [&] {
        CHECK(train ? small_m_fp64_train(x, K, w, M, N, K, bn, nbt, out, z, stats, workspace, 0)
                    : small_m_fp64_eval(x, K, w, M, N, K, bn, out, workspace, 0));
      };
      auto reset = [&] {  // the running statistics as uploaded, so both builds hash the same state
        CHECK(cudaMemcpy(running_mean, zeros.data(), N * sizeof(float), cudaMemcpyHostToDevice));
        CHECK(cudaMemcpy(running_var, ones.data(), N * sizeof(float), cudaMemcpyHostToDevice));
      };
      const double plain_us = median_us(launch);
      reset();
      CHECK(cudaMemset(stamps, 0, static_cast<size_t>(kMaxCtas) * kSlots * sizeof(unsigned long long)));
      const double stamped_us = timed_us(launch, stamps);
      std::vector<float> hout(static_cast<size_t>(M) * N), hrm(N), hrv(N);
      CHECK(cudaMemcpy(hout.data(), out, hout.size() * sizeof(float), cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(hrm.data(), running_mean, N * sizeof(float), cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(hrv.data(), running_var, N * sizeof(float), cudaMemcpyDeviceToHost));
      uint64_t h = fnv1a(hout.data(), hout.size() * sizeof(float));
      if (train) h = fnv1a(hrv.data(), N * sizeof(float), fnv1a(hrm.data(), N * sizeof(float), h));
      reset();

      std::vector<unsigned long long> hs(static_cast<size_t>(kMaxCtas) * kSlots);
      CHECK(cudaMemcpy(hs.data(), stamps, hs.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
      std::vector<const unsigned long long*> ctas;
      unsigned long long t0 = ~0ull;
      for (int c = 0; c < kMaxCtas; ++c) {
        const unsigned long long* s = &hs[static_cast<size_t>(c) * kSlots];
        if (s[0] == 0) continue;
        ctas.push_back(s);
        t0 = std::min(t0, s[0]);
      }
      std::printf("\nproblem %s %s: %.1f us plain (median of %d; %.3fx the floor), %.1f us stamped, %zu CTAs, "
                  "results hash %016llx\n",
                  problem84 ? "84" : "33", train ? "train" : "eval", plain_us, timed_launches, plain_us / floor_us,
                  stamped_us, ctas.size(), static_cast<unsigned long long>(h));
      if (ctas.empty()) {
        std::printf("  no stamps: not the TMA ring (an sm_90a GPU runs it)\n");
        continue;
      }
      std::printf("  %-20s %8s %8s %8s   (us after the first CTA's start)\n", "phase", "min", "median", "max");
      for (int p = 0; p < kPhases; ++p) {
        std::vector<double> t;
        for (const unsigned long long* s : ctas)
          if (s[p] != 0) t.push_back((s[p] - t0) / 1e3);
        if (t.empty()) continue;
        std::sort(t.begin(), t.end());
        std::printf("  %-20s %8.2f %8.2f %8.2f\n", names[p], t.front(), t[t.size() / 2], t.back());
      }
      // The CTAs whose mainloop ended last: which SMs, and how late against the median.
      std::vector<std::pair<double, int>> ends;
      for (const unsigned long long* s : ctas) ends.push_back({(s[3] - t0) / 1e3, static_cast<int>(s[kPhases])});
      std::sort(ends.begin(), ends.end());
      std::printf("  last mainloops (us, SM):");
      for (size_t i = ends.size() > 4 ? ends.size() - 4 : 0; i < ends.size(); ++i)
        std::printf(" %.2f (SM %d)", ends[i].first, ends[i].second);
      std::printf("\n");
      if (std::getenv("SMALL_M_PHASE_CTAS") != nullptr) {  // every CTA: SM, blockIdx.x, its last stage read (us)
        std::vector<std::pair<int, double>> by_sm;
        for (const unsigned long long* s : ctas) by_sm.push_back({static_cast<int>(s[kPhases]), (s[3] - t0) / 1e3});
        std::sort(by_sm.begin(), by_sm.end());
        std::printf("  mainloop end by SM:");
        for (size_t i = 0; i < by_sm.size(); ++i)
          std::printf("%s%d:%.1f", i % 16 == 0 ? "\n   " : " ", by_sm[i].first, by_sm[i].second);
        std::printf("\n");
      }
    }
  return 0;
}
