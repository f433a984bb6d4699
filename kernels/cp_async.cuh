// cp_async.cuh -- Ampere-style asynchronous global -> shared copies (sm_80+),
// shared by the kernels that stream their operands through a ring of
// shared-memory stages with them: sm80_gemm_3xtf32_bn.cuh, small_m_fp64.cu and
// lowp/sm80_gemm_bn_16bit.cu.
//
// cp_async<kBytes>(dst, src, valid): copies kBytes (16, 8 or 4) from global src to
//   shared dst; with valid == false nothing is read and dst is zero-filled
//   (src-size 0).  16-byte copies go through L2 only (.cg), smaller ones through
//   L1 as well (.ca: .cg takes only 16 bytes).  dst and src aligned to kBytes.
// cp_async_commit(): closes the group of this thread's copies issued since the last one.
// cp_async_wait<kPending>(): returns once at most kPending of this thread's
//   committed groups are still in flight.  Other threads' copies need a barrier
//   after the wait before they are read.
// Source: PTX ISA, "Data Movement and Conversion Instructions: cp.async",
// cp.async.commit_group, cp.async.wait_group.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace fused_gemm_bn {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

template <int kBytes>
__device__ __forceinline__ void cp_async(void* dst, const void* src, bool valid) {
  static_assert(kBytes == 16 || kBytes == 8 || kBytes == 4, "cp.async copies 4, 8 or 16 bytes");
  const int src_bytes = valid ? kBytes : 0;
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(src_bytes));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(smem_addr(dst)), "l"(src), "n"(kBytes),
                 "r"(src_bytes));
  }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

}  // namespace fused_gemm_bn
