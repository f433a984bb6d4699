// sm80_gemm_3xtf32_bn.cuh -- float32-accurate GEMM on tensor cores (3xTF32, mma.sync)
// with a fused BatchNorm epilogue: the kernel body of sm80_gemm_3xtf32_bn_kernel
// (sm80_gemm_3xtf32_bn.cu, which holds its launchers), the portable path on
// every GPU with compute capability >= 8.0.
//
// Formula
//   z[m, n] = sum_k x[m, k] * w[n, k]                      (z = x @ W^T, no bias)
//   kTrain:  out = z; part_mean[mt, n], part_m2[mt, n] = mean and sum of squared
//            deviations of z[:, n] over the rows of M tile mt (bn_apply.cu merges
//            them and normalises `out` in place).
//   kEval:   out = a[n] * z + c[n]: bias, scale and BatchNorm(eval) folded into
//            one per-feature multiply-add, with scale before BatchNorm (problem
//            33) or after it (problem 84); bn_eval_affine in bn_stats.cuh
//
// Tensors (all float32, contiguous, row-major)
//   x_big, x_small  TF32 parts of x from prepass_3xtf32.cu, zero-padded to
//                   (round_up(M, 16), round_up(K, 32)) and stored in mma A-fragment
//                   order (layout in prepass_3xtf32.cu) == mma "row" A operand
//   w    (N, K)   K-major  == mma "col" B operand (nn.Linear weight layout)
//   x_center (M), w_row_sum (N) (hi, lo): the centred split's terms (centring.cuh),
//                   or both null
//   out  (M, N)   row-major
//   part_mean, part_m2  (ceil(M / BLOCK_M), N)
//   bias, scale, bn_weight, bn_bias, running_mean, running_var  (N)
//
// Numerics (3xTF32; CUTLASS example 27 and Ootomo & Yokota, "Recovering single
// precision accuracy from Tensor Cores while surpassing the FP32 theoretical
// peak performance", IJHPCA 2022)
//   Each fp32 operand v is split as v = big + small with
//     big   = v rounded to TF32 (nearest, ties away: 11-bit significand)
//     small = v - big               (exact in fp32; |small| <= 2^-11 |v|)
//   x is split by the pre-pass (small rounded to TF32 with cvt.rna); w is split
//   here in registers with two integer ops and one FADD (round_tf32 below), and
//   its small part goes to the tensor core as raw fp32 (the TF32 MMA reads only
//   the top 19 bits, i.e. truncates it: <= 2^-21 |w| lost).
//   a*b ~= a_small*b_big + a_big*b_small + a_big*b_big; dropped: a_small*b_small
//   (<= 2^-22 |ab|).  Each product carries <= ~2^-20.5 relative error.
//
//   Accumulation: the tensor core adds into its fp32 accumulator without
//   round-to-nearest (measured on H200: a 3072-MMA chain over K = 8192 gave 10x
//   eager's error, growing linearly with K).  So each (mma tile, span of SPAN_K
//   k columns: 16, half a BLOCK_K slab) accumulates its MMAs into a zeroed
//   register quad `part`, which is added to the main accumulator with an
//   ordinary round-to-nearest FADD (the promotion that DeepGEMM uses for FP8).
//   Expected ||z - z64|| / ||z64|| below eager FP32 SGEMM's (docs/perf.md has
//   the measurements).  What the truncation still costs: each MMA result loses
//   ~0.7 u of |part| on average (u = 2^-24), always towards zero, so every span
//   shrinks its own contribution to z and the batch variance of z comes out low
//   by 2 * 0.7 u * sum over the span's MMAs of Var(part after it) / Var(span):
//   2 * 5.5 * 0.7 u ~ 8 u with SPAN_K = 32 in the per-k-step term order below,
//   1.4 u with SPAN_K = 8 (tools/sm80_span_model.py emulates it: -7.7 u and
//   -1.3 u at 64 x 512 x 256 on log-normal x).  running_var keeps that bias
//   where the batch variance dominates it (log-normal x; uniform x leaves
//   running_var near its initial 1).  Hence the defaults (the switches before
//   the traits, -D overrides for A/B builds): SPAN_K = 16 with each span's
//   small-term MMAs before its big*big ones (the model's bias ~1.5 u, as the
//   fp16x3 kernel's) and each tile's mean / M2 summed in float64.  Measured
//   (docs/perf.md v36, ten seeds, log-normal x, 64 x 512 x 256): running_var
//   0.99-1.00x eager's error against float64 (SPAN_K = 32 in k-step order:
//   2.87-2.99x), at the KernelBench shape's speed.
//   Non-finite inputs: inf - inf = NaN in the split, so an inf operand yields NaN.
//   Centring (centring.cuh): the forwards split x - c_m (c_m the row mean) and
//   the epilogue adds c_m (hi_n + lo_n) back, so that the truncating
//   accumulation's error has no common sign over a feature's rows: the batch
//   mean (BatchNorm's statistic) then averages it out (docs/perf.md v25).
//
// Tiling: BLOCK_M x BLOCK_N x BLOCK_K = 128 x 128 x 32 per CTA, 8 warps in a
// 2 x 4 grid of 64 x 32 warp tiles (Sm80GemmTraits; batches of at most 64 rows:
// 16 x 256 x 32, 1 x 8 warps of 16 x 32, Sm80SmallMTraits), mma.sync.m16n8k8 (PTX ISA 9.7.13.4.13,
// "Matrix Fragments for mma.m16n8k8", .tf32), kNumStages-deep cp.async ring
// (PTX ISA 9.7.9.25; 4 / 3 / 2 stages of 48 KB by the device's shared memory)
// holding x_big, x_small and w slabs.  x slabs arrive in
// fragment order, so one 16-byte shared load is one mma A operand (no register
// shuffles; the row-major v2 spent more issue slots on MOVs than on HMMAs).
// w's shared rows are XOR-swizzled in 16-byte chunks (w_smem_offset) so that
// the 16-byte cp.async stores and fragment loads are bank-conflict free.
//
// Split K (sm80_split_plan in heuristics_sm80.cuh): where the output tiles
// alone leave SMs idle (fewer tiles than SMs), or the batch is below 16 rows,
// each tile's K slabs are cut into `pieces` runs (grid z), one CTA each.  Each
// piece writes its partial sums to a workspace slice and counts itself in on a
// per-tile counter; the last to arrive sums the slices in piece order in
// float64 and runs the epilogue (split_k_hand_off; as sm90_gemm_tiles.cuh's
// split tiles).  Why below 16 rows: one CTA's promotion chain over all of K
// is K / SPAN_K round-to-nearest additions, relative error ~ u sqrt(K / SPAN_K),
// and cuBLAS at a few rows splits K: unsplit, this kernel measured 1.06-1.87x
// eager's output error over batches 1-15 (up to 4.0x at 7 x 4095 x 513;
// docs/perf.md v36).  A piece holds at most kSmallBatchPieceK = 512 k there.
//
// K permutation: within one BLOCK_K slab, mma k-step s (0..3) and fragment
// column kl (0..7) read shared column 8 * (kl % 4) + 2 * s + kl / 4.  The same
// bijection is used for A (applied by prepass_3xtf32.cu) and B, so the dot product
// is unchanged, and every thread reads its w fragments for two k-steps with one
// 16-byte load.
//
// Preconditions: M, N >= 1, K >= 0; x_big / x_small 16-byte aligned; w 4-byte
// aligned.  The 16-byte w load path (kVec16) needs
// K % 4 == 0 and a 16-byte aligned w.
// Rows past M and columns past K/N are zero-filled and masked out of the
// statistics; nothing is written past M or N.
//

