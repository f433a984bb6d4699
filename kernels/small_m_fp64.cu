// small_m_fp64.cu -- the small-batch route (M = 1 .. 32 rows): one read of W,
// products and sums in float64 on the FP64 tensor cores (DMMA), z rounded once
// to float32, with the training statistics or the eval-mode fold in the same
// kernel.  Portable: mma.sync m8n8k4 .f64 (sm_80+); nothing Hopper-only.
//
// Formula
//   z[m, n] = sum_k x[m, k] * w[n, k]          (z = x @ W^T, no bias)
//   train:  z (float32) and one statistics tile of the M rows:
//           part_mean[n] = mean_m z[m, n],  part_m2[n] = sum_m (z[m, n] - part_mean[n])^2
//           both from the float64 sums (before z is rounded), rounded once.
//   eval:   out[m, n] = rn_f32(a[n] * z64[m, n] + c[n]) with, in float64,
//           g = bn_weight / sqrt(running_var + eps),  a = scale * g and
//             problem 33 (!scale_after_bn):  c = bn_bias + (scale * bias - running_mean) * g
//             problem 84 ( scale_after_bn):  c = scale * (bn_bias + (bias - running_mean) * g)
//           the formulas of model_new.py's _torch_forward_eval and of
//           bn_eval_affine (bn_stats.cuh), here in float64 and applied to the
//           unrounded z (bn_eval_affine is float32, as PyTorch's eval BatchNorm;
//           its float32 a, c would cost more than the GEMM's error).  Problem 84's
//           out is the softmax input v: the caller runs softmax_rows(v, out, nullptr, M, N).
//           Null bias / bn_weight / bn_bias read as 0 / 1 / 0 (the existing eval
//           epilogues read all six vectors unconditionally: the binding always passes them).
//
// Tensors
//   x (M, K) float32, row stride x_row_stride elements, column stride 1, 4-byte aligned
//   w (N, K) float32 row-major contiguous (K-major, nn.Linear's layout); 16-byte
//       loads where K % 4 == 0 and w is 16-byte aligned, else 4-byte loads
//   z, out (M, N) float32 contiguous;  part_mean, part_m2 (1, N) float32
//   workspace: small_m_fp64_workspace_bytes(M, N, K, num_sms) bytes (pieces x M x N
//       float64 partial sums; 0 and null-able when K is not split), 8-byte aligned
//
// Statistics contract (train): the M rows are ONE tile, so the existing
//   merge (bn_stats.cuh merge_tile_statistics, tile t holding min(block_m, M -
//   t block_m) rows) reads it with num_m_tiles = 1 and block_m = M (any block_m
//   >= M is the same): bn_apply(z, out, part_mean, part_m2, 1, M, M, N, bn, coeff,
//   stats, stream) for problem 33 (coeff unused at 1 tile <= kFusedMaxTiles; M >= 2,
//   as bn_apply requires), bn_softmax_fold_train(part_mean, part_m2, 1, M, M, N, bn,
//   coeff, stats, stream) then softmax_rows(z, out, coeff, M, N, stream) for 84.
//   The merge then gives mean = float(mean64) exactly (M * mean / M) and m2 =
//   float(M2_64).
//
// Numerics
//   Conversions are exact: x's floats are staged in shared memory as the doubles
//   x * 2^896, w's floats enter the MMA as the doubles w * 2^-896 (bit moves,
//   f32_to_f64_times_2m896 below: exact for every finite float, subnormals
//   included; tools/small_m_check.cu compares them with ldexp on 2^24 patterns), so
//   each product is x*w exactly (a float product has <= 48 significant bits).
//   (A float-subnormal w becomes a double subnormal: the FP64 MMA is assumed to
//   honour subnormal operands as DFMA does; the check's inputs are normal.)
//   Products are accumulated in float64 (round to nearest; the order of the K
//   terms differs from a plain loop: per warp over its chunks, then the K slices
//   in warp order, then the pieces in piece order), so with u64 = 2^-53
//       |z64 - z| <= (K + 8) u64 sum_k |x[m, k] w[n, k]|
//   and z = rn_f32(z64) is within 0.5 ulp(z) + that: within 1 ulp of the
//   correctly rounded value wherever sum_k |x w| / |z| <= 2^29 / (K + 8)
//   (65472 at K = 8192: only heavy cancellation breaks it).  mean and M2 are
//   formed in float64 from z64 (M2 as sum (z64 - mean)^2: no E[z^2] - E[z]^2
//   cancellation) and rounded once; eval's a, c and a z64 + c in float64,
//   rounded once.  tools/small_m_check.cu checks every element against these
//   bounds (reference: exact products, long double sums).
//   A non-finite x element converts to a non-finite double, so it reaches z as in eager
//   (an infinity's sign and a NaN's payload aside); W must be finite: a non-finite W
//   element becomes a finite term (checking it in the W loop spills registers on sm_80).
//
// Work split (SmallMTraits below; kMBlocks = 1, 2, 4 for M <= 8, 16, 32)
//   CTA: 12 warps = kWarpsN (2) feature halves x kWarpsK (6) K slices, 384
//   threads, one CTA per SM (<= 168 registers: with 512 threads the 128-register
//   cap spilled).  BLOCK_N = kWarpsN x kFeatGroups x 8 = 64 features (32 at
//   kMBlocks = 4): whole W rows, so a feature's sums end in one CTA.  Each warp
//   keeps kFeatGroups x kMBlocks DMMA accumulators (8 features x 8 batch rows
//   each): A = 8 W rows x 4 k (lane (g, t) holds W[g][k0 + 4t + s] for step s:
//   one 16-byte load gives its 4 steps), B = 4 k x 8 batch rows of x, from shared
//   memory in fragment order (one conflict-free 16-byte load per two steps).
//   x is staged in tiles of BLOCK_K = 384 / kMBlocks columns (kRows x BLOCK_K
//   doubles = 24 KB, double-buffered, one __syncthreads per tile; the next
//   tile's floats are loaded into registers while the current one is used);
//   each warp's W loads run kRing - 1 = 2 chunks (16 k) ahead in registers.
//   At the end the K slices are summed through shared memory in warp order, and
//   either the epilogue runs (one thread per feature), or, with K split into
//   pieces (fewer feature blocks than SMs), each piece stores its float64 sums to
//   the workspace and small_m_fp64_finish_kernel adds the pieces in piece order
//   and runs the epilogue.  No atomics: the same bits on every run.
//
// Performance model (predictions, not measurements: tools/small_m_check.cu
// measures the kernel next to the floor on the GPU).
//   Floor: W read once, 4 N K bytes (268 MB at N = K = 8192: ~90 us on an H100,
//   ~60 us on an H200, half of a device-to-device copy of W).
//   DFMA would not keep up at M = 16: 64 DFMA/clk/SM x 132 SMs x 1.75 GHz =
//   14.8e12/s, and 16 x 8192^2 = 1.07e9 products take 72.6 us at full issue (over
//   the H200's floor, 0.8x the H100's), plus the float -> double conversions
//   (16/clk/SM for 64-bit types, CUDA C++ Programming Guide, arithmetic
//   instructions table, cc 8.0 / 9.0).  The FP64 tensor core does 128 FMA/clk/SM
//   (H100 SXM: 67 TFLOP/s FP64 Tensor Core = 128 x 2 x 132 x 1.98 GHz): 36 us at
//   M = 9 .. 16 and 18 us at M <= 8 (an 8-row block costs the same whatever the
//   rows used) at 1.75 GHz, 73 us at M = 17 .. 32 (compute-bound on an H200).
//   Per 16-k chunk a warp issues 4 kFeatGroups kMBlocks DMMAs (8 clk each on its
//   SM sub-partition), kFeatGroups 16-byte W loads, 4 kFeatGroups conversions of
//   3 integer ops (INT pipe, not FP64) and 2 kMBlocks 16-byte shared loads:
//   ~110 issue slots against 256 DMMA clocks at kMBlocks = 2.  x staging: 2
//   integer ops + 2 DMUL per x element per CTA: 6% of the FP64 pipe at M = 16.
//   Shared memory: 0.125 B per FMA at kFeatGroups = 4 (16 B/clk/SM of 128).
//   L2 -> SM: every CTA reads all of x once: ceil(N / BLOCK_N) x 4 M K bytes =
//   64 MB at N = K = 8192, M = 16 (a quarter of W's bytes).
//   W in flight per SM: 384 threads x kFeatGroups x 16 B x 2 chunks ahead = 48 KB
//   (kFeatGroups = 4; 24 KB at kMBlocks = 4).  Little's law at ~700 ns loaded DRAM
//   latency needs ~18 KB/SM (H100: 3.35 TB/s / 132 SMs = 25 B/ns) to ~26 KB/SM
//   (H200: 36 B/ns).
//   Predicted at N = K = 8192: M <= 16 memory-bound at ~1.05-1.1x the floor
//   (128 CTAs on 132 SMs stream W; a few us of launch, pipeline fill and
//   epilogue); M = 32: ~1.1x on an H100, >= 1.2x on an H200 (compute).  Small
//   shapes ((4096, 512): 8 MB of W, 11 pieces) are latency-bound: two launches
//   and the pipeline fill make the ratio to a 1-3 us floor well above 1.15.
//
// Preconditions: 1 <= M <= kSmallMMaxRows (32), N >= 1, K >= 1, W finite;
// eval: bn.scale, bn.running_mean, bn.running_var not null; workspace as above.
// SM 8.0+ (mma.sync .f64; runs, slowly, where FP64 is 1/64 rate: sm_86 / sm_89).
// Sources: PTX ISA, "Warp-level matrix multiply-accumulate instructions",
// mma.m8n8k4 with .f64 (fragment layouts); IEEE 754 binary64 format; CUDA C++
// Programming Guide, "Arithmetic Instructions" (throughput table).

