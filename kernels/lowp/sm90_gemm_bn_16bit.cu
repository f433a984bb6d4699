// sm90_gemm_bn_16bit.cu -- Linear on Hopper's 16-bit tensor cores in the input's
// type (__half or __nv_bfloat16; one product, float32 accumulation) through
// wgmma and TMA, with the per-element part of Linear -> scale -> BatchNorm1d
// (problem 33) or Linear -> BatchNorm1d -> scale (problem 84) in the epilogue,
// rounded where PyTorch's eager ops round.  Needs sm_90a (H100 / H200); the
// mma.sync kernel (sm80_gemm_bn_16bit.cu) serves sm_80-89 and the shapes this
// one does not take.
//
// Formula and rounding points: those of sm80_gemm_bn_16bit.cu, element for
// element (acc[m, n] = sum_k x[m, k] w[n, k] in float32; rnd = round to the
// 16-bit type, nearest even; f(v) = float(v)):
//   z = rnd(acc + f(bias))
//   kTrain, 33: u = rnd(z f(scale));  84: u = z.  out = u, and the mean and M2 of
//     u[:, n] over each 128-row block of the batch (part_mean, part_m2, float32,
//     two passes over the registers), which bn_16bit.cu merges; with z_out (the
//     training forward with gradients) also z_out = z, as T.
//   kEval, 33: out = rnd(fma(w (rnd(z f(scale)) - rm), invstd, b))
//   kEval, 84: out = rnd(rnd(fma(w (z - rm), invstd, b)) f(scale))   (then the row softmax)
//     with z_out and coeff_out (kEvalSaved: the eval forward with gradients, 16-bit out only),
//     also z_out = z, as T, and the first batch tile's CTAs write the coefficients they used,
//     {rm, invstd, w, b} (lowp_coeff.cuh's (4, N) rows), for bn_16bit_backward.cu.
//   w, b, rm = f(bn.weight), f(bn.bias), f(running_mean); invstd = rsqrtf(f(running_var) + eps).
// Autocast form (S = float, Storage in lowp_types.cuh: a float32 module under
// torch.autocast in T): the vectors and out are float32; bias is rounded to T
// first (autocast's cast), and the roundings to S above are none:
//   kTrain, 33: u = z f(scale);  84: u = z.   kEval, 33: out = fma(w (z f(scale) - rm), invstd, b)
//   kEval, 84: out = rnd(fma(w (z - rm), invstd, b)) f(scale)   (BatchNorm's output is T under autocast)
// In that form w may also be float32 (kWFloat: the training forward without
// gradients, where no cached cast exists): each consumer rounds its A
// fragments to T as it reads them from shared memory (cvt.rn.*x2.f32, round to
// nearest even: the values of autocast's w.to(T)), so the products and sums are
// those of the cast weight, bit for bit (tests/test_autocast_fused.py).
// Expected error: PyTorch's own 16-bit path's (the same rounding points; the
// float32 sums differ only in order).  The tensor core's fp32 accumulation is
// the one cuBLAS's 16-bit GEMMs use; no split-K.
//
// Tensors (row-major, contiguous)
//   x (M, K), w (N, K): T (w: or float32, kWFloat), K-major, 16-byte aligned,
//     K % 8 == 0 (TMA's 16-byte global strides); out (M, N) and the six
//     vectors (N): S (T, or float32).
//   part_mean, part_m2 (ceil(M / 128), N) float32 (kTrain).
//   z_out (M, N) T (kTrainSaved, kEvalSaved: the forward with gradients; else null).
//   coeff_out (4, N) float32 (kEvalSaved; else null).
//   num_batches_tracked int64 (kTrain, may be null): CTA 0 adds 1.
//
// Structure (PTX ISA 9.7.15 wgmma, 9.7.9.25.5 cp.async.bulk.tensor, 9.7.12.15 mbarrier)
//   The swapped product z^T = w x^T, as the float32 Hopper kernels: a CTA
//   computes BLOCK_N = 128 features (wgmma M: two consumer warpgroups of 64) by
//   BLOCK_M batch rows (wgmma N: 256, or 128 on small grids: lowp_grid_plan), BLOCK_K = 64 (one
//   128-byte swizzle row).  Warpgroup 2 is the producer: one thread streams the
//   k-blocks' w and x tiles by TMA into a ring of kNumStages stages (full /
//   empty mbarriers).  Each consumer warpgroup issues its BLOCK_K / 16 = 4
//   m64nBLOCK_Mk16 wgmmas per stage with both operands in shared memory (SS),
//   as one commit group, then waits for the previous group (wait_group 1) and
//   releases that group's stage: one group in flight while the next stage's
//   barrier is awaited.  BLOCK_M = 256: whole tiles, a persistent grid of
//   min(tiles, SMs) CTAs each walking tiles cta, cta + gridDim.x, ... (the producer
//   loads a CTA's next tile while its consumers finish the last; 1.2-1.6% off the
//   kernel at 1024-16384 rows, 10-12% at a short K: docs/perf.md v70).  BLOCK_M = 128: the
//   grid of sm90_gemm_tiles.cuh (whole tiles, and remainder tiles cut along K
//   whose pieces meet in split_tile_hand_off: float32 partial sums, the last
//   piece to arrive runs the epilogue).  Tiles walk the batch fastest, so the
//   CTAs sharing a w tile run together and w streams from DRAM about once.
//   At a batch shorter than the 128-row tile, x's box brings only the batch's rows (rounded
//   up to 8) and the tile's other rows are zeroed once at the CTA's start (x_box_rows).
//   kWFloat: the w tile is float32 (two 32-wide TMA boxes per k-block, 64 KB
//   stages, 3 of them at BLOCK_M = 256) and the consumers issue the RS form
//   (A from registers: float2 shared-memory loads, one cvt per pair, two
//   register buffers so a k-block's fragments are made while the previous
//   group runs).  Its call takes 1.19-1.27x the 16-bit w's time at the
//   KernelBench shape (3 stages instead of 4, 64 KB per k-block from L2
//   instead of 48, and the conversions: not separated), against ~1.5x for a
//   cast pass first (docs/perf.md v30).
//   Accumulator layout: sm90_wgmma_16bit.cuh (feature 64 wg + 16 warp + g + 8 h,
//   batch row 8 i + 2 t + e of the tile).  The epilogue works in registers: the
//   statistics reduce over the quad (shuffles).  Stores: with 256-row tiles, a
//   16-bit out and N % 8 == 0, out leaves by TMA through shared memory apart from
//   the ring: stmatrix .trans into 128-byte-swizzled boxes of 64 rows x 64
//   features, two buffers per consumer warpgroup (store_tile_tma; 2-3% off the
//   call at the KernelBench shape against store_tile, docs/perf.md v30); z_out (the
//   saved chains) the same way, before out.  Otherwise (float32
//   out, split tiles) store_tile pairs neighbouring features through one shuffle so
//   each thread writes 4-byte words.
//
// Launchers return the launch error (cudaSuccess if none); they never synchronise.

