// bn_16bit_chain.cu -- the 16-bit chains after a product made by cuBLAS (the
// lowp_cublas route: binding_16bit.cpp computes z = rnd(x w^T + bias) with
// at::linear, the call eager's nn.Linear makes, so z is eager's z bit for bit).
// These kernels then do what the Hopper GEMM's epilogue does (sm90_gemm_bn_16bit.cu),
// with the per-element steps of lowp_chain.cuh, so either route rounds at the
// same points; bn_16bit.cu's fold, apply and row softmax follow as after the GEMMs.
// Used where the project's wgmma kernel loses to cuBLAS (model_new.py's dispatch,
// docs/perf.md v31: grids that fill the GPU poorly, short K, very large M).
//
// T: the product's 16-bit type (__half or __nv_bfloat16); S: the storage of the
// vectors and out (T, or float for a float32 module under autocast, lowp_types.cuh).
//
// bn16_chain_train (training; both problems)
//   u = train_u(z, scale) (33: rnd_S(z scale); 84: z) -> out (M, N) of S, and per
//   feature and 128-row block of the batch the mean and M2 of u (float32, two
//   passes: the sum, then the squares about the block's mean) -> part_mean,
//   part_m2 (ceil(M / 128), N), the layout the GEMMs' kTrain epilogues write and
//   bn16_fold_train merges.  num_batches_tracked += 1 (may be null).
//   CTA: 16 feature groups x 16 row slices of 8 rows (one 128-row block); a
//   thread's group is 8 features (16-byte z loads) when N % 8 == 0 and z and out
//   are 16-byte aligned, else 1: 128 features per CTA, so that small batches
//   still give enough CTAs (333 x 5000: 120).  A thread loads its 8 rows before
//   using any.  The slices' sums meet in shared memory.  The second pass reads u
//   back from out (the thread's own stores), so z may be out (in place, S == T).
// bn16_chain_eval (eval; problem 33, and 84 in the autocast form, where
// bn16_softmax_rows follows; 84 with 16-bit out runs it inside the row softmax
// instead: bn_16bit.cu's kEval mode, the same values)
//   out = eval_out(z, ...) with invstd = rsqrtf(running_var + eps), rounded to S by
//   the store; in place allowed.  With coeff (the eval forward with gradients), the first
//   row block's CTAs also write the (4, N) rows {running_mean, invstd, bn.weight,
//   bn.bias} they used (lowp_coeff.cuh), for bn_16bit_backward.cu.
//   CTA: 16 feature groups x 16 row slices of 4 rows, at most 85 registers a thread
//   (3 CTAs an SM); a programmatic dependent launch (pdl.cuh), waiting for the product
//   before it reads anything.
// Layout: z (M, N) T and out (M, N) S row-major contiguous; vectors (N) of S.
// Memory-bound: train reads z once and out once and writes out once, eval reads z
// and writes out once.  Launchers return the launch error (cudaSuccess for M or N of 0).

#include <cuda_runtime.h>
#include <stdint.h>

#include "launchers.cuh"
#include "lowp_chain.cuh"
#include "lowp_coeff.cuh"
#include "lowp_types.cuh"
#include "pdl.cuh"

