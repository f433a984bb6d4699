// small_m_grad_w.cu -- the small-batch route's weight gradient: out = a^T b for
// a (M, N) and b (M, K) with M = 1 .. 16 rows, the backward's grad_W = grad_z^T x,
// each output the float64 sum of its M exact products rounded once to float32.
//
// Where: the binding's gemm_tn("small_m_fp64", a, b) launches it; model_new.py's
// dispatch_gemm_tn picks it under FUSED_GEMM_BN_SMALL_M=1 for batches of at most
// small_m_fp64_max_rows() rows on GPUs with full-rate FP64 (not yet run on a GPU:
// docs/perf.md v57, Open).
//
// Work: at small M grad_W is an outer product, N K outputs from M (N + K) inputs,
// so writing the N x K floats is the floor (256 MB at 8192 x 8192: ~70 us on an
// H200 at the rate W is read).  The M N K FMAs in float64 (1.1 G at M = 16,
// 8192 x 8192) take about as long on the FP64 units of an H100 / H200 (~17 T DFMA
// per second), half that at M = 8.  sm90_fp16x3's gemm_tn takes 140-142 us there
// (K = M padded to one k-block per tile), cuBLAS's float32 product 99-125 us
// (perf.md v57, call B).
//
// Numerics: a and b are staged in shared memory as float64 (exact); each product
// a[m, n] b[m, k] is exact in float64 (at most 48 significant bits), the M
// products are added in float64 in m order (error at most M 2^-53 sum_m |a b|),
// and the sum is rounded once: within 0.5 ulp of the exact result plus that, so
// correctly rounded unless the terms cancel below 2^-29 of sum |a b|.  float32
// products can overflow where the float64 ones do not; the rounding then gives
// Inf as float32 arithmetic would.  NaN and Inf propagate.
//
// Tensors: a, b float32 with unit column stride and row strides lda, ldb
// (elements); out (N, K) float32 row-major contiguous.  Any N, K >= 1.
//
// Layout: CTAs of 256 threads; each holds a strip of kTileK = 128 columns of b
// (all M rows) in shared memory as doubles, converted once, and walks n tiles of
// kTileN = 64 rows, staging a's M x 64 block per tile.  Warp w computes rows
// 8 w .. 8 w + 7 of the tile, lane l the columns l, l + 32, l + 64, l + 96 (32
// accumulators a thread): b's shared-memory reads are 256 contiguous bytes a warp
// (no bank conflicts), a's are broadcasts, and each store instruction of a warp
// writes 128 contiguous bytes of one row.  grid.x = the K strips; grid.y splits
// the n tiles so the grid holds about two CTAs per SM.

#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>

#include "device_facts.cuh"
#include "launchers.cuh"
#include "pdl.cuh"

namespace fused_gemm_bn {
namespace grad_w {

constexpr int kMaxRows = 16;  // small_m_fp64's rows (small_m_fp64_max_rows(): the launcher checks both)
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTileK = 128;                 // b's strip: 4 columns a lane
constexpr int kCols = kTileK / 32;          // columns a thread
constexpr int kRowsPerWarp = 8;             // rows of the n tile a warp computes
constexpr int kTileN = kWarps * kRowsPerWarp;  // 64
constexpr int kCtasPerSm = 2;               // the grid's target

struct Args {
  const float* a;
  const float* b;
  float* out;
  int64_t lda, ldb;
  int M, N, K;
  int tiles_per_cta;  // n tiles each CTA walks (the last CTA of a strip may have fewer)
};

__global__ void __launch_bounds__(kThreads) grad_w_kernel(const Args p) {
  pdl_wait_then_release();
  __shared__ __align__(16) double b_s[kMaxRows][kTileK];  // 16 KB
  __shared__ __align__(16) double a_s[kMaxRows][kTileN];  // 8 KB (read as double2)
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int k0 = blockIdx.x * kTileK;
  for (int i = tid; i < p.M * kTileK; i += kThreads) {
    const int m = i / kTileK, c = i % kTileK;
    b_s[m][c] = k0 + c < p.K ? static_cast<double>(p.b[m * p.ldb + k0 + c]) : 0.0;
  }
  const int n_tiles = (p.N + kTileN - 1) / kTileN;
  const int t_end = min(n_tiles, (static_cast<int>(blockIdx.y) + 1) * p.tiles_per_cta);
  for (int t = blockIdx.y * p.tiles_per_cta; t < t_end; ++t) {
    const int n0 = t * kTileN;
    __syncthreads();  // b_s written (first tile); the previous tile's a_s reads done
    for (int i = tid; i < p.M * kTileN; i += kThreads) {
      const int m = i / kTileN, r = i % kTileN;
      a_s[m][r] = n0 + r < p.N ? static_cast<double>(p.a[m * p.lda + n0 + r]) : 0.0;
    }
    __syncthreads();
    double acc[kRowsPerWarp][kCols];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
      for (int c = 0; c < kCols; ++c) acc[r][c] = 0.0;
#pragma unroll 2
    for (int m = 0; m < p.M; ++m) {
      double bv[kCols], av[kRowsPerWarp];
#pragma unroll
      for (int c = 0; c < kCols; ++c) bv[c] = b_s[m][lane + 32 * c];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; r += 2) {
        const double2 pair = *reinterpret_cast<const double2*>(&a_s[m][kRowsPerWarp * warp + r]);
        av[r] = pair.x, av[r + 1] = pair.y;
      }
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
        for (int c = 0; c < kCols; ++c) acc[r][c] = fma(av[r], bv[c], acc[r][c]);
    }
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int n = n0 + kRowsPerWarp * warp + r;
      if (n >= p.N) break;
      float* row = p.out + static_cast<int64_t>(n) * p.K + k0 + lane;
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        if (k0 + lane + 32 * c < p.K) __stcs(row + 32 * c, static_cast<float>(acc[r][c]));
      }
    }
  }
}

}  // namespace grad_w
}  // namespace fused_gemm_bn

// out (N, K) = a^T b in float64 sums (header above).  cudaErrorInvalidValue for M
// outside 1 .. min(16, small_m_fp64_max_rows()) or N, K < 1; nothing is launched then.
cudaError_t fused_gemm_bn::small_m_grad_w(const float* a, int64_t lda, const float* b, int64_t ldb, int M, int N,
                                          int K, float* out, cudaStream_t stream) {
  using namespace grad_w;
  if (M < 1 || M > kMaxRows || M > small_m_fp64_max_rows() || N < 1 || K < 1) return cudaErrorInvalidValue;
  DeviceFacts facts;
  const cudaError_t err = current_device_facts(&facts);
  if (err != cudaSuccess) return err;
  const int strips = (K + kTileK - 1) / kTileK, n_tiles = (N + kTileN - 1) / kTileN;
  const int chunks = std::max(1, std::min(n_tiles, (kCtasPerSm * facts.num_sms + strips - 1) / strips));
  Args p{a, b, out, lda, ldb, M, N, K, (n_tiles + chunks - 1) / chunks};
  const int grid_y = (n_tiles + p.tiles_per_cta - 1) / p.tiles_per_cta;
  if (grid_y > 65535) return cudaErrorInvalidValue;  // (n tiles of 64 rows: N < 2^31 keeps it far below)
  return launch_kernel(grad_w_kernel, dim3(strips, grid_y), kThreads, 0, stream, p);
}
