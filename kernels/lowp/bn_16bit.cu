// bn_16bit.cu -- after the 16-bit GEMM (sm80_gemm_bn_16bit.cu): the rest of
// training-mode BatchNorm1d (problem 33: Linear -> scale -> BatchNorm1d) and of
// BatchNorm1d -> scale -> Softmax(dim=1) (problem 84, training and eval) on
// 16-bit tensors (__half or __nv_bfloat16), rounding where PyTorch's eager ops
// round.  rnd = round to the 16-bit type (nearest even), f(v) = float(v).
//
// bn16_fold_train (both problems; one thread per feature j)
//   Inputs: part_mean, part_m2 (num_m_tiles, N) float32 from the GEMM's kTrain
//   epilogue over u (M, N), the BatchNorm input (16-bit values); bn_weight,
//   bn_bias (N); num_batches_tracked (int64, already incremented by the GEMM).
//   As PyTorch's native CUDA batch_norm (training, 2-D contiguous input):
//     mean = float32(mean of u),  var = float32(biased variance of u)
//     invstd = rsqrtf(var + eps)
//     running_mean = rnd(mean * f + (1 - f) * f(running_mean))
//     running_var  = rnd(var * c * f + (1 - f) * f(running_var)),  c = float32(M / (M - 1))
//     f = momentum, or float32(1 / num_batches_tracked) for momentum=None
//     (momentum < 0 here; nn.BatchNorm1d passes 1 / num_batches_tracked as the momentum)
//   Writes coeff[:, j] = {mean, invstd, f(bn_weight), f(bn_bias)} (lowp_coeff.cuh's (4, N) rows).
//   The tiles are merged in float64 (merge_tile_statistics, ../bn_stats.cuh:
//   no E[u^2] - E[u]^2 cancellation); PyTorch's Welford in float32 agrees to
//   float32 rounding, far below the 16-bit rounding of everything downstream.
//
// bn16_apply (problem 33, training; in place over out = u (M, N))
//   out = rnd(fma(w * (u - mean), invstd, b)) with coeff = {mean, invstd, w, b}:
//   the channels-last elementwise kernel's `w * (x - mean) * invstd + b`.
//   Memory-bound: one read and one write of out; 16-byte accesses (8 elements)
//   when N % 8 == 0 and out is 16-byte aligned, else 2-byte.
//
// bn16_softmax_rows (problem 84; one CTA per row m, in place over out (M, N)), in
// one of three modes (RowMode):
//   kTrain, with coeff (out = u = z):
//     v = rnd(rnd(fma(w * (u - mean), invstd, b)) * f(scale))   BatchNorm, then * scale
//   kEval, after a cuBLAS product (16-bit storage only): the same v from z with
//     coefficients made from the running statistics as they are read,
//     {mean, invstd} = {f(running_mean), rsqrtf(f(running_var) + eps)}: lowp_chain.cuh's
//     eval_out rounded to S, bit for bit what bn16_chain_eval would store, without
//     that kernel's launch and pass over z.  In place over z (out = z), or, for the
//     eval forward with gradients, z kept and read (in) and out written apart, the
//     coefficients used also written to coeff_out (4, N) (lowp_coeff.cuh's rows,
//     bn16_chain_eval's values) for bn_16bit_backward.cu
//   kPlain (eval after the GEMMs, whose epilogue already wrote v):  v = out
//   out = rnd(expf(v - max v) / sum expf(v - max v)): PyTorch's CUDA softmax on
//   a 16-bit tensor (max and sum in float32, rounded once to S).  The register and
//   walk kernels with 16-bit S form it as exp(v - m) exp(m - M) / S from each thread's
//   max m, one reduction of (max, sum) pairs a row, exp by ex2.approx and one
//   reciprocal a row (about 2^-20 relative before the rounding to S: row_factor16's
//   note); S = float (autocast) and the shared-memory kernels take IEEE expf and the
//   division as IEEE's from one reciprocal a row (RowDivisor, row_divisor.cuh).
//   Rows of N <= 16384 with 16-byte access keep v in registers
//   (bn16_softmax_rows_reg_kernel: up to 4 groups of 8 per thread, all loads issued
//   first; batches under 256 rows spread a row over up to 512 threads, one group
//   each); kTrain and kEval rows of N <= 8192 in batches of >= 512 rows: bn16_softmax_rows_walk_kernel,
//   resident CTAs walking the rows, one group per thread whose coefficients stay in
//   registers, the next two rows' groups copied ahead into shared memory (cp.async);
//   otherwise the CTA keeps v (16-bit, exact) in shared memory, N * 2 bytes
//   (16 KB for N = 8192): one read and one write of the row; rows longer than the
//   device's shared memory allows take the online variant (running max and
//   rescaled sum, Milakov & Gimelshein 2018, "Online normalizer calculation for
//   softmax"), which reads the row twice.  A NaN in a row makes the row NaN
//   (through the sum), as PyTorch.  16-byte accesses when N % 8 == 0 and out
//   and the vectors read are 16-byte aligned, else 2-byte.
//
// Autocast form (S = float: a float32 module under torch.autocast in T): out,
// scale, BatchNorm's parameters and running statistics are float32 and nothing
// is rounded to S (Storage<float>); problem 84 still rounds BatchNorm's output to
// T (BatchNorm returns T under autocast), then v = that * f(scale) and the
// softmax are float32, as PyTorch's type promotion runs them.
// Layout: row-major, contiguous; coeff (4, N) float32 (lowp_coeff.cuh); vectors (N) and out of S
// (16-bit T or float32).
// Launches: programmatic dependent launches on compute capability 9.0+ (pdl.cuh): every
// kernel here waits for the kernel before it (griddepcontrol.wait) before it touches
// memory, so its launch and CTA start overlap that kernel's tail.
// Preconditions: M >= 2 for the training kernels (the caller raises PyTorch's
// error for M == 1); any N >= 1.  Launchers return the launch error.

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "block_reduce.cuh"
#include "bn_stats.cuh"
#include "cp_async.cuh"
#include "device_facts.cuh"
#include "pdl.cuh"
#include "launchers.cuh"
#include "row_divisor.cuh"
#include "lowp_coeff.cuh"
#include "lowp_types.cuh"

