// bn_16bit_strip.cu -- training-mode BatchNorm after a cuBLAS product (the
// lowp_cublas route) in one kernel, for batches of at most kStripMaxRows rows:
// each CTA owns whole columns (features) of z, so it has every row of them and
// needs no other CTA's statistics.  It replaces bn16_chain_train + bn16_fold_train
// (+ bn16_apply for problem 33) of bn_16bit_chain.cu / bn_16bit.cu, three launches
// whose grids are small at small batches (docs/perf.md v33).
//
// T: the product's 16-bit type (__half or __nv_bfloat16); S: the storage of the
// vectors and out (T, or float for a float32 module under autocast, lowp_types.cuh).
//
// bn16_strip_train (both problems)
//   u = train_u(z, scale) (lowp_chain.cuh; 33: rnd_S(z scale), 84: z), then per feature j:
//     mean = float32(sum of u / M), var = float32(sum of (u - mean)^2 / M), both sums
//       in float64 (the same statistics bn16_fold_train makes from the GEMMs' tiles,
//       to float32 rounding; no E[u^2] - E[u]^2 cancellation);
//     running_mean / running_var updated as bn16_fold_train does (momentum f, or
//       1 / num_batches_tracked for momentum < 0, Bessel's M / (M - 1), rounded to S);
//     coeff[:, j] = {mean, rsqrtf(var + eps), f(bn_weight), f(bn_bias)} (lowp_coeff.cuh);
//   problem 33: out = rnd_S(fma(w (u - mean), invstd, b)), bn16_apply's value;
//   problem 84: out = u (skipped when out is z: the row softmax reads u = z there).
//   num_batches_tracked: with momentum >= 0 this kernel adds 1 (nothing reads it);
//   with momentum < 0 the caller adds 1 before the launch and the kernel reads it.
// CTA: kStripThreads threads = kStripGroups groups of 8 features (16-byte
// accesses: N % 8 == 0, z and out 16-byte aligned) x kStripSlices row slices; a
// thread holds rows slice, slice + kStripSlices, ... (kRows of them: 1, 2, 4 or
// kStripRowsPerThread = 8, the fewest that cover M; registers grow with kRows),
// all loaded before any is used.  kStripGroups = 2: each row segment is one
// 32-byte sector.  The slices' sums meet in shared memory (float64).
// bn16_strip_train_rows (batches of at most kThreadRows = 8 rows): the same outputs, each
//   thread owning one group of 8 features and every row of them, kRowsThreads threads a
//   CTA, so no reduction crosses threads.  The slices above are nearly all empty there
//   (512 CTAs at N = 8192, each with two block reductions over 128 slices): a 16-bit
//   training call at 2-8 rows spent 10-14 us more than an eval call (docs/perf.md v98).
//   Its float64 sums run over the rows in order, u then the squares (d d rounded, then
//   added): for M <= 16 the slices' sums above add the same terms in the same order (their
//   other terms are exact zeros), so the statistics are the same numbers by construction
//   (the tests bound both against eager and float64; no GPU run compared the two forms).
//   Its per-thread routine is strip::rows_group (bn_16bit_strip.cuh); the small-batch product's
//   epilogue (small_m_16bit.cu) runs its one-feature form, strip::rows_feature, on the same
//   per-feature steps.
// bn16_strip_train_mid (batches of kThreadRows + 1 .. kMidMaxRows = 128 rows): the same outputs
//   on kMidSlices = 16 row slices (slice q holds rows q, q + 16, ...: 1, 2, 4 or 8 of them) and
//   kMidGroups = 8 groups of 8 features a CTA (128 threads, 64 features; 128 CTAs at N = 8192),
//   where the sliced form runs 128 slices of one row or none (512 CTAs of 256 threads with two
//   block reductions over mostly empty slices).  Its statistics are the sliced form's, term for
//   term and in its order: a thread's float64 sum over its rows is slice_sums's part[q] (whose
//   other terms are +0.0), the 16 sums meet in slice order from 0.0 (mid_slice_sums), and each
//   square is rounded before it is added (the sliced form's fma(d, d, 0.0) of one row).  Measured
//   bit-identical to the sliced form, 0.81-0.88x its time back to back (docs/perf.md v106).
// Layout: z (M, N) T and out (M, N) S row-major contiguous (out may be z); vectors
// (N) of S; coeff (4, N) float32.  Preconditions (lowp_bn_strip_train_fits): 2 <= M <=
// kStripMaxRows, N % 8 == 0, z and out 16-byte aligned.  Memory-bound: one read of
// z and (33, or 84 not in place) one write of out.  The launcher returns the launch error.