#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>

#include "device_facts.cuh"
#include "launchers.cuh"
#include "load_hints.cuh"
#include "pdl.cuh"

namespace fused_gemm_bn {

constexpr int kSmallMMaxRows = 32;

// One traits struct per batch block count (kMBlocks 8-row blocks: M <= 8, 16, 32).
template <int kMBlocks_>
struct SmallMTraits {
  static constexpr int kMBlocks = kMBlocks_;
  static constexpr int kRows = kMBlocks * 8;  // batch rows held (M padded)
  // 8-feature groups per warp: F x kMBlocks accumulator pairs (<= 8 pairs = 32
  // registers), F reuses of each x fragment.
  static constexpr int kFeatGroups = kMBlocks <= 2 ? 4 : 2;
  static constexpr int kWarpsN = 2;
  // 12 warps: 384 threads, one CTA per SM, up to 168 registers per thread (at
  // 512 threads the 128-register cap spilled with 2 chunks in registers).
  static constexpr int kWarpsK = 6;
  static constexpr int kNumWarps = kWarpsN * kWarpsK;
  static constexpr int kNumThreads = kNumWarps * 32;
  static constexpr int BLOCK_N = kWarpsN * kFeatGroups * 8;
  static constexpr int CHUNK_K = 16;  // one 16-byte W load per lane and group
  // x tile: kRows x BLOCK_K doubles = 24 KB per buffer whatever kMBlocks.
  static constexpr int kChunksPerWarp = 4 / kMBlocks;
  static constexpr int BLOCK_K = kChunksPerWarp * CHUNK_K * kWarpsK;
  static constexpr int kXTileBytes = kRows * BLOCK_K * 8;
  static constexpr int kXPerThread = kRows * BLOCK_K / kNumThreads;  // staged floats per thread per tile
  // W chunks in registers: the one being used and kRing - 1 loaded ahead.
  static constexpr int kRing = 3;
  // The final K-slice reduction: kNumWarps x 32 lanes x F x kMBlocks x 2 doubles.
  // Then each feature's float64 sums z64[n][m] (BLOCK_N x kRows doubles) after it.
  static constexpr int kReduceBytes = kNumWarps * 32 * kFeatGroups * kMBlocks * 2 * 8;
  static constexpr int kZsumBytes = BLOCK_N * kRows * 8;
  static constexpr int kSmemBytes =
      2 * kXTileBytes > kReduceBytes + kZsumBytes ? 2 * kXTileBytes : kReduceBytes + kZsumBytes;
  static_assert(kChunksPerWarp >= 1 && BLOCK_K == kChunksPerWarp * CHUNK_K * kWarpsK, "x tile splits over warps");
  static_assert(kRows * BLOCK_K % kNumThreads == 0, "x tile splits over threads");
  static_assert(BLOCK_N <= kNumThreads, "one thread per feature in the epilogue");
};

struct SmallMArgs {
  const float* x;
  int64_t x_row_stride;
  const float* w;
  int M, N, K;
  int pieces;           // K split: blockIdx.y = piece; 1: the epilogue runs in the GEMM kernel
  int tiles_per_piece;  // BLOCK_K tiles per piece (the last piece: the rest)
  double* partials;     // (pieces, M, N) float64, pieces > 1
  // train
  float* z;
  float* part_mean;
  float* part_m2;
  int64_t* num_batches_tracked;  // += 1 by the GEMM kernel's first thread when not null
  // eval: bias, scale, bn_weight, bn_bias, running_mean, running_var, eps, scale_after_bn
  BatchNormArgs bn;
  float* out;
};

// w * 2^-896 exactly, for every finite float w: w's sign, exponent and
// mantissa bits moved into a double's fields without rebiasing the exponent
// (a float of exponent field e, mantissa f is 2^(e-127) 1.f; the double with
// the same fields is 2^(e-1023) 1.f; subnormals (e = 0) scale the same way).
// Three integer ops, no FP64 conversion (16/clk/SM) on the FP64 pipe.  A
// non-finite w (exponent field 255) becomes a finite double: the launchers'
// callers take finite weights (the route is opt-in; README limitations).
__device__ __forceinline__ double f32_to_f64_times_2m896(float w) {
  const uint32_t b = __float_as_uint(w);
  const int hi = (static_cast<int>(b) >> 3) & static_cast<int>(0x8fffffffu);
  return __hiloint2double(hi, static_cast<int>(b << 29));
}

// x * 2^896 exactly (|x| < 2^128: below 2^1024, no overflow); an infinity or NaN x
// stays one (the all-ones exponent), so it reaches z as in eager.
__device__ __forceinline__ double f32_to_f64_times_2p896(float x) {
  const uint32_t b = __float_as_uint(x);
  const int non_finite = (b & 0x7f800000u) == 0x7f800000u ? 0x7ff00000 : 0;
  const int hi = ((static_cast<int>(b) >> 3) & static_cast<int>(0x8fffffffu)) | non_finite;
  return __hiloint2double(hi, static_cast<int>(b << 29)) * 0x1p896 * 0x1p896;
}

// D = A B + D, A 8x4 (row), B 4x8 (col), float64 (PTX ISA mma.m8n8k4 .f64):
// lane = 4 g + t holds a = A[g][t], b = B[t][g], d = D[g][2t], D[g][2t + 1].
__device__ __forceinline__ void dmma_m8n8k4(double& d0, double& d1, double a, double b) {
  asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%0, %1};"
      : "+d"(d0), "+d"(d1)
      : "d"(a), "d"(b));
}

