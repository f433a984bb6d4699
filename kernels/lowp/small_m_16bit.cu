// small_m_16bit.cu -- the 16-bit Linear at a few batch rows (M = 1 .. 32): z = rnd(x W^T +
// bias) in x's dtype T (__half or __nv_bfloat16), W read once.  The product of the
// lowp_small_m route (model_new_lowp.py): the same z as lowp_cublas's at::linear (float32
// accumulation, the bias added in float32, one rounding), with the BatchNorm in its epilogue
// (below) or followed by the same chain kernels (bn_16bit_chain.cu, bn_16bit_strip.cu,
// bn_16bit.cu).  mma.sync m16n8k16, cp.async: sm_80+ (the route: Hopper).
//
// Why (H200, docs/perf.md v98): at a few rows the product is a read of W (N K 2 bytes:
// 128 MB at N = K = 8192, 31.5 us as half a copy of its size).  This kernel takes 36-37 us
// there at 1-8 rows; cuBLAS's float16 kernels 40-41 us (its bfloat16 ones 35.5-36.5), and
// cuBLAS's host path (cublasLt through at::linear) adds ~20 us to a synchronized call.
// At 9-16 rows (v102) it takes 37.4-38.7 us against cuBLAS's 36.1-36.4, and the module gains it
// back where the BatchNorm runs in the epilogue (training 0.75-0.86 of lowp_cublas's time).
// At 17-32 rows (v103-v104) the module's training calls take 0.78-0.91 of lowp_cublas's time back to
// back and 0.67-0.82 synchronized at 8192 x 8192; its eval calls 1.03-1.10 back to back (the
// product ~3 us behind cuBLAS's) and 0.84-0.89 synchronized.
//
// Formula (f(v) = float(v) of a 16-bit value; rnd = round to T, nearest even)
//   acc[m, n] = sum_k f(x[m, k]) f(w[n, k])     exact products, float32 sums: per warp
//                                               over its K slice on the tensor cores,
//                                               then the CTA's K slices in slice order,
//                                               then the K pieces in piece order
//   z[m, n]   = rnd(acc[m, n] + f(bias[n]))     bias T, or float32 rounded to T first
//                                               (bias_float32: autocast's cast of the
//                                               bias, as lowp_cublas casts it); null: 0
// Expected error: that of cuBLAS's 16-bit product (eager nn.Linear): the rounding to T
// dominates; the float32 sums differ from cuBLAS's in order only (relative ~K 2^-24 at
// worst against T's 2^-11 or 2^-8), so z is eager's z but where the float32 sum lies
// within a few float32 ulps of a rounding boundary of T (0.95-0.98 of the elements equal;
// the largest error against float64 at most eager's in every measured case).
//
// Tensors (row-major, contiguous, 16-byte aligned; K % 8 == 0, so rows are whole
// 16-byte pieces: the binding copies a misaligned operand, the route needs K % 8 == 0)
//   x (M, K) T; w (N, K) T, nn.Linear's layout; bias (N) T or float32, or null;
//   z (M, N) T;  partials (pieces, M, N) float32 where K is split into pieces > 1
//   (plan below), else unused.
//
// Work split
//   CTA: BLOCK_N = 32 features (two 16-feature tiles: mma's A rows) x kRows = 8 batch
//   rows (M <= 8), 16 (M = 9 .. 16) or 32 (M = 17 .. 32; two or four column blocks of 8, each
//   W fragment feeding two or four mmas) (mma's B columns; rows past M zero-filled, never
//   stored) x one K piece; 8 warps = 2 tiles x 4 K slices of each stage's BLOCK_K = 256 k (two
//   32-k chunks a warp).  At 32 rows, where N / 64 CTAs fill at least 0.9 of the SMs, BLOCK_N =
//   64 (each warp two tiles; one CTA an SM): every CTA reads all of x from L2, and at 32 rows x
//   is as many bytes as the CTA's W (x's L2 traffic per W byte is kRows / BLOCK_N); 64 features
//   took 0.94-1.02 of 32 features' time at 8192 x 8192 (v104).  The
//   CTA takes its stages in a rotated order, from stage blockIdx.x % stages: every CTA
//   reads all of x from L2, and in one order all of them ask for the same lines at once
//   (a first version, in one order and reading x's last row in place of the rows past
//   M, took 43 us for 1 row at 8192 x 8192; this one 36.6).  Each W element is
//   read from DRAM once, by one CTA.  K is split into pieces only where the feature
//   blocks leave SMs idle (fewer than the SMs), each piece at least kMinStagesPerPiece long.
//   Ring: kStages stages of (BLOCK_N + kRows) rows x 512 bytes, each row padded to
//   576 bytes (64 mod 128: a warp's 16-byte reads of 8 rows x 4 lanes a quarter are
//   bank-conflict free), filled by 16-byte cp.async (one warp a row); k past K and rows
//   past N and M zero-filled, not read (both operands: no Inf x 0); kStages - 1 stages
//   in flight, one __syncthreads a stage; 92 KB (8 rows) or 108 KB (16; 32 rows x 32 features
//   with 3 stages), two CTAs a Hopper SM; 216 KB (32 x 64), one (the 16-row ring exceeds
//   sm_86/89's shared memory, the 32 x 64 one sm_80's: the route runs on Hopper only).
//   Fragments: lane (g, t) reads 16 bytes of rows g and g + 8 of its W tile and of x's
//   row g at k 8t .. 8t + 7 of a 32-k chunk; the chunk's two k16 steps take halves
//   {0, 1 | 2, 3} and {4, 5 | 6, 7} as mma's k {2t, 2t + 1 | 2t + 8, 2t + 9}: the same
//   permutation of k in A and B, so each product pairs x[m, k] with w[n, k].
//   End: the 4 K slices' accumulators through shared memory, summed in slice order by
//   one thread an output (feature fastest: 64- or 128-byte runs of z), then z (pieces == 1) or
//   the piece's float32 sums to partials, and small_m_16bit_finish_kernel (a
//   programmatic dependent launch, pdl.cuh) adds the pieces in piece order, the bias,
//   and rounds.  No atomics: the same bits on every run (of one plan: the stages' rotation
//   orders each feature's float32 sums by its CTA's index, so another CTA shape may differ in
//   the last bit, as cuBLAS's kernels do from each other).
// BatchNorm in the epilogue (lowp_small_m_linear_bn, where lowp_small_m_fuses: one K piece, 16-bit
// vectors, N % 8 == 0): training, each CTA also keeps its z tile (kRows x BLOCK_N, 16-bit) in
// shared memory after the reduction, and its first BLOCK_N threads compute from it what
// bn16_strip_train_rows gives (strip::rows_feature, bn_16bit_strip.cuh: the statistics (at 17-32 rows
// the sliced kernel's), the running statistics, coeff,
// problem 33's out; 84's u where out is not z), one thread a feature; eval (problem 33), each
// thread applies bn16_chain_eval's step (eval_out, lowp_chain.cuh) to its output, the feature's
// vectors read before the main loop.  The same bits as the product then the strip or chain
// kernel, one launch and one pass over z fewer (docs/perf.md v101).
//
// Sources: PTX ISA, "Warp Level Matrix Multiply-Accumulate Instructions" (mma.m16n8k16
// fragments: lowp_mma.cuh), "cp.async" (cp_async.cuh).

