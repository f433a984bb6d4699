// w_read_patterns.cu -- how fast W (8192 x 8192 float32, 268 MB) is read once in the
// orders a small-batch kernel can use, next to bench.py's W-read floor (no torch).  Each
// pattern only loads W (float4, __ldcs) and keeps a sum; median of 21 launches (cudaEvent,
// each launch timed alone after 3 warm-ups, as tools/small_m_check.cu times its launchers):
//   A  small_m_fp64's order: 128 CTAs of 512 threads, CTA c owns W rows 64c .. 64c + 63 and
//      reads them a 128-column stage at a time (64 pieces of 512 B, 32 KB apart; a warp a
//      piece), kDepth stages of loads in flight a thread (2: 64 KB a SM, 4: 128 KB);
//   B  the same CTAs and bytes, each CTA's 2 MB read linearly (stage s: bytes 32 KB s ..);
//   C  A's order over every SM (the rows split 62-63 a CTA on 132 SMs);
//   D  one grid-stride read of all of W by 4 CTAs a SM;
//   E  half of a device-to-device cudaMemcpy of W's bytes (bench.py's w_read floor).
// Printed: us and GB/s each.  docs/perf.md v56: on an H200 A 65.1-66.3 us, B 63.8-64.9,
// C 64.1-64.5, D 66.8-67.5, E 65.7-65.9: small_m_fp64's order reads W at the floor's rate,
// so the kernel's time above the floor is its own (fill, consumers, epilogue), not DRAM's.
//
//   nvcc -O3 -arch=sm_90a tools/w_read_patterns.cu -o /tmp/w_read_patterns && /tmp/w_read_patterns
// Exit status 1 on a CUDA error.

#include <cstdio>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#define OK(x)                                                    \
  do {                                                           \
    const cudaError_t e = (x);                                   \
    if (e != cudaSuccess) {                                      \
      printf("%s: %s\n", #x, cudaGetErrorString(e));             \
      return 1;                                                  \
    }                                                            \
  } while (0)
constexpr int N = 8192, K = 8192;
template <int kDepth, bool kLinear>
__global__ void __launch_bounds__(512, 1) read_rows(const float4* __restrict__ w, int rows_per_cta_base, int extra, float* out) {
  const int cta = blockIdx.x;
  const int r0 = cta * rows_per_cta_base + min(cta, extra);
  const int rows = rows_per_cta_base + (cta < extra);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int stages = K / 128;  // 64
  float4 acc = make_float4(0, 0, 0, 0);
  // per stage, a warp reads pieces warp, warp + 16, ... (rows pieces of 512 B = 32 float4)
  for (int s0 = 0; s0 < stages; s0 += kDepth) {
    float4 v[kDepth][4];
#pragma unroll
    for (int d = 0; d < kDepth; ++d)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int piece = warp + 16 * j;  // 0..63
        const int s = s0 + d;
        size_t idx;
        if (kLinear) {  // the CTA's rows as one linear range: piece p of stage s = float4 (s * 64 + p) * 32 + lane
          idx = static_cast<size_t>(r0) * (K / 4) + (static_cast<size_t>(s) * 64 + piece) * 32 + lane;
        } else {
          idx = static_cast<size_t>(r0 + piece) * (K / 4) + s * 32 + lane;
        }
        v[d][j] = piece < rows ? __ldcs(w + idx) : make_float4(0, 0, 0, 0);
      }
#pragma unroll
    for (int d = 0; d < kDepth; ++d)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc.x += v[d][j].x, acc.y += v[d][j].y, acc.z += v[d][j].z, acc.w += v[d][j].w;
  }
  if (acc.x + acc.y + acc.z + acc.w == 12345.f) out[0] = acc.x;
}
__global__ void read_all(const float4* __restrict__ w, size_t n4, float* out) {
  float4 acc = make_float4(0, 0, 0, 0);
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n4; i += (size_t)gridDim.x * blockDim.x) {
    const float4 v = __ldcs(w + i);
    acc.x += v.x, acc.y += v.y, acc.z += v.z, acc.w += v.w;
  }
  if (acc.x + acc.y + acc.z + acc.w == 12345.f) out[0] = acc.x;
}
template <class F> float med_us(F f, cudaStream_t st) {
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  std::vector<float> t;
  for (int i = 0; i < 3; ++i) f();
  for (int i = 0; i < 21; ++i) { cudaEventRecord(a, st); f(); cudaEventRecord(b, st); cudaEventSynchronize(b); float ms; cudaEventElapsedTime(&ms, a, b); t.push_back(ms * 1000); }
  std::sort(t.begin(), t.end()); return t[t.size() / 2];
}
int main() {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float4 *w, *w2; float* out;
  const size_t bytes = (size_t)N * K * 4;
  OK(cudaMalloc(&w, bytes)); OK(cudaMalloc(&w2, bytes)); OK(cudaMalloc(&out, 4));
  OK(cudaMemset(w, 0x3c, bytes));
  cudaStream_t st = 0;
  auto gbs = [&](float us) { return bytes / (us * 1e3); };
  for (int round = 0; round < 2; ++round) {
    float a2 = med_us([&] { read_rows<2, false><<<128, 512>>>(w, 64, 0, out); }, st);
    float a4 = med_us([&] { read_rows<4, false><<<128, 512>>>(w, 64, 0, out); }, st);
    float b2 = med_us([&] { read_rows<2, true><<<128, 512>>>(w, 64, 0, out); }, st);
    float b4 = med_us([&] { read_rows<4, true><<<128, 512>>>(w, 64, 0, out); }, st);
    float c4 = med_us([&] { read_rows<4, false><<<sms, 512>>>(w, N / sms, N % sms, out); }, st);
    float d = med_us([&] { read_all<<<4 * sms, 512>>>(w, bytes / 16, out); }, st);
    float e = 0.5f * med_us([&] { cudaMemcpyAsync(w2, w, bytes, cudaMemcpyDeviceToDevice, st); }, st);
    OK(cudaGetLastError());
    printf("round %d us (GB/s): A rows depth2 %.1f (%.0f) depth4 %.1f (%.0f) | B linear depth2 %.1f (%.0f) depth4 %.1f (%.0f) | C rows %d CTAs %.1f (%.0f) | D grid-stride %.1f (%.0f) | E half copy %.1f (%.0f)\n",
           round, a2, gbs(a2), a4, gbs(a4), b2, gbs(b2), b4, gbs(b4), sms, c4, gbs(c4), d, gbs(d), e, gbs(e));
  }
  return 0;
}