// The per-feature epilogue of feature n from its float64 sums zd[0 .. M).
template <int kRows, bool kEval>
__device__ __forceinline__ void small_m_feature_epilogue(const SmallMArgs& p, int n, const double (&zd)[kRows]) {
  const int M = p.M, N = p.N;
  if constexpr (kEval) {
    const BatchNormArgs& bn = p.bn;
    const double bias = bn.bias != nullptr ? static_cast<double>(bn.bias[n]) : 0.0;
    const double gamma = bn.bn_weight != nullptr ? static_cast<double>(bn.bn_weight[n]) : 1.0;
    const double beta = bn.bn_bias != nullptr ? static_cast<double>(bn.bn_bias[n]) : 0.0;
    const double s = bn.scale[n], rm = bn.running_mean[n];
    const double g = gamma / sqrt(static_cast<double>(bn.running_var[n]) + static_cast<double>(bn.eps));
    const double a = s * g;
    const double c = bn.scale_after_bn ? s * fma(bias - rm, g, beta) : fma(fma(s, bias, -rm), g, beta);
#pragma unroll
    for (int m = 0; m < kRows; ++m)
      if (m < M) p.out[static_cast<size_t>(m) * N + n] = static_cast<float>(fma(a, zd[m], c));
  } else {
    double mean = 0.0;
#pragma unroll
    for (int m = 0; m < kRows; ++m)
      if (m < M) {
        mean += zd[m];
        p.z[static_cast<size_t>(m) * N + n] = static_cast<float>(zd[m]);
      }
    mean /= static_cast<double>(M);
    double m2 = 0.0;
#pragma unroll
    for (int m = 0; m < kRows; ++m)
      if (m < M) m2 = fma(zd[m] - mean, zd[m] - mean, m2);
    p.part_mean[n] = static_cast<float>(mean);
    p.part_m2[n] = static_cast<float>(m2);
  }
}

