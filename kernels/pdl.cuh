// pdl.cuh -- programmatic dependent launch (PDL) for the kernels around the
// fp16x3 GEMM: the pre-passes, the BatchNorm and softmax kernels and the
// backward's row and column kernels, and for those after the 16-bit GEMM
// (lowp/bn_16bit.cu: fold, apply, row softmax), each launched right after the
// previous kernel on the same stream.
//
// Without PDL a kernel's CTAs are launched only once the previous kernel has
// finished; the launch and the CTAs' start then sit between the two (0.9-2.3 us
// per kernel boundary in the training step on an H200, docs/perf.md v40).
// With PDL (compute capability 9.0+; CUDA programming guide, "Programmatic
// Dependent Launch and Synchronization"; PTX ISA, griddepcontrol) the next
// kernel may be launched once every CTA of the current one has run
// pdl_wait_then_release() (or exited), and its CTAs take SMs as the current
// kernel's CTAs leave them; each then waits in griddepcontrol.wait until the
// previous kernel has completed and its memory writes are visible.
//
// The GEMM (sm90_gemm_fp16x3_bn.cu) is launched without PDL and does not
// release its successor early, so the kernel after it is launched as it exits
// and finds every SM free.  Measured on an H200 (docs/perf.md v41): with the
// GEMM releasing at its start, the single-wave bn_apply after it was launched
// during the GEMM's last wave and the GEMM took 20 us longer; with the GEMM
// itself launched early after the pre-pass, the training step was 12 us slower
// than with it launched as before.
//
// The rule (device side): every kernel launched with launch_kernel() calls
// pdl_wait_then_release() before it reads or writes global memory and before
// any of its CTAs can return; then nothing it touches can race with the
// kernels before it, whatever they are.  Waiting before releasing keeps at most
// two kernels' CTAs on the GPU at once (the one running and the next, waiting).
// On the host, launch_kernel() asks for PDL only on devices of compute
// capability 9.0 or more and on streams that are not capturing a CUDA graph;
// otherwise it launches as <<<>>> does, and griddepcontrol.wait returns at once.
// launch_kernel_cooperative() is the same launch as a cooperative one (every CTA
// resident at once, for cooperative_groups' grid sync: small_m_fp64.cu's
// problem-84 softmax), refused where the grid does not fit.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "device_facts.cuh"

namespace fused_gemm_bn {

// griddepcontrol.wait (the previous kernel on the stream has completed, its
// writes visible), then griddepcontrol.launch_dependents (the next kernel may
// launch once every CTA of this one has got here).  No-ops below sm_90 and in
// kernels launched without PDL.
__device__ __forceinline__ void pdl_wait_then_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether launches on `stream` may ask for PDL: compute capability 9.0+ and a stream
// that is not capturing a CUDA graph (header).  Leaves no error behind.
static inline bool pdl_allowed(cudaStream_t stream) {
  DeviceFacts facts;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  const bool pdl = current_device_facts(&facts) == cudaSuccess && facts.cc_major >= 9 &&
                   cudaStreamIsCapturing(stream, &capture) == cudaSuccess && capture == cudaStreamCaptureStatusNone;
  if (!pdl) cudaGetLastError();
  return pdl;
}

#if CUDART_VERSION >= 11080
// cudaLaunchKernelEx with PDL (where pdl_allowed) and, if `cooperative`, as a
// cooperative launch (every CTA resident at once, cooperative_groups' grid sync).
template <typename... Params, typename... Args>
static cudaError_t launch_kernel_ex(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                    bool pdl, bool cooperative, Args&&... args) {
  cudaLaunchAttribute attr[2];
  unsigned num_attrs = 0;
  if (pdl) {
    attr[num_attrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[num_attrs++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cooperative) {
    attr[num_attrs].id = cudaLaunchAttributeCooperative;
    attr[num_attrs++].val.cooperative = 1;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = num_attrs;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  if (err != cudaSuccess) cudaGetLastError();
  return err;
}
#endif

// kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent
// launch where the device and stream allow it (header).  Returns the launch's
// error (cudaSuccess if none) and leaves none behind.
template <typename... Params, typename... Args>
static cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                 Args&&... args) {
#if CUDART_VERSION >= 11080
  if (pdl_allowed(stream))
    return launch_kernel_ex(kernel, grid, block, smem, stream, true, false, std::forward<Args>(args)...);
#endif
  kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
  return cudaGetLastError();
}

// The same as a cooperative launch (CUDA programming guide, "Grid Synchronization"):
// every CTA of `grid` resident at once, so that the kernel may wait on
// cooperative_groups::this_grid().sync(); PDL as launch_kernel.  Returns
// cudaErrorCooperativeLaunchTooLarge where the grid does not fit on the device at
// once (e.g. an MPS client's share of the SMs), cudaErrorNotSupported before CUDA
// 11.8's cudaLaunchKernelEx; the caller then launches another way.  Leaves no error behind.
template <typename... Params, typename... Args>
static cudaError_t launch_kernel_cooperative(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                                             cudaStream_t stream, Args&&... args) {
#if CUDART_VERSION >= 11080
  const bool pdl = pdl_allowed(stream);
  cudaError_t err = launch_kernel_ex(kernel, grid, block, smem, stream, pdl, true, args...);
  if (err != cudaSuccess && err != cudaErrorCooperativeLaunchTooLarge && pdl)  // the two attributes only apart
    err = launch_kernel_ex(kernel, grid, block, smem, stream, false, true, args...);
  return err;
#else
  return cudaErrorNotSupported;
#endif
}

}  // namespace fused_gemm_bn
