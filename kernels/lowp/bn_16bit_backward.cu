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
// Memory-bound: g and z read twice (eval: once), dz written once.
// Launchers return the launch error.

#include <cuda_runtime.h>
#include <stdint.h>

#include "bn_stats.cuh"
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

// kTraining: coeff holds the batch statistics (else the running statistics: eval).
template <typename T, typename S, typename G, bool kTraining>
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

  // Pass 1: S1, S2, problem 84's dscale (s3); eval also dz and problem 33's dscale.
  double s1 = 0.0, s2 = 0.0, s3 = 0.0, scale_sum = 0.0;
  if (valid) {
    for_each_row<T, G>(p, warp, j, [&](int m, float gv, float zv) {
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
    for_each_row<T, G>(p, warp, j, [&](int m, float gv, float zv) {
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

template <typename T, typename S, typename G>
void launch_for_mode(const Args& p, bool training, cudaStream_t stream) {
  const int blocks = (p.N + kCols - 1) / kCols;
  if (training) {
    bn16_backward_kernel<T, S, G, true><<<blocks, kCols * kWarps, 0, stream>>>(p);
  } else {
    bn16_backward_kernel<T, S, G, false><<<blocks, kCols * kWarps, 0, stream>>>(p);
  }
}

template <typename T, typename S>
cudaError_t launch_for_storage(const Args& p, int dscale_len, bool g_float32, bool training, cudaStream_t stream) {
  if (g_float32) {
    launch_for_mode<T, S, float>(p, training, stream);
  } else {
    launch_for_mode<T, S, T>(p, training, stream);
  }
  if (p.dscale_terms != nullptr) {
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
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
