// lowp_phase_times.cu -- where a tile's time goes in kernels/lowp/sm90_gemm_bn_16bit.cu
// (issue 51; docs/perf.md v66): the kernel built with FUSED_GEMM_BN_LOWP_PHASE defined to
// stamp each CTA's phases (thread 0, %clock64 and %globaltimer); 31 plain launches timed one
// at a time (the median: a kernel-level A/B), then one stamped launch read: the phases'
// durations per CTA and the gaps between a CTA's end and the next CTA's start on the same
// SM, printed as medians, first wave and later waves apart; and a hash of the results, to
// compare two builds bit for bit.  No torch.
//
// Build and run (repository root, an sm_90a GPU):
//   nvcc -std=c++17 -O3 -I kernels -I kernels/lowp -arch=sm_90a tools/lowp_phase_times.cu \
//     -o /tmp/lowp_phase_times && /tmp/lowp_phase_times [M K N] [train|eval] [33|84] [timed launches] [wf32]
//   (default 1024 8192 8192 train 33 31: the KernelBench shape, problem 33, float16; wf32: the
//   autocast form, w, the vectors and out float32, w rounded to float16 in the kernel (kWFloat))
// Also printed: the W-read floor, half of a device-to-device cudaMemcpy of w's bytes (bench.py's).
//
// Phases (the kernel's FUSED_GEMM_BN_LOWP_PHASE points): 0 start, 1 the first stage landed
// (the ring's fill), 2 the last k-block done (the mainloop), 3 the chain applied (with the
// per-feature vectors' loads), 4 the statistics written (training), 5 out stored (the TMA
// store's read wait), 6 the end.  A CTA of a persistent (256-row) plan walks several tiles:
// its stamps 2-5 are its last tile's, so "mainloop" spans from its first tile's first stage
// to its last tile's last k-block.  %clock64 counts the SM's cycles (comparable within one SM);
// %globaltimer (ns) converts them.  The stamps add a few instructions to thread 0 only.
// Inputs: x, w uniform in [-1, 1), the vectors seeded, the running statistics 0 / 1.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

constexpr int kSlots = 16;  // per CTA: clock64 of phases 0..6 (0..6), %smid (7), globaltimer of 0..6 (8..14)
__device__ unsigned long long* g_phase_stamps;

__device__ __forceinline__ void lowp_phase_stamp(int p) {
  if (threadIdx.x != 0 || g_phase_stamps == nullptr) return;
  unsigned long long* slot = g_phase_stamps + static_cast<size_t>(blockIdx.x) * kSlots;
  unsigned long long gt = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(gt));
  slot[p] = clock64();
  slot[8 + p] = gt;
  if (p == 0) {
    unsigned sm = 0;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    slot[7] = sm;
  }
}
#define FUSED_GEMM_BN_LOWP_PHASE(p) lowp_phase_stamp(p)
#include "lowp/sm90_gemm_bn_16bit.cu"
#include "phase_tool_common.cuh"