#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>

#include "device_facts.cuh"
#include "heuristics_sm90.cuh"
#include "launchers.cuh"
#include "lowp_chain.cuh"
#include "lowp_coeff.cuh"
#include "lowp_types.cuh"
#include "sm90_gemm_tiles.cuh"
#include "sm90_wgmma_16bit.cuh"

// FUSED_GEMM_BN_LOWP_PHASE(p): a time stamp of phase p of the CTA's work (thread 0: 0 start,
// 1 first stage landed, 2 last k-block done, 3 chain applied, 4 statistics written, 5 out
// stored, 6 end), defined by tools/lowp_phase_times.cu to read %globaltimer; nothing
// otherwise (the kernels' code is the same with and without this line).
#ifndef FUSED_GEMM_BN_LOWP_PHASE
#define FUSED_GEMM_BN_LOWP_PHASE(p) static_cast<void>(0)
#endif

namespace fused_gemm_bn {
namespace lowp {
namespace hopper {

// The batch rows of one CTA (wgmma N): 256 while the grid of such tiles fills
// at least half of the GPU, else 128 with split tiles (lowp_grid_plan, heuristics_sm90.cuh).
constexpr int kBatchTile = sm90::kLowpBatchTile;
constexpr int kSmallBatchTile = sm90::kLowpSmallBatchTile;
// Rows of one statistics block (part_mean / part_m2 rows), as the mma.sync kernel's BLOCK_M.
constexpr int kStatRows = 128;
// Rows of one TMA store box of out or z (256-row plans: store_tile_tma).
constexpr int kStoreRows = 64;

// kWFloat: w arrives as float32 (a float32 module under autocast) and each
// consumer converts its A fragments to T in registers (wgmma RS); else w is T
// in shared memory (wgmma SS).
template <int kBlockM, bool kWFloat = false>
struct Traits {
  static constexpr int BLOCK_N = 128;  // features per CTA (wgmma M over the consumer warpgroups)
  static constexpr int BLOCK_M = kBlockM;  // batch rows per CTA (wgmma N)
  static constexpr int BLOCK_K = 64;   // one 128-byte swizzle row of 16-bit elements
  static constexpr int WGMMA_K = 16;
  static constexpr int kKSteps = BLOCK_K / WGMMA_K;
  static constexpr int kNumConsumers = BLOCK_N / 64;
  static constexpr int kNumThreads = 128 * (kNumConsumers + 1);
  static constexpr int kAccRegs = 64 * BLOCK_M / 128;
  static constexpr int W_BOX_BYTES = BLOCK_N * 128;  // one TMA box: BLOCK_N rows of one 128-byte swizzle span
  static constexpr int W_TILE_BYTES = BLOCK_N * BLOCK_K * (kWFloat ? 4 : 2);  // float32 w: two boxes of 32 k
  static constexpr int X_TILE_BYTES = BLOCK_M * BLOCK_K * 2;
  static constexpr int STAGE_BYTES = W_TILE_BYTES + X_TILE_BYTES;
  static constexpr int kNumStages = (200 * 1024) / STAGE_BYTES < 8 ? (200 * 1024) / STAGE_BYTES : 8;
  // 256-row plans run as a persistent grid (min(tiles, SMs) CTAs, each walking tiles cta,
  // cta + gridDim.x, ...: for_each_segment<true>), their stores staged apart from the ring, in
  // each consumer warpgroup's two buffers of kStoreRows x 64 features (store_tile_tma).
  static constexpr bool kPersistent = kBlockM == kBatchTile;
  static constexpr int STAGING_BYTES = kPersistent ? kNumConsumers * 2 * kStoreRows * 128 : 0;
  static constexpr int SMEM_BYTES = kNumStages * STAGE_BYTES + STAGING_BYTES + 2 * kNumStages * 8 + 1024;
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  static constexpr int kStatBlocks = BLOCK_M / kStatRows;

