// sm90_gemm_3xtf32_bn.cu -- float32-accurate GEMM on Hopper tensor cores
// (3xTF32 through wgmma, TMA, warp specialisation) with the BatchNorm epilogues.
// Needs sm_90a (H100 / H200); other GPUs take sm80_gemm_3xtf32_bn.cu.
//
// Formula (the same two epilogues as the portable kernel)
//   z[m, n] = sum_k x[m, k] * w[n, k]                     (z = x @ W^T, no bias)
//   kTrain: out = z; part_mean[mt, n], part_m2[mt, n] = mean and sum of squared
//           deviations of z[:, n] over the rows of M tile mt (BLOCK_M rows; the
//           last tile holds the rest).  bn_apply.cu finishes.
//   kEval:  out = a[n] * z + c[n]: bias, scale and BatchNorm(eval) folded, with
//           scale before BatchNorm (problem 33) or after it (problem 84);
//           bn_eval_affine in bn_stats.cuh has both formulas
//
// Tensors (float32, row-major, contiguous, 16-byte aligned, K % 4 == 0: TMA
// needs 16-byte global strides)
//   x        (M, K)  K-major: the caller's input or its centred rows, read raw by TMA
//   x_small  (M, K)  K-major: rna_tf32(x - tf32_trunc(x)), sm90_prepass_3xtf32
//   w        (N, K)  K-major: nn.Linear weight
//   out      (M, N);  part_mean, part_m2 (ceil(M / BLOCK_M), N);  vectors (N)
//
// Swapped product.  The kernel computes the transposed tile z^T = W x^T: wgmma's
// M dimension runs over output features (w is operand A), its N dimension over
// batch rows (x is operand B).  Operand A may come from registers, so w's split
// is made there from the shared tile (three ALU ops per element) and never
// touches memory; x's small part is made once per forward by the pre-pass
// (M*K floats against the N*K of w).  Each accumulator row is one feature, so
// the BatchNorm statistics are row reductions inside one warp.
//
// Numerics (3xTF32: CUTLASS example 27; Ootomo & Yokota, IJHPCA 2022)
//   wgmma .tf32 reads the top 19 bits of each fp32 operand (truncation).
//   w = w_big + w_small: w_big = rna_tf32(w) (exact TF32), w_small = w - w_big
//     (exact, |w_small| <= 2^-11 |w|; the tensor core truncates it: < 2^-22 |w| lost).
//   x = x_big + x_small: x_big = the raw x tile (the tensor core truncates it),
//     x_small = rna_tf32(x - tf32_trunc(x)) (|x_small| < 2^-10 |x|, <= 2^-22 |x| lost).
//   Per k-step: w_big*x_big + w_big*x_small + w_small*x_big; dropped:
//   w_small * x_small (< 2^-21 |wx|).
//   Accumulation: the tensor core does not round to nearest when it adds into
//   its fp32 accumulator (docs/perf.md, v1: error linear in K).  The wgmmas of
//   kPromoteBlocks * BLOCK_K = 32 k (12 per 64-row half) therefore go into a
//   fresh register tile `part`, which is added to `acc` with ordinary
//   round-to-nearest FADDs (DeepGEMM's FP8 promotion).  Within a slab the
//   correction products go first, while |part| is small (a truncating add loses
//   in proportion to the running |part|).  Measured (v18, H200)
//   ||y - y64|| / ||y64|| 0.19-0.46x eager FP32's on the tested shapes of K >= 1000
//   (docs/perf.md; promoting every 64 k was 1.5% faster, at 0.9-1.0x eager's error in eval).
//   Non-finite inputs: inf - inf = NaN in the split, so an inf operand gives NaN.
//   Centring (the forwards; centring.cuh): x is x_centred = rn(x - c_m) and
//   the epilogue adds c_m (hi_n + lo_n) back (finish_product), so the
//   truncating accumulation's error has no common sign over a feature's rows.
//
// Structure (PTX ISA 9.7.15 wgmma, 9.7.9.25.5 cp.async.bulk.tensor; DeepGEMM's
// sm90 GEMMs were read for the warp-specialised pattern)
//   CTA tile BLOCK_N (features) x BLOCK_M (batch) = 128 x 128, BLOCK_K = 32.
//   Warpgroups 0, 1: consumers, 64 features each, wgmma m64n64k8 with A from
//   registers, registers raised to kConsumerRegs.  A consumer issues each
//   SLAB_K = 16 slab (both batch halves) as one commit group and waits with
//   wait_group 1, so the tensor pipe drains only at the promotion once per
//   k-block (v18: GEMM 1039-1050 -> 947-951 us at the KernelBench shape, H200).  Warpgroup 2: producer; one
//   thread issues the TMA loads of w, x, x_small into a kNumStages ring of
//   48 KB stages guarded by full (TMA bytes) and empty (one arrive per
//   consumer warp) mbarriers.  Tiles are 128-byte swizzled by TMA and read in
//   place by wgmma.  Grid: one CTA per tile, M tiles fastest, so the CTAs
//   sharing a w tile run together and w is read from DRAM about once.
//
// Split tiles (a locality-preserving stream-K; StreamKPlan, stream_k_plan)
//   One CTA per SM fits, so whole tiles alone leave the last wave part-empty
//   (512 tiles = 3.88 waves of 132 SMs at the KernelBench shape).  The
//   remainder tiles are cut along K and run first: each piece's CTA writes
//   its fp32 partial tile to a workspace slot and counts itself in on a
//   per-tile counter (GPU-scope acq_rel atomic); the last to arrive sums the
//   slots in piece order (deterministic) and runs the epilogue.  Measured
//   (H200): GEMM 1063 -> 1047 us, train 1.117 -> 1.104 ms (docs/perf.md v14).
//   A piece-sum adds one fp32 rounding per piece boundary, as the per-slab
//   promotion already does every 16 k.
//
// Whether this kernel runs is model_new.py's dispatch decision (compute
// capability 9.0 and sm90_gemm_available(), K % 4 == 0, 16-byte aligned w);
// launchers given inputs outside those preconditions return
// cudaErrorInvalidValue, launching nothing.  split_tiles = false (the dispatch's
// `sm90_3xtf32_nosplit` GEMM, an A/B switch for measurements) runs whole tiles only.

