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
//   x        (M, K)  K-major: the caller's input, read raw by TMA
//   x_small  (M, K)  K-major: rna_tf32(x - tf32_trunc(x)), split_tf32_remainder
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
//   its fp32 accumulator (docs/perf.md, v1: error linear in K).  Each SLAB_K = 16
//   slab's 6 wgmmas per 64-row half therefore go into a fresh register tile
//   `part`, which is added to `acc` with ordinary round-to-nearest FADDs
//   (DeepGEMM's FP8 promotion).  Measured ||z - z64|| / ||z64|| 0.3-0.8x eager
//   FP32's on the tested shapes (docs/perf.md).
//   Non-finite inputs: inf - inf = NaN in the split, so an inf operand gives NaN.
//
// Structure (PTX ISA 9.7.15 wgmma, 9.7.9.25.5 cp.async.bulk.tensor; DeepGEMM's
// sm90 GEMMs were read for the warp-specialised pattern)
//   CTA tile BLOCK_N (features) x BLOCK_M (batch) = 128 x 128, BLOCK_K = 32.
//   Warpgroups 0, 1: consumers, 64 features each, wgmma m64n64k8 with A from
//   registers, registers raised to kConsumerRegs.  Warpgroup 2: producer; one
//   thread issues the TMA loads of w, x, x_small into a kNumStages ring of
//   48 KB stages guarded by full (TMA bytes) and empty (one arrive per
//   consumer warp) mbarriers.  Tiles are 128-byte swizzled by TMA and read in
//   place by wgmma.  Grid: one CTA per tile, M tiles fastest, so the CTAs
//   sharing a w tile run together and w is read from DRAM about once.
//
// Launchers return cudaErrorNotSupported (launching nothing) when this kernel
// does not apply (not compute capability 9.0, no sm_90a image, K % 4 != 0,
// misaligned pointers); the caller then takes the portable kernel.

#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "bn_stats.cuh"
#include "sm90_primitives.cuh"

namespace fused_gemm_bn {
namespace sm90 {

struct Sm90GemmTraits {
  static constexpr int BLOCK_N = 128;  // features per CTA (wgmma M, over the consumer warpgroups)
  static constexpr int BLOCK_M = 128;  // batch rows per CTA (wgmma N)
  static constexpr int BLOCK_K = 32;   // one 128-byte swizzle row of fp32
  static constexpr int WGMMA_M = 64;
  static constexpr int WGMMA_N = 64;   // half the batch tile per wgmma
  static constexpr int WGMMA_K = 8;
  static constexpr int SLAB_K = 16;                      // k per promotion of the partial sums
  static constexpr int kSlabSteps = SLAB_K / WGMMA_K;    // wgmma k-steps per slab
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
};

enum class Epilogue { kTrain, kEval };

struct Sm90GemmBnArgs {
  int M, N, K;
  float* out;
  float* part_mean;  // kTrain
  float* part_m2;
  BnParams bn;  // kEval
};

// v rounded to TF32 (nearest, ties away from zero; = cvt.rna.tf32.f32 for
// finite v) with two integer ops: the low 13 bits are cleared after adding half
// their range.
__device__ __forceinline__ float round_tf32(float v) {
  return __uint_as_float((__float_as_uint(v) + 0x1000u) & 0xffffe000u);
}

// Byte offset of element (row, col) of a 128-byte-swizzled K-major tile.
__device__ __forceinline__ uint32_t sw128_offset(int row, int col) {
  return static_cast<uint32_t>(row * 128 + ((((col >> 2) ^ row) & 7) << 4) + (col & 3) * 4);
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

  const int M = args.M, N = args.N;
  const int m_tiles = (M + T::BLOCK_M - 1) / T::BLOCK_M;
  const int m_tile = static_cast<int>(blockIdx.x) % m_tiles;
  const int n_tile = static_cast<int>(blockIdx.x) / m_tiles;
  const int m0 = m_tile * T::BLOCK_M, n0 = n_tile * T::BLOCK_N;
  const int num_k_blocks = (args.K + T::BLOCK_K - 1) / T::BLOCK_K;
  const int warpgroup = threadIdx.x / 128;

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
    // Producer warpgroup: one thread streams the k slabs through the ring.
    setmaxnreg_dec<T::kProducerRegs>();
    if (threadIdx.x == T::kNumConsumers * 128) {
      tma_prefetch_descriptor(&tmap_w);
      tma_prefetch_descriptor(&tmap_x);
      tma_prefetch_descriptor(&tmap_x_small);
      for (int kb = 0; kb < num_k_blocks; ++kb) {
        const int s = kb % T::kNumStages;
        mbar_wait(&empty_bar[s], ((kb / T::kNumStages) & 1) ^ 1);
        uint8_t* stage = smem + s * T::STAGE_BYTES;
        mbar_arrive_expect_tx(&full_bar[s], T::STAGE_BYTES);
        const int k0 = kb * T::BLOCK_K;
        tma_load_2d(stage, &tmap_w, &full_bar[s], k0, n0);
        tma_load_2d(stage + T::W_TILE_BYTES, &tmap_x, &full_bar[s], k0, m0);
        tma_load_2d(stage + T::W_TILE_BYTES + T::X_TILE_BYTES, &tmap_x_small, &full_bar[s], k0, m0);
      }
    }
    return;
  }