#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "bn_16bit_strip.cuh"
#include "launchers.cuh"
#include "lowp_chain.cuh"
#include "lowp_coeff.cuh"
#include "lowp_types.cuh"

namespace fused_gemm_bn {
namespace lowp {
namespace strip {

constexpr int kStripGroups = 2;
constexpr int kStripThreads = 256;
constexpr int kStripSlices = kStripThreads / kStripGroups;
constexpr int kStripRowsPerThread = 8;
constexpr int kStripMaxRows = kStripSlices * kStripRowsPerThread;  // 1024
constexpr int kFeatures = kStripGroups * kVec;                      // per CTA
constexpr int kParts = kStripThreads / kFeatures;                   // partial sums per feature in the reduction
static_assert(kParts == kPairStride, "feature_stats (bn_16bit_strip.cuh) sums in slice_sums's order");
constexpr int kRowsThreads = 128;
constexpr int kMidSlices = kPairStride;  // the mid form's row slices: slice_sums's first sums, whole
constexpr int kMidGroups = 8;
constexpr int kMidThreads = kMidSlices * kMidGroups;  // 128
constexpr int kMidFeatures = kMidGroups * kVec;       // 64 per CTA
constexpr int kMidMaxRows = kMidSlices * kThreadRows;  // 128: a slice holds at most 8 rows
static_assert(kStripSlices % kMidSlices == 0 && kMidMaxRows <= kStripSlices,
              "a mid slice's rows are the sliced form's slices q, q + kMidSlices, ..., one row each");

// The CTA's sum over the slices of each feature's per-thread value v[j]
// (thread: group g, slice s), returned to every thread for its group's features.
__device__ __forceinline__ void slice_sums(const double (&v)[kVec], int group, int slice,
                                           double (&red)[kStripSlices][kFeatures], double (&part)[kParts][kFeatures],
                                           double (&total)[kVec]) {
#pragma unroll
  for (int j = 0; j < kVec; ++j) red[slice][group * kVec + j] = v[j];
  __syncthreads();
  {  // thread t sums slices q = t / kFeatures, + kParts, ... of feature t % kFeatures
    const int f = threadIdx.x % kFeatures, q0 = threadIdx.x / kFeatures;
    double s = 0.0;
    for (int q = q0; q < kStripSlices; q += kParts) s += red[q][f];
    part[q0][f] = s;
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    double s = 0.0;
#pragma unroll
    for (int q = 0; q < kParts; ++q) s += part[q][group * kVec + j];
    total[j] = s;
  }
  __syncthreads();  // red and part are reused by the next call
}

// The thread's rows slice, slice + kRowStride, ... below M of its group's 8 features f0 .. f0 + 7
// into v (every load first) and the group's scale; nothing where the group is outside the tensor.
template <typename T, typename S, int kRowStride, int kRows>
__device__ __forceinline__ void load_held(const Args& p, bool active, int slice, int f0, float (&v)[kRows][kVec],
                                          float (&scale)[kVec]) {
  using St = Storage<S>;
  using W = word_t<S>;
  if (!active) return;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = slice + r * kRowStride;
    if (row < p.M) load_group<T>(p.z + static_cast<size_t>(row) * p.N + f0, v[r]);
  }
#pragma unroll
  for (int j = 0; j < kVec; ++j) scale[j] = St::load(static_cast<const W*>(p.scale) + (f0 + j) * p.scale_stride);
}

// pass(v[r][j], j) for each feature j of each row r = slice + r kRowStride that the thread
// holds (the rows below M; none where its group is outside the tensor).
template <int kRowStride, int kRows, class Pass>
__device__ __forceinline__ void for_each_held(float (&v)[kRows][kVec], bool active, int slice, int M, Pass pass) {
  if (!active) return;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (slice + r * kRowStride >= M) break;
#pragma unroll
    for (int j = 0; j < kVec; ++j) pass(v[r][j], j);
  }
}

// The statistics' two passes over the held values: v becomes u = train_u(v), summed;
// then the squared deviations from the mean are summed.
template <typename S>
struct SumPass {
  const float (&scale)[kVec];
  bool scale_after_bn;
  double (&sum)[kVec];
  __device__ __forceinline__ void operator()(float& v, int j) const {
    v = train_u<S>(v, scale[j], scale_after_bn);
    sum[j] += v;
  }
};
struct SquaredDeviationPass {
  const double (&mean)[kVec];
  double (&m2)[kVec];
  __device__ __forceinline__ void operator()(float& v, int j) const {
    const double d = static_cast<double>(v) - mean[j];
    m2[j] = fma(d, d, m2[j]);
  }
};
// The mid form's: each square rounded, then added (its rows' squares are the sliced form's
// fma(d, d, 0.0) of one row a slice, summed in slice_sums's order).
struct RoundedSquarePass {
  const double (&mean)[kVec];
  double (&m2)[kVec];
  __device__ __forceinline__ void operator()(float& v, int j) const {
    const double d = static_cast<double>(v) - mean[j];
    m2[j] = __dadd_rn(m2[j], __dmul_rn(d, d));
  }
};

template <typename T, typename S, int kRows>
__global__ void __launch_bounds__(kStripThreads) bn16_strip_train_kernel(const Args p) {
  __shared__ double red[kStripSlices][kFeatures];
  __shared__ double part[kParts][kFeatures];
  const int group = threadIdx.x % kStripGroups, slice = threadIdx.x / kStripGroups;
  const int f0 = (blockIdx.x * kStripGroups + group) * kVec;
  const bool active = f0 < p.N;  // N % 8 == 0: the whole group is inside or outside
  if (blockIdx.x == 0 && threadIdx.x == 0 && p.momentum >= 0.f) *p.num_batches_tracked += 1;

  float v[kRows][kVec];
  float scale[kVec];
  load_held<T, S, kStripSlices>(p, active, slice, f0, v, scale);
  double sum[kVec] = {};
  for_each_held<kStripSlices>(v, active, slice, p.M, SumPass<S>{scale, p.scale_after_bn, sum});
  double total[kVec];
  slice_sums(sum, group, slice, red, part, total);
  double mean64[kVec], m2[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    mean64[j] = total[j] / static_cast<double>(p.M);
    m2[j] = 0.0;
  }
  for_each_held<kStripSlices>(v, active, slice, p.M, SquaredDeviationPass{mean64, m2});
  slice_sums(m2, group, slice, red, part, total);
  if (!active) return;  // no barrier follows
  finish_group<S>(p, f0, slice == 0, v, mean64, total, slice, kStripSlices);
}

// The mid form's sum over its kMidSlices slices of each feature's per-thread value v[j] (thread:
// group g, slice s), in slice order from 0.0, divided by `divisor` (M: the mean, 1: the sum
// itself), returned to every thread for its group's features.  For M <= kStripSlices the sum is
// slice_sums's value (its part[q] is the sum of slice q's rows here; its other terms are +0.0).
// One division a feature, by the 64 threads that sum (each thread dividing its 8 features gave
// sm_80's kRows = 1 form a stack frame around ptxas's float64 division routine).
__device__ __forceinline__ void mid_slice_sums(const double (&v)[kVec], int group, int slice, double divisor,
                                               double (&red)[kMidSlices][kMidFeatures], double (&tot)[kMidFeatures],
                                               double (&total)[kVec]) {
#pragma unroll
  for (int j = 0; j < kVec; ++j) red[slice][group * kVec + j] = v[j];
  __syncthreads();
  if (threadIdx.x < kMidFeatures) {
    double s = 0.0;
#pragma unroll
    for (int q = 0; q < kMidSlices; ++q) s += red[q][threadIdx.x];
    tot[threadIdx.x] = s / divisor;
  }
  __syncthreads();  // a second call writes red only after this barrier, and tot after its first
#pragma unroll
  for (int j = 0; j < kVec; ++j) total[j] = tot[group * kVec + j];
}

// Batches of kThreadRows + 1 .. kMidMaxRows rows: kMidSlices slices, each thread rows slice,
// slice + kMidSlices, ... (kRows = 1, 2, 4 or 8 of them) of one group of 8 features (header).
template <typename T, typename S, int kRows>
__global__ void __launch_bounds__(kMidThreads) bn16_strip_train_mid_kernel(const Args p) {
  __shared__ double red[kMidSlices][kMidFeatures];
  __shared__ double tot[kMidFeatures];
  const int group = threadIdx.x % kMidGroups, slice = threadIdx.x / kMidGroups;
  const int f0 = (blockIdx.x * kMidGroups + group) * kVec;
  const bool active = f0 < p.N;  // N % 8 == 0: the whole group is inside or outside
  if (blockIdx.x == 0 && threadIdx.x == 0 && p.momentum >= 0.f) *p.num_batches_tracked += 1;

  float v[kRows][kVec];
  float scale[kVec];
  load_held<T, S, kMidSlices>(p, active, slice, f0, v, scale);
  double sum[kVec] = {};
  for_each_held<kMidSlices>(v, active, slice, p.M, SumPass<S>{scale, p.scale_after_bn, sum});
  double mean64[kVec], m2[kVec] = {}, total[kVec];
  mid_slice_sums(sum, group, slice, static_cast<double>(p.M), red, tot, mean64);
  for_each_held<kMidSlices>(v, active, slice, p.M, RoundedSquarePass{mean64, m2});
  mid_slice_sums(m2, group, slice, 1.0, red, tot, total);
  if (!active) return;  // no barrier follows
  finish_group<S>(p, f0, slice == 0, v, mean64, total, slice, kMidSlices);
}

// Batches of at most kThreadRows rows: one thread a group of 8 features, every row (header).
template <typename T, typename S>
__global__ void __launch_bounds__(kRowsThreads) bn16_strip_train_rows_kernel(const Args p) {
  const int f0 = (blockIdx.x * kRowsThreads + threadIdx.x) * kVec;
  if (blockIdx.x == 0 && threadIdx.x == 0 && p.momentum >= 0.f) *p.num_batches_tracked += 1;
  if (f0 >= p.N) return;  // N % 8 == 0: the whole group is inside or outside
  rows_group<T, S>(p, f0, p.z + f0, static_cast<size_t>(p.N));
}

// f(std::integral_constant<int, kRows>{}) for the fewest rows a thread, 1, 2, 4 or kStripRowsPerThread, that
// cover `rows` (the kernels' instantiations; their registers grow with kRows).
template <class F>
void with_thread_rows(int rows, F f) {
  if (rows <= 1) {
    f(std::integral_constant<int, 1>{});
  } else if (rows <= 2) {
    f(std::integral_constant<int, 2>{});
  } else if (rows <= 4) {
    f(std::integral_constant<int, 4>{});
  } else {
    f(std::integral_constant<int, kStripRowsPerThread>{});
  }
}
static_assert(kMidMaxRows / kMidSlices == kStripRowsPerThread, "the mid form's rows a thread: with_thread_rows's");

template <typename T, typename S>
cudaError_t launch(const Args& p, cudaStream_t stream) {
  if (p.M <= kThreadRows) {
    const int groups = p.N / kVec;
    bn16_strip_train_rows_kernel<T, S><<<(groups + kRowsThreads - 1) / kRowsThreads, kRowsThreads, 0, stream>>>(p);
  } else if (p.M <= kMidMaxRows) {
    with_thread_rows((p.M + kMidSlices - 1) / kMidSlices, [&](auto rows) {
      bn16_strip_train_mid_kernel<T, S, decltype(rows)::value>
          <<<(p.N + kMidFeatures - 1) / kMidFeatures, kMidThreads, 0, stream>>>(p);
    });
  } else {
    with_thread_rows((p.M + kStripSlices - 1) / kStripSlices, [&](auto rows) {
      bn16_strip_train_kernel<T, S, decltype(rows)::value>
          <<<(p.N + kFeatures - 1) / kFeatures, kStripThreads, 0, stream>>>(p);
    });
  }
  return cudaGetLastError();
}

}  // namespace strip
}  // namespace lowp
}  // namespace fused_gemm_bn

