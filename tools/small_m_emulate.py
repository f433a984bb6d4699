"""Runs kernels/small_m_fp64.cu's launchers and kernels on the host, without a
GPU, through tools/small_m_check.cu's checks (-DSMALL_M_CHECK_EMULATE): a test
of the kernel's index arithmetic, DMMA fragment layouts (the mma.m8n8k4 form),
the cp.async ring (copies made synchronous), the Hopper TMA ring (its mbarriers
emulated: arrival counts, byte counts and phases, waits that block; each tensor
copy made at once with its zero fill, then counted on its barrier; --no-tma runs
the cp.async ring on its rows instead), K-slice reduction, split K, the
BatchNorm epilogues (training and eval, both problems), problem 84's float64
softmax (block_reduce.cuh) and the step counter, not of its speed.

    python3 tools/small_m_emulate.py            # K split as on a 132-SM GPU
    python3 tools/small_m_emulate.py --sms 1    # K never split (in-kernel epilogue over many tiles)
    python3 tools/small_m_emulate.py --smem 166912   # an A100's shared memory: the 2-stage ring
    python3 tools/small_m_emulate.py --no-tma        # the cp.async ring where Hopper takes the TMA ring
    python3 tools/small_m_emulate.py --sms 1 --negative-control   # tensor copies without their zero
        # fill (K tails read stale columns): must exit 1, the check seeing the wrong sums

How: a CUDA shim (headers written to a temporary folder, found before
kernels/) runs each CTA as one OS thread per CUDA thread (std::barrier for
__syncthreads), the CTAs of a launch one after another; mma.m8n8k4 .f64 is
emulated from the PTX ISA's fragment layouts (lane 4g+t holds A[g][t], B[t][g],
D[g][2t], D[g][2t+1]) with the lanes of a warp exchanging their operands, and so
are __shfl_xor_sync (float or double), __any_sync and __syncwarp.  The kernel
source is used as it is except dmma_f64.cuh's one device-only statement (the mma
asm) and the kernel's extern shared arrays, replaced textually here (the script fails if they change);
launch_kernel, tensor_map.cuh and sm90_primitives.cuh's mbarrier and tensor-copy
wrappers are the shim's (cudaFuncGetAttributes reports the sm_90a image:
binaryVersion 90, or 80 with --no-tma).  A static __shared__ array (the softmax's block_reduce scratch) becomes
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
DMMA_HEADER = os.path.join(REPO, "kernels", "dmma_f64.cuh")
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
inline double2 make_double2(double a, double b) { return {a, b}; }
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
// One CTA runs at a time (emu_launch): a function-local static is the running CTA's shared array.
#define __shared__ static
#define __align__(n) alignas(n)
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize };
template <class F> cudaError_t cudaFuncSetAttribute(F, cudaFuncAttribute, int) { return cudaSuccess; }
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaGetDevice(int* d) { *d = 0; return cudaSuccess; }
template <class T> T __ldg(const T* p) { return *p; }
template <class T> T __ldcg(const T* p) { return *p; }
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
inline void __syncwarp() { g_block->warp_bar[threadIdx.x >> 5]->arrive_and_wait(); }
struct cudaFuncAttributes { int binaryVersion = 0, ptxVersion = 0; };
inline int g_emu_binary_version = 90;  // 90: the sm_90a image (the TMA ring); 80: none
template <class F> cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* a, F) {
  a->binaryVersion = a->ptxVersion = g_emu_binary_version;
  return cudaSuccess;
}
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
    # CTAs run one after another here, so a grid-wide barrier cannot be emulated: the shim's
    # cooperative launch is refused (launch_kernel_cooperative), and the launchers take the
    # kernels one after another, as on a GPU where the grid does not fit at once.
    "cooperative_groups.h": r'''#pragma once
#include <stdlib.h>
namespace cooperative_groups {
struct grid_group { void sync() const { abort(); } };
inline grid_group this_grid() { return {}; }
}
''',
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
template <typename... Params, typename... Args>
static cudaError_t launch_kernel_cooperative(void (*)(Params...), dim3, dim3, size_t, cudaStream_t, Args&&...) {
  return 720;  // cudaErrorCooperativeLaunchTooLarge: see cooperative_groups.h
}
}
''',
    "device_facts.cuh": r'''#pragma once
#include "cuda_runtime.h"
namespace fused_gemm_bn {
constexpr int kMaxCachedDevices = 64;
inline int g_emu_num_sms = 132, g_emu_smem_optin = 232448;
struct DeviceFacts { int num_sms = 0, smem_optin = 0, cc_major = 0, cc_minor = 0; };
static cudaError_t current_device_facts(DeviceFacts* f) {
  f->num_sms = g_emu_num_sms, f->smem_optin = g_emu_smem_optin, f->cc_major = 9, f->cc_minor = 0;
  return cudaSuccess;
}
}
''',
    "tensor_map.cuh": r"""#pragma once