#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>
#include <type_traits>

#include "launchers.cuh"
#include "sm90_gemm_tiles.cuh"

namespace fused_gemm_bn {
namespace sm90 {

struct Sm90GemmTraits {
  static constexpr int BLOCK_N = 128;  // features per CTA (wgmma M, over the consumer warpgroups)
  static constexpr int BLOCK_M = 128;  // batch rows per CTA (wgmma N)
  static constexpr int BLOCK_K = 32;   // one 128-byte swizzle row of fp32
  static constexpr int WGMMA_M = 64;
  static constexpr int WGMMA_N = 64;   // half the batch tile per wgmma
  static constexpr int WGMMA_K = 8;
  static constexpr int SLAB_K = 16;                      // k per A-fragment buffer (one commit group)
  static constexpr int kSlabSteps = SLAB_K / WGMMA_K;    // wgmma k-steps per slab
  static constexpr int kPromoteBlocks = 1;  // k-blocks (of BLOCK_K) per promotion of the partial sums (v18)
  static constexpr int kNumConsumers = BLOCK_N / WGMMA_M;
  static constexpr int kNumThreads = 128 * (kNumConsumers + 1);
  static constexpr int kNumStages = 4;
  static constexpr int kAccRegs = WGMMA_M * BLOCK_M / 128;   // 64 x 128 fp32 per warpgroup
  static constexpr int kPartRegs = WGMMA_M * WGMMA_N / 128;  // one 64 x 64 half
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  static constexpr int W_TILE_BYTES = BLOCK_N * BLOCK_K * 4;
  static constexpr int X_TILE_BYTES = BLOCK_M * BLOCK_K * 4;
  static constexpr int STAGE_BYTES = W_TILE_BYTES + 2 * X_TILE_BYTES;
  static constexpr int SMEM_BYTES = kNumStages * STAGE_BYTES + 2 * kNumStages * 8 + 1024;  // + barriers, alignment

