// launchers.cuh -- the host/device boundary: every host launcher of kernels/*.cu
// and kernels/lowp/*.cu, declared once.  Included by each .cu that defines a
// launcher (its definition is written qualified, `cudaError_t fused_gemm_bn::bn_apply(...)`,
// which C++ accepts only when it matches a declaration here) and by both torch
// bindings (torch_binding.cpp, lowp/binding_16bit.cpp), so a signature cannot
// drift between the two sides: a mismatch fails the compile (.ci/run compiles
// the .cu files and both bindings; tests/test_boundary.py has the negative control).
//
// Conventions: raw device pointers (float32 unless `const void*` with a dtype
// code), sizes as int (the bindings check that they fit), the CUDA stream last.
// Launchers return the launch error (cudaSuccess if none), never synchronise,
// and never choose a different kernel: model_new.py's dispatch decides which
// launcher runs (its preconditions are listed at each definition), and a
// launcher given inputs outside its preconditions returns cudaErrorInvalidValue.
// M = batch, N = out_features, K = in_features; x (M, K) and w (N, K) K-major.
// Host-only declarations: this header compiles with a plain C++ compiler.

#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

namespace fused_gemm_bn {

// ---- the BatchNorm side of a float32 call -----------------------------------
// Filled once per call by torch_binding.cpp from the module's tensors and
// passed whole to every launcher below that takes BatchNorm parameters; each
// launcher's comment names the fields it reads (the others may stay unset).
// Vectors: (N) float32, contiguous, on the call's device.
struct BatchNormArgs {
  const float* bias = nullptr;       // gemm.bias (the Linear's): running_mean, the eval fold, 33's grad_scale
  const float* scale = nullptr;      // the per-feature scale s: scale[j * scale_stride] for feature j
  const float* bn_weight = nullptr;  // bn.weight (gamma)
  const float* bn_bias = nullptr;    // bn.bias (beta)
  // bn.running_mean / running_var: updated in place by the training launchers,
  // only read by the eval ones (sm80_gemm_3xtf32_eval, sm90_gemm_fp16x3_eval).
  float* running_mean = nullptr;
  float* running_var = nullptr;
  // bn.num_batches_tracked (device int64 scalar), training: already incremented
  // for this call by the pre-pass; read where momentum < 0 (small_m_fp64_train
  // takes the counter as its own argument instead).
  const int64_t* num_batches_tracked = nullptr;
  float momentum = 0.f;         // training; < 0: cumulative average (momentum=None), f = 1 / num_batches_tracked
  float eps = 0.f;              // bn.eps
  bool scale_after_bn = false;  // false: problem 33 (Linear -> scale -> BatchNorm); true: 84 (BatchNorm -> scale)
  int scale_stride = 1;         // 1: N scales; 0: one number (scale[0]) for every feature, read in place
};

// ---- prepass_3xtf32.cu: the pre-pass before each 3xTF32 GEMM ---------------
// Writes x's TF32 parts and, in the same launch, num_batches_tracked += 1 when
// it is not null (a training call: nn.BatchNorm1d's first step).  center (M,
// from row_centers; null: none): the parts are those of rn(x - c_m), the
// centred split (centring.cuh).

// Floats in each of x_big / x_small for an (M, K) input (fragment order, padded).
int64_t sm80_prepass_elems(int M, int K);
// x (any strides) -> x_big, x_small in mma fragment order, for sm80_gemm_3xtf32_*;
// zero_ints[0 .. num_zero_ints) = 0 (the GEMM's split-K arrival counts).
cudaError_t sm80_prepass_3xtf32(const float* x, int64_t row_stride, int64_t col_stride, int M, int K,
                                const float* center, float* x_big, float* x_small, int64_t* num_batches_tracked,
                                int* zero_ints, int num_zero_ints, cudaStream_t stream);

// ---- centring.cu: the centred split's per-row terms for the 3xTF32 GEMM -----
// x (any strides) -> center (M): c_m.
cudaError_t row_centers(const float* x, int64_t row_stride, int64_t col_stride, int M, int K, float* center,
                        cudaStream_t stream);
// w (any strides) -> row_sum (N): sum_k w[n, k] in float64 as fp32 (hi, lo) pairs.
cudaError_t row_sums(const float* w, int64_t row_stride, int64_t col_stride, int N, int K, float2* row_sum,
                     cudaStream_t stream);
// What the 3xTF32 GEMM needs to undo the centring: z = the parts' product +
// c_m (hi_n + lo_n).  Both null: x was split as it is.
struct Centring {
  const float* x_center;    // (M), row_centers
  const float2* w_row_sum;  // (N), row_sums
};

// ---- sm80_gemm_3xtf32_bn.cu: portable 3xTF32 GEMM (mma.sync, sm_80+) --------
// Rows per batch tile for a batch of M rows (the training statistics' tiles).
int sm80_gemm_block_m(int M);
// Workspace of an (M, K) x (N, K) product on the current device (its split
// K): *floats floats, of which the last *zero_ints ints must be zero at the
// launch (the pre-pass zeroes them); both 0 when K is not split.
cudaError_t sm80_gemm_3xtf32_workspace(int M, int N, int K, int64_t* floats, int* zero_ints);
// z = x @ w^T into out, and per-(M tile, feature) mean / M2 of z.
cudaError_t sm80_gemm_3xtf32_train(const float* x_big, const float* x_small, const float* w, Centring centring,
                                   float* out, float* part_mean, float* part_m2, int M, int N, int K,
                                   float* workspace, cudaStream_t stream);
// out = a * (x @ w^T) + c, the eval-mode fold (bn: bias, scale, bn_weight,
// bn_bias, running_mean, running_var, eps, scale_after_bn).
cudaError_t sm80_gemm_3xtf32_eval(const float* x_big, const float* x_small, const float* w, Centring centring,
                                  float* out, const BatchNormArgs& bn, int M, int N, int K, float* workspace,
                                  cudaStream_t stream);

// ---- prepass_fp16x3.cu, sm90_gemm_fp16x3_bn.cu: Hopper fp16x3 GEMM (sm_90a) --
int sm90_gemm_block_m();
// True when this build has the sm_90a kernel and the current device can run it
// (compute capability 9.0, shared memory, the driver's tensor-map encoder).
bool sm90_gemm_available();
// The row length of the K-major fp16x3 parts of an operand with K = in_features
// columns: K rounded up to a multiple of 8 (16-byte rows, as TMA's global
// strides need); the pre-pass writes zeros in the extra columns, so the GEMM
// runs over K_pad with the same result (as lowp/binding_16bit.cpp pads its copies).
constexpr int64_t fp16x3_padded_k(int64_t K) { return (K + 7) / 8 * 8; }
// x (M, K) fp32, any K >= 1, any strides and alignment -> x_hi, x_lo (M, K_pad =
// fp16x3_padded_k(K)) fp16 words (columns K .. K_pad - 1 zero) and x_inv_scale
// (M), and exactly one of: center (M, the GEMM's x side: each row is centred on
// its mean before the split) or row_sum (M, the GEMM's w side: each row's sum as
// an fp32 (hi, lo) pair); both over the K real columns.  num_batches_tracked += 1
// when not null; zero_ints[0 .. num_zero_ints) = 0.
cudaError_t sm90_prepass_fp16x3(const float* x, int64_t row_stride, int64_t col_stride, int M, int K, uint16_t* x_hi,
                                uint16_t* x_lo, float* x_inv_scale, float* center, float2* row_sum, int* zero_ints,
                                int num_zero_ints, int64_t* num_batches_tracked, cudaStream_t stream);
// prepass_fp16x3_backward.cu: the backward products' operands.  a (M, K) fp32
// (rows contiguous) times col_scale (K, powers of two), each row split with its
// own scale -> hi, lo (M, K) K-major, inv_scale (M); zero_ints[0 .. num_zero_ints) = 0.
cudaError_t sm90_prepass_fp16x3_scaled(const float* a, int64_t row_stride, int M, int K, const float* col_scale,
                                       uint16_t* hi, uint16_t* lo, float* inv_scale, int* zero_ints,
                                       int num_zero_ints, cudaStream_t stream);
// a (R, C) fp32 (rows contiguous), each column split with its own scale -> hi, lo
// (R, C) as stored (an MN-major operand of C rows), inv_scale (C); zero_ints as above.
cudaError_t sm90_prepass_fp16x3_columns(const float* a, int64_t row_stride, int R, int C, uint16_t* hi, uint16_t* lo,
                                        float* inv_scale, int* zero_ints, int num_zero_ints, cudaStream_t stream);
// Workspace for an (M, K) x (N, K) product: *floats floats, of which the last
// *zero_ints ints must be zero at the launch (both 0 when no tile is split).
void sm90_gemm_fp16x3_workspace(int M, int N, int K, int64_t* floats, int* zero_ints);
// An operand's fp16x3 parts: hi, lo fp16 words, 16-byte aligned, stored (rows, K)
// row-major ("K-major", from sm90_prepass_fp16x3 -- K there is fp16x3_padded_k of
// the real one -- or sm90_prepass_fp16x3_scaled) or, with mn_major, (K, rows)
// row-major ("MN-major", from sm90_prepass_fp16x3_columns); inv_scale (rows)
// fp32, each row's 2^-e (null on the w side of a plain product: 1).  center: the x side's per-row centre c_m
// (the parts hold x - c_m); row_sum: the w side's per-row sums (hi, lo).  The
// GEMM adds c_m (sum_k w[n, k]) back.
struct Fp16x3Parts {
  const uint16_t* hi;
  const uint16_t* lo;
  const float* inv_scale;
  const float* center;    // x side (M), else null
  const float2* row_sum;  // w side (N), else null
  bool mn_major = false;
};
// The GEMMs below run over K, the parts' K (a multiple of 8 for K-major parts:
// the forwards pass fp16x3_padded_k(in_features)).
// z = x @ w^T into out and per-tile mean / M2 (block_m: sm90_gemm_block_m()).
cudaError_t sm90_gemm_fp16x3_train(Fp16x3Parts x, Fp16x3Parts w, float* out, float* part_mean, float* part_m2, int M,
                                   int N, int K, float* workspace, cudaStream_t stream);
// out = a * (x @ w^T) + c, the eval-mode fold (bn: as sm80_gemm_3xtf32_eval).
cudaError_t sm90_gemm_fp16x3_eval(Fp16x3Parts x, Fp16x3Parts w, float* out, const BatchNormArgs& bn, int M, int N,
                                  int K, float* workspace, cudaStream_t stream);
// out = x @ w^T (the backward's products): both operands K-major, w MN-major
// (grad_x = grad_z W from W's cached parts), or both MN-major (grad_W = grad_z^T x).
cudaError_t sm90_gemm_fp16x3_plain(Fp16x3Parts x, Fp16x3Parts w, float* out, int M, int N, int K, float* workspace,
                                   cudaStream_t stream);

// ---- bn_apply.cu: problem 33's BatchNorm after the training GEMM ------------
// Merge the per-tile statistics, update the running statistics, out = BatchNorm(scale * (z + bias))
// (bn: every field but scale_after_bn); coeff: 2 N floats of scratch (used when num_m_tiles > 8: one
// merge per feature, then a streaming pass); stats: (2, N) = [mean_z | biased var_z] for the
// backward, or null.
cudaError_t bn_apply(const float* z, float* out, const float* part_mean, const float* part_m2, int num_m_tiles,
                     int block_m, int M, int N, const BatchNormArgs& bn, float* coeff, float* stats,
                     cudaStream_t stream);
// out = (z - coeff[0 .. N)) * coeff[N .. 2N) + bn_bias: the apply with given coefficients
// (synchronized BatchNorm; out may be z).
cudaError_t bn_apply_folded(const float* z, float* out, const float* coeff, const float* bn_bias, int M, int N,
                            cudaStream_t stream);

// Eval mode with gradients: coeff (3 N floats) = [0 | a | c], the running statistics' fold
// (bn: bias, scale, bn_weight, bn_bias, running_mean, running_var, eps, scale_after_bn), so that
// out = z a + c (problem 33: bn_apply_folded with bn_bias = coeff + 2 N; 84: softmax_rows).
cudaError_t bn_fold_eval(const BatchNormArgs& bn, int N, float* coeff, cudaStream_t stream);

// ---- bn_softmax.cu: problem 84's BatchNorm, scale and row softmax -----------
// Training: coeff (3 N floats: mean_z | a | c), the running-statistics update
// (bn: every field but scale_after_bn, which is true here) and, when given,
// stats (2, N) = [mean_z | biased var_z] for the backward.
cudaError_t bn_softmax_fold_train(const float* part_mean, const float* part_m2, int num_m_tiles, int block_m, int M,
                                  int N, const BatchNormArgs& bn, float* coeff, float* stats, cudaStream_t stream);
// out <- row softmax of (in - mean_z) * a + c (coeff) or of in (coeff null); in may be out.
cudaError_t softmax_rows(const float* in, float* out, const float* coeff, int M, int N, cudaStream_t stream);

// ---- softmax_rows_backward.cu: the row softmax's backward (problem 84) ------
// grad_v = out * (grad_out - sum_n grad_out * out) per row; (M, N) contiguous each.
cudaError_t softmax_rows_backward(const float* out, const float* grad_out, float* grad_v, int M, int N,
                                  cudaStream_t stream);

// ---- bn_backward.cu: the backward's BatchNorm (training, eval) --------------
// grad_z (M, N) and grad_scale, grad_bn_weight, grad_bn_bias (N) from grad_y
// (bn: scale, bn_weight, eps, scale_after_bn; problem 84: bn_bias, or null for a
// grad_scale without its bn_bias * sum_m grad_y term).  bn.scale_stride 1: N scales;
// 0: one scale (bn.scale[0] at every feature), grad_scale_terms N doubles of scratch,
// and grad_scale = [the float64 sum of the features' terms, rounded once, 0, ..., 0].
cudaError_t bn_backward_train(const float* grad_y, const float* z, const float* stats, const BatchNormArgs& bn, int M,
                              int N, float* grad_z, float* grad_scale, float* grad_bn_weight, float* grad_bn_bias,
                              double* grad_scale_terms, cudaStream_t stream);
// Eval mode (running statistics; bn: bias, scale, bn_weight, bn_bias, running_mean, running_var,
// eps, scale_after_bn): grad_z (M, N) and grad_bias, grad_scale, grad_bn_weight, grad_bn_bias (N)
// from grad_y = dL/dy (problem 33) or dL/dv (problem 84, the softmax's backward) and the forward's
// z = x @ W^T; one scale (bn.scale_stride 0) as bn_backward_train's.
cudaError_t bn_backward_eval(const float* grad_y, const float* z, const BatchNormArgs& bn, int M, int N,
                             float* grad_z, float* grad_bias, float* grad_scale, float* grad_bn_weight,
                             float* grad_bn_bias, double* grad_scale_terms, cudaStream_t stream);
// Synchronized BatchNorm (statistics merged over processes):
// the backward split around the all_reduce: this process's sums (2, N) float64 =
// [sum_m grad_y | sum_m grad_y (z - stats[0])], then grad_z from every process's sums
// (total_sums) and the merged row count (*count, device memory), the parameter gradients from local_sums;
// problem 33's grad_scale sums this process's rows (bn: bias (gemm.bias), scale, bn_weight, eps,
// scale_after_bn; problem 84: bn_bias as bn_backward_train's).
cudaError_t bn_backward_sums(const float* grad_y, const float* z, const float* stats, int M, int N, double* sums,
                             cudaStream_t stream);
cudaError_t bn_backward_grad(const float* grad_y, const float* z, const float* stats, const BatchNormArgs& bn, int M,
                             int N, const double* count, const double* local_sums, const double* total_sums,
                             float* grad_z, float* grad_scale, float* grad_bn_weight, float* grad_bn_bias,
                             cudaStream_t stream);

// ---- bn_sync.cu: synchronized BatchNorm's statistics (merged over processes) ----
// local (3, N) float64 = [M | mean_z + bias | M2_z] of this process's rows, from the per-tile statistics
// (bias: gemm.bias, the one BatchNorm vector it reads, before the call's BatchNormArgs exist).
cudaError_t bn_local_stats(const float* part_mean, const float* part_m2, int num_m_tiles, int block_m, int M, int N,
                           const float* bias, double* local, cudaStream_t stream);
// gathered (world, 3, N) float64 (every process's local) -> stats (2, N) = [mean_z | var_z],
// coeff (2 N or 3 N: bn_apply_folded's or softmax_rows'), count (1) float64, and the
// running statistics updated in place (bn: every field; num_batches_tracked already incremented).
cudaError_t sync_bn_finalize(const double* gathered, int world, int N, const BatchNormArgs& bn, float* stats,
                             float* coeff, double* count, cudaStream_t stream);

// ---- lowp/: the 16-bit kernels (second extension; dtype 0 = IEEE half, 1 = bfloat16) ----
// The BatchNorm side of a 16-bit call: filled once per call by lowp/binding_16bit.cpp
// and passed whole to each launcher below, which reads the fields its step needs
// (each launcher's comment says which).  Vectors: (N), contiguous, 16-bit words of
// dtype, or float32 with float32_io; a field a call's steps never read may be null / 0.
struct LowpBatchNormArgs {
  int dtype;                     // x's (and z's) type: 0 = IEEE half, 1 = bfloat16 (lowp::Dtype)
  bool float32_io;               // vectors and out float32: a float32 module under mixed precision
                                 // (the GEMM still in dtype); else all 16-bit of dtype
  const void* bias;              // gemm.bias: the fused GEMMs' epilogues (the cuBLAS product adds its own)
  const void* scale;             // the scale (N)
  const void* bn_weight;         // bn.weight
  const void* bn_bias;           // bn.bias
  void* running_mean;            // read by the eval steps, updated by the training fold / strip
  void* running_var;
  int64_t* num_batches_tracked;  // training only (null in eval): += 1 by the step that counts
                                 // the call, read by the fold / strip for momentum < 0
  float momentum;                // training only; < 0: momentum=None (1 / num_batches_tracked)
  float eps;
  bool scale_after_bn;           // false: problem 33 (scale, then BatchNorm); true: 84 (then softmax)
  int scale_stride = 1;          // words from one feature's scale to the next: 1, or 0 for one number
                                 // read at every feature (a scale of shape (1,); scale_for_kernel)
};

int lowp_gemm_block_m();
// train: out = u and per-tile statistics, num_batches_tracked += 1 (not null), and
// with z_out (may be null) the Linear output z = rnd(x w^T + bias) (M, N);
// else the whole eval chain.  mma.sync m16n8k16, sm_80+ (lowp/sm80_gemm_bn_16bit.cu).
// bn: dtype, bias, scale, scale_after_bn; training num_batches_tracked; eval bn_weight,
// bn_bias, running_mean, running_var, eps.  float32_io: cudaErrorInvalidValue.
cudaError_t lowp_gemm_bn(const LowpBatchNormArgs& bn, bool train, const void* x, const void* w, void* out, int M,
                         int N, int K, float* part_mean, float* part_m2, void* z_out, cudaStream_t stream);
// The same on Hopper (lowp/sm90_gemm_bn_16bit.cu: wgmma, TMA; sm_90a): x and w 16-byte
// aligned, K % 8 == 0 (else cudaErrorInvalidValue).  The same outputs, statistics layout
// and fields of bn, and float32_io: the vectors and out are float32 (a float32 module
// under mixed precision; the GEMM in dtype), else 16-bit of dtype.  workspace: *floats
// floats from lowp_sm90_workspace, the last *zero_ints ints zeroed (may be null when
// *floats is 0).  z_out (may be null): also the Linear output z = rnd(x w^T + bias)
// (M, N) in dtype, for the backward; in eval (16-bit vectors only) with coeff_out, the
// (4, N) rows {running_mean, rsqrtf(running_var + eps), bn.weight, bn.bias} used
// (lowp_coeff.cuh; both or neither, else cudaErrorInvalidValue).  w_float32 (with
// float32_io, without z_out): w is float32, rounded to dtype in the kernel as autocast's
// cast of the weight rounds it.
void lowp_sm90_workspace(int M, int N, int K, int64_t* floats, int* zero_ints);
cudaError_t lowp_sm90_gemm_bn(const LowpBatchNormArgs& bn, bool train, bool w_float32, const void* x, const void* w,
                              void* out, int M, int N, int K, float* part_mean, float* part_m2, void* z_out,
                              float* coeff_out, float* workspace, cudaStream_t stream);
// The lowp_small_m route's product (lowp/small_m_16bit.cu; mma.sync, sm_80+): z = rnd(x w^T + bias)
// (M, N) in dtype, as eager nn.Linear's product gives it, for M = 1 .. lowp_small_m_max_rows().  x (M, K)
// and w (N, K) contiguous and 16-byte aligned, K % 8 == 0, else cudaErrorInvalidValue.  bias (N): dtype,
// or float32 (bias_float32: rounded to dtype first, autocast's cast), or null.  workspace:
// lowp_small_m_workspace_floats(M, N, K, num_sms) floats (null where that is 0); num_sms: the device's.
int lowp_small_m_max_rows();
int64_t lowp_small_m_workspace_floats(int M, int N, int K, int num_sms);
cudaError_t lowp_small_m_linear(int dtype, bool bias_float32, const void* x, const void* w, const void* bias,
                                void* z, float* workspace, int M, int N, int K, int num_sms, cudaStream_t stream);
// The same product with the BatchNorm after it in the kernel's epilogue, where lowp_small_m_fuses
// (16-bit vectors, N % 8 == 0, the product in one K piece; training M >= 2; eval problem 33 only):
// training, z and what lowp_bn_strip_train gives from it (out, coeff, the running statistics,
// num_batches_tracked += 1 where momentum >= 0; momentum < 0: the caller adds 1 first); eval, z (where
// out is not z) and lowp_bn_chain_eval's out and, where coeff is not null, its coeff.  The same bits as
// lowp_small_m_linear then those launchers.  z, out 16-byte aligned (out may be z); bn: every field
// the two launchers read, and bias.  Else cudaErrorInvalidValue, nothing launched.
bool lowp_small_m_fuses(bool train, int M, int N, int K, int num_sms, const LowpBatchNormArgs& bn);
cudaError_t lowp_small_m_linear_bn(const LowpBatchNormArgs& bn, bool train, const void* x, const void* w, void* z,
                                   void* out, float* coeff, int M, int N, int K, int num_sms, cudaStream_t stream);
// Training statistics (coeff, (4, N) rows: lowp_coeff.cuh) and the running-statistics update (lowp/bn_16bit.cu);
// float32_io: the BatchNorm parameters and running statistics (and below, out and scale) are float32.
// bn: dtype, float32_io, bn_weight, bn_bias, running_mean, running_var (updated),
// num_batches_tracked (read, already counted), momentum, eps.
cudaError_t lowp_bn_fold_train(const LowpBatchNormArgs& bn, const float* part_mean, const float* part_m2,
                               int num_m_tiles, int block_m, int M, int N, float* coeff, cudaStream_t stream);
// After a cuBLAS product z = rnd(x w^T + bias) (M, N) in dtype (lowp/bn_16bit_chain.cu), what the
// GEMMs' epilogues do: training, out = u and part_mean / part_m2 (ceil(M / 128), N),
// num_batches_tracked += 1 (may be null); eval, out = the eval chain, and where coeff is not
// null its (4, N) rows {running_mean, invstd, bn.weight, bn.bias} as the chain used them
// (the eval backward's coefficients).  out may be z (16-bit S).
// bn: dtype, float32_io, scale, scale_after_bn; training num_batches_tracked; eval
// bn_weight, bn_bias, running_mean, running_var, eps.
cudaError_t lowp_bn_chain_train(const LowpBatchNormArgs& bn, const void* z, void* out, int M, int N,
                                float* part_mean, float* part_m2, cudaStream_t stream);
cudaError_t lowp_bn_chain_eval(const LowpBatchNormArgs& bn, const void* z, void* out, int M, int N, float* coeff,
                               cudaStream_t stream);
// After a cuBLAS product, training, batches of 2 .. 1024 rows (lowp/bn_16bit_strip.cu): u,
// the statistics, the running statistics, coeff and (problem 33) out = BatchNorm(u), or
// (84) out = u, in one kernel.  num_batches_tracked += 1 here when momentum >= 0;
// momentum < 0 (1 / num_batches_tracked): the caller adds 1 first.  fits: whether
// the kernel takes this call (M, N % 8, 16-byte alignment); the launcher returns
// cudaErrorInvalidValue otherwise.  bn: every field but bias.
bool lowp_bn_strip_train_fits(int M, int N, const void* z, const void* out);
// Batches of at most this many rows take the strip kernel's small-batch forms (at most 8 rows: one
// thread a group of 8 features and every row; 9-128: 16 row slices), fast at any N (problem 84's
// limit does not apply).
int lowp_bn_strip_small_rows();
cudaError_t lowp_bn_strip_train(const LowpBatchNormArgs& bn, const void* z, void* out, int M, int N, float* coeff,
                                cudaStream_t stream);
// Problem 33, training: BatchNorm of out in place (bn: dtype, float32_io).
cudaError_t lowp_bn_apply(const LowpBatchNormArgs& bn, void* out, const float* coeff, int M, int N,
                          cudaStream_t stream);
// Problem 84: row softmax in place (coeff and bn.scale: training; coeff null: eval, the
// scale unread).  bn: dtype, float32_io, scale.
cudaError_t lowp_softmax_rows(const LowpBatchNormArgs& bn, void* out, const float* coeff, int M, int N,
                              cudaStream_t stream);
// Problem 84, eval after lowp_cublas's product z (M, N) 16-bit: out <- row softmax of
// BatchNorm (running statistics) * scale of z (bn_16bit.cu, kEval); out may be z (in place).
// coeff (may be null): (4, N) rows {running_mean, invstd, bn.weight, bn.bias} as used, for
// the eval backward (the forward with gradients, z kept apart from out).
// bn: dtype, scale, bn_weight, bn_bias, running_mean, running_var, eps; float32_io or
// !scale_after_bn: cudaErrorInvalidValue.
cudaError_t lowp_bn_softmax_rows_eval(const LowpBatchNormArgs& bn, const void* z, void* out, int M, int N,
                                      float* coeff, cudaStream_t stream);
// The backward's outputs (lowp_bn_backward): dz (M, N) in dtype; the parameter gradients
// in the vectors' type (float32_io: float32, else dtype).  dbias: eval only (training's is
// 0: the caller's), null for none.  dscale: (N) words, or (1) for one number of shape (1,)
// (dscale_len 1); a scale read as one number (scale_stride 0) needs dscale_terms, an (N)
// float64 scratch, and gets dscale = [its gradient, 0, ..., 0] (scale_terms.cuh).
struct LowpBnGrads {
  void* dz;
  void* dbias;
  void* dscale;
  int dscale_len;  // N, or 1
  void* dgamma;
  void* dbeta;
  double* dscale_terms;  // scale_stride 0: (N) float64 scratch; else null
};
// The backward after the GEMM (lowp/bn_16bit_backward.cu): grads from g = dL/dout (33) or
// dL/d(softmax input) (84), float32 (g_float32) or dtype, the saved z (M, N) in dtype and
// coeff ((4, N) rows, lowp_coeff.cuh) of the forward: the batch's (training) or the running
// statistics' (eval).  bn: dtype, float32_io (the vectors float32), scale, scale_stride,
// scale_after_bn.  M == 0 or N == 0 writes nothing; else a missing dscale_terms for
// scale_stride 0: cudaErrorInvalidValue.
cudaError_t lowp_bn_backward(const LowpBatchNormArgs& bn, bool g_float32, bool training, const void* g,
                             const void* z, const float* coeff, int M, int N, const LowpBnGrads& grads,
                             cudaStream_t stream);
// Problem 84's row softmax backward (lowp/softmax_16bit_backward.cu, softmax_backward.cuh):
// grad_v = out (grad_out - sum_n grad_out out) per row, out, grad_out, grad_v (M, N) contiguous
// of dtype (float32_io: float32, the autocast form), each element rounded once from float32.
cudaError_t lowp_softmax_rows_backward(int dtype, bool float32_io, const void* out, const void* grad_out,
                                       void* grad_v, int M, int N, cudaStream_t stream);

}  // namespace fused_gemm_bn

