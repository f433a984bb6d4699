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
// workspace: sm80_gemm_3xtf32_workspace(M, N, K) floats, its last zero_ints
// ints zero at the launch (the pre-pass zeroes them); null where that is 0.
// They return the launch error (cudaSuccess if none) and never synchronise.

#include <algorithm>
#include <type_traits>

#include "device_facts.cuh"
#include "heuristics_sm80.cuh"
#include "launchers.cuh"
#include "sm80_gemm_3xtf32_bn.cuh"

namespace fused_gemm_bn {

template <class T, Epilogue kEpilogue, bool kVec16, int kNumStages>
__global__ void __launch_bounds__(T::kNumThreads, 1) sm80_gemm_3xtf32_bn_kernel(const Sm80GemmBnArgs args) {
  sm80_gemm_3xtf32_bn_body<T, kEpilogue, kVec16, kNumStages>(args);
}

// The tiles and the split are planned in heuristics_sm80.cuh (sm80_tile_dims,
// sm80_split_plan) from the tile sizes it names: they must be these traits'.
static_assert(Sm80GemmTraits::BLOCK_M == kSm80Tile.block_m && Sm80GemmTraits::BLOCK_N == kSm80Tile.block_n &&
                  Sm80SmallMTraits::BLOCK_M == kSm80SmallMTile.block_m &&
                  Sm80SmallMTraits::BLOCK_N == kSm80SmallMTile.block_n &&
                  Sm80GemmTraits::BLOCK_K == kSm80BlockK && Sm80SmallMTraits::BLOCK_K == kSm80BlockK,
              "heuristics_sm80.cuh plans with these tiles");

template <class T, Epilogue kEpilogue, bool kVec16, int kNumStages>
static cudaError_t launch_sm80_gemm_stages(const Sm80GemmBnArgs& args, cudaStream_t stream) {
  auto kernel = sm80_gemm_3xtf32_bn_kernel<T, kEpilogue, kVec16, kNumStages>;
  constexpr int kSmemBytes = T::smem_bytes(kNumStages);
  static bool smem_set[kMaxCachedDevices] = {};  // per instantiation and device
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device >= kMaxCachedDevices || !smem_set[device]) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    if (err != cudaSuccess) return err;
    if (device < kMaxCachedDevices) smem_set[device] = true;
  }
  const dim3 grid((args.M + T::BLOCK_M - 1) / T::BLOCK_M, (args.N + T::BLOCK_N - 1) / T::BLOCK_N, args.pieces);
  if (grid.y > 65535u || grid.z > 65535u) return cudaErrorInvalidConfiguration;
  kernel<<<grid, T::kNumThreads, kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

// Picks the deepest pipeline of tile T that fits the current device's shared
// memory: 4, 3 or 2 stages (the small-M tile: 4 or 2).
template <class T, Epilogue kEpilogue, bool kVec16>
static cudaError_t launch_sm80_tile(const Sm80GemmBnArgs& args, int smem_optin, cudaStream_t stream) {
  constexpr bool kThreeStages = std::is_same<T, Sm80GemmTraits>::value;
  if (smem_optin >= T::smem_bytes(4)) return launch_sm80_gemm_stages<T, kEpilogue, kVec16, 4>(args, stream);
  if constexpr (kThreeStages) {
    if (smem_optin >= T::smem_bytes(3)) return launch_sm80_gemm_stages<T, kEpilogue, kVec16, 3>(args, stream);
  }
  if (smem_optin >= T::smem_bytes(2)) return launch_sm80_gemm_stages<T, kEpilogue, kVec16, 2>(args, stream);
  return cudaErrorInvalidConfiguration;
}

