// sm90_gemm_fp16x3_bn.cu -- float32-accurate GEMM on Hopper's 16-bit tensor
// cores (fp16x3 through wgmma, TMA, warp specialisation) with the BatchNorm
// epilogues of sm90_gemm_tiles.cuh.  Needs sm_90a (H100 / H200); other GPUs
// take sm80_gemm_3xtf32_bn.cu.
//
// Formula: z[m, n] = sum_k x[m, k] * w[n, k] (z = x @ W^T, no bias), then the
// epilogues of sm90_gemm_tiles.cuh (kTrain: out = z and per-tile mean / M2;
// kEval: out = a[n] z + c[n]; kPlain: out = z, grad W's through the staged TMA
// stores, store_tile_staged).
//
// Tensors (row-major, contiguous, 16-byte aligned; K here is the parts' row
// length, a multiple of 8: TMA needs 16-byte global strides of the 16-bit parts.
// The forwards run over K_pad = fp16x3_padded_k(in_features), the pre-pass
// having zeroed columns in_features .. K_pad - 1 of both operands: their
// products are exact zeros, and the k-block count ceil(K / 64) is unchanged)
//   w_hi, w_lo   (N, K) fp16 words, K-major: W's parts scaled by 2^e_n (prepass_fp16x3.cu
//                run over W's rows; model_new.py caches them per weight)
//   w_inv_scale  (N) fp32: 2^-e_n;  w_row_sum (N) fp32 (hi, lo): sum_k w[n, k]
//   x_hi, x_lo   (M, K) fp16 words, K-major: x's rows minus their centre c_m,
//                scaled by 2^e_m (the same pre-pass)
//   x_inv_scale  (M) fp32: 2^-e_m;  x_center (M) fp32: c_m
//   out (M, N);  part_mean, part_m2 (ceil(M / 128), N);  vectors (N)
//
// Why fp16: Hopper's dense fp16 tensor-core rate is twice its TF32 rate, so
// three fp16 products cost what 1.5 TF32 products do (the retired 3xTF32
// wgmma kernel: 947 us at M = 1024, K = N = 8192 on an H200, against one
// cuBLAS fp16 product with fp32 output at 196 us).
//
// Numerics (fp16x3_split.cuh derives the split; Ootomo & Yokota, IJHPCA 2022)
//   Centring (prepass_fp16x3.cu): x's row m is split as x - c_m (c_m its mean,
//   rounded to nearest: unbiased) and the epilogue adds c_m sum_k w[n, k] back
//   (the sum from float64, as an fp32 pair), so the products below carry only
//   what varies between rows; the truncation bias they keep then has no common
//   sign across the batch (see the bias note below).
//   Each row r of either operand: v = (v_hi + v_lo) 2^-e_r, e_r from
//   max_k |v[r, k]| (the row's max lands in [2^14, 2^15)), v_hi = rn_fp16(v 2^e_r),
//   v_lo = rn_fp16(v 2^e_r - v_hi): representation error <= 2^-22 |v| (round to
//   nearest, unbiased) for elements above the fp16 subnormal range of v_lo.
//   Per span of SPAN_K = 32 k, one commit group into the register tile `part`
//   (wgmma: exact fp16 products, fp32 accumulation):
//     part += w_hi x_lo + w_lo x_hi  (first: the small products while |part| is small)
//           + w_hi x_hi
//   and after every span, acc += part with one round-to-nearest add:
//   DeepGEMM's promotion of FP8 partial sums.  The tensor core's own
//   accumulation truncates (biased towards zero); promoting often bounds what
//   it loses (emulated with cuBLAS fp16 products at 1024 x 8192 x 8192: 2.45e-7
//   relative with promotion every 64 k against eager SGEMM's 1.62e-6, 9.7e-6
//   with no promotion).  The bias shows in per-feature means over the batch
//   when rows share a level: running_mean after 5 training calls on uniform
//   inputs was 3.1x eager's error with promotion every 64 k, 1.3x every 32 k
//   (v20); with centring the mean of z over the batch is 10x closer to float64
//   than eager's (docs/perf.md, v21).  Dropped: w_lo x_lo (< 2^-22 |w x|).
//   Finally z = fma(c_m, hi_n, fma(c_m, lo_n, (acc 2^-e_n) 2^-e_m)) (two exact
//   scalings, then the centre's share: one rounding of z, one of the lo term).
//   Measured (H200, gemm_nt against float64, rel. Frobenius): 3.0e-7 at
//   1024 x 8192 x 8192 (eager 1.62e-6, 3xTF32 3.6e-7); 0.2-0.5x eager's error
//   over the sweep's shapes (docs/perf.md, v20).
//   Range: acc holds z 2^(e_n + e_m) <= K 2^30 in magnitude (no overflow for
//   K < 2^97).  Elements below 2^-38 of their row's max have no fp16 parts
//   (their share of |w| |x| is below 2^-38); a row with one huge element thus
//   loses its small ones, which matters only if x is tiny exactly where that
//   element sits.
//   Non-finite inputs: an Inf in x's row m or w's row n gives NaN (Inf - Inf in
//   the split; such x rows are not centred), so z is non-finite wherever
//   Model's is (and NaN where Model has +-Inf).  Rows of x with max >= 2^32 are
//   not centred (c_m = 0), so |c_m hi_n| overflows only for W rows summing
//   beyond 2^95.
//
// Structure (PTX ISA 9.7.15 wgmma, 9.7.9.25.5 cp.async.bulk.tensor, 9.7.9.23 ldmatrix)
//   CTA tile BLOCK_N (features) x BLOCK_M (batch) = 128 x 128, BLOCK_K = 64,
//   the tile of sm90_gemm_tiles.cuh (swapped product z^T = W x^T: w is operand
//   A from registers, x operand B from shared memory).  Warpgroups 0, 1:
//   consumers, 64 features each over the whole batch tile (wgmma m64n128k16;
//   two m64n64k16 halves, 12 wgmmas per span, were 5-7% slower: docs/perf.md
//   v37).  Per span: wait_group 1 (the group before the previous one, the
//   last reader of this span's A buffer), ldmatrix the span's w_hi / w_lo A
//   fragments (4 ldmatrix.x4 per warp), wait_group 0 and the promotion (the
//   other consumer warpgroup's groups keep the tensor cores busy meanwhile),
//   then issue the span's 6 wgmmas as one group.  One group outstanding at
//   the loop's back edge: with wait_group 1 at per-half promotions ptxas
//   serialised every wgmma (warning C7514; the
//   v19 kernel).  Warpgroup 2: producer; one thread issues the TMA loads (w_hi,
//   w_lo, x_hi, x_lo: 16 KB each) into a ring of kNumStages 64 KB stages.  Grid
//   and split tiles: sm90_gemm_tiles.cuh (StreamKPlan, per 64-k block): one work
//   unit per tile, M tiles fastest, so the units sharing a w tile run together
//   and w is read from DRAM about once; the remainder tiles are split along K.
//   One CTA per unit, or, where tiles are short in k (persistent_grid_pays, heuristics_sm90.cuh),
//   one CTA per SM looping over units blockIdx.x, + gridDim.x, ...: the
//   producer's ring slot count q runs on across them.  A product with K-major x whose
//   batch is shorter than BLOCK_M (the forwards, eval's z, the backward's grad x) runs the
//   kShortX instantiation: x's boxes bring only the batch's rows (rounded up to 8), the
//   rest of the x tiles zeroed once (below).
//
// Whether this kernel runs is model_new.py's dispatch decision (compute
// capability 9.0 and sm90_gemm_available()); launchers given inputs outside
// their preconditions return cudaErrorInvalidValue, launching nothing.