  static_assert(BLOCK_K == 2 * SLAB_K, "a stage holds two slabs, one per A-fragment buffer");
  static_assert(BLOCK_K * 4 == 128, "tiles are rows of one 128-byte swizzle span");
  static_assert(2 * WGMMA_N == BLOCK_M && kPartRegs == 32, "two m64n64k8 halves per batch tile");
  static_assert(W_TILE_BYTES % 1024 == 0 && X_TILE_BYTES % 1024 == 0, "tiles start on 1024-byte swizzle atoms");
  static_assert(kNumConsumers * 128 * kConsumerRegs + 128 * kProducerRegs <= 65536, "register file");
  static_assert(BLOCK_N == kTileN && BLOCK_M == kTileM && kAccRegs == kTileAccRegs &&
                    kNumConsumers * 128 == kConsumerThreads,
                "the tile of sm90_gemm_tiles.cuh (its epilogues and split-tile hand-off)");
};

// v rounded to TF32 (nearest, ties away from zero; = cvt.rna.tf32.f32 for
// finite v) with two integer ops: the low 13 bits are cleared after adding half
// their range.
__device__ __forceinline__ float round_tf32(float v) {
  return __uint_as_float((__float_as_uint(v) + 0x1000u) & 0xffffe000u);
}

template <Epilogue kEpilogue>
__global__ void __launch_bounds__(Sm90GemmTraits::kNumThreads, 1)
    sm90_gemm_3xtf32_bn_kernel(const __grid_constant__ CUtensorMap tmap_w,
                               const __grid_constant__ CUtensorMap tmap_x,
                               const __grid_constant__ CUtensorMap tmap_x_small, const Sm90GemmBnArgs args) {
#if FUSED_GEMM_BN_SM90A
  using T = Sm90GemmTraits;
  extern __shared__ uint8_t smem_raw[];
  // 128-byte swizzle atoms must start on 1024-byte boundaries.
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + T::kNumStages * T::STAGE_BYTES);
  uint64_t* empty_bar = full_bar + T::kNumStages;

  const int M = args.M;
  const int m_tiles = (M + T::BLOCK_M - 1) / T::BLOCK_M;
  const int num_k_blocks = (args.K + T::BLOCK_K - 1) / T::BLOCK_K;
  const int warpgroup = threadIdx.x / 128;
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
  __syncthreads();

  if (warpgroup == T::kNumConsumers) {
    // Producer warpgroup: one thread streams the k-blocks of every segment
    // through the ring; `q` counts ring slots over the whole CTA.
    setmaxnreg_dec<T::kProducerRegs>();
    if (threadIdx.x == T::kNumConsumers * 128) {
      tma_prefetch_descriptor(&tmap_w);
      tma_prefetch_descriptor(&tmap_x);
      tma_prefetch_descriptor(&tmap_x_small);
      int q = 0;
      for (int si = 0; si < num_segments; ++si) {
        const WorkSegment seg = cta_segment(args.plan, cta, si, num_k_blocks);
        const int m0 = (seg.tile % m_tiles) * T::BLOCK_M, n0 = (seg.tile / m_tiles) * T::BLOCK_N;
        for (int kb = seg.kb_begin; kb < seg.kb_end; ++kb, ++q) {
          const int s = q % T::kNumStages;
          mbar_wait(&empty_bar[s], ((q / T::kNumStages) & 1) ^ 1);
          uint8_t* stage = smem + s * T::STAGE_BYTES;
          mbar_arrive_expect_tx(&full_bar[s], T::STAGE_BYTES);
          const int k0 = kb * T::BLOCK_K;
          tma_load_2d(stage, &tmap_w, &full_bar[s], k0, n0);
          tma_load_2d(stage + T::W_TILE_BYTES, &tmap_x, &full_bar[s], k0, m0);
          tma_load_2d(stage + T::W_TILE_BYTES + T::X_TILE_BYTES, &tmap_x_small, &full_bar[s], k0, m0);
        }
      }
    }
    return;
  }

