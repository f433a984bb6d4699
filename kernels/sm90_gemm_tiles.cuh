// sm90_gemm_tiles.cuh -- the Hopper GEMMs' shared pieces (sm90_gemm_fp16x3_bn.cu;
// lowp/sm90_gemm_bn_16bit.cu uses the work split, the hand-off and the tensor
// maps): the 128 x 128 output tile and its register layout, the grid's work
// split (whole tiles and split tiles, StreamKPlan), the split-tile hand-off,
// the BatchNorm epilogues (finish_tile), the staged TMA stores of grad W's tiles
// (store_tile_staged), and the host's tensor maps.  The
// epilogue formulas are in bn_stats.cuh.
//
// Split tiles (a locality-preserving stream-K; StreamKPlan and its rule,
// stream_k_plan, in heuristics_sm90.cuh)
//   One CTA per SM fits, so whole tiles alone leave the last wave part-empty
//   (512 tiles = 3.88 waves of 132 SMs at the KernelBench shape).  The
//   remainder tiles are cut along K and run first: each piece's CTA writes
//   its fp32 partial tile to a workspace slot and counts itself in on a
//   per-tile counter (GPU-scope acq_rel atomic); the last to arrive sums the
//   slots in piece order (deterministic) and runs the epilogue.  Measured
//   with the (since retired) 3xTF32 wgmma kernel on an H200: GEMM 1063 ->
//   1047 us, train 1.117 -> 1.104 ms (docs/perf.md v14).  A piece-sum adds
//   one fp32 rounding per piece boundary, as the GEMM's promotion of its
//   partial sums already does every span.
//
// Output tile: BLOCK_N = 128 features (wgmma M, two consumer
// warpgroups of 64) x BLOCK_M = 128 batch rows (wgmma N).  Each consumer
// thread holds kAccRegs = 64 fp32 accumulators; element 4 i + 2 h + e holds
// z[b, f] with
//   f = n0 + w_row + 8 h       (w_row = 64 warpgroup + 16 warp + lane / 4)
//   b = m0 + 8 i + 2 t + e     (t = lane % 4; i = 0 .. 15 over both 64-row halves)
// so each feature's 128 batch values live in the 4 lanes of one quad.

#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>

#include "bn_stats.cuh"
#include "heuristics_sm90.cuh"
#include "sm90_primitives.cuh"
#include "tensor_map.cuh"

