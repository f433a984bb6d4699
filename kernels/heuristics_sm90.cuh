// heuristics_sm90.cuh -- the Hopper GEMMs' launch decisions (sm90_gemm_fp16x3_bn.cu,
// lowp/sm90_gemm_bn_16bit.cu): the grid's split of the output tiles
// (stream_k_plan), whether the grid is persistent (persistent_grid_pays) and
// the 16-bit kernel's batch tile (lowp_grid_plan).  Pure functions of the shape
// and the device's SM count, which the launchers query (device_facts.cuh) and
// pass in; each rule beside the measurement that set it.  Host code without the
// CUDA runtime, so a plain C++ compiler builds this header too
// (tests/test_heuristics.py asserts the decisions on named cases).  The kernels
// that carry the plans out (for_each_segment, split_tile_hand_off) are in
// sm90_gemm_tiles.cuh; heuristics_common.cuh and heuristics_sm80.cuh hold the rest.

#pragma once

#include <stdint.h>

#include <algorithm>

namespace fused_gemm_bn {
namespace sm90 {

// The output tile the plans count in: the fp16x3 kernel's (static_assert there)
// and the 16-bit kernel's small-batch tile.
constexpr int kTileN = 128;             // features per CTA
constexpr int kTileM = 128;             // batch rows per CTA

// ---- the split of the output tiles (both sm_90a GEMMs) ------------------------
// Work of the grid (sm90_gemm_tiles.cuh's header, "Split tiles"), in work units: unit i is CTA i's
// work in a grid of one CTA per unit; a persistent grid (the fp16x3 kernel's,
// where persistent_grid_pays) runs units blockIdx.x, + gridDim.x, ... per CTA, and the
// device functions of sm90_gemm_tiles.cuh take the unit for `cta`.  The first sk_ctas CTAs compute
// tiles 0 .. sk_tiles - 1, each cut along K into `pieces` runs of piece_blocks
// k-blocks (the last piece takes the rest): pieces 0 .. pieces - 2 of tile t go
// to CTAs t * (pieces - 1) + j, one each; the last pieces go tails_per_cta
// tiles at a time to the CTAs after those, run back to back.  CTA sk_ctas + i
// then computes tile sk_tiles + i whole.  sk_ctas == 0: no tile is split.
struct StreamKPlan {
  int sk_tiles = 0;
  int pieces = 1;
  int piece_blocks = 0;
  int tails_per_cta = 1;
  int sk_ctas = 0;
  int dp_tiles = 0;
};

// Split tiles (sm90_gemm_tiles.cuh's header).  With one CTA per SM, `tiles` tiles take
// ceil(tiles / num_sms) waves and the last leaves SMs idle (the KernelBench
// shape: 512 tiles = 3.88 waves of 132).  The R remainder tiles (tiles %
// num_sms, or all tiles when fewer than the SMs) are instead cut along K and
// run first, on CTAs that each take about the same number of k-blocks; the
// whole tiles follow in whole waves.  Unlike stream-K's even cut of the
// flattened tile x k space (Osama et al., PPoPP 2023), which was measured
// 7% slower here (CTAs sharing an x or w block read it at different times,
// so the pass ran out of L2 and became DRAM-bound), every piece starts at
// one of few k offsets, so CTAs read the same k-blocks at the same time:
//   2 R <= num_sms: p equal pieces per tile (split-K), p <= num_sms / R;
//   otherwise: a first piece of L k-blocks per tile on R CTAs, all starting
//     at k = 0, and the K - L tails, tails_per_cta = ceil(R / (num_sms - R))
//     back to back per CTA (consecutive tiles: the same w rows), with L set
//     so both kinds take about as long (one k-block per hand-off counted).
// kSplitMaxPieces bounds the slots a finishing CTA reads back; kSplitMinIters
// keeps a piece above pipeline start-up.  block_k: the kernel's k-block
// (BLOCK_K of both sm_90a GEMMs: 64).
constexpr int kSplitMaxPieces = 8;
constexpr int kSplitMinIters = 4;

inline StreamKPlan stream_k_plan(int M, int N, int K, int block_k, int num_sms) {
  const long long tiles = static_cast<long long>((M + kTileM - 1) / kTileM) * ((N + kTileN - 1) / kTileN);
  const int num_k_blocks = (K + block_k - 1) / block_k;
  StreamKPlan p;
  p.dp_tiles = static_cast<int>(tiles);
  if (num_sms <= 0 || tiles > INT32_MAX / 8) return p;
  const int rem = static_cast<int>(tiles >= num_sms ? tiles % num_sms : tiles);
  if (rem == 0) return p;
  int pieces, piece_blocks, tails_per_cta;
  if (2 * rem <= num_sms) {
    pieces = std::min({kSplitMaxPieces, num_sms / rem, num_k_blocks / kSplitMinIters});
    if (pieces < 2) return p;
    piece_blocks = (num_k_blocks + pieces - 1) / pieces;
    pieces = (num_k_blocks + piece_blocks - 1) / piece_blocks;  // no empty last piece
    tails_per_cta = 1;
  } else {
    pieces = 2;
    tails_per_cta = (rem + (num_sms - rem) - 1) / (num_sms - rem);
    piece_blocks = (tails_per_cta * (num_k_blocks + 1) - 1 + tails_per_cta) / (tails_per_cta + 1);
    if (num_k_blocks - piece_blocks < kSplitMinIters) return p;
  }
  p.sk_tiles = rem;
  p.pieces = pieces;
  p.piece_blocks = piece_blocks;
  p.tails_per_cta = tails_per_cta;
  p.sk_ctas = rem * (pieces - 1) + (rem + tails_per_cta - 1) / tails_per_cta;
  p.dp_tiles = static_cast<int>(tiles - rem);
  return p;
}

// ---- sm90_gemm_fp16x3_bn.cu: a persistent grid or one CTA per work unit ------
// Whether the grid is persistent (one CTA per SM, each looping over work units
// cta, cta + gridDim.x, ...) rather than one CTA per unit.  With a CTA per
// unit (one fits an SM), each tile pays a CTA start (barrier set-up, the first
// TMA fills) that no other tile's mainloop covers; looping, the producer fills
// the next tile's stages while the consumers finish this one.  That pays where
// tiles are short in k.  H200, per GEMM, against the one-CTA-per-unit kernel
// (docs/perf.md v40): grad W = grad z^T x (k = the batch) at 256 x 8192 x 8192
// 279 -> 224 us, 512 rows 390 -> 361, 1024 rows 645 -> 639; forwards 8192 x
// 512 x 8192 463 -> 405, 4096 x 1024 x 4096 188 -> 177, 16384 x 2048 x 2048
// 622 -> 610; but 1024 x 2048 x 8192 (512 tiles) 164.5 -> 168.  At 64
// k-blocks it was mixed, at 128 5-15% slower (the KernelBench forward's GEMM
// 582 -> 613-620 us, docs/perf.md v41): those keep a CTA per unit.
constexpr int kPersistentMaxKBlocks = 32;
inline bool persistent_grid_pays(int K, int block_k) {
  return (K + block_k - 1) / block_k <= kPersistentMaxKBlocks;
}

// ---- lowp/sm90_gemm_bn_16bit.cu: the batch tile and the split ---------------
// The 16-bit kernel's batch rows per CTA (wgmma N): 256, or 128 on small grids.
constexpr int kLowpBatchTile = 256;
constexpr int kLowpSmallBatchTile = 128;
static_assert(kLowpSmallBatchTile == kTileM, "stream_k_plan counts the small tile's tiles");

// The tile and grid plan of an (M, K) x (N, K) product: BLOCK_M = 256, whole tiles
// (the launcher runs min(tiles, SMs) CTAs walking them persistently, as the fp16x3
// launcher does where persistent_grid_pays), when those tiles fill at least half of
// the SMs, else BLOCK_M = 128 and the split-tile plan of the fp16x3 kernel
// (stream_k_plan), which cuts the remainder tiles along K.  Measured (H200, float16, problem 33 eval):
// 512 x 8192 x 8192 (128 tiles of 256 rows) 0.098 ms, with the split 128-row
// plan 0.153; 256 x 8192 x 8192 (64 tiles) 0.090 against 0.058 (docs/perf.md v26).
// plan.dp_tiles < 0: more tiles than an int counts (the launcher refuses the call).
struct LowpGridPlan {
  int block_m;
  StreamKPlan plan;
};

inline LowpGridPlan lowp_grid_plan(int M, int N, int K, int block_k, int num_sms) {
  LowpGridPlan out;
  const long long n_tiles = (N + kTileN - 1) / kTileN;
  const long long big_tiles = static_cast<long long>((M + kLowpBatchTile - 1) / kLowpBatchTile) * n_tiles;
  if (2 * big_tiles >= num_sms) {
    out.block_m = kLowpBatchTile;
    out.plan = StreamKPlan{};
    out.plan.dp_tiles = big_tiles > INT32_MAX ? -1 : static_cast<int>(big_tiles);
  } else {
    out.block_m = kLowpSmallBatchTile;
    out.plan = stream_k_plan(M, N, K, block_k, num_sms);
  }
  return out;
}

}  // namespace sm90
}  // namespace fused_gemm_bn