#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "bn_stats.cuh"
#include "cp_async.cuh"
#include "launchers.cuh"

// Numerics switches, each a compile-time constant that a -D flag overrides
// (the A/B builds of tools/sm80_promote.sh); the defaults are the measured kernel.
// SPAN_K: k columns per promotion (8, 16, 32 = BLOCK_K, or a multiple of BLOCK_K).
#ifndef FUSED_GEMM_BN_SM80_SPAN_K
#define FUSED_GEMM_BN_SM80_SPAN_K 16
#endif
// 1: within a span, every small-term MMA before any big*big one (SPAN_K <= BLOCK_K).
#ifndef FUSED_GEMM_BN_SM80_SMALL_TERMS_FIRST
#define FUSED_GEMM_BN_SM80_SMALL_TERMS_FIRST 1
#endif
// 1: the kTrain epilogue sums a tile's mean and M2 in float64 (as sm90_gemm_tiles.cuh).
#ifndef FUSED_GEMM_BN_SM80_TILE_STATS_F64
#define FUSED_GEMM_BN_SM80_TILE_STATS_F64 1
#endif

namespace fused_gemm_bn {

// One CTA tile shape: BLOCK_M x BLOCK_N outputs, WARPS_M x WARPS_N warps.
template <int kBlockM, int kBlockN, int kWarpsM, int kWarpsN>
struct Sm80Tile {
  static constexpr int BLOCK_M = kBlockM;
  static constexpr int BLOCK_N = kBlockN;
  static constexpr int BLOCK_K = 32;
  static constexpr int WARPS_M = kWarpsM;
  static constexpr int WARPS_N = kWarpsN;
  static constexpr int WARP_M = BLOCK_M / WARPS_M;
  static constexpr int WARP_N = BLOCK_N / WARPS_N;
  static constexpr int MMA_M = 16;
  static constexpr int MMA_N = 8;
  static constexpr int MMA_K = 8;
  static constexpr int kMmaTilesM = WARP_M / MMA_M;
  static constexpr int kMmaTilesN = WARP_N / MMA_N;
  static constexpr int kNumThreads = WARPS_M * WARPS_N * 32;
  static constexpr int FRAG_BLOCK_ELEMS = MMA_M * BLOCK_K;  // one (16 x 32) fragment-order block of x
  static constexpr int A_STAGE_ELEMS = BLOCK_M * BLOCK_K;    // one of x_big / x_small, fragment order
  static constexpr int B_STAGE_ELEMS = BLOCK_N * BLOCK_K;    // w, 16-byte chunks XOR-swizzled per row
  static constexpr int STAGE_ELEMS = 2 * A_STAGE_ELEMS + B_STAGE_ELEMS;
  static constexpr int STAGE_BYTES = STAGE_ELEMS * 4;
  // Pipeline depth is chosen at launch from the opt-in shared-memory limit.
  static constexpr int smem_bytes(int stages) { return stages * STAGE_BYTES; }
  // The promotion interval (Numerics above): SPAN_K k columns go into the
  // zeroed register tile `part` on the tensor core, then acc += part rounds to
  // nearest.  A span is kSpanSteps mma k-steps of one slab, or kSpanSlabs whole slabs.
  static constexpr int SPAN_K = FUSED_GEMM_BN_SM80_SPAN_K;
  static constexpr int kSpanSteps = (SPAN_K < BLOCK_K ? SPAN_K : BLOCK_K) / MMA_K;
  static constexpr int kSpanSlabs = SPAN_K > BLOCK_K ? SPAN_K / BLOCK_K : 1;
  static constexpr bool kSmallTermsFirst = FUSED_GEMM_BN_SM80_SMALL_TERMS_FIRST != 0;
  static constexpr bool kTileStatsF64 = FUSED_GEMM_BN_SM80_TILE_STATS_F64 != 0;