namespace fused_gemm_bn {
namespace sm90 {

constexpr int kConsumerThreads = 256;   // two consumer warpgroups
constexpr int kTileAccRegs = 64;        // fp32 accumulators per consumer thread

enum class Epilogue { kTrain, kEval, kPlain };

struct Sm90GemmBnArgs {
  int M, N, K;
  float* out;
  float* part_mean;  // kTrain
  float* part_m2;
  BnParams bn;  // kEval
  StreamKPlan plan;
  // Split-tile workspace: partial sums, one slot per (split tile, piece), each
  // 256 threads x kAccRegs fp32 in register order; and one arrival count per
  // split tile, zeroed before the launch (by the GEMM's pre-pass).
  float* partials;
  int* tile_arrivals;
  // 2^-e of each row's power-of-two scale, x's (M floats) and w's (N floats;
  // null: 1).  x's row centres c_m (M) and w's row sums (N (hi, lo) pairs),
  // z = the parts' product + c_m (hi_n + lo_n); both null in the uncentred
  // plain products.
  const float* x_inv_scale;
  const float* w_inv_scale;
  const float* x_center;
  const float2* w_row_sum;
  // Batch rows of x's K-major TMA boxes (the fp16x3 kernel's kShortX instantiations: M
  // rounded up to 8 where the batch is shorter than a tile; else the tile's rows).
  int x_box_rows;
  // out leaves through store_tile_staged (an instantiation that has it, out's tensor map
  // made); else through finish_tile's scalar stores.
  bool out_staged;
};

// Tile order.  The grid's CTAs take tiles in index order, one CTA per SM, so
// a wave is a run of consecutive tile indices and should share operands.
// kGroupedOrder false (batch-fastest): tile = n_tile * m_tiles + m_tile.
// kGroupedOrder true: tiles go in groups of kTileGroupN feature tiles, and in
// a group the feature tile is the fastest index, then the batch tile; a wave
// of 132 CTAs then covers about 16 batch tiles x 8 feature tiles and reads
// those rows of x's and W's parts (51 MB at K = 4096).  Batch-fastest reads
// every batch tile of x in each wave: at 16384 x 4096 x 4096 the GEMM read
// 8.8 GB from DRAM for 0.3 GB of operands (ncu), and grouped order is 11-13%
// faster there (docs/perf.md v36).  Up to kBatchFastestMaxTiles batch tiles a wave
// of either order covers the same tiles (all of x), and both launchers
// (sm90_gemm_fp16x3_bn.cu; lowp/sm90_gemm_bn_16bit.cu since perf.md v62) keep
// batch-fastest (the KernelBench shape, 8 batch tiles: the grouped instantiation
// measured 3% slower in training there).
constexpr int kTileGroupN = 8;
constexpr int kBatchFastestMaxTiles = 16;

// The launchers' choice of order for M rows in batch tiles of block_m rows.
inline bool grouped_tile_order(int M, int block_m) { return (M + block_m - 1) / block_m > kBatchFastestMaxTiles; }

struct TileCoord {
  int m, n;  // batch tile, feature tile
};

template <bool kGroupedOrder>
__device__ __forceinline__ TileCoord tile_coord(int tile, int m_tiles, int N) {
  if constexpr (!kGroupedOrder) {
    return {tile % m_tiles, tile / m_tiles};
  } else {
    const int n_tiles = (N + kTileN - 1) / kTileN;
    const int per_group = kTileGroupN * m_tiles;
    const int group = tile / per_group, first_n = group * kTileGroupN;
    const int group_n = min(kTileGroupN, n_tiles - first_n);
    const int r = tile - group * per_group;
    return {r / group_n, first_n + r % group_n};
  }
}

// k-blocks [kb_begin, kb_end) of tile `tile`; piece -1 for a whole tile.
struct WorkSegment {
  int tile, kb_begin, kb_end, piece;
};

__device__ __forceinline__ int cta_num_segments(const StreamKPlan& p, int cta) {
  const int dedicated = p.sk_tiles * (p.pieces - 1);
  if (cta >= p.sk_ctas || cta < dedicated) return 1;
  return min(p.tails_per_cta, p.sk_tiles - (cta - dedicated) * p.tails_per_cta);
}

__device__ __forceinline__ WorkSegment cta_segment(const StreamKPlan& p, int cta, int si, int num_k_blocks) {
  if (cta >= p.sk_ctas) return {p.sk_tiles + (cta - p.sk_ctas), 0, num_k_blocks, -1};
  const int dedicated = p.sk_tiles * (p.pieces - 1);
  if (cta < dedicated) {
    const int j = cta % (p.pieces - 1);
    return {cta / (p.pieces - 1), j * p.piece_blocks, (j + 1) * p.piece_blocks, j};
  }
  return {(cta - dedicated) * p.tails_per_cta + si, (p.pieces - 1) * p.piece_blocks, num_k_blocks, p.pieces - 1};
}

// body(seg) for each segment of this CTA's work, in order: CTA `cta` =
// blockIdx.x runs unit cta's num_segments = cta_num_segments(p, cta) segments
// (kPersistent false: one CTA per unit), or the segments of units cta, cta +
// gridDim.x, ... (true: a persistent grid).  The persistent walk advances
// (unit, segment) in one loop: as two nested loops ptxas kept the unit in
// local memory in the fp16x3 kernel's kTrain instantiation (a spill).
template <bool kPersistent, typename Body>
__device__ __forceinline__ void for_each_segment(const StreamKPlan& p, int cta, int num_segments, int num_k_blocks,
                                                 Body&& body) {
  if constexpr (kPersistent) {
    int unit = cta, si = 0;
    while (unit < p.sk_ctas + p.dp_tiles) {
      const WorkSegment seg = cta_segment(p, unit, si, num_k_blocks);
      if (++si == cta_num_segments(p, unit)) si = 0, unit += static_cast<int>(gridDim.x);
      body(seg);
    }
  } else {
    for (int si = 0; si < num_segments; ++si) body(cta_segment(p, cta, si, num_k_blocks));
  }
}

// Short x boxes (both sm_90a GEMMs).  A K-major x box reaching past the batch is
// zero-filled by TMA, but that fill is not free: lowp_sm90's mainloop at 8192 x 8192 took
// 44.9 us at 16 rows (112 rows of its 128-row box filled) against 33.3 at 128, about
// 0.1 us a filled row (H200, docs/perf.md v110).  So where the batch is one tile shorter
// than the tile, x's boxes bring x_box_rows rows (M rounded up to 8), and the rows of the
// x tiles past them are zeroed once at the CTA's start (zero_x_rows_past_box) and never
// written again: the products are those of the zero-filled whole box, bit for bit.
__host__ __device__ constexpr int x_box_rows(int M, int block_m) { return M >= block_m ? block_m : (M + 7) / 8 * 8; }

// Zeroes rows box_rows .. kTileRows - 1 (128 bytes each: one swizzle span) of each of the
// kStages stages' kParts x tiles (at stage * kStageBytes + kXOffset + part * kPartBytes from
// smem), all threads of the CTA striding by blockDim.x, then fences the generic proxy's
// stores for wgmma's reads (the async proxy).  Before the CTA's first barrier wait.  box_rows
// by reference to the kernel's argument: the callers' SASS is then the measured build's
// (docs/perf.md v110), which took the argument where it is used.
template <int kStages, int kStageBytes, int kXOffset, int kParts, int kPartBytes, int kTileRows>
__device__ __forceinline__ void zero_x_rows_past_box(uint8_t* smem, const int& box_rows) {
  const int chunks = (kTileRows - box_rows) * 128 / 16;  // 16-byte chunks per x tile
  for (int i = threadIdx.x; i < kStages * kParts * chunks; i += blockDim.x) {
    const int tile = i / chunks, c = i % chunks;  // tile: stage * kParts + part
    *reinterpret_cast<uint4*>(smem + (tile / kParts) * kStageBytes + kXOffset + (tile % kParts) * kPartBytes +
                              box_rows * 128 + 16 * c) = make_uint4(0u, 0u, 0u, 0u);
  }
  fence_proxy_async_shared();
}

// Byte offset of element (row, col) of a 128-byte-swizzled K-major tile.
__device__ __forceinline__ uint32_t sw128_offset(int row, int col) {
  return static_cast<uint32_t>(row * 128 + ((((col >> 2) ^ row) & 7) << 4) + (col & 3) * 4);
}
// ---------------------------------------------------------------------------
// Device side: the split-tile hand-off and the epilogues of a finished tile
// ---------------------------------------------------------------------------

// Split-tile hand-off.  Every piece's CTA stores its partial sums in the
// piece's slot, then counts itself in with a GPU-scope acquire-release
// atomic; the last to arrive sums the slots in piece order (its own read
// back too, so the result does not depend on which CTA came last) and runs
// the epilogue.  No CTA waits for another, so this cannot deadlock whatever
// the residency.  Called by all kConsumerThreads consumer threads (ctid =
// 0 .. 255); true when this CTA finishes tile seg.tile, acc then holding the
// whole sum.  plan, partials, tile_arrivals: the grid's plan and the
// workspace (Sm90GemmBnArgs' fields of those names).
__device__ __forceinline__ bool split_tile_hand_off(float (&acc)[kTileAccRegs], const StreamKPlan& plan,
                                                    float* partials, int* tile_arrivals, const WorkSegment& seg,
                                                    int ctid) {
  __shared__ int last_arrival;
  constexpr int kAccQuads = kTileAccRegs / 4;
  auto partial_slot = [&](int tile, int piece) {
    return reinterpret_cast<float4*>(partials) +
           static_cast<size_t>(tile * plan.pieces + piece) * kAccQuads * kConsumerThreads + ctid;
  };
  float4* mine = partial_slot(seg.tile, seg.piece);
#pragma unroll
  for (int i = 0; i < kAccQuads; ++i)
    __stcg(mine + i * kConsumerThreads, make_float4(acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]));
  named_barrier_sync<1, kConsumerThreads>();  // the CTA's stores precede the release below
  if (ctid == 0) {
    __threadfence();
    last_arrival = atomic_add_acq_rel_gpu(&tile_arrivals[seg.tile], 1) == plan.pieces - 1;
  }
  named_barrier_sync<1, kConsumerThreads>();
  if (!last_arrival) return false;
#pragma unroll
  for (int i = 0; i < kTileAccRegs; ++i) acc[i] = 0.f;
  for (int piece = 0; piece < plan.pieces; ++piece) {
    const float4* slot = partial_slot(seg.tile, piece);
#pragma unroll
    for (int i = 0; i < kAccQuads; ++i) {
      const float4 v = __ldcg(slot + i * kConsumerThreads);
      acc[4 * i] += v.x;
      acc[4 * i + 1] += v.y;
      acc[4 * i + 2] += v.z;
      acc[4 * i + 3] += v.w;
    }
  }
  return true;
}

// The product's last steps, in place: z = (acc 2^-e_n) 2^-e_m (the fp16x3
// operands' power-of-two row scales, two exact multiplies; 2^-e_n = 1 where
// args.w_inv_scale is null) + c_m (hi_n + lo_n) where x was centred
// (args.x_center not null; centring.cuh): two fmas, one rounding of z beyond
// the tiny lo product.  Rows past M or N hold zeros and stay zero.  The scales
// (the thread's 2 features' 2^-e_n and row sums, its kTileAccRegs / 2 rows' 2^-e_m)
// are loaded here, after the products, or by load_tile_scales before them (grad W's
// staged instantiations, where a tile is one or two k-blocks at a small batch and the
// loads after the products were a long-scoreboard stall of both warpgroups each tile:
// 0.95x grad W's time at 24-128 x 8192^2, docs/perf.md v113; that form also skips the
// centring fmas where x is not centred: 0.85-0.91x more at 24-128 rows, v114); the rows'
// centres (x centred) are loaded here either way.
struct TileScales {
  float w_inv[2];
  float2 w_sum[2];
  float x_inv[kTileAccRegs / 2];  // row 8 i + 2 t + e at 2 i + e
};

// Features f0 and f0 + 8: 2^-e_n (1 where w is unscaled, 0 past N) and the row sums (x centred).
__device__ __forceinline__ void load_w_scales(const Sm90GemmBnArgs& args, int f0, bool centred, float (&w_inv)[2],
                                              float2 (&w_sum)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int f = f0 + 8 * h;
    w_inv[h] = f < args.N ? (args.w_inv_scale != nullptr ? __ldg(args.w_inv_scale + f) : 1.f) : 0.f;
    w_sum[h] = centred && f < args.N ? __ldg(args.w_row_sum + f) : make_float2(0.f, 0.f);
  }
}