namespace fused_gemm_bn {
namespace lowp {
namespace bn {

constexpr int kFoldThreads = 256;
constexpr int kApplyThreads = 256;
constexpr int kApplyRowsPerBlock = 8;   // 512 blocks of 256 threads at M = 1024, N = 8192 (3 resident an SM)
constexpr int kApplyRowBatch = 8;       // rows loaded before any is stored (in place: see bn_apply.cu)
constexpr int kApplyMinBlocks = 256;    // fewer rows per block below this grid (apply_for_storage)
constexpr int kRowThreads = 512;        // N = 8192: two 16-byte groups per thread
constexpr int kStaticSmemBytes = 1024;  // reserve for the block reductions' static arrays
constexpr int kVec = 8;                 // elements per 16-byte access

struct FoldArgs {
  const float* part_mean;
  const float* part_m2;
  int num_m_tiles, block_m, M, N;
  const void* bn_weight;  // S words, as the running statistics
  const void* bn_bias;
  const int64_t* num_batches_tracked;
  float momentum, eps;
  void* running_mean;
  void* running_var;
  float* coeff;  // (4, N)
};

template <typename S>
__global__ void __launch_bounds__(kFoldThreads) bn16_fold_train_kernel(const FoldArgs p) {
  using St = Storage<S>;
  using W = word_t<S>;
  pdl_wait_then_release();
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= p.N) return;
  double mean64, m2;
  merge_tile_statistics(p.part_mean, p.part_m2, p.num_m_tiles, p.block_m, p.M, p.N, j, mean64, m2);
  W* running_mean = static_cast<W*>(p.running_mean);
  W* running_var = static_cast<W*>(p.running_var);
  coeff_store1(p.coeff, p.N, j,
               train_coeff<S>(mean64, m2, p.M, running_factor(p.momentum, p.num_batches_tracked), p.eps,
                              St::load(static_cast<const W*>(p.bn_weight) + j),
                              St::load(static_cast<const W*>(p.bn_bias) + j), running_mean + j, running_var + j,
                              true));
}

// Each thread owns kCols columns (8 or 1) and walks rows_per_block rows, kApplyRowBatch at a
// time, every load of a batch issued before its first store.  16-bit storage holds the loads as
// they arrive (Group8: 4 registers a row), so that three CTAs share an SM with 8 rows each in
// flight (96 KB an SM); float32 storage holds 8 floats a row (two CTAs an SM).
template <typename S, int kCols>
__global__ void __launch_bounds__(kApplyThreads, sizeof(word_t<S>) == 2 && kCols == kVec ? 3 : 1)
    bn16_apply_kernel(word_t<S>* out, const float* __restrict__ coeff, int M, int N, int rows_per_block) {
  using St = Storage<S>;
  using Held = std::conditional_t<kCols == kVec, Group8<S>, float>;
  pdl_wait_then_release();
  const int col = (blockIdx.x * blockDim.x + threadIdx.x) * kCols;
  if (col >= N) return;
  float4 c[kCols];
  if constexpr (kCols == kVec) {
    coeff_load8(coeff, N, col, c);
  } else {
    c[0] = coeff_load1(coeff, N, col);
  }
  const int row0 = blockIdx.y * rows_per_block;
  const int row_end = min(M, row0 + rows_per_block);
  for (int row = row0; row < row_end; row += kApplyRowBatch) {
    Held held[kApplyRowBatch];
#pragma unroll
    for (int r = 0; r < kApplyRowBatch; ++r) {
      if (row + r >= row_end) break;
      const word_t<S>* q = out + static_cast<size_t>(row + r) * N + col;
      if constexpr (kCols == kVec) {
        held[r] = load_group8<S>(q);
      } else {
        held[r] = St::load(q);
      }
    }
#pragma unroll
    for (int r = 0; r < kApplyRowBatch; ++r) {
      if (row + r >= row_end) break;
      word_t<S>* q = out + static_cast<size_t>(row + r) * N + col;
      float v[kCols];
      if constexpr (kCols == kVec) {
        unpack8<S>(held[r], v);
      } else {
        v[0] = held[r];
      }
#pragma unroll
      for (int e = 0; e < kCols; ++e) v[e] = bn_affine(v[e], c[e]);
      if constexpr (kCols == kVec) {
        store_group<S>(q, v);
      } else {
        St::store(q, v[0]);
      }
    }
  }
}

// The softmax's input (RowMode): kPlain reads v itself; kTrain applies BatchNorm
// from coeff; kEval from the running statistics.
enum class RowMode { kPlain, kTrain, kEval };

struct RowArgs {
  void* out;               // S words
  const void* in;          // S words the row's values are read from: out (in place), or z (kEval, kept)
  const float* coeff;      // kTrain: (4, N) {mean, invstd, w, b} rows (lowp_coeff.cuh)
  const void* scale;       // kTrain, kEval: (N) S words
  const void* bn_weight;   // kEval: (N) S words each
  const void* bn_bias;
  const void* running_mean;
  const void* running_var;
  float eps;               // kEval
  int N;
  int scale_stride;        // 1, or 0: one number for every feature
  float* coeff_out;        // kEval: null, or (4, N) float32 for the coefficients used (store_eval_coeff)
};

// The scale of the kG features from feature i * kG on (kTrain, kEval): one 16-byte group,
// or with scale_stride 0 the one number at every feature.
template <typename S, int kG>
__device__ __forceinline__ void load_scale(const RowArgs& p, int i, float (&s)[kG]) {
  const word_t<S>* scale = static_cast<const word_t<S>*>(p.scale);
  if (p.scale_stride == 0) {
    const float s0 = Storage<S>::load(scale);
#pragma unroll
    for (int e = 0; e < kG; ++e) s[e] = s0;
  } else if constexpr (kG == kVec) {
    load_group<S>(scale + i * kVec, s);
  } else {
    s[0] = Storage<S>::load(scale + i);
  }
}

// load_scale's eight values for 16-bit S as their patterns, packed as pack2 packs them
// (one 16-byte load, or the one number in every half).
template <typename S>
__device__ __forceinline__ uint4 scale_words(const RowArgs& p, int i) {
  const uint16_t* scale = static_cast<const uint16_t*>(p.scale);
  if (p.scale_stride == 0) {
    const uint32_t s = pack2(*scale, *scale);
    return make_uint4(s, s, s, s);
  }
  return reinterpret_cast<const uint4*>(scale)[i];
}

// The BatchNorm coefficients {mean, invstd, w, b} of the kG features from feature
// i * kG on: kTrain's from coeff; kEval's from the running statistics, invstd =
// rsqrtf(running_var + eps) as lowp_chain.cuh's eval_out takes it.
template <typename S, int kG, RowMode kMode>
__device__ __forceinline__ void load_coeff(const RowArgs& p, int i, float4 (&c)[kG]) {
  if constexpr (kMode == RowMode::kTrain) {
    if constexpr (kG == kVec) {
      coeff_load8(p.coeff, p.N, i * kVec, c);
    } else {
      c[0] = coeff_load1(p.coeff, p.N, i);
    }
  } else {
    using St = Storage<S>;
    using W = word_t<S>;
    float rm[kG], rv[kG], w[kG], b[kG];
    if constexpr (kG == kVec) {
      load_group<S>(static_cast<const W*>(p.running_mean) + i * kVec, rm);
      load_group<S>(static_cast<const W*>(p.running_var) + i * kVec, rv);
      load_group<S>(static_cast<const W*>(p.bn_weight) + i * kVec, w);
      load_group<S>(static_cast<const W*>(p.bn_bias) + i * kVec, b);
    } else {
      rm[0] = St::load(static_cast<const W*>(p.running_mean) + i);
      rv[0] = St::load(static_cast<const W*>(p.running_var) + i);
      w[0] = St::load(static_cast<const W*>(p.bn_weight) + i);
      b[0] = St::load(static_cast<const W*>(p.bn_bias) + i);
    }
#pragma unroll
    for (int e = 0; e < kG; ++e) c[e] = make_float4(rm[e], rsqrtf(rv[e] + p.eps), w[e], b[e]);
  }
}

// kEval with coeff_out: the coefficients every row of this launch uses, {running_mean,
// rsqrtf(running_var + eps), bn.weight, bn.bias} per feature (load_coeff's), written for the
// backward by the grid's threads, one feature each.  Called by every kernel before its rows.
template <typename S, RowMode kMode>
__device__ __forceinline__ void store_eval_coeff(const RowArgs& p) {
  if constexpr (kMode == RowMode::kEval) {
    if (p.coeff_out == nullptr) return;
    const int threads = static_cast<int>(gridDim.x * blockDim.x);
    for (int j = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); j < p.N; j += threads) {
      float4 c[1];
      load_coeff<S, 1, kMode>(p, j, c);
      coeff_store1(p.coeff_out, p.N, j, c[0]);
    }
  }
}

// The softmax inputs v of the kG elements of group i of `row` (kG = 8 or 1):
// BatchNorm's output rounded to T (the dtype of BatchNorm's input), times the
// scale rounded to S.
template <typename T, typename S, int kG, RowMode kMode>
__device__ __forceinline__ void load_logits(const RowArgs& p, const word_t<S>* row, int i, float (&v)[kG]) {
  using St = Storage<S>;
  if constexpr (kG == kVec) {
    load_group<S>(row + i * kVec, v);
  } else {
    v[0] = St::load(row + i);
  }
  if constexpr (kMode != RowMode::kPlain) {
    float s[kG];
    load_scale<S, kG>(p, i, s);
    float4 c[kG];
    load_coeff<S, kG, kMode>(p, i, c);
#pragma unroll
    for (int e = 0; e < kG; ++e) v[e] = St::round(round16<T>(bn_affine(v[e], c[e])) * s[e]);
  }
}

// kCached: v kept in dynamic shared memory (S words, exact; one global read);
// else online max / sum and a second read of the row.
template <typename T, typename S, int kG, RowMode kMode, bool kCached>
__global__ void __launch_bounds__(kRowThreads) bn16_softmax_rows_kernel(const RowArgs p) {
  pdl_wait_then_release();
  using St = Storage<S>;
  extern __shared__ uint4 dynamic_smem[];
  word_t<S>* cache = reinterpret_cast<word_t<S>*>(dynamic_smem);
  __shared__ float red_max[kRowThreads / 32], red_sum[kRowThreads / 32];  // block_reduce's, one each
  store_eval_coeff<S, kMode>(p);
  word_t<S>* row = static_cast<word_t<S>*>(p.out) + static_cast<size_t>(blockIdx.x) * p.N;
  const word_t<S>* in_row = static_cast<const word_t<S>*>(p.in) + static_cast<size_t>(blockIdx.x) * p.N;
  const int num_groups = p.N / kG;

  float thread_max = -INFINITY, thread_sum = 0.f;
  for (int i = threadIdx.x; i < num_groups; i += blockDim.x) {
    float v[kG];
    load_logits<T, S, kG, kMode>(p, in_row, i, v);
    if constexpr (kCached) {
      if constexpr (kG == kVec) {
        store_group<S>(cache + i * kVec, v);  // exact: v is already an S value
      } else {
        St::store(cache + i, v[0]);
      }
#pragma unroll
      for (int e = 0; e < kG; ++e) thread_max = fmaxf(thread_max, v[e]);
    } else {
#pragma unroll
      for (int e = 0; e < kG; ++e) {
        const float new_max = fmaxf(thread_max, v[e]);
        thread_sum = thread_sum * expf(thread_max - new_max) + expf(v[e] - new_max);
        thread_max = new_max;
      }
    }
  }
  const float row_max = block_reduce<true>(thread_max, red_max);

  if constexpr (kCached) {
    for (int i = threadIdx.x; i < num_groups; i += blockDim.x) {
      float v[kG];
      if constexpr (kG == kVec) {
        load_group<S>(cache + i * kVec, v);
      } else {
        v[0] = St::load(cache + i);
      }
#pragma unroll
      for (int e = 0; e < kG; ++e) thread_sum += expf(v[e] - row_max);
    }
  } else {
    thread_sum = thread_max == -INFINITY ? 0.f : thread_sum * expf(thread_max - row_max);
  }
  const RowDivisor divide(block_reduce<false>(thread_sum, red_sum));

  for (int i = threadIdx.x; i < num_groups; i += blockDim.x) {
    float v[kG];
    if constexpr (kCached) {
      if constexpr (kG == kVec) {
        load_group<S>(cache + i * kVec, v);
      } else {
        v[0] = St::load(cache + i);
      }
    } else {
      load_logits<T, S, kG, kMode>(p, in_row, i, v);
    }
#pragma unroll
    for (int e = 0; e < kG; ++e) v[e] = divide(expf(v[e] - row_max));
    if constexpr (kG == kVec) {
      store_group<S>(row + i * kVec, v);
    } else {
      St::store(row + i, v[0]);
    }
  }
}

// The row softmax's exponentials and normalisation for 16-bit storage (S = T: the
// output is rounded to 11 or 8 significant bits), in one CTA reduction a row (the reg
// and walk kernels; S = float keeps expf and two reductions, the float32 output needing
// float32's accuracy).  Each thread takes its values' max m (NaN ignored; -inf for none),
// e = exp(v - m) and s = sum e; the CTA combines the (m, s) pairs, each partial sum
// rescaled by exp(m - M) to the larger max M (a butterfly over the lanes, then over
// the warps: max, rescale, sum), and each value becomes e * exp(m - M) / S
// (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax", its
// parallel form).  One barrier a row where max-then-sum takes two; 5 instructions an
// element where expf and the IEEE division took 13 (docs/perf.md v93).
// Numerics: exp by ex2.approx.ftz of d * log2(e) (exp_ftz; d = v - m formed first, exact
// or below exp's range; relative error about 2^-21 for |d| < 16, below 2^-17 down to
// exp's underflow) and the reciprocal of S once a row (rcp.approx.ftz, 1 ulp):
// about 2^-20 relative before the one rounding to T, against 2^-12 (float16) /
// 2^-9 (bfloat16) for that rounding itself, so a result lands on the other side of
// a rounding tie for about 2^-9 of the elements, each still within one unit of
// the exact value.  exp below 2^-126 is flushed to zero (ex2.approx.ftz): a
// bfloat16 output below 2^-126 (a subnormal, < 1.2e-38 after a row max of 1) is
// 0 instead.  Special values as PyTorch's softmax: a NaN anywhere makes the row NaN
// (through S); a row of -inf is NaN (S = 0, 0 * inf); +inf gives NaN (inf - inf).

// exp(d) as 2^(d log2(e)): one multiply and MUFU.EX2 (PTX ISA, "ex2": ex2.approx.ftz.f32,
// maximum relative error 2^-22 over its range; a result below 2^-126 flushed to +0).
// __expf adds a range test and two predicated multiplies for subnormal results.
__device__ __forceinline__ float exp_ftz(float d) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d * 1.4426950408889634f));
  return r;
}

