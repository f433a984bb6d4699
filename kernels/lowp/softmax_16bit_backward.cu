// softmax_16bit_backward.cu -- problem 84's row softmax backward for the 16-bit
// extension: grad_v = out (grad_out - sum_n grad_out out) per row, on 16-bit tensors
// (__half, __nv_bfloat16) and, under torch.autocast, float32 ones.  The kernel, its forms
// and numerics: ../softmax_backward.cuh (the float32 extension runs the same kernel).
//
// Tensors: out, grad_out, grad_v (M, N) of one type, row-major, contiguous; 16-byte
// groups (8 16-bit or 4 float32 elements) where N allows and all three are 16-byte
// aligned, else single elements.  Numerics: the row's sum in float64, each grad_v element
// rounded once to float32 and, for 16-bit, once more to the type (nearest even).  torch's
// 16-bit kernel (at::_softmax_backward_data) rounds grad_out * out to the type first and
// sums in float32.  Returns the launch error; an unknown dtype code: cudaErrorInvalidValue.

#include <cuda_runtime.h>
#include <stdint.h>

#include "launchers.cuh"
#include "lowp_types.cuh"
#include "softmax_backward.cuh"

namespace fused_gemm_bn {
namespace lowp {

// 16-bit elements for softmax_backward.cuh: 16-byte groups of 8 (lowp_types.cuh's conversions).
template <typename T>
struct Elems16 {
  using word = uint16_t;
  using Group = uint4;
  static constexpr int kGroup = 8;
  static __device__ __forceinline__ void unpack(const uint4& g, float (&v)[8]) { unpack8<T>(Group8<T>{{g}}, v); }
  static __device__ __forceinline__ void store(uint16_t* p, const float (&v)[8]) { store_group<T>(p, v); }
  static __device__ __forceinline__ float load1(const uint16_t* p) { return Storage<T>::load(p); }
  static __device__ __forceinline__ void store1(uint16_t* p, float v) { Storage<T>::store(p, v); }
};

}  // namespace lowp
}  // namespace fused_gemm_bn

// ---------------------------------------------------------------------------
// Host launcher (declared in launchers.cuh)
// ---------------------------------------------------------------------------

cudaError_t fused_gemm_bn::lowp_softmax_rows_backward(int dtype, bool float32_io, const void* out,
                                                      const void* grad_out, void* grad_v, int M, int N,
                                                      cudaStream_t stream) {
  using namespace fused_gemm_bn::lowp;
  using softmax_backward::launch_softmax_rows_backward;
  if (float32_io)
    return launch_softmax_rows_backward<softmax_backward::FloatElems>(
        static_cast<const float*>(out), static_cast<const float*>(grad_out), static_cast<float*>(grad_v), M, N, stream);
  return dispatch_dtype(dtype, [&](auto t) {
    return launch_softmax_rows_backward<Elems16<typename decltype(t)::type>>(
        static_cast<const uint16_t*>(out), static_cast<const uint16_t*>(grad_out), static_cast<uint16_t*>(grad_v), M, N,
        stream);
  });
}