#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "device_facts.cuh"
#include "fp16x3_split.cuh"
#include "heuristics_sm90.cuh"
#include "launchers.cuh"
#include "sm90_gemm_tiles.cuh"

namespace fused_gemm_bn {
namespace sm90 {

struct Fp16x3Traits {
  static constexpr int BLOCK_N = 128;  // features per CTA (wgmma M, over the consumer warpgroups)
  static constexpr int BLOCK_M = 128;  // batch rows per CTA (wgmma N)
  static constexpr int BLOCK_K = 64;   // one 128-byte swizzle row of fp16: two spans
  static constexpr int WGMMA_M = 64;
  static constexpr int WGMMA_N = 128;  // the whole batch tile per wgmma
  static constexpr int WGMMA_K = 16;
  static constexpr int SPAN_K = 32;    // k per A-fragment buffer (one commit group)
  static constexpr int kSpanSteps = SPAN_K / WGMMA_K;  // wgmma k-steps per span
  static constexpr int kNumConsumers = BLOCK_N / WGMMA_M;
  static constexpr int kNumThreads = 128 * (kNumConsumers + 1);
  static constexpr int kNumStages = 3;
  static constexpr int kAccRegs = WGMMA_M * BLOCK_M / 128;
  static constexpr int kPartRegs = WGMMA_M * WGMMA_N / 128;
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  static constexpr int W_PART_BYTES = BLOCK_N * BLOCK_K * 2;  // one fp16 part of the w tile
  static constexpr int X_PART_BYTES = BLOCK_M * BLOCK_K * 2;
  static constexpr int STAGE_BYTES = 2 * W_PART_BYTES + 2 * X_PART_BYTES;  // w_hi, w_lo, x_hi, x_lo
  static constexpr int SMEM_BYTES = kNumStages * STAGE_BYTES + 2 * kNumStages * 8 + 1024;
  // Whether an instantiation stores its tiles through store_tile_staged: grad W's
  // product (kPlain, both operands MN-major), whose k is the batch, so that at small
  // batches the tile's epilogue is most of its time (docs/perf.md v112).  The plain
  // products with long k (grad x, eval's z) keep finish_tile's stores: with the staged
  // path's code their mainloop measured slower (grad x at 1024 x 8192^2: 1.14x).
  __host__ __device__ static constexpr bool staged_store(Epilogue e, bool w_mn, bool x_mn) {
    return e == Epilogue::kPlain && w_mn && x_mn;
  }
  // The staged stores' buffers after the barriers, on a 1024-byte boundary (128-byte swizzle).
  static constexpr int STAGING_OFFSET = kNumStages * STAGE_BYTES + 1024;
  static constexpr int SMEM_BYTES_STAGED = STAGING_OFFSET + kStagingBytes + 1024;
  static constexpr int smem_bytes(bool staged) { return staged ? SMEM_BYTES_STAGED : SMEM_BYTES; }
  static constexpr int MN_BOX_BYTES = kMnBoxRows * kMnBoxK * 2;  // one MN-major TMA box: 64 rows x 64 k