  static_assert(BLOCK_M == 128 || BLOCK_M == 256, "wgmma m64n128k16 or m64n256k16");
  static_assert(BLOCK_K * 2 == 128, "tiles are rows of one 128-byte swizzle span");
  static_assert(W_TILE_BYTES % 1024 == 0 && STAGE_BYTES % 1024 == 0, "tiles start on 1024-byte swizzle atoms");
  static_assert(kNumStages >= 3, "the ring needs room for a stage in flight on each side");
  static_assert(kNumConsumers * 128 * kConsumerRegs + 128 * kProducerRegs <= 65536, "register file");
};

// kTrainSaved / kEvalSaved: kTrain / kEval that also store z (args.z_out), for the forward with
// gradients; kEvalSaved also writes the coefficients it used (args.coeff_out).
enum class Chain { kTrain, kTrainSaved, kEval, kEvalSaved };

__host__ __device__ constexpr bool is_eval(Chain c) { return c == Chain::kEval || c == Chain::kEvalSaved; }

// The vectors and out hold words of the storage type S (lowp_types.cuh: T, or float
// under autocast); the kernel casts them.
struct Args {
  int M, N, K;
  void* out;
  const void* bias;
  const void* scale;
  int scale_stride;          // 1, or 0: one number for every feature
  const void* bn_weight;     // kEval
  const void* bn_bias;       // kEval
  const void* running_mean;  // kEval
  const void* running_var;   // kEval
  float eps;                     // kEval
  bool scale_after_bn;           // false: problem 33; true: problem 84
  float* part_mean;              // kTrain
  float* part_m2;                // kTrain
  int64_t* num_batches_tracked;  // kTrain; may be null
  void* z_out;                   // kTrainSaved, kEvalSaved: z (M, N) as T (the backward's saved Linear output)
  float* coeff_out;              // kEvalSaved: (4, N) rows {running_mean, invstd, bn.weight, bn.bias} (lowp_coeff.cuh)
  // The grid's work (BLOCK_M = 128 only: whole tiles and split tiles, sm90_gemm_tiles.cuh;
  // BLOCK_M = 256: whole tiles, walked persistently) and the split tiles' workspace.
  sm90::StreamKPlan plan;
  float* partials;
  int* tile_arrivals;
  // BLOCK_M = 256, 16-bit out with N % 8 == 0: out is written through shared memory
  // and TMA stores (tmap_out), else by store_tile.
  bool tma_store;
  bool tma_store_z;  // z_out by TMA the same way (store_tile_tma)
  // Tile order (sm90_gemm_tiles.cuh, tile_coord): grouped where there are more than
  // kBatchFastestMaxTiles batch tiles (a batch-fastest wave would read all of x), else
  // batch-fastest.  Grouped takes 0.80-0.85 of batch-fastest's time at 16384 x 4096 x
  // 4096 and 0.97-0.99 at 6144-8192 rows (H200, docs/perf.md v62); the outputs are
  // bit-identical (each tile's arithmetic and the statistics' order do not depend on it).
  bool grouped_order;
  // Batch rows that x's TMA box brings per stage: sm90::x_box_rows on 128-row plans (the rest
  // of a short batch's tile zeroed once: sm90_gemm_tiles.cuh, "Short x boxes"); BLOCK_M on
  // 256-row plans.
  int x_box_rows;
};

static_assert(Traits<128>::BLOCK_N == sm90::kTileN && Traits<256>::BLOCK_N == sm90::kTileN,
              "tile_coord counts feature tiles of kTileN");

__device__ __forceinline__ sm90::TileCoord lowp_tile_coord(const Args& args, int tile, int m_tiles) {
  return args.grouped_order ? sm90::tile_coord<true>(tile, m_tiles, args.N)
                             : sm90::tile_coord<false>(tile, m_tiles, args.N);
}

template <typename T, int kBlockM>
__device__ __forceinline__ void issue_wgmma_rs(float (&acc)[64 * kBlockM / 128], const uint32_t (&a)[4],
                                               uint64_t desc_b) {
  if constexpr (kBlockM == 128) {
    sm90::wgmma_m64n128k16_rs<T>(acc, a, desc_b);
  } else {
    sm90::wgmma_m64n256k16_rs<T>(acc, a, desc_b);
  }
}

template <typename T, int kBlockM>
__device__ __forceinline__ void issue_wgmma(float (&acc)[64 * kBlockM / 128], uint64_t desc_a, uint64_t desc_b) {
  if constexpr (kBlockM == 128) {
    sm90::wgmma_m64n128k16_ss<T>(acc, desc_a, desc_b);
  } else {
    sm90::wgmma_m64n256k16_ss<T>(acc, desc_a, desc_b);
  }
}

// Stores a finished tile's values (acc as in tile_epilogue) as words of S
// into out (M, N): row-major, rows m0.., this thread's features col0 and col0 + 8.
// 16-bit S with N even: lanes g and g ^ 1 (features f, f + 1) swap one value so
// each writes one 4-byte word: the even lane row b (f, f + 1), the odd lane row
// b + 1 (f - 1, f).  Otherwise one store per element (4 bytes for float: a
// warp's store covers four full 32-byte sectors).
template <typename S, int kBlockM>
__device__ __forceinline__ void store_tile(const float (&acc)[64 * kBlockM / 128], void* out, int M, int N, int m0,
                                           int col0, int g, int t) {
  using St = Storage<S>;
  using W = word_t<S>;
  constexpr int kAccRegs = 64 * kBlockM / 128;
  if constexpr (sizeof(W) == 2) {
    if (N % 2 == 0) {
      const bool odd = (g & 1) != 0;
#pragma unroll
      for (int i = 0; i < kAccRegs / 4; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t v0 = to_bits<S>(acc[4 * i + 2 * h]), v1 = to_bits<S>(acc[4 * i + 2 * h + 1]);
          const uint32_t other = __shfl_xor_sync(0xffffffffu, odd ? v0 : v1, 4);
          const int row = m0 + 8 * i + 2 * t + (odd ? 1 : 0);
          const int col = col0 + 8 * h - (odd ? 1 : 0);
          if (row < M && col < N) {
            uint16_t* p = static_cast<uint16_t*>(out) + static_cast<size_t>(row) * N + col;
            const uint16_t lo = static_cast<uint16_t>(odd ? other : v0), hi = static_cast<uint16_t>(odd ? v1 : other);
            if (col + 1 < N) {
              *reinterpret_cast<uint32_t*>(p) = pack2(lo, hi);
            } else {
              *p = lo;
            }
          }
        }
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < kAccRegs / 4; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int row = m0 + 8 * i + 2 * t + e, col = col0 + 8 * h;
        if (row < M && col < N) St::store(static_cast<W*>(out) + static_cast<size_t>(row) * N + col, acc[4 * i + 2 * h + e]);
      }
}

// The epilogue of one finished tile (m_tile; batch rows m0.., features n0..),
// run by the 256 consumer threads: acc[4 i + 2 h + e] is z^T's (feature
// 64 wg + 16 warp + g + 8 h, batch row 8 i + 2 t + e) of the tile.
// Writes the finished tile (acc as in tile_epilogue, already rounded to the 16-bit
// type S) by TMA, through shared memory apart from the ring (which meanwhile holds
// the CTA's next tile): each consumer warpgroup's 64 features x BLOCK_M rows leave in
// BLOCK_M / kStoreRows boxes of kStoreRows rows x 64 features (128-byte swizzle),
// alternating between the warpgroup's two buffers at `staging` + 16 KB x warpgroup.
// Per box, stmatrix .trans writes each 8-row group's transposed 8 x 8 blocks (rows of
// out, 8 features in 16 bytes), then the warpgroup's elected thread stores the box
// (rows >= M and features >= N clipped).  `round` counts the warpgroup's boxes over
// the CTA's tiles (out's and z's alike); a buffer is rewritten once the store that
// last read it has read it (cp.async.bulk.wait_group.read 1, PTX ISA 9.7.9.25.3).  The
// writes themselves are ordered by the grid's end; the CTA waits for the last reads
// before it exits (the kernel's tail).  Each box is one sm90::staged_store_round
// (sm90_primitives.cuh, shared with fp16x3's store_tile_staged) on barrier 3 or 4, one
// per warpgroup, the id a register from the warp-uniform warpgroup index (see the
// kernel's `warpgroup`).
template <typename S, int kBlockM>
__device__ __forceinline__ void store_tile_tma(const float (&acc)[64 * kBlockM / 128], const CUtensorMap* tmap,
                                               uint8_t* staging, int m0, int n0, int& round) {
  constexpr int kGroupsPerBox = kStoreRows / 8;
  const int warpgroup = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);  // warp-uniform
  const int warp = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  const bool elected = threadIdx.x % 128 == 0;
  uint8_t* buffers = staging + warpgroup * (2 * kStoreRows * 128);
  const int j = lane / 8;
  const int chunk = 2 * warp + j % 2;
#pragma unroll
  for (int sub = 0; sub < kBlockM / kStoreRows; ++sub, ++round) {
    uint8_t* box = buffers + (round & 1) * (kStoreRows * 128);
    sm90::staged_store_round<1>(
        elected, 3 + warpgroup,
        [&]() {
#pragma unroll
          for (int i = sub * kGroupsPerBox; i < (sub + 1) * kGroupsPerBox; i += 2) {
            uint32_t r[4];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
              const int base = 4 * (i + q / 2) + 2 * (q % 2);
              r[q] = pack2(to_bits<S>(acc[base]), to_bits<S>(acc[base + 1]));
            }
            const int row = 8 * (i - sub * kGroupsPerBox + j / 2) + lane % 8;
            sm90::stmatrix_x4_trans(r, sm90::smem_u32(box) + row * 128 + ((chunk ^ (row % 8)) << 4));
          }
        },
        [&]() { sm90::tma_store_2d(tmap, box, n0 + warpgroup * 64, m0 + sub * kStoreRows); });
  }
}

// This thread's two features' vectors (features n0 + 64 warpgroup + 16 warp + g + 8 h), as
// floats (0 past N): loaded before the tile's mainloop, so their latency is not the
// epilogue's (the loads cannot move past the mainloop's asm, which clobbers memory).
struct FeatureVectors {
  float bias[2], scale[2], w[2], b[2], rm[2], rv[2];  // w .. rv: kEval, kEvalSaved
};

template <typename T, typename S, Chain kChain>
__device__ __forceinline__ FeatureVectors load_feature_vectors(const Args& args, int n0) {
  using St = Storage<S>;
  using W = word_t<S>;
  auto vec = [](const void* p) { return static_cast<const W*>(p); };
  const int f_local = (threadIdx.x / 128) * 64 + ((threadIdx.x / 32) % 4) * 16 + (threadIdx.x % 32) / 4;
  FeatureVectors v{};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int f = n0 + f_local + 8 * h;
    if (f >= args.N) continue;
    v.bias[h] = round16<T>(St::load(vec(args.bias) + f));  // autocast's cast of the bias to T
    v.scale[h] = St::load(vec(args.scale) + f * args.scale_stride);
    if constexpr (is_eval(kChain)) {
      v.w[h] = St::load(vec(args.bn_weight) + f);
      v.b[h] = St::load(vec(args.bn_bias) + f);
      v.rm[h] = St::load(vec(args.running_mean) + f);
      v.rv[h] = St::load(vec(args.running_var) + f);
    }
  }
  return v;
}

// The chain over a tile's values (acc as in tile_epilogue), up to its final rounding
// (the store rounds to S; kTrain's u is already an S value), with the problem's order
// a template argument (no branch per element), over the two batch rows e = 0, 1 of each
// (i, h), which share a feature: lowp_chain.cuh's pair forms where S is float16 (one
// packed conversion per pair, mul.rn.f16x2 for the scale: 7-8% fewer instructions in
// the kernel, ptxas sizes), its scalar forms otherwise (for bfloat16 and float storage
// the pair forms cost more: the scalar forms' conversion pairs fold).  The same values,
// bit for bit.  kZRounded: acc already holds z (the saved chains; its pair is packed
// exactly), else acc + bias is rounded here.
template <typename T, typename S, Chain kChain, bool kScaleAfterBn, bool kZRounded, int kAccRegs>
__device__ __forceinline__ void chain_pairs(float (&acc)[kAccRegs], const FeatureVectors& fv,
                                            const float (&invstd)[2]) {
  if constexpr (!(kZRounded && !is_eval(kChain) && kScaleAfterBn)) {  // else nothing: 84's u is z itself
#pragma unroll
    for (int i = 0; i < kAccRegs; i += 2) {
      const int h = (i / 2) % 2;
      float2 v;
      if constexpr (std::is_same_v<S, __half>) {  // the pair forms
        const uint32_t z2 = kZRounded ? pack2_rn<T>(acc[i], acc[i + 1])
                                      : pack2_rn<T>(acc[i] + fv.bias[h], acc[i + 1] + fv.bias[h]);
        if constexpr (is_eval(kChain)) {
          v = eval_out2<T, S, kScaleAfterBn>(z2, fv.scale[h], fv.w[h], fv.b[h], fv.rm[h], invstd[h]);
        } else {
          v = train_u2<T, S, kScaleAfterBn>(z2, fv.scale[h]);
        }
      } else {  // the scalar forms: fewer instructions here (no mul.rn.f16x2; their conversions fold)
        float* pv = &v.x;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float z = kZRounded ? acc[i + e] : round16<T>(acc[i + e] + fv.bias[h]);
          if constexpr (is_eval(kChain)) {
            pv[e] = eval_out<T, S>(z, fv.scale[h], fv.w[h], fv.b[h], fv.rm[h], invstd[h], kScaleAfterBn);
          } else {
            pv[e] = train_u<S>(z, fv.scale[h], kScaleAfterBn);
          }
        }
      }
      acc[i] = v.x;
      acc[i + 1] = v.y;
    }
  }
}