  // Consumer warpgroups: 64 features each, as two 64 x 64 halves of the batch
  // tile.  A stage's BLOCK_K = 32 is consumed as two slabs of SLAB_K = 16, each
  // one commit group of 12 wgmmas (6 per half, into part[half]); the A
  // fragments of the next slab are loaded while the previous one runs.  Every
  // kPromoteBlocks k-blocks `part` is added to `acc` (the one full drain).
  setmaxnreg_inc<T::kConsumerRegs>();
  const int warp = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int w_row = warpgroup * T::WGMMA_M + warp * 16 + g;  // this thread's first A row in the w tile

  float acc[T::kAccRegs];
  float part[2][T::kPartRegs];
  // w's TF32 parts for one slab in the A-fragment layout: [k-step][big, small][reg].
  // Two buffers, one per slab of a stage: a slab's wgmmas still read theirs
  // while the next slab's are loaded.
  uint32_t a_frag[2][T::kSlabSteps][2][4];

  // The lambdas below take `q`, the ring slot counter (stage q % kNumStages,
  // mbarrier phase q / kNumStages), which runs on over both segments.
  // Slab `sub` (0, 1) of slot q: k-steps kSlabSteps * sub + j of the tiles.
  auto load_a = [&](uint32_t(&a)[T::kSlabSteps][2][4], int q, int sub) {
    const uint8_t* w_tile = smem + (q % T::kNumStages) * T::STAGE_BYTES;
#pragma unroll
    for (int j = 0; j < T::kSlabSteps; ++j) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = w_row + 8 * (r & 1);
        const int col = (sub * T::kSlabSteps + j) * T::WGMMA_K + t + 4 * (r >> 1);
        const float v = *reinterpret_cast<const float*>(w_tile + sw128_offset(row, col));
        const float big = round_tf32(v);
        a[j][0][r] = __float_as_uint(big);
        a[j][1][r] = __float_as_uint(v - big);
      }
    }
  };
  // The 12 wgmmas of one slab (both batch halves, 6 each) as one commit group.
  // fresh: the slab's first wgmma per half overwrites `part` (a promotion just
  // emptied it) instead of adding to it.
  auto issue_slab = [&](const uint32_t(&a)[T::kSlabSteps][2][4], int q, int sub, bool fresh) {
    const uint8_t* x_tiles = smem + (q % T::kNumStages) * T::STAGE_BYTES + T::W_TILE_BYTES;
    wgmma_fence();
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint8_t* x_big_tile = x_tiles + half * 64 * 128;
      const uint8_t* x_small_tile = x_big_tile + T::X_TILE_BYTES;
      // Corrections first, while |part| is small (the tensor core's truncating
      // adds lose in proportion to the running |part|), then the big products.
#pragma unroll
      for (int j = 0; j < T::kSlabSteps; ++j) {
        const uint32_t k_bytes = (sub * T::kSlabSteps + j) * T::WGMMA_K * 4;
        wgmma_m64n64k8_rs(part[half], a[j][0], desc_kmajor_sw128(x_small_tile, k_bytes), !(fresh && j == 0));
        wgmma_m64n64k8_rs(part[half], a[j][1], desc_kmajor_sw128(x_big_tile, k_bytes), true);
      }
#pragma unroll
      for (int j = 0; j < T::kSlabSteps; ++j) {
        const uint32_t k_bytes = (sub * T::kSlabSteps + j) * T::WGMMA_K * 4;
        wgmma_m64n64k8_rs(part[half], a[j][0], desc_kmajor_sw128(x_big_tile, k_bytes), true);
      }
    }
    wgmma_commit();
  };
  auto promote = [&]() {
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < T::kPartRegs; ++i) {
        fence_operand(part[h][i]);  // read only after the wgmma wait
        acc[h * T::kPartRegs + i] += part[h][i];
        fence_operand(acc[h * T::kPartRegs + i]);  // add before the next wgmma overwrites part
      }
  };
  auto keep_alive = [&](uint32_t(&a)[T::kSlabSteps][2][4]) {
#pragma unroll
    for (int j = 0; j < T::kSlabSteps; ++j)
#pragma unroll
      for (int p = 0; p < 2; ++p)
#pragma unroll
        for (int r = 0; r < 4; ++r) fence_operand(a[j][p][r]);
  };
  // Slab `sub` of ring slot q, its A fragments in buffer `sub`.  On entry the
  // previous slab's group may be in flight; wait<1> retires the one before it,
  // the last reader of buffer `sub` (and, for sub == 1, of slot q - 1, which is
  // then released).  With promote_now the partial sums are first added to acc
  // (wait<0>: the tensor pipe of this warpgroup drains once per promotion, not
  // once per slab).  `sub` is a compile-time constant, so the register arrays
  // are never indexed at run time.
  auto slab = [&](auto sub_c, int q, int q0, bool promote_now) {
    constexpr int kSub = decltype(sub_c)::value;
    if (kSub == 0) mbar_wait(&full_bar[q % T::kNumStages], (q / T::kNumStages) & 1);
    wgmma_wait<1>();
    keep_alive(a_frag[kSub]);
    if (kSub == 1 && q > q0 && lane == 0) mbar_arrive(&empty_bar[(q - 1) % T::kNumStages]);
    load_a(a_frag[kSub], q, kSub);
    if (promote_now) {
      wgmma_wait<0>();
      keep_alive(a_frag[kSub ^ 1]);
      promote();
    }
    issue_slab(a_frag[kSub], q, kSub, promote_now);
  };
  using Sub0 = std::integral_constant<int, 0>;
  using Sub1 = std::integral_constant<int, 1>;

  // acc = the sum over the segment's n k-blocks, from ring slot q0 on.  The
  // partial sums are promoted every kPromoteBlocks k-blocks.
  auto mainloop = [&](int q0, int n) {
#pragma unroll
    for (int i = 0; i < T::kAccRegs; ++i) acc[i] = 0.f;
    mbar_wait(&full_bar[q0 % T::kNumStages], (q0 / T::kNumStages) & 1);
    load_a(a_frag[0], q0, 0);
    issue_slab(a_frag[0], q0, 0, true);
    slab(Sub1{}, q0, q0, false);
    for (int q = q0 + 1; q < q0 + n; ++q) {
      slab(Sub0{}, q, q0, (q - q0) % T::kPromoteBlocks == 0);
      slab(Sub1{}, q, q0, false);
    }
    wgmma_wait<0>();
    keep_alive(a_frag[0]);
    keep_alive(a_frag[1]);
    promote();
    if (lane == 0) mbar_arrive(&empty_bar[(q0 + n - 1) % T::kNumStages]);
  };

  const int ctid = threadIdx.x;  // 0 .. 255 over the consumer warpgroups
  int q = 0;
  for (int si = 0; si < num_segments; ++si) {
    const WorkSegment seg = cta_segment(args.plan, cta, si, num_k_blocks);
    const int n_blocks = seg.kb_end - seg.kb_begin;
    mainloop(q, n_blocks);
    q += n_blocks;
    if (seg.piece >= 0 && !split_tile_hand_off(acc, args.plan, args.partials, args.tile_arrivals, seg, ctid))
      continue;
    if (args.x_center != nullptr) finish_product<false>(acc, args, seg.tile, m_tiles, w_row, t);
    finish_tile<kEpilogue>(acc, args, seg.tile, m_tiles, w_row, t);
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // this kernel exists only in sm_90a images; the launcher never selects it elsewhere
#endif
}

