// sm80_gemm_bn_16bit.cu -- Linear on tensor cores in the input's 16-bit type (__half
// or __nv_bfloat16, float32 accumulation), with the per-element part of
// Linear -> scale -> BatchNorm1d (problem 33) or Linear -> BatchNorm1d -> scale
// (problem 84) in the epilogue, rounded to 16 bits where PyTorch's eager ops
// round.  Compute capability >= 8.0 (mma.sync with .bf16 needs sm_80).
//
// Formula (acc[m, n] = sum_k x[m, k] w[n, k], float32; rnd = round to the
// 16-bit type, nearest even (lowp_types.cuh); f(v) = float(v) of a 16-bit value)
//   z = rnd(acc + f(bias))                      F.linear: cuBLAS adds the bias to
//                                               the float32 result, rounds once
//   kTrain, scale first (33):  u = rnd(z * f(scale))          x * scale: float32 product, rounded
//   kTrain, bn first (84):     u = z
//     out = u, and part_mean[mt, n], part_m2[mt, n] = mean and sum of squared
//     deviations of u[:, n] over the valid rows of M tile mt, float32, two passes
//     over the staged tile (no E[u^2] - E[u]^2); bn_16bit.cu merges them.
//   kTrain with z_out (the training forward with gradients): also z_out = z, staged
//     through the same shared-memory tile before u.
//   kEval, scale first (33):   y = rnd(z * f(scale))
//                              out = rnd(fma(w * (y - rm), invstd, b))
//   kEval, bn first (84):      y = rnd(fma(w * (z - rm), invstd, b))
//                              out = rnd(y * f(scale))     (its row softmax: bn_16bit.cu)
//   w = f(bn.weight), b = f(bn.bias), rm = f(running_mean),
//   invstd = rsqrtf(f(running_var) + eps): PyTorch's native CUDA batch_norm for a
//   2-D contiguous 16-bit input with 16-bit weight (cuDNN is not used there): the
//   channels-last elementwise kernel computes `w * (x - mean) * invstd + b` in
//   float32 (nvcc contracts the last multiply-add) with invstd = rsqrt(var + eps),
//   and rounds once.
// Expected error: that of PyTorch's own 16-bit path (the rounding points are
// the same; the float32 sums differ only in order).  Tensor-core accumulation
// is float32 as cuBLAS's; no split-K.
//
// Tensors (16-bit elements of one type; row-major, contiguous)
//   x    (M, K)  K-major == the mma "row" A operand
//   w    (N, K)  K-major == the mma "col" B operand (nn.Linear's weight layout)
//   out  (M, N)
//   bias, scale, bn_weight, bn_bias, running_mean, running_var  (N)
//   part_mean, part_m2  (ceil(M / BLOCK_M), N) float32          (kTrain)
//   num_batches_tracked  int64: CTA (0, 0) adds 1 (kTrain), nn.BatchNorm1d's
//     first step; the later kernels of the call see it by stream order.
//
// Tiling: BLOCK_M x BLOCK_N x BLOCK_K = 128 (batch) x 128 (features) x 32 per
// CTA, 8 warps in a 2 x 4 grid of 64 x 32 warp tiles, mma.sync.m16n8k16 with
// float32 accumulators (64 per thread), a kNumStages-deep cp.async ring of
// 16 KB stages (64 KB), two CTAs per SM (__launch_bounds__ caps registers at 128).
// Shared memory rows are 64 bytes (BLOCK_K halves); 16-byte chunk c of row r
// is stored at chunk c ^ ((r / 2) % 4), so the 8 row addresses of every
// ldmatrix phase and of every cp.async phase fall on 8 distinct 16-byte bank
// groups (conflict-free).  Epilogue: the tile is staged in shared memory
// (row pitch BLOCK_N + 8 elements: the fragment pair stores are conflict-free),
// then written with 16-byte coalesced stores.
//
// Loads: 16-byte cp.async (zero-filled past M, N or K) when K % 8 == 0 and x
// and w are 16-byte aligned (kVec16); otherwise a guarded element-wise path
// (plain loads, correct for any K and alignment, slower).  Any M, N >= 1, K >= 0.
// Nothing is written past M or N.
//
// Sources: PTX ISA, "Warp Level Matrix Multiply-Accumulate Instructions":
// mma.sync (section "Matrix Fragments for mma.m16n8k16 with floating point
// type": A a0..a3 = rows g / g+8, k 2t..2t+1 / +8; B b0, b1 = k 2t..2t+1 / +8,
// column g; C c0..c3 = rows g / g+8, columns 2t, 2t+1), ldmatrix (".m8n8.x4.b16":
// lane l addresses row l % 8 of matrix l / 8; each lane receives row l / 4,
// elements 2 (l % 4), +1 of every matrix); "Data Movement and Conversion
// Instructions": cp.async (.cg, 16 bytes, src-size 0 zero-fills).
//
// Launchers return the launch error (cudaSuccess if none); they never synchronise.