template <typename T, typename S, Chain kChain, int kBlockM>
__device__ __forceinline__ void tile_epilogue(float (&acc)[64 * kBlockM / 128], const FeatureVectors& fv,
                                              const Args& args, int m_tile, int m0, int n0,
                                              const CUtensorMap* tmap_out, const CUtensorMap* tmap_z,
                                              uint8_t* staging, int& store_round) {
  using TR = Traits<kBlockM>;
  const int M = args.M, N = args.N;
  const int warpgroup = threadIdx.x / 128;
  const int warp = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int f_local = warpgroup * 64 + warp * 16 + g;
  const float(&p_bias)[2] = fv.bias;
  const float(&p_w)[2] = fv.w;
  const float(&p_b)[2] = fv.b;
  const float(&p_rm)[2] = fv.rm;
  float p_invstd[2] = {0.f, 0.f};
  if constexpr (is_eval(kChain)) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (n0 + f_local + 8 * h < N) p_invstd[h] = rsqrtf(fv.rv[h] + args.eps);
  }
  constexpr bool kSaved = kChain == Chain::kTrainSaved || kChain == Chain::kEvalSaved;
  if constexpr (kSaved) {
    // z = rnd(acc + bias), the Linear output (a T value), kept for the backward
    // (T words, whatever S is); then u, or the eval chain's output, from it.
#pragma unroll
    for (int i = 0; i < TR::kAccRegs; i += 2) {
      const float b = p_bias[(i / 2) % 2];
      if constexpr (std::is_same_v<S, __half>) {  // one conversion for the pair (fewer instructions only here)
        const float2 z = round2<T>(acc[i] + b, acc[i + 1] + b);
        acc[i] = z.x;
        acc[i + 1] = z.y;
      } else {
        acc[i] = round16<T>(acc[i] + b);
        acc[i + 1] = round16<T>(acc[i + 1] + b);
      }
    }
    bool z_stored = false;
    if constexpr (kBlockM == kBatchTile) {
      if (args.tma_store_z) {  // z's boxes first, so out's follow at once after the chain
        store_tile_tma<T, kBlockM>(acc, tmap_z, staging, m0, n0, store_round);
        z_stored = true;
      }
    }
    if (!z_stored) store_tile<T, kBlockM>(acc, args.z_out, M, N, m0, n0 + f_local, g, t);
  }
  if (args.scale_after_bn) {
    chain_pairs<T, S, kChain, true, kSaved>(acc, fv, p_invstd);
  } else {
    chain_pairs<T, S, kChain, false, kSaved>(acc, fv, p_invstd);
  }
  if constexpr (kChain == Chain::kEvalSaved) {
    if (m_tile == 0 && t == 0) {  // the first batch tile: the coefficients used, for the backward
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int f = n0 + f_local + 8 * h;
        if (f < N) coeff_store1(args.coeff_out, N, f, make_float4(p_rm[h], p_invstd[h], p_w[h], p_b[h]));
      }
    }
  }

  FUSED_GEMM_BN_LOWP_PHASE(3);
  if constexpr (!is_eval(kChain)) {
    // Per feature and 128-row block: mean, then M2 about it (two passes), float32,
    // over the block's valid rows; each feature's values live in one quad.  A whole
    // block (kFull: every block but the batch's last partial one) takes the same sums
    // without the per-row tests (which ptxas kept as a predicate mask: ~5 instructions a
    // value) and divides by 128 as a multiply by 2^-7 (exact: the same quotient).
    constexpr int kI = kStatRows / 8;  // i per statistics block
    auto block_stats = [&](auto full, int sb, int rows_valid) {
      constexpr bool kFull = decltype(full)::value;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float sum = 0.f;
#pragma unroll
        for (int i = sb * kI; i < (sb + 1) * kI; ++i)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            if (kFull || 8 * (i - sb * kI) + 2 * t + e < rows_valid) sum += acc[4 * i + 2 * h + e];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const float mean = kFull ? sum * (1.f / kStatRows) : sum / static_cast<float>(rows_valid);
        float m2 = 0.f;
#pragma unroll
        for (int i = sb * kI; i < (sb + 1) * kI; ++i)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float d = acc[4 * i + 2 * h + e] - mean;
            if (kFull || 8 * (i - sb * kI) + 2 * t + e < rows_valid) m2 = fmaf(d, d, m2);
          }
        m2 += __shfl_xor_sync(0xffffffffu, m2, 1);
        m2 += __shfl_xor_sync(0xffffffffu, m2, 2);
        const int f = n0 + f_local + 8 * h;
        if (t == 0 && f < N) {
          const size_t row = static_cast<size_t>(m_tile) * TR::kStatBlocks + sb;
          args.part_mean[row * N + f] = mean;
          args.part_m2[row * N + f] = m2;
        }
      }
    };
    static_assert((kStatRows & (kStatRows - 1)) == 0, "1 / kStatRows is exact");