template <bool kGroupedOrder>
__device__ __forceinline__ TileScales load_tile_scales(const Sm90GemmBnArgs& args, int tile, int m_tiles, int w_row,
                                                       int t) {
  const TileCoord tc = tile_coord<kGroupedOrder>(tile, m_tiles, args.N);
  const int m0 = tc.m * kTileM, n0 = tc.n * kTileN;
  const bool centred = args.x_center != nullptr;
  TileScales s;
  load_w_scales(args, n0 + w_row, centred, s.w_inv, s.w_sum);
#pragma unroll
  for (int i = 0; i < kTileAccRegs / 4; ++i)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int b = m0 + 8 * i + 2 * t + e;
      s.x_inv[2 * i + e] = b < args.M ? __ldg(args.x_inv_scale + b) : 0.f;
    }
  return s;
}

// kPreloaded: the scales come from `pre` (load_tile_scales, before the products); else
// they are loaded here.
template <bool kGroupedOrder, bool kPreloaded = false>
__device__ __forceinline__ void finish_product(float (&acc)[kTileAccRegs], const Sm90GemmBnArgs& args, int tile,
                                               int m_tiles, int w_row, int t, const TileScales& pre = TileScales{}) {
  const TileCoord tc = tile_coord<kGroupedOrder>(tile, m_tiles, args.N);
  const int m0 = tc.m * kTileM, n0 = tc.n * kTileN;
  const bool centred = args.x_center != nullptr;
  float w_inv[2];
  float2 w_sum[2];
  if constexpr (kPreloaded) {
    if (!centred) {
      // x not centred (grad W's operands never are): only the scales, without the two
      // fmas that would add c_m (hi_n + lo_n) = +0 (128 instructions a thread a tile).
#pragma unroll
      for (int i = 0; i < kTileAccRegs / 4; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float& z = acc[4 * i + 2 * h + e];
            z = (z * pre.w_inv[h]) * pre.x_inv[2 * i + e];
          }
      return;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      w_inv[h] = pre.w_inv[h];
      w_sum[h] = pre.w_sum[h];
    }
  } else {
    load_w_scales(args, n0 + w_row, centred, w_inv, w_sum);
  }
#pragma unroll
  for (int i = 0; i < kTileAccRegs / 4; ++i)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int b = m0 + 8 * i + 2 * t + e;
      const float inv = kPreloaded ? pre.x_inv[2 * i + e] : b < args.M ? __ldg(args.x_inv_scale + b) : 0.f;
      const float c = centred && b < args.M ? __ldg(args.x_center + b) : 0.f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float& z = acc[4 * i + 2 * h + e];
        z = (z * w_inv[h]) * inv;
        z = fmaf(c, w_sum[h].x, fmaf(c, w_sum[h].y, z));
      }
    }
}

