// small_m_fp64.cu -- the small-batch route (M = 1 .. 16 rows): one read of W,
// products and sums in float64 on the FP64 tensor cores (DMMA), and the whole
// BatchNorm (training: batch statistics, running statistics, saved statistics;
// eval: the running-statistics fold) in float64 in the same kernel, each output
// rounded once to float32; problem 84's row softmax in float64 after it (on Hopper, in the
// same kernel after a grid-wide barrier where the grid fits at once).
// Portable: mma.sync m8n8k4 .f64 (sm_80+); the TMA ring and the cooperative softmax are
// Hopper's (sm_90a), and the cp.async ring and the row-softmax kernel serve elsewhere.
//
// Formula (z = x @ W^T, no bias; per feature n over the M batch rows, in float64)
//   train:  mean = sum_m z[m, n] / M,  M2 = sum_m (z[m, n] - mean)^2,  var = M2 / M (biased)
//           problem 33 (!scale_after_bn): out = (z - mean) a + bn_bias,
//                                         a = scale bn_weight / sqrt(scale^2 var + eps)
//           problem 84 ( scale_after_bn): v = scale ((z - mean) bn_weight / sqrt(var + eps) + bn_bias)
//           running_mean = (1 - f) running_mean + f s (mean + bias)
//           running_var  = (1 - f) running_var  + f s^2 M2 / (M - 1)
//             s = scale (33: BatchNorm sees scale (z + bias)) or 1 (84: it sees z + bias);
//             f = momentum, or 1 / num_batches_tracked after this call's increment where
//             momentum < 0 (momentum=None);  bn_stats.cuh has the algebra (in float32 there)
//           for the backward (optional): z and stats (2, N) = [mean | var] centred, as
//           z - mean (each element rounded once) and [0 | var] (NaN for a NaN feature): the backward reads z and
//           mean only as z - mean (bn_backward.cu), which is then exact instead of a
//           difference of two rounded values (the cancellation that costs problem 33's
//           scale gradient its accuracy where |mean| is large against the spread)
//   eval:   g = bn_weight / sqrt(running_var + eps),  a = scale g and
//             problem 33:  out = a z + bn_bias + (scale bias - running_mean) g
//             problem 84:  v = a z + scale (bn_bias + (bias - running_mean) g)
//           (model_new.py's _torch_forward_eval, bn_stats.cuh's bn_eval_affine, here in
//           float64 on the unrounded z: bn_eval_affine's float32 a, c would cost more than
//           the GEMM's error)
//   problem 84, both modes: out[m, :] = softmax(v[m, :]) in float64 (v kept in the
//           workspace or, in the cooperative grid, in shared memory; never rounded), out
//           rounded once.
//   Null bias / bn_weight / bn_bias read as 0 / 1 / 0 (the binding always passes them).
//   num_batches_tracked += 1 once per training call: by the GEMM kernel where momentum
//   >= 0 (f does not read it), else by a one-thread kernel after the epilogue has read it.
//
// Tensors
//   x (M, K) float32, row stride x_row_stride elements, column stride 1, 4-byte aligned
//   w (N, K) float32 row-major contiguous (K-major, nn.Linear's layout); 16-byte
//       loads where K % 4 == 0 and w is 16-byte aligned, else 4-byte loads
//   out (M, N) float32 contiguous: the module's output;  z (M, N), stats (2, N) float32
//       (centred, above), or null
//   bias, bn_weight, bn_bias (N) float32; scale (N) float32, or one number for every feature
//       (bn.scale_stride 0: problem 84's scale of shape (1,), read in place); running_mean, running_var (N) float32,
//       updated in place (train), read (eval)
//   workspace: small_m_fp64_workspace_bytes(M, N, K, num_sms, scale_after_bn) bytes,
//       8-byte aligned (16 for the cooperative softmax's double2 pairs, else its row kernel
//       runs): pieces x M x N float64 partial sums where K is split, then problem 84's v
//       (M x max(N, 2 num_sms) float64: v, or the cooperative softmax's row_stats); null
//       where that is 0
//
// Numerics
//   Conversions are exact: x's floats are staged in shared memory as the doubles
//   x * 2^896, w's floats enter the MMA as the doubles w * 2^-896 (bit moves,
//   f32_to_f64_times_2m896 below: exact for every finite float, subnormals
//   included; tools/small_m_check.cu compares them with ldexp on 2^24 patterns), so
//   each product is x*w exactly (a float product has <= 48 significant bits).
//   (A float-subnormal w becomes a double subnormal: the FP64 MMA is assumed to
//   honour subnormal operands as DFMA does; the check's inputs are normal.)
//   Products are accumulated in float64 (round to nearest; the order of the K
//   terms differs from a plain loop: per warp over its chunks, then the K slices
//   in warp order, then the pieces in piece order), so with u64 = 2^-53
//       |z64 - z| <= (K + 8) u64 sum_k |x[m, k] w[n, k]|
//   and z = rn_f32(z64) is within 0.5 ulp(z) + that: within 1 ulp of the
//   correctly rounded value wherever sum_k |x w| / |z| <= 2^29 / (K + 8)
//   (65472 at K = 8192: only heavy cancellation breaks it).  mean and M2 are
//   formed in float64 from z64 (M2 as sum (z64 - mean)^2: no E[z^2] - E[z]^2
//   cancellation); the BatchNorm outputs, running statistics and the softmax are
//   float64 functions of z64 rounded once (relative error a few 2^-53 before that
//   rounding, times the conditioning of BatchNorm at heavy cancellation), so each
//   output is within about 0.5 ulp of its correctly rounded value: a few times
//   below eager's float32 BatchNorm / softmax error.  tools/small_m_check.cu checks
//   every element against these bounds (reference: exact products, long double sums).
//   A non-finite x element converts to a non-finite double, so it reaches z as in eager
//   (an infinity's sign and a NaN's payload aside).  A non-finite W element would become
//   a finite term through the bit move: the kernel sums w * 0 per W row on the FP32
//   pipe and adds it to the row's sums, so a feature whose W row holds an infinity or
//   NaN gets NaN in every batch row (eager: NaN, or an infinity where the products do
//   not cancel; after BatchNorm's batch statistics, NaN in both).
//
// Work split (SmallMTraits below; kMBlocks = 1, 2 for M <= 8, 16)
//   CTA: 16 warps, kWarpsK = 8 16-k slices of a stage x kWarpsN = 2 halves of the
//   BLOCK_N = 64 features (whole W rows, so a feature's sums end in one CTA), 512
//   threads, one CTA per SM; BLOCK_K = 128 k per stage.  W and x reach shared memory
//   through a kStages-deep ring, each stage W's 64 rows and x's kRows rows of 128
//   floats, each row padded to 144 floats (576 bytes, 64 mod 128), so that a warp's
//   16-byte reads of 8 rows x 4 consecutive float4 are bank-conflict free.  Two
//   forms of the ring (launch_small_m_gemm chooses):
//     TMA ring (small_m_fp64_tma_kernel; Hopper's sm_90a image with 16-byte rows):
//       one thread issues two tensor copies a stage (boxes 144 floats wide, landing in
//       the padded rows; rows past N and M and k past K zero-filled by the copies),
//       3 stages ahead, on per-stage full / empty mbarriers: no CTA-wide barrier a
//       stage, each warp runs on as soon as its next stage has landed.
//     cp.async ring (small_m_fp64_kernel; elsewhere, cp_async.cuh; 16-byte copies
//       where K % 4 == 0 and the rows are 16-byte aligned, else 4-byte copies): a warp
//       copies one 512-byte row piece, one __syncthreads per stage (M = 9 .. 16 with
//       at least 8 stages a piece: per pair of stages, 2 ahead instead of 3); rows
//       past M (x) and past N (W) are zeroed once and never copied; k past K is
//       zero-filled by the copies.
//   In flight per SM: kStages - 1 stages = 96 KB of W, 2.7 us of the H200's 36 B/ns
//   per SM (Little's law: ~1 us of loaded DRAM latency needs 36 KB).
//   Each warp keeps kTilesN (2) x kMBlocks accumulator tiles of 16 features x 8 batch
//   rows (4 doubles a lane) and reads, per 16-k chunk, one float4 per lane from
//   each of its 2 kTilesN W rows and kMBlocks x rows (lane (g, t): row g, k 4t ..
//   4t + 3), converts them (below) and issues, on sm_90, one
//   mma.m16n8k16 .f64 per tile (A = 16 W rows x 16 k, B = 16 k x 8 batch rows),
//   elsewhere the same product as 8 mma.m8n8k4 .f64.  The k order inside a chunk
//   is permuted (fragment k index t + 4 i, or t for step i, is column 4 t + i),
//   the same way for A and B.
//   At the end the K slices are summed through shared memory in warp order, and
//   either the epilogue runs (8 threads a feature, each holding kRows / 8 of its rows: the
//   whole batch of a feature is in one warp's 8 lanes, so the BatchNorm's sums are one
//   butterfly, no second pass), or, with K split into
//   pieces (fewer feature blocks than SMs), each piece stores its float64 sums to
//   the workspace and small_m_fp64_finish_kernel adds the pieces in piece order
//   and runs the epilogue.  No atomics: the same bits on every run.
//
// Performance (tools/small_m_check.cu times the kernel next to the floor,
// tools/dmma_rate.cu the MMA rates; docs/perf.md v43).
//   Floor: W read once, 4 N K bytes (268 MB at N = K = 8192: ~90 us on an H100,
//   ~65 us on an H200, half of a device-to-device copy of W).  v42's kernel (W in
//   registers, 2 chunks ahead, 48 KB a SM in flight) ran at 1.9x that on the H200.
//   MMA rates measured on the H200: mma.m16n8k16 .f64 128 FMA/clk/SM (the FP64
//   tensor peak), mma.m8n8k4 .f64 63 (half: the sm_80 form here runs 1.2-1.3x
//   slower on an H200), DFMA 56.  At M <= 8, 0.54e9 FMA take 16 us of the peak.
//   Measured (H200, N = K = 8192; v44, problem 33's training with its epilogue): M <= 8
//   1.13-1.17x the floor (75-78 us); M = 9 .. 16 1.35-1.45x (90-98 us): not the MMA pipe (35% busy) nor the ALU
//   (43%) but the per-stage chain barrier -> copies -> shared loads -> conversions
//   -> MMA with 4 warps a scheduler (ncu: 1.1 eligible warps, issue 48% busy); since v53
//   M = 9 .. 16 reads the ring's stages in pairs, one barrier a pair: 1.27-1.34x (83-88 us);
//   since v55 the TMA ring on Hopper: M = 9 .. 16 1.22-1.26x (80-83 us; 2-9% below the
//   pairs, most at 16 rows), M <= 8 1.13-1.15x (74-78 us, within 0-3% of the cp.async ring).
//   Small shapes (4096 x 512, 8 MB of W, K split into 16 pieces) take 11-25 us:
//   launch, pipeline fill and the finish kernel, not W.
//   Problem 84's float64 softmax: one CTA of 1024 threads per row, v read from L2,
//   one exp per element (kept in registers up to N = 8192): +6-7 us at N = 8192, mostly
//   the kernel boundary (v63).  Since v86, on the TMA ring with K unsplit (N = 4225 .. 8448
//   on 132 SMs), the GEMM kernel's cooperative grid does it after one grid-wide barrier
//   (small_m_coop_tail): problem 84's module 1.5-3.8 us faster a call at K = N = 8192
//   (H200, both modes, 1-16 rows), and the TMA kernel stages its epilogue's feature vectors
//   in shared memory at its start (problem 33 0.5-1.4 us faster).  The same barrier in
//   place of the finish kernel where K is split measured slower (not kept).  Since v88 the
//   tail after the barrier takes 1.2-1.6 us (2.3-2.9 before): the pairs loaded once, and the
//   sum relative to the CTA's own max (tools/small_m_phase_times.cu stamps each CTA's phases).
//   Where the rest goes (v88, M = 2 .. 16): the CTAs' mainloops end over a 10-15 us spread,
//   the same SMs fast or slow from launch to launch (by GPC, the likely cause: ~24 SMs 6-7 us
//   ahead of the median, ~84 at it or up to 3.4 us behind); the kernel waits for the slowest,
//   3-6 us past the median, then its epilogue (1.7 us; problem 84 3.9 us with the barrier).
//   Since v100 the epilogue runs on 8 threads a feature (0.4-0.7 us off 16 rows' training on an
//   H100, outputs bit-identical); on the H100 the module runs at 1.05-1.12x the W read at 1-16
//   rows, K = N = 8192 (docs/perf.md v100).
//
// Preconditions: 1 <= M <= kSmallMMaxRows (16) (train: M >= 2), N >= 1, K >= 1;
// bn.scale, bn.running_mean, bn.running_var not null (train: and num_batches_tracked);
// workspace as above.
// SM 8.0+ (mma.sync .f64; runs, slowly, where FP64 is 1/64 rate: sm_86 / sm_89); the TMA
// ring sm_90a only.
// Sources: PTX ISA, "Warp-level matrix multiply-accumulate instructions",
// mma.m16n8k16 / mma.m8n8k4 with .f64 (fragment layouts); cp.async.bulk.tensor and
// mbarrier (expect-tx, try_wait.parity) for the TMA ring; Chan, Golub & LeVeque
// (1979) for the two-pass M2;
// IEEE 754 binary64 format; CUDA C++
// Programming Guide, "Arithmetic Instructions" (throughput table).