// Loads the W chunk of k columns [k, k + 4) of row `row` (one lane's 4 steps);
// zeros past k_end or past N.
template <bool kVec16>
__device__ __forceinline__ float4 load_w_chunk(const float* w_row, bool row_ok, int k, int k_end) {
  if constexpr (kVec16) {
    // K % 4 == 0 and k % 4 == 0: k < k_end means all four are in range.
    if (row_ok && k < k_end) return ld_evict_first_f4(w_row + k);
    return make_float4(0.f, 0.f, 0.f, 0.f);
  } else {
    float4 v;
    v.x = row_ok && k < k_end ? __ldg(w_row + k) : 0.f;
    v.y = row_ok && k + 1 < k_end ? __ldg(w_row + k + 1) : 0.f;
    v.z = row_ok && k + 2 < k_end ? __ldg(w_row + k + 2) : 0.f;
    v.w = row_ok && k + 3 < k_end ? __ldg(w_row + k + 3) : 0.f;
    return v;
  }
}

// grid (ceil(N / BLOCK_N), pieces), kNumThreads threads, T::kSmemBytes of
// dynamic shared memory.
template <class T, bool kEval, bool kVec16>
__global__ void __launch_bounds__(T::kNumThreads, 1) small_m_fp64_kernel(const SmallMArgs p) {
  pdl_wait_then_release();
  constexpr int F = T::kFeatGroups, MB = T::kMBlocks, kRing = T::kRing;
  extern __shared__ __align__(16) unsigned char small_m_smem[];
  double* xs = reinterpret_cast<double*>(small_m_smem);  // [2][BLOCK_K / 16][MB][2][32 lanes] double2

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int warp_n = warp / T::kWarpsK, warp_k = warp % T::kWarpsK;
  // nn.BatchNorm1d's step counter, once per training call (the pre-pass does it on the other routes).
  if (p.num_batches_tracked != nullptr && tid == 0 && blockIdx.x == 0 && blockIdx.y == 0) *p.num_batches_tracked += 1;
  const int n0 = blockIdx.x * T::BLOCK_N + warp_n * F * 8;
  const int M = p.M, N = p.N, K = p.K;
  const int piece = blockIdx.y;
  const int tile_begin = piece * p.tiles_per_piece;
  const int k_begin = tile_begin * T::BLOCK_K;
  const int k_end = min(K, k_begin + p.tiles_per_piece * T::BLOCK_K);
  const int num_tiles = (k_end - k_begin + T::BLOCK_K - 1) / T::BLOCK_K;
  const int num_items = num_tiles * T::kChunksPerWarp;

  // Row n0 + 8 f + g of group f is at w_lane + 8 f K (formed per load: registers are the limit).
  const float* w_lane = p.w + static_cast<size_t>(n0 + g) * K;
  // Item i: tile i / kChunksPerWarp, chunk (i % kChunksPerWarp) * kWarpsK + warp_k
  // of it (the warps of a CTA read adjacent 64-byte pieces of each row).
  auto item_k = [&](int i) {
    return k_begin + (i / T::kChunksPerWarp) * T::BLOCK_K +
           ((i % T::kChunksPerWarp) * T::kWarpsK + warp_k) * T::CHUNK_K + 4 * t;
  };
  auto load_item = [&](int i, float4 (&dst)[F]) {
    const int k = item_k(i);
#pragma unroll
    for (int f = 0; f < F; ++f)
      dst[f] = load_w_chunk<kVec16>(w_lane + static_cast<size_t>(8 * f) * K, n0 + 8 * f + g < N && i < num_items, k,
                                    k_end);
  };

  // x tile staging: element e = tid + r * kNumThreads of the tile is row e / BLOCK_K,
  // column e % BLOCK_K (coalesced along k); rows >= M and columns >= k_end are 0.
  float xr[T::kXPerThread];
  auto load_x_tile = [&](int tile) {
    const int k0 = k_begin + tile * T::BLOCK_K;
#pragma unroll
    for (int r = 0; r < T::kXPerThread; ++r) {
      const int e = tid + r * T::kNumThreads;
      const int m = e / T::BLOCK_K, k = k0 + e % T::BLOCK_K;
      xr[r] = tile < num_tiles && m < M && k < k_end ? __ldg(p.x + m * p.x_row_stride + k) : 0.f;
    }
  };
  // Fragment order: the double at chunk c, batch block mb, step s, lane (g, t)
  // is x[8 mb + g][16 c + 4 t + s] * 2^896, at ((c MB + mb) 2 + s / 2) 32 + lane
  // (double2 units), component s % 2: each B-fragment pair is one conflict-free 16-byte load.
  auto store_x_tile = [&](int buf) {
    double* dst = xs + buf * (T::kXTileBytes / 8);
#pragma unroll
    for (int r = 0; r < T::kXPerThread; ++r) {
      const int e = tid + r * T::kNumThreads;
      const int m = e / T::BLOCK_K, kl = e % T::BLOCK_K;
      const int c = kl / 16, tt = (kl / 4) % 4, s = kl % 4;
      const int idx = (((c * MB + m / 8) * 2 + s / 2) * 32 + (m % 8) * 4 + tt) * 2 + (s % 2);
      dst[idx] = f32_to_f64_times_2p896(xr[r]);
    }
  };

  double acc[F][MB][2];
#pragma unroll
  for (int f = 0; f < F; ++f)
#pragma unroll
    for (int mb = 0; mb < MB; ++mb) acc[f][mb][0] = acc[f][mb][1] = 0.0;

  float4 wbuf[kRing][F];
#pragma unroll
  for (int r = 0; r < kRing; ++r) load_item(r, wbuf[r]);
  load_x_tile(0);

  for (int i0 = 0; i0 < num_items; i0 += kRing) {
#pragma unroll
    for (int r = 0; r < kRing; ++r) {
      const int i = i0 + r;
      if (i < num_items) {  // uniform over the CTA: every warp has num_items items
        const int tile = i / T::kChunksPerWarp, j = i % T::kChunksPerWarp;
        if (j == 0) {
          // Buffer tile % 2 was last read in tile - 2, before every thread passed
          // the barrier of tile - 1.
          store_x_tile(tile & 1);
          __syncthreads();
          load_x_tile(tile + 1);
        }
        const double2* xf = reinterpret_cast<const double2*>(xs + (tile & 1) * (T::kXTileBytes / 8)) +
                            ((j * T::kWarpsK + warp_k) * MB * 2) * 32 + lane;
#pragma unroll
        for (int pair = 0; pair < 2; ++pair) {  // steps s = 2 pair, 2 pair + 1: one x load per batch block
          double2 xb[MB];
#pragma unroll
          for (int mb = 0; mb < MB; ++mb) xb[mb] = xf[(mb * 2 + pair) * 32];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int f = 0; f < F; ++f) {
              const float4& wv = wbuf[r][f];
              const double a = f32_to_f64_times_2m896(pair == 0 ? (h == 0 ? wv.x : wv.y) : (h == 0 ? wv.z : wv.w));
#pragma unroll
              for (int mb = 0; mb < MB; ++mb) dmma_m8n8k4(acc[f][mb][0], acc[f][mb][1], a, h == 0 ? xb[mb].x : xb[mb].y);
            }
          }
        }
        load_item(i + kRing, wbuf[r]);
      }
    }
  }

  // Sum the kWarpsK K slices in warp order: red[warp][f][mb][h][lane].
  __syncthreads();
  double* red = reinterpret_cast<double*>(small_m_smem);