// The epilogue of one finished tile (layout in this header's comment): kEval
// folds bias, scale and BatchNorm into a * z + c; kTrain writes the tile's
// per-feature mean and M2; every epilogue then stores the tile.
template <Epilogue kEpilogue, bool kGroupedOrder>
__device__ __forceinline__ void finish_tile(float (&acc)[kTileAccRegs], const Sm90GemmBnArgs& args, int tile,
                                            int m_tiles, int w_row, int t) {
  const int M = args.M, N = args.N;
  const TileCoord tc = tile_coord<kGroupedOrder>(tile, m_tiles, N);
  const int m_tile = tc.m, n_tile = tc.n;
  const int m0 = m_tile * kTileM, n0 = n_tile * kTileN;
  const int f_base = n0 + w_row;
  if constexpr (kEpilogue == Epilogue::kEval) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int f = f_base + 8 * h;
      if (f >= N) continue;
      float a, c;
      bn_eval_affine(args.bn, f, a, c);
#pragma unroll
      for (int i = 0; i < kTileAccRegs / 4; ++i) {
        acc[4 * i + 2 * h] = fmaf(a, acc[4 * i + 2 * h], c);
        acc[4 * i + 2 * h + 1] = fmaf(a, acc[4 * i + 2 * h + 1], c);
      }
    }
  } else if constexpr (kEpilogue == Epilogue::kTrain) {
    // Per-feature mean and M2 over the tile's valid rows: two passes over the
    // registers (no E[z^2] - E[z]^2 cancellation), reduced across the quad.
    // Both sums are float64, so mean and M2 are rounded once each: float32
    // sums of 32 values per thread kept ~3 ulps, the largest error left in
    // running_mean and running_var (docs/perf.md v21).
    const int rows_valid = min(kTileM, M - m0);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      double sum = 0.0;
#pragma unroll
      for (int i = 0; i < kTileAccRegs / 4; ++i) {
#pragma unroll
        for (int e = 0; e < 2; ++e)
          if (8 * i + 2 * t + e < rows_valid) sum += static_cast<double>(acc[4 * i + 2 * h + e]);
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const float mean = static_cast<float>(sum / static_cast<double>(rows_valid));
      double m2_sum = 0.0;
#pragma unroll
      for (int i = 0; i < kTileAccRegs / 4; ++i) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const double d = static_cast<double>(acc[4 * i + 2 * h + e] - mean);
          if (8 * i + 2 * t + e < rows_valid) m2_sum = fma(d, d, m2_sum);
        }
      }
      m2_sum += __shfl_xor_sync(0xffffffffu, m2_sum, 1);
      m2_sum += __shfl_xor_sync(0xffffffffu, m2_sum, 2);
      const float m2 = static_cast<float>(m2_sum);
      const int f = f_base + 8 * h;
      if (t == 0 && f < N) {
        args.part_mean[static_cast<size_t>(m_tile) * N + f] = mean;
        args.part_m2[static_cast<size_t>(m_tile) * N + f] = m2;
      }
    }
  }

  // Store: a warp instruction writes 8 consecutive features (32 bytes) of 4 rows.
