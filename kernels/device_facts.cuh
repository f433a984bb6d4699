// device_facts.cuh -- what the launchers plan with about the current device
// (sm80_gemm_3xtf32_bn.cu, sm90_gemm_fp16x3_bn.cu, pdl.cuh): its streaming
// multiprocessor count, the opt-in shared memory per block and the compute
// capability's major number, queried once per device with
// cudaDeviceGetAttribute and cached for the process (they do not change while
// it runs).  Host code only.
#pragma once

#include <cuda_runtime.h>

namespace fused_gemm_bn {

constexpr int kMaxCachedDevices = 64;  // devices past this are queried on every call

struct DeviceFacts {
  int num_sms = 0;     // cudaDevAttrMultiProcessorCount
  int smem_optin = 0;  // cudaDevAttrMaxSharedMemoryPerBlockOptin, bytes
  int cc_major = 0;    // cudaDevAttrComputeCapabilityMajor
};

// The current device's facts; an error from cudaGetDevice or the queries is returned as it is.
static cudaError_t current_device_facts(DeviceFacts* facts) {
  static DeviceFacts cached[kMaxCachedDevices];
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < kMaxCachedDevices && cached[device].num_sms > 0) {
    *facts = cached[device];
    return cudaSuccess;
  }
  DeviceFacts f;
  err = cudaDeviceGetAttribute(&f.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&f.cc_major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&f.num_sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  if (device < kMaxCachedDevices) cached[device] = f;
  *facts = f;
  return cudaSuccess;
}

}  // namespace fused_gemm_bn
