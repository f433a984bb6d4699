"""Runs kernels/small_m_fp64.cu's launchers and kernels on the host, without a
GPU, through tools/small_m_check.cu's checks (-DSMALL_M_CHECK_EMULATE): a test
of the kernel's index arithmetic, DMMA fragment layouts (the mma.m8n8k4 form),
the cp.async ring (copies made synchronous), K-slice reduction, split K, the
BatchNorm epilogues (training and eval, both problems), problem 84's float64
softmax (block_reduce.cuh) and the step counter, not of its speed.

    python3 tools/small_m_emulate.py            # K split as on a 132-SM GPU
    python3 tools/small_m_emulate.py --sms 1    # K never split (in-kernel epilogue over many tiles)
    python3 tools/small_m_emulate.py --smem 166912   # an A100's shared memory: the 2-stage ring

How: a CUDA shim (headers written to a temporary folder, found before
kernels/) runs each CTA as one OS thread per CUDA thread (std::barrier for
__syncthreads), the CTAs of a launch one after another; mma.m8n8k4 .f64 is
emulated from the PTX ISA's fragment layouts (lane 4g+t holds A[g][t], B[t][g],
D[g][2t], D[g][2t+1]) with the lanes of a warp exchanging their operands, and so
are __shfl_xor_sync (float or double) and __any_sync.  The kernel source is used
as it is except its one device-only statement (the mma asm) and its extern shared
array, replaced textually here (the script fails if they change); launch_kernel is
the shim's.  A static __shared__ array (the softmax's block_reduce scratch) becomes
a function-local static (__shared__ is `static` here): one array for all threads
of the CTA running, as on the GPU, since CTAs run one at a time.
Exit status: the check's (0 pass, 1 fail).  Slow (minutes): keep the shapes small.
"""
import argparse
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL = os.path.join(REPO, "kernels", "small_m_fp64.cu")
CHECK = os.path.join(REPO, "tools", "small_m_check.cu")

SHIM = {
    "cuda_runtime.h": r'''#pragma once
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <algorithm>
#include <barrier>
#include <thread>
#include <vector>
typedef int cudaError_t;
constexpr cudaError_t cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorInvalidConfiguration = 9;
typedef void* cudaStream_t;
struct dim3 { unsigned x = 1, y = 1, z = 1; dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {} };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
struct double2 { double x, y; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// One CTA runs at a time (emu_launch): a function-local static is the running CTA's shared array.
#define __shared__ static
#define __align__(n) alignas(n)
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize };
template <class F> cudaError_t cudaFuncSetAttribute(F, cudaFuncAttribute, int) { return cudaSuccess; }
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaGetDevice(int* d) { *d = 0; return cudaSuccess; }
template <class T> T __ldg(const T* p) { return *p; }
inline uint32_t __float_as_uint(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
inline double __hiloint2double(int hi, int lo) {
  const uint64_t b = (uint64_t)(uint32_t)hi << 32 | (uint32_t)lo; double d; memcpy(&d, &b, 8); return d;
}
using std::max;
using std::min;
constexpr unsigned kEmuMaxWarps = 32;  // 1024 threads, CUDA's largest CTA
struct EmuBlock {
  std::barrier<>* block_bar;
  std::vector<std::barrier<>*> warp_bar;
  double a[kEmuMaxWarps][32], b[kEmuMaxWarps][32];
};
inline EmuBlock* g_block = nullptr;
inline void __syncthreads() { g_block->block_bar->arrive_and_wait(); }
// __shfl_xor_sync over the whole warp (the kernels call it with every lane), float or double.
template <class T> T __shfl_xor_sync(unsigned, T v, int mask) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  g_block->a[warp][lane] = v;
  g_block->warp_bar[warp]->arrive_and_wait();
  const T got = static_cast<T>(g_block->a[warp][lane ^ mask]);
  g_block->warp_bar[warp]->arrive_and_wait();
  return got;
}
// __any_sync over the whole warp (the kernel calls it with every lane).
inline bool __any_sync(unsigned, bool p) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  g_block->a[warp][lane] = p ? 1.0 : 0.0;
  g_block->warp_bar[warp]->arrive_and_wait();
  bool any = false;
  for (int l = 0; l < 32; ++l) any = any || g_block->a[warp][l] != 0.0;
  g_block->warp_bar[warp]->arrive_and_wait();
  return any;
}
// D = A B + D for m8n8k4 .f64 (PTX ISA fragments): lane 4g+t holds A[g][t], B[t][g], D[g][2t], D[g][2t+1].
inline void emu_dmma(double& d0, double& d1, double a, double b) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  g_block->a[warp][lane] = a;
  g_block->b[warp][lane] = b;
  g_block->warp_bar[warp]->arrive_and_wait();
  const int g = lane >> 2, t = lane & 3;
  for (int h = 0; h < 2; ++h) {
    double& d = h ? d1 : d0;
    for (int kk = 0; kk < 4; ++kk) d = fma(g_block->a[warp][4 * g + kk], g_block->b[warp][4 * (2 * t + h) + kk], d);
  }
  g_block->warp_bar[warp]->arrive_and_wait();
}
template <class... P, class... A>
cudaError_t emu_launch(void (*kernel)(P...), dim3 grid, dim3 block, A&&... args) {
  if ((block.x + 31) / 32 > kEmuMaxWarps) abort();
  gridDim = grid;
  blockDim = block;
  for (unsigned by = 0; by < grid.y; ++by)
    for (unsigned bx = 0; bx < grid.x; ++bx) {
      EmuBlock eb;
      std::barrier<> bb(block.x);
      eb.block_bar = &bb;
      for (unsigned w = 0; w < (block.x + 31) / 32; ++w) eb.warp_bar.push_back(new std::barrier<>(32));
      g_block = &eb;
      std::vector<std::thread> th;
      for (unsigned t = 0; t < block.x; ++t)
        th.emplace_back([&, t] { threadIdx = dim3(t); blockIdx = dim3(bx, by); kernel(args...); });
      for (auto& x : th) x.join();
      for (auto* p : eb.warp_bar) delete p;
    }
  return cudaSuccess;
}
''',
    "cuda_runtime_api.h": '#pragma once\n#include "cuda_runtime.h"\n',
    "cp_async.cuh": r'''#pragma once
#include "cuda_runtime.h"
namespace fused_gemm_bn {
// Synchronous: the copy is done when cp_async returns (the kernel's barriers still order it).
template <int kBytes> inline void cp_async(void* dst, const void* src, bool valid) {
  if (valid) memcpy(dst, src, kBytes); else memset(dst, 0, kBytes);
}
inline void cp_async_commit() {}
template <int kPending> inline void cp_async_wait() {}
}
''',
    "pdl.cuh": r'''#pragma once
#include "device_facts.cuh"
namespace fused_gemm_bn {
inline void pdl_wait_then_release() {}
template <typename... Params, typename... Args>
static cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t, cudaStream_t,
                                 Args&&... args) {
  return emu_launch(kernel, grid, block, args...);
}
}
''',
    "device_facts.cuh": r'''#pragma once
#include "cuda_runtime.h"
namespace fused_gemm_bn {
constexpr int kMaxCachedDevices = 64;
inline int g_emu_num_sms = 132, g_emu_smem_optin = 232448;
struct DeviceFacts { int num_sms = 0, smem_optin = 0, cc_major = 0; };
static cudaError_t current_device_facts(DeviceFacts* f) {
  f->num_sms = g_emu_num_sms, f->smem_optin = g_emu_smem_optin, f->cc_major = 9;
  return cudaSuccess;
}
}
''',
}