#include <cuda_runtime.h>
#include <stdint.h>

#include "cp_async.cuh"
#include "launchers.cuh"
#include "lowp_mma.cuh"
#include "lowp_types.cuh"

namespace fused_gemm_bn {
namespace lowp {

struct GemmTraits {
  static constexpr int BLOCK_M = 128;  // batch rows per CTA: one statistics tile
  static constexpr int BLOCK_N = 128;  // features per CTA
  static constexpr int BLOCK_K = 32;
  static constexpr int WARPS_M = 2;
  static constexpr int WARPS_N = 4;
  static constexpr int WARP_M = BLOCK_M / WARPS_M;  // 64
  static constexpr int WARP_N = BLOCK_N / WARPS_N;  // 32
  static constexpr int MMA_M = 16;
  static constexpr int MMA_N = 8;
  static constexpr int MMA_K = 16;
  static constexpr int kMmaTilesM = WARP_M / MMA_M;  // 4
  static constexpr int kMmaTilesN = WARP_N / MMA_N;  // 4
  static constexpr int kKSteps = BLOCK_K / MMA_K;    // 2
  static constexpr int kNumThreads = WARPS_M * WARPS_N * 32;
  static constexpr int kNumStages = 4;
  static constexpr int kMinBlocksPerSm = 2;
  static constexpr int ELEM_BYTES = 2;
  static constexpr int CHUNK_BYTES = 16;
  static constexpr int CHUNK_ELEMS = CHUNK_BYTES / ELEM_BYTES;     // 8
  static constexpr int ROW_BYTES = BLOCK_K * ELEM_BYTES;           // 64
  static constexpr int CHUNKS_PER_ROW = ROW_BYTES / CHUNK_BYTES;   // 4
  static constexpr int A_STAGE_BYTES = BLOCK_M * ROW_BYTES;        // 8 KB
  static constexpr int B_STAGE_BYTES = BLOCK_N * ROW_BYTES;        // 8 KB
  static constexpr int STAGE_BYTES = A_STAGE_BYTES + B_STAGE_BYTES;
  static constexpr int PIPE_BYTES = kNumStages * STAGE_BYTES;      // 64 KB
  // Epilogue, in the pipeline's shared memory once the main loop is done.
  static constexpr int TILE_PITCH_ELEMS = BLOCK_N + 8;
  static constexpr int TILE_BYTES = BLOCK_M * TILE_PITCH_ELEMS * ELEM_BYTES;
  static constexpr int kNumColParams = 6;  // bias, scale, bn.weight, bn.bias, running_mean, invstd
  static constexpr int PARAM_BYTES = kNumColParams * BLOCK_N * 4;
  static constexpr int RED_BYTES = 2 * BLOCK_N * 4;  // one partial sum per (row half, column)
  static constexpr int MEAN_BYTES = BLOCK_N * 4;
  static constexpr int EPI_BYTES = TILE_BYTES + PARAM_BYTES + RED_BYTES + MEAN_BYTES;
  static constexpr int SMEM_BYTES = PIPE_BYTES > EPI_BYTES ? PIPE_BYTES : EPI_BYTES;