  static_assert(BLOCK_K == 4 * MMA_K, "the K permutation assumes 4 mma k-steps per slab");
  static_assert(WARP_M % MMA_M == 0 && WARP_N % MMA_N == 0, "warp tile must be whole mma tiles");
  static_assert(BLOCK_K / 4 == 8, "the w swizzle permutes the 8 16-byte chunks of a row");
  static_assert(BLOCK_N <= kNumThreads, "epilogue uses one thread per tile column");
  static_assert(kMmaTilesN == 4, "mma_k_step's initialisers list 4 mma column tiles per warp");
  static_assert(kNumThreads == 256, "load_slab / load_frag_slab split a slab over 256 threads");
  static_assert(SPAN_K == MMA_K || SPAN_K == 2 * MMA_K || (SPAN_K > 0 && SPAN_K % BLOCK_K == 0),
                "a span is 1, 2 or 4 mma k-steps, or whole slabs");
  static_assert(!kSmallTermsFirst || SPAN_K <= BLOCK_K, "small terms first: the span must lie in one slab");
};

// The tile for every batch: 128 x 128, 2 x 4 warps of 64 x 32 (48 KB stages:
// 4 = 192 KB on Hopper, 3 = 144 KB on A100, 2 = 96 KB on sm_86 / sm_89).
using Sm80GemmTraits = Sm80Tile<128, 128, 2, 4>;
// Batches of at most 64 rows (kSmallTileMaxRows): 16 x 256, 1 x 8 warps of 16 x 32
// (36 KB stages: 4 or 2), which wastes at most 15 rows of MMA work per batch
// tile (at 15 x 8192 x 8192 the big tile took 1.5x eager's time; docs/perf.md v37).
using Sm80SmallMTraits = Sm80Tile<16, 256, 1, 8>;

// kTrain: write z and per-tile statistics (any M).
// kEval:  folded affine epilogue.
enum class Epilogue { kTrain, kEval };

namespace sm80 {

// Splits v into a TF32 big part (round to nearest, ties away; identical to
// cvt.rna.tf32.f32 for finite v) and the exact fp32 remainder.  Two integer ops
// and one FADD; the remainder is truncated to TF32 by the MMA itself.
__device__ __forceinline__ void split_tf32(float v, uint32_t& big, uint32_t& small) {
  big = (__float_as_uint(v) + 0x1000u) & 0xffffe000u;
  small = __float_as_uint(v - __uint_as_float(big));
}

__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Float offset of element (row, col) of a w slab in shared memory.  Each row is
// 8 chunks of 16 bytes; chunk c of row r is stored at chunk c ^ (r % 8), so the
// 16-byte fragment loads (8 lanes: rows g, g+1 x chunks 2t + half) and the
// cp.async stores (8 lanes: one row's 8 chunks) are bank-conflict free.
__device__ __forceinline__ int w_smem_offset(int row, int col) {
  return row * Sm80GemmTraits::BLOCK_K + ((((col / 4) ^ row) % 8) * 4) + col % 4;
}

// Loads one (rows x BLOCK_K) slab of the K-major w into a swizzled stage.
template <int kRows, bool kVec16>
__device__ __forceinline__ void load_slab(float* stage, const float* __restrict__ g, int row0, int rows,
                                          int k0, int K) {
  using T = Sm80GemmTraits;
  if constexpr (kVec16) {
    constexpr int kChunksPerRow = T::BLOCK_K / 4;
    constexpr int kChunks = kRows * kChunksPerRow;
    static_assert(kChunks % T::kNumThreads == 0, "slab must split evenly over threads");
#pragma unroll
    for (int i = 0; i < kChunks / T::kNumThreads; ++i) {
      const int c = threadIdx.x + i * T::kNumThreads;
      const int r = c / kChunksPerRow;
      const int col = (c % kChunksPerRow) * 4;
      const bool valid = (row0 + r < rows) && (k0 + col < K);
      const float* src = valid ? g + static_cast<size_t>(row0 + r) * K + (k0 + col) : g;
      cp_async<16>(stage + w_smem_offset(r, col), src, valid);
    }
  } else {
    constexpr int kElems = kRows * T::BLOCK_K;
    static_assert(kElems % T::kNumThreads == 0, "slab must split evenly over threads");
    // Rolled: 16 unrolled 4-byte copies cost the registers that make the
    // train kernel spill.  This path only serves K % 4 != 0.
#pragma unroll 1
    for (int i = 0; i < kElems / T::kNumThreads; ++i) {
      const int e = threadIdx.x + i * T::kNumThreads;
      const int r = e / T::BLOCK_K;
      const int col = e % T::BLOCK_K;
      const bool valid = (row0 + r < rows) && (k0 + col < K);
      const float* src = valid ? g + static_cast<size_t>(row0 + r) * K + (k0 + col) : g;
      cp_async<4>(stage + w_smem_offset(r, col), src, valid);
    }
  }
}

// Loads the (BLOCK_M x BLOCK_K) slab `slab` of a fragment-order x part: BLOCK_M / 16
// contiguous 2 KB blocks, copied linearly.
template <class T>
__device__ __forceinline__ void load_frag_slab(float* stage, const float* __restrict__ g, int mb0, int num_mb,
                                               int slab, int num_slabs) {
  constexpr int kChunksPerBlock = T::FRAG_BLOCK_ELEMS / 4;
  constexpr int kChunks = (T::BLOCK_M / T::MMA_M) * kChunksPerBlock;
  static_assert(kChunks % T::kNumThreads == 0 || kChunks < T::kNumThreads, "slab must split evenly over threads");
#pragma unroll
  for (int i = 0; i < (kChunks + T::kNumThreads - 1) / T::kNumThreads; ++i) {
    const int c = threadIdx.x + i * T::kNumThreads;
    if (kChunks < T::kNumThreads && c >= kChunks) break;
    const int blk = c / kChunksPerBlock;
    const int within = (c % kChunksPerBlock) * 4;
    const bool valid = mb0 + blk < num_mb;
    const float* src =
        valid ? g + (static_cast<size_t>(mb0 + blk) * num_slabs + slab) * T::FRAG_BLOCK_ELEMS + within : g;
    cp_async<16>(stage + blk * T::FRAG_BLOCK_ELEMS + within, src, valid);
  }
}

template <typename StatT>
__device__ __forceinline__ StatT warp_sum_over_rows(StatT v) {
  // Lanes that share lane % 4 hold the same accumulator columns (rows differ).
  v += __shfl_xor_sync(0xffffffffu, v, 4);
  v += __shfl_xor_sync(0xffffffffu, v, 8);
  v += __shfl_xor_sync(0xffffffffu, v, 16);
  return v;
}

template <class T>
using AccTiles = float[T::kMmaTilesM][T::kMmaTilesN][4];
using WFrags = uint32_t[Sm80GemmTraits::kMmaTilesN][4];  // kMmaTilesN == 4 in every tile

template <class T>
__device__ __forceinline__ void zero_tiles(AccTiles<T>& tiles) {
#pragma unroll
  for (int mi = 0; mi < T::kMmaTilesM; ++mi)
#pragma unroll
    for (int ni = 0; ni < T::kMmaTilesN; ++ni)
#pragma unroll
      for (int r = 0; r < 4; ++r) tiles[mi][ni][r] = 0.f;
}

// acc += part with round-to-nearest FADDs: the promotion.
template <class T>
__device__ __forceinline__ void promote(AccTiles<T>& acc, const AccTiles<T>& part) {
#pragma unroll
  for (int mi = 0; mi < T::kMmaTilesM; ++mi)
#pragma unroll
    for (int ni = 0; ni < T::kMmaTilesN; ++ni)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[mi][ni][r] += part[mi][ni][r];
}

// This thread's w fragments of one half slab (two k-steps) for every ni,
// split into TF32 parts: element 2 * step + j is k-step `step`'s b_j.
__device__ __forceinline__ void load_w_half(const float* b_s, int b_row, int t, int half, WFrags& b_big,
                                            WFrags& b_small) {
#pragma unroll
  for (int ni = 0; ni < Sm80GemmTraits::kMmaTilesN; ++ni) {
    const float4 v = *reinterpret_cast<const float4*>(
        b_s + w_smem_offset(b_row + ni * Sm80GemmTraits::MMA_N, 8 * t + 4 * half));
    split_tf32(v.x, b_big[ni][0], b_small[ni][0]);
    split_tf32(v.y, b_big[ni][1], b_small[ni][1]);
    split_tf32(v.z, b_big[ni][2], b_small[ni][2]);
    split_tf32(v.w, b_big[ni][3], b_small[ni][3]);
  }
}

// Which of a k-step's three products mma_k_step issues (a bit mask).
constexpr int kTermsSmall = 1;  // x_small w_big, x_big w_small
constexpr int kTermsBig = 2;    // x_big w_big
constexpr int kTermsAll = kTermsSmall | kTermsBig;

// One k-step's MMAs for mma row tile mi (part_mi = part[mi]): the x fragments
// at float offset `off` of the warp's fragment blocks (one 16-byte load each is
// one A operand: a0: row g, k t; a1: row g+8, k t; a2: row g, k t+4; a3: row
// g+8, k t+4), w's from load_w_half.
template <int kTerms>
__device__ __forceinline__ void mma_k_step(float (&part_mi)[Sm80GemmTraits::kMmaTilesN][4], const float* a_big_s,
                                           const float* a_small_s, int off, const WFrags& b_big,
                                           const WFrags& b_small, int step) {
  using T = Sm80GemmTraits;
  const uint32_t bb[T::kMmaTilesN][2] = {{b_big[0][2 * step], b_big[0][2 * step + 1]},
                                         {b_big[1][2 * step], b_big[1][2 * step + 1]},
                                         {b_big[2][2 * step], b_big[2][2 * step + 1]},
                                         {b_big[3][2 * step], b_big[3][2 * step + 1]}};
  const uint32_t bs[T::kMmaTilesN][2] = {{b_small[0][2 * step], b_small[0][2 * step + 1]},
                                         {b_small[1][2 * step], b_small[1][2 * step + 1]},
                                         {b_small[2][2 * step], b_small[2][2 * step + 1]},
                                         {b_small[3][2 * step], b_small[3][2 * step + 1]}};
  static_assert(T::kMmaTilesN == 4, "bb / bs initialisers list kMmaTilesN tiles");
  const uint4 xb = *reinterpret_cast<const uint4*>(a_big_s + off);
  const uint32_t a_big[4] = {xb.x, xb.y, xb.z, xb.w};
  // Term-major over ni: consecutive MMAs write different accumulators, so none
  // waits on the one before it (ncu: "wait" stalls).
  if constexpr ((kTerms & kTermsSmall) != 0) {
    const uint4 xs = *reinterpret_cast<const uint4*>(a_small_s + off);
    const uint32_t a_small[4] = {xs.x, xs.y, xs.z, xs.w};
#pragma unroll
    for (int ni = 0; ni < T::kMmaTilesN; ++ni) mma_tf32(part_mi[ni], a_small, bb[ni]);
#pragma unroll
    for (int ni = 0; ni < T::kMmaTilesN; ++ni) mma_tf32(part_mi[ni], a_big, bs[ni]);
  }
  if constexpr ((kTerms & kTermsBig) != 0) {
#pragma unroll
    for (int ni = 0; ni < T::kMmaTilesN; ++ni) mma_tf32(part_mi[ni], a_big, bb[ni]);
  }
}

}  // namespace sm80


struct Sm80GemmBnArgs {
  const float* x_big;
  const float* x_small;
  const float* w;
  // The centred split (centring.cuh): x's parts are those of x - c_m, and the
  // epilogue adds c_m (hi_n + lo_n) back.  Null: x split as it is.
  const float* x_center;
  const float2* w_row_sum;
  float* out;
  int M, N, K;
  // kTrain
  float* part_mean;
  float* part_m2;
  // kEval
  BnParams bn;
  // Split K (header, "Split K"; sm80_split_plan): blockIdx.z is the piece, slabs
  // [piece * k_tiles_per_piece, +k_tiles_per_piece) of K; pieces == 1: whole K.
  // partials (pieces, M, N) float32 and tile_arrivals (m_tiles * n_tiles ints,
  // zero at the launch: the pre-pass zeroes them) are read only when pieces > 1.
  int pieces = 1;
  int k_tiles_per_piece = 0;
  float* partials = nullptr;
  int* tile_arrivals = nullptr;
};

namespace sm80 {

// Split-K hand-off (header, "Split K").  Each piece's CTA stores its fp32
// partial sums (valid rows and columns only) in its slice of args.partials,
// then counts itself in on the tile's arrival counter (fence, atomic: the
// threadFenceReduction pattern of the CUDA samples).  The last to arrive sums
// all slices in piece order in float64, its own read back too (so the result
// does not depend on arrival order), and rounds once.  No CTA waits for
// another: no deadlock whatever the residency.  True when this CTA finishes
// the tile (acc then holds the whole sum; rows past M / columns past N hold 0).
template <class T>
__device__ __forceinline__ bool split_k_hand_off(AccTiles<T>& acc, const Sm80GemmBnArgs& args, int tile,
                                                 int row_base, int col_base) {
  __shared__ int last_arrival;
  const int M = args.M, N = args.N;
  const size_t slice = static_cast<size_t>(M) * N;
  float* mine = args.partials + blockIdx.z * slice;
#pragma unroll
  for (int mi = 0; mi < T::kMmaTilesM; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row_base + mi * T::MMA_M + 8 * h;
      if (row >= M) continue;
#pragma unroll
      for (int ni = 0; ni < T::kMmaTilesN; ++ni)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int col = col_base + ni * T::MMA_N + j;
          if (col < N) __stcg(mine + static_cast<size_t>(row) * N + col, acc[mi][ni][2 * h + j]);
        }
    }
  __threadfence();  // this thread's stores, visible GPU-wide before the count below
  __syncthreads();
  if (threadIdx.x == 0) last_arrival = atomicAdd(args.tile_arrivals + tile, 1) == args.pieces - 1;
  __syncthreads();
  if (!last_arrival) return false;
  __threadfence();  // the other pieces' stores, observed after their counts
#pragma unroll
  for (int mi = 0; mi < T::kMmaTilesM; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row_base + mi * T::MMA_M + 8 * h;
#pragma unroll
      for (int ni = 0; ni < T::kMmaTilesN; ++ni)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int col = col_base + ni * T::MMA_N + j;
          double sum = 0.0;
          if (row < M && col < N) {
            const float* p = args.partials + static_cast<size_t>(row) * N + col;
#pragma unroll 4
            for (int piece = 0; piece < args.pieces; ++piece) sum += __ldcg(p + piece * slice);
          }
          acc[mi][ni][2 * h + j] = static_cast<float>(sum);
        }
    }
  return true;
}

}  // namespace sm80