  static_assert(BLOCK_K * 2 == 128, "tiles are rows of one 128-byte swizzle span");
  static_assert(BLOCK_K == 2 * SPAN_K, "a stage holds two spans");
  static_assert(WGMMA_N == BLOCK_M && kPartRegs == kAccRegs, "one m64n128k16 over the batch tile");
  static_assert(W_PART_BYTES % 1024 == 0 && X_PART_BYTES % 1024 == 0, "tiles start on 1024-byte swizzle atoms");
  static_assert(kMnBoxK == BLOCK_K && 2 * kMnBoxRows == BLOCK_N && 2 * kMnBoxRows == BLOCK_M &&
                    kMnBoxRows == WGMMA_M && MN_BOX_BYTES == kMnBoxRows * 128,
                "an MN-major part tile is two boxes: one per consumer warpgroup (w) or batch half (x)");
  static_assert(kNumConsumers * 128 * kConsumerRegs + 128 * kProducerRegs <= 65536, "register file");
  static_assert(2 * kNumStages * 8 <= 1024 && SMEM_BYTES_STAGED + 16 <= 232448,
                "the barriers before the staging buffers; 227 KB of shared memory per block (the hand-off's static int too)");
  static_assert(BLOCK_N == kTileN && BLOCK_M == kTileM && kAccRegs == kTileAccRegs &&
                    kNumConsumers * 128 == kConsumerThreads,
                "the tile of sm90_gemm_tiles.cuh (its epilogues and split-tile hand-off)");
};

// kWMn / kXMn: the w / x operand is MN-major (stored (K, rows), TMA boxes of
// 64 rows x 64 k, make_tensor_map_mn) instead of K-major (stored (rows, K)).
// kGroupedOrder: the tile order (sm90_gemm_tiles.cuh, tile_coord).  kPersistent:
// the grid's walk over the work units (for_each_segment; persistent_grid_pays).
// kShortX (K-major x, a batch shorter than BLOCK_M): x's boxes bring
// args.x_box_rows rows and x_hi's and x_lo's rows past them are zeroed once at the CTA's
// start (sm90_gemm_tiles.cuh, "Short x boxes"; docs/perf.md v110).  A separate
// instantiation, so the other kernels' code is unchanged.
template <Epilogue kEpilogue, bool kWMn, bool kXMn, bool kGroupedOrder, bool kPersistent, bool kShortX = false>
__global__ void __launch_bounds__(Fp16x3Traits::kNumThreads, 1)
    sm90_gemm_fp16x3_bn_kernel(const __grid_constant__ CUtensorMap tmap_w_hi,
                               const __grid_constant__ CUtensorMap tmap_w_lo,
                               const __grid_constant__ CUtensorMap tmap_x_hi,
                               const __grid_constant__ CUtensorMap tmap_x_lo, const Sm90GemmBnArgs args,
                               const __grid_constant__ CUtensorMap tmap_out) {
#if FUSED_GEMM_BN_SM90A
  using T = Fp16x3Traits;
  extern __shared__ uint8_t smem_raw[];
  // 128-byte swizzle atoms must start on 1024-byte boundaries.
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + T::kNumStages * T::STAGE_BYTES);
  uint64_t* empty_bar = full_bar + T::kNumStages;