def patched_kernel_source():
    """small_m_fp64.cu with the mma asm and the extern shared array replaced by the
    shim's emu_dmma and a static array (every kernel launches through launch_kernel,
    which the shim's pdl.cuh runs with emu_launch)."""
    s = open(KERNEL, encoding="utf-8").read()
    a = s.index('  asm("mma.sync')
    b = s.index(";", s.index('"d"(a), "d"(b))')) + 1
    s = s[:a] + "  emu_dmma(d0, d1, a, b);" + s[b:]
    decl = "extern __shared__ __align__(16) unsigned char small_m_smem[];"
    assert s.count(decl) == 1, "the shared array's declaration changed"
    s = s.replace(decl, "")
    anchor = "namespace fused_gemm_bn {\n\nconstexpr int kSmallMMaxRows"
    assert anchor in s, "the namespace opening changed"
    return s.replace(anchor, "namespace fused_gemm_bn {\nalignas(16) inline unsigned char small_m_smem[1 << 18];\n\n"
                     "constexpr int kSmallMMaxRows", 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sms", type=int, default=132, help="SM count the launchers plan with (1: no K split)")
    parser.add_argument("--smem", type=int, default=232448, help="opt-in shared memory per block the launchers see (bytes)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cxx", default=os.environ.get("CXX", "g++"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in SHIM.items():
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                f.write(text)
        with open(os.path.join(tmp, "small_m_fp64_emulated.cpp"), "w", encoding="utf-8") as f:
            f.write(patched_kernel_source())
        exe = os.path.join(tmp, "small_m_emulated")
        cmd = [args.cxx, "-std=c++20", "-O1", "-I", tmp, "-I", os.path.join(REPO, "kernels"),
               "-DSMALL_M_CHECK_HOST_ONLY", "-DSMALL_M_CHECK_EMULATE", "-x", "c++", CHECK, "-o", exe, "-lpthread"]
        subprocess.run(cmd, check=True)
        return subprocess.run([exe, str(args.seed), str(args.sms), str(args.smem)]).returncode


if __name__ == "__main__":
    sys.exit(main())