  // Consumer warpgroups: 64 features each, as two 64 x 64 halves of the batch
  // tile.  A stage's BLOCK_K = 32 is consumed as two slabs of SLAB_K = 16.  Per
  // slab and half the 6 wgmmas go into a fresh `part` tile (one commit group);
  // while the tensor core runs one half, the other half's finished `part` is
  // promoted into `acc`, so the pipe does not drain between slabs.
  setmaxnreg_inc<T::kConsumerRegs>();
  const int warp = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int w_row = warpgroup * T::WGMMA_M + warp * 16 + g;  // this thread's first A row in the w tile

  float acc[T::kAccRegs];
#pragma unroll
  for (int i = 0; i < T::kAccRegs; ++i) acc[i] = 0.f;
  float part[2][T::kPartRegs];
  // w's TF32 parts for one slab in the A-fragment layout: [k-step][big, small][reg].
  // Two buffers, one per slab of a stage: a slab's wgmmas still read theirs
  // while the next slab's are loaded.
  uint32_t a_frag[2][T::kSlabSteps][2][4];

  // Slab `sub` (0, 1) of stage kb: k-steps kSlabSteps * sub + j of the tiles.
  auto load_a = [&](uint32_t(&a)[T::kSlabSteps][2][4], int kb, int sub) {
    const uint8_t* w_tile = smem + (kb % T::kNumStages) * T::STAGE_BYTES;
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
  // The 6 wgmmas of one slab for batch half `half` (rows 64 half .. +63 of the x tiles).
  auto issue_half = [&](float(&d)[T::kPartRegs], const uint32_t(&a)[T::kSlabSteps][2][4], int kb, int sub,
                        int half) {
    const uint8_t* x_big_tile = smem + (kb % T::kNumStages) * T::STAGE_BYTES + T::W_TILE_BYTES + half * 64 * 128;
    const uint8_t* x_small_tile = x_big_tile + T::X_TILE_BYTES;
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < T::kSlabSteps; ++j) {
      const uint32_t k_bytes = (sub * T::kSlabSteps + j) * T::WGMMA_K * 4;
      const uint64_t desc_big = desc_kmajor_sw128(x_big_tile, k_bytes);
      const uint64_t desc_small = desc_kmajor_sw128(x_small_tile, k_bytes);
      wgmma_m64n64k8_rs(d, a[j][0], desc_big, j > 0);  // w_big * x_big (overwrites d first)
      wgmma_m64n64k8_rs(d, a[j][0], desc_small, true);  // w_big * x_small
      wgmma_m64n64k8_rs(d, a[j][1], desc_big, true);    // w_small * x_big
    }
    wgmma_commit();
  };
  auto promote = [&](int half) {
#pragma unroll
    for (int i = 0; i < T::kPartRegs; ++i) {
      fence_operand(part[half][i]);  // read only after the wgmma wait
      acc[half * T::kPartRegs + i] += part[half][i];
      fence_operand(acc[half * T::kPartRegs + i]);  // add before the next wgmma overwrites part
    }
  };
  auto keep_alive = [&](uint32_t(&a)[T::kSlabSteps][2][4]) {
#pragma unroll
    for (int j = 0; j < T::kSlabSteps; ++j)
#pragma unroll
      for (int q = 0; q < 2; ++q)
#pragma unroll
        for (int r = 0; r < 4; ++r) fence_operand(a[j][q][r]);
  };
  // Slab `sub` of stage kb; its A fragments are in buffer `sub`.  On entry the
  // first half of this slab is in flight; on exit the first half of the next
  // slab (if any), while the second half's `part` is promoted.  The wait before
  // promote(0) retires both halves: ptxas keeps the wgmmas asynchronous only
  // when at most one commit group is outstanding at every wait inside the loop
  // (with wait<1> here as well it serialises them, warning C7514).  `sub` and
  // `has_next` are compile-time constants, so the register arrays are never
  // indexed at run time.
  auto slab = [&](auto sub_c, auto has_next_c, int kb) {
    constexpr int kSub = decltype(sub_c)::value;
    constexpr bool kHasNext = decltype(has_next_c)::value;
    constexpr int kNextSub = kSub ^ 1;
    const int next_kb = kSub == 0 ? kb : kb + 1;
    issue_half(part[1], a_frag[kSub], kb, kSub, 1);
    if constexpr (kHasNext) {
      if (kNextSub == 0) mbar_wait(&full_bar[next_kb % T::kNumStages], (next_kb / T::kNumStages) & 1);
      load_a(a_frag[kNextSub], next_kb, kNextSub);  // its previous reader, the slab before this one, is complete
    }
    wgmma_wait<0>();  // both halves of this slab done
    keep_alive(a_frag[kSub]);
    promote(0);
    if constexpr (kHasNext) issue_half(part[0], a_frag[kNextSub], next_kb, kNextSub, 0);
    promote(1);  // overlaps the next slab's first half
    if (kSub == 1 && lane == 0) mbar_arrive(&empty_bar[kb % T::kNumStages]);  // stage kb fully read
  };
  using Sub0 = std::integral_constant<int, 0>;
  using Sub1 = std::integral_constant<int, 1>;