  const int M = args.M;
  const int m_tiles = (M + T::BLOCK_M - 1) / T::BLOCK_M;
  const int num_k_blocks = (args.K + T::BLOCK_K - 1) / T::BLOCK_K;
  const int warpgroup = threadIdx.x / 128;
  // Unit cta's segment count, here before the warpgroups split as the
  // one-CTA-per-unit kernels always had it (their SASS is unchanged by the
  // persistent walk); for_each_segment<true> counts per unit instead.
  const int cta = static_cast<int>(blockIdx.x);
  const int num_segments = cta_num_segments(args.plan, cta);

  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < T::kNumStages; ++s) {
      mbar_init(&full_bar[s], 1);
      mbar_init(&empty_bar[s], T::kNumConsumers * 4);
    }
    mbar_init_fence();
  }
  if constexpr (kShortX) {
    static_assert(!kXMn, "K-major x boxes");
    zero_x_rows_past_box<T::kNumStages, T::STAGE_BYTES, 2 * T::W_PART_BYTES, 2, T::X_PART_BYTES, T::BLOCK_M>(
        smem, args.x_box_rows);
  }
  __syncthreads();

  if (warpgroup == T::kNumConsumers) {
    // Producer warpgroup: one thread streams the k-blocks of every segment
    // through the ring; `q` counts ring slots over the whole CTA.
    setmaxnreg_dec<T::kProducerRegs>();
    if (threadIdx.x == T::kNumConsumers * 128) {
      tma_prefetch_descriptor(&tmap_w_hi);
      tma_prefetch_descriptor(&tmap_w_lo);
      tma_prefetch_descriptor(&tmap_x_hi);
      tma_prefetch_descriptor(&tmap_x_lo);
      int q = 0;
      for_each_segment<kPersistent>(args.plan, cta, num_segments, num_k_blocks, [&](const WorkSegment& seg) {
        const TileCoord tc = tile_coord<kGroupedOrder>(seg.tile, m_tiles, args.N);
        const int m0 = tc.m * T::BLOCK_M, n0 = tc.n * T::BLOCK_N;
        for (int kb = seg.kb_begin; kb < seg.kb_end; ++kb, ++q) {
          const int s = q % T::kNumStages;
          mbar_wait(&empty_bar[s], ((q / T::kNumStages) & 1) ^ 1);
          uint8_t* stage = smem + s * T::STAGE_BYTES;
          mbar_arrive_expect_tx(&full_bar[s], kShortX ? 2 * T::W_PART_BYTES + 2 * args.x_box_rows * 128
                                                      : T::STAGE_BYTES);
          const int k0 = kb * T::BLOCK_K;
          // One part tile: a K-major box of 128 rows, or two MN-major boxes of 64 rows.
          auto load_part = [&](uint8_t* dst, const CUtensorMap* map, int r0, auto mn_c) {
            if constexpr (decltype(mn_c)::value) {
              tma_load_2d(dst, map, &full_bar[s], r0, k0);
              tma_load_2d(dst + T::MN_BOX_BYTES, map, &full_bar[s], r0 + kMnBoxRows, k0);
            } else {
              tma_load_2d(dst, map, &full_bar[s], k0, r0);
            }
          };
          using WMn = std::integral_constant<bool, kWMn>;
          using XMn = std::integral_constant<bool, kXMn>;
          load_part(stage, &tmap_w_hi, n0, WMn{});
          load_part(stage + T::W_PART_BYTES, &tmap_w_lo, n0, WMn{});
          load_part(stage + 2 * T::W_PART_BYTES, &tmap_x_hi, m0, XMn{});
          load_part(stage + 2 * T::W_PART_BYTES + T::X_PART_BYTES, &tmap_x_lo, m0, XMn{});
        }
      });
    }
    return;
  }

  setmaxnreg_inc<T::kConsumerRegs>();
  const int warp = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  const int t = lane % 4;
  const int w_row = warpgroup * T::WGMMA_M + warp * 16 + lane / 4;  // this thread's first A row in the w tile
  // ldmatrix: lane l gives the address of row (l % 8) + 8 ((l / 8) % 2) of the
  // warp's 16 rows, 16-byte chunk l / 16 of the k-step (the A fragment order).
  const int ld_row = warpgroup * T::WGMMA_M + warp * 16 + (lane % 8) + 8 * ((lane / 8) % 2);
  const int ld_chunk = lane / 16;
  // MN-major w (ldmatrix .trans): lane l gives k-row (l % 8) + 8 (l / 16) of the
  // k-step, 16-byte chunk 2 warp + (l / 8) % 2 (the warp's 16 rows) of its
  // warpgroup's 64-row box; k % 8 == l % 8 picks the swizzle.
  const int mn_k = (lane % 8) + 8 * (lane / 16);
  const uint32_t mn_offset =
      warpgroup * T::MN_BOX_BYTES + mn_k * 128 + (((2 * warp + (lane / 8) % 2) ^ (lane % 8)) << 4);

  float acc[T::kAccRegs];
  float part[T::kPartRegs];
  // w's fp16 parts of one span (32 k) in the A-fragment layout:
  // [buffer][k-step][hi, lo][reg].  Two buffers, one per span of a stage: the
  // previous span's wgmmas still read theirs while the next is loaded.
  uint32_t a_frag[2][T::kSpanSteps][2][4];
  // The lambdas take `q`, the ring slot counter (stage q % kNumStages, mbarrier
  // phase q / kNumStages), which runs on over all segments of the CTA.  Span
  // `sub` (0, 1) of slot q: k-steps kSpanSteps * sub + j of the stage's tiles;
  // its A fragments live in buffer `sub`.
  auto load_a = [&](uint32_t(&a)[T::kSpanSteps][2][4], int q, int sub) {
    const uint32_t w_hi = smem_u32(smem + (q % T::kNumStages) * T::STAGE_BYTES);
#pragma unroll
    for (int j = 0; j < T::kSpanSteps; ++j) {
      if constexpr (kWMn) {
        const uint32_t offset = mn_offset + (sub * T::kSpanSteps + j) * T::WGMMA_K * 128;  // 128 bytes per k
        ldmatrix_x4_trans(a[j][0], w_hi + offset);
        ldmatrix_x4_trans(a[j][1], w_hi + T::W_PART_BYTES + offset);
      } else {
        const int chunk = (sub * T::kSpanSteps + j) * (T::WGMMA_K / 8) + ld_chunk;  // 8 fp16 per 16-byte chunk
        const uint32_t offset = ld_row * 128 + ((chunk ^ (ld_row % 8)) << 4);       // 128-byte swizzle
        ldmatrix_x4(a[j][0], w_hi + offset);
        ldmatrix_x4(a[j][1], w_hi + T::W_PART_BYTES + offset);
      }
    }
  };
  // The 6 wgmmas of one span (m64n128k16: the whole batch tile) as one commit
  // group: the small products first, while |part| is small (the tensor core's
  // truncating adds lose in proportion to the running |part|), then the big
  // one.  The span's first wgmma overwrites `part` (the promotion before it
  // emptied it).
  auto issue_span = [&](const uint32_t(&a)[T::kSpanSteps][2][4], int q, int sub) {
    // x's parts: 128 batch rows, 16 KB each (K-major: 128 rows of 128 bytes;
    // MN-major: two boxes of 64 rows, MN_BOX_BYTES apart).
    const uint8_t* x_hi = smem + (q % T::kNumStages) * T::STAGE_BYTES + 2 * T::W_PART_BYTES;
    const uint8_t* x_lo = x_hi + T::X_PART_BYTES;
    // B descriptor of k-step j of this span.
    auto desc_b = [&](const uint8_t* tile, int j) {
      const int k_step = sub * T::kSpanSteps + j;
      if constexpr (kXMn) return desc_mnmajor_sw128(tile, k_step * T::WGMMA_K * 128, T::MN_BOX_BYTES);
      else return desc_kmajor_sw128(tile, k_step * T::WGMMA_K * 2);
    };
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < T::kSpanSteps; ++j) {
      wgmma_m64n128k16_f16_rs<kXMn>(part, a[j][0], desc_b(x_lo, j), j != 0);
      wgmma_m64n128k16_f16_rs<kXMn>(part, a[j][1], desc_b(x_hi, j), true);
    }