// exp(m - M) for a partial max m under the combined max M >= m; 0 for a part with no
// value above -inf, so that it adds nothing (0 times its sum: 0, or NaN kept).
__device__ __forceinline__ float rescale16(float m, float M) { return m == -INFINITY ? 0.f : exp_ftz(m - M); }

// v <- exp(v - m) for this thread's values, m their max; returns their sum.
template <int kV>
__device__ __forceinline__ float row_exps16(float (&v)[kV], float m) {
  const float base = m == -INFINITY ? 0.f : m;  // none above -inf: v - 0 is -inf (e = 0) or NaN
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < kV; ++e) {
    v[e] = exp_ftz(v[e] - base);
    s += v[e];
  }
  return s;
}

// The factor that takes this thread's e = exp(v - m) to its outputs, exp(m - M) / S, from
// its (m, s) and every other thread's.  red (shared): blockDim.x / 32 float2, this
// reduction's own until a barrier that every thread reaches after it (one buffer a row
// parity in the walk).
__device__ __forceinline__ float row_factor16(float m, float s, float2* red) {
  const float warp_max = warp_butterfly<true>(m);
  const float warp_sum = warp_butterfly<false>(s * rescale16(m, warp_max));
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (lane == 0) red[threadIdx.x / 32] = make_float2(warp_max, warp_sum);
  __syncthreads();
  const float2 q = lane < static_cast<int>(blockDim.x / 32) ? red[lane] : make_float2(-INFINITY, 0.f);
  const float row_max = warp_butterfly<true>(q.x);
  const float row_sum = warp_butterfly<false>(q.y * rescale16(q.x, row_max));
  float r;  // 1 / row_sum to 1 ulp (PTX ISA, "rcp": rcp.approx.ftz.f32); row_sum >= 1 (the max's own term)
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(row_sum));
  return rescale16(m, row_max) * r;
}