#pragma unroll
  for (int i = 0; i < kTileAccRegs / 4; ++i) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int b = m0 + 8 * i + 2 * t + e;
      if (b >= M) continue;
      float* out_row = args.out + static_cast<size_t>(b) * N;
      if (f_base < N) out_row[f_base] = acc[4 * i + e];
      if (f_base + 8 < N) out_row[f_base + 8] = acc[4 * i + 2 + e];
    }
  }
}

// Staged stores (the fp16x3 kernel's grad W instantiations: Fp16x3Traits::staged_store).
// finish_tile's scalar stores (8 features x 4 rows a warp instruction) hold the consumers
// until the tile's 64 KB have been issued; with one 64-k block per tile (grad W at a batch
// of 24-64 rows, 8192 x 8192) a tile took about 4.5 us, about 1 of them the mainloop
// (docs/perf.md v111).  Here each consumer warpgroup's 64 features x kTileM rows leave in
// kTileM / kStoreRows rounds of two boxes, kStoreRows rows x 32 features (128 bytes, one
// swizzle span) each, written to shared memory apart from the ring and stored by TMA
// (rows >= M and features >= N clipped), so the stores drain while the next tile's
// mainloop runs.  The rounds alternate between the warpgroup's two buffers; a buffer is
// rewritten once the two stores that last read it have read it (wait_group.read 2: the
// previous round's two may still be pending; PTX ISA 9.7.9.25.3).  The st.shared of one
// warp instruction cover rows 2t + e (t = 0 .. 3) x 8 features: with the 128-byte swizzle
// eight distinct 16-byte chunks, so no bank conflict.  `round` counts the warpgroup's
// rounds over the CTA's tiles; the CTA waits for the last reads before it exits (the
// kernel's tail), and the writes are ordered by the grid's end.  Each round is
// staged_store_round (sm90_primitives.cuh, shared with lowp's store_tile_tma).  Barriers
// 2 and 3 (one per warpgroup; 1 is split_tile_hand_off's): the warpgroup's index made warp-uniform
// (__shfl_sync) and the id a register.  With a branch per warpgroup between two immediate
// ids, ptxas moved the mainloop's descriptor arithmetic off the uniform datapath (46 R2UR
// among its wgmmas; grad x and z at 1024 x 8192^2 then 1.18-1.2x slower).  Measured: grad
// W 0.93-0.97x the scalar stores' time at 24-1024 rows (docs/perf.md v112).  initcheck
// does not see TMA stores; the poisoned-output tests check every element is written.
constexpr int kStoreRows = 32;
constexpr int kStoreBoxBytes = kStoreRows * 128;                     // 32 rows x 32 fp32
constexpr int kStagingBytes = (kConsumerThreads / 128) * 2 * 2 * kStoreBoxBytes;  // warpgroups x buffers x boxes