// ---------------------------------------------------------------------------
// Host side: tensor maps and launch
// ---------------------------------------------------------------------------

template <Epilogue kEpilogue>
static cudaError_t launch_sm90_gemm(const float* x, const float* x_small, const float* w, Sm90GemmBnArgs args,
                                    bool split_tiles, float* workspace, cudaStream_t stream) {
  using T = Sm90GemmTraits;
  auto kernel = sm90_gemm_3xtf32_bn_kernel<kEpilogue>;
  CUtensorMap tmap_w, tmap_x, tmap_x_small;
  if (!make_tensor_map(&tmap_w, w, TileDtype::kFloat32, args.N, args.K, T::BLOCK_N) ||
      !make_tensor_map(&tmap_x, x, TileDtype::kFloat32, args.M, args.K, T::BLOCK_M) ||
      !make_tensor_map(&tmap_x_small, x_small, TileDtype::kFloat32, args.M, args.K, T::BLOCK_M))
    return cudaErrorInvalidValue;
  // The shared-memory opt-in is set once per device (it costs microseconds of host time per call).
  constexpr int kMaxDevices = 64;
  static bool smem_set[kMaxDevices] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device >= kMaxDevices || !smem_set[device]) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::SMEM_BYTES);
    if (err != cudaSuccess) return err;
    if (device < kMaxDevices) smem_set[device] = true;
  }
  int num_sms = 0;
  err = current_num_sms(&num_sms);
  if (err != cudaSuccess) return err;
  args.plan = stream_k_plan(args.M, args.N, args.K, T::BLOCK_K, num_sms, split_tiles);
  if (args.plan.sk_ctas > 0 && workspace == nullptr) return cudaErrorInvalidValue;
  args.partials = workspace;
  args.tile_arrivals = args.plan.sk_ctas > 0 ? reinterpret_cast<int*>(workspace + partial_floats(args.plan)) : nullptr;
  const long long ctas = static_cast<long long>(args.plan.sk_ctas) + args.plan.dp_tiles;
  if (ctas > INT32_MAX) return cudaErrorInvalidConfiguration;
  kernel<<<static_cast<unsigned>(ctas), T::kNumThreads, T::SMEM_BYTES, stream>>>(tmap_w, tmap_x, tmap_x_small, args);
  return cudaGetLastError();
}

