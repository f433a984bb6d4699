// device_facts.cuh -- what the launchers plan with about the current device
// (sm80_gemm_3xtf32_bn.cu, sm90_gemm_fp16x3_bn.cu, pdl.cuh): its streaming
// multiprocessor count, the opt-in shared memory per block and the compute
// capability, queried once per device with cudaDeviceGetAttribute and cached for
// the process (they do not change while it runs).  Host code only; the 16-bit
// binding (lowp/binding_16bit.cpp) reads it too, by device index.
#pragma once

#include <cuda_runtime.h>

namespace fused_gemm_bn {

constexpr int kMaxCachedDevices = 64;  // devices past this are queried on every call

struct DeviceFacts {
  int num_sms = 0;     // cudaDevAttrMultiProcessorCount
  int smem_optin = 0;  // cudaDevAttrMaxSharedMemoryPerBlockOptin, bytes
  int cc_major = 0;    // cudaDevAttrComputeCapabilityMajor
  int cc_minor = 0;    // cudaDevAttrComputeCapabilityMinor
};

// The facts of device `device` (an index >= 0); an error from the queries is returned as it is.
static cudaError_t device_facts(int device, DeviceFacts* facts) {
  static DeviceFacts cached[kMaxCachedDevices];
  if (device >= 0 && device < kMaxCachedDevices && cached[device].num_sms > 0) {
    *facts = cached[device];
    return cudaSuccess;
  }
  DeviceFacts f;
  cudaError_t err = cudaDeviceGetAttribute(&f.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&f.cc_major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&f.cc_minor, cudaDevAttrComputeCapabilityMinor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&f.num_sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  if (device >= 0 && device < kMaxCachedDevices) cached[device] = f;
  *facts = f;
  return cudaSuccess;
}

// The current device's facts; an error from cudaGetDevice or the queries is returned as it is.
static cudaError_t current_device_facts(DeviceFacts* facts) {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  return err == cudaSuccess ? device_facts(device, facts) : err;
}

}  // namespace fused_gemm_bn