#pragma unroll
  for (int f = 0; f < F; ++f)
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
      for (int h = 0; h < 2; ++h) red[(((warp * F + f) * MB + mb) * 2 + h) * 32 + lane] = acc[f][mb][h];
  __syncthreads();
  // zsum[feature_local][m]: after the reduction area.
  double* zsum = red + T::kNumWarps * 32 * F * MB * 2;
  for (int o = tid; o < T::BLOCK_N * T::kRows; o += T::kNumThreads) {
    // o -> (warp_n, f, mb, h, lane); feature = warp_n F 8 + f 8 + g, row m = 8 mb + 2 t + h.
    const int ln = o % 32, h = (o / 32) % 2, mb = (o / 64) % MB, f = (o / (64 * MB)) % F, wn = o / (64 * MB * F);
    double v = 0.0;
#pragma unroll
    for (int wk = 0; wk < T::kWarpsK; ++wk)
      v += red[((((wn * T::kWarpsK + wk) * F + f) * MB + mb) * 2 + h) * 32 + ln];
    const int nl = wn * F * 8 + f * 8 + (ln >> 2), m = 8 * mb + 2 * (ln & 3) + h;
    zsum[nl * T::kRows + m] = v;
  }
  __syncthreads();
  if (tid >= T::BLOCK_N) return;
  const int n = blockIdx.x * T::BLOCK_N + tid;
  if (n >= N) return;
  double zd[T::kRows];