// Preconditions of the launchers below, as the dispatch guarantees them.
static bool launch_ok(const float* x, const float* x_small, const float* w, Centring centring, int M, int N, int K) {
  return M >= 1 && N >= 1 && K >= 1 && K % 4 == 0 && aligned16(x) && aligned16(x_small) && aligned16(w) &&
         (centring.x_center == nullptr) == (centring.w_row_sum == nullptr) && fused_gemm_bn::sm90_gemm_available();
}

// The arguments every epilogue takes.
static Sm90GemmBnArgs gemm_args(Centring centring, float* out, int M, int N, int K) {
  Sm90GemmBnArgs args{};
  args.M = M; args.N = N; args.K = K;
  args.out = out;
  args.x_center = centring.x_center;
  args.w_row_sum = centring.w_row_sum;
  return args;
}

}  // namespace sm90
}  // namespace fused_gemm_bn

// ---------------------------------------------------------------------------
// Host launchers (declared in launchers.cuh)
// ---------------------------------------------------------------------------

int fused_gemm_bn::sm90_gemm_block_m() { return sm90::Sm90GemmTraits::BLOCK_M; }

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
        major == 9 && minor == 0 && smem_optin >= Sm90GemmTraits::SMEM_BYTES &&
        // the sm_90a cubin reports binaryVersion 90; a build without it does not
        cudaFuncGetAttributes(&attr, sm90_gemm_3xtf32_bn_kernel<sm90::Epilogue::kTrain>) == cudaSuccess &&
        attr.binaryVersion == 90 && encode_tiled_fn() != nullptr;
    if (!ok) cudaGetLastError();  // a failed query leaves no error behind
    device_ok[device] = ok ? 1 : -1;
  }
  return device_ok[device] == 1;
}