  if (num_k_blocks > 0) {
    mbar_wait(&full_bar[0], 0);
    load_a(a_frag[0], 0, 0);
    issue_half(part[0], a_frag[0], 0, 0, 0);
    for (int kb = 0; kb + 1 < num_k_blocks; ++kb) {
      slab(Sub0{}, std::true_type{}, kb);
      slab(Sub1{}, std::true_type{}, kb);
    }
    slab(Sub0{}, std::true_type{}, num_k_blocks - 1);
    slab(Sub1{}, std::false_type{}, num_k_blocks - 1);
  }

  // Accumulator element 4 i + 2 h + e holds z[b, f] with
  //   f = n0 + w_row + 8 h            (feature: one row of the wgmma tile)
  //   b = m0 + 8 i + 2 t + e          (batch row)
  // so each feature's 128 batch values live in the 4 lanes of one quad.
  const int f_base = n0 + w_row;
  if constexpr (kEpilogue == Epilogue::kEval) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int f = f_base + 8 * h;
      if (f >= N) continue;
      float a, c;
      bn_eval_affine(args.bn, f, a, c);
#pragma unroll
      for (int i = 0; i < T::kAccRegs / 4; ++i) {
        acc[4 * i + 2 * h] = fmaf(a, acc[4 * i + 2 * h], c);
        acc[4 * i + 2 * h + 1] = fmaf(a, acc[4 * i + 2 * h + 1], c);
      }
    }
  } else {
    // Per-feature mean and M2 over the tile's valid rows: two passes over the
    // registers (no E[z^2] - E[z]^2 cancellation), reduced across the quad.
    const int rows_valid = min(T::BLOCK_M, M - m0);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < T::kAccRegs / 4; ++i) {
#pragma unroll
        for (int e = 0; e < 2; ++e)
          if (8 * i + 2 * t + e < rows_valid) sum += acc[4 * i + 2 * h + e];
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const float mean = sum / static_cast<float>(rows_valid);
      float m2 = 0.f;
#pragma unroll
      for (int i = 0; i < T::kAccRegs / 4; ++i) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float d = acc[4 * i + 2 * h + e] - mean;
          if (8 * i + 2 * t + e < rows_valid) m2 = fmaf(d, d, m2);
        }
      }
      m2 += __shfl_xor_sync(0xffffffffu, m2, 1);
      m2 += __shfl_xor_sync(0xffffffffu, m2, 2);
      const int f = f_base + 8 * h;
      if (t == 0 && f < N) {
        args.part_mean[static_cast<size_t>(m_tile) * N + f] = mean;
        args.part_m2[static_cast<size_t>(m_tile) * N + f] = m2;
      }
    }
  }

  // Store: a warp instruction writes 8 consecutive features (32 bytes) of 4 rows.