// Plans the split (the workspace must hold sm80_gemm_3xtf32_workspace's size
// for this shape on this device; null only where that is 0), then launches
// the tile of the batch size (sm80_tile_dims).
template <Epilogue kEpilogue, bool kVec16>
static cudaError_t launch_sm80_gemm(Sm80GemmBnArgs args, float* workspace, cudaStream_t stream) {
  DeviceFacts facts;
  const cudaError_t err = current_device_facts(&facts);
  if (err != cudaSuccess) return err;
  const Sm80SplitPlan plan = sm80_split_plan(args.M, args.N, args.K, facts.num_sms);
  args.pieces = plan.pieces;
  args.k_tiles_per_piece = plan.k_tiles_per_piece;
  if (plan.pieces > 1) {
    if (workspace == nullptr) return cudaErrorInvalidValue;
    args.partials = workspace;
    args.tile_arrivals = reinterpret_cast<int*>(workspace + static_cast<int64_t>(plan.pieces) * args.M * args.N);
  }
  if (sm80_small_tile(args.M))
    return launch_sm80_tile<Sm80SmallMTraits, kEpilogue, kVec16>(args, facts.smem_optin, stream);
  return launch_sm80_tile<Sm80GemmTraits, kEpilogue, kVec16>(args, facts.smem_optin, stream);
}

}  // namespace fused_gemm_bn

// ---------------------------------------------------------------------------
// Host launchers (declared in launchers.cuh)
// ---------------------------------------------------------------------------

int fused_gemm_bn::sm80_gemm_block_m(int M) { return sm80_tile_dims(M).block_m; }

// *floats floats: the split's partial sums (pieces x M x N) and, after them,
// one arrival count per output tile, the last *zero_ints ints, which must be
// zero at the launch.  Both 0 when the plan does not split.
cudaError_t fused_gemm_bn::sm80_gemm_3xtf32_workspace(int M, int N, int K, int64_t* floats, int* zero_ints) {
  *floats = 0;
  *zero_ints = 0;
  if (M < 1 || N < 1 || K < 0) return cudaSuccess;
  DeviceFacts facts;
  const cudaError_t err = current_device_facts(&facts);
  if (err != cudaSuccess) return err;
  const Sm80SplitPlan plan = sm80_split_plan(M, N, K, facts.num_sms);
  if (plan.pieces < 2) return cudaSuccess;
  const Sm80TileDims d = sm80_tile_dims(M);
  const int tiles = ((M + d.block_m - 1) / d.block_m) * ((N + d.block_n - 1) / d.block_n);
  *floats = static_cast<int64_t>(plan.pieces) * M * N + tiles;
  *zero_ints = tiles;
  return cudaSuccess;
}

cudaError_t fused_gemm_bn::sm80_gemm_3xtf32_train(const float* x_big, const float* x_small, const float* w,
                                                  Centring centring, float* out, float* part_mean, float* part_m2,
                                                  int M, int N, int K, float* workspace, cudaStream_t stream) {
  if (M < 1 || N < 1 || K < 0 || (centring.x_center == nullptr) != (centring.w_row_sum == nullptr))
    return cudaErrorInvalidValue;
  Sm80GemmBnArgs args = gemm_args(x_big, x_small, w, centring, out, M, N, K);
  args.part_mean = part_mean;
  args.part_m2 = part_m2;
  return vec16_ok(w, K) ? launch_sm80_gemm<Epilogue::kTrain, true>(args, workspace, stream)
                        : launch_sm80_gemm<Epilogue::kTrain, false>(args, workspace, stream);
}

// bn.scale_after_bn: Linear -> BatchNorm -> scale (problem 84) instead of Linear -> scale -> BatchNorm.
cudaError_t fused_gemm_bn::sm80_gemm_3xtf32_eval(const float* x_big, const float* x_small, const float* w,
                                                 Centring centring, float* out, const BatchNormArgs& bn, int M, int N,
                                                 int K, float* workspace, cudaStream_t stream) {
  if (M < 1 || N < 1 || K < 0 || (centring.x_center == nullptr) != (centring.w_row_sum == nullptr))
    return cudaErrorInvalidValue;
  Sm80GemmBnArgs args = gemm_args(x_big, x_small, w, centring, out, M, N, K);
  args.bn = BnParams{bn.bias,         bn.scale,       bn.bn_weight, bn.bn_bias,
                     bn.running_mean, bn.running_var, bn.eps,       bn.scale_after_bn, bn.scale_stride};
  return vec16_ok(w, K) ? launch_sm80_gemm<Epilogue::kEval, true>(args, workspace, stream)
                        : launch_sm80_gemm<Epilogue::kEval, false>(args, workspace, stream);
}
