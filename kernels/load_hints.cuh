// load_hints.cuh -- global loads with an L2 eviction-priority hint.
//
// ld_evict_first_f4: a 16-byte global load whose L2 line is marked
// evict-first (createpolicy.fractional.L2::evict_first with fraction 1.0,
// then ld.global.L1::no_allocate.L2::cache_hint; PTX ISA "createpolicy" and
// "ld", sm_80+).  For data read once: it does not allocate in L1 and is the
// first to leave L2.  Values are unchanged; only caching differs.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace fused_gemm_bn {

__device__ __forceinline__ float4 ld_evict_first_f4(const float* q) {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  float4 v;
  asm volatile("ld.global.L1::no_allocate.L2::cache_hint.v4.f32 {%0, %1, %2, %3}, [%4], %5;"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "l"(q), "l"(policy));
  return v;
}

}  // namespace fused_gemm_bn
