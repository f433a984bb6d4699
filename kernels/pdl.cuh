// pdl.cuh -- programmatic dependent launch (Hopper): a kernel launched with
// launch_dependent() may be scheduled while the stream's previous kernel is
// still running, once every CTA of that kernel has called
// pdl_launch_dependents() (or exited); it must call pdl_wait() before it reads
// anything the previous kernel writes.  What this hides: the dependent's
// launch latency and prologue (barrier set-up, descriptor prefetch, loads of
// data the previous kernel does not write).  Before sm_90 the device calls
// compile to nothing and launch_dependent() launches normally.
// FUSED_GEMM_BN_NO_PDL=1 turns the attribute off (to measure what it gives).
//
// Sources: CUDA Programming Guide, "Programmatic Dependent Launch and
// Synchronization"; PTX ISA 8.x, section 9.7.13.x (griddepcontrol).
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <utility>

namespace fused_gemm_bn {

// Blocks until the prerequisite grid has completed and its writes are visible.
// Returns at once in a kernel that was not launched as a dependent.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Lets the stream's next kernel (if launched as a dependent) be scheduled.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Programmatic dependent launch is available on the current device (compute
// capability 9.0 or newer) and not turned off; cached per device.
inline bool pdl_enabled() {
  constexpr int kMaxDevices = 64;
  static signed char state[kMaxDevices] = {};  // 0 unknown, 1 yes, -1 no
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device >= kMaxDevices) return false;
  if (state[device] == 0) {
    int major = 0;
    const char* off = std::getenv("FUSED_GEMM_BN_NO_PDL");
    const bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
                    major >= 9 && !(off != nullptr && off[0] == '1');
    state[device] = ok ? 1 : -1;
  }
  return state[device] == 1;
}

// kernel<<<grid, block, smem_bytes, stream>>>(args...), as a programmatic
// dependent of the stream's previous kernel where pdl_enabled().
template <typename... KernelArgs, typename... Args>
cudaError_t launch_dependent(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem_bytes,
                             cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl_enabled() ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace fused_gemm_bn