// The kernel body; the __global__ wrapper (sm80_gemm_3xtf32_bn.cu) is only this call.
template <class T, Epilogue kEpilogue, bool kVec16, int kNumStages>
__device__ __forceinline__ void sm80_gemm_3xtf32_bn_body(const Sm80GemmBnArgs& args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using namespace sm80;
  extern __shared__ __align__(16) float smem[];
  // Stage layout: [x_big slab | x_small slab | w slab] (fragment order, fragment order, swizzled).

  const int M = args.M, N = args.N, K = args.K;
  // blockIdx.x walks M fastest, so the CTAs that share one W tile run together
  // and W (the large operand) streams from DRAM once; x stays resident in L2.
  const int m_tile = blockIdx.x;
  const int m0 = m_tile * T::BLOCK_M;
  const int n0 = blockIdx.y * T::BLOCK_N;

  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int wm = warp / T::WARPS_N;
  const int wn = warp % T::WARPS_N;
  const int g = lane / 4;  // fragment row group
  const int t = lane % 4;  // fragment thread-in-group

  float acc[T::kMmaTilesM][T::kMmaTilesN][4];
#pragma unroll
  for (int mi = 0; mi < T::kMmaTilesM; ++mi)
#pragma unroll
    for (int ni = 0; ni < T::kMmaTilesN; ++ni)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[mi][ni][r] = 0.f;

  // The current span's partial sums (zeroed when a span opens, added into acc when it closes).
  float part[T::kMmaTilesM][T::kMmaTilesN][4];

  const int num_k_tiles = (K + T::BLOCK_K - 1) / T::BLOCK_K;  // == slabs of the x parts
  const int num_mb = (M + T::MMA_M - 1) / T::MMA_M;             // 16-row blocks of the x parts
  const int mb0 = m0 / T::MMA_M;
  // This CTA's slabs [kt_begin, kt_end): its piece of K (all of K when pieces == 1).
  const int kt_begin = args.pieces > 1 ? static_cast<int>(blockIdx.z) * args.k_tiles_per_piece : 0;
  const int kt_end = args.pieces > 1 ? min(num_k_tiles, kt_begin + args.k_tiles_per_piece) : num_k_tiles;

  // k tile k_tile goes to stage k_tile % kNumStages (a ring from any start).
  auto load_stage = [&](int k_tile) {
    float* stage = smem + (k_tile % kNumStages) * T::STAGE_ELEMS;
    load_frag_slab<T>(stage, args.x_big, mb0, num_mb, k_tile, num_k_tiles);
    load_frag_slab<T>(stage + T::A_STAGE_ELEMS, args.x_small, mb0, num_mb, k_tile, num_k_tiles);
    load_slab<T::BLOCK_N, kVec16>(stage + 2 * T::A_STAGE_ELEMS, args.w, n0, N, k_tile * T::BLOCK_K, K);
  };

#pragma unroll
  for (int s = 0; s < kNumStages - 1; ++s) {
    if (kt_begin + s < kt_end) load_stage(kt_begin + s);
    cp_async_commit();
  }

  for (int k_tile = kt_begin; k_tile < kt_end; ++k_tile) {
    cp_async_wait<kNumStages - 2>();
    // Makes stage k_tile visible to all warps, and frees the stage that the
    // next load overwrites (it was consumed in iteration k_tile - 1).
    __syncthreads();
    if (k_tile + kNumStages - 1 < kt_end) load_stage(k_tile + kNumStages - 1);
    cp_async_commit();

    const float* stage = smem + (k_tile % kNumStages) * T::STAGE_ELEMS;
    // This warp's fragment blocks; block mi, k-step s, lane l at ((mi * 4 + s) * 32 + l) * 4.
    const float* a_big_s = stage + (wm * T::kMmaTilesM) * T::FRAG_BLOCK_ELEMS + lane * 4;
    const float* a_small_s = a_big_s + T::A_STAGE_ELEMS;
    const float* b_s = stage + 2 * T::A_STAGE_ELEMS;
    const int b_row = wn * T::WARP_N + g;  // + ni * MMA_N; row % 8 == g

    // Span boundaries at slab granularity (always true for spans within a slab).
    const bool span_opens = T::kSpanSlabs == 1 || (k_tile - kt_begin) % T::kSpanSlabs == 0;
    const bool span_closes = T::kSpanSlabs == 1 || (k_tile - kt_begin + 1) % T::kSpanSlabs == 0 || k_tile + 1 == kt_end;

    // The slab is consumed in two halves of two k-steps.  Thread (g, t) reads w's
    // shared columns 8t + 4 * half .. +3; k-step `step` of the half uses elements
    // 2 * step (b0: k = t) and 2 * step + 1 (b1: k = t + 4).  A span's MMAs go into
    // `part`: 16 independent MMA chains, so the tensor pipe always has independent work.
    if constexpr (!T::kSmallTermsFirst || T::kSpanSteps == 1) {
      // Per k-step: x_small w_big, x_big w_small, then x_big w_big.
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        // w fragments of this half, split once and reused by every mi.
        uint32_t b_big[T::kMmaTilesN][4], b_small[T::kMmaTilesN][4];
        load_w_half(b_s, b_row, t, half, b_big, b_small);
#pragma unroll
        for (int step = 0; step < 2; ++step) {
          const int k_step = 2 * half + step;
          if (k_step % T::kSpanSteps == 0 && span_opens) zero_tiles<T>(part);
#pragma unroll
          for (int mi = 0; mi < T::kMmaTilesM; ++mi)
            mma_k_step<kTermsAll>(part[mi], a_big_s, a_small_s, (mi * 4 + k_step) * 32 * 4, b_big, b_small, step);
          if ((k_step + 1) % T::kSpanSteps == 0 && span_closes) promote<T>(acc, part);
        }
      }
    } else {
      // Every small-term MMA of the span, then its x_big w_big MMAs in k order:
      // the small terms are truncated against a small |part|.
#pragma unroll
      for (int span = 0; span < 4 / T::kSpanSteps; ++span) {
        zero_tiles<T>(part);
#pragma unroll
        for (int terms = kTermsSmall; terms <= kTermsBig; terms *= 2) {
#pragma unroll
          for (int half = span * T::kSpanSteps / 2; half < (span + 1) * T::kSpanSteps / 2; ++half) {
            uint32_t b_big[T::kMmaTilesN][4], b_small[T::kMmaTilesN][4];
            load_w_half(b_s, b_row, t, half, b_big, b_small);
#pragma unroll
            for (int step = 0; step < 2; ++step)
#pragma unroll
              for (int mi = 0; mi < T::kMmaTilesM; ++mi) {
                const int off = (mi * 4 + 2 * half + step) * 32 * 4;
                if (terms == kTermsSmall)
                  mma_k_step<kTermsSmall>(part[mi], a_big_s, a_small_s, off, b_big, b_small, step);
                else
                  mma_k_step<kTermsBig>(part[mi], a_big_s, a_small_s, off, b_big, b_small, step);
              }
          }
        }
        promote<T>(acc, part);
      }
    }
  }
  cp_async_wait<0>();

  // Accumulator element (mi, ni, r) sits at
  //   row = m0 + wm * WARP_M + mi * 16 + g + 8 * (r / 2)
  //   col = n0 + wn * WARP_N + ni * 8 + 2 * t + (r % 2)
  const int row_base = m0 + wm * T::WARP_M + g;
  const int col_base = n0 + wn * T::WARP_N + 2 * t;

  // Split K: every piece but the tile's last to arrive leaves here; that one
  // holds the whole sum and runs the epilogue.
  if (args.pieces > 1 && !split_k_hand_off<T>(acc, args, m_tile * gridDim.y + blockIdx.y, row_base, col_base)) return;

  // z = the parts' product + c_m (hi_n + lo_n): two fmas, one rounding of z
  // beyond the tiny lo product.  Rows past M and columns past N add 0.
  if (args.x_center != nullptr) {
    float c[T::kMmaTilesM][2];
#pragma unroll
    for (int mi = 0; mi < T::kMmaTilesM; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row_base + mi * T::MMA_M + 8 * h;
        c[mi][h] = row < M ? __ldg(args.x_center + row) : 0.f;
      }
#pragma unroll
    for (int ni = 0; ni < T::kMmaTilesN; ++ni)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int col = col_base + ni * T::MMA_N + j;
        const float2 s = col < N ? __ldg(args.w_row_sum + col) : make_float2(0.f, 0.f);
#pragma unroll
        for (int mi = 0; mi < T::kMmaTilesM; ++mi)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            acc[mi][ni][2 * h + j] = fmaf(c[mi][h], s.x, fmaf(c[mi][h], s.y, acc[mi][ni][2 * h + j]));
      }
  }

  if constexpr (kEpilogue == Epilogue::kEval) {
#pragma unroll
    for (int ni = 0; ni < T::kMmaTilesN; ++ni) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int col = col_base + ni * T::MMA_N + j;
        if (col >= N) continue;
        float a, c;
        bn_eval_affine(args.bn, col, a, c);
#pragma unroll
        for (int mi = 0; mi < T::kMmaTilesM; ++mi) {
          acc[mi][ni][j] = fmaf(a, acc[mi][ni][j], c);
          acc[mi][ni][2 + j] = fmaf(a, acc[mi][ni][2 + j], c);
        }
      }
    }
  } else {
    // Per-column mean and M2 over this tile's valid rows: `moment` 0 sums the
    // values, 1 the squared deviations from the tile mean (no E[z^2] - E[z]^2
    // cancellation).  Sums in StatT; mean and M2 are then rounded to float.
    using StatT = typename std::conditional<T::kTileStatsF64, double, float>::type;
    __syncthreads();  // all warps are done with the pipeline smem; reuse it
    StatT* red = reinterpret_cast<StatT*>(smem);                                // [WARPS_M][BLOCK_N]
    float* tile_mean = reinterpret_cast<float*>(red + T::WARPS_M * T::BLOCK_N);  // [BLOCK_N]
    float* tile_m2 = tile_mean + T::BLOCK_N;                                     // [BLOCK_N]
    const int rows_valid = min(T::BLOCK_M, M - m0);

#pragma unroll
    for (int moment = 0; moment < 2; ++moment) {
#pragma unroll
      for (int ni = 0; ni < T::kMmaTilesN; ++ni) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int tcol = wn * T::WARP_N + ni * T::MMA_N + 2 * t + j;
          const float mu = moment == 0 ? 0.f : tile_mean[tcol];
          StatT sum = 0.f;
#pragma unroll
          for (int mi = 0; mi < T::kMmaTilesM; ++mi) {
            const int r = row_base + mi * T::MMA_M;
            const StatT d0 = static_cast<StatT>(acc[mi][ni][j] - mu);
            const StatT d1 = static_cast<StatT>(acc[mi][ni][2 + j] - mu);
            if (r < M) sum += moment == 0 ? d0 : d0 * d0;
            if (r + 8 < M) sum += moment == 0 ? d1 : d1 * d1;
          }
          sum = warp_sum_over_rows(sum);
          if (g == 0) red[wm * T::BLOCK_N + tcol] = sum;
        }
      }
      __syncthreads();
      if (threadIdx.x < T::BLOCK_N) {
        StatT total = 0.f;
#pragma unroll
        for (int w = 0; w < T::WARPS_M; ++w) total += red[w * T::BLOCK_N + threadIdx.x];
        if (moment == 0) {
          tile_mean[threadIdx.x] = static_cast<float>(total / static_cast<StatT>(rows_valid));
        } else {
          tile_m2[threadIdx.x] = static_cast<float>(total);
        }
      }
      __syncthreads();
    }

    const int col = n0 + threadIdx.x;
    if (threadIdx.x < T::BLOCK_N && col < N) {
      args.part_mean[static_cast<size_t>(m_tile) * N + col] = tile_mean[threadIdx.x];
      args.part_m2[static_cast<size_t>(m_tile) * N + col] = tile_m2[threadIdx.x];
    }
  }

  // Store z (kTrain) or the final output (kEval).
  const bool pair_ok = (N % 2 == 0);  // 8-byte aligned column pairs
