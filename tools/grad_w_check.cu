// grad_w_check.cu -- standalone GPU check and timing of kernels/small_m_grad_w.cu (no torch):
// grad_W = a^T b for a (M, N) and b (M, K), M = 1 .. 16, against a host float64 reference,
// next to the write floor (a cudaMemsetAsync of the N x K output: 4 N K bytes written).
//
// Build and run (repository root):
//   nvcc -std=c++17 -O3 -I kernels -arch=sm_90a tools/grad_w_check.cu -o /tmp/grad_w_check && /tmp/grad_w_check
//   (sm_80: -arch=sm_80; optional argument: a seed, default 1; SMALL_M_CHECK_CASE=MxKxN: that
//   one case only, W being N x K as in tools/small_m_check.cu; GRAD_W_CHECK_NO_TIMING=1: no
//   timed launches, e.g. under compute-sanitizer).  tools/small_m_ab.sh runs it against a
//   revision's kernel with SMALL_M_AB_CHECK=tools/grad_w_check.cu.
//
// Per case: a standard normal, b standard normal x 3 (row strides N + 3 and K + 1: the kernel
// reads rows in place), out poisoned with NaN (0xff bytes).  Checked: every element written (no
// NaN left) and, for every 97th row and the last, every element within 0.5 ulp of the float64
// sum plus M 2^-53 sum_m |a b| (the kernel's bound: exact products, float64 additions, one
// rounding).  Timed: ITERS interleaved rounds of (L2 flushed by reading a 256 MB buffer, the
// kernel) and (flush, the floor), each between CUDA events; medians in us.
// Row: M K N, max error / bound, kernel us, floor us, kernel / floor, "ok" (or what failed).
// Exit status: 1 if any case fails.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "small_m_grad_w.cu"

int fused_gemm_bn::small_m_fp64_max_rows() { return 16; }  // (small_m_fp64.cu's, not built here)