#pragma unroll
    for (int j = 0; j < T::kSpanSteps; ++j) wgmma_m64n128k16_f16_rs<kXMn>(part, a[j][0], desc_b(x_hi, j), true);
    wgmma_commit();
  };
  // acc += part, round to nearest (the promotion).
  auto promote = [&]() {
#pragma unroll
    for (int i = 0; i < T::kPartRegs; ++i) {
      fence_operand(part[i]);  // read only after the wgmma wait
      acc[i] += part[i];
      fence_operand(acc[i]);  // add before the next wgmma overwrites part
    }
  };
  auto keep_alive = [&](uint32_t(&a)[T::kSpanSteps][2][4]) {
#pragma unroll
    for (int j = 0; j < T::kSpanSteps; ++j)
#pragma unroll
      for (int p = 0; p < 2; ++p)
#pragma unroll
        for (int r = 0; r < 4; ++r) fence_operand(a[j][p][r]);
  };
  // Span `sub` of ring slot q.  On entry the previous span's group may be in
  // flight; wait<1> retires the one before it, the last reader of buffer `sub`.  Then the
  // previous span's partial sums are added to acc (wait<0>: this warpgroup's
  // tensor pipe drains once per span; the other warpgroup's groups keep the
  // tensor cores busy meanwhile; promoting only every 64 k (v20a) was 5%
  // faster but tripled running_mean's error, docs/perf.md).  One group outstanding at
  // the loop's back edge and the full drain at the promotion: with wait<1>
  // promotions ptxas serialises every wgmma (warning C7514).  `sub` is a
  // compile-time constant, so the register arrays are never indexed at run time.
  //   Slot q - 1 is released after the wait<0>, when its last reader (the
  // previous span's group, whose wgmmas read its x tiles) has retired.
  // Promoting every 64 k instead (span 1 accumulating onto span 0's `part`)
  // measured no faster and failed the small-batch bar (docs/perf.md v37).
  auto span = [&](auto sub_c, int q, int q0) {
    constexpr int kSub = decltype(sub_c)::value;
    if (kSub == 0) mbar_wait(&full_bar[q % T::kNumStages], (q / T::kNumStages) & 1);
    wgmma_wait<1>();
    keep_alive(a_frag[kSub]);
    load_a(a_frag[kSub], q, kSub);
    wgmma_wait<0>();
    if (kSub == 0 && q > q0 && lane == 0) mbar_arrive(&empty_bar[(q - 1) % T::kNumStages]);
    keep_alive(a_frag[kSub ^ 1]);
    promote();
    issue_span(a_frag[kSub], q, kSub);
  };
  using Sub0 = std::integral_constant<int, 0>;
  using Sub1 = std::integral_constant<int, 1>;

  // acc = the sum over the segment's n k-blocks, from ring slot q0 on (scaled
  // by 2^e_n of w and 2^e_m of x: the caller unscales), promoted every span.
  auto mainloop = [&](int q0, int n) {
#pragma unroll
    for (int i = 0; i < T::kAccRegs; ++i) acc[i] = 0.f;
    mbar_wait(&full_bar[q0 % T::kNumStages], (q0 / T::kNumStages) & 1);
    load_a(a_frag[0], q0, 0);
    issue_span(a_frag[0], q0, 0);
    span(Sub1{}, q0, q0);
    for (int q = q0 + 1; q < q0 + n; ++q) {
      span(Sub0{}, q, q0);
      span(Sub1{}, q, q0);
    }
    wgmma_wait<0>();
    keep_alive(a_frag[0]);
    keep_alive(a_frag[1]);
    promote();
    if (lane == 0) mbar_arrive(&empty_bar[(q0 + n - 1) % T::kNumStages]);
  };

  const int ctid = threadIdx.x;  // 0 .. 255 over the consumer warpgroups
  int q = 0;
  constexpr bool kStagedStore = T::staged_store(kEpilogue, kWMn, kXMn);
  int store_round = 0;  // store_tile_staged's count
  for_each_segment<kPersistent>(args.plan, cta, num_segments, num_k_blocks, [&](const WorkSegment& seg) {
    const int n_blocks = seg.kb_end - seg.kb_begin;
    // Grad W's scales loaded ahead of the products, off the tile's serial chain (v113).
    TileScales scales;
    if constexpr (kStagedStore) scales = load_tile_scales<kGroupedOrder>(args, seg.tile, m_tiles, w_row, t);
    mainloop(q, n_blocks);
    q += n_blocks;
    if (seg.piece >= 0 && !split_tile_hand_off(acc, args.plan, args.partials, args.tile_arrivals, seg, ctid))
      return;
    finish_product<kGroupedOrder, kStagedStore>(acc, args, seg.tile, m_tiles, w_row, t, scales);  // scales, centre
    if constexpr (kStagedStore) {
      if (args.out_staged) {
        const TileCoord tc = tile_coord<kGroupedOrder>(seg.tile, m_tiles, args.N);
        store_tile_staged(acc, &tmap_out, smem + T::STAGING_OFFSET, tc.m * T::BLOCK_M, tc.n * T::BLOCK_N,
                          store_round);
        return;
      }
    }
    finish_tile<kEpilogue, kGroupedOrder>(acc, args, seg.tile, m_tiles, w_row, t);
  });
  if constexpr (kStagedStore) {
    if (args.out_staged && threadIdx.x % 128 == 0) tma_store_wait_read<0>();  // shared memory outlives the reads
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // this kernel exists only in sm_90a images; the launcher never selects it elsewhere
#endif
}

