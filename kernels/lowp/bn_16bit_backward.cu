// bn_16bit_backward.cu -- the backward of what follows the Linear in the 16-bit
// forward, training (batch statistics: sm90/sm80_gemm_bn_16bit.cu with z_out, or
// bn_16bit_chain.cu / bn_16bit_strip.cu after cuBLAS, then bn_16bit.cu) and eval
// (running statistics: bn_16bit_chain.cu's eval chain after cuBLAS): from the
// saved Linear output z and the forward's coefficients to dL/dz, which the
// backward's two GEMMs take, and the per-feature parameter gradients.
//
// Forward being differentiated, per feature j over the batch's M rows (T the
// 16-bit type, S the storage: T for a 16-bit module, float for a float32 module
// under torch.autocast in T; rnd_S = Storage<S>::round, the identity for float;
// rnd_T = round16<T>):
//   problem 33: u = rnd_S(z s),  out = BatchNorm(u)                     (dL/dout = g)
//   problem 84: u = z,  y = rnd_T(BatchNorm(u)),  w = rnd_S(y s),  out = softmax(w)
//               (g = dL/dw: the caller runs the row softmax's backward)
// BatchNorm(u) = gamma (u - mean) invstd + beta, with the forward's own
// coefficients coeff[:, j] = {mean, invstd, gamma, beta} (lowp_coeff.cuh): the
// batch's (training: bn16_fold_train / bn16_strip_train) or the running
// statistics' (eval: running_mean, rsqrtf(running_var + eps), as the forward
// computed them: bn16_chain_eval with coeff).
// Gradients, as autograd gives them for that chain (a rounding's derivative is 1):
//   dy = g (33) or g s (84);  S1 = sum_m dy,  S2 = sum_m dy (u - mean)
//   training: du = gamma invstd (dy - S1 / M - (u - mean) invstd^2 S2 / M)
//   eval:     du = gamma invstd dy            (mean and invstd are constants there)
//   dz = du s (33) or du (84)                       -> rnd_T: the GEMMs' operand
//   dgamma = S2 invstd,  dbeta = S1
//   dscale = sum_m du z (33) or sum_m g y (84)
//   eval: dbias = sum_m dz = a S1 s (33) or a S1 (84)  (the Linear's bias; training's is 0)
// Numerics: loads are exact (16-bit or float32 values); u and y are recomputed
// exactly as the forward rounded them; the sums and each du in float64, dz
// rounded once to T, each parameter gradient once to S (through float32).  Eager
// 16-bit rounds dL/du, the products by scale and the reductions to T at each op,
// so its gradients carry several 16-bit roundings; these carry one.  One scale
// (scale_stride 0): dscale's N terms stay float64 and one CTA sums them
// (scale_terms.cuh): dscale = [the sum, rounded once, 0, ..., 0].
//
// Tensors (row-major, contiguous): g (M, N) G (T, or float32); z, dz (M, N) T;
// coeff (4, N) float32 (lowp_coeff.cuh); scale (N), or one number; dscale (N, or 1
// for one number), dgamma, dbeta, dbias (N) S.
// Preconditions: M >= 1 (training: M >= 2, the forward's batch), N >= 1.
//
// Kernel: one CTA per 32 features (a warp reads one row's 32 contiguous
// elements), its 8 warps take every 8th row, as bn_backward.cu.  Pass 1 reduces
// S1, S2 (and problem 84's dscale); training: pass 2 re-reads g and z (mostly
// from L2) and writes dz; eval, where du needs no sum, pass 1 writes dz too.
// Memory-bound: g and z read twice (eval: once), dz written once.  Where N % 32
// == 0 and g, z are 16-byte aligned (the staged form), each warp streams its rows
// through a 3-slot ring in shared memory (cp.async, cp_async.cuh), two
// batches of 16 rows in flight while it works on one: 48 KB of dynamic shared
// memory a CTA (72 KB with a float32 g).  Otherwise each warp loads 16 rows into
// registers, then uses them.  Both forms make the same calls in the same order:
// the same bits (docs/perf.md v78: 13-17 us faster at 1024 x 8192, 40-72 us at
// 4096 x 4096 on an H200).
// Launchers return the launch error.