namespace {

constexpr int kIters = 30, kWarmup = 5;
constexpr size_t kFlushBytes = size_t{256} << 20;

#define CHECK_CUDA(call)                                                                   \
  do {                                                                                     \
    const cudaError_t e_ = (call);                                                         \
    if (e_ != cudaSuccess) {                                                               \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      exit(2);                                                                             \
    }                                                                                      \
  } while (0)

__global__ void read_all(const int4* p, size_t n, int* sink) {  // the L2 flush: reads, no write-backs
  int acc = 0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x)
    acc ^= p[i].x ^ p[i].w;
  if (acc == 0x7fffffff) *sink = acc;
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One case; returns whether it passed (its row printed).
bool run_case(int M, int K, int N, uint64_t seed, bool timing, const int4* flush, int* sink) {
  const int64_t lda = N + 3, ldb = K + 1;
  std::mt19937_64 rng(seed * 1000003 + M * 131 + K * 7 + N);
  std::normal_distribution<float> normal;
  std::vector<float> a(M * lda), b(M * ldb);
  for (auto& v : a) v = normal(rng);
  for (auto& v : b) v = 3 * normal(rng);
  float *da, *db, *dout;
  const size_t out_bytes = size_t{4} * N * K;
  CHECK_CUDA(cudaMalloc(&da, a.size() * 4));
  CHECK_CUDA(cudaMalloc(&db, b.size() * 4));
  CHECK_CUDA(cudaMalloc(&dout, out_bytes));
  CHECK_CUDA(cudaMemcpy(da, a.data(), a.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(db, b.data(), b.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(dout, 0xff, out_bytes));
  CHECK_CUDA(fused_gemm_bn::small_m_grad_w(da, lda, db, ldb, M, N, K, dout, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> out(size_t{1} * N * K);
  CHECK_CUDA(cudaMemcpy(out.data(), dout, out_bytes, cudaMemcpyDeviceToHost));
  const char* note = "ok";
  size_t unwritten = 0;
  for (float v : out) unwritten += std::isnan(v);
  if (unwritten) note = "UNWRITTEN";
  std::vector<int> rows;  // every 97th row and the last
  for (int n = 0; n < N; n += 97) rows.push_back(n);
  if (rows.back() != N - 1) rows.push_back(N - 1);
  double worst = 0;
  for (int n : rows)
    for (int k = 0; k < K; ++k) {
      double ref = 0, mag = 0;
      for (int m = 0; m < M; ++m) {
        const double t = static_cast<double>(a[m * lda + n]) * b[m * ldb + k];
        ref += t, mag += std::fabs(t);
      }
      const float near = std::fabs(static_cast<float>(ref));
      const double bound = 0.5 * (static_cast<double>(std::nextafter(near, INFINITY)) - near) +
                           M * std::ldexp(1.0, -53) * mag + 1e-45;
      const double ratio = std::fabs(static_cast<double>(out[size_t{1} * n * K + k]) - ref) / bound;
      worst = ratio <= worst ? worst : ratio;  // (NaN: an unwritten element, counted above)
    }
  if (!(worst <= 1.0) && !unwritten) note = "ERROR";
  float t_kernel = NAN, t_floor = NAN;
  if (timing) {
    cudaEvent_t e0, e1;
    CHECK_CUDA(cudaEventCreate(&e0));
    CHECK_CUDA(cudaEventCreate(&e1));
    std::vector<float> tk, tf;
    for (int it = 0; it < kWarmup + kIters; ++it)
      for (int side = 0; side < 2; ++side) {
        read_all<<<1024, 256>>>(flush, kFlushBytes / 16, sink);
        CHECK_CUDA(cudaEventRecord(e0));
        if (side == 0)
          CHECK_CUDA(fused_gemm_bn::small_m_grad_w(da, lda, db, ldb, M, N, K, dout, nullptr));
        else
          CHECK_CUDA(cudaMemsetAsync(dout, 0, out_bytes));
        CHECK_CUDA(cudaEventRecord(e1));
        CHECK_CUDA(cudaEventSynchronize(e1));
        float ms;
        CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
        if (it >= kWarmup) (side == 0 ? tk : tf).push_back(ms * 1e3f);
      }
    t_kernel = median(tk), t_floor = median(tf);
    CHECK_CUDA(cudaEventDestroy(e0));
    CHECK_CUDA(cudaEventDestroy(e1));
  }
  printf("%4d %6d %6d  %8.3f  %8.1f  %8.1f  %6.2f  %s\n", M, K, N, worst, t_kernel, t_floor, t_kernel / t_floor,
         note);
  CHECK_CUDA(cudaFree(da));
  CHECK_CUDA(cudaFree(db));
  CHECK_CUDA(cudaFree(dout));
  return note[0] == 'o';
}

}  // namespace

int main(int argc, char** argv) {
  const uint64_t seed = argc > 1 ? strtoull(argv[1], nullptr, 10) : 1;
  const bool timing = getenv("GRAD_W_CHECK_NO_TIMING") == nullptr;
  std::vector<int> ms = {1, 2, 4, 8, 16};
  std::vector<std::pair<int, int>> shapes = {{8192, 8192}, {4096, 4096}, {4096, 512}, {1024, 1000}, {4095, 513}};
  std::vector<std::vector<int>> cases;
  for (auto [k, n] : shapes)
    for (int m : ms) cases.push_back({m, k, n});
  cases.push_back({13, 33, 17});
  if (const char* only = getenv("SMALL_M_CHECK_CASE")) {
    int m, k, n;
    if (sscanf(only, "%dx%dx%d", &m, &k, &n) != 3) return 2;
    cases = {{m, k, n}};
  }
  int4* flush = nullptr;
  int* sink = nullptr;
  if (timing) {
    CHECK_CUDA(cudaMalloc(&flush, kFlushBytes));
    CHECK_CUDA(cudaMemset(flush, 1, kFlushBytes));
    CHECK_CUDA(cudaMalloc(&sink, 4));
  }
  printf("   M      K      N  err/bound  kernel us  floor us  ratio  check\n");
  bool ok = true;
  for (const auto& c : cases) ok = run_case(c[0], c[1], c[2], seed, timing, flush, sink) && ok;
  // Refusals: nothing launched for M = 0 or 17.
  ok = ok && fused_gemm_bn::small_m_grad_w(nullptr, 1, nullptr, 1, 17, 8, 8, nullptr, nullptr) == cudaErrorInvalidValue &&
       fused_gemm_bn::small_m_grad_w(nullptr, 1, nullptr, 1, 0, 8, 8, nullptr, nullptr) == cudaErrorInvalidValue;
  return ok ? 0 : 1;
}