#pragma unroll
    for (int sb = 0; sb < TR::kStatBlocks; ++sb) {
      const int rows_valid = min(kStatRows, M - (m0 + sb * kStatRows));
      if (rows_valid <= 0) break;  // uniform over the CTA
      if (rows_valid == kStatRows) {
        block_stats(std::true_type{}, sb, rows_valid);
      } else {
        block_stats(std::false_type{}, sb, rows_valid);
      }
    }
  }

  FUSED_GEMM_BN_LOWP_PHASE(4);
  if constexpr (sizeof(word_t<S>) == 2 && kBlockM == kBatchTile) {
    if (args.tma_store) {
      store_tile_tma<S, kBlockM>(acc, tmap_out, staging, m0, n0, store_round);
      FUSED_GEMM_BN_LOWP_PHASE(5);
      return;
    }
  }
  store_tile<S, kBlockM>(acc, args.out, M, N, m0, n0 + f_local, g, t);
  FUSED_GEMM_BN_LOWP_PHASE(5);
}

template <typename T, typename S, Chain kChain, int kBlockM, bool kWFloat>
__global__ void __launch_bounds__(Traits<kBlockM, kWFloat>::kNumThreads, 1)
    sm90_gemm_bn_16bit_kernel(const __grid_constant__ CUtensorMap tmap_w, const __grid_constant__ CUtensorMap tmap_x,
                              const __grid_constant__ CUtensorMap tmap_out, const __grid_constant__ CUtensorMap tmap_z,
                              const Args args) {
#if FUSED_GEMM_BN_SM90A
  using TR = Traits<kBlockM, kWFloat>;
  using namespace sm90;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* staging = smem + TR::kNumStages * TR::STAGE_BYTES;  // store_tile_tma's buffers (256-row plans)
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + TR::kNumStages * TR::STAGE_BYTES + TR::STAGING_BYTES);
  uint64_t* empty_bar = full_bar + TR::kNumStages;

  const int m_tiles = (args.M + TR::BLOCK_M - 1) / TR::BLOCK_M;
  const int num_k_blocks = (args.K + TR::BLOCK_K - 1) / TR::BLOCK_K;
  // Warp-uniform (__shfl_sync), so the mainloop's wgmma descriptors, which add the
  // warpgroup's W rows, stay on the uniform datapath: from threadIdx.x / 128, ptxas
  // built them in vector registers (6 R2UR among the wgmmas; 0.986-0.999x the time at
  // 1024 x 8192^2 and 16384 x 4096^2 without them, docs/perf.md v113).
  const int warpgroup = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
  const int cta = static_cast<int>(blockIdx.x);
  const int num_segments = cta_num_segments(args.plan, cta);
  FUSED_GEMM_BN_LOWP_PHASE(0);

  if (threadIdx.x == 0) {
    if (!is_eval(kChain) && blockIdx.x == 0 && args.num_batches_tracked != nullptr)
      *args.num_batches_tracked += 1;
#pragma unroll
    for (int s = 0; s < TR::kNumStages; ++s) {
      mbar_init(&full_bar[s], 1);
      mbar_init(&empty_bar[s], TR::kNumConsumers * 4);
    }
    mbar_init_fence();
  }
  // A batch shorter than the tile: the x tile's rows past the box (sm90_gemm_tiles.cuh).
  if (!TR::kPersistent && args.x_box_rows < TR::BLOCK_M)
    zero_x_rows_past_box<TR::kNumStages, TR::STAGE_BYTES, TR::W_TILE_BYTES, 1, TR::X_TILE_BYTES, TR::BLOCK_M>(
        smem, args.x_box_rows);
  __syncthreads();

  if (warpgroup == TR::kNumConsumers) {
    setmaxnreg_dec<TR::kProducerRegs>();
    if (threadIdx.x == TR::kNumConsumers * 128) {
      tma_prefetch_descriptor(&tmap_w);
      tma_prefetch_descriptor(&tmap_x);
      int q = 0;  // ring slots over the CTA's segments
      for_each_segment<TR::kPersistent>(args.plan, cta, num_segments, num_k_blocks, [&](const WorkSegment& seg) {
        const sm90::TileCoord tc = lowp_tile_coord(args, seg.tile, m_tiles);
        const int m0 = tc.m * TR::BLOCK_M, n0 = tc.n * TR::BLOCK_N;
        for (int kb = seg.kb_begin; kb < seg.kb_end; ++kb, ++q) {
          const int s = q % TR::kNumStages;
          mbar_wait(&empty_bar[s], ((q / TR::kNumStages) & 1) ^ 1);
          uint8_t* stage = smem + s * TR::STAGE_BYTES;
          mbar_arrive_expect_tx(&full_bar[s], TR::kPersistent ? TR::STAGE_BYTES
                                                              : TR::W_TILE_BYTES + args.x_box_rows * TR::BLOCK_K * 2);
          tma_load_2d(stage, &tmap_w, &full_bar[s], kb * TR::BLOCK_K, n0);
          if constexpr (kWFloat)  // float32 w: the k-block's second 32-wide box
            tma_load_2d(stage + TR::W_BOX_BYTES, &tmap_w, &full_bar[s], kb * TR::BLOCK_K + 32, n0);
          tma_load_2d(stage + TR::W_TILE_BYTES, &tmap_x, &full_bar[s], kb * TR::BLOCK_K, m0);
        }
      });
    }
    return;
  }

  setmaxnreg_inc<TR::kConsumerRegs>();
  const int lane = threadIdx.x % 32;

  float acc[TR::kAccRegs];
  auto fence_acc = [&]() {
#pragma unroll
    for (int i = 0; i < TR::kAccRegs; ++i) fence_operand(acc[i]);
  };
  // kWFloat: A fragments of one k-block (kKSteps wgmmas) in two buffers: a
  // k-block's group reads its buffer until the wait_group of the next k-block.
  uint32_t a_frag[2][TR::kKSteps][4] = {};
  auto keep_alive = [&](uint32_t(&a)[TR::kKSteps][4]) {
#pragma unroll
    for (int j = 0; j < TR::kKSteps; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) fence_operand(a[j][r]);
  };
  // Thread (warp, g, t) converts A(row, k) for rows 16 warp + g (+ 8) of its
  // warpgroup's 64 and k = 16 j + 2 t (+ 8) (+ 1): float2 loads from the
  // float32 tile (two boxes of 32 k, 128-byte swizzle: chunk c of row r at
  // c ^ (r % 8), here g), then one cvt to a T pair.  A warp's load covers 16
  // chunks in 8 distinct positions twice: two wavefronts, the minimum.
  const int g = lane / 4, t = lane % 4;
  const uint32_t a_row_bytes = (warpgroup * 64 + ((threadIdx.x / 32) % 4) * 16 + g) * 128;
  auto load_a = [&](uint32_t(&a)[TR::kKSteps][4], uint32_t stage) {
#pragma unroll
    for (int j = 0; j < TR::kKSteps; ++j)
#pragma unroll
      for (int hk = 0; hk < 2; ++hk) {
        const int kk = 16 * j + 8 * hk + 2 * t;  // 0 .. 63
        const uint32_t offset =
            (kk / 32) * TR::W_BOX_BYTES + a_row_bytes + ((((kk % 32) / 4) ^ g) << 4) + (kk % 4) * 4;
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const float2 v = ld_shared_f32x2(stage + offset + hr * 8 * 128);
          a[j][2 * hk + hr] = pack2_rn<T>(v.x, v.y);
        }
      }
  };
  // One k-block (ring slot q) through A buffer kBuf; see the SS loop below for the ring.
  auto step_rs = [&](auto buf_c, int q, bool first) {
    constexpr int kBuf = decltype(buf_c)::value;
    const int s = q % TR::kNumStages;
    mbar_wait(&full_bar[s], (q / TR::kNumStages) & 1);
    if (q == 0) FUSED_GEMM_BN_LOWP_PHASE(1);
    const uint8_t* stage = smem + s * TR::STAGE_BYTES;
    load_a(a_frag[kBuf], smem_u32(stage));
    fence_acc();
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < TR::kKSteps; ++j)
      issue_wgmma_rs<T, kBlockM>(acc, a_frag[kBuf][j],
                                 desc_kmajor_sw128(stage + TR::W_TILE_BYTES, j * TR::WGMMA_K * 2));
    wgmma_commit();
    wgmma_wait<1>();  // the previous k-block's group is done: its stage and A buffer are free
    fence_acc();
    keep_alive(a_frag[kBuf ^ 1]);
    if (!first && lane == 0) mbar_arrive(&empty_bar[(q - 1) % TR::kNumStages]);
  };
  using Buf0 = std::integral_constant<int, 0>;
  using Buf1 = std::integral_constant<int, 1>;

  int q = 0;
  int store_round = 0;  // the staged store boxes so far (store_tile_tma)
  for_each_segment<TR::kPersistent>(args.plan, cta, num_segments, num_k_blocks, [&](const WorkSegment& seg) {
    const sm90::TileCoord tc = lowp_tile_coord(args, seg.tile, m_tiles);
    const FeatureVectors fv = load_feature_vectors<T, S, kChain>(args, tc.n * TR::BLOCK_N);
#pragma unroll
    for (int i = 0; i < TR::kAccRegs; ++i) acc[i] = 0.f;
    if constexpr (kWFloat) {
      int kb = seg.kb_begin;
      for (; kb + 1 < seg.kb_end; kb += 2, q += 2) {
        step_rs(Buf0{}, q, kb == seg.kb_begin);
        step_rs(Buf1{}, q + 1, false);
      }
      if (kb < seg.kb_end) {
        step_rs(Buf0{}, q, kb == seg.kb_begin);
        ++q;
      }
      wgmma_wait<0>();
      fence_acc();
      keep_alive(a_frag[0]);
      keep_alive(a_frag[1]);
      if (lane == 0) mbar_arrive(&empty_bar[(q - 1) % TR::kNumStages]);
      FUSED_GEMM_BN_LOWP_PHASE(2);
    } else {
      for (int kb = seg.kb_begin; kb < seg.kb_end; ++kb, ++q) {
        const int s = q % TR::kNumStages;
        mbar_wait(&full_bar[s], (q / TR::kNumStages) & 1);
        if (q == 0) FUSED_GEMM_BN_LOWP_PHASE(1);
        const uint8_t* stage = smem + s * TR::STAGE_BYTES;
        fence_acc();
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < TR::kKSteps; ++j) {
          const uint32_t k_bytes = j * TR::WGMMA_K * 2;
          issue_wgmma<T, kBlockM>(acc, desc_kmajor_sw128(stage + warpgroup * 64 * 128, k_bytes),
                                  desc_kmajor_sw128(stage + TR::W_TILE_BYTES, k_bytes));
        }
        wgmma_commit();
        wgmma_wait<1>();  // the previous slot's group is done: release its stage
        fence_acc();
        if (kb > seg.kb_begin && lane == 0) mbar_arrive(&empty_bar[(q - 1) % TR::kNumStages]);
      }
      wgmma_wait<0>();
      fence_acc();
      if (lane == 0) mbar_arrive(&empty_bar[(q - 1) % TR::kNumStages]);
      FUSED_GEMM_BN_LOWP_PHASE(2);
    }
    if constexpr (kBlockM == sm90::kTileM) {
      if (seg.piece >= 0 && !split_tile_hand_off(acc, args.plan, args.partials, args.tile_arrivals, seg,
                                                    static_cast<int>(threadIdx.x))) return;
    }
    const int m_tile = tc.m;
    const int m0 = m_tile * TR::BLOCK_M, n0 = tc.n * TR::BLOCK_N;
    tile_epilogue<T, S, kChain, kBlockM>(acc, fv, args, m_tile, m0, n0, &tmap_out, &tmap_z, staging, store_round);
  });
  if constexpr (TR::kPersistent) {
    if (threadIdx.x % 128 == 0) tma_store_wait_read<0>();  // the last boxes read before shared memory goes
  }
  FUSED_GEMM_BN_LOWP_PHASE(6);