#pragma unroll
  for (int i = 0; i < T::kAccRegs / 4; ++i) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int b = m0 + 8 * i + 2 * t + e;
      if (b >= M) continue;
      float* out_row = args.out + static_cast<size_t>(b) * N;
      if (f_base < N) out_row[f_base] = acc[4 * i + e];
      if (f_base + 8 < N) out_row[f_base + 8] = acc[4 * i + 2 + e];
    }
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // this kernel exists only in sm_90a images; the launcher never selects it elsewhere
#endif
}

// ---------------------------------------------------------------------------
// Host side: tensor maps and launch
// ---------------------------------------------------------------------------

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled from the driver, fetched through the runtime so the
// extension needs no -lcuda.  nullptr if the driver does not provide it.
static EncodeTiledFn encode_tiled_fn() {
  static EncodeTiledFn fn = []() -> EncodeTiledFn {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status{};
#if CUDART_VERSION >= 12050
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &status) !=
        cudaSuccess)
      return nullptr;
#else
    if (cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &ptr, cudaEnableDefault, &status) != cudaSuccess)
      return nullptr;
#endif
    return status == cudaDriverEntryPointSuccess ? reinterpret_cast<EncodeTiledFn>(ptr) : nullptr;
  }();
  return fn;
}

// A (rows, K) row-major fp32 matrix read in boxes of box_rows x BLOCK_K,
// 128-byte swizzled, zero-filled outside the matrix.
static bool make_tensor_map(CUtensorMap* map, const float* ptr, int rows, int K, int box_rows) {
  const EncodeTiledFn encode = encode_tiled_fn();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(K), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(K) * sizeof(float)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(Sm90GemmTraits::BLOCK_K), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, const_cast<float*>(ptr), dims, strides, box,
                element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

static bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <Epilogue kEpilogue>
static cudaError_t launch_sm90_gemm(const float* x, const float* x_small, const float* w,
                                    const Sm90GemmBnArgs& args, cudaStream_t stream) {
  using T = Sm90GemmTraits;
  auto kernel = sm90_gemm_3xtf32_bn_kernel<kEpilogue>;
  CUtensorMap tmap_w, tmap_x, tmap_x_small;
  if (!make_tensor_map(&tmap_w, w, args.N, args.K, T::BLOCK_N) ||
      !make_tensor_map(&tmap_x, x, args.M, args.K, T::BLOCK_M) ||
      !make_tensor_map(&tmap_x_small, x_small, args.M, args.K, T::BLOCK_M))
    return cudaErrorNotSupported;
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
  const long long tiles = static_cast<long long>((args.M + T::BLOCK_M - 1) / T::BLOCK_M) *
                          ((args.N + T::BLOCK_N - 1) / T::BLOCK_N);
  if (tiles > INT32_MAX) return cudaErrorInvalidConfiguration;
  kernel<<<static_cast<unsigned>(tiles), T::kNumThreads, T::SMEM_BYTES, stream>>>(tmap_w, tmap_x, tmap_x_small,
                                                                                    args);
  return cudaGetLastError();
}

}  // namespace sm90
}  // namespace fused_gemm_bn

