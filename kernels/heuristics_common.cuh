// heuristics_common.cuh -- launch decisions that hold on every architecture:
// pure functions of the shape (and, where a rule needs them, the device facts
// passed in), each rule beside the measurement that set it.  The launchers
// query the device and call these; nothing here touches the CUDA runtime, so a
// plain C++ compiler builds this header too (tests/test_heuristics.py asserts
// the decisions on named cases through tests/heuristics_driver.cpp).
// heuristics_sm90.cuh and heuristics_sm80.cuh hold the GEMMs' grid plans.

#pragma once

#include <stdint.h>

namespace fused_gemm_bn {

// ---- bn_backward.cu: which kernel bn_backward_train runs ----------------------
// The resident-strip kernel holds a strip of g and z in registers between its
// two passes; its geometry (kResRowGroups x kResRows rows per CTA, bn_backward.cu,
// static_assert there) caps the batch at this many rows.
constexpr int kResidentStripMaxRows = 1024;

// Where the resident kernel is the faster one (H200, devrun A/B, outputs
// identical; docs/perf.md v39): from 768 rows at N = 8192 (640: a tie; 1024 x
// 8192 57.6 -> 47.7 us), from 256 rows where N <= 2048 (the two-pass kernel's
// N / 32 CTAs leave SMs idle: 1024 x 130 30.4 -> 10.4 us); below, the two-pass
// kernel's strips fit L2 and its 256-thread CTAs fill the GPU better (128 x
// 8192: 10.8 against 26.3 us).  Offsets are 32-bit: M N < 2^31.
inline bool resident_strip_pays(int M, int N) {
  if (M > kResidentStripMaxRows || static_cast<int64_t>(M) * N > INT32_MAX) return false;
  return M >= 768 || (N <= 2048 && M >= 256);
}

}  // namespace fused_gemm_bn