int fused_gemm_bn::lowp_bn_strip_small_rows() { return lowp::strip::kMidMaxRows; }

bool fused_gemm_bn::lowp_bn_strip_train_fits(int M, int N, const void* z, const void* out) {
  const auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  return M >= 2 && M <= lowp::strip::kStripMaxRows && N > 0 && N % 8 == 0 && aligned(z) && aligned(out);
}

cudaError_t fused_gemm_bn::lowp_bn_strip_train(const LowpBatchNormArgs& bn, const void* z, void* out, int M, int N,
                                               float* coeff, cudaStream_t stream) {
  using namespace fused_gemm_bn::lowp;
  if (!lowp_bn_strip_train_fits(M, N, z, out)) return cudaErrorInvalidValue;
  const strip::Args p{static_cast<const uint16_t*>(z),
                      out,
                      bn.scale,
                      bn.bn_weight,
                      bn.bn_bias,
                      bn.running_mean,
                      bn.running_var,
                      bn.num_batches_tracked,
                      coeff,
                      bn.momentum,
                      bn.eps,
                      bn.scale_after_bn,
                      M,
                      N,
                      bn.scale_stride};
  return dispatch_dtype(bn.dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    return bn.float32_io ? strip::launch<T, float>(p, stream) : strip::launch<T, T>(p, stream);
  });
}