#pragma unroll
  for (int m = 0; m < T::kRows; ++m) zd[m] = zsum[tid * T::kRows + m];
  if (p.pieces > 1) {
#pragma unroll
    for (int m = 0; m < T::kRows; ++m)
      if (m < M) p.partials[(static_cast<size_t>(piece) * M + m) * N + n] = zd[m];
    return;
  }
  small_m_feature_epilogue<T::kRows, kEval>(p, n, zd);
}

// K split: z64[m, n] = sum over pieces in piece order, then the epilogue; one thread per feature.
template <int kRows, bool kEval>
__global__ void __launch_bounds__(256) small_m_fp64_finish_kernel(const SmallMArgs p) {
  pdl_wait_then_release();
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= p.N) return;
  double zd[kRows];
#pragma unroll
  for (int m = 0; m < kRows; ++m) {
    zd[m] = 0.0;
    if (m < p.M)
      for (int q = 0; q < p.pieces; ++q) zd[m] += p.partials[(static_cast<size_t>(q) * p.M + m) * p.N + n];
  }
  small_m_feature_epilogue<kRows, kEval>(p, n, zd);
}

// K pieces: 1 when the feature blocks fill the SMs (one CTA per SM), else as
// many as fill them once (each at least one BLOCK_K tile, at most kMaxPieces).
constexpr int kSmallMMaxPieces = 32;
struct SmallMPlan {
  int m_blocks = 0;  // 1, 2, 4: the traits
  int block_n = 0, block_k = 0;
  int pieces = 1, tiles_per_piece = 0;
};