#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>

#include "bn_16bit_strip.cuh"
#include "cp_async.cuh"
#include "launchers.cuh"
#include "lowp_chain.cuh"
#include "lowp_coeff.cuh"
#include "lowp_mma.cuh"
#include "lowp_types.cuh"
#include "pdl.cuh"

namespace fused_gemm_bn {
namespace lowp {
namespace small_m {

constexpr int BLOCK_K = 256;               // k per stage: 512 bytes of a row
constexpr int kRowBytes = 576;             // a stage row in shared memory: 512 + 64 bytes
constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kChunkK = 32;                // k a warp's 16-byte loads cover (4 lanes x 8)
constexpr int kPiecesPerRow = BLOCK_K * 2 / 16;       // 16-byte copies a stage row
constexpr int kMaxRows = 32;               // batch rows: M <= 32
constexpr int kMinStagesPerPiece = 4;      // a K piece streams at least this many stages
constexpr int kMaxSmemBytes = 227 * 1024;  // a Hopper CTA's dynamic shared memory

// The CTA's batch rows for M rows: 8 (M <= 8), 16 (M <= 16) or 32.
constexpr int cta_rows(int M) { return M <= 8 ? 8 : M <= 16 ? 16 : 32; }
// Its features: 32, or at 32 rows 64 where N / 64 CTAs fill at least 0.9 of the SMs (one CTA an SM;
// N = 8192: 0.94-1.02 of 32 features' time, docs/perf.md v104), else 32 (two CTAs an SM: at N = 4096
// 64 features split K and leave the BatchNorm unfused: 0.97-1.28x the time).
constexpr int cta_features(int rows, int N, int num_sms) {
  return rows == 32 && 10 * ((N + 63) / 64) >= 9 * num_sms ? 64 : 32;
}

// A CTA of kRows batch rows (8: M <= 8, one mma column block; 16: M = 9 .. 16, two; 32: M = 17 ..
// 32, four) and kBlockN features (32; 64 at 32 rows only): its warps' work, its ring and the
// epilogue's shared memory.
template <int kRows, int kBlockN>
struct Shape {
  static_assert(kRows == 8 || kRows == 16 || kRows == 32, "one, two or four mma column blocks of 8 rows");
  static_assert(kBlockN == 32 || (kBlockN == 64 && kRows == 32), "32 features, or 64 at 32 rows");
  static constexpr int BLOCK_N = kBlockN;
  static constexpr int kBlocks = kRows / 8;            // mma column blocks (x's rows 8 nb .. 8 nb + 7)
  static constexpr int kTiles = BLOCK_N / 16;          // 16-feature tiles (mma's M)
  static constexpr int kWarpTiles = kTiles / 2;        // tiles a warp: each x fragment feeds them all
  static constexpr int kWarpsN = kTiles / kWarpTiles;  // 2
  static constexpr int kWarpsK = kWarps / kWarpsN;     // K slices of a stage: 4
  static constexpr int kChunks = BLOCK_K / kWarpsK / kChunkK;  // chunks a warp a stage: 2
  static constexpr int kStages = kRows == 32 && kBlockN == 32 ? 3 : 4;  // 32 x 32: 3, so that two CTAs fit an SM
  static constexpr int kStageRows = BLOCK_N + kRows;
  static constexpr int kStageBytes = kStageRows * kRowBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes;  // 92 KB (8 rows), 108 KB (16; 32 x 32), 216 KB (32 x 64)
  static constexpr int kCtasPerSm = kSmemBytes * 2 <= kMaxSmemBytes ? 2 : 1;  // on Hopper: two, but one for 32 x 64
  static constexpr int kReduceBytes = kWarpsK * kTiles * kBlocks * 4 * 32 * 4;  // the K slices' sums, then kTrain's z
  static_assert(kStageRows * kPiecesPerRow % kThreads == 0 && kStageRows % kWarps == 0,
                "a stage's copies are whole rounds of the CTA");
  static_assert(kReduceBytes + BLOCK_N * kRows * 2 <= kSmemBytes && kReduceBytes % 16 == 0,
                "the K-slice reduction and the z tile fit the ring");
  static_assert(kSmemBytes <= kMaxSmemBytes, "the ring fits a Hopper CTA");
  static_assert(BLOCK_N <= kThreads && kThreads % BLOCK_N == 0, "the epilogue: each thread's outputs of one feature");
};

// What the kernel's end does with z (one K piece; lowp_small_m_linear_bn): kZ stores z alone;
// kTrain also runs bn16_strip_train_rows's BatchNorm on the CTA's features (strip::rows_feature
// over z in shared memory); kEval (problem 33) stores bn16_chain_eval's out (and z where out is
// not z).
enum Epilogue : int { kZ = 0, kTrain = 1, kEval = 2 };

struct Args {
  const uint16_t* x;
  const uint16_t* w;
  const void* bias;  // T, or float32 (bias_float32); null: 0
  uint16_t* z;
  float* partials;   // pieces > 1
  int M, N, K;
  int pieces, stages_per_piece;
  int block_n;       // the CTA's features (plan)
  bool bias_float32;
  strip::Args bn;    // kTrain, kEval: z, out, the vectors (16-bit), coeff, eps; kTrain the rest
};

template <typename T>
__device__ __forceinline__ float bias_of(const Args& a, int n) {
  if (a.bias == nullptr) return 0.f;
  return a.bias_float32 ? round16<T>(static_cast<const float*>(a.bias)[n])
                        : load_float<T>(static_cast<const uint16_t*>(a.bias) + n);
}

// kEval: feature n's bn16_chain_eval coefficients, read before the main loop (scale, bn.weight,
// bn.bias, running_mean, invstd = rsqrtf(running_var + eps): bn16_chain_eval's values).
struct EvalVectors {
  float scale, w, b, rm, invstd;
};
template <typename T>
__device__ __forceinline__ EvalVectors eval_vectors(const strip::Args& bn, int n) {
  using St = Storage<T>;
  const uint16_t* const vectors[5] = {static_cast<const uint16_t*>(bn.scale), static_cast<const uint16_t*>(bn.bn_weight),
                                      static_cast<const uint16_t*>(bn.bn_bias),
                                      static_cast<const uint16_t*>(bn.running_mean),
                                      static_cast<const uint16_t*>(bn.running_var)};
  return {St::load(vectors[0] + static_cast<size_t>(n) * bn.scale_stride), St::load(vectors[1] + n),
          St::load(vectors[2] + n), St::load(vectors[3] + n), rsqrtf(St::load(vectors[4] + n) + bn.eps)};
}

template <typename T, int kEpi, int kRows, int kBlockN>
__global__ void __launch_bounds__(kThreads, Shape<kRows, kBlockN>::kCtasPerSm) small_m_16bit_kernel(const Args a) {
  using Sh = Shape<kRows, kBlockN>;
  constexpr int BLOCK_N = Sh::BLOCK_N;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  extern __shared__ __align__(128) uint8_t smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int n0 = blockIdx.x * BLOCK_N, piece = blockIdx.y;
  EvalVectors ev{};
  if constexpr (kEval == kEpi) {
    if (n0 + static_cast<int>(threadIdx.x) % BLOCK_N < a.N) ev = eval_vectors<T>(a.bn, n0 + threadIdx.x % BLOCK_N);
  }
  const int stages_total = (a.K + BLOCK_K - 1) / BLOCK_K;
  const int stage_begin = piece * a.stages_per_piece;
  const int num_stages = min(stages_total, stage_begin + a.stages_per_piece) - stage_begin;

  // The CTA's stages in a rotated order, starting at stage blockIdx.x % num_stages, so that
  // the CTAs streaming at once read different k of x (every CTA reads all of x from L2:
  // in one order, every CTA would ask for the same lines at once).
  const int rotation = num_stages > 0 ? static_cast<int>(blockIdx.x % num_stages) : 0;
  // Stage s's copies: warp w takes rows w, w + 8, ...; a row's 32 lanes its 32 pieces.
  // Rows past N (W) and M (x) and k past K are zero-filled, not read.
  auto load_stage = [&](int slot, int s) {
    uint8_t* stage = smem + slot * Sh::kStageBytes;
    const int rotated = s + rotation < num_stages ? s + rotation : s + rotation - num_stages;
    const int k = (stage_begin + rotated) * BLOCK_K + 8 * lane;
#pragma unroll
    for (int i = 0; i < Sh::kStageRows / kWarps; ++i) {
      const int row = warp + kWarps * i;
      const bool w_row = row < BLOCK_N;
      const int r = w_row ? n0 + row : row - BLOCK_N;
      const bool valid = k < a.K && r < (w_row ? a.N : a.M);
      const uint16_t* src = (w_row ? a.w : a.x) + (valid ? static_cast<size_t>(r) * a.K + k : 0);
      cp_async<16>(stage + row * kRowBytes + 16 * lane, src, valid);
    }
  };

#pragma unroll
  for (int s = 0; s < Sh::kStages - 1; ++s) {
    if (s < num_stages) load_stage(s, s);
    cp_async_commit();
  }

  // Warp: tiles kWarpTiles wn .. kWarpTiles (wn + 1) - 1 of the CTA's features, K slice `slice`.
  const int wn = warp % Sh::kWarpsN, slice = warp / Sh::kWarpsN;
  float acc[Sh::kWarpTiles][Sh::kBlocks][4] = {};

  for (int s = 0; s < num_stages; ++s) {
    cp_async_wait<Sh::kStages - 2>();
    __syncthreads();  // stage s landed for every thread; stage s - 1's slot read by every warp
    if (s + Sh::kStages - 1 < num_stages) load_stage((s + Sh::kStages - 1) % Sh::kStages, s + Sh::kStages - 1);
    cp_async_commit();
    const uint8_t* stage = smem + (s % Sh::kStages) * Sh::kStageBytes;
#pragma unroll
    for (int c = 0; c < Sh::kChunks; ++c) {
      const int byte = ((slice * Sh::kChunks + c) * kChunkK) * 2 + 16 * t;
#pragma unroll
      for (int wt = 0; wt < Sh::kWarpTiles; ++wt) {
        const int tile = Sh::kWarpTiles * wn + wt;
        const uint4 w0 = *reinterpret_cast<const uint4*>(stage + (16 * tile + g) * kRowBytes + byte);
        const uint4 w1 = *reinterpret_cast<const uint4*>(stage + (16 * tile + g + 8) * kRowBytes + byte);
        const uint32_t a0[4] = {w0.x, w1.x, w0.y, w1.y};
        const uint32_t a1[4] = {w0.z, w1.z, w0.w, w1.w};
#pragma unroll
        for (int nb = 0; nb < Sh::kBlocks; ++nb) {  // x's rows 8 nb + g
          const uint4 xb = *reinterpret_cast<const uint4*>(stage + (BLOCK_N + 8 * nb + g) * kRowBytes + byte);
          mma16816<T>(acc[wt][nb], a0, xb.x, xb.y);
          mma16816<T>(acc[wt][nb], a1, xb.z, xb.w);
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp done with the ring: it holds the K slices' sums now

  // red[slice][tile][nb][j][lane]: accumulator j of lane for column block nb, as the fragment holds it.
  float* red = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int wt = 0; wt < Sh::kWarpTiles; ++wt)
#pragma unroll
    for (int nb = 0; nb < Sh::kBlocks; ++nb)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        red[(((slice * Sh::kTiles + Sh::kWarpTiles * wn + wt) * Sh::kBlocks + nb) * 4 + j) * 32 + lane] =
            acc[wt][nb][j];
  __syncthreads();

  // One thread an output (feature f fastest, then batch row m), the slices in order.
  uint16_t* zs = reinterpret_cast<uint16_t*>(smem + Sh::kReduceBytes);  // kTrain: the CTA's z, rows BLOCK_N apart
  for (int o = threadIdx.x; o < BLOCK_N * kRows; o += kThreads) {
    const int f = o % BLOCK_N, m = o / BLOCK_N;
    const int n = n0 + f;
    if (n >= a.N || m >= a.M) continue;
    const int ti = f / 16, fr = f % 16, nb = m / 8, mm = m % 8;
    const int j = 2 * (fr / 8) + mm % 2, src_lane = 4 * (fr % 8) + mm / 2;
    float sum = 0.f;
#pragma unroll
    for (int sl = 0; sl < Sh::kWarpsK; ++sl)
      sum += red[(((sl * Sh::kTiles + ti) * Sh::kBlocks + nb) * 4 + j) * 32 + src_lane];
    if (a.pieces == 1) {
      const size_t at = static_cast<size_t>(m) * a.N + n;
      const uint16_t zb = to_bits<T>(sum + bias_of<T>(a, n));
      if (kEpi != kEval || a.z != a.bn.out) a.z[at] = zb;
      if constexpr (kEpi == kTrain) zs[m * BLOCK_N + f] = zb;
      if constexpr (kEpi == kEval) {  // bn16_chain_eval's out, and its coeff from the first row
        const float v = eval_out<T, T>(Bits<T>::to_float(zb), ev.scale, ev.w, ev.b, ev.rm, ev.invstd, false);
        static_cast<uint16_t*>(a.bn.out)[at] = to_bits<T>(v);
        if (a.bn.coeff != nullptr && m == 0) coeff_store1(a.bn.coeff, a.N, n, make_float4(ev.rm, ev.invstd, ev.w, ev.b));
      }
    } else {
      a.partials[(static_cast<size_t>(piece) * a.M + m) * a.N + n] = sum;
    }
  }
  if constexpr (kEpi == kTrain) {  // bn16_strip_train_rows's outputs on the CTA's features, one thread a feature
    __syncthreads();  // zs written
    if (blockIdx.x == 0 && threadIdx.x == 0 && a.bn.momentum >= 0.f) *a.bn.num_batches_tracked += 1;
    const int n = n0 + static_cast<int>(threadIdx.x);
    if (threadIdx.x < BLOCK_N && n < a.N) strip::rows_feature<T, T, kRows>(a.bn, n, zs + threadIdx.x, BLOCK_N);
  }
#endif
}

// pieces > 1: z = rnd(sum of the pieces in piece order + bias), one thread an element.
template <typename T>
__global__ void small_m_16bit_finish_kernel(const Args a) {
  pdl_wait_then_release();
  const int64_t total = static_cast<int64_t>(a.M) * a.N;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float sum = a.partials[i];
    for (int p = 1; p < a.pieces; ++p) sum += a.partials[p * total + i];
    a.z[i] = to_bits<T>(sum + bias_of<T>(a, static_cast<int>(i % a.N)));
  }
}

// The plan of an M x N x K call on `num_sms` SMs: the CTA's features, K pieces (1: none) and stages each.
inline void plan(int M, int N, int K, int num_sms, int* pieces, int* stages_per_piece, int* block_n_out) {
  const int block_n = cta_features(cta_rows(M), N, num_sms);
  *block_n_out = block_n;
  const int n_blocks = (N + block_n - 1) / block_n;
  const int stages = std::max(1, (K + BLOCK_K - 1) / BLOCK_K);
  // Split K only where the feature blocks leave SMs idle, each piece at least
  // kMinStagesPerPiece stages long.
  int p = std::max(1, std::min(num_sms / n_blocks, stages / kMinStagesPerPiece));
  const int per_piece = (stages + p - 1) / p;
  *pieces = (stages + per_piece - 1) / per_piece;  // no empty piece
  *stages_per_piece = per_piece;
}

template <typename T, int kEpi, int kRows, int kBlockN = 32>
static cudaError_t launch_rows(const Args& a, cudaStream_t stream) {
  auto kernel = small_m_16bit_kernel<T, kEpi, kRows, kBlockN>;
  constexpr int smem_bytes = Shape<kRows, kBlockN>::kSmemBytes;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err != cudaSuccess) return err;
  constexpr int BLOCK_N = kBlockN;
  const dim3 grid((a.N + BLOCK_N - 1) / BLOCK_N, a.pieces);
  kernel<<<grid, kThreads, smem_bytes, stream>>>(a);
  return cudaGetLastError();
}

// The product (and kEpi's epilogue) on the CTA shape of a.M rows and a.block_n features, then with K
// split the finish kernel.
template <typename T, int kEpi = kZ>
static cudaError_t launch(const Args& a, cudaStream_t stream) {
  const int rows = cta_rows(a.M);
  cudaError_t err = rows == 8        ? launch_rows<T, kEpi, 8>(a, stream)
                    : rows == 16     ? launch_rows<T, kEpi, 16>(a, stream)
                    : a.block_n == 64 ? launch_rows<T, kEpi, 32, 64>(a, stream)
                                      : launch_rows<T, kEpi, 32, 32>(a, stream);
  if (err != cudaSuccess || a.pieces == 1) return err;
  const int64_t total = static_cast<int64_t>(a.M) * a.N;
  const int blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 4096));
  return launch_kernel(small_m_16bit_finish_kernel<T>, blocks, 256, 0, stream, a);
}

}  // namespace small_m
}  // namespace lowp
}  // namespace fused_gemm_bn