// The tensor map of one part: K-major (rows, K) in 128-row boxes, or MN-major (K, rows).
static bool make_part_map(CUtensorMap* map, const uint16_t* part, bool mn_major, int rows, int K, int box_rows) {
  return mn_major ? make_tensor_map_mn(map, part, rows, K)
                  : make_tensor_map(map, part, TileDtype::kWord16, rows, K, box_rows);
}

template <Epilogue kEpilogue, bool kWMn = false, bool kXMn = false>
static cudaError_t launch_fp16x3(Fp16x3Parts x, Fp16x3Parts w, Sm90GemmBnArgs args, float* workspace,
                                 cudaStream_t stream) {
  using T = Fp16x3Traits;
  const bool grouped = grouped_tile_order(args.M, T::BLOCK_M);
  const bool persistent = persistent_grid_pays(args.K, T::BLOCK_K);
  decltype(&sm90_gemm_fp16x3_bn_kernel<kEpilogue, kWMn, kXMn, false, false>) kernels[2][2] = {
      {sm90_gemm_fp16x3_bn_kernel<kEpilogue, kWMn, kXMn, false, false>,
       sm90_gemm_fp16x3_bn_kernel<kEpilogue, kWMn, kXMn, false, true>},
      {sm90_gemm_fp16x3_bn_kernel<kEpilogue, kWMn, kXMn, true, false>,
       sm90_gemm_fp16x3_bn_kernel<kEpilogue, kWMn, kXMn, true, true>}};
  auto kernel = kernels[grouped][persistent];
  // K-major x at a batch shorter than a tile: the kShortX kernels (one batch tile, so
  // batch-fastest order).
  constexpr bool kHasShortX = !kXMn;
  const bool short_x = kHasShortX && args.M < T::BLOCK_M;
  args.x_box_rows = short_x ? x_box_rows(args.M, T::BLOCK_M) : T::BLOCK_M;
  if constexpr (kHasShortX) {
    if (short_x)
      kernel = persistent ? sm90_gemm_fp16x3_bn_kernel<kEpilogue, kWMn, kXMn, false, true, true>
                          : sm90_gemm_fp16x3_bn_kernel<kEpilogue, kWMn, kXMn, false, false, true>;
  }
  CUtensorMap tmap_w_hi, tmap_w_lo, tmap_x_hi, tmap_x_lo, tmap_out{};
  // out through staged TMA stores where the instantiation has them and TMA can address
  // out (N % 4 == 0, 16-byte aligned); else finish_tile's scalar stores.
  constexpr bool kStaged = T::staged_store(kEpilogue, kWMn, kXMn);
  if constexpr (kStaged)
    args.out_staged = make_tensor_map(&tmap_out, args.out, TileDtype::kFloat32, args.M, args.N, kStoreRows);
  if (w.mn_major != kWMn || x.mn_major != kXMn ||
      !make_part_map(&tmap_w_hi, w.hi, kWMn, args.N, args.K, T::BLOCK_N) ||
      !make_part_map(&tmap_w_lo, w.lo, kWMn, args.N, args.K, T::BLOCK_N) ||
      !make_part_map(&tmap_x_hi, x.hi, kXMn, args.M, args.K, args.x_box_rows) ||
      !make_part_map(&tmap_x_lo, x.lo, kXMn, args.M, args.K, args.x_box_rows))
    return cudaErrorInvalidValue;
  // Per instantiation (short x, tile order, grid) and device.
  static bool smem_set[2][2][2][kMaxCachedDevices] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device >= kMaxCachedDevices || !smem_set[short_x][grouped][persistent][device]) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::smem_bytes(kStaged));
    if (err != cudaSuccess) return err;
    if (device < kMaxCachedDevices) smem_set[short_x][grouped][persistent][device] = true;
  }
  DeviceFacts facts;
  err = current_device_facts(&facts);
  if (err != cudaSuccess) return err;
  args.plan = stream_k_plan(args.M, args.N, args.K, T::BLOCK_K, facts.num_sms);
  if (args.plan.sk_ctas > 0 && workspace == nullptr) return cudaErrorInvalidValue;
  args.partials = workspace;
  args.tile_arrivals = args.plan.sk_ctas > 0 ? reinterpret_cast<int*>(workspace + partial_floats(args.plan)) : nullptr;
  args.x_inv_scale = x.inv_scale;
  args.w_inv_scale = w.inv_scale;
  args.x_center = x.center;
  args.w_row_sum = w.row_sum;
  long long ctas = static_cast<long long>(args.plan.sk_ctas) + args.plan.dp_tiles;  // work units
  if (ctas > INT32_MAX) return cudaErrorInvalidConfiguration;
  if (persistent && ctas > facts.num_sms) ctas = facts.num_sms;
  kernel<<<static_cast<unsigned>(ctas), T::kNumThreads, T::smem_bytes(kStaged), stream>>>(
      tmap_w_hi, tmap_w_lo, tmap_x_hi, tmap_x_lo, args, tmap_out);
  return cudaGetLastError();
}