static SmallMPlan small_m_plan(int M, int N, int K, int num_sms) {
  SmallMPlan plan;
  plan.m_blocks = M <= 8 ? 1 : M <= 16 ? 2 : 4;
  switch (plan.m_blocks) {
    case 1: plan.block_n = SmallMTraits<1>::BLOCK_N, plan.block_k = SmallMTraits<1>::BLOCK_K; break;
    case 2: plan.block_n = SmallMTraits<2>::BLOCK_N, plan.block_k = SmallMTraits<2>::BLOCK_K; break;
    default: plan.block_n = SmallMTraits<4>::BLOCK_N, plan.block_k = SmallMTraits<4>::BLOCK_K; break;
  }
  const int feature_blocks = (N + plan.block_n - 1) / plan.block_n;
  const int num_tiles = (K + plan.block_k - 1) / plan.block_k;
  int pieces = feature_blocks >= num_sms ? 1 : num_sms / feature_blocks;
  pieces = std::max(1, std::min({pieces, num_tiles, kSmallMMaxPieces}));
  plan.tiles_per_piece = (num_tiles + pieces - 1) / pieces;
  plan.pieces = (num_tiles + plan.tiles_per_piece - 1) / plan.tiles_per_piece;
  return plan;
}

template <class T, bool kEval, bool kVec16>
static cudaError_t launch_small_m_gemm(const SmallMArgs& p, int device, cudaStream_t stream) {
  auto kernel = small_m_fp64_kernel<T, kEval, kVec16>;
  // The shared-memory opt-in once per device and kernel (a host call per launch
  // would sit inside a small launch's time); a racing second set is harmless.
  static bool configured[kMaxCachedDevices] = {};
  cudaError_t err = cudaSuccess;
  if (device >= kMaxCachedDevices || !configured[device]) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes);
    if (err != cudaSuccess) return err;
    if (device < kMaxCachedDevices) configured[device] = true;
  }
  // Unlike the large GEMMs (pdl.cuh), this one-wave kernel releases its dependents at once: the
  // BatchNorm kernel after it is launched while it runs and waits on the device (a small batch's
  // call time is mostly such gaps).
  err = launch_kernel(kernel, dim3((p.N + T::BLOCK_N - 1) / T::BLOCK_N, p.pieces), dim3(T::kNumThreads),
                      T::kSmemBytes, stream, p);
  if (err != cudaSuccess || p.pieces == 1) return err;
  return launch_kernel(small_m_fp64_finish_kernel<T::kRows, kEval>, dim3((p.N + 255) / 256), dim3(256), 0, stream,
                       p);
}

