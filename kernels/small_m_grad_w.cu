// small_m_grad_w.cu -- the small-batch route's weight gradient: out = a^T b for
// a (M, N) and b (M, K) with M = 1 .. 16 rows, the backward's grad_W = grad_z^T x,
// each output the float64 sum of its M exact products rounded once to float32.
//
// Where: the binding's gemm_tn("small_m_fp64", a, b) launches it; model_new.py's
// dispatch_gemm_tn picks it for batches of at most small_m_fp64_max_rows() rows on
// Hopper by default, and on every full-rate FP64 GPU under FUSED_GEMM_BN_SMALL_M=1
// (docs/perf.md v58).
//
// Work: at small M grad_W is an outer product, N K outputs from M (N + K) inputs,
// so writing the N x K floats is the floor (256 MB at 8192 x 8192: 61 us on an H200,
// a fill_ of that size).  The products run on the FP64 tensor cores
// (dmma_f64.cuh: mma.m16n8k16 .f64 on sm_90, 8 mma.m8n8k4 elsewhere) with the rows
// zero-padded to 16: N K 16 FMAs, 36 us of the H200's FP64 tensor peak at 8192 x 8192,
// under the write.  v57's form (DFMA from shared memory, a barrier-bound tile walk)
// took 97 us at M = 1 and 202 us at M = 16 there (H200; perf.md v58).
//
// Numerics: a and b are converted to float64 exactly; each product a[m, n] b[m, k]
// is exact in float64 (at most 48 significant bits) and the M products are added in
// float64 in the tensor core (error at most M 2^-53 sum_m |a b|; the padded rows add
// exact zeros), then rounded once: within 0.5 ulp of the exact result plus that, so
// correctly rounded unless the terms cancel below 2^-29 of sum |a b|.  A sum beyond
// float32's range rounds to +-Inf.  NaN and Inf propagate.
//
// Tensors: a, b float32 with unit column stride and row strides lda, ldb
// (elements); out (N, K) float32 row-major contiguous.  Any N, K >= 1.
//
// Layout: the product is computed transposed, out^T (K x N) = b^T a, so that the
// operand held for the whole kernel is the MMA's larger one (A, 16 x 16) and the one
// streamed is its smaller one (B, 16 x 8).  CTAs of 8 independent warps (no CTA-wide
// barrier).  Warp w of CTA (x, y) holds kWarpK = 32 output columns
// k0 = 256 x + 32 w .. k0 + 31 as two A tiles, b^T rows of 16 columns x the 16
// (padded) batch rows, converted once into 16 doubles a lane, and walks output rows in
// steps of kStepN = 16 (two B tiles of a's columns), the CTA's y-th share of them:
// per step 4 MMAs and 8 floats of a loaded a lane, two steps ahead into two register
// buffers used in turn (the 8 warps of a CTA load the same slices, but at 16 rows only
// 45% of those loads hit L1 (ncu, perf.md v60): L2 latency, hidden behind two steps).
// The step's 16 x 32 outputs go through the warp's own shared tile (18 KB a CTA,
// __syncwarp only) and leave as streaming (__stcs) stores of whole rows: float4 a lane, 4
// rows x 128 bytes an instruction, where K % 4 == 0 and out is 16-byte aligned; otherwise
// one row's 128 contiguous bytes an instruction.
// (v58 stored the MMA fragments directly, 4 rows x 32 bytes an instruction: 4x the L2
// write requests, 96-105 us against 71-82 at 8192 x 8192; perf.md v59.)  The grid is
// strips (x) x shares (y), at most two CTAs a SM in one wave.  ptxas: 123 registers
// (sm_90a), 112 (sm_80), no spill.
//
// Sources: PTX ISA, "Warp-level matrix multiply-accumulate instructions" (mma .f64
// fragments); CUDA C++ Programming Guide, __stcs (cache-streaming store).

#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>

#include "device_facts.cuh"
#include "dmma_f64.cuh"
#include "launchers.cuh"
#include "pdl.cuh"

namespace fused_gemm_bn {
namespace grad_w {

constexpr int kMaxRows = 16;  // small_m_fp64's rows (small_m_fp64_max_rows(): the launcher checks both)
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kWarpK = 32;                  // output columns a warp holds: two A tiles of 16
constexpr int kTileK = kWarps * kWarpK;     // 256: a CTA's strip
constexpr int kStepN = 16;                  // output rows a warp step: two B tiles of 8
constexpr int kTileStride = kWarpK + 4;     // the store tile's row pitch (floats): 16-byte rows, no bank conflict
constexpr int kCtasPerSm = 2;               // the grid's target (launch bounds: <= 128 registers)

struct Args {
  const float* a;
  const float* b;
  float* out;
  int64_t lda, ldb;
  int M, N, K;
  int steps_per_cta;  // n steps each CTA walks (the last CTA of a strip may have fewer)
};

// a's columns n0 .. n0 + 15 as the step's two B tiles, lane (g, t): v[q][i] = a[4t + i][n0 + 8q + g]
// (0 past M or N).
__device__ __forceinline__ void load_step(const Args& p, int n0, int g, int t, float (&v)[2][4]) {
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int n = n0 + 8 * q + g;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int m = 4 * t + i;
      v[q][i] = m < p.M && n < p.N ? __ldg(p.a + m * p.lda + n) : 0.f;
    }
  }
}

