// softmax_rows_backward.cu -- the float32 extension's backward of problem 84's row
// softmax: grad_v = out * (grad_out - sum_n grad_out * out) per row, one kernel
// (softmax_backward.cuh: the kernel, its forms, numerics and sources; the 16-bit
// extension instantiates the same kernel for its element types).
//
// Tensors: out, grad_out, grad_v (M, N) float32, row-major, contiguous; 16-byte
// accesses when N % 4 == 0 and all three are 16-byte aligned, else 4-byte.
// Any M >= 0, N >= 0.  Returns the launch error (cudaErrorInvalidValue for
// negative sizes).

#include <cuda_runtime.h>

#include "launchers.cuh"
#include "softmax_backward.cuh"

// ---------------------------------------------------------------------------
// Host launcher (declared in launchers.cuh)
// ---------------------------------------------------------------------------

cudaError_t fused_gemm_bn::softmax_rows_backward(const float* out, const float* grad_out, float* grad_v, int M, int N,
                                                 cudaStream_t stream) {
  using namespace softmax_backward;
  return launch_softmax_rows_backward<FloatElems>(out, grad_out, grad_v, M, N, stream);
}