// Rows of at most kRegGroups * kRowThreads groups of 8 (N <= 16384): v kept
// in registers, every group's load issued before any is used (one global
// read, as kCached, without the shared-memory round trips).
constexpr int kRegGroups = 4;
constexpr int kSpreadRows = 256;  // fewer rows: each row over up to kRowThreads threads (launch_softmax_rows)

template <typename T, typename S, RowMode kMode>
__global__ void __launch_bounds__(kRowThreads) bn16_softmax_rows_reg_kernel(const RowArgs p) {
  pdl_wait_then_release();
  store_eval_coeff<S, kMode>(p);
  word_t<S>* row = static_cast<word_t<S>*>(p.out) + static_cast<size_t>(blockIdx.x) * p.N;
  const word_t<S>* in_row = static_cast<const word_t<S>*>(p.in) + static_cast<size_t>(blockIdx.x) * p.N;
  const int num_groups = p.N / kVec;
  float v[kRegGroups][kVec];
#pragma unroll
  for (int j = 0; j < kRegGroups; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i < num_groups) {
      load_logits<T, S, kVec, kMode>(p, in_row, i, v[j]);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) v[j][e] = -INFINITY;
    }
  }
  float thread_max = -INFINITY;
#pragma unroll
  for (int j = 0; j < kRegGroups; ++j)