#elif defined(__CUDA_ARCH__)
  __trap();  // this kernel exists only in sm_90a images; the dispatch never selects it elsewhere
#endif
}

// The batch tile and the split for this shape on the current device (lowp_grid_plan,
// heuristics_sm90.cuh); cudaErrorInvalidConfiguration where the tiles overflow an int.
static cudaError_t grid_plan(int M, int N, int K, sm90::LowpGridPlan* out) {
  DeviceFacts facts;
  const cudaError_t err = current_device_facts(&facts);
  if (err != cudaSuccess) return err;
  *out = sm90::lowp_grid_plan(M, N, K, Traits<kSmallBatchTile>::BLOCK_K, facts.num_sms);
  return out->plan.dp_tiles < 0 ? cudaErrorInvalidConfiguration : cudaSuccess;
}

template <typename T, typename S, Chain kChain, int kBlockM, bool kWFloat>
static cudaError_t launch(Args args, const sm90::StreamKPlan& plan, const void* x, const void* w, float* workspace,
                          cudaStream_t stream) {
  using TR = Traits<kBlockM, kWFloat>;
  auto kernel = sm90_gemm_bn_16bit_kernel<T, S, kChain, kBlockM, kWFloat>;
  CUtensorMap tmap_w, tmap_x;
  args.x_box_rows = TR::kPersistent ? TR::BLOCK_M : sm90::x_box_rows(args.M, TR::BLOCK_M);
  if (!sm90::make_tensor_map(&tmap_w, w, kWFloat ? sm90::TileDtype::kFloat32 : sm90::TileDtype::kWord16, args.N,
                             args.K, TR::BLOCK_N) ||
      !sm90::make_tensor_map(&tmap_x, x, sm90::TileDtype::kWord16, args.M, args.K, args.x_box_rows))
    return cudaErrorInvalidValue;
  CUtensorMap tmap_out = {};
  args.tma_store = sizeof(word_t<S>) == 2 && kBlockM == kBatchTile &&
                   sm90::make_tensor_map(&tmap_out, args.out, sm90::TileDtype::kWord16, args.M, args.N, kStoreRows);
  CUtensorMap tmap_z = {};  // z_out is T words whatever S is
  args.tma_store_z = args.z_out != nullptr && kBlockM == kBatchTile &&
                     sm90::make_tensor_map(&tmap_z, args.z_out, sm90::TileDtype::kWord16, args.M, args.N, kStoreRows);
  if (plan.sk_ctas > 0 && workspace == nullptr) return cudaErrorInvalidValue;
  args.plan = plan;
  args.grouped_order = sm90::grouped_tile_order(args.M, kBlockM);
  args.partials = workspace;
  args.tile_arrivals = plan.sk_ctas > 0 ? reinterpret_cast<int*>(workspace + sm90::partial_floats(plan)) : nullptr;
  constexpr int kMaxDevices = 64;
  static bool smem_set[kMaxDevices] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device >= kMaxDevices || !smem_set[device]) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, TR::SMEM_BYTES);
    if (err != cudaSuccess) return err;
    if (device < kMaxDevices) smem_set[device] = true;
  }
  long long ctas = static_cast<long long>(plan.sk_ctas) + plan.dp_tiles;
  if (ctas > INT32_MAX) return cudaErrorInvalidConfiguration;
  if constexpr (TR::kPersistent) {  // 256-row plans have whole tiles only (sk_ctas == 0)
    DeviceFacts facts;
    err = current_device_facts(&facts);
    if (err != cudaSuccess) return err;
    ctas = std::min<long long>(ctas, facts.num_sms);
  }
  kernel<<<static_cast<unsigned>(ctas), TR::kNumThreads, TR::SMEM_BYTES, stream>>>(tmap_w, tmap_x, tmap_out, tmap_z,
                                                                                     args);
  return cudaGetLastError();
}