// A tensor map holds what the emulated copy needs: the matrix, its row stride and the box.
#include "cuda_runtime.h"
struct CUtensorMap { const float* ptr; int rows, cols; int64_t row_stride; int box_cols, box_rows; };
namespace fused_gemm_bn {
namespace sm90 {
inline void* encode_tiled_fn() {  // the driver's encoder is there
  static int present;
  return &present;
}
static bool make_tensor_map_f32_rows(CUtensorMap* map, const float* ptr, int rows, int cols, int64_t row_stride,
                                     int box_cols, int box_rows) {
  if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0 || row_stride % 4 != 0 || box_cols % 4 != 0 || box_cols > 256 ||
      box_rows > 256)
    return false;  // the driver's rules
  *map = CUtensorMap{ptr, rows, cols, row_stride, box_cols, box_rows};
  return true;
}
}  // namespace sm90
}  // namespace fused_gemm_bn
""",
    "sm90_primitives.cuh": r"""#pragma once
// mbarriers (PTX ISA 9.7.12.15) and the 2-D tensor copy for the emulated CTA's OS
// threads: a barrier's pending arrivals and transaction bytes; its phase completes
// (the parity flips, waiters wake) when both reach 0, and the arrival count is re-armed.
// A copy is made at once (elements outside the matrix zero-filled), then counted.
#include <condition_variable>
#include <map>
#include <mutex>
#include "cuda_runtime.h"
#include "tensor_map.cuh"
#define FUSED_GEMM_BN_SM90A 1
namespace fused_gemm_bn {
namespace sm90 {
struct EmuMbar { int expected = 0, pending = 0; long long tx = 0; uint32_t phase = 0; };
inline std::mutex g_mbar_mutex;
inline std::condition_variable g_mbar_cv;
inline std::map<const void*, EmuMbar> g_mbars;
inline void emu_mbar_update(EmuMbar& b, int arrivals, long long tx) {  // under g_mbar_mutex
  b.pending -= arrivals, b.tx += tx;
  if (b.pending < 0) abort();  // more arrivals than the barrier's count in one phase
  if (b.pending == 0 && b.tx == 0) {
    b.phase ^= 1u, b.pending = b.expected;
    g_mbar_cv.notify_all();
  }
}
inline void mbar_init(uint64_t* bar, uint32_t count) {
  std::lock_guard<std::mutex> lk(g_mbar_mutex);
  g_mbars[bar] = EmuMbar{static_cast<int>(count), static_cast<int>(count), 0, 0u};
}
inline void mbar_init_fence() {}
inline void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  std::lock_guard<std::mutex> lk(g_mbar_mutex);
  emu_mbar_update(g_mbars.at(bar), 1, bytes);
}
inline void mbar_arrive(uint64_t* bar) {
  std::lock_guard<std::mutex> lk(g_mbar_mutex);
  emu_mbar_update(g_mbars.at(bar), 1, 0);
}
// Returns once the phase of this parity has completed (the current phase's parity differs).
inline void mbar_wait(uint64_t* bar, uint32_t parity) {
  std::unique_lock<std::mutex> lk(g_mbar_mutex);
  g_mbar_cv.wait(lk, [&] { return g_mbars.at(bar).phase != (parity & 1u); });
}
inline void tma_prefetch_descriptor(const void*) {}
// The box at (column c0, row c1), stored densely (box_cols floats a row).
inline void tma_load_2d(void* dst, const void* tmap, uint64_t* bar, int c0, int c1) {
  const CUtensorMap& m = *static_cast<const CUtensorMap*>(tmap);
  if (reinterpret_cast<uintptr_t>(dst) % 128 != 0) abort();  // a tensor copy's shared-memory alignment
  float* out = static_cast<float*>(dst);
  for (int r = 0; r < m.box_rows; ++r)
    for (int k = 0; k < m.box_cols; ++k) {
      const int row = c1 + r, col = c0 + k;
#ifdef SMALL_M_EMULATE_NEGATIVE_CONTROL  // no zero fill: the tails read what the stage held before
      if (row < m.rows && col < m.cols) out[r * m.box_cols + k] = m.ptr[static_cast<size_t>(row) * m.row_stride + col];
#else
      out[r * m.box_cols + k] = row < m.rows && col < m.cols ? m.ptr[static_cast<size_t>(row) * m.row_stride + col] : 0.f;
#endif
    }
  std::lock_guard<std::mutex> lk(g_mbar_mutex);
  emu_mbar_update(g_mbars.at(bar), 0, -4LL * m.box_rows * m.box_cols);
}
}  // namespace sm90
}  // namespace fused_gemm_bn
""",
}


def write_files(folder, files):
    """Writes {name: text} into folder (the shim's headers, a patched kernel, a driver)."""
    for name, text in files.items():
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            f.write(text)


def patched_dmma_header():
    """kernels/dmma_f64.cuh with its one device-only statement, the mma.m8n8k4 asm, replaced
    by the shim's emu_dmma (the host takes the header's m8n8k4 form: no __CUDA_ARCH__).
    Written into the shim's folder, which the include path searches before kernels/."""
    s = open(DMMA_HEADER, encoding="utf-8").read()
    a = s.index('  asm("mma.sync.aligned.m8n8k4')
    b = s.index(";", s.index('"d"(a), "d"(b))')) + 1
    return s[:a] + "  emu_dmma(d0, d1, a, b);" + s[b:]


def shim_files():
    """{name: text} of the shim's headers, the patched dmma_f64.cuh among them."""
    return {**SHIM, "dmma_f64.cuh": patched_dmma_header()}


def patched_kernel_source():
    """small_m_fp64.cu with its extern shared array replaced by a static array (every
    kernel launches through launch_kernel, which the shim's pdl.cuh runs with emu_launch)."""
    s = open(KERNEL, encoding="utf-8").read()
    decl = "extern __shared__ __align__(128) unsigned char small_m_smem[];"
    assert s.count(decl) == 2, "the shared arrays' declarations changed (one per ring kernel)"
    s = s.replace(decl, "")
    anchor = "namespace fused_gemm_bn {\n\nconstexpr int kSmallMMaxRows"
    assert anchor in s, "the namespace opening changed"
    return s.replace(anchor, "namespace fused_gemm_bn {\nalignas(128) inline unsigned char small_m_smem[1 << 18];\n\n"
                     "constexpr int kSmallMMaxRows", 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sms", type=int, default=132, help="SM count the launchers plan with (1: no K split)")
    parser.add_argument("--smem", type=int, default=232448, help="opt-in shared memory per block the launchers see (bytes)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-tma", action="store_true", help="no sm_90a image: the cp.async ring on Hopper too")
    parser.add_argument("--negative-control", action="store_true",
                        help="the TMA ring's copies skip their zero fill: the check must fail (exit 1)")
    parser.add_argument("--cxx", default=os.environ.get("CXX", "g++"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        write_files(tmp, {**shim_files(), "small_m_fp64_emulated.cpp": patched_kernel_source()})
        exe = os.path.join(tmp, "small_m_emulated")
        cmd = [args.cxx, "-std=c++20", "-O1", "-I", tmp, "-I", os.path.join(REPO, "kernels"),
               "-DSMALL_M_CHECK_HOST_ONLY", "-DSMALL_M_CHECK_EMULATE", "-x", "c++", CHECK, "-o", exe, "-lpthread"]
        if args.negative_control:
            cmd.insert(1, "-DSMALL_M_EMULATE_NEGATIVE_CONTROL")
        subprocess.run(cmd, check=True)
        return subprocess.run([exe, str(args.seed), str(args.sms), str(args.smem),
                               "80" if args.no_tma else "90"]).returncode


if __name__ == "__main__":
    sys.exit(main())