// Preconditions of the launchers below, as the dispatch guarantees them.
static bool parts_ok(const Fp16x3Parts& p) {
  return aligned16(p.hi) && aligned16(p.lo) && p.inv_scale != nullptr;
}
// The forwards: both operands K-major, x centred, w's row sums.
static bool fp16x3_launch_ok(const Fp16x3Parts& x, const Fp16x3Parts& w, int M, int N, int K) {
  return M >= 1 && N >= 1 && K >= 1 && K % 8 == 0 && parts_ok(x) && parts_ok(w) && x.center != nullptr &&
         w.row_sum != nullptr && !x.mn_major && !w.mn_major && fused_gemm_bn::sm90_gemm_available();
}
// The plain product: any centring (x.center and w.row_sum both or neither);
// K-major operands need K % 8 == 0, MN-major ones rows % 8 == 0 (16-byte TMA
// strides); w.inv_scale may be null (unscaled w); x K-major with w MN-major,
// or both of one layout.
static bool fp16x3_plain_ok(const Fp16x3Parts& x, const Fp16x3Parts& w, int M, int N, int K) {
  const bool x_ok = aligned16(x.hi) && aligned16(x.lo) && x.inv_scale != nullptr && (x.mn_major ? M % 8 : K % 8) == 0;
  const bool w_ok = aligned16(w.hi) && aligned16(w.lo) && (w.mn_major ? N % 8 : K % 8) == 0;
  return M >= 1 && N >= 1 && K >= 1 && x_ok && w_ok && (x.center == nullptr) == (w.row_sum == nullptr) &&
         !(x.mn_major && !w.mn_major) && fused_gemm_bn::sm90_gemm_available();
}

}  // namespace sm90
}  // namespace fused_gemm_bn

// ---------------------------------------------------------------------------
// Host launchers (declared in launchers.cuh)
// ---------------------------------------------------------------------------

