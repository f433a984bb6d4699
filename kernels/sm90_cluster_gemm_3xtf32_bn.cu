// sm90_cluster_gemm_3xtf32_bn.cu -- problem 33's whole training forward in one
// launch on sm_90: the portable 3xTF32 kernel body (sm80_gemm_3xtf32_bn.cuh) with
// its kClusterTrain epilogue, launched as thread-block clusters (PTX ISA 9.7.1
// "cluster", CUDA programming guide "Thread Block Clusters").
//
// Grid (m_tiles, n_tiles), cluster (m_tiles, 1, 1): one cluster holds every M
// tile of one BLOCK_N column block, so after the GEMM the per-tile mean / M2 of z
// are merged over distributed shared memory (Chan's formula, bn_stats.cuh), each
// CTA normalises its tile in registers and writes the BatchNorm output once;
// cluster rank 0 updates running_mean / running_var.  No z round trip through
// memory and no bn_apply launch.
//
// Tensors: as sm80_gemm_3xtf32_train (x as fragment-order TF32 parts from
// sm80_prepass_3xtf32, which has already incremented num_batches_tracked), plus
// bias, scale, bn_weight, bn_bias, running_mean, running_var (N) float32.
// Preconditions (the launcher returns cudaErrorInvalidValue otherwise):
// 1 <= m_tiles = ceil(M / BLOCK_M) <= 8 (the portable cluster size limit),
// n_tiles <= 65535, N >= 1, compute capability >= 9.0 with 4 pipeline stages of
// shared memory.  Whether to use it is model_new.py's dispatch decision: where
// clusters of m_tiles CTAs cost no extra wave (sm90_cluster_max_active below,
// against the plain grid over the SM count).  Measured on an H200 at M = 1024,
// N = K = 8192, where they would (5 waves instead of 4): 2.55 ms against 2.10 ms
// for the multi-pass path.

#include "launchers.cuh"
#include "sm80_gemm_3xtf32_bn.cuh"

namespace fused_gemm_bn {

constexpr int kMaxClusterTiles = 8;  // portable cluster size limit
constexpr int kClusterStages = Sm80GemmTraits::kMaxStages;
constexpr int kClusterSmemBytes = Sm80GemmTraits::smem_bytes(kClusterStages);

template <bool kVec16>
__global__ void __launch_bounds__(Sm80GemmTraits::kNumThreads, 1)
    sm90_cluster_gemm_3xtf32_bn_kernel(const Sm80GemmBnArgs args) {
  sm80_gemm_3xtf32_bn_body<Epilogue::kClusterTrain, kVec16, kClusterStages>(args);
}

// The launch configuration of a cluster of m_tiles CTAs per column block.
inline cudaLaunchConfig_t cluster_config(unsigned m_tiles, unsigned n_tiles, cudaLaunchAttribute* attr,
                                         cudaStream_t stream) {
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = m_tiles;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(m_tiles, n_tiles);
  config.blockDim = dim3(Sm80GemmTraits::kNumThreads);
  config.dynamicSmemBytes = kClusterSmemBytes;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = 1;
  return config;
}

template <bool kVec16>
static cudaError_t max_active_clusters(int m_tiles, int* max_clusters) {
  auto kernel = sm90_cluster_gemm_3xtf32_bn_kernel<kVec16>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kClusterSmemBytes);
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute attr[1];
  const cudaLaunchConfig_t config = cluster_config(m_tiles, 1, attr, nullptr);
  return cudaOccupancyMaxActiveClusters(max_clusters, kernel, &config);
}

template <bool kVec16>
static cudaError_t launch_cluster_train(const Sm80GemmBnArgs& args, cudaStream_t stream) {
  using T = Sm80GemmTraits;
  const unsigned m_tiles = (args.M + T::BLOCK_M - 1) / T::BLOCK_M;
  const unsigned n_tiles = (args.N + T::BLOCK_N - 1) / T::BLOCK_N;
  auto kernel = sm90_cluster_gemm_3xtf32_bn_kernel<kVec16>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kClusterSmemBytes);
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute attr[1];
  const cudaLaunchConfig_t config = cluster_config(m_tiles, n_tiles, attr, stream);
  err = cudaLaunchKernelEx(&config, kernel, args);
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

// Compute capability >= 9.0 and the 4-stage shared memory on the current device.
static bool cluster_device_ok() {
  int device = 0, major = 0, smem_optin = 0;
  return cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
         cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) == cudaSuccess &&
         major >= 9 && smem_optin >= kClusterSmemBytes;
}

}  // namespace fused_gemm_bn

// ---------------------------------------------------------------------------
// Host launchers (declared in launchers.cuh)
// ---------------------------------------------------------------------------

// Clusters of m_tiles CTAs that fit on the current device at once; 0 where the
// device cannot run the kernel (compute capability < 9.0, too little shared
// memory) or m_tiles is out of range.  A query: launches nothing.
int fused_gemm_bn::sm90_cluster_max_active(int m_tiles, bool vec16) {
  if (m_tiles < 1 || m_tiles > kMaxClusterTiles || !cluster_device_ok()) return 0;
  int max_clusters = 0;
  const cudaError_t err =
      vec16 ? max_active_clusters<true>(m_tiles, &max_clusters) : max_active_clusters<false>(m_tiles, &max_clusters);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the query's error: nothing was launched
    return 0;
  }
  return max_clusters;
}

cudaError_t fused_gemm_bn::sm90_cluster_gemm_3xtf32_train(const float* x_big, const float* x_small, const float* w,
                                                          Centring centring, float* out, const float* bias, const float* scale,
                                                          const float* bn_weight, const float* bn_bias,
                                                          float* running_mean, float* running_var,
                                                          const int64_t* num_batches_tracked, float momentum,
                                                          float eps, int M, int N, int K, cudaStream_t stream) {
  using T = Sm80GemmTraits;
  const long long m_tiles = (static_cast<long long>(M) + T::BLOCK_M - 1) / T::BLOCK_M;
  const long long n_tiles = (static_cast<long long>(N) + T::BLOCK_N - 1) / T::BLOCK_N;
  if (m_tiles < 1 || m_tiles > kMaxClusterTiles || n_tiles < 1 || n_tiles > 65535 || K < 0 ||
      (centring.x_center == nullptr) != (centring.w_row_sum == nullptr) || !cluster_device_ok())
    return cudaErrorInvalidValue;
  Sm80GemmBnArgs args = gemm_args(x_big, x_small, w, centring, out, M, N, K);
  args.bn = BnParams{bias, scale, bn_weight, bn_bias, nullptr, nullptr, eps, false};
  args.running_mean_out = running_mean;
  args.running_var_out = running_var;
  args.num_batches_tracked = num_batches_tracked;
  args.momentum = momentum;
  return vec16_ok(w, K) ? launch_cluster_train<true>(args, stream) : launch_cluster_train<false>(args, stream);
}
