// centring.cu -- the centred split's per-row terms for the 3xTF32 GEMM
// (sm80_gemm_3xtf32_bn.cuh; the fp16x3 pre-pass makes
// its own in the same pass as its split).  The rule, and why, are in
// centring.cuh.
//
//   row_centers: x (M, K) fp32, any strides (read, never written) -> center (M)
//                fp32, c_m; the 3xTF32 pre-pass (prepass_3xtf32.cu) then splits
//                rn(x - c_m).
//   row_sums:    w (N, K) fp32, any strides -> row_sum (N) fp32 (hi, lo) pairs,
//                sum_k w[n, k] in float64; model_new.py keeps them while the
//                weight is unchanged (_weight_parts).
// One 256-thread block per row, one read of it: 4 M K (or 4 N K) bytes.

#include <cuda_runtime.h>
#include <stdint.h>

#include "centring.cuh"
#include "launchers.cuh"

namespace fused_gemm_bn {
namespace {

template <bool kVec, RowSide kSide>
__global__ void __launch_bounds__(kRowThreads)
    row_terms_kernel(const float* __restrict__ x, int64_t row_stride, int64_t col_stride, int K,
                     float* __restrict__ center, float2* __restrict__ row_sum) {
  const int64_t m = blockIdx.x;
  row_terms<kVec, kSide>(x + m * row_stride, col_stride, K, m, center, row_sum);
}

template <RowSide kSide>
cudaError_t launch_row_terms(const float* x, int64_t row_stride, int64_t col_stride, int rows, int K, float* center,
                             float2* row_sum, cudaStream_t stream) {
  if (rows < 1 || K < 1) return cudaErrorInvalidValue;
  const bool vec = col_stride == 1 && row_stride % 4 == 0 && K % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  if (vec) row_terms_kernel<true, kSide><<<rows, kRowThreads, 0, stream>>>(x, row_stride, col_stride, K, center, row_sum);
  else row_terms_kernel<false, kSide><<<rows, kRowThreads, 0, stream>>>(x, row_stride, col_stride, K, center, row_sum);
  return cudaGetLastError();
}

}  // namespace
}  // namespace fused_gemm_bn

// ---------------------------------------------------------------------------
// Host launchers (declared in launchers.cuh)
// ---------------------------------------------------------------------------

// Preconditions: M >= 1, K >= 1.
cudaError_t fused_gemm_bn::row_centers(const float* x, int64_t row_stride, int64_t col_stride, int M, int K,
                                       float* center, cudaStream_t stream) {
  return launch_row_terms<RowSide::kX>(x, row_stride, col_stride, M, K, center, nullptr, stream);
}

// Preconditions: N >= 1, K >= 1.
cudaError_t fused_gemm_bn::row_sums(const float* w, int64_t row_stride, int64_t col_stride, int N, int K,
                                    float2* row_sum, cudaStream_t stream) {
  return launch_row_terms<RowSide::kW>(w, row_stride, col_stride, N, K, nullptr, row_sum, stream);
}