int fused_gemm_bn::sm90_gemm_block_m() { return sm90::Fp16x3Traits::BLOCK_M; }

// True when this build holds the sm_90a kernel and the current device can run
// it: compute capability 9.0, enough shared memory, and the driver's
// tensor-map encoder.  Cached per device; a query (launches nothing).
bool fused_gemm_bn::sm90_gemm_available() {
  using namespace sm90;
  constexpr int kMaxDevices = 64;
  static signed char device_ok[kMaxDevices] = {};  // 0 unknown, 1 yes, -1 no
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device >= kMaxDevices) return false;
  if (device_ok[device] == 0) {
    int major = 0, minor = 0, smem_optin = 0;
    cudaFuncAttributes attr{};
    const bool ok =
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess &&
        cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) == cudaSuccess &&
        major == 9 && minor == 0 && smem_optin >= Fp16x3Traits::SMEM_BYTES_STAGED &&
        // the sm_90a cubin reports binaryVersion 90; a build without it does not
        cudaFuncGetAttributes(&attr, sm90_gemm_fp16x3_bn_kernel<sm90::Epilogue::kTrain, false, false, false, false>) ==
            cudaSuccess &&
        attr.binaryVersion == 90 && encode_tiled_fn() != nullptr;
    if (!ok) cudaGetLastError();  // a failed query leaves no error behind
    device_ok[device] = ok ? 1 : -1;
  }
  return device_ok[device] == 1;
}

// *floats floats (split-tile partial sums and, after them, arrival counts), of
// which the last *zero_ints ints must be zero at the launch.  Both 0 when no
// tile is split.
void fused_gemm_bn::sm90_gemm_fp16x3_workspace(int M, int N, int K, int64_t* floats, int* zero_ints) {
  using namespace sm90;
  *floats = 0;
  *zero_ints = 0;
  DeviceFacts facts;
  if (current_device_facts(&facts) != cudaSuccess) return;
  const StreamKPlan p = stream_k_plan(M, N, K, Fp16x3Traits::BLOCK_K, facts.num_sms);
  if (p.sk_ctas == 0) return;
  *floats = partial_floats(p) + p.sk_tiles;
  *zero_ints = p.sk_tiles;
}

// z = x @ w^T into `out`, and per-(M tile, feature) mean / M2 of z.
cudaError_t fused_gemm_bn::sm90_gemm_fp16x3_train(Fp16x3Parts x, Fp16x3Parts w, float* out, float* part_mean,
                                                  float* part_m2, int M, int N, int K, float* workspace,
                                                  cudaStream_t stream) {
  using namespace sm90;
  if (!fp16x3_launch_ok(x, w, M, N, K)) return cudaErrorInvalidValue;
  Sm90GemmBnArgs args{};
  args.M = M; args.N = N; args.K = K;
  args.out = out; args.part_mean = part_mean; args.part_m2 = part_m2;
  return launch_fp16x3<sm90::Epilogue::kTrain>(x, w, args, workspace, stream);
}

// out = a * (x @ w^T) + c, the eval-mode fold (bn.scale_after_bn: problem 84's order).
cudaError_t fused_gemm_bn::sm90_gemm_fp16x3_eval(Fp16x3Parts x, Fp16x3Parts w, float* out, const BatchNormArgs& bn,
                                                 int M, int N, int K, float* workspace, cudaStream_t stream) {
  using namespace sm90;
  if (!fp16x3_launch_ok(x, w, M, N, K)) return cudaErrorInvalidValue;
  Sm90GemmBnArgs args{};
  args.M = M; args.N = N; args.K = K;
  args.out = out;
  args.bn = BnParams{bn.bias,         bn.scale,       bn.bn_weight, bn.bn_bias,
                     bn.running_mean, bn.running_var, bn.eps,       bn.scale_after_bn, bn.scale_stride};
  return launch_fp16x3<sm90::Epilogue::kEval>(x, w, args, workspace, stream);
}

// out = x @ w^T, nothing else (the backward's products), in any of the
// operand layouts fp16x3_plain_ok accepts.
cudaError_t fused_gemm_bn::sm90_gemm_fp16x3_plain(Fp16x3Parts x, Fp16x3Parts w, float* out, int M, int N, int K,
                                                  float* workspace, cudaStream_t stream) {
  using namespace sm90;
  if (!fp16x3_plain_ok(x, w, M, N, K)) return cudaErrorInvalidValue;
  Sm90GemmBnArgs args{};
  args.M = M; args.N = N; args.K = K;
  args.out = out;
  if (w.mn_major && x.mn_major)
    return launch_fp16x3<sm90::Epilogue::kPlain, true, true>(x, w, args, workspace, stream);
  if (w.mn_major) return launch_fp16x3<sm90::Epilogue::kPlain, true, false>(x, w, args, workspace, stream);
  return launch_fp16x3<sm90::Epilogue::kPlain>(x, w, args, workspace, stream);
}