// ---------------------------------------------------------------------------
// Host launchers (raw pointers; no torch types so nvcc compiles this file alone)
// ---------------------------------------------------------------------------

int sm90_gemm_block_m() { return fused_gemm_bn::sm90::Sm90GemmTraits::BLOCK_M; }

// True when the Hopper kernel applies on the current device to an (M, K) x and
// the (N, K) w at this address: compute capability 9.0, an sm_90a image in this
// build, K % 4 == 0 (TMA strides), 16-byte aligned w, M, N, K >= 1, and the
// driver's tensor-map encoder available.  x and x_small must then be passed
// contiguous and 16-byte aligned.  The device query is cached per device.
bool sm90_gemm_supported(const float* w, int M, int N, int K) {
  using namespace fused_gemm_bn::sm90;
  if (M < 1 || N < 1 || K < 1 || K % 4 != 0 || !aligned16(w)) return false;
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
        cudaFuncGetAttributes(&attr, sm90_gemm_3xtf32_bn_kernel<Epilogue::kTrain>) == cudaSuccess &&
        attr.binaryVersion == 90 && encode_tiled_fn() != nullptr;
    device_ok[device] = ok ? 1 : -1;
  }
  return device_ok[device] == 1;
}

// z = x @ w^T into `out`, and per-(M tile, feature) mean / M2 of z.
// x_small = rna_tf32(x - tf32_trunc(x)) (split_tf32_remainder).
cudaError_t sm90_gemm_3xtf32_train(const float* x, const float* x_small, const float* w, float* out,
                                   float* part_mean, float* part_m2, int M, int N, int K, cudaStream_t stream) {
  using namespace fused_gemm_bn::sm90;
  if (!sm90_gemm_supported(w, M, N, K)) return cudaErrorNotSupported;
  if (!aligned16(x) || !aligned16(x_small)) return cudaErrorInvalidValue;
  Sm90GemmBnArgs args{};
  args.M = M; args.N = N; args.K = K;
  args.out = out; args.part_mean = part_mean; args.part_m2 = part_m2;
  return launch_sm90_gemm<Epilogue::kTrain>(x, x_small, w, args, stream);
}

// out = a * (x @ w^T) + c with the eval-mode fold of bias, scale and BatchNorm
// (scale_after_bn: Linear -> BatchNorm -> scale instead of Linear -> scale -> BatchNorm).
cudaError_t sm90_gemm_3xtf32_eval(const float* x, const float* x_small, const float* w, float* out,
                                  const float* bias, const float* scale, const float* bn_weight,
                                  const float* bn_bias, const float* running_mean, const float* running_var,
                                  float eps, bool scale_after_bn, int M, int N, int K, cudaStream_t stream) {
  using namespace fused_gemm_bn::sm90;
  if (!sm90_gemm_supported(w, M, N, K)) return cudaErrorNotSupported;
  if (!aligned16(x) || !aligned16(x_small)) return cudaErrorInvalidValue;
  Sm90GemmBnArgs args{};
  args.M = M; args.N = N; args.K = K;
  args.out = out;
  args.bn = fused_gemm_bn::BnParams{bias, scale, bn_weight, bn_bias, running_mean, running_var, eps,
                                    scale_after_bn};
  return launch_sm90_gemm<Epilogue::kEval>(x, x_small, w, args, stream);
}