int main(int argc, char** argv) {
  int M = 1024, K = 8192, N = 8192;
  bool train = true;
  if (argc >= 4) M = std::atoi(argv[1]), K = std::atoi(argv[2]), N = std::atoi(argv[3]);
  if (argc >= 5) train = std::string(argv[4]) != "eval";
  const bool problem84 = argc >= 6 && std::string(argv[5]) == "84";  // Linear -> BatchNorm1d -> scale
  const int timed_launches = argc >= 7 ? std::max(1, std::atoi(argv[6])) : 31;  // 1: under compute-sanitizer
  const bool wf32 = argc >= 8 && std::string(argv[7]) == "wf32";  // autocast form: float32 w, vectors, out
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs; %d x %d x %d, problem %s float16 %s%s\n", prop.name, prop.multiProcessorCount, M,
              K, N, problem84 ? "84" : "33", train ? "train" : "eval", wf32 ? ", float32 w (autocast form)" : "");

  std::vector<__half> hx(static_cast<size_t>(M) * K);
  fill_uniform(hx, 1, -1.f, 1.f);
  __half* x = upload(hx);
  // w, the vectors and out: float16, or float32 (wf32); w's values are float16's either way.
  const size_t elem = wf32 ? sizeof(float) : sizeof(__half);
  auto upload_as = [&](uint32_t seed, float lo, float hi, size_t n) -> void* {
    std::vector<__half> h(n);
    fill_uniform(h, seed, lo, hi);
    if (!wf32) return upload(h);
    std::vector<float> f(n);
    for (size_t i = 0; i < n; ++i) f[i] = __half2float(h[i]);
    return upload(f);
  };
  void* w = upload_as(2, -1.f / 64, 1.f / 64, static_cast<size_t>(N) * K);
  void* bias = upload_as(3, -0.5f, 0.5f, N);
  void* scale = upload_as(4, 0.5f, 1.5f, N);
  void* bn_weight = upload_as(5, 1.f, 1.f, N);
  void* bn_bias = upload_as(6, 0.f, 0.f, N);
  void* running_mean = upload_as(7, 0.f, 0.f, N);
  void* running_var = upload_as(8, 1.f, 1.f, N);
  void* out = nullptr;
  CHECK(cudaMalloc(&out, static_cast<size_t>(M) * N * elem));
  const int stat_rows = (M + 127) / 128;
  float *part_mean = nullptr, *part_m2 = nullptr;
  CHECK(cudaMalloc(&part_mean, static_cast<size_t>(stat_rows) * N * sizeof(float)));
  CHECK(cudaMalloc(&part_m2, static_cast<size_t>(stat_rows) * N * sizeof(float)));
  int64_t* nbt = nullptr;
  CHECK(cudaMalloc(&nbt, sizeof(int64_t)));
  CHECK(cudaMemset(nbt, 0, sizeof(int64_t)));
  int64_t ws_floats = 0;
  int zero_ints = 0;
  fused_gemm_bn::lowp_sm90_workspace(M, N, K, &ws_floats, &zero_ints);
  float* workspace = nullptr;
  if (ws_floats > 0) CHECK(cudaMalloc(&workspace, ws_floats * sizeof(float)));

  // dtype 0 (half), 16-bit (or float32: wf32) vectors and out, the problem's order (84: scale after
  // BatchNorm), momentum 0.1.
  const fused_gemm_bn::LowpBatchNormArgs bn{0,   wf32,  bias,  scale, bn_weight, bn_bias, running_mean, running_var,
                                            nbt, 0.1f,  1e-5f, problem84, 1};

  constexpr int kMaxCtas = 1 << 16;
  unsigned long long* stamps = nullptr;
  CHECK(cudaMalloc(&stamps, static_cast<size_t>(kMaxCtas) * kSlots * sizeof(unsigned long long)));
  auto launch = [&]() {
    if (workspace != nullptr && zero_ints > 0)
      CHECK(cudaMemset(reinterpret_cast<int*>(workspace + ws_floats) - zero_ints, 0, zero_ints * sizeof(int)));
    CHECK(fused_gemm_bn::lowp_sm90_gemm_bn(bn, train, wf32, x, w, out, M, N, K, part_mean, part_m2, nullptr, nullptr,
                                           workspace, 0));
  };
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  auto timed_ms = [&](unsigned long long* stamp_buffer) {  // one launch, stamping into stamp_buffer (or not)
    CHECK(cudaMemcpyToSymbol(g_phase_stamps, &stamp_buffer, sizeof(stamp_buffer)));
    CHECK(cudaEventRecord(e0));
    launch();
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    float ms = 0.f;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    return ms;
  };
  for (int i = 0; i < 3; ++i) timed_ms(nullptr);  // warm-up
  std::vector<double> plain;  // one launch at a time, so a kernel-level A/B reads the median
  for (int i = 0; i < timed_launches; ++i) plain.push_back(timed_ms(nullptr));
  const double plain_ms = median(plain);
  const double plain_min_ms = *std::min_element(plain.begin(), plain.end());
  // The W-read floor: half of a device-to-device copy of w's bytes, timed as the launches are.
  double floor_ms = 0.0;
  {
    const size_t w_bytes = static_cast<size_t>(N) * K * elem;
    void* w_copy = nullptr;
    CHECK(cudaMalloc(&w_copy, w_bytes));
    std::vector<double> copies;
    for (int i = 0; i < 3 + timed_launches; ++i) {
      CHECK(cudaEventRecord(e0));
      CHECK(cudaMemcpyAsync(w_copy, w, w_bytes, cudaMemcpyDeviceToDevice));
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      float ms = 0.f;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (i >= 3) copies.push_back(ms / 2);
    }
    floor_ms = median(copies);
    CHECK(cudaFree(w_copy));
  }
  // FNV-1a over out's bits (and training's part_mean / part_m2): equal across two builds of the
  // kernel means bit-identical results (the launches are deterministic).
  {
    std::vector<unsigned char> hout(static_cast<size_t>(M) * N * elem);
    CHECK(cudaMemcpy(hout.data(), out, hout.size(), cudaMemcpyDeviceToHost));
    uint64_t h = fnv1a(hout.data(), hout.size());
    if (train) {
      std::vector<float> hp(static_cast<size_t>(stat_rows) * N);
      CHECK(cudaMemcpy(hp.data(), part_mean, hp.size() * sizeof(float), cudaMemcpyDeviceToHost));
      h = fnv1a(hp.data(), hp.size() * sizeof(float), h);
      CHECK(cudaMemcpy(hp.data(), part_m2, hp.size() * sizeof(float), cudaMemcpyDeviceToHost));
      h = fnv1a(hp.data(), hp.size() * sizeof(float), h);
    }
    std::printf("results hash %016llx (out%s)\n", static_cast<unsigned long long>(h),
                train ? ", part_mean, part_m2" : "");
  }
  CHECK(cudaMemset(stamps, 0, static_cast<size_t>(kMaxCtas) * kSlots * sizeof(unsigned long long)));
  const float stamped_ms = timed_ms(stamps);
  std::vector<unsigned long long> h(static_cast<size_t>(kMaxCtas) * kSlots);
  CHECK(cudaMemcpy(h.data(), stamps, h.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost));

  struct Cta {
    int id, sm;
    unsigned long long clk[7], gt[7];
  };
  std::vector<Cta> ctas;
  for (int c = 0; c < kMaxCtas; ++c) {
    const unsigned long long* s = &h[static_cast<size_t>(c) * kSlots];
    if (s[8] == 0) continue;
    Cta t{c, static_cast<int>(s[7]), {}, {}};
    for (int p = 0; p < 7; ++p) t.clk[p] = s[p], t.gt[p] = s[8 + p];
    ctas.push_back(t);
  }
  if (ctas.empty()) {
    std::printf("no stamps were written: the launch did not run\n");
    return 1;
  }
  // ns per cycle from each CTA's whole span.
  std::vector<double> ns_per_cycle;
  for (const Cta& t : ctas)
    if (t.clk[6] > t.clk[0]) ns_per_cycle.push_back(double(t.gt[6] - t.gt[0]) / double(t.clk[6] - t.clk[0]));
  const double npc = median(ns_per_cycle);
  std::printf("launch: %.1f us plain (median of %zu, min %.1f), %.1f us stamped (events); %zu CTAs; SM clock %.0f MHz "
              "(globaltimer / clock64); W-read floor %.1f us (%.2fx)\n",
              plain_ms * 1e3, plain.size(), plain_min_ms * 1e3, stamped_ms * 1e3, ctas.size(), 1e3 / npc,
              floor_ms * 1e3, plain_ms / floor_ms);
  const char* names[6] = {"fill (start -> first stage)", "mainloop (-> last k-block)", "chain (-> u or out)",
                          "statistics (-> written)", "store (-> TMA read done)", "end (-> exit point)"};
  const int sms = prop.multiProcessorCount;
  for (int wave = 0; wave < 2; ++wave) {
    std::printf("%s CTAs (blockIdx %s SMs):\n", wave == 0 ? "first-wave" : "later", wave == 0 ? "<" : ">=");
    for (int p = 0; p < 6; ++p) {
      std::vector<double> d;
      for (const Cta& t : ctas)
        if ((t.id < sms) == (wave == 0) && t.clk[p] > 0 && t.clk[p + 1] >= t.clk[p])
          d.push_back((t.clk[p + 1] - t.clk[p]) * npc / 1e3);
      if (!d.empty()) std::printf("  %-32s median %7.2f us  (n %zu)\n", names[p], median(d), d.size());
    }
  }
  // Same SM: the next CTA's start after a CTA's end (clock64 is per SM).
  std::vector<double> gaps;
  for (int sm = 0; sm < 1024; ++sm) {
    std::vector<const Cta*> on;
    for (const Cta& t : ctas)
      if (t.sm == sm) on.push_back(&t);
    std::sort(on.begin(), on.end(), [](const Cta* a, const Cta* b) { return a->clk[0] < b->clk[0]; });
    for (size_t i = 1; i < on.size(); ++i)
      if (on[i]->clk[0] > on[i - 1]->clk[6]) gaps.push_back((on[i]->clk[0] - on[i - 1]->clk[6]) * npc / 1e3);
  }
  if (!gaps.empty())
    std::printf("next CTA on the same SM starts %.2f us after the previous one's end (median, n %zu)\n", median(gaps),
                gaps.size());
  unsigned long long first = ~0ull, last = 0;
  for (const Cta& t : ctas) first = std::min(first, t.gt[0]), last = std::max(last, t.gt[6]);
  std::printf("first start to last end: %.1f us (globaltimer)\n", (last - first) / 1e3);
  return 0;
}