template <typename T, typename S, Chain kChain, bool kWFloat = false>
static cudaError_t launch_planned(const Args& args, const void* x, const void* w, float* workspace,
                                  cudaStream_t stream) {
  sm90::LowpGridPlan gp;
  const cudaError_t err = grid_plan(args.M, args.N, args.K, &gp);
  if (err != cudaSuccess) return err;
  return gp.block_m == kBatchTile
             ? launch<T, S, kChain, kBatchTile, kWFloat>(args, gp.plan, x, w, workspace, stream)
             : launch<T, S, kChain, kSmallBatchTile, kWFloat>(args, gp.plan, x, w, workspace, stream);
}

template <typename T, typename S>
static cudaError_t launch_for_storage(const Args& args, bool train, const void* x, const void* w, float* workspace,
                                      cudaStream_t stream) {
  if (train && args.z_out != nullptr) return launch_planned<T, S, Chain::kTrainSaved>(args, x, w, workspace, stream);
  if (!train && args.z_out != nullptr) {  // the eval forward with gradients: 16-bit modules only
    if constexpr (std::is_same_v<S, T>) return launch_planned<T, S, Chain::kEvalSaved>(args, x, w, workspace, stream);
    return cudaErrorInvalidValue;
  }
  return train ? launch_planned<T, S, Chain::kTrain>(args, x, w, workspace, stream)
               : launch_planned<T, S, Chain::kEval>(args, x, w, workspace, stream);
}