// ---------------------------------------------------------------------------
// Host launchers (raw pointers; no torch types so nvcc compiles this file alone)
// ---------------------------------------------------------------------------

int fused_gemm_bn::lowp_small_m_max_rows() { return lowp::small_m::kMaxRows; }

int64_t fused_gemm_bn::lowp_small_m_workspace_floats(int M, int N, int K, int num_sms) {
  int pieces = 1, per_piece = 1;
  int block_n = 32;
  lowp::small_m::plan(M, N, K, num_sms, &pieces, &per_piece, &block_n);
  return pieces > 1 ? static_cast<int64_t>(pieces) * M * N : 0;
}

cudaError_t fused_gemm_bn::lowp_small_m_linear(int dtype, bool bias_float32, const void* x, const void* w,
                                               const void* bias, void* z, float* workspace, int M, int N, int K,
                                               int num_sms, cudaStream_t stream) {
  using namespace fused_gemm_bn::lowp;
  if (M == 0 || N == 0) return cudaSuccess;
  if (M < 0 || M > small_m::kMaxRows || N < 0 || K < 0 || K % 8 != 0 || num_sms < 1 ||
      reinterpret_cast<uintptr_t>(x) % 16 != 0 || reinterpret_cast<uintptr_t>(w) % 16 != 0)
    return cudaErrorInvalidValue;
  small_m::Args a{};
  a.x = static_cast<const uint16_t*>(x);
  a.w = static_cast<const uint16_t*>(w);
  a.bias = bias;
  a.z = static_cast<uint16_t*>(z);
  a.partials = workspace;
  a.M = M;
  a.N = N;
  a.K = K;
  a.bias_float32 = bias_float32;
  small_m::plan(M, N, K, num_sms, &a.pieces, &a.stages_per_piece, &a.block_n);
  if (a.pieces > 1 && workspace == nullptr) return cudaErrorInvalidValue;
  return dispatch_dtype(dtype, [&](auto tag) { return small_m::launch<typename decltype(tag)::type>(a, stream); });
}