#include <cuda_runtime.h>
#include <stdint.h>

#include "bn_stats.cuh"
#include "cp_async.cuh"
#include "device_facts.cuh"
#include "launchers.cuh"
#include "lowp_coeff.cuh"
#include "lowp_types.cuh"
#include "scale_terms.cuh"

namespace fused_gemm_bn {
namespace lowp {
namespace bn_backward {

constexpr int kCols = 32;     // features per CTA
constexpr int kWarps = 8;     // row groups per CTA
constexpr int kRowBatch = 16;  // rows loaded per thread before use

struct Args {
  const void* g;  // G words
  const uint16_t* z;
  const float* coeff;  // (4, N)
  const void* scale;  // S words
  bool scale_after_bn;
  int M, N;
  uint16_t* dz;
  void* dbias;   // S words; eval only, may be null
  void* dscale;  // S words
  void* dgamma;  // S words
  void* dbeta;   // S words
  double* dscale_terms;  // one number (scale_stride 0): dscale's N terms, summed after; else null
  int scale_stride;  // 1, or 0: one number for every feature
};

// g as float32, for G = float or a 16-bit type.
template <typename G>
__device__ __forceinline__ float load_g(const void* g, size_t idx) {
  if constexpr (sizeof(G) == 4) {
    return static_cast<const float*>(g)[idx];
  } else {
    return load_float<G>(static_cast<const uint16_t*>(g) + idx);
  }
}

// Rows row + r * kWarps (r < kRowBatch) of g and z at feature j, every load issued
// before any is used; rows past M read as g = 0, z = 0.
template <typename T, typename G>
__device__ __forceinline__ void load_rows(const Args& p, int row, int j, float (&gv)[kRowBatch],
                                          float (&zv)[kRowBatch]) {
#pragma unroll
  for (int r = 0; r < kRowBatch; ++r) {
    const int m = row + r * kWarps;
    const size_t idx = static_cast<size_t>(m) * p.N + j;
    gv[r] = m < p.M ? load_g<G>(p.g, idx) : 0.f;
    zv[r] = m < p.M ? load_float<T>(p.z + idx) : 0.f;
  }
}

// f(m, g, z) for feature j's rows m = warp, warp + kWarps, ... < M, kRowBatch of
// them loaded (load_rows) before the first call.
template <typename T, typename G, typename F>
__device__ __forceinline__ void for_each_row(const Args& p, int warp, int j, F&& f) {
  for (int row = warp; row < p.M; row += kWarps * kRowBatch) {
    float gv[kRowBatch], zv[kRowBatch];
    load_rows<T, G>(p, row, j, gv, zv);
#pragma unroll
    for (int r = 0; r < kRowBatch; ++r) {
      const int m = row + r * kWarps;
      if (m >= p.M) break;
      f(m, gv[r], zv[r]);
    }
  }
}

// The staged form (kStaged): each warp streams its rows' g and z through a private ring of
// kStages slots of kRowBatch rows in shared memory (cp.async, 16-byte chunks), the next
// kStages - 1 batches in flight while it works on one, instead of loading a batch into
// registers and waiting for it (v74: 36% of stalls on those loads, DRAM 23% busy).  Needs
// N % kCols == 0 (every lane's feature valid, whole 64-byte rows) and g, z 16-byte aligned.
constexpr int kStages = 3;
template <typename G>
constexpr int kSlotBytes = kRowBatch * kCols * static_cast<int>(sizeof(G) + sizeof(uint16_t));  // g rows, then z rows
template <typename G>
constexpr int staged_smem_bytes() { return kWarps * kStages * kSlotBytes<G>; }

// Issues batch b of this warp's rows (row warp + (b kRowBatch + r) kWarps, r < kRowBatch) into
// its slot, rows past M zero-filled, and commits one group (empty past the last batch).
template <typename G>
__device__ __forceinline__ void issue_batch(const Args& p, int warp, int lane, unsigned char* ring, int b,
                                            int num_batches) {
  if (b < num_batches) {
    unsigned char* slot = ring + (b % kStages) * kSlotBytes<G>;
    const int row0 = warp + b * kRowBatch * kWarps, j0 = blockIdx.x * kCols;
    constexpr int kGRowChunks = kCols * static_cast<int>(sizeof(G)) / 16;  // 4 (16-bit) or 8 (float)
    constexpr int kZRowChunks = kCols * 2 / 16;                             // 4
#pragma unroll
    for (int c = lane; c < kRowBatch * kGRowChunks; c += 32) {
      const int m = row0 + (c / kGRowChunks) * kWarps;
      const G* src = static_cast<const G*>(p.g) + static_cast<size_t>(m < p.M ? m : 0) * p.N + j0 +
                     (c % kGRowChunks) * (16 / static_cast<int>(sizeof(G)));
      cp_async<16>(slot + c * 16, src, m < p.M);
    }
    unsigned char* zslot = slot + kRowBatch * kCols * sizeof(G);
#pragma unroll
    for (int c = lane; c < kRowBatch * kZRowChunks; c += 32) {
      const int m = row0 + (c / kZRowChunks) * kWarps;
      const uint16_t* src = p.z + static_cast<size_t>(m < p.M ? m : 0) * p.N + j0 + (c % kZRowChunks) * 8;
      cp_async<16>(zslot + c * 16, src, m < p.M);
    }
  }
  cp_async_commit();
}

// for_each_row's staged form: the same calls f(m, g, z) in the same order.  Every lane of
// the warp takes part (the copies and __syncwarp).  Returns with no copy in flight.
template <typename T, typename G, typename F>
__device__ __forceinline__ void for_each_row_staged(const Args& p, int warp, int lane, unsigned char* ring, F&& f) {
  const int rows_per_batch = kRowBatch * kWarps;
  const int num_batches = warp < p.M ? (p.M - warp + rows_per_batch - 1) / rows_per_batch : 0;
#pragma unroll
  for (int b = 0; b < kStages - 1; ++b) issue_batch<G>(p, warp, lane, ring, b, num_batches);
  for (int b = 0; b < num_batches; ++b) {
    issue_batch<G>(p, warp, lane, ring, b + kStages - 1, num_batches);
    cp_async_wait<kStages - 1>();  // this lane's copies of batch b have landed
    __syncwarp();                  // and every other lane's
    const unsigned char* slot = ring + (b % kStages) * kSlotBytes<G>;
    const G* gs = reinterpret_cast<const G*>(slot);
    const uint16_t* zs = reinterpret_cast<const uint16_t*>(slot + kRowBatch * kCols * sizeof(G));
    const int row0 = warp + b * rows_per_batch;
#pragma unroll
    for (int r = 0; r < kRowBatch; ++r) {
      const int m = row0 + r * kWarps;
      if (m >= p.M) break;
      f(m, load_g<G>(gs, r * kCols + lane), load_float<T>(zs + r * kCols + lane));
    }
    __syncwarp();  // the slot is refilled by the next iteration's issue
  }
  cp_async_wait<0>();
}

// kTraining: coeff holds the batch statistics (else the running statistics: eval).
// kStaged: rows streamed through shared memory (for_each_row_staged), else loaded in batches.
template <typename T, typename S, typename G, bool kTraining, bool kStaged>
__global__ void __launch_bounds__(kCols* kWarps, 2) bn16_backward_kernel(const Args p) {
  using St = Storage<S>;
  __shared__ double red[3][kWarps][kCols];
  __shared__ double coef[2][kCols];  // per feature, training: c1 = S1 / M, c2 = invstd^2 S2 / M
  const int lane = threadIdx.x % kCols, warp = threadIdx.x / kCols;
  const int j = blockIdx.x * kCols + lane;
  const bool valid = j < p.N;
  const float4 c = valid ? coeff_load1(p.coeff, p.N, j) : make_float4(0.f, 0.f, 0.f, 0.f);
  const float s = valid ? St::load(static_cast<const word_t<S>*>(p.scale) + j * p.scale_stride) : 0.f;
  const double mean = c.x, sd = s, a = static_cast<double>(c.z) * c.y;  // a = gamma invstd
  // u and dy of one element (the forward's values, recomputed); dz of one du.
  auto u_of = [&](float z) { return p.scale_after_bn ? z : St::round(z * s); };
  auto dy_of = [&](float g) { return p.scale_after_bn ? g * sd : static_cast<double>(g); };
  auto store_dz = [&](int m, double du) {
    p.dz[static_cast<size_t>(m) * p.N + j] = to_bits<T>(static_cast<float>(p.scale_after_bn ? du : du * sd));
  };
  // A parameter gradient of feature j, rounded once to S; dscale's term kept in float64 for one number.
  auto store_vector = [j](void* out, double v) { St::store(static_cast<word_t<S>*>(out) + j, static_cast<float>(v)); };
  auto store_dscale = [&](double term) {
    if (p.dscale_terms != nullptr)
      p.dscale_terms[j] = term;
    else
      store_vector(p.dscale, term);
  };

  extern __shared__ __align__(16) unsigned char staged_ring[];
  unsigned char* ring = staged_ring + warp * kStages * kSlotBytes<G>;
  auto rows = [&](auto&& f) {
    if constexpr (kStaged) {
      for_each_row_staged<T, G>(p, warp, lane, ring, f);
    } else {
      for_each_row<T, G>(p, warp, j, f);
    }
  };

  // Pass 1: S1, S2, problem 84's dscale (s3); eval also dz and problem 33's dscale.
  double s1 = 0.0, s2 = 0.0, s3 = 0.0, scale_sum = 0.0;
  if (valid) {
    rows([&](int m, float gv, float zv) {
      const double u = u_of(zv);
      const double dy = dy_of(gv);
      s1 += dy;
      s2 += dy * (u - mean);
      if (p.scale_after_bn) s3 += static_cast<double>(gv) * round16<T>(bn_affine(zv, c));
      if constexpr (!kTraining) {
        const double du = a * dy;
        store_dz(m, du);
        if (!p.scale_after_bn) scale_sum += du * zv;
      }
    });
  }
  red[0][warp][lane] = s1;
  red[1][warp][lane] = s2;
  red[2][warp][lane] = s3;
  __syncthreads();
  if (warp == 0 && valid) {
    double S1 = 0.0, S2 = 0.0, S3 = 0.0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      S1 += red[0][w][lane];
      S2 += red[1][w][lane];
      S3 += red[2][w][lane];
    }
    const double invstd = c.y, M = p.M;
    coef[0][lane] = S1 / M;
    coef[1][lane] = invstd * invstd * S2 / M;
    store_vector(p.dgamma, S2 * invstd);
    store_vector(p.dbeta, S1);
    if (p.scale_after_bn) store_dscale(S3);
    if (!kTraining && p.dbias != nullptr) store_vector(p.dbias, p.scale_after_bn ? a * S1 : a * S1 * sd);
  }
  __syncthreads();
  // Pass 2 (training): dz and problem 33's dscale.
  if (kTraining && valid) {
    const double c1 = coef[0][lane], c2 = coef[1][lane];
    rows([&](int m, float gv, float zv) {
      const double du = a * (dy_of(gv) - c1 - (u_of(zv) - mean) * c2);
      store_dz(m, du);
      if (!p.scale_after_bn) scale_sum += du * zv;
    });
  }
  if (p.scale_after_bn) return;  // uniform over the grid
  row_groups_total(scale_sum, red[0], warp, lane, warp == 0 && valid, store_dscale);
}

// One number's dscale (scale_terms.cuh): [the float64 sum of the N terms, rounded once
// to S, 0, ...] (len words).  One CTA of kScaleSumThreads.
template <typename S>
__global__ void __launch_bounds__(kScaleSumThreads) bn16_scale_sum_kernel(const double* terms, int N, int len,
                                                                          word_t<S>* dscale) {
  sum_scale_terms(terms, N, len,
                  [dscale](int j, double v) { Storage<S>::store(dscale + j, static_cast<float>(v)); });
}

// `static`: its per-device flags are this extension's own (bn_16bit.cu's launch_walk says why).
template <typename T, typename S, typename G, bool kTraining, bool kStaged>
static cudaError_t launch_kernel_form(const Args& p, cudaStream_t stream) {
  auto kernel = bn16_backward_kernel<T, S, G, kTraining, kStaged>;
  const int smem = kStaged ? staged_smem_bytes<G>() : 0;
  if (kStaged) {  // above the 48 KB a launch may take without asking: once per device
    static bool allowed[kMaxCachedDevices] = {};
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    if (device >= kMaxCachedDevices || !allowed[device]) {
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      if (err != cudaSuccess) return err;
      if (device < kMaxCachedDevices) allowed[device] = true;
    }
  }
  kernel<<<(p.N + kCols - 1) / kCols, kCols * kWarps, smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, typename S, typename G>
cudaError_t launch_for_mode(const Args& p, bool training, cudaStream_t stream) {
  const bool staged = p.N % kCols == 0 && reinterpret_cast<uintptr_t>(p.g) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(p.z) % 16 == 0;
  if (training)
    return staged ? launch_kernel_form<T, S, G, true, true>(p, stream) : launch_kernel_form<T, S, G, true, false>(p, stream);
  return staged ? launch_kernel_form<T, S, G, false, true>(p, stream) : launch_kernel_form<T, S, G, false, false>(p, stream);
}

template <typename T, typename S>
cudaError_t launch_for_storage(const Args& p, int dscale_len, bool g_float32, bool training, cudaStream_t stream) {
  const cudaError_t err =
      g_float32 ? launch_for_mode<T, S, float>(p, training, stream) : launch_for_mode<T, S, T>(p, training, stream);
  if (err != cudaSuccess) return err;
  if (p.dscale_terms != nullptr) {
    bn16_scale_sum_kernel<S><<<1, kScaleSumThreads, 0, stream>>>(p.dscale_terms, p.N, dscale_len,
                                                                  static_cast<word_t<S>*>(p.dscale));
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_for_type(const Args& p, int dscale_len, bool float32_io, bool g_float32, bool training,
                            cudaStream_t stream) {
  return float32_io ? launch_for_storage<T, float>(p, dscale_len, g_float32, training, stream)
                    : launch_for_storage<T, T>(p, dscale_len, g_float32, training, stream);
}

}  // namespace bn_backward
}  // namespace lowp
}  // namespace fused_gemm_bn

// grads (LowpBnGrads: dz (M, N) in dtype, the parameter gradients in the vectors' type)
// from g (M, N) (formulas above); training: coeff holds the batch statistics, else the
// running statistics (eval).
cudaError_t fused_gemm_bn::lowp_bn_backward(const LowpBatchNormArgs& bn, bool g_float32, bool training, const void* g,
                                            const void* z, const float* coeff, int M, int N,
                                            const LowpBnGrads& grads, cudaStream_t stream) {
  using namespace fused_gemm_bn::lowp;
  using namespace fused_gemm_bn::lowp::bn_backward;
  if (bn.scale_stride != 0 && bn.scale_stride != 1) return cudaErrorInvalidValue;
  if (M == 0 || N == 0) return cudaSuccess;  // nothing to write (a batch of no rows: the caller's zeros)
  if (bn.scale_stride == 0 && grads.dscale_terms == nullptr) return cudaErrorInvalidValue;
  const Args p{g, static_cast<const uint16_t*>(z), coeff, bn.scale, bn.scale_after_bn, M, N,
               static_cast<uint16_t*>(grads.dz), training ? nullptr : grads.dbias, grads.dscale, grads.dgamma,
               grads.dbeta, bn.scale_stride == 0 ? grads.dscale_terms : nullptr, bn.scale_stride};
  return dispatch_dtype(bn.dtype, [&](auto t) {
    return launch_for_type<typename decltype(t)::type>(p, grads.dscale_len, bn.float32_io, g_float32, training,
                                                       stream);
  });
}