template <bool kEval>
static cudaError_t launch_small_m(SmallMArgs p, double* workspace, cudaStream_t stream) {
  DeviceFacts facts;
  int device = 0;
  cudaError_t err = current_device_facts(&facts);
  if (err == cudaSuccess) err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const SmallMPlan plan = small_m_plan(p.M, p.N, p.K, facts.num_sms);
  if (plan.pieces > 1 && workspace == nullptr) return cudaErrorInvalidValue;
  p.pieces = plan.pieces, p.tiles_per_piece = plan.tiles_per_piece;
  p.partials = plan.pieces > 1 ? workspace : nullptr;
  const bool vec16 = p.K % 4 == 0 && reinterpret_cast<uintptr_t>(p.w) % 16 == 0;
  switch (plan.m_blocks) {
    case 1:
      return vec16 ? launch_small_m_gemm<SmallMTraits<1>, kEval, true>(p, device, stream)
                   : launch_small_m_gemm<SmallMTraits<1>, kEval, false>(p, device, stream);
    case 2:
      return vec16 ? launch_small_m_gemm<SmallMTraits<2>, kEval, true>(p, device, stream)
                   : launch_small_m_gemm<SmallMTraits<2>, kEval, false>(p, device, stream);
    default:
      return vec16 ? launch_small_m_gemm<SmallMTraits<4>, kEval, true>(p, device, stream)
                   : launch_small_m_gemm<SmallMTraits<4>, kEval, false>(p, device, stream);
  }
}

static bool small_m_shape_ok(int M, int N, int K) { return M >= 1 && M <= kSmallMMaxRows && N >= 1 && K >= 1; }

}  // namespace fused_gemm_bn

// ---------------------------------------------------------------------------
// Host launchers (declared in launchers.cuh)
// ---------------------------------------------------------------------------

int fused_gemm_bn::small_m_fp64_max_rows() { return kSmallMMaxRows; }

int64_t fused_gemm_bn::small_m_fp64_workspace_bytes(int M, int N, int K, int num_sms) {
  if (!small_m_shape_ok(M, N, K) || num_sms < 1) return 0;
  const SmallMPlan plan = small_m_plan(M, N, K, num_sms);
  return plan.pieces > 1 ? static_cast<int64_t>(plan.pieces) * M * N * static_cast<int64_t>(sizeof(double)) : 0;
}

cudaError_t fused_gemm_bn::small_m_fp64_train(const float* x, int64_t x_row_stride, const float* w, int M, int N,
                                              int K, float* z, float* part_mean, float* part_m2,
                                              int64_t* num_batches_tracked, double* workspace, cudaStream_t stream) {
  if (!small_m_shape_ok(M, N, K) || x == nullptr || w == nullptr || z == nullptr || part_mean == nullptr ||
      part_m2 == nullptr)
    return cudaErrorInvalidValue;
  SmallMArgs p{};
  p.x = x, p.x_row_stride = x_row_stride, p.w = w, p.M = M, p.N = N, p.K = K;
  p.z = z, p.part_mean = part_mean, p.part_m2 = part_m2, p.num_batches_tracked = num_batches_tracked;
  return launch_small_m<false>(p, workspace, stream);
}

// bn: bias, scale, bn_weight, bn_bias, running_mean, running_var, eps, scale_after_bn.
cudaError_t fused_gemm_bn::small_m_fp64_eval(const float* x, int64_t x_row_stride, const float* w, int M, int N,
                                             int K, const BatchNormArgs& bn, float* out, double* workspace,
                                             cudaStream_t stream) {
  if (!small_m_shape_ok(M, N, K) || x == nullptr || w == nullptr || out == nullptr || bn.scale == nullptr ||
      bn.running_mean == nullptr || bn.running_var == nullptr)
    return cudaErrorInvalidValue;
  SmallMArgs p{};
  p.x = x, p.x_row_stride = x_row_stride, p.w = w, p.M = M, p.N = N, p.K = K;
  p.bn = bn;
  p.out = out;
  return launch_small_m<true>(p, workspace, stream);
}