// ==== small_m_fp64.cu: small batches (M <= small_m_fp64_max_rows()), float64 products (DMMA, sm_80+) ====
// (appended block: the small-M route's launchers)
namespace fused_gemm_bn {
// The largest batch the small-M kernels take (16).
int small_m_fp64_max_rows();
// Bytes of workspace for an (M, K) x (N, K) product on a GPU of num_sms SMs (the split K's
// float64 partial sums, and problem 84's float64 softmax input; 0: the workspace may be
// null).  Pass the current device's multiprocessor count: the launchers plan with it.
int64_t small_m_fp64_workspace_bytes(int M, int N, int K, int num_sms, bool scale_after_bn);
// The training forward of either problem (bn.scale_after_bn), x: (M, K) with row stride
// x_row_stride elements, column stride 1, 2 <= M <= 16, N, K >= 1: out (M, N) the module's
// output; running statistics updated (bn.momentum; < 0: momentum=None) and
// num_batches_tracked (device int64) += 1; for the backward where not null, centred: z (M, N) =
// z - mean_z and stats (2, N) = [0 | biased var_z] (bn_backward_train reads only z - stats[0]).
// The BatchNorm (and softmax) in float64.
cudaError_t small_m_fp64_train(const float* x, int64_t x_row_stride, const float* w, int M, int N, int K,
                               const BatchNormArgs& bn, int64_t* num_batches_tracked, float* out, float* z,
                               float* stats, void* workspace, cudaStream_t stream);
// The eval forward of either problem: out (M, N) the module's output from the running
// statistics' fold (bn: bias, scale, bn_weight, bn_bias, running_mean, running_var, eps,
// scale_after_bn; null bias / bn_weight / bn_bias read as 0 / 1 / 0), in float64.
cudaError_t small_m_fp64_eval(const float* x, int64_t x_row_stride, const float* w, int M, int N, int K,
                              const BatchNormArgs& bn, float* out, void* workspace, cudaStream_t stream);
// ---- small_m_grad_w.cu: the route's weight gradient ----
// out (N, K) contiguous = a^T b for a (M, N), b (M, K) (unit column strides, row strides lda,
// ldb elements), 1 <= M <= small_m_fp64_max_rows(), N, K >= 1: each output the float64 sum
// of its M exact products, rounded once (grad_W = grad_z^T x).
cudaError_t small_m_grad_w(const float* a, int64_t lda, const float* b, int64_t ldb, int M, int N, int K,
                           float* out, cudaStream_t stream);
}  // namespace fused_gemm_bn
// ==== end small_m_fp64.cu ====
