// tensor_map.cuh -- host code: TMA tensor maps (CUtensorMap) through the driver's
// cuTensorMapEncodeTiled, fetched through the runtime so that no extension needs
// -lcuda.  Used by the Hopper GEMMs' maps (sm90_gemm_tiles.cuh) and by the
// small-batch kernel's ring (small_m_fp64.cu).
// Source: CUDA Driver API, cuTensorMapEncodeTiled (tensor map rules: global
// address and strides multiples of 16 bytes, box dimensions at most 256,
// out-of-bounds elements zero-filled).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace fused_gemm_bn {
namespace sm90 {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled from the driver; nullptr if the driver does not provide it.
static EncodeTiledFn encode_tiled_fn() {
  static EncodeTiledFn fn = []() -> EncodeTiledFn {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status{};
#if CUDART_VERSION >= 12050
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &status) !=
        cudaSuccess)
      return nullptr;
#else
    if (cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &ptr, cudaEnableDefault, &status) != cudaSuccess)
      return nullptr;
#endif
    return status == cudaDriverEntryPointSuccess ? reinterpret_cast<EncodeTiledFn>(ptr) : nullptr;
  }();
  return fn;
}

// A (rows, cols) float32 matrix with a row stride of row_stride floats (row_stride % 4 == 0,
// ptr 16-byte aligned), read in boxes of box_rows x box_cols floats (box_cols % 4 == 0),
// stored densely in shared memory (no swizzle: a box row takes box_cols floats), zero-filled
// outside the matrix.  False if the driver has no encoder or refuses the map.
static bool make_tensor_map_f32_rows(CUtensorMap* map, const float* ptr, int rows, int cols, int64_t row_stride,
                                     int box_cols, int box_rows) {
  const EncodeTiledFn encode = encode_tiled_fn();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_stride) * 4};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, const_cast<float*>(ptr), dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace sm90
}  // namespace fused_gemm_bn