bool fused_gemm_bn::lowp_small_m_fuses(bool train, int M, int N, int K, int num_sms, const LowpBatchNormArgs& bn) {
  using namespace fused_gemm_bn::lowp;
  if (bn.float32_io || M < (train ? 2 : 1) || M > small_m::kMaxRows || N <= 0 || N % 8 != 0 || K <= 0 || K % 8 != 0 ||
      num_sms < 1 || (!train && bn.scale_after_bn))
    return false;
  int pieces = 1, per_piece = 1;
  int block_n = 32;
  small_m::plan(M, N, K, num_sms, &pieces, &per_piece, &block_n);
  return pieces == 1;
}

cudaError_t fused_gemm_bn::lowp_small_m_linear_bn(const LowpBatchNormArgs& bn, bool train, const void* x,
                                                  const void* w, void* z, void* out, float* coeff, int M, int N,
                                                  int K, int num_sms, cudaStream_t stream) {
  using namespace fused_gemm_bn::lowp;
  const auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  if (!lowp_small_m_fuses(train, M, N, K, num_sms, bn) || !aligned(x) || !aligned(w) || !aligned(z) ||
      !aligned(out) || (train && (coeff == nullptr || bn.num_batches_tracked == nullptr)))
    return cudaErrorInvalidValue;
  small_m::Args a{};
  a.x = static_cast<const uint16_t*>(x);
  a.w = static_cast<const uint16_t*>(w);
  a.bias = bn.bias;
  a.z = static_cast<uint16_t*>(z);
  a.M = M;
  a.N = N;
  a.K = K;
  a.bias_float32 = false;
  small_m::plan(M, N, K, num_sms, &a.pieces, &a.stages_per_piece, &a.block_n);
  a.bn = strip::Args{static_cast<const uint16_t*>(z), out, bn.scale, bn.bn_weight, bn.bn_bias, bn.running_mean,
                     bn.running_var, bn.num_batches_tracked, coeff, bn.momentum, bn.eps, bn.scale_after_bn, M, N,
                     bn.scale_stride};
  return dispatch_dtype(bn.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return train ? small_m::launch<T, small_m::kTrain>(a, stream) : small_m::launch<T, small_m::kEval>(a, stream);
  });
}