#pragma unroll
    for (int e = 0; e < kVec; ++e) thread_max = fmaxf(thread_max, v[j][e]);
  if constexpr (!std::is_same_v<S, float>) {  // 16-bit storage: one reduction of (max, sum) pairs
    __shared__ float2 red[kRowThreads / 32];
    float thread_sum = 0.f;
#pragma unroll
    for (int j = 0; j < kRegGroups; ++j) thread_sum += row_exps16(v[j], thread_max);  // groups past N: -inf, e = 0
    const float factor = row_factor16(thread_max, thread_sum, red);
#pragma unroll
    for (int j = 0; j < kRegGroups; ++j) {
      const int i = threadIdx.x + j * blockDim.x;
      if (i < num_groups) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) v[j][e] *= factor;
        store_group<S>(row + i * kVec, v[j]);
      }
    }
  } else {  // float storage: expf, then the IEEE division (RowDivisor)
    __shared__ float red_max[kRowThreads / 32], red_sum[kRowThreads / 32];  // block_reduce's, one each
    const float row_max = block_reduce<true>(thread_max, red_max);
    float thread_sum = 0.f;
#pragma unroll
    for (int j = 0; j < kRegGroups; ++j)
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const int i = threadIdx.x + j * blockDim.x;
        v[j][e] = i < num_groups ? expf(v[j][e] - row_max) : 0.f;  // expf(v - max), reused below
        thread_sum += v[j][e];
      }
    const RowDivisor divide(block_reduce<false>(thread_sum, red_sum));
#pragma unroll
    for (int j = 0; j < kRegGroups; ++j) {
      const int i = threadIdx.x + j * blockDim.x;
      if (i < num_groups) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) v[j][e] = divide(v[j][e]);
        store_group<S>(row + i * kVec, v[j]);
      }
    }
  }
}

// Tall batches of rows of N <= 8 * kWalkMaxThreads with 16-byte access (launch_softmax_rows
// says which): resident CTAs walk the rows blockIdx.x, blockIdx.x + gridDim.x, ...; thread
// i owns group i (columns 8 i .. 8 i + 7) of every row, so kTrain / kEval keep that
// group's coefficients in registers over the walk (the reg kernel reloads them per row:
// a float4 per element, 128 KB per row of 8192 from L2).  Each thread copies its group of
// the CTA's rows kWalkStages - 1 steps ahead into its own shared-memory slots (cp.async:
// no registers held while in flight), so the loads of the next rows overlap this row's
// reductions and stores.  Against the 4-rows-per-CTA kernel it replaced (1024 x 8192
// float16 training, H200, docs/perf.md v46): the walk alone 0.885x its time, with
// block_reduce's butterfly over the warps 0.70x (a row's two reductions over 32 warps
// are its critical path).  Same thread <-> group mapping and reductions as one CTA per
// row of this width, so the outputs do not depend on the walk.  With 16-bit storage the
// product by the scale and the row's max run on T pairs (mul2_rn, max2: the same values;
// 320-330 instructions a warp per row instead of 379-395, docs/perf.md v81), and the
// softmax takes one reduction a row (row_factor16: 238 instructions and one barrier a row
// in float16 training, v93).  sm_80+
// (cp.async; the 16-bit kernels run from compute capability 8.0).
constexpr int kWalkMaxThreads = 1024;
constexpr int kWalkStages = 3;          // slots per thread: this row's group and the next two rows'
// kTrain and kEval from this many rows (fewer: the reg kernel, its rows spread).  kPlain
// (no coefficients to hold) stays on the reg kernel: 256 threads a row and 4 groups each
// measured 0.55-0.87x the walk's time at 512-16384 rows of 4096-8192 (H200, v46, both with
// the warp-order reduction; not measured since the butterfly).
constexpr int kWalkMinRows = 512;

// 16-byte chunks per group of 8 elements of S: 1 (16-bit), 2 (float).
template <typename S>
constexpr int kGroupChunks = static_cast<int>(kVec * sizeof(word_t<S>) / 16);

// The walk's dynamic shared memory: kWalkStages slots of one group per thread.
template <typename S>
size_t walk_smem_bytes(int threads) {
  return static_cast<size_t>(kWalkStages) * threads * kGroupChunks<S> * 16;
}

