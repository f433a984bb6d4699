// sm80_gemm_3xtf32_bn.cu -- the portable 3xTF32 GEMM with a fused BatchNorm
// epilogue (mma.sync), on every GPU with compute capability >= 8.0 (Ampere, Ada,
// Hopper).  The kernel body, its formula, tensors, numerics and tiling are in
// sm80_gemm_3xtf32_bn.cuh; this file holds its __global__ wrapper and launchers.
//
// Launchers (launchers.cuh):
//   sm80_gemm_3xtf32_train  z = x @ w^T into out, per-(M tile, feature) mean / M2
//   sm80_gemm_3xtf32_eval   out = a * (x @ w^T) + c (eval-mode fold)
// x is given as its TF32 parts in fragment order (sm80_prepass_3xtf32), centred
// or not (centring: both pointers or neither).
// Preconditions: M, N >= 1, K >= 0; x_big / x_small 16-byte aligned; w 4-byte
// aligned (the 16-byte w loads are used where K % 4 == 0 and w is 16-byte aligned).
// They return the launch error (cudaSuccess if none) and never synchronise.

#include "launchers.cuh"
#include "sm80_gemm_3xtf32_bn.cuh"

namespace fused_gemm_bn {

template <Epilogue kEpilogue, bool kVec16, int kNumStages>
__global__ void __launch_bounds__(Sm80GemmTraits::kNumThreads, 1)
    sm80_gemm_3xtf32_bn_kernel(const Sm80GemmBnArgs args) {
  sm80_gemm_3xtf32_bn_body<kEpilogue, kVec16, kNumStages>(args);
}

template <Epilogue kEpilogue, bool kVec16, int kNumStages>
static cudaError_t launch_sm80_gemm_stages(const Sm80GemmBnArgs& args, cudaStream_t stream) {
  using T = Sm80GemmTraits;
  auto kernel = sm80_gemm_3xtf32_bn_kernel<kEpilogue, kVec16, kNumStages>;
  constexpr int kSmemBytes = T::smem_bytes(kNumStages);
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid((args.M + T::BLOCK_M - 1) / T::BLOCK_M, (args.N + T::BLOCK_N - 1) / T::BLOCK_N);
  if (grid.y > 65535u) return cudaErrorInvalidConfiguration;
  kernel<<<grid, T::kNumThreads, kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

// Picks the deepest pipeline that fits the current device's shared memory.
template <Epilogue kEpilogue, bool kVec16>
static cudaError_t launch_sm80_gemm(const Sm80GemmBnArgs& args, cudaStream_t stream) {
  using T = Sm80GemmTraits;
  int device = 0, smem_optin = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  err = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return err;
  if (smem_optin >= T::smem_bytes(4)) return launch_sm80_gemm_stages<kEpilogue, kVec16, 4>(args, stream);
  if (smem_optin >= T::smem_bytes(3)) return launch_sm80_gemm_stages<kEpilogue, kVec16, 3>(args, stream);
  if (smem_optin >= T::smem_bytes(2)) return launch_sm80_gemm_stages<kEpilogue, kVec16, 2>(args, stream);
  return cudaErrorInvalidConfiguration;
}

}  // namespace fused_gemm_bn

// ---------------------------------------------------------------------------
// Host launchers (declared in launchers.cuh)
// ---------------------------------------------------------------------------

int fused_gemm_bn::sm80_gemm_block_m() { return Sm80GemmTraits::BLOCK_M; }

cudaError_t fused_gemm_bn::sm80_gemm_3xtf32_train(const float* x_big, const float* x_small, const float* w,
                                                  Centring centring, float* out, float* part_mean, float* part_m2,
                                                  int M, int N, int K, cudaStream_t stream) {
  if (M < 1 || N < 1 || K < 0 || (centring.x_center == nullptr) != (centring.w_row_sum == nullptr))
    return cudaErrorInvalidValue;
  Sm80GemmBnArgs args = gemm_args(x_big, x_small, w, centring, out, M, N, K);
  args.part_mean = part_mean;
  args.part_m2 = part_m2;
  return vec16_ok(w, K) ? launch_sm80_gemm<Epilogue::kTrain, true>(args, stream)
                        : launch_sm80_gemm<Epilogue::kTrain, false>(args, stream);
}

// bn.scale_after_bn: Linear -> BatchNorm -> scale (problem 84) instead of Linear -> scale -> BatchNorm.
cudaError_t fused_gemm_bn::sm80_gemm_3xtf32_eval(const float* x_big, const float* x_small, const float* w,
                                                 Centring centring, float* out, const BatchNormArgs& bn, int M, int N,
                                                 int K, cudaStream_t stream) {
  if (M < 1 || N < 1 || K < 0 || (centring.x_center == nullptr) != (centring.w_row_sum == nullptr))
    return cudaErrorInvalidValue;
  Sm80GemmBnArgs args = gemm_args(x_big, x_small, w, centring, out, M, N, K);
  args.bn = BnParams{bn.bias,         bn.scale,       bn.bn_weight, bn.bn_bias,
                     bn.running_mean, bn.running_var, bn.eps,       bn.scale_after_bn};
  return vec16_ok(w, K) ? launch_sm80_gemm<Epilogue::kEval, true>(args, stream)
                        : launch_sm80_gemm<Epilogue::kEval, false>(args, stream);
}