#pragma unroll
  for (int mi = 0; mi < T::kMmaTilesM; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row_base + mi * T::MMA_M + 8 * h;
      if (row >= M) continue;
      float* out_row = args.out + static_cast<size_t>(row) * N;
#pragma unroll
      for (int ni = 0; ni < T::kMmaTilesN; ++ni) {
        const int col = col_base + ni * T::MMA_N;
        const float v0 = acc[mi][ni][2 * h], v1 = acc[mi][ni][2 * h + 1];
        if (pair_ok && col + 1 < N) {
          *reinterpret_cast<float2*>(out_row + col) = make_float2(v0, v1);
        } else {
          if (col < N) out_row[col] = v0;
          if (col + 1 < N) out_row[col + 1] = v1;
        }
      }
    }
  }
#endif  // __CUDA_ARCH__ >= 800
}

// Arguments common to every epilogue; the caller fills the epilogue's fields.
inline Sm80GemmBnArgs gemm_args(const float* x_big, const float* x_small, const float* w, Centring centring,
                                float* out, int M, int N, int K) {
  Sm80GemmBnArgs args{};
  args.x_big = x_big;
  args.x_small = x_small;
  args.w = w;
  args.x_center = centring.x_center;
  args.w_row_sum = centring.w_row_sum;
  args.out = out;
  args.M = M;
  args.N = N;
  args.K = K;
  return args;
}

inline bool vec16_ok(const float* w, int K) { return K % 4 == 0 && reinterpret_cast<uintptr_t>(w) % 16 == 0; }

}  // namespace fused_gemm_bn