template <typename T, typename S, RowMode kMode>
__global__ void __launch_bounds__(kWalkMaxThreads) bn16_softmax_rows_walk_kernel(const RowArgs p, int M) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  pdl_wait_then_release();
  using St = Storage<S>;
  using W = word_t<S>;
  constexpr int kChunks = kGroupChunks<S>;
  extern __shared__ uint4 walk_slots[];  // [stage][thread][chunk]
  __shared__ float red_max[kWalkMaxThreads / 32], red_sum[kWalkMaxThreads / 32];  // block_reduce's, one each
  // row_factor16's, one a row parity: a row's buffer is written again two rows later, after
  // the next row's barrier, which every thread reaches after reading it.
  __shared__ float2 red_pair[2][kWalkMaxThreads / 32];
  int parity = 0;
  const int i = threadIdx.x;  // this thread's group: columns 8 i .. 8 i + 7
  const bool active = i < p.N / kVec;
  store_eval_coeff<S, kMode>(p);
  W* const out = static_cast<W*>(p.out) + i * kVec;
  const W* const in = static_cast<const W*>(p.in) + i * kVec;
  const int slot = i * kChunks;  // this thread's chunk index in stage 0
  const int stage_stride = static_cast<int>(blockDim.x) * kChunks;
  // The group's coefficients {mean, invstd, w, b}, held over the walk as 32 floats: w and b
  // packed as two 16-bit patterns a word (24 registers) cost 16 conversions a row (v81).
  float4 held[kVec];
  if constexpr (kMode != RowMode::kPlain) {
    if (active) load_coeff<S, kVec, kMode>(p, i, held);
  }
  const int step = static_cast<int>(gridDim.x);
  const size_t row_step = static_cast<size_t>(step) * p.N;  // elements from one of this CTA's rows to its next
  // One commit group per step (empty past the last row), so the wait below counts steps.
  const W* ahead = in + static_cast<size_t>(blockIdx.x) * p.N;  // the next row to copy
  int ahead_row = blockIdx.x, ahead_stage = 0;
  auto copy_ahead = [&]() {
    if (active && ahead_row < M) {
#pragma unroll
      for (int k = 0; k < kChunks; ++k)
        cp_async<16>(walk_slots + ahead_stage * stage_stride + slot + k, reinterpret_cast<const uint4*>(ahead) + k,
                     true);
    }
    cp_async_commit();
    ahead += row_step;
    ahead_row += step;
    ahead_stage = ahead_stage == kWalkStages - 1 ? 0 : ahead_stage + 1;
  };
#pragma unroll
  for (int s = 0; s < kWalkStages - 1; ++s) copy_ahead();
  W* row = out + static_cast<size_t>(blockIdx.x) * p.N;
  for (int r = blockIdx.x, stage = 0; r < M; r += step, row += row_step) {
    copy_ahead();
    cp_async_wait<kWalkStages - 1>();  // this thread's copy of row r has landed (its own slot: no barrier)
    float v[kVec];
    float thread_max = -INFINITY;
    if (active) {
      const uint4* q = walk_slots + stage * stage_stride + slot;
      if constexpr (kChunks == 1) {
        load_group<S>(reinterpret_cast<const W*>(q), v);
      } else {
        const uint4 a = q[0], b = q[1];
        const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int e = 0; e < kVec; ++e) v[e] = __uint_as_float(w[e]);
      }
      if constexpr (kMode != RowMode::kPlain && kChunks == 1) {
        // 16-bit storage (S = T): load_logits' v = rnd(rnd(affine) * scale) in pairs, the
        // product and the max on T pairs (mul2_rn, max2: the same values, lowp_types.cuh).
        const uint4 sg = scale_words<S>(p, i);  // reloaded per row (L1): 2 bytes per element, not 16
        const uint32_t s2[4] = {sg.x, sg.y, sg.z, sg.w};
        uint32_t w2[4];
#pragma unroll
        for (int k = 0; k < 4; ++k)
          w2[k] = mul2_rn<S>(pack2_rn<T>(bn_affine(v[2 * k], held[2 * k]), bn_affine(v[2 * k + 1], held[2 * k + 1])),
                             s2[k]);
        const uint32_t m2 = max2<S>(max2<S>(w2[0], w2[1]), max2<S>(w2[2], w2[3]));
        thread_max = fmaxf(Bits<S>::to_float(static_cast<uint16_t>(m2)),
                           Bits<S>::to_float(static_cast<uint16_t>(m2 >> 16)));
        unpack8<S>(Group8<S>{{make_uint4(w2[0], w2[1], w2[2], w2[3])}}, v);
      } else {
        if constexpr (kMode != RowMode::kPlain) {
          float s[kVec];  // the scale, reloaded per row (L1): 4 bytes per element, not 16
          load_scale<S, kVec>(p, i, s);
#pragma unroll
          for (int e = 0; e < kVec; ++e) v[e] = St::round(round16<T>(bn_affine(v[e], held[e])) * s[e]);  // load_logits'
        }
#pragma unroll
        for (int e = 0; e < kVec; ++e) thread_max = fmaxf(thread_max, v[e]);
      }
    }
    stage = stage == kWalkStages - 1 ? 0 : stage + 1;
    if constexpr (kChunks == 1) {  // 16-bit storage: one reduction of (max, sum) pairs (row_factor16)
      const float thread_sum = row_exps16(v, thread_max);  // past N (not active): v unset, the sum dropped
      const float factor = row_factor16(thread_max, active ? thread_sum : 0.f, red_pair[parity]);
      parity ^= 1;
      if (active) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) v[e] *= factor;
        store_group<S>(row, v);
      }
    } else {  // float storage: expf, then the IEEE division (RowDivisor)
      const float row_max = block_reduce<true>(thread_max, red_max);
      float thread_sum = 0.f;
      if (active) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          v[e] = expf(v[e] - row_max);
          thread_sum += v[e];
        }
      }
      const RowDivisor divide(block_reduce<false>(thread_sum, red_sum));
      if (active) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) v[e] = divide(v[e]);
        store_group<S>(row, v);
      }
    }
  }
  cp_async_wait<0>();
