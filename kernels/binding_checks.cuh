// binding_checks.cuh -- the input checks and stream lookup that both torch
// bindings (torch_binding.cpp, lowp/binding_16bit.cpp) share, so that a check
// and its message read the same in the float32 and the 16-bit extension.
// Host C++ with torch headers: included only by the bindings, never by a .cu
// (those compile without torch).  A .cuh because the loaders write kernels/*.cuh
// into the extensions' include folder (model_new_lowp.py takes the kernels/
// headers its sources #include by name).

#pragma once

#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/extension.h>

#include "device_facts.cuh"

namespace fused_gemm_bn {
namespace binding {

// The scale as a contiguous (N) vector, for the kernels that read N scales (synchronized
// BatchNorm's): model_new.per_feature_scale passes one number broadcast to N features as a
// stride-0 view (no copy in Python); it is materialized here, in one at:: copy.  The
// forwards read that view in place instead (scale_for_kernel, BatchNormArgs::scale_stride).
inline torch::Tensor feature_vector(const torch::Tensor& scale) {
  return scale.dim() == 1 && !scale.is_contiguous() ? scale.contiguous() : scale;
}

// Whether the scale is one number viewed as N (stride 0: a scale of shape (1,), as
// per_feature_scale passes it).
inline bool scale_of_one_number(const torch::Tensor& scale) {
  return scale.dim() == 1 && scale.size(0) > 1 && scale.stride(0) == 0;
}

// The scale as the forwards' kernels read it (scale[j * stride]), and that stride: 0 for one
// number viewed as N, else 1 (feature_vector's N words, copied here if they are not contiguous).
inline int scale_for_kernel(torch::Tensor& scale) {
  if (scale_of_one_number(scale)) return 0;
  scale = feature_vector(scale);
  return 1;
}

// nn.BatchNorm1d's training precondition (more than one row) and the counter's form.
inline void check_training(const torch::Tensor& x, int M, int N, const torch::Tensor& num_batches_tracked) {
  TORCH_CHECK(M > 1, "Expected more than 1 value per channel when training, got input size ",
              torch::IntArrayRef({M, N}));
  TORCH_CHECK(num_batches_tracked.device() == x.device() && num_batches_tracked.scalar_type() == torch::kInt64 &&
                  num_batches_tracked.numel() == 1,
              "bn.num_batches_tracked must be a one-element int64 tensor on ", x.device());
}

// The current stream of x's device: every launch goes there.
inline cudaStream_t current_stream(const torch::Tensor& x) {
  return c10::cuda::getCurrentCUDAStream(x.get_device()).stream();
}

// What the bindings read about x's device (compute capability, multiprocessors), queried once
// per device (device_facts.cuh's cache, shared with the launchers).
inline DeviceFacts facts_of(const torch::Tensor& x) {
  DeviceFacts facts;
  TORCH_CHECK(device_facts(x.get_device(), &facts) == cudaSuccess, "fused_gemm_bn: cannot read the attributes of ",
              x.device());
  return facts;
}

// Streaming multiprocessors of x's device.
inline int num_sms(const torch::Tensor& x) { return facts_of(x).num_sms; }

}  // namespace binding
}  // namespace fused_gemm_bn