#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>

#include "device_facts.cuh"
#include "block_reduce.cuh"
#include "cp_async.cuh"
#include "dmma_f64.cuh"
#include "launchers.cuh"
#include "pdl.cuh"
#include "sm90_primitives.cuh"
#include "tensor_map.cuh"

// FUSED_GEMM_BN_SMALL_M_PHASE(p): a time stamp of phase p of a TMA-ring CTA's work (thread 0:
// 0 start, past the dependent-launch wait; 1 the first stage landed; 2 its warp's last stage
// read; 3 every warp's; 4 the K slices summed; the cooperative tail: 5 v in shared memory,
// 6 the row's pair written, 7 past the grid barrier; 8 the end), defined by
// tools/small_m_phase_times.cu to read %globaltimer; nothing otherwise (the kernel's code is
// the same with and without these points).
#ifndef FUSED_GEMM_BN_SMALL_M_PHASE
#define FUSED_GEMM_BN_SMALL_M_PHASE(p) static_cast<void>(0)
#endif

namespace fused_gemm_bn {

constexpr int kSmallMMaxRows = 16;

// One traits struct per batch block count (kMBlocks 8-row blocks: M <= 8, 16).
template <int kMBlocks_>
struct SmallMTraits {
  static constexpr int kMBlocks = kMBlocks_;
  static constexpr int kRows = kMBlocks * 8;  // batch rows held (M padded)
  // Each warp takes half of the BLOCK_N features of its K slice: kTilesN x kMBlocks
  // accumulator tiles of 4 doubles (16 warps: one x 4 features per warp measured
  // the same at M = 9 .. 16 and 5% slower at M = 8, docs/perf.md v43).
  static constexpr int kTilesN = 2;
  static constexpr int kWarpsN = 2;
  static constexpr int kWarpsK = 8;
  static constexpr int kNumWarps = kWarpsN * kWarpsK;
  static constexpr int kNumThreads = kNumWarps * 32;
  static constexpr int BLOCK_N = kWarpsN * kTilesN * 16;  // 64
  static constexpr int CHUNK_K = 16;                      // one float4 a lane and row
  static constexpr int BLOCK_K = 128;                     // k per stage
  static constexpr int kChunksPerWarp = BLOCK_K / CHUNK_K / kWarpsK;
  static constexpr int kRowStride = BLOCK_K + 16;  // floats: 576 bytes, 64 mod 128
  static constexpr int kStageFloats = (BLOCK_N + kRows) * kRowStride;  // W rows, then x rows
  static constexpr int kStageBytes = kStageFloats * 4;
  // The final K-slice reduction: kNumWarps x kTilesN x kMBlocks x 4 x 32 lanes doubles,
  // then each feature's float64 sums z64[n][m] (BLOCK_N rows of kZsumStride doubles) after it:
  // the odd stride keeps the epilogue's reads of a row a thread (feature) free of bank
  // conflicts (a stride of kRows doubles, 64 or 128 bytes, put all 32 lanes on one bank pair).
  static constexpr int kReduceBytes = kNumWarps * kTilesN * kMBlocks * 4 * 32 * 8;
  static constexpr int kZsumStride = kRows + 1;
  // The cooperative tail's ybuf (problem 84's v, kRows x BLOCK_N doubles) after zsum.
  static constexpr int kZsumBytes = BLOCK_N * kZsumStride * 8;
  static constexpr int kYbufBytes = BLOCK_N * kRows * 8;
  static constexpr int kTailBytes = kReduceBytes + kZsumBytes + kYbufBytes;
  // Shared memory of a kStages-deep ring (the reduction area reuses it).
  __host__ __device__ static constexpr int smem_bytes(int stages) {
    return stages * kStageBytes > kTailBytes ? stages * kStageBytes : kTailBytes;
  }
  static_assert(BLOCK_N == 64 && kChunksPerWarp >= 1 && kChunksPerWarp * kWarpsK * CHUNK_K == BLOCK_K,
                "stage splits over warps");
  static_assert(smem_bytes(4) <= 227 * 1024, "4 stages fit sm_90's opt-in shared memory");
  // The epilogue's threads a feature (small_m_feature_epilogue): the whole CTA, 8 a feature.
  static constexpr int kEpilogueLanes = kNumThreads / BLOCK_N;
  static_assert(kEpilogueLanes * BLOCK_N == kNumThreads && kRows % kEpilogueLanes == 0,
                "the CTA's threads in groups of whole rows a feature");
};

struct SmallMArgs {
  const float* x;
  int64_t x_row_stride;
  const float* w;
  int M, N, K;
  int pieces;           // K split: blockIdx.y = piece; 1: the epilogue runs in the GEMM kernel
  int tiles_per_piece;  // BLOCK_K tiles per piece (the last piece: the rest)
  double* partials;     // (pieces, M, N) float64, pieces > 1
  // bias, scale, bn_weight, bn_bias, running statistics, eps, scale_after_bn; train: momentum
  // (bn.num_batches_tracked unused: num_batches_tracked below)
  BatchNormArgs bn;
  float* out;  // the module's output (M, N)
  double* v;   // problem 84's softmax input (M, N) float64, for small_m_softmax_fp64_kernel (!coop)
  // 1: the TMA kernel runs problem 84's softmax itself, as one cooperative grid (K not
  // split; small_m_coop_tail): row_stats (M, gridDim.x, 2) doubles, its (max, sum) pairs
  int coop;
  double* row_stats;
  // train
  float* z;                           // (M, N) z - mean_z, or null
  float* stats;                       // (2, N) [0 | biased var_z], or null
  int64_t* num_batches_tracked;       // += 1 once: by the GEMM kernel where momentum >= 0
};

// w * 2^-896 exactly, for every finite float w: w's sign, exponent and
// mantissa bits moved into a double's fields without rebiasing the exponent
// (a float of exponent field e, mantissa f is 2^(e-127) 1.f; the double with
// the same fields is 2^(e-1023) 1.f; subnormals (e = 0) scale the same way).
// Three integer ops, no FP64 conversion (16/clk/SM) on the FP64 pipe.  A
// non-finite w (exponent field 255) becomes a finite double: the kernel flags such
// W rows apart (w * 0 summed on the FP32 pipe, small_m_fp64_kernel).
__device__ __forceinline__ double f32_to_f64_times_2m896(float w) {
  const uint32_t b = __float_as_uint(w);
  const int hi = (static_cast<int>(b) >> 3) & static_cast<int>(0x8fffffffu);
  return __hiloint2double(hi, static_cast<int>(b << 29));
}

// x * 2^896 exactly (|x| < 2^128: below 2^1024, no overflow), for every float; an
// infinity or NaN x stays one (the all-ones exponent), so it reaches z as in eager.
// Two DMUL on the FP64 pipe: the main loop takes f32_to_f64_times_2p896_fast and
// comes here only for subnormal x.
__device__ __forceinline__ double f32_to_f64_times_2p896(float x) {
  const uint32_t b = __float_as_uint(x);
  const int non_finite = (b & 0x7f800000u) == 0x7f800000u ? 0x7ff00000 : 0;
  const int hi = ((static_cast<int>(b) >> 3) & static_cast<int>(0x8fffffffu)) | non_finite;
  return __hiloint2double(hi, static_cast<int>(b << 29)) * 0x1p896 * 0x1p896;
}

// The same in integer ops only, exact for every float but the subnormals: the
// exponent field e moved into the double's and raised by 1792 (e + 1792 <= 2047,
// no carry: 1 .. 254 give x * 2^896, 255 gives 2047, an infinity or NaN as above),
// a zero (e = 0) left as it is.  `subnormal` is set where x is one (e = 0, mantissa
// != 0): the result is then wrong and f32_to_f64_times_2p896 must be used.
__device__ __forceinline__ double f32_to_f64_times_2p896_fast(float x, bool& subnormal) {
  const uint32_t b = __float_as_uint(x);
  const bool zero_exponent = (b & 0x7f800000u) == 0u;
  subnormal = subnormal || (zero_exponent && (b << 1) != 0u);
  const int hi = ((static_cast<int>(b) >> 3) & static_cast<int>(0x8fffffffu)) | (zero_exponent ? 0 : 0x70000000);
  return __hiloint2double(hi, static_cast<int>(b << 29));
}

// A feature's BatchNorm vectors as the epilogue reads them (null bias / bn_weight / bn_bias: 0 / 1 / 0).
struct SmallMFeatureVectors {
  double bias, gamma, beta, s, running_mean, running_var;
};

// The six vectors in SmallMFeatureVectors' order: j's array and feature n's element in it.
constexpr int kSmallMVectors = 6;
__device__ __forceinline__ const float* small_m_vector(const BatchNormArgs& bn, int j) {
  const float* const src[kSmallMVectors] = {bn.bias,  bn.bn_weight,    bn.bn_bias,
                                            bn.scale, bn.running_mean, bn.running_var};
  return src[j];
}
__device__ __forceinline__ size_t small_m_vector_offset(const BatchNormArgs& bn, int j, int n) {
  return j == 3 ? static_cast<size_t>(n) * bn.scale_stride : static_cast<size_t>(n);
}

// One feature's vectors, vector j's float from load(j) (not called for a null bias, bn_weight
// or bn_bias).
template <class Load>
__device__ __forceinline__ SmallMFeatureVectors small_m_vectors(const BatchNormArgs& bn, Load load) {
  SmallMFeatureVectors f;
  f.bias = bn.bias != nullptr ? static_cast<double>(load(0)) : 0.0;
  f.gamma = bn.bn_weight != nullptr ? static_cast<double>(load(1)) : 1.0;
  f.beta = bn.bn_bias != nullptr ? static_cast<double>(load(2)) : 0.0;
  f.s = load(3), f.running_mean = load(4), f.running_var = load(5);
  return f;
}

// Read from global memory (small_m_fp64_kernel's and the finish kernel's epilogue).
__device__ __forceinline__ SmallMFeatureVectors small_m_load_vectors(const BatchNormArgs& bn, int n) {
  return small_m_vectors(bn, [&](int j) { return small_m_vector(bn, j)[small_m_vector_offset(bn, j, n)]; });
}

// The TMA kernel's staged copies (small_m_stage_vectors): staged[j * BLOCK_N + f] for the CTA's feature f.
template <int kBlockN>
__device__ __forceinline__ SmallMFeatureVectors small_m_staged_vectors(const BatchNormArgs& bn, const float* staged,
                                                                       int f) {
  return small_m_vectors(bn, [&](int j) { return staged[j * kBlockN + f]; });
}

// At the TMA kernel's start, thread f < BLOCK_N copies feature n0 + f's six vectors (those
// not null, n < N) into `staged` by cp.async, one group (waited for before the epilogue):
// the epilogue then starts without the DRAM round trips of its loads (training had two, the
// running statistics' loads ordered after the z stores they might alias).
template <int kBlockN>
__device__ __forceinline__ void small_m_stage_vectors(const BatchNormArgs& bn, int n0, int N, float* staged) {
  const int f = static_cast<int>(threadIdx.x), n = n0 + f;
  if (f >= kBlockN) return;
#pragma unroll
  for (int j = 0; j < kSmallMVectors; ++j) {
    const float* src = small_m_vector(bn, j);
    const bool valid = src != nullptr && n < N;
    cp_async<4>(staged + j * kBlockN + f, valid ? src + small_m_vector_offset(bn, j, n) : bn.scale, valid);
  }
  cp_async_commit();
}

// The sum of s over a group of kLanes consecutive lanes (kLanes a power of two <= 32), as a
// butterfly: every lane of the group gets the same bits (a + b == b + a).  kLanes = 1: s.
template <int kLanes>
__device__ __forceinline__ double small_m_group_sum(double s) {
#pragma unroll
  for (int o = kLanes / 2; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

// The epilogue of feature n, the formulas of the file's header, each output rounded once,
// over a group of kLanes consecutive lanes: lane j of the group holds the float64 sums zd[i]
// of batch rows m = j + kLanes i (i < kRows / kLanes).  kLanes = 1: one thread a feature (the
// finish kernel); the GEMM kernels' CTAs take SmallMTraits::kEpilogueLanes threads a feature, so the
// per-row work (loads, sums, outputs) is spread over the CTA instead of one thread per feature
// doing all kRows rows (docs/perf.md v100).  The mean and M2 sum a lane's rows in row order,
// then the group's lanes by small_m_group_sum.  Every lane of the warp must call this (the
// butterflies); `store`: the group's feature exists (n < N), else nothing is written.
// Problem 84's v goes to v[m v_row_stride] (m < M), problem 33's out to p.out; lane 0 of the
// group writes the feature's running statistics and stats.
template <int kRows, int kLanes, bool kEval>
__device__ __forceinline__ void small_m_feature_epilogue(const SmallMArgs& p, int n, int lane_in_group, bool store,
                                                         const double (&zd)[kRows / kLanes],
                                                         const SmallMFeatureVectors& vec, double* v,
                                                         size_t v_row_stride) {
  constexpr int kHeld = kRows / kLanes;
  static_assert(kRows % kLanes == 0 && (kLanes & (kLanes - 1)) == 0 && kLanes <= 32, "whole rows a lane");
  const int M = p.M, N = p.N;
  const BatchNormArgs& bn = p.bn;
  const double bias = vec.bias, gamma = vec.gamma, beta = vec.beta, s = vec.s;
  double a, c;     // out or v = a (z - shift) + c
  double shift;
  double mean = 0.0, m2 = 0.0, var = 0.0;  // training
  if constexpr (kEval) {
    const double g = gamma / sqrt(vec.running_var + static_cast<double>(bn.eps));
    const double rm = vec.running_mean;
    a = s * g;
    c = bn.scale_after_bn ? s * fma(bias - rm, g, beta) : fma(fma(s, bias, -rm), g, beta);
    shift = 0.0;
  } else {
    double sum = 0.0;
#pragma unroll
    for (int i = 0; i < kHeld; ++i)
      if (lane_in_group + kLanes * i < M) sum += zd[i];
    mean = small_m_group_sum<kLanes>(sum) / static_cast<double>(M);
#pragma unroll
    for (int i = 0; i < kHeld; ++i)
      if (lane_in_group + kLanes * i < M) m2 = fma(zd[i] - mean, zd[i] - mean, m2);
    m2 = small_m_group_sum<kLanes>(m2);
    var = m2 / static_cast<double>(M);
    if (bn.scale_after_bn) {
      const double g = gamma / sqrt(var + static_cast<double>(bn.eps));
      a = s * g, c = s * beta;
    } else {
      a = s * gamma / sqrt(s * s * var + static_cast<double>(bn.eps));
      c = beta;
    }
    shift = mean;
  }
  if (!store) return;
#pragma unroll
  for (int i = 0; i < kHeld; ++i) {
    const int m = lane_in_group + kLanes * i;
    if (m < M) {
      const double y = fma(zd[i] - shift, a, c);
      if (bn.scale_after_bn)
        v[m * v_row_stride] = y;
      else
        p.out[static_cast<size_t>(m) * N + n] = static_cast<float>(y);
    }
  }
  if constexpr (!kEval) {  // after the outputs: nothing on their path waits for these
#pragma unroll
    for (int i = 0; i < kHeld; ++i) {
      const int m = lane_in_group + kLanes * i;
      if (p.z != nullptr && m < M) p.z[static_cast<size_t>(m) * N + n] = static_cast<float>(zd[i] - mean);
    }
    if (lane_in_group != 0) return;
    if (p.stats != nullptr) {  // the backward's (z, mean_z), centred: z - mean_z rounded once, and 0
      p.stats[n] = static_cast<float>(mean - mean);  // NaN where the feature is (a non-finite W row)
      p.stats[N + n] = static_cast<float>(var);
    }
    // Running statistics of what BatchNorm sees: s (z + bias) for 33, z + bias for 84.
    const double su = bn.scale_after_bn ? 1.0 : s;
    const double f = bn.momentum >= 0.f ? static_cast<double>(bn.momentum)
                                        : 1.0 / static_cast<double>(*p.num_batches_tracked + 1);
    bn.running_mean[n] = static_cast<float>((1.0 - f) * vec.running_mean + f * su * (mean + bias));
    bn.running_var[n] = static_cast<float>((1.0 - f) * vec.running_var + f * su * su * (m2 / static_cast<double>(M - 1)));
  }
}

// The copies of one stage (k from k0) into ring buffer `stage`: W rows n0 .. n0 +
// BLOCK_N (those < N), then x rows 0 .. M; k >= k_end zero-filled.
// 16-byte form: thread tid copies columns 4 lane .. 4 lane + 3 of rows tid / 32 + 16 j
// (a warp copies one 512-byte row piece), the same rows in every stage, so the
// source pointers and shared offsets are formed once (the copy loop was a third of
// the kernel's instructions at M = 16, docs/perf.md v43).
template <class T>
struct SmallMCopies16 {
  static constexpr int kRowsPerPass = T::kNumThreads / 32;
  static constexpr int kMaxCopies = (T::BLOCK_N + T::kRows + kRowsPerPass - 1) / kRowsPerPass;
  const float* src[kMaxCopies];
  int dst[kMaxCopies];  // floats from the stage's start
  int count;
  int col;

  __device__ __forceinline__ SmallMCopies16(const SmallMArgs& p, int n0) {
    const int rows_w = min(T::BLOCK_N, p.N - n0), first = threadIdx.x / 32;
    col = 4 * (threadIdx.x % 32);
    count = 0;
#pragma unroll
    for (int j = 0; j < kMaxCopies; ++j) {
      const int r = first + kRowsPerPass * j;
      const bool is_w = r < rows_w;
      src[j] = (is_w ? p.w + static_cast<size_t>(n0 + r) * p.K
                     : p.x + static_cast<size_t>(min(r - rows_w, p.M - 1)) * p.x_row_stride) + col;
      dst[j] = (is_w ? r : T::BLOCK_N + r - rows_w) * T::kRowStride + col;
      if (r < rows_w + p.M) count = j + 1;
    }
  }
  __device__ __forceinline__ void issue(float* stage, int k0, int k_end) const {
    const bool valid = k0 + col < k_end;
#pragma unroll
    for (int j = 0; j < kMaxCopies; ++j)
      if (j < count) cp_async<16>(stage + dst[j], valid ? src[j] + k0 : src[j], valid);
  }
};

// 4-byte form (K % 4 != 0 or rows not 16-byte aligned): element by element.
template <class T>
__device__ __forceinline__ void small_m_issue_stage4(const SmallMArgs& p, float* stage, int n0, int k0, int k_end) {
  const int rows_w = min(T::BLOCK_N, p.N - n0);
  for (int c = threadIdx.x; c < (rows_w + p.M) * T::BLOCK_K; c += T::kNumThreads) {
    const int r = c / T::BLOCK_K, k = k0 + c % T::BLOCK_K;
    const bool is_w = r < rows_w;
    const float* src = is_w ? p.w + static_cast<size_t>(n0 + r) * p.K
                            : p.x + static_cast<size_t>(r - rows_w) * p.x_row_stride;
    const int row = is_w ? r : T::BLOCK_N + r - rows_w;
    const bool valid = k < k_end;
    cp_async<4>(stage + row * T::kRowStride + (k - k0), valid ? src + k : src, valid);
  }
}

// The CTA's place: its thread's lane and warp coordinates, its BLOCK_N features from
// n0 and its K piece [k_begin, k_end) of num_tiles BLOCK_K stages (both ring kernels).
template <class T>
struct SmallMCta {
  int tid, lane, warp, g, t, warp_n, warp_k;
  int n0, piece, k_begin, k_end, num_tiles;
  __device__ __forceinline__ explicit SmallMCta(const SmallMArgs& p) {
    tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    g = lane >> 2, t = lane & 3;
    warp_n = warp / T::kWarpsK, warp_k = warp % T::kWarpsK;
    n0 = blockIdx.x * T::BLOCK_N;
    piece = blockIdx.y;
    k_begin = piece * p.tiles_per_piece * T::BLOCK_K;
    k_end = min(p.K, k_begin + p.tiles_per_piece * T::BLOCK_K);
    num_tiles = (k_end - k_begin + T::BLOCK_K - 1) / T::BLOCK_K;
  }
};

// A warp's sums: kTilesN x kMBlocks accumulator tiles (4 doubles a lane), and the w * 0
// flags of the W rows the lane reads (non-finite W: small_m_stage_products).
template <class T>
struct SmallMAccum {
  double acc[T::kTilesN][T::kMBlocks][4];
  float w_nan[T::kTilesN][2];
  __device__ __forceinline__ SmallMAccum() {
#pragma unroll
    for (int f = 0; f < T::kTilesN; ++f) {
      w_nan[f][0] = w_nan[f][1] = 0.f;
#pragma unroll
      for (int mb = 0; mb < T::kMBlocks; ++mb)
#pragma unroll
        for (int v = 0; v < 4; ++v) acc[f][mb][v] = 0.0;
    }
  }
};

// nn.BatchNorm1d's step counter, once per training call (the pre-pass does it on the
// other routes), where momentum >= 0 (else small_m_count_batch_kernel after the epilogue).
template <bool kEval>
__device__ __forceinline__ void small_m_count_batch(const SmallMArgs& p, int tid) {
  if (!kEval && p.bn.momentum >= 0.f && tid == 0 && blockIdx.x == 0 && blockIdx.y == 0) *p.num_batches_tracked += 1;
}

// The cp.async ring's rows never copied (W past N, x past M), zeroed in each of its
// kStages stages before the first copy.
template <class T, int kStages>
__device__ __forceinline__ void small_m_zero_pad_rows(const SmallMArgs& p, const SmallMCta<T>& c, float* ring) {
  const int pad_w = T::BLOCK_N - min(T::BLOCK_N, p.N - c.n0), pad_rows = pad_w + T::kRows - p.M;
  constexpr int kRowFloat4s = T::kRowStride / 4;
  for (int e = c.tid; e < kStages * pad_rows * kRowFloat4s; e += T::kNumThreads) {
    const int q = (e / kRowFloat4s) % pad_rows, stage = e / (kRowFloat4s * pad_rows);
    const int row = q < pad_w ? T::BLOCK_N - pad_w + q : T::BLOCK_N + p.M + (q - pad_w);
    reinterpret_cast<float4*>(ring + stage * T::kStageFloats + row * T::kRowStride)[e % kRowFloat4s] =
        make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

// The products of one ring stage: per 16-k chunk of this warp's K slice, the lane's
// float4 of each of its kMBlocks x rows and 2 kTilesN W rows, converted exactly, then
// one DMMA chunk per accumulator tile.
template <class T>
__device__ __forceinline__ void small_m_stage_products(const float* stage, const SmallMCta<T>& c, SmallMAccum<T>& a) {
  constexpr int TN = T::kTilesN, MB = T::kMBlocks;
#pragma unroll
  for (int j = 0; j < T::kChunksPerWarp; ++j) {
    const int col = (j * T::kWarpsK + c.warp_k) * T::CHUNK_K + 4 * c.t;
    float4 xv[MB];
    double xb[MB][4];
    bool subnormal = false;
#pragma unroll
    for (int mb = 0; mb < MB; ++mb) {
      xv[mb] = *reinterpret_cast<const float4*>(stage + (T::BLOCK_N + 8 * mb + c.g) * T::kRowStride + col);
      xb[mb][0] = f32_to_f64_times_2p896_fast(xv[mb].x, subnormal);
      xb[mb][1] = f32_to_f64_times_2p896_fast(xv[mb].y, subnormal);
      xb[mb][2] = f32_to_f64_times_2p896_fast(xv[mb].z, subnormal);
      xb[mb][3] = f32_to_f64_times_2p896_fast(xv[mb].w, subnormal);
    }
    if (__any_sync(0xffffffffu, subnormal)) {  // rare: a subnormal x in this warp's chunk
#pragma unroll
      for (int mb = 0; mb < MB; ++mb) {
        xb[mb][0] = f32_to_f64_times_2p896(xv[mb].x), xb[mb][1] = f32_to_f64_times_2p896(xv[mb].y);
        xb[mb][2] = f32_to_f64_times_2p896(xv[mb].z), xb[mb][3] = f32_to_f64_times_2p896(xv[mb].w);
      }
    }
#pragma unroll
    for (int f = 0; f < TN; ++f) {
      const int row = (c.warp_n * TN + f) * 16 + c.g;
      const float4 lo = *reinterpret_cast<const float4*>(stage + row * T::kRowStride + col);
      const float4 hi = *reinterpret_cast<const float4*>(stage + (row + 8) * T::kRowStride + col);
      // W's non-finite values: w * 0 is NaN for an infinity or NaN w and 0 otherwise, summed per
      // W row this lane reads on the otherwise idle FP32 pipe; the bit-moving conversion
      // would make them finite terms.
      a.w_nan[f][0] = fmaf(lo.x, 0.f, fmaf(lo.y, 0.f, fmaf(lo.z, 0.f, fmaf(lo.w, 0.f, a.w_nan[f][0]))));
      a.w_nan[f][1] = fmaf(hi.x, 0.f, fmaf(hi.y, 0.f, fmaf(hi.z, 0.f, fmaf(hi.w, 0.f, a.w_nan[f][1]))));
      const double wlo[4] = {f32_to_f64_times_2m896(lo.x), f32_to_f64_times_2m896(lo.y),
                             f32_to_f64_times_2m896(lo.z), f32_to_f64_times_2m896(lo.w)};
      const double whi[4] = {f32_to_f64_times_2m896(hi.x), f32_to_f64_times_2m896(hi.y),
                             f32_to_f64_times_2m896(hi.z), f32_to_f64_times_2m896(hi.w)};
#pragma unroll
      for (int mb = 0; mb < MB; ++mb) dmma_chunk_16x8(a.acc[f][mb], wlo, whi, xb[mb]);
    }
  }
}

// The cooperative grid's tail (p.coop: problem 84, K not split; every thread of every CTA
// comes here, the CTA's float64 sums of its BLOCK_N features in zsum[feature][m], rows
// kZsumStride apart): the
// softmax in the GEMM kernel, after a grid-wide barrier instead of a kernel boundary (the
// boundary, its drain, dependent launch and wait, cost problem 84 5-7 us, docs/perf.md v63):
//   The epilogue, one thread a feature, v into shared memory (ybuf[m][f]).
//   Warp m (M <= 16 warps) takes row m: over the CTA's features (warp butterflies) its max
//   R_q and e = exp(v - R_q), kept in registers, and s_q = Sum e, the pair (R_q, s_q) to
//   row_stats[m][q] (CTA q of G); a barrier; then the row's sum relative to this CTA's max,
//   S = Sum_q s_q exp(R_q - R) (R = this CTA's R_q, the G pairs in q order, lane-strided,
//   then a butterfly: the same bits on every run), and out = e / S rounded once: softmax's
//   exp(v - max) / Sum exp(v - max) with the shift R instead of the row's max (the quotient is
//   shift-free), so nothing after the barrier waits for the max.  Overflow: R_q - R > ~705
//   makes S infinite and out 0, where the exact value is below e^-705 (float32's smallest is
//   e^-103.3).  An element -inf adds 0 and gets 0 (a CTA of -inf only: the pair (-inf, 0),
//   and S infinite or NaN beside it); NaN anywhere makes S, so the row, NaN, and a row of
//   -inf only gives 0 / 0 = NaN, as torch.softmax.  Relative error before the rounding
//   (G + 4) 2^-53 beside small_m_softmax_fp64_kernel's N-term sum.
// The barrier is cooperative_groups' grid sync (a cooperative launch: every CTA resident);
// its release and acquire order the row_stats writes before the other CTAs' reads, which bypass
// L1 (__ldcg).  The pairs are loaded at once (one L2 round trip), kept in registers.
// Measured (docs/perf.md v86): with K split, the same barrier in place of the finish kernel
// was slower (a barrier costs about what a boundary does there), so those grids keep the kernels.
template <class T, bool kEval>
__device__ __forceinline__ void small_m_coop_tail(const SmallMArgs& p, const SmallMCta<T>& c, const double* zsum,
                                                  const float* staged, double* ybuf) {
  const int M = p.M, N = p.N;
  const int G = static_cast<int>(gridDim.x), q = static_cast<int>(blockIdx.x);
  const int count = min(T::BLOCK_N, N - c.n0);  // this CTA's features
  {
    constexpr int kLanes = T::kEpilogueLanes;
    const int f = c.tid / kLanes, j = c.tid % kLanes;
    double zd[T::kRows / kLanes];
#pragma unroll
    for (int i = 0; i < T::kRows / kLanes; ++i) zd[i] = zsum[f * T::kZsumStride + j + kLanes * i];
    small_m_feature_epilogue<T::kRows, kLanes, kEval>(p, c.n0 + f, j, f < count, zd,
                                                      small_m_staged_vectors<T::BLOCK_N>(p.bn, staged, f),
                                                      ybuf + f, T::BLOCK_N);
  }
  __syncthreads();  // ybuf written
  FUSED_GEMM_BN_SMALL_M_PHASE(5);
  const int row = c.warp, lane = c.lane;
  const bool has0 = row < M && lane < count, has1 = row < M && lane + 32 < count;
  const double y0 = has0 ? ybuf[row * T::BLOCK_N + lane] : -INFINITY;
  const double y1 = has1 ? ybuf[row * T::BLOCK_N + lane + 32] : -INFINITY;
  double r = 0.0, e0 = 0.0, e1 = 0.0;  // this CTA's max of the row, and exp(y - r)
  if (row < M) {
    r = warp_butterfly<true>(fmax(y0, y1));
    e0 = y0 != -INFINITY ? exp(y0 - r) : 0.0;
    e1 = y1 != -INFINITY ? exp(y1 - r) : 0.0;
    const double sum = warp_butterfly<false>(e0 + e1);
    if (lane == 0) reinterpret_cast<double2*>(p.row_stats)[static_cast<size_t>(row) * G + q] = make_double2(r, sum);
  }
  FUSED_GEMM_BN_SMALL_M_PHASE(6);
  cooperative_groups::this_grid().sync();
  FUSED_GEMM_BN_SMALL_M_PHASE(7);
  if (row >= M) return;
  // The row's G pairs, lane b's b, b + 32, ... (G <= 32 kHeldPairs loaded at once: one L2 round
  // trip; any rest after them).
  constexpr int kHeldPairs = 5;  // 160 CTAs: every sm_90 GPU's SMs
  const double2* pairs = reinterpret_cast<const double2*>(p.row_stats) + static_cast<size_t>(row) * G;
  auto term = [r](double2 pair) {  // pair.y: 0, or NaN, where pair.x is -inf
    return pair.x != -INFINITY ? pair.y * exp(pair.x - r) : pair.y;
  };
  double2 held[kHeldPairs];
#pragma unroll
  for (int i = 0; i < kHeldPairs; ++i)
    held[i] = lane + 32 * i < G ? __ldcg(pairs + lane + 32 * i) : make_double2(-INFINITY, 0.0);
  double sum = 0.0;  // in q order
#pragma unroll
  for (int i = 0; i < kHeldPairs; ++i)
    if (lane + 32 * i < G) sum += term(held[i]);
  for (int b = lane + 32 * kHeldPairs; b < G; b += 32) sum += term(__ldcg(pairs + b));
  const double inv = 1.0 / warp_butterfly<false>(sum);
  float* out_row = p.out + static_cast<size_t>(row) * N + c.n0;
  if (has0) out_row[lane] = static_cast<float>(e0 * inv);
  if (has1) out_row[lane + 32] = static_cast<float>(e1 * inv);
}

// After the last stage, every warp done with the ring (the caller's __syncthreads): the
// non-finite W flags folded in, the kWarpsK K slices summed through shared memory in
// warp order (the ring becomes the reduction area), then either the cooperative tail
// (the TMA kernel, where p.coop) or the epilogue (kEpilogueLanes threads a feature) or, with
// K split, the piece's float64 sums to the workspace.  `staged`: the TMA kernel's copies of the
// CTA's feature vectors (small_m_stage_vectors, landed), or null (read from global memory); each is
// read by other threads than its copier, after the caller's cp_async_wait and the reduction's barriers.
// kTma: the TMA kernel (the only one whose p.coop may be set; the cp.async kernel's code has no tail).
template <class T, bool kEval, bool kTma>
__device__ __forceinline__ void small_m_cta_finish(const SmallMArgs& p, const SmallMCta<T>& c, SmallMAccum<T>& a,
                                                   unsigned char* smem, const float* staged) {
  constexpr int TN = T::kTilesN, MB = T::kMBlocks;
  const int tid = c.tid, lane = c.lane, warp = c.warp;
  // A non-finite W row makes its feature's sums NaN, for every batch row (in eager, a NaN,
  // or an infinity whose products do not cancel): the 4 lanes of a quad read a row's columns.
#pragma unroll
  for (int f = 0; f < TN; ++f)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float flag = a.w_nan[f][h];
      flag += __shfl_xor_sync(0xffffffffu, flag, 1);
      flag += __shfl_xor_sync(0xffffffffu, flag, 2);
#pragma unroll
      for (int mb = 0; mb < MB; ++mb) a.acc[f][mb][2 * h] += flag, a.acc[f][mb][2 * h + 1] += flag;
    }

  // Sum the kWarpsK K slices in warp order: red[warp][f][mb][v][lane].
  double* red = reinterpret_cast<double*>(smem);
#pragma unroll
  for (int f = 0; f < TN; ++f)
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
      for (int v = 0; v < 4; ++v) red[(((warp * TN + f) * MB + mb) * 4 + v) * 32 + lane] = a.acc[f][mb][v];
  __syncthreads();
  // zsum[feature_local][m]: after the reduction area.
  double* zsum = red + T::kNumWarps * TN * MB * 4 * 32;
  for (int o = tid; o < T::BLOCK_N * T::kRows; o += T::kNumThreads) {
    // o -> (warp_n, f, mb, v, lane); feature = (warp_n TN + f) 16 + g + 8 (v / 2), row m = 8 mb + 2 t + v % 2.
    const int ln = o % 32, v = (o / 32) % 4, mb = (o / 128) % MB, f = (o / (128 * MB)) % TN,
              wn = o / (128 * MB * TN);
    double sum = 0.0;
#pragma unroll
    for (int wk = 0; wk < T::kWarpsK; ++wk)
      sum += red[((((wn * T::kWarpsK + wk) * TN + f) * MB + mb) * 4 + v) * 32 + ln];
    const int nl = (wn * TN + f) * 16 + (ln >> 2) + 8 * (v >> 1), m = 8 * mb + 2 * (ln & 3) + (v & 1);
    zsum[nl * T::kZsumStride + m] = sum;
  }
  __syncthreads();
  FUSED_GEMM_BN_SMALL_M_PHASE(4);
  if (kTma && p.coop) {
    small_m_coop_tail<T, kEval>(p, c, zsum, staged, zsum + T::BLOCK_N * T::kZsumStride);
    return;
  }
  if (p.pieces > 1) {  // the piece's float64 sums to the workspace, feature fastest
    for (int o = tid; o < T::BLOCK_N * T::kRows; o += T::kNumThreads) {
      const int fl = o % T::BLOCK_N, m = o / T::BLOCK_N;
      if (m < p.M && c.n0 + fl < p.N)
        p.partials[(static_cast<size_t>(c.piece) * p.M + m) * p.N + c.n0 + fl] = zsum[fl * T::kZsumStride + m];
    }
    return;
  }
  constexpr int kLanes = T::kEpilogueLanes;
  const int f = tid / kLanes, j = tid % kLanes, n = c.n0 + f;
  const bool store = n < p.N;
  double zd[T::kRows / kLanes];
#pragma unroll
  for (int i = 0; i < T::kRows / kLanes; ++i) zd[i] = zsum[f * T::kZsumStride + j + kLanes * i];
  const SmallMFeatureVectors vec = staged != nullptr ? small_m_staged_vectors<T::BLOCK_N>(p.bn, staged, f)
                                   : store           ? small_m_load_vectors(p.bn, n)
                                                     : SmallMFeatureVectors{};
  small_m_feature_epilogue<T::kRows, kLanes, kEval>(p, n, j, store, zd, vec, p.v + n, static_cast<size_t>(p.N));
}

// The cp.async ring (any sm_80+ GPU).  grid (ceil(N / BLOCK_N), pieces), kNumThreads
// threads, T::smem_bytes(kStages) of dynamic shared memory.  kStagesPerSync (1 or 2)
// ring stages are consumed per barrier: 1: the ring kStages - 1 stages ahead; 2
// (kStages = 4): stages in pairs, one cp.async group and one __syncthreads a pair, the
// next pair in flight while this one is read (2 stages ahead, but twice the independent
// work per barrier: the per-stage chain barrier -> shared loads -> conversions -> MMA is
// what bounds M = 9 .. 16, docs/perf.md v43 and v53).
template <class T, int kStages, int kStagesPerSync, bool kEval, bool kVec16>
__global__ void __launch_bounds__(T::kNumThreads, 1) small_m_fp64_kernel(const SmallMArgs p) {
  pdl_wait_then_release();
  static_assert((kStagesPerSync == 1 && kStages >= 2) || (kStagesPerSync == 2 && kStages == 4),
                "one stage a barrier, or pairs in a 4-stage ring");
  extern __shared__ __align__(128) unsigned char small_m_smem[];
  float* ring = reinterpret_cast<float*>(small_m_smem);
  const SmallMCta<T> c(p);
  small_m_count_batch<kEval>(p, c.tid);
  small_m_zero_pad_rows<T, kStages>(p, c, ring);
  const SmallMCopies16<T> copies(p, c.n0);  // unused (and dropped) in the 4-byte form
  auto issue_stage = [&](int tile) {
    float* stage = ring + (tile % kStages) * T::kStageFloats;
    const int k0 = c.k_begin + tile * T::BLOCK_K;
    if constexpr (kVec16)
      copies.issue(stage, k0, c.k_end);
    else
      small_m_issue_stage4<T>(p, stage, c.n0, k0, c.k_end);
  };
  // The first kStages - kStagesPerSync stages, one cp.async group per barrier's worth.
#pragma unroll
  for (int s = 0; s < kStages - kStagesPerSync; ++s) {
    if (s < c.num_tiles) issue_stage(s);
    if ((s + 1) % kStagesPerSync == 0) cp_async_commit();
  }
  SmallMAccum<T> a;
  for (int tile = 0; tile < c.num_tiles; tile += kStagesPerSync) {
    cp_async_wait<kStages / kStagesPerSync - 2>();
    // Stages tile .. tile + kStagesPerSync - 1 landed for every thread; the ones before
    // read by every warp, so their buffers take the next copies.
    __syncthreads();
#pragma unroll
    for (int u = 0; u < kStagesPerSync; ++u) {
      const int next = tile + kStages - kStagesPerSync + u;
      if (next < c.num_tiles) issue_stage(next);
    }
    cp_async_commit();
#pragma unroll
    for (int u = 0; u < kStagesPerSync; ++u) {
      if (u > 0 && tile + u >= c.num_tiles) break;  // an odd count's last pair: one stage
      small_m_stage_products<T>(ring + ((tile + u) % kStages) * T::kStageFloats, c, a);
    }
  }
  cp_async_wait<0>();  // only empty groups can be left; nothing writes the ring after this
  __syncthreads();     // every warp done with the ring: it becomes the reduction area
  small_m_cta_finish<T, kEval, false>(p, c, a, small_m_smem, nullptr);
}

// The TMA ring (Hopper: the sm_90a image; 16-byte rows, kVec16's condition).  The same
// grid, threads, stage layout and products as small_m_fp64_kernel; the dynamic shared
// memory is T::smem_bytes(kStages), then kStages "full" and kStages "empty" mbarriers, then
// the CTA's staged feature vectors (small_m_stage_vectors, where K is not split).
// One thread (warp 0, lane 0) fills the ring kStages - 1 stages ahead with two tensor
// copies a stage (cp.async.bulk.tensor.2d): W rows n0 .. n0 + BLOCK_N and x rows 0 ..
// kRows, each box kRowStride (144) floats wide from column k0, so that the box rows land
// exactly in the stage's padded rows (576 bytes, 64 mod 128: the consumers' reads stay
// bank-conflict free); the 16 columns past the stage's 128 are read and never used
// (12.5% more L2 traffic, the same DRAM bytes: the next stage reads them again from L2).
// Rows past N and M and columns past K are zero-filled by the copies: no pad rows, no K
// tail mask.  Every warp waits on the stage's full barrier (armed with the stage's bytes),
// reads it and arrives on its empty barrier (one arrival a warp); the producer waits on a
// stage's empty barrier before refilling it.  No CTA-wide barrier per stage and no
// per-thread copies: each warp runs on to the next stage as soon as it has landed (the
// per-stage chain barrier -> copies -> shared loads -> conversions -> MMA bounds the
// cp.async ring at M = 9 .. 16, docs/perf.md v43).  One bulk copy per 512-byte row piece
// (80 a stage) measured 2.2-2.5x the cp.async ring's time: the copy engine's time per
// copy, not bytes, bounded it (docs/perf.md v55).  Traps on any target but sm_90a (the
// launcher takes it only where the sm_90a image runs: small_m_tma_ready).
template <class T, int kStages, bool kEval>
__global__ void __launch_bounds__(T::kNumThreads, 1)
    small_m_fp64_tma_kernel(const __grid_constant__ CUtensorMap tmap_w, const __grid_constant__ CUtensorMap tmap_x,
                            const SmallMArgs p) {
  pdl_wait_then_release();
#if FUSED_GEMM_BN_SM90A
  extern __shared__ __align__(128) unsigned char small_m_smem[];
  float* ring = reinterpret_cast<float*>(small_m_smem);
  uint64_t* full = reinterpret_cast<uint64_t*>(small_m_smem + T::smem_bytes(kStages));
  uint64_t* empty = full + kStages;
  float* staged = reinterpret_cast<float*>(empty + kStages);  // kSmallMVectors x BLOCK_N
  FUSED_GEMM_BN_SMALL_M_PHASE(0);
  const SmallMCta<T> c(p);
  small_m_count_batch<kEval>(p, c.tid);
  const bool producer = c.tid == 0;
  if (producer) {
    sm90::tma_prefetch_descriptor(&tmap_w);
    sm90::tma_prefetch_descriptor(&tmap_x);
    for (int s = 0; s < kStages; ++s) {
      sm90::mbar_init(&full[s], 1);
      sm90::mbar_init(&empty[s], T::kNumWarps);
    }
    sm90::mbar_init_fence();
  }
  __syncthreads();
  auto issue_stage = [&](int tile) {  // the producer thread
    const int s = tile % kStages, k0 = c.k_begin + tile * T::BLOCK_K;
    float* stage = ring + s * T::kStageFloats;
    sm90::mbar_arrive_expect_tx(&full[s], T::kStageBytes);
    sm90::tma_load_2d(stage, &tmap_w, &full[s], k0, c.n0);
    sm90::tma_load_2d(stage + T::BLOCK_N * T::kRowStride, &tmap_x, &full[s], k0, 0);
  };
  if (producer)
    for (int s = 0; s < kStages - 1 && s < c.num_tiles; ++s) issue_stage(s);
  if (p.pieces == 1) small_m_stage_vectors<T::BLOCK_N>(p.bn, c.n0, p.N, staged);  // this kernel's epilogue's
  SmallMAccum<T> a;
  for (int tile = 0; tile < c.num_tiles; ++tile) {
    const int s = tile % kStages;
    if (producer) {  // refill the stage read at tile - 1 once every warp has arrived on its empty barrier
      const int next = tile + kStages - 1;
      if (next < c.num_tiles) {
        if (next >= kStages) sm90::mbar_wait(&empty[next % kStages], static_cast<uint32_t>(next / kStages - 1) & 1u);
        issue_stage(next);
      }
    }
    sm90::mbar_wait(&full[s], static_cast<uint32_t>(tile / kStages) & 1u);
    if (tile == 0) FUSED_GEMM_BN_SMALL_M_PHASE(1);
    small_m_stage_products<T>(ring + s * T::kStageFloats, c, a);
    __syncwarp();
    if (c.lane == 0) sm90::mbar_arrive(&empty[s]);
  }
  FUSED_GEMM_BN_SMALL_M_PHASE(2);
  __syncthreads();  // every stage landed and read by every warp: the ring becomes the reduction area
  FUSED_GEMM_BN_SMALL_M_PHASE(3);
  cp_async_wait<0>();  // this thread's staged vectors (the epilogue's thread f reads feature f's)
  small_m_cta_finish<T, kEval, true>(p, c, a, small_m_smem, staged);
  FUSED_GEMM_BN_SMALL_M_PHASE(8);
#else
  __trap();  // no sm_90a image: the launcher never takes this kernel here
#endif
}

// K split: z64[m, n] = sum over pieces in piece order, then the epilogue; one thread per feature.
template <int kRows, bool kEval>
__global__ void __launch_bounds__(256) small_m_fp64_finish_kernel(const SmallMArgs p) {
  pdl_wait_then_release();
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= p.N) return;
  double zd[kRows];
#pragma unroll
  for (int m = 0; m < kRows; ++m) {
    zd[m] = 0.0;
    if (m < p.M)
      for (int q = 0; q < p.pieces; ++q) zd[m] += p.partials[(static_cast<size_t>(q) * p.M + m) * p.N + n];
  }
  small_m_feature_epilogue<kRows, 1, kEval>(p, n, 0, true, zd, small_m_load_vectors(p.bn, n), p.v + n,
                                            static_cast<size_t>(p.N));
}

// Problem 84's row softmax in float64: out[m, :] = softmax(v[m, :]), one CTA of
// kSoftmaxThreads per row; each thread keeps its first kSoftmaxCache exponentials in
// registers (every one of them up to N = 8192) and recomputes the rest.  The max and
// the sum are block_reduce trees (the same order on every run); out = e / sum rounded once.
// NaN anywhere in a row makes the row NaN, as torch.softmax.
constexpr int kSoftmaxThreads = 1024;
constexpr int kSoftmaxCache = 8;

__global__ void __launch_bounds__(kSoftmaxThreads) small_m_softmax_fp64_kernel(const double* v, float* out, int N) {
  pdl_wait_then_release();
  __shared__ double red_max[kSoftmaxThreads / 32], red_sum[kSoftmaxThreads / 32];  // block_reduce's, one each
  const double* row = v + static_cast<size_t>(blockIdx.x) * N;
  float* out_row = out + static_cast<size_t>(blockIdx.x) * N;
  double row_max = -INFINITY;
  for (int j = threadIdx.x; j < N; j += kSoftmaxThreads) row_max = fmax(row_max, row[j]);
  row_max = block_reduce<true>(row_max, red_max);
  double e[kSoftmaxCache];
  double sum = 0.0;
#pragma unroll
  for (int i = 0; i < kSoftmaxCache; ++i) {
    const int j = threadIdx.x + i * kSoftmaxThreads;
    e[i] = j < N ? exp(row[j] - row_max) : 0.0;
    sum += e[i];
  }
  for (int j = threadIdx.x + kSoftmaxCache * kSoftmaxThreads; j < N; j += kSoftmaxThreads) sum += exp(row[j] - row_max);
  const double inv = 1.0 / block_reduce<false>(sum, red_sum);
#pragma unroll
  for (int i = 0; i < kSoftmaxCache; ++i) {
    const int j = threadIdx.x + i * kSoftmaxThreads;
    if (j < N) out_row[j] = static_cast<float>(e[i] * inv);
  }
  for (int j = threadIdx.x + kSoftmaxCache * kSoftmaxThreads; j < N; j += kSoftmaxThreads)
    out_row[j] = static_cast<float>(exp(row[j] - row_max) * inv);
}

// num_batches_tracked += 1 after the epilogue read it (momentum < 0).
__global__ void small_m_count_batch_kernel(int64_t* num_batches_tracked) {
  pdl_wait_then_release();
  *num_batches_tracked += 1;
}

// K pieces: 1 when the feature blocks fill the SMs (one CTA per SM), else as
// many as fill them once (each at least one BLOCK_K tile, at most kMaxPieces).
constexpr int kSmallMMaxPieces = 32;
struct SmallMPlan {
  int m_blocks = 0;  // 1, 2: the traits
  int pieces = 1, tiles_per_piece = 0;
};

static SmallMPlan small_m_plan(int M, int N, int K, int num_sms) {
  SmallMPlan plan;
  using T = SmallMTraits<1>;
  static_assert(T::BLOCK_N == SmallMTraits<2>::BLOCK_N && T::BLOCK_K == SmallMTraits<2>::BLOCK_K,
                "one tiling for both batch block counts");
  plan.m_blocks = M <= 8 ? 1 : 2;
  const int feature_blocks = (N + T::BLOCK_N - 1) / T::BLOCK_N;
  const int num_tiles = (K + T::BLOCK_K - 1) / T::BLOCK_K;
  int pieces = feature_blocks >= num_sms ? 1 : num_sms / feature_blocks;
  pieces = std::max(1, std::min({pieces, num_tiles, kSmallMMaxPieces}));
  plan.tiles_per_piece = (num_tiles + pieces - 1) / pieces;
  plan.pieces = (num_tiles + plan.tiles_per_piece - 1) / plan.tiles_per_piece;
  return plan;
}

// The shared-memory opt-in once per device and kernel (a host call per launch would sit
// inside a small launch's time); a racing second set is harmless.
template <class Kernel>
static cudaError_t small_m_smem_optin(Kernel kernel, int smem, int device, bool (&configured)[kMaxCachedDevices]) {
  if (device < kMaxCachedDevices && configured[device]) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err == cudaSuccess && device < kMaxCachedDevices) configured[device] = true;
  return err;
}

// The GEMM kernel on the plan's grid (its arguments: `args`, then p), then, with K split,
// the finish kernel.  Unlike the large GEMMs (pdl.cuh), the one-wave GEMM kernel releases
// its dependents at once: the kernel after it is launched while it runs and waits on the
// device (a small batch's call time is mostly such gaps).
template <class T, bool kEval, class Kernel, class... Args>
static cudaError_t launch_small_m_grid(Kernel kernel, int smem, const SmallMArgs& p, cudaStream_t stream,
                                       const Args&... args) {
  cudaError_t err = launch_kernel(kernel, dim3((p.N + T::BLOCK_N - 1) / T::BLOCK_N, p.pieces), dim3(T::kNumThreads),
                                  smem, stream, args..., p);
  if (err != cudaSuccess || p.pieces == 1) return err;
  return launch_kernel(small_m_fp64_finish_kernel<T::kRows, kEval>, dim3((p.N + 255) / 256), dim3(256), 0, stream,
                       p);
}

template <class T, int kStages, int kStagesPerSync, bool kEval, bool kVec16>
static cudaError_t launch_small_m_stages(const SmallMArgs& p, int device, cudaStream_t stream) {
  auto kernel = small_m_fp64_kernel<T, kStages, kStagesPerSync, kEval, kVec16>;
  constexpr int kSmem = T::smem_bytes(kStages);
  static bool configured[kMaxCachedDevices] = {};
  const cudaError_t err = small_m_smem_optin(kernel, kSmem, device, configured);
  return err != cudaSuccess ? err : launch_small_m_grid<T, kEval>(kernel, kSmem, p, stream);
}

// The TMA ring's 4 stages, its 8 mbarriers and the staged feature vectors.
constexpr int kSmallMTmaStages = 4;
template <class T>
constexpr int small_m_tma_smem_bytes() {
  return T::smem_bytes(kSmallMTmaStages) + 2 * kSmallMTmaStages * static_cast<int>(sizeof(uint64_t)) +
         kSmallMVectors * T::BLOCK_N * static_cast<int>(sizeof(float));
}

// Whether small_m_fp64_tma_kernel runs on `device`: compute capability 9.0, its shared
// memory fits, the driver's tensor-map encoder is there, and the sm_90a image is loaded
// (binaryVersion 90, as sm90_gemm_available asks of the fp16x3 kernel; another image
// traps).  Cached per device and kernel; a failed query leaves no error behind.
template <class T, bool kEval>
static bool small_m_tma_ready(const DeviceFacts& facts, int device) {
  if (facts.cc_major != 9 || facts.cc_minor != 0 || facts.smem_optin < small_m_tma_smem_bytes<T>()) return false;
  static signed char ready[kMaxCachedDevices] = {};  // 0 unknown, 1 yes, -1 no
  if (device < kMaxCachedDevices && ready[device] != 0) return ready[device] > 0;
  cudaFuncAttributes attr{};
  const bool ok = sm90::encode_tiled_fn() != nullptr &&
                  cudaFuncGetAttributes(&attr, small_m_fp64_tma_kernel<T, kSmallMTmaStages, kEval>) == cudaSuccess &&
                  attr.binaryVersion == 90;
  if (!ok) cudaGetLastError();
  if (device < kMaxCachedDevices) ready[device] = ok ? 1 : -1;
  return ok;
}

// The TMA ring's launch: W's and x's tensor maps (boxes of kRowStride floats x BLOCK_N
// and x kRows rows), the shared-memory opt-in, the grid: where p.coop, as one cooperative
// grid that does the whole call; where that launch is refused (the grid does not fit at
// once, e.g. beside another MPS client), p.coop = 0 and the kernels one after another.
template <class T, bool kEval>
static cudaError_t launch_small_m_tma(SmallMArgs& p, int device, cudaStream_t stream) {
  CUtensorMap tmap_w, tmap_x;
  if (!sm90::make_tensor_map_f32_rows(&tmap_w, p.w, p.N, p.K, p.K, T::kRowStride, T::BLOCK_N) ||
      !sm90::make_tensor_map_f32_rows(&tmap_x, p.x, p.M, p.K, p.x_row_stride, T::kRowStride, T::kRows))
    return cudaErrorInvalidValue;
  auto kernel = small_m_fp64_tma_kernel<T, kSmallMTmaStages, kEval>;
  constexpr int kSmem = small_m_tma_smem_bytes<T>();
  static bool configured[kMaxCachedDevices] = {};
  const cudaError_t err = small_m_smem_optin(kernel, kSmem, device, configured);
  if (err != cudaSuccess) return err;
  if (p.coop) {
    if (launch_kernel_cooperative(kernel, dim3((p.N + T::BLOCK_N - 1) / T::BLOCK_N, p.pieces), dim3(T::kNumThreads),
                                  kSmem, stream, tmap_w, tmap_x, p) == cudaSuccess)
      return cudaSuccess;
    p.coop = 0;
  }
  return launch_small_m_grid<T, kEval>(kernel, kSmem, p, stream, tmap_w, tmap_x);
}

// Hopper with 16-byte rows: the TMA ring (docs/perf.md v55: 0.91-0.98 of the cp.async
// ring's time at M = 9 .. 16, 0.97-1.01 at M <= 8; at split-K shapes of 1-2 stages a piece
// (4096 x 512, 1024 x 1000) within -6% .. +9% of it, no side consistently ahead).
// Elsewhere the cp.async ring: 4 stages where the device's shared memory holds them (sm_90:
// 227 KB), else 2 (sm_80's 163 KB, sm_86 / sm_89's 99 KB up to kMBlocks = 2; one stage in
// flight: 36 KB, 2 us at an A100's 15 B/ns per SM).  At M = 9 .. 16 (kMBlocks = 2) the
// 4-stage cp.async ring is read in pairs where a piece has at least kSmallMPairTiles stages
// (docs/perf.md v53, H200: 0.90-0.93 of the one-stage form's time at 8192 x 8192, 0.94-0.97
// at 8000 x 4096; at M <= 8 pairs measured the same at 8192 x 8192 and 1.02-1.06 at 8000 x
// 4096, and a piece of 2-4 stages keeps only one pair in flight).
constexpr int kSmallMPairTiles = 8;
template <class T, bool kEval, bool kVec16>
static cudaError_t launch_small_m_gemm(SmallMArgs& p, const DeviceFacts& facts, int device, cudaStream_t stream) {
  if constexpr (kVec16) {
    if (small_m_tma_ready<T, kEval>(facts, device)) return launch_small_m_tma<T, kEval>(p, device, stream);
  }
  p.coop = 0;  // the cp.async ring: the kernels one after another
  if (facts.smem_optin >= T::smem_bytes(4)) {
    if constexpr (T::kMBlocks == 2) {
      if (p.tiles_per_piece >= kSmallMPairTiles) return launch_small_m_stages<T, 4, 2, kEval, kVec16>(p, device, stream);
    }
    return launch_small_m_stages<T, 4, 1, kEval, kVec16>(p, device, stream);
  }
  if (facts.smem_optin >= T::smem_bytes(2)) return launch_small_m_stages<T, 2, 1, kEval, kVec16>(p, device, stream);
  return cudaErrorInvalidConfiguration;
}

// The pieces of the workspace: the split K's partial sums, then problem 84's v (M x N
// doubles) or, in the cooperative grid, its row_stats (M x the grid's <= num_sms CTAs pairs).
static int64_t small_m_partials_bytes(const SmallMPlan& plan, int M, int N) {
  return plan.pieces > 1 ? static_cast<int64_t>(plan.pieces) * M * N * static_cast<int64_t>(sizeof(double)) : 0;
}
static int64_t small_m_v_bytes(int M, int N, int num_sms, bool scale_after_bn) {
  return scale_after_bn ? static_cast<int64_t>(M) * std::max(N, 2 * num_sms) * static_cast<int64_t>(sizeof(double))
                        : 0;
}

// The GEMM with its epilogue (and the finish kernel), then problem 84's softmax, then,
// in training with momentum < 0, the step counter.  On Hopper's TMA ring, problem 84 with K
// not split runs its softmax in the GEMM kernel where the grid (one CTA a SM) fits on the
// device at once: a cooperative grid (small_m_coop_tail, docs/perf.md v86).
template <bool kEval>
static cudaError_t launch_small_m(SmallMArgs p, unsigned char* workspace, cudaStream_t stream) {
  DeviceFacts facts;
  int device = 0;
  cudaError_t err = current_device_facts(&facts);
  if (err == cudaSuccess) err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const SmallMPlan plan = small_m_plan(p.M, p.N, p.K, facts.num_sms);
  const int64_t partials_bytes = small_m_partials_bytes(plan, p.M, p.N);
  if (workspace == nullptr && partials_bytes + small_m_v_bytes(p.M, p.N, facts.num_sms, p.bn.scale_after_bn) > 0)
    return cudaErrorInvalidValue;
  p.pieces = plan.pieces, p.tiles_per_piece = plan.tiles_per_piece;
  p.partials = plan.pieces > 1 ? reinterpret_cast<double*>(workspace) : nullptr;
  p.v = p.bn.scale_after_bn ? reinterpret_cast<double*>(workspace + partials_bytes) : nullptr;
  p.row_stats = p.v;
  p.coop = p.bn.scale_after_bn && plan.pieces == 1 && reinterpret_cast<uintptr_t>(p.row_stats) % 16 == 0 &&
           (p.N + SmallMTraits<1>::BLOCK_N - 1) / SmallMTraits<1>::BLOCK_N <= facts.num_sms;
  // 16-byte copies: every row of W and x starts 16-byte aligned.
  const bool vec16 = p.K % 4 == 0 && reinterpret_cast<uintptr_t>(p.w) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(p.x) % 16 == 0 && p.x_row_stride % 4 == 0;
  switch (plan.m_blocks) {
    case 1:
      err = vec16 ? launch_small_m_gemm<SmallMTraits<1>, kEval, true>(p, facts, device, stream)
                  : launch_small_m_gemm<SmallMTraits<1>, kEval, false>(p, facts, device, stream);
      break;
    default:
      err = vec16 ? launch_small_m_gemm<SmallMTraits<2>, kEval, true>(p, facts, device, stream)
                  : launch_small_m_gemm<SmallMTraits<2>, kEval, false>(p, facts, device, stream);
  }
  if (err == cudaSuccess && p.bn.scale_after_bn && !p.coop)
    err = launch_kernel(small_m_softmax_fp64_kernel, dim3(p.M), dim3(kSoftmaxThreads), 0, stream,
                        static_cast<const double*>(p.v), p.out, p.N);
  if (err == cudaSuccess && !kEval && p.bn.momentum < 0.f)
    err = launch_kernel(small_m_count_batch_kernel, dim3(1), dim3(1), 0, stream, p.num_batches_tracked);
  return err;
}

static bool small_m_shape_ok(int M, int N, int K) { return M >= 1 && M <= kSmallMMaxRows && N >= 1 && K >= 1; }

}  // namespace fused_gemm_bn

// ---------------------------------------------------------------------------
// Host launchers (declared in launchers.cuh)
// ---------------------------------------------------------------------------

int fused_gemm_bn::small_m_fp64_max_rows() { return kSmallMMaxRows; }

int64_t fused_gemm_bn::small_m_fp64_workspace_bytes(int M, int N, int K, int num_sms, bool scale_after_bn) {
  if (!small_m_shape_ok(M, N, K) || num_sms < 1) return 0;
  return small_m_partials_bytes(small_m_plan(M, N, K, num_sms), M, N) + small_m_v_bytes(M, N, num_sms, scale_after_bn);
}

// bn: all of BatchNormArgs but bn.num_batches_tracked (the argument num_batches_tracked instead).
cudaError_t fused_gemm_bn::small_m_fp64_train(const float* x, int64_t x_row_stride, const float* w, int M, int N,
                                              int K, const BatchNormArgs& bn, int64_t* num_batches_tracked,
                                              float* out, float* z, float* stats, void* workspace,
                                              cudaStream_t stream) {
  if (!small_m_shape_ok(M, N, K) || M < 2 || (bn.scale_stride != 0 && bn.scale_stride != 1) || x == nullptr ||
      w == nullptr || out == nullptr ||
      bn.scale == nullptr || bn.running_mean == nullptr || bn.running_var == nullptr ||
      num_batches_tracked == nullptr)
    return cudaErrorInvalidValue;
  SmallMArgs p{};
  p.x = x, p.x_row_stride = x_row_stride, p.w = w, p.M = M, p.N = N, p.K = K;
  p.bn = bn;
  p.out = out, p.z = z, p.stats = stats, p.num_batches_tracked = num_batches_tracked;
  return launch_small_m<false>(p, static_cast<unsigned char*>(workspace), stream);
}

// bn: bias, scale, bn_weight, bn_bias, running_mean, running_var, eps, scale_after_bn.
cudaError_t fused_gemm_bn::small_m_fp64_eval(const float* x, int64_t x_row_stride, const float* w, int M, int N,
                                             int K, const BatchNormArgs& bn, float* out, void* workspace,
                                             cudaStream_t stream) {
  if (!small_m_shape_ok(M, N, K) || (bn.scale_stride != 0 && bn.scale_stride != 1) || x == nullptr || w == nullptr ||
      out == nullptr || bn.scale == nullptr || bn.running_mean == nullptr || bn.running_var == nullptr)
    return cudaErrorInvalidValue;
  SmallMArgs p{};
  p.x = x, p.x_row_stride = x_row_stride, p.w = w, p.M = M, p.N = N, p.K = K;
  p.bn = bn;
  p.out = out;
  return launch_small_m<true>(p, static_cast<unsigned char*>(workspace), stream);
}
