"""Runs kernels/small_m_grad_w.cu (grad_W = a^T b at M <= 16 rows, float64 sums) on the
host, without a GPU, through tools/small_m_emulate.py's CUDA shim (each CTA's threads as
OS threads, CTAs one after another, mma.m8n8k4 .f64 emulated from its PTX fragment
layouts; the host takes dmma_f64.cuh's m8n8k4 form): a test of the kernel's fragment
indexing, n-step walk, one-step-ahead loads and edge guards, not of its speed.  Each
case fills the output with NaN, passes row strides wider than the rows, and checks
every element against a float64 sum of the exact products: within 0.5 ulp of the
float64 result plus M 2^-53 sum |a b| (the kernel's bound).  Shapes cover tails in n
(steps of 16) and k (warps of 32 columns, CTAs of 256), 1 and 16 rows, and both grid
plans (132 SMs: many CTAs, few steps each; 1 SM: one CTA a strip walking every step).
The launcher's refusals (M = 0, M = 17) are checked too.

    python3 tools/small_m_grad_w_emulate.py        (exit 0: every case within its bound)

The kernel source is used as it is, copied next to the shim so that its includes find the
shim's headers (dmma_f64.cuh patched as for small_m_emulate.py).
"""
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from tools.small_m_emulate import shim_files, write_files  # noqa: E402


DRIVER = r'''
#include "cuda_runtime.h"
inline void __stcs(float* p, float v) { *p = v; }
inline void __stcs(float4* p, float4 v) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) abort();  // (a misaligned vector store faults on a GPU)
  *p = v;
}
#include "small_m_grad_w_emulated.cu"
#include <cstdio>
#include <random>
int fused_gemm_bn::small_m_fp64_max_rows() { return 16; }
int main() {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  int fails = 0;
  const int shapes[][3] = {{9, 130, 257}, {16, 70, 300}, {1, 5, 7}, {3, 37, 529}, {16, 64, 256}, {2, 1, 1}, {13, 17, 33}};
  for (int sms : {132, 1}) {
    fused_gemm_bn::g_emu_num_sms = sms;
    for (const auto& s : shapes) {
      const int M = s[0], N = s[1], K = s[2], lda = N + 3, ldb = K + 1;
      std::vector<float> a(M * lda), b(M * ldb), out(N * K, NAN);
      for (auto& v : a) v = normal(rng);
      for (auto& v : b) v = 3 * normal(rng);
      if (fused_gemm_bn::small_m_grad_w(a.data(), lda, b.data(), ldb, M, N, K, out.data(), nullptr) != cudaSuccess) {
        printf("%dx%dx%d: launch refused\n", M, N, K);
        return 1;
      }
      double worst = 0;
      for (int n = 0; n < N; ++n)
        for (int k = 0; k < K; ++k) {
          double ref = 0, mag = 0;
          for (int m = 0; m < M; ++m) {
            const double t = static_cast<double>(a[m * lda + n]) * b[m * ldb + k];
            ref += t, mag += fabs(t);
          }
          const float near = fabsf(static_cast<float>(ref));
          const double bound = 0.5 * (static_cast<double>(nextafterf(near, INFINITY)) - near) +
                               M * ldexp(1.0, -53) * mag + 1e-45;
          const double err = fabs(static_cast<double>(out[n * K + k]) - ref);
          if (!(err <= bound) && fails++ < 5) printf("%dx%dx%d (n %d, k %d): %g, want %.17g\n", M, N, K, n, k,
                                                    out[n * K + k], ref);
          worst = err <= bound ? std::max(worst, err / bound) : INFINITY;  // (NaN: an element never written)
        }
      printf("%3d SMs  %2d x %3d x %3d: max error / bound %.3f\n", sms, M, N, K, worst);
    }
  }
  std::vector<float> x(17 * 8), o(64);
  const int refused_17 = fused_gemm_bn::small_m_grad_w(x.data(), 8, x.data(), 8, 17, 8, 8, o.data(), nullptr);
  const int refused_0 = fused_gemm_bn::small_m_grad_w(x.data(), 8, x.data(), 8, 0, 8, 8, o.data(), nullptr);
  printf("M = 17: %s, M = 0: %s\n", refused_17 == cudaErrorInvalidValue ? "refused" : "ACCEPTED",
         refused_0 == cudaErrorInvalidValue ? "refused" : "ACCEPTED");
  return fails || refused_17 != cudaErrorInvalidValue || refused_0 != cudaErrorInvalidValue ? 1 : 0;
}
'''


def kernel_source():
    """kernels/small_m_grad_w.cu's text (a test swaps it for its negative control)."""
    return open(os.path.join(REPO, "kernels", "small_m_grad_w.cu"), encoding="utf-8").read()


def main():
    cxx = os.environ.get("CXX", "g++")
    with tempfile.TemporaryDirectory() as tmp:
        write_files(tmp, {**shim_files(), "small_m_grad_w_emulated.cu": kernel_source(), "driver.cpp": DRIVER})
        exe = os.path.join(tmp, "small_m_grad_w_emulated")
        subprocess.run([cxx, "-std=c++20", "-O1", "-I", tmp, "-I", os.path.join(REPO, "kernels"),
                        os.path.join(tmp, "driver.cpp"), "-o", exe, "-lpthread"], check=True)
        return subprocess.run([exe]).returncode


if __name__ == "__main__":
    sys.exit(main())