__global__ void __launch_bounds__(kThreads, kCtasPerSm) grad_w_kernel(const Args p) {
  pdl_wait_then_release();
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int kw = blockIdx.x * kTileK + (threadIdx.x / 32) * kWarpK;
  if (kw >= p.K) return;  // (whole warps; nothing below synchronizes more than one warp)
  __align__(16) __shared__ float tiles[kWarps][kStepN][kTileStride];
  float(&tile)[kStepN][kTileStride] = tiles[threadIdx.x / 32];
  const bool rows_aligned = p.K % 4 == 0 && reinterpret_cast<uintptr_t>(p.out) % 16 == 0;
  // A tiles h = 0, 1: out^T rows kw + 16 h .. + 15 (b's columns), k index = batch row:
  // alo[h][i] = b[4t + i][kw + 16 h + g], ahi[h][i] the same 8 columns on (0 past M or K).
  double alo[2][4], ahi[2][4];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int m = 4 * t + i, k = kw + 16 * h + g;
      alo[h][i] = m < p.M && k < p.K ? static_cast<double>(p.b[m * p.ldb + k]) : 0.0;
      ahi[h][i] = m < p.M && k + 8 < p.K ? static_cast<double>(p.b[m * p.ldb + k + 8]) : 0.0;
    }
  const int steps = (p.N + kStepN - 1) / kStepN;
  const int s_begin = blockIdx.y * p.steps_per_cta, s_end = min(steps, s_begin + p.steps_per_cta);
  // a's slices two steps ahead, in two register buffers used in turn (no copy between
  // them, so a pending load never stalls a move).
  float buf0[2][4], buf1[2][4];
  if (s_begin < s_end) load_step(p, s_begin * kStepN, g, t, buf0);
  if (s_begin + 1 < s_end) load_step(p, (s_begin + 1) * kStepN, g, t, buf1);
  auto step = [&](const int s, float(&buf)[2][4]) {
    const int n0 = s * kStepN;
    double bq[2][4];
#pragma unroll
    for (int q = 0; q < 2; ++q)
#pragma unroll
      for (int i = 0; i < 4; ++i) bq[q][i] = static_cast<double>(buf[q][i]);
    if (s + 2 < s_end) load_step(p, n0 + 2 * kStepN, g, t, buf);
    // d[h][q][v0 + 2 v1] = out^T[kw + 16 h + g + 8 v1][n0 + 8 q + 2 t + v0]
    double d[2][2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int q = 0; q < 2; ++q) {
#pragma unroll
        for (int v = 0; v < 4; ++v) d[h][q][v] = 0.0;
        dmma_chunk_16x8(d[h][q], alo[h], ahi[h], bq[q]);
      }
    // The step's 16 x 32 outputs through the warp's own shared tile, so that each store
    // instruction writes 4 whole rows of 128 bytes (float4 a lane) instead of 4 x 32 bytes.
    // Element (row r, column c) = out[n0 + r][kw + c]: the fragment writes r = 8 q + 2 t + v0,
    // c = 16 h + 8 v1 + g (banks 8 t + g + const: 32 distinct); lane l reads row 4 i + l / 8,
    // columns 4 (l % 8) .. + 3 (a quarter-warp a row: conflict-free).
    __syncwarp();  // (the previous step's reads of the tile are done)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int q = 0; q < 2; ++q)
#pragma unroll
        for (int v = 0; v < 4; ++v) tile[8 * q + 2 * t + v % 2][16 * h + 8 * (v / 2) + g] = static_cast<float>(d[h][q][v]);
    __syncwarp();
    if (rows_aligned) {  // K % 4 == 0: k < K covers k .. k + 3
      const int c = 4 * (lane % 8), k = kw + c;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = 4 * i + lane / 8;
        if (k < p.K && n0 + r < p.N)
          __stcs(reinterpret_cast<float4*>(p.out + static_cast<int64_t>(n0 + r) * p.K + k),
                 *reinterpret_cast<const float4*>(&tile[r][c]));
      }
    } else {  // rows not 16-byte aligned: one row's 32 columns (128 contiguous bytes) an instruction
      const int k = kw + lane;
#pragma unroll
      for (int r = 0; r < kStepN; ++r)
        if (k < p.K && n0 + r < p.N) __stcs(p.out + static_cast<int64_t>(n0 + r) * p.K + k, tile[r][lane]);
    }
  };
  for (int s = s_begin; s < s_end; s += 2) {
    step(s, buf0);
    if (s + 1 < s_end) step(s + 1, buf1);
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
  // One wave: strips x shares <= kCtasPerSm CTAs a SM (a second, partial wave would double the time).
  const int strips = (K + kTileK - 1) / kTileK, steps = (N + kStepN - 1) / kStepN;
  const int shares = std::max(1, std::min(steps, kCtasPerSm * facts.num_sms / strips));
  Args p{a, b, out, lda, ldb, M, N, K, (steps + shares - 1) / shares};
  const int grid_y = (steps + p.steps_per_cta - 1) / p.steps_per_cta;
  if (grid_y > 65535) return cudaErrorInvalidValue;  // (steps of 16 rows: N < 2^31 keeps it far below)
  return launch_kernel(grad_w_kernel, dim3(strips, grid_y), kThreads, 0, stream, p);
}
