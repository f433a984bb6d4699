// heuristics_sm80.cuh -- the portable 3xTF32 GEMM's launch decisions
// (sm80_gemm_3xtf32_bn.cu): the CTA tile for the batch size (sm80_tile_dims)
// and the split along K (sm80_split_plan).  Pure functions of the shape and the
// device's SM count, which the launcher queries (device_facts.cuh) and passes
// in; each rule beside the measurement that set it.  Host code without the CUDA
// runtime, so a plain C++ compiler builds this header too
// (tests/test_heuristics.py asserts the decisions on named cases).  The split's
// hand-off itself is in sm80_gemm_3xtf32_bn.cuh ("Split K").

#pragma once

#include <algorithm>

// Most K pieces per tile (sm80_split_plan); 1 turns the split off (the A/B baseline).
#ifndef FUSED_GEMM_BN_SM80_MAX_PIECES
#define FUSED_GEMM_BN_SM80_MAX_PIECES 64
#endif

namespace fused_gemm_bn {

// The two CTA tiles (Sm80GemmTraits, Sm80SmallMTraits in sm80_gemm_3xtf32_bn.cuh;
// static_assert in sm80_gemm_3xtf32_bn.cu) and their common k slab.
struct Sm80TileDims {
  int block_m, block_n;
};
constexpr Sm80TileDims kSm80Tile{128, 128};
constexpr Sm80TileDims kSm80SmallMTile{16, 256};
constexpr int kSm80BlockK = 32;

// The CTA tile of a batch of M rows: the 16 x 256 tile up to kSmallTileMaxRows
// rows (1-4 batch tiles of 16), else 128 x 128.  The training statistics are
// per batch tile: ceil(M / sm80_gemm_block_m(M)) rows of part_mean / part_m2.
// At 15 rows the 128-row tile computed 8.5x the useful MMA work (H200, problem
// 33, train ms: 15 x 8192 x 8192 0.334 -> 0.143 with the 16-row tile; eager
// 0.226); from 17 to 64 rows the 128-row tile was still slower than eager (17 x
// 8192^2 0.312 against 0.289) and the 16-row tile faster (64 x 8192^2 0.305,
// 128-row 0.354, eager 0.375); 100 x 4096^2 keeps the 128-row tile (docs/perf.md v37).
constexpr int kSmallTileMaxRows = 64;
inline bool sm80_small_tile(int M) { return M <= kSmallTileMaxRows; }
inline Sm80TileDims sm80_tile_dims(int M) { return sm80_small_tile(M) ? kSm80SmallMTile : kSm80Tile; }

// Split K (sm80_gemm_3xtf32_bn.cuh, "Split K").  Pieces per tile: enough to
// fill the SMs once (one CTA per SM fits), each piece at least
// kMinPieceKTiles slabs; below kSmallBatchRows rows also at most
// kSmallBatchPieceK k per piece (the small-batch error falls with the
// promotion chain: err / eager's err 1.06-1.87 -> 0.23-0.77 per input family); at
// most FUSED_GEMM_BN_SM80_MAX_PIECES.  Then every piece but the last has
// k_tiles_per_piece slabs, the last the rest (>= 1; 2 <= pieces <= num_k_tiles
// keeps at least two pieces after the rounding).  pieces == 1: no split, no
// workspace.  Measured (H200, problem 33, train ms, no split -> split;
// docs/perf.md v37): 128 x 8192 x 1024 0.636 -> 0.159, 15 x 8192 x 8192
// 0.537 -> 0.334, 1024 x 8192 x 8192 2.495 -> 2.500 (tiles fill the SMs: no split).
struct Sm80SplitPlan {
  int pieces = 1;
  int k_tiles_per_piece = 0;
};
constexpr int kMinPieceKTiles = 4;
constexpr int kSmallBatchRows = 16;
constexpr int kSmallBatchPieceK = 512;

inline Sm80SplitPlan sm80_split_plan(int M, int N, int K, int num_sms) {
  const Sm80TileDims d = sm80_tile_dims(M);
  Sm80SplitPlan plan;
  const int num_k_tiles = (K + kSm80BlockK - 1) / kSm80BlockK;
  plan.k_tiles_per_piece = num_k_tiles;
  const long long tiles = static_cast<long long>((M + d.block_m - 1) / d.block_m) * ((N + d.block_n - 1) / d.block_n);
  if (num_k_tiles < 2 || tiles < 1) return plan;
  long long pieces = tiles < num_sms ? num_sms / tiles : 1;
  pieces = std::min<long long>(pieces, num_k_tiles / kMinPieceKTiles);
  if (M < kSmallBatchRows) {
    constexpr int kSmallBatchPieceTiles = kSmallBatchPieceK / kSm80BlockK;
    pieces = std::max<long long>(pieces, (num_k_tiles + kSmallBatchPieceTiles - 1) / kSmallBatchPieceTiles);
  }
  pieces = std::min<long long>(pieces, FUSED_GEMM_BN_SM80_MAX_PIECES);
  if (pieces < 2) return plan;
  plan.k_tiles_per_piece = static_cast<int>((num_k_tiles + pieces - 1) / pieces);
  plan.pieces = (num_k_tiles + plan.k_tiles_per_piece - 1) / plan.k_tiles_per_piece;
  return plan;
}

}  // namespace fused_gemm_bn