__device__ __forceinline__ void store_tile_staged(const float (&acc)[kTileAccRegs], const CUtensorMap* tmap_out,
                                                  uint8_t* staging, int m0, int n0, int& round) {
  const int warpgroup = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);  // consumer threads 0 .. 255
  const int warp = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  const int t = lane % 4;
  const bool elected = threadIdx.x % 128 == 0;
  // Feature 16 warp + lane / 4 + 8 h of the warpgroup's 64: box warp / 2, column
  // 16 (warp % 2) + lane / 4 + 8 h of its 32.
  const int col0 = 16 * (warp % 2) + lane / 4;
  uint8_t* const buffers = staging + warpgroup * 2 * 2 * kStoreBoxBytes;
#pragma unroll
  for (int sub = 0; sub < kTileM / kStoreRows; ++sub) {
    uint8_t* const buffer = buffers + ((round + sub) & 1) * 2 * kStoreBoxBytes;
    staged_store_round<2>(
        elected, 2 + warpgroup,
        [&]() {
          const uint32_t box = smem_u32(buffer + (warp / 2) * kStoreBoxBytes);
#pragma unroll
          for (int r = 0; r < kStoreRows / 8; ++r)
#pragma unroll
            for (int e = 0; e < 2; ++e)
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                const int i = sub * (kStoreRows / 8) + r;
                st_shared_f32(box + sw128_offset(8 * r + 2 * t + e, col0 + 8 * h), acc[4 * i + 2 * h + e]);
              }
        },
        [&]() {
          const int f0 = n0 + warpgroup * 64, b0 = m0 + sub * kStoreRows;
          tma_store_2d(tmap_out, buffer, f0, b0);
          tma_store_2d(tmap_out, buffer + kStoreBoxBytes, f0 + 32, b0);
        });
  }
  round += kTileM / kStoreRows;
}