// *floats floats (split-tile partial sums and, after them, arrival counts), of
// which the last *zero_ints ints must be zero at the launch.  Both 0 when no
// tile is split.
void fused_gemm_bn::sm90_gemm_workspace(int M, int N, int K, bool split_tiles, int64_t* floats, int* zero_ints) {
  using namespace sm90;
  *floats = 0;
  *zero_ints = 0;
  int num_sms = 0;
  if (current_num_sms(&num_sms) != cudaSuccess) return;
  const StreamKPlan p = stream_k_plan(M, N, K, Sm90GemmTraits::BLOCK_K, num_sms, split_tiles);
  if (p.sk_ctas == 0) return;
  *floats = partial_floats(p) + p.sk_tiles;
  *zero_ints = p.sk_tiles;
}

// z = x @ w^T into `out`, and per-(M tile, feature) mean / M2 of z.
// x_small = rna_tf32(x - tf32_trunc(x)) (sm90_prepass_3xtf32); x is the
// centred x_centred when centring is given.  `workspace`: as
// sm90_gemm_workspace says (null when it needs none).
cudaError_t fused_gemm_bn::sm90_gemm_3xtf32_train(const float* x, const float* x_small, const float* w,
                                                  Centring centring, float* out, float* part_mean, float* part_m2,
                                                  int M, int N, int K, bool split_tiles, float* workspace,
                                                  cudaStream_t stream) {
  using namespace sm90;
  if (!launch_ok(x, x_small, w, centring, M, N, K)) return cudaErrorInvalidValue;
  Sm90GemmBnArgs args = gemm_args(centring, out, M, N, K);
  args.part_mean = part_mean; args.part_m2 = part_m2;
  return launch_sm90_gemm<sm90::Epilogue::kTrain>(x, x_small, w, args, split_tiles, workspace, stream);
}

// out = a * (x @ w^T) + c with the eval-mode fold of bias, scale and BatchNorm
// (scale_after_bn: Linear -> BatchNorm -> scale instead of Linear -> scale -> BatchNorm).
cudaError_t fused_gemm_bn::sm90_gemm_3xtf32_eval(const float* x, const float* x_small, const float* w,
                                                 Centring centring, float* out, const float* bias, const float* scale, const float* bn_weight,
                                                 const float* bn_bias, const float* running_mean,
                                                 const float* running_var, float eps, bool scale_after_bn, int M,
                                                 int N, int K, bool split_tiles, float* workspace,
                                                 cudaStream_t stream) {
  using namespace sm90;
  if (!launch_ok(x, x_small, w, centring, M, N, K)) return cudaErrorInvalidValue;
  Sm90GemmBnArgs args = gemm_args(centring, out, M, N, K);
  args.bn = BnParams{bias, scale, bn_weight, bn_bias, running_mean, running_var, eps, scale_after_bn};
  return launch_sm90_gemm<sm90::Epilogue::kEval>(x, x_small, w, args, split_tiles, workspace, stream);
}

// out = x @ w^T, nothing else (the backward's products).
cudaError_t fused_gemm_bn::sm90_gemm_3xtf32_plain(const float* x, const float* x_small, const float* w,
                                                  Centring centring, float* out, int M, int N, int K,
                                                  bool split_tiles, float* workspace, cudaStream_t stream) {
  using namespace sm90;
  if (!launch_ok(x, x_small, w, centring, M, N, K)) return cudaErrorInvalidValue;
  Sm90GemmBnArgs args = gemm_args(centring, out, M, N, K);
  return launch_sm90_gemm<sm90::Epilogue::kPlain>(x, x_small, w, args, split_tiles, workspace, stream);
}