// w_float32: w is float32 (the autocast form only, without z_out), cast to T in the kernel.
template <typename T>
static cudaError_t launch_for_type(const Args& args, bool train, bool float32_io, bool w_float32, const void* x,
                                   const void* w, float* workspace, cudaStream_t stream) {
  if (w_float32) {
    if (!float32_io || (train && args.z_out != nullptr)) return cudaErrorInvalidValue;
    return train ? launch_planned<T, float, Chain::kTrain, true>(args, x, w, workspace, stream)
                 : launch_planned<T, float, Chain::kEval, true>(args, x, w, workspace, stream);
  }
  return float32_io ? launch_for_storage<T, float>(args, train, x, w, workspace, stream)
                  : launch_for_storage<T, T>(args, train, x, w, workspace, stream);
}

}  // namespace hopper
}  // namespace lowp
}  // namespace fused_gemm_bn

// ---------------------------------------------------------------------------
// Host launcher (declared in launchers.cuh)
// ---------------------------------------------------------------------------

// Workspace of lowp_sm90_gemm_bn for an (M, K) x (N, K) product: *floats
// floats, of which the last *zero_ints ints must be zero at the launch (both 0
// when no tile is split).
void fused_gemm_bn::lowp_sm90_workspace(int M, int N, int K, int64_t* floats, int* zero_ints) {
  using namespace fused_gemm_bn::lowp;
  *floats = 0;
  *zero_ints = 0;
  sm90::LowpGridPlan gp;
  if (M < 1 || N < 1 || hopper::grid_plan(M, N, K, &gp) != cudaSuccess || gp.plan.sk_ctas == 0) return;
  *floats = sm90::partial_floats(gp.plan) + gp.plan.sk_tiles;
  *zero_ints = gp.plan.sk_tiles;
}

// As lowp_gemm_bn, on the Hopper kernel: x, w 16-byte aligned, K % 8 == 0, K >= 8,
// compute capability 9.0 with this build's sm_90a image (the dispatch checks;
// cudaErrorInvalidValue otherwise); workspace: lowp_sm90_workspace's.
cudaError_t fused_gemm_bn::lowp_sm90_gemm_bn(const LowpBatchNormArgs& bn, bool train, bool w_float32, const void* x,
                                             const void* w, void* out, int M, int N, int K, float* part_mean,
                                             float* part_m2, void* z_out, float* coeff_out, float* workspace,
                                             cudaStream_t stream) {
  using namespace fused_gemm_bn::lowp;
  if (M == 0 || N == 0) return cudaSuccess;
  if (M < 0 || N < 0 || K < 8 || K % 8 != 0 || !sm90::aligned16(x) || !sm90::aligned16(w))
    return cudaErrorInvalidValue;
  hopper::Args args{};
  args.M = M;
  args.N = N;
  args.K = K;
  args.out = out;
  args.bias = bn.bias;
  args.scale = bn.scale;
  args.scale_stride = bn.scale_stride;
  args.bn_weight = train ? nullptr : bn.bn_weight;  // the other mode's fields stay null / 0
  args.bn_bias = train ? nullptr : bn.bn_bias;
  args.running_mean = train ? nullptr : bn.running_mean;
  args.running_var = train ? nullptr : bn.running_var;
  args.eps = train ? 0.f : bn.eps;
  args.scale_after_bn = bn.scale_after_bn;
  args.part_mean = part_mean;
  args.part_m2 = part_m2;
  args.num_batches_tracked = train ? bn.num_batches_tracked : nullptr;
  args.z_out = z_out;
  args.coeff_out = train ? nullptr : coeff_out;
  if (!train && (z_out == nullptr) != (coeff_out == nullptr)) return cudaErrorInvalidValue;
  return dispatch_dtype(bn.dtype, [&](auto t) {
    return hopper::launch_for_type<typename decltype(t)::type>(args, train, bn.float32_io, w_float32, x, w,
                                                               workspace, stream);
  });
}