#elif defined(__CUDA_ARCH__)
  __trap();  // never launched below compute capability 8.0 (the binding refuses it first)
#endif
}

// The walk's launch: as many CTAs as are resident at once (cudaOccupancyMaxActiveBlocksPerMultiprocessor
// with its shared memory, asked once per device, instantiation and block size), at most one per row.
// `static`: the cache is this extension's own.  A function-local static of a function with external
// linkage is emitted as a GNU unique symbol, which the dynamic loader merges across every library
// loaded in the process: a second copy of the 16-bit extension (two differing copies of model_new
// in one process) then found the first one's cache filled, skipped cudaFuncSetAttribute for its own
// kernel, and its launch failed (invalid argument).  .ci/run fails on any such symbol in kernels/.
template <typename T, typename S, RowMode kMode>
static cudaError_t launch_walk(const RowArgs& p, int M, int threads, cudaStream_t stream) {
  static int resident[kMaxCachedDevices][kWalkMaxThreads / 32 + 1] = {};
  auto kernel = bn16_softmax_rows_walk_kernel<T, S, kMode>;
  const size_t smem = walk_smem_bytes<S>(threads);
  DeviceFacts facts;
  cudaError_t err = current_device_facts(&facts);
  if (err != cudaSuccess) return err;
  int device = 0;
  err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  int per_sm = device < kMaxCachedDevices ? resident[device][threads / 32] : 0;
  if (per_sm == 0) {  // first launch of this block size on this device: its shared memory allowed, then counted
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(walk_smem_bytes<S>(kWalkMaxThreads)));
    if (err != cudaSuccess) return err;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem);
    if (err != cudaSuccess) return err;
    per_sm = max(per_sm, 1);
    if (device < kMaxCachedDevices) resident[device][threads / 32] = per_sm;
  }
  const int grid = static_cast<int>(min(static_cast<int64_t>(M), static_cast<int64_t>(per_sm) * facts.num_sms));
  return launch_kernel(kernel, grid, threads, smem, stream, p, M);
}

template <typename T, typename S, int kG, RowMode kMode>
cudaError_t launch_softmax_rows(const RowArgs& p, int M, cudaStream_t stream) {
  const int num_groups = p.N / kG;
  if constexpr (kG == kVec && kMode != RowMode::kPlain) {
    if (num_groups <= kWalkMaxThreads && M >= kWalkMinRows)
      return launch_walk<T, S, kMode>(p, M, max(32, (num_groups + 31) / 32 * 32), stream);
  }
  if constexpr (kG == kVec) {
    if (num_groups <= kRegGroups * kRowThreads) {
      // kRegGroups groups per thread.  Batches of fewer than kSpreadRows rows (one
      // CTA per row) leave too few warps per SM to hide the loads' latency: each
      // row is spread over up to kRowThreads threads instead, one group each
      // (float16 training: 128 x 4096 8.9 -> 6.3 us, 128 x 8192 11.5 -> 10.3 us;
      // from 256 rows on it measured mixed, 333 x 5000 14.5 -> 17-18 us: docs/perf.md v32).
      const int per_thread = M < kSpreadRows ? 1 : kRegGroups;
      const int threads =
          min(kRowThreads, max(32, ((num_groups + per_thread - 1) / per_thread + 31) / 32 * 32));
      return launch_kernel(bn16_softmax_rows_reg_kernel<T, S, kMode>, M, threads, 0, stream, p);
    }
  }
  const int threads = min(kRowThreads, max(32, (num_groups + 31) / 32 * 32));
  int device = 0, max_optin = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  err = cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return err;
  const size_t cache_bytes = (static_cast<size_t>(p.N) * sizeof(word_t<S>) + 15) / 16 * 16;
  if (cache_bytes + kStaticSmemBytes <= static_cast<size_t>(max_optin)) {
    auto kernel = bn16_softmax_rows_kernel<T, S, kG, kMode, true>;
    if (cache_bytes > 48 * 1024) {
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(cache_bytes));
      if (err != cudaSuccess) return err;
    }
    return launch_kernel(kernel, M, threads, cache_bytes, stream, p);
  }
  return launch_kernel(bn16_softmax_rows_kernel<T, S, kG, kMode, false>, M, threads, 0, stream, p);
}

inline bool aligned16(const void* q) { return q == nullptr || reinterpret_cast<uintptr_t>(q) % 16 == 0; }

template <typename T, typename S, RowMode kMode>
cudaError_t softmax_rows_for_storage(const RowArgs& p, int M, cudaStream_t stream) {
  const bool vec = p.N % kVec == 0 && aligned16(p.out) && aligned16(p.in) && (p.scale_stride == 0 || aligned16(p.scale)) &&
                   aligned16(p.bn_weight) && aligned16(p.bn_bias) && aligned16(p.running_mean) &&
                   aligned16(p.running_var);
  return vec ? launch_softmax_rows<T, S, kVec, kMode>(p, M, stream) : launch_softmax_rows<T, S, 1, kMode>(p, M, stream);
}

template <typename T>
cudaError_t softmax_rows_for_type(const RowArgs& p, bool float32_io, int M, cudaStream_t stream) {
  if (p.coeff != nullptr)
    return float32_io ? softmax_rows_for_storage<T, float, RowMode::kTrain>(p, M, stream)
                      : softmax_rows_for_storage<T, T, RowMode::kTrain>(p, M, stream);
  return float32_io ? softmax_rows_for_storage<T, float, RowMode::kPlain>(p, M, stream)
                    : softmax_rows_for_storage<T, T, RowMode::kPlain>(p, M, stream);
}