// ---------------------------------------------------------------------------
// Host side: tensor maps, the split-tile plan, device facts
// ---------------------------------------------------------------------------

// A (rows, K) row-major matrix of elem_bytes-byte elements (kFloat32: fp32;
// else 16-bit words) read in boxes of box_rows x (128 / elem_bytes) elements,
// one 128-byte swizzle span per row, zero-filled outside the matrix.  False where
// TMA cannot address it (ptr not 16-byte aligned, or a row's bytes not a multiple of
// 16: checked here, so that a caller that falls back to other loads or stores, e.g.
// lowp's 16-bit out at N % 8 != 0, makes no failing driver call that
// compute-sanitizer reports), or where the driver has no encoder or refuses the map.
enum class TileDtype { kFloat32, kWord16 };

static bool make_tensor_map(CUtensorMap* map, const void* ptr, TileDtype dtype, int rows, int K, int box_rows) {
  const EncodeTiledFn encode = encode_tiled_fn();
  const int elem_bytes = dtype == TileDtype::kFloat32 ? 4 : 2;
  if (encode == nullptr || (static_cast<int64_t>(K) * elem_bytes) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(ptr) % 16 != 0)
    return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(K), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(K) * elem_bytes};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(128 / elem_bytes), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  return encode(map, dtype == TileDtype::kFloat32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : CU_TENSOR_MAP_DATA_TYPE_UINT16, 2,
                const_cast<void*>(ptr), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// A (K, rows) row-major matrix of 16-bit words (an MN-major operand: k-row by
// k-row; rows % 8 == 0 for TMA's 16-byte global stride) read in boxes of 64
// rows (one 128-byte swizzle span) x 64 k, zero-filled outside the matrix.
constexpr int kMnBoxRows = 64;
constexpr int kMnBoxK = 64;
static bool make_tensor_map_mn(CUtensorMap* map, const void* ptr, int rows, int K) {
  const EncodeTiledFn encode = encode_tiled_fn();
  if (encode == nullptr || rows % 8 != 0) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(rows), static_cast<cuuint64_t>(K)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(rows) * 2};
  const cuuint32_t box[2] = {kMnBoxRows, kMnBoxK};
  const cuuint32_t element_strides[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, const_cast<void*>(ptr), dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

static bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Workspace floats of the split tiles' partial sums (one slot per piece),
// followed by one int per split tile (the arrival counts).
static long long partial_floats(const StreamKPlan& p) {
  return static_cast<long long>(p.sk_tiles) * p.pieces * kTileN * kTileM;
}

}  // namespace sm90
}  // namespace fused_gemm_bn