namespace fused_gemm_bn {
namespace lowp {
namespace chain {

constexpr int kStatRows = 128;  // rows of one statistics block: the GEMMs' (lowp_gemm_block_m)
constexpr int kGroups = 16;     // feature groups per CTA
constexpr int kSlices = 16;     // row slices per CTA
constexpr int kThreads = kGroups * kSlices;
constexpr int kSliceRows = kStatRows / kSlices;  // rows per thread of bn16_chain_train
constexpr int kEvalRows = 4;        // rows per thread of bn16_chain_eval
constexpr int kEvalMinBlocks = 3;   // its CTAs per SM (the register cap: 85)

struct TrainArgs {
  const uint16_t* z;
  void* out;
  const void* scale;
  bool scale_after_bn;
  int M, N;
  float* part_mean;
  float* part_m2;
  int64_t* num_batches_tracked;
  int scale_stride;  // 1, or 0: one number for every feature
};

template <typename T, typename S, int kV>
__global__ void __launch_bounds__(kThreads) bn16_chain_train_kernel(const TrainArgs p) {
  using W = word_t<S>;
  __shared__ float red[kSlices][kGroups * kV];
  const int group = threadIdx.x % kGroups, slice = threadIdx.x / kGroups;
  const int f0 = (blockIdx.x * kGroups + group) * kV;
  const int row0 = blockIdx.y * kStatRows;
  const int rows_valid = min(kStatRows, p.M - row0);
  const int r_begin = slice * kSliceRows, r_end = min(r_begin + kSliceRows, rows_valid);
  const bool active = f0 < p.N;  // kV = 8: N % 8 == 0, so the whole group is inside
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && p.num_batches_tracked != nullptr)
    *p.num_batches_tracked += 1;
  W* out = static_cast<W*>(p.out);
  float scale[kV], sum[kV];
#pragma unroll
  for (int j = 0; j < kV; ++j) {
    scale[j] = active ? Storage<S>::load(static_cast<const W*>(p.scale) + (f0 + j) * p.scale_stride) : 0.f;
    sum[j] = 0.f;
  }
  if (active) {
    float v[kSliceRows][kV];
#pragma unroll
    for (int r = 0; r < kSliceRows; ++r)  // every load first
      if (r_begin + r < r_end) load_values<T, kV>(p.z + static_cast<size_t>(row0 + r_begin + r) * p.N + f0, v[r]);
#pragma unroll
    for (int r = 0; r < kSliceRows; ++r) {
      if (r_begin + r >= r_end) break;
#pragma unroll
      for (int j = 0; j < kV; ++j) {
        v[r][j] = train_u<S>(v[r][j], scale[j], p.scale_after_bn);
        sum[j] += v[r][j];
      }
      store_values<S, kV>(out + static_cast<size_t>(row0 + r_begin + r) * p.N + f0, v[r]);
    }
  }
#pragma unroll
  for (int j = 0; j < kV; ++j) red[slice][group * kV + j] = sum[j];
  __syncthreads();
  float mean[kV], m2[kV];
#pragma unroll
  for (int j = 0; j < kV; ++j) {
    float total = 0.f;
#pragma unroll
    for (int q = 0; q < kSlices; ++q) total += red[q][group * kV + j];
    mean[j] = total / static_cast<float>(rows_valid);
    m2[j] = 0.f;
  }
  __syncthreads();  // every mean read before red is reused
  if (active) {
    float v[kSliceRows][kV];
#pragma unroll
    for (int r = 0; r < kSliceRows; ++r)
      if (r_begin + r < r_end) load_values<S, kV>(out + static_cast<size_t>(row0 + r_begin + r) * p.N + f0, v[r]);
#pragma unroll
    for (int r = 0; r < kSliceRows; ++r) {
      if (r_begin + r >= r_end) break;
#pragma unroll
      for (int j = 0; j < kV; ++j) {
        const float d = v[r][j] - mean[j];
        m2[j] = fmaf(d, d, m2[j]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kV; ++j) red[slice][group * kV + j] = m2[j];
  __syncthreads();
  if (slice == 0 && active) {
    const size_t row = static_cast<size_t>(blockIdx.y) * p.N + f0;
#pragma unroll
    for (int j = 0; j < kV; ++j) {
      float total = 0.f;
#pragma unroll
      for (int q = 0; q < kSlices; ++q) total += red[q][group * kV + j];
      p.part_mean[row + j] = mean[j];
      p.part_m2[row + j] = total;
    }
  }
}

struct EvalArgs {
  const uint16_t* z;
  void* out;
  LowpBatchNormArgs bn;  // scale, bn_weight, bn_bias, running_mean, running_var, eps, scale_after_bn
  int M, N;
  float* coeff;  // may be null: (4, N) rows {running_mean, invstd, bn.weight, bn.bias} (lowp_coeff.cuh)
  bool vectors16;  // kV = 8: the vectors' data 16-byte aligned (16-byte loads; else 2-byte)
};

// kV values of the (N) vector q of S words from feature f0: 16-byte loads where aligned16.
template <typename S, int kV>
__device__ __forceinline__ void load_vector(const void* q, int f0, bool aligned16, float (&v)[kV]) {
  const word_t<S>* p = static_cast<const word_t<S>*>(q) + f0;
  if constexpr (kV == 8) {
    if (aligned16) {
      load_group<S>(p, v);
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < kV; ++j) v[j] = Storage<S>::load(p + j);
}

// Each thread: kV features (one 16-byte group of z, or one element) of kEvalRows rows,
// every row loaded (held as loaded: Group8) before the vectors are read and any row is
// stored; at most 85 registers (80 used), so that kEvalMinBlocks = 3 CTAs share an SM, 48 KB
// of loads in flight (the form before this one held 8 rows of floats, 120-138 registers,
// one CTA an SM: ~2.2 TB/s, docs/perf.md v50).
template <typename T, typename S, int kV>
__global__ void __launch_bounds__(kThreads, kEvalMinBlocks) bn16_chain_eval_kernel(const EvalArgs p) {
  using W = word_t<S>;
  using Held = std::conditional_t<kV == 8, Group8<T>, uint16_t>;
  pdl_wait_then_release();
  const int group = threadIdx.x % kGroups, slice = threadIdx.x / kGroups;
  const int f0 = (blockIdx.x * kGroups + group) * kV;
  if (f0 >= p.N) return;
  const int row0 = (blockIdx.y * kSlices + slice) * kEvalRows;
  Held held[kEvalRows];
#pragma unroll
  for (int r = 0; r < kEvalRows; ++r) {  // every load first, then the stores (in place: z may be out)
    if (row0 + r >= p.M) break;
    const uint16_t* q = p.z + static_cast<size_t>(row0 + r) * p.N + f0;
    if constexpr (kV == 8) {
      held[r] = load_group8<T>(q);
    } else {
      held[r] = *q;
    }
  }
  float scale[kV], w[kV], b[kV], rm[kV], invstd[kV];
  if (p.bn.scale_stride == 0) {
    const float s0 = Storage<S>::load(static_cast<const W*>(p.bn.scale));
#pragma unroll
    for (int j = 0; j < kV; ++j) scale[j] = s0;
  } else {
    load_vector<S, kV>(p.bn.scale, f0, p.vectors16, scale);
  }
  load_vector<S, kV>(p.bn.bn_weight, f0, p.vectors16, w);
  load_vector<S, kV>(p.bn.bn_bias, f0, p.vectors16, b);
  load_vector<S, kV>(p.bn.running_mean, f0, p.vectors16, rm);
  load_vector<S, kV>(p.bn.running_var, f0, p.vectors16, invstd);
#pragma unroll
  for (int j = 0; j < kV; ++j) invstd[j] = rsqrtf(invstd[j] + p.bn.eps);
  if (p.coeff != nullptr && blockIdx.y == 0 && slice == 0) {  // the values used here, for the backward
#pragma unroll
    for (int j = 0; j < kV; ++j) coeff_store1(p.coeff, p.N, f0 + j, make_float4(rm[j], invstd[j], w[j], b[j]));
  }
#pragma unroll
  for (int r = 0; r < kEvalRows; ++r) {
    if (row0 + r >= p.M) break;
    float v[kV];
    if constexpr (kV == 8) {
      unpack8<T>(held[r], v);
    } else {
      v[0] = Bits<T>::to_float(held[r]);
    }
#pragma unroll
    for (int j = 0; j < kV; ++j)
      v[j] = eval_out<T, S>(v[j], scale[j], w[j], b[j], rm[j], invstd[j], p.bn.scale_after_bn);
    store_values<S, kV>(static_cast<W*>(p.out) + static_cast<size_t>(row0 + r) * p.N + f0, v);
  }
}

inline bool aligned16(const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; }

template <typename T, typename S>
cudaError_t train_for_storage(const TrainArgs& p, cudaStream_t stream) {
  const bool vec = p.N % 8 == 0 && aligned16(p.z) && aligned16(p.out);
  const int kv = vec ? 8 : 1;
  const dim3 grid((p.N + kGroups * kv - 1) / (kGroups * kv), (p.M + kStatRows - 1) / kStatRows);
  if (grid.y > 65535) return cudaErrorInvalidConfiguration;
  if (vec) {
    bn16_chain_train_kernel<T, S, 8><<<grid, kThreads, 0, stream>>>(p);
  } else {
    bn16_chain_train_kernel<T, S, 1><<<grid, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

template <typename T, typename S>
cudaError_t eval_for_storage(EvalArgs p, cudaStream_t stream) {
  const bool vec = p.N % 8 == 0 && aligned16(p.z) && aligned16(p.out);
  p.vectors16 = (p.bn.scale_stride == 0 || aligned16(p.bn.scale)) && aligned16(p.bn.bn_weight) &&
                aligned16(p.bn.bn_bias) && aligned16(p.bn.running_mean) && aligned16(p.bn.running_var);
  const int kv = vec ? 8 : 1;
  constexpr int kRowsPerCta = kSlices * kEvalRows;
  const dim3 grid((p.N + kGroups * kv - 1) / (kGroups * kv), (p.M + kRowsPerCta - 1) / kRowsPerCta);
  if (grid.y > 65535) return cudaErrorInvalidConfiguration;
  if (vec) return launch_kernel(bn16_chain_eval_kernel<T, S, 8>, grid, kThreads, 0, stream, p);
  return launch_kernel(bn16_chain_eval_kernel<T, S, 1>, grid, kThreads, 0, stream, p);
}

}  // namespace chain
}  // namespace lowp
}  // namespace fused_gemm_bn

cudaError_t fused_gemm_bn::lowp_bn_chain_train(const LowpBatchNormArgs& bn, const void* z, void* out, int M, int N,
                                               float* part_mean, float* part_m2, cudaStream_t stream) {
  using namespace fused_gemm_bn::lowp;
  if (M <= 0 || N <= 0) return cudaSuccess;
  const chain::TrainArgs p{static_cast<const uint16_t*>(z), out, bn.scale, bn.scale_after_bn, M, N, part_mean, part_m2,
                           bn.num_batches_tracked, bn.scale_stride};
  return dispatch_dtype(bn.dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    return bn.float32_io ? chain::train_for_storage<T, float>(p, stream) : chain::train_for_storage<T, T>(p, stream);
  });
}

cudaError_t fused_gemm_bn::lowp_bn_chain_eval(const LowpBatchNormArgs& bn, const void* z, void* out, int M, int N,
                                              float* coeff, cudaStream_t stream) {
  using namespace fused_gemm_bn::lowp;
  if (M <= 0 || N <= 0) return cudaSuccess;
  const chain::EvalArgs p{static_cast<const uint16_t*>(z), out, bn, M, N, coeff, false};
  return dispatch_dtype(bn.dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    return bn.float32_io ? chain::eval_for_storage<T, float>(p, stream) : chain::eval_for_storage<T, T>(p, stream);
  });
}