  static_assert(BLOCK_M == BLOCK_N, "load_tile copies BLOCK_M-row tiles of x and of w alike");
  static_assert(CHUNKS_PER_ROW == 4, "the swizzle permutes the 4 chunks of a 64-byte row");
  static_assert(kMmaTilesN % 2 == 0, "one ldmatrix.x4 loads the B fragments of two mma tiles");
  static_assert(kNumThreads == 2 * BLOCK_N, "the statistics give each column two threads (row halves)");
  static_assert((BLOCK_M * CHUNKS_PER_ROW) % kNumThreads == 0, "tile copies split evenly over threads");
  static_assert((TILE_PITCH_ELEMS * ELEM_BYTES) % 16 == 0, "staged rows stay 16-byte aligned");
  static_assert(kNumStages >= 2, "the ring needs two stages");
};

enum class Mode { kTrain, kEval };

struct GemmArgs {
  const uint16_t* x;  // (M, K)
  const uint16_t* w;  // (N, K)
  uint16_t* out;      // (M, N)
  int M, N, K;
  const uint16_t* bias;
  const uint16_t* scale;
  int scale_stride;              // 1, or 0: one number for every feature
  const uint16_t* bn_weight;     // kEval
  const uint16_t* bn_bias;       // kEval
  const uint16_t* running_mean;  // kEval
  const uint16_t* running_var;   // kEval
  float eps;                     // kEval
  bool scale_after_bn;           // false: problem 33 (scale, then BatchNorm); true: problem 84
  float* part_mean;              // kTrain
  float* part_m2;                // kTrain
  int64_t* num_batches_tracked;  // kTrain; may be null
  uint16_t* z_out;               // kTrain; may be null: also z = rnd(acc + bias) (M, N), for the backward
};

namespace gemm {

// Byte offset of 16-byte chunk `chunk` of row `row` in a stage's x or w tile.
__device__ __forceinline__ int tile_offset(int row, int chunk) {
  return row * GemmTraits::ROW_BYTES + ((chunk ^ ((row >> 1) & 3)) << 4);
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Copies rows row0 .. row0 + 127 (those < rows) and columns k0 .. k0 + 31 (those
// < K) of the K-major (rows, K) matrix g into a stage tile; zeros elsewhere.
template <bool kVec16>
__device__ __forceinline__ void load_tile(uint8_t* tile, const uint16_t* __restrict__ g, int row0, int rows, int k0,
                                          int K) {
  using TR = GemmTraits;
  constexpr int kChunks = TR::BLOCK_M * TR::CHUNKS_PER_ROW;
#pragma unroll
  for (int i = 0; i < kChunks / TR::kNumThreads; ++i) {
    const int c = threadIdx.x + i * TR::kNumThreads;
    const int r = c / TR::CHUNKS_PER_ROW;
    const int ch = c % TR::CHUNKS_PER_ROW;
    const int k = k0 + ch * TR::CHUNK_ELEMS;
    const bool row_ok = row0 + r < rows;
    const uint16_t* src = g + static_cast<size_t>(row_ok ? row0 + r : 0) * K + k;
    if constexpr (kVec16) {
      const bool valid = row_ok && k < K;  // K % 8 == 0: a chunk is wholly inside or outside
      cp_async<16>(tile + tile_offset(r, ch), valid ? src : g, valid);
    } else {
      uint16_t v[TR::CHUNK_ELEMS];
#pragma unroll
      for (int e = 0; e < TR::CHUNK_ELEMS; ++e) v[e] = (row_ok && k + e < K) ? src[e] : uint16_t(0);
      *reinterpret_cast<uint4*>(tile + tile_offset(r, ch)) =
          make_uint4(pack2(v[0], v[1]), pack2(v[2], v[3]), pack2(v[4], v[5]), pack2(v[6], v[7]));
    }
  }
}

}  // namespace gemm

template <typename T, Mode kMode, bool kVec16>
__global__ void __launch_bounds__(GemmTraits::kNumThreads, GemmTraits::kMinBlocksPerSm)
    sm80_gemm_bn_16bit_kernel(const GemmArgs args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using TR = GemmTraits;
  using namespace gemm;
  extern __shared__ __align__(128) uint8_t smem[];

  const int M = args.M, N = args.N, K = args.K;
  // blockIdx.x walks M fastest: the CTAs sharing one w tile run together, so w
  // (the large operand) streams from DRAM about once and x stays in L2.
  const int m_tile = blockIdx.x;
  const int m0 = m_tile * TR::BLOCK_M;
  const int n0 = blockIdx.y * TR::BLOCK_N;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int wm = warp / TR::WARPS_N;
  const int wn = warp % TR::WARPS_N;
  const int g = lane / 4;
  const int t = lane % 4;

  if constexpr (kMode == Mode::kTrain) {
    if (args.num_batches_tracked != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0)
      *args.num_batches_tracked += 1;
  }

  float acc[TR::kMmaTilesM][TR::kMmaTilesN][4];
#pragma unroll
  for (int mi = 0; mi < TR::kMmaTilesM; ++mi)
#pragma unroll
    for (int ni = 0; ni < TR::kMmaTilesN; ++ni)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[mi][ni][r] = 0.f;

  // ldmatrix addresses of this lane within a stage tile.  A (x), matrices
  // 0..3 = (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15),
  // (rows 8-15, k 8-15) of the 16 x 16 mma tile: a0..a3.  B (w, rows = n),
  // matrices 0..3 = (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7),
  // (n 8-15, k 8-15): b0, b1 of mma tile 2p, then of 2p + 1.
  int a_off[TR::kMmaTilesM][TR::kKSteps], b_off[TR::kMmaTilesN / 2][TR::kKSteps];
#pragma unroll
  for (int mi = 0; mi < TR::kMmaTilesM; ++mi) {
    const int row = wm * TR::WARP_M + mi * TR::MMA_M + lane % 8 + ((lane / 8) % 2) * 8;
#pragma unroll
    for (int ks = 0; ks < TR::kKSteps; ++ks) a_off[mi][ks] = tile_offset(row, 2 * ks + lane / 16);
  }
#pragma unroll
  for (int p = 0; p < TR::kMmaTilesN / 2; ++p) {
    const int row = wn * TR::WARP_N + p * 2 * TR::MMA_N + lane % 8 + (lane / 16) * 8;
#pragma unroll
    for (int ks = 0; ks < TR::kKSteps; ++ks) b_off[p][ks] = tile_offset(row, 2 * ks + (lane / 8) % 2);
  }

  const int num_k_tiles = (K + TR::BLOCK_K - 1) / TR::BLOCK_K;
  auto load_stage = [&](int k_tile) {
    uint8_t* stage = smem + (k_tile % TR::kNumStages) * TR::STAGE_BYTES;
    load_tile<kVec16>(stage, args.x, m0, M, k_tile * TR::BLOCK_K, K);
    load_tile<kVec16>(stage + TR::A_STAGE_BYTES, args.w, n0, N, k_tile * TR::BLOCK_K, K);
  };

#pragma unroll
  for (int s = 0; s < TR::kNumStages - 1; ++s) {
    if (s < num_k_tiles) load_stage(s);
    cp_async_commit();
  }

  const uint32_t smem_base = smem_addr(smem);
  for (int k_tile = 0; k_tile < num_k_tiles; ++k_tile) {
    cp_async_wait<TR::kNumStages - 2>();
    // Stage k_tile is visible to every warp, and the stage the next load
    // overwrites (consumed in iteration k_tile - 1) is free.
    __syncthreads();
    if (k_tile + TR::kNumStages - 1 < num_k_tiles) load_stage(k_tile + TR::kNumStages - 1);
    cp_async_commit();

    const uint32_t a_stage = smem_base + (k_tile % TR::kNumStages) * TR::STAGE_BYTES;
    const uint32_t b_stage = a_stage + TR::A_STAGE_BYTES;
#pragma unroll
    for (int ks = 0; ks < TR::kKSteps; ++ks) {
      uint32_t a[TR::kMmaTilesM][4], b[TR::kMmaTilesN / 2][4];
#pragma unroll
      for (int mi = 0; mi < TR::kMmaTilesM; ++mi) ldmatrix_x4(a[mi], a_stage + a_off[mi][ks]);
#pragma unroll
      for (int p = 0; p < TR::kMmaTilesN / 2; ++p) ldmatrix_x4(b[p], b_stage + b_off[p][ks]);
#pragma unroll
      for (int mi = 0; mi < TR::kMmaTilesM; ++mi)
#pragma unroll
        for (int ni = 0; ni < TR::kMmaTilesN; ++ni)
          mma16816<T>(acc[mi][ni], a[mi], b[ni / 2][2 * (ni % 2)], b[ni / 2][2 * (ni % 2) + 1]);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with the ring: its shared memory is reused below

  // ---- Epilogue -----------------------------------------------------------
  uint16_t* tile = reinterpret_cast<uint16_t*>(smem);  // [BLOCK_M][TILE_PITCH_ELEMS]
  float* params = reinterpret_cast<float*>(smem + TR::TILE_BYTES);  // [kNumColParams][BLOCK_N]
  float* red = params + TR::kNumColParams * TR::BLOCK_N;             // [2][BLOCK_N]
  float* tile_mean = red + 2 * TR::BLOCK_N;                          // [BLOCK_N]
  float* p_bias = params;
  float* p_scale = params + TR::BLOCK_N;
  float* p_weight = params + 2 * TR::BLOCK_N;
  float* p_beta = params + 3 * TR::BLOCK_N;
  float* p_mean = params + 4 * TR::BLOCK_N;
  float* p_invstd = params + 5 * TR::BLOCK_N;

  if (threadIdx.x < TR::BLOCK_N) {
    const int col = n0 + threadIdx.x;
    const bool ok = col < N;
    p_bias[threadIdx.x] = ok ? load_float<T>(args.bias + col) : 0.f;
    p_scale[threadIdx.x] = ok ? load_float<T>(args.scale + col * args.scale_stride) : 0.f;
    if constexpr (kMode == Mode::kEval) {
      p_weight[threadIdx.x] = ok ? load_float<T>(args.bn_weight + col) : 0.f;
      p_beta[threadIdx.x] = ok ? load_float<T>(args.bn_bias + col) : 0.f;
      p_mean[threadIdx.x] = ok ? load_float<T>(args.running_mean + col) : 0.f;
      p_invstd[threadIdx.x] = ok ? rsqrtf(load_float<T>(args.running_var + col) + args.eps) : 0.f;
    }
  }
  __syncthreads();

  // The value the module's chain gives for accumulator v of tile column c,
  // before its final rounding (the store rounds).
  auto chain = [&](float v, int c) -> float {
    const float z = round16<T>(v + p_bias[c]);
    if constexpr (kMode == Mode::kTrain) {
      return args.scale_after_bn ? z : round16<T>(z * p_scale[c]);
    } else {
      if (!args.scale_after_bn) {
        const float y = round16<T>(z * p_scale[c]);
        return fmaf(p_weight[c] * (y - p_mean[c]), p_invstd[c], p_beta[c]);
      }
      const float y = round16<T>(fmaf(p_weight[c] * (z - p_mean[c]), p_invstd[c], p_beta[c]));
      return y * p_scale[c];
    }
  };

  // Accumulator element (mi, ni, r): tile row wm * WARP_M + mi * 16 + g + 8 (r / 2),
  // tile column wm * WARP_N + ni * 8 + 2 t + r % 2: f(v, column) staged into the tile, rounded.
  auto stage_tile = [&](auto f) {
#pragma unroll
    for (int mi = 0; mi < TR::kMmaTilesM; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int trow = wm * TR::WARP_M + mi * TR::MMA_M + g + 8 * h;
#pragma unroll
        for (int ni = 0; ni < TR::kMmaTilesN; ++ni) {
          const int tcol = wn * TR::WARP_N + ni * TR::MMA_N + 2 * t;
          const float v0 = f(acc[mi][ni][2 * h], tcol);
          const float v1 = f(acc[mi][ni][2 * h + 1], tcol + 1);
          *reinterpret_cast<uint32_t*>(tile + trow * TR::TILE_PITCH_ELEMS + tcol) =
              pack2(to_bits<T>(v0), to_bits<T>(v1));
        }
      }
    }
  };
  const int rows_valid = min(TR::BLOCK_M, M - m0);
  // The staged tile's valid part into dst (M, N).
  auto copy_tile_out = [&](uint16_t* dst) {
    if (N % TR::CHUNK_ELEMS == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
      constexpr int kChunksPerRow = TR::BLOCK_N / TR::CHUNK_ELEMS;
#pragma unroll
      for (int i = 0; i < TR::BLOCK_M * kChunksPerRow / TR::kNumThreads; ++i) {
        const int c = threadIdx.x + i * TR::kNumThreads;
        const int r = c / kChunksPerRow;
        const int col = (c % kChunksPerRow) * TR::CHUNK_ELEMS;
        if (r < rows_valid && n0 + col < N)
          *reinterpret_cast<uint4*>(dst + static_cast<size_t>(m0 + r) * N + n0 + col) =
              *reinterpret_cast<const uint4*>(tile + r * TR::TILE_PITCH_ELEMS + col);
      }
    } else {
#pragma unroll 4
      for (int e = threadIdx.x; e < TR::BLOCK_M * TR::BLOCK_N; e += TR::kNumThreads) {
        const int r = e / TR::BLOCK_N;
        const int col = e % TR::BLOCK_N;
        if (r < rows_valid && n0 + col < N) dst[static_cast<size_t>(m0 + r) * N + n0 + col] = tile[r * TR::TILE_PITCH_ELEMS + col];
      }
    }
  };

  if constexpr (kMode == Mode::kTrain) {
    if (args.z_out != nullptr) {  // the training forward with gradients: z first
      stage_tile([&](float v, int c) { return v + p_bias[c]; });
      __syncthreads();
      copy_tile_out(args.z_out);
      __syncthreads();  // every read of the tile is done before it is restaged
    }
  }
  stage_tile(chain);
  __syncthreads();
  copy_tile_out(args.out);

  if constexpr (kMode == Mode::kTrain) {
    // Per-column mean and M2 of the staged (already rounded) values over the
    // tile's valid rows: each column's two threads take one row half each.
    const int col = threadIdx.x % TR::BLOCK_N;
    const int half = threadIdx.x / TR::BLOCK_N;
    const int r_begin = half * (TR::BLOCK_M / 2);
    const int r_end = min(r_begin + TR::BLOCK_M / 2, rows_valid);
    const uint16_t* column = tile + col;
    float sum = 0.f;
#pragma unroll 8
    for (int r = r_begin; r < r_end; ++r) sum += load_float<T>(column + r * TR::TILE_PITCH_ELEMS);
    red[half * TR::BLOCK_N + col] = sum;
    __syncthreads();
    if (half == 0) tile_mean[col] = (red[col] + red[TR::BLOCK_N + col]) / static_cast<float>(rows_valid);
    __syncthreads();  // also: every read of `red` above is done before it is rewritten
    const float mu = tile_mean[col];
    float m2 = 0.f;
#pragma unroll 8
    for (int r = r_begin; r < r_end; ++r) {
      const float d = load_float<T>(column + r * TR::TILE_PITCH_ELEMS) - mu;
      m2 += d * d;
    }
    red[half * TR::BLOCK_N + col] = m2;
    __syncthreads();
    if (half == 0 && n0 + col < N) {
      args.part_mean[static_cast<size_t>(m_tile) * N + n0 + col] = mu;
      args.part_m2[static_cast<size_t>(m_tile) * N + n0 + col] = red[col] + red[TR::BLOCK_N + col];
    }
  }
#endif  // __CUDA_ARCH__ >= 800
}

template <typename T, Mode kMode, bool kVec16>
static cudaError_t launch_sm80_gemm_bn_16bit(const GemmArgs& args, cudaStream_t stream) {
  using TR = GemmTraits;
  auto kernel = sm80_gemm_bn_16bit_kernel<T, kMode, kVec16>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, TR::SMEM_BYTES);
  // The most shared memory per SM, so that kMinBlocksPerSm CTAs fit.
  if (err == cudaSuccess)
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  if (err != cudaSuccess) return err;
  const dim3 grid((args.M + TR::BLOCK_M - 1) / TR::BLOCK_M, (args.N + TR::BLOCK_N - 1) / TR::BLOCK_N);
  if (grid.y > 65535u) return cudaErrorInvalidConfiguration;
  kernel<<<grid, TR::kNumThreads, TR::SMEM_BYTES, stream>>>(args);
  return cudaGetLastError();
}

template <typename T>
static cudaError_t launch_for_type(const GemmArgs& args, bool train, cudaStream_t stream) {
  const bool vec16 = args.K % GemmTraits::CHUNK_ELEMS == 0 && reinterpret_cast<uintptr_t>(args.x) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(args.w) % 16 == 0;
  if (train) {
    return vec16 ? launch_sm80_gemm_bn_16bit<T, Mode::kTrain, true>(args, stream)
                 : launch_sm80_gemm_bn_16bit<T, Mode::kTrain, false>(args, stream);
  }
  return vec16 ? launch_sm80_gemm_bn_16bit<T, Mode::kEval, true>(args, stream)
               : launch_sm80_gemm_bn_16bit<T, Mode::kEval, false>(args, stream);
}

}  // namespace lowp
}  // namespace fused_gemm_bn

// ---------------------------------------------------------------------------
// Host launchers (raw pointers; no torch types so nvcc compiles this file alone)
// ---------------------------------------------------------------------------

int fused_gemm_bn::lowp_gemm_block_m() { return lowp::GemmTraits::BLOCK_M; }

// bn.dtype: 0 = IEEE half, 1 = bfloat16 (lowp::Dtype).  train: out = u and the
// per-tile statistics (part_mean / part_m2, ceil(M / 128) x N float32), and
// bn.num_batches_tracked += 1 (if not null), and with z_out also z = rnd(x w^T + bias)
// (M, N); else the eval chain (running_mean, running_var, bn_weight, bn_bias, eps
// used).  scale_after_bn: problem 84's order.  The kernel's fields of the other mode
// stay null / 0; float32_io (float32 vectors) is lowp_sm90_gemm_bn's.
cudaError_t fused_gemm_bn::lowp_gemm_bn(const LowpBatchNormArgs& bn, bool train, const void* x, const void* w,
                                        void* out, int M, int N, int K, float* part_mean, float* part_m2, void* z_out,
                                        cudaStream_t stream) {
  using namespace fused_gemm_bn::lowp;
  if (M == 0 || N == 0) return cudaSuccess;
  if (bn.float32_io) return cudaErrorInvalidValue;
  GemmArgs args{};
  args.x = static_cast<const uint16_t*>(x);
  args.w = static_cast<const uint16_t*>(w);
  args.out = static_cast<uint16_t*>(out);
  args.M = M;
  args.N = N;
  args.K = K;
  args.bias = static_cast<const uint16_t*>(bn.bias);
  args.scale = static_cast<const uint16_t*>(bn.scale);
  args.scale_stride = bn.scale_stride;
  args.bn_weight = train ? nullptr : static_cast<const uint16_t*>(bn.bn_weight);
  args.bn_bias = train ? nullptr : static_cast<const uint16_t*>(bn.bn_bias);
  args.running_mean = train ? nullptr : static_cast<const uint16_t*>(bn.running_mean);
  args.running_var = train ? nullptr : static_cast<const uint16_t*>(bn.running_var);
  args.eps = train ? 0.f : bn.eps;
  args.scale_after_bn = bn.scale_after_bn;
  args.part_mean = part_mean;
  args.part_m2 = part_m2;
  args.num_batches_tracked = train ? bn.num_batches_tracked : nullptr;
  args.z_out = train ? static_cast<uint16_t*>(z_out) : nullptr;
  return dispatch_dtype(bn.dtype,
                        [&](auto t) { return launch_for_type<typename decltype(t)::type>(args, train, stream); });
}