template <typename S>
cudaError_t apply_for_storage(word_t<S>* out, const float* coeff, int M, int N, cudaStream_t stream) {
  const bool vec = N % kVec == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const int cols_per_thread = vec ? kVec : 1;
  const int threads_needed = (N + cols_per_thread - 1) / cols_per_thread;
  // grid.y is capped at 65535: very tall inputs give each block more rows.  Small
  // inputs give each block fewer rows, down to 1, until the grid has kApplyMinBlocks
  // blocks (128 x 2048: 8 blocks of 16 rows before, a latency-bound 5.9 us).
  const int col_blocks = (threads_needed + kApplyThreads - 1) / kApplyThreads;
  int rows_per_block = max(kApplyRowsPerBlock, (M + 65534) / 65535);
  while (rows_per_block > 1 && static_cast<int64_t>(col_blocks) * ((M + rows_per_block - 1) / rows_per_block) <
                                   kApplyMinBlocks)
    rows_per_block /= 2;
  const dim3 grid(col_blocks, (M + rows_per_block - 1) / rows_per_block);
  if (vec) {
    return launch_kernel(bn16_apply_kernel<S, kVec>, grid, kApplyThreads, 0, stream, out, coeff, M, N, rows_per_block);
  }
  return launch_kernel(bn16_apply_kernel<S, 1>, grid, kApplyThreads, 0, stream, out, coeff, M, N, rows_per_block);
}

}  // namespace bn
}  // namespace lowp
}  // namespace fused_gemm_bn

// ---------------------------------------------------------------------------
// Host launchers (raw pointers and the call's LowpBatchNormArgs, launchers.cuh)
// ---------------------------------------------------------------------------

// Training statistics of both problems: coeff (N float4) and the running
// statistics, from the GEMM's per-tile statistics.
cudaError_t fused_gemm_bn::lowp_bn_fold_train(const LowpBatchNormArgs& bn, const float* part_mean,
                                              const float* part_m2, int num_m_tiles, int block_m, int M, int N,
                                              float* coeff, cudaStream_t stream) {
  using namespace fused_gemm_bn::lowp;
  using namespace fused_gemm_bn::lowp::bn;
  if (M == 0 || N == 0) return cudaSuccess;
  const FoldArgs p{part_mean,
                   part_m2,
                   num_m_tiles,
                   block_m,
                   M,
                   N,
                   bn.bn_weight,
                   bn.bn_bias,
                   bn.num_batches_tracked,
                   bn.momentum,
                   bn.eps,
                   bn.running_mean,
                   bn.running_var,
                   coeff};
  const int blocks = (N + kFoldThreads - 1) / kFoldThreads;
  if (bn.float32_io) {  // float32 parameters and running statistics
    return launch_kernel(bn16_fold_train_kernel<float>, blocks, kFoldThreads, 0, stream, p);
  }
  return dispatch_dtype(bn.dtype, [&](auto t) {
    return launch_kernel(bn16_fold_train_kernel<typename decltype(t)::type>, blocks, kFoldThreads, 0, stream, p);
  });
}

// Problem 33, training: out (M, N) <- BatchNorm of out with coeff, in place.
cudaError_t fused_gemm_bn::lowp_bn_apply(const LowpBatchNormArgs& bn, void* out, const float* coeff, int M, int N,
                                         cudaStream_t stream) {
  using namespace fused_gemm_bn::lowp;
  using namespace fused_gemm_bn::lowp::bn;
  if (M == 0 || N == 0) return cudaSuccess;
  const float* c = coeff;
  if (bn.float32_io) return apply_for_storage<float>(static_cast<float*>(out), c, M, N, stream);
  uint16_t* o = static_cast<uint16_t*>(out);
  return dispatch_dtype(bn.dtype,
                        [&](auto t) { return apply_for_storage<typename decltype(t)::type>(o, c, M, N, stream); });
}

// Problem 84: out (M, N) <- row softmax of rnd(rnd(BatchNorm(out)) * bn.scale)
// (coeff given: training) or of out itself (coeff == nullptr: eval, the scale
// unread), in place.
cudaError_t fused_gemm_bn::lowp_softmax_rows(const LowpBatchNormArgs& bn, void* out, const float* coeff, int M, int N,
                                             cudaStream_t stream) {
  using namespace fused_gemm_bn::lowp;
  using namespace fused_gemm_bn::lowp::bn;
  if (M == 0 || N == 0) return cudaSuccess;
  const RowArgs p{out,     out,     coeff,   coeff != nullptr ? bn.scale : nullptr, nullptr, nullptr, nullptr, nullptr,
                  0.f,     N,       bn.scale_stride, nullptr};
  return dispatch_dtype(bn.dtype, [&](auto t) {
    return softmax_rows_for_type<typename decltype(t)::type>(p, bn.float32_io, M, stream);
  });
}

// Problem 84, eval, after a cuBLAS product: out (M, N) of the 16-bit type <- row softmax
// of rnd(eval_out(z)) (kEval: BatchNorm with the running statistics and the scale applied
// as each row of z is read); z may be out (in place).  coeff, when not null: (4, N) float32
// <- the coefficients used (the eval forward with gradients, z kept).  16-bit vectors only
// (bn.float32_io: cudaErrorInvalidValue), problem 84 only (bn.scale_after_bn).
cudaError_t fused_gemm_bn::lowp_bn_softmax_rows_eval(const LowpBatchNormArgs& bn, const void* z, void* out, int M,
                                                     int N, float* coeff, cudaStream_t stream) {
  using namespace fused_gemm_bn::lowp;
  using namespace fused_gemm_bn::lowp::bn;
  if (M == 0 || N == 0) return cudaSuccess;
  if (bn.float32_io || !bn.scale_after_bn) return cudaErrorInvalidValue;
  const RowArgs p{out, z,  nullptr, bn.scale, bn.bn_weight, bn.bn_bias, bn.running_mean, bn.running_var, bn.eps, N,
                  bn.scale_stride, coeff};
  return dispatch_dtype(bn.dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    return softmax_rows_for_storage<T, T, RowMode::kEval>(p, M, stream);
  });
}
