// sm90_primitives.cuh -- thin PTX wrappers for the Hopper kernels
// (sm90_gemm_fp16x3_bn.cu; lowp/sm90_wgmma_16bit.cuh, lowp/sm90_gemm_bn_16bit.cu;
// small_m_fp64.cu's TMA ring): mbarriers, TMA tile loads and stores (and the
// staged-store round both GEMMs' epilogues run), named barriers and the GPU-scope
// atomic of the split-tile hand-off, wgmma shared-memory descriptors and the fp16
// wgmma form the fp16x3 GEMM issues (A from registers).
//
// Every wrapper compiles to nothing unless the pass targets sm_90a
// (__CUDA_ARCH_FEAT_SM90_ALL; FUSED_GEMM_BN_SM90A_ASM): wgmma and setmaxnreg
// exist only there.  The kernel that uses them traps on any other target, so a
// build without an sm_90a image can never return unwritten output silently.
//
// Sources: PTX ISA 8.x, sections 9.7.12.15 (mbarrier), 9.7.9.25.5
// (cp.async.bulk.tensor), 9.7.15 (wgmma: 9.7.15.5.1 matrix descriptor,
// 9.7.15.5.2 register fragments, 9.7.15.6 wgmma.fence / commit_group /
// wait_group), 9.7.19.5 (setmaxnreg); the atom and bar.sync instruction
// pages and chapter 8 (memory consistency model) for the split-tile hand-off.

#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FUSED_GEMM_BN_SM90A 1
#else
#define FUSED_GEMM_BN_SM90A 0
#endif

// The wrappers' one statement: asm volatile(...) in an sm_90a pass, nothing
// elsewhere (its operands are then not evaluated either).
#if FUSED_GEMM_BN_SM90A
#define FUSED_GEMM_BN_SM90A_ASM(...) asm volatile(__VA_ARGS__)
#else
#define FUSED_GEMM_BN_SM90A_ASM(...) static_cast<void>(0)
#endif

namespace fused_gemm_bn {
namespace sm90 {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarrier -------------------------------------------------------------

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  FUSED_GEMM_BN_SM90A_ASM("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

// Makes the initialised barriers visible to the async (TMA) proxy and the cluster.
__device__ __forceinline__ void mbar_init_fence() {
  FUSED_GEMM_BN_SM90A_ASM("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  FUSED_GEMM_BN_SM90A_ASM("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  FUSED_GEMM_BN_SM90A_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
                          : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  FUSED_GEMM_BN_SM90A_ASM("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

// Blocks until the phase with the given parity has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  FUSED_GEMM_BN_SM90A_ASM(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

// ---- TMA ------------------------------------------------------------------

__device__ __forceinline__ void tma_prefetch_descriptor(const void* tmap) {
  FUSED_GEMM_BN_SM90A_ASM("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(tmap)) : "memory");
}

// Loads the box at (inner = c0, outer = c1) of a 2-D tensor map into shared
// memory; completion is counted in bytes on `bar`.  Out-of-bounds elements are
// zero-filled and still counted.
__device__ __forceinline__ void tma_load_2d(void* dst, const void* tmap, uint64_t* bar, int c0, int c1) {
  FUSED_GEMM_BN_SM90A_ASM(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}

// ---- shared-memory loads and stores ---------------------------------------

// Two float32 words at a shared-memory address (8-byte aligned).
__device__ __forceinline__ float2 ld_shared_f32x2(uint32_t addr) {
  float2 v = make_float2(0.f, 0.f);
  FUSED_GEMM_BN_SM90A_ASM("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
  return v;
}

// One float32 word to a shared-memory address.
__device__ __forceinline__ void st_shared_f32(uint32_t addr, float v) {
  FUSED_GEMM_BN_SM90A_ASM("st.shared.f32 [%0], %1;\n" ::"r"(addr), "f"(v) : "memory");
}

// ---- registers per warpgroup role ----------------------------------------

template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  FUSED_GEMM_BN_SM90A_ASM("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  FUSED_GEMM_BN_SM90A_ASM("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// ---- CTA and grid synchronisation (split-tile hand-off) ------------------

// Barrier over the first `kThreads` threads of the CTA (the consumer
// warpgroups) on hardware barrier `kId`; id 0 is __syncthreads'.
template <uint32_t kId, uint32_t kThreads>
__device__ __forceinline__ void named_barrier_sync() {
  FUSED_GEMM_BN_SM90A_ASM("bar.sync %0, %1;\n" ::"n"(kId), "n"(kThreads) : "memory");
}

// The same on hardware barrier `id`, a register operand (warp-uniform).
template <uint32_t kThreads>
__device__ __forceinline__ void named_barrier_sync(uint32_t id) {
  FUSED_GEMM_BN_SM90A_ASM("bar.sync %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}

// Atomic add at GPU scope with acquire-release semantics (PTX ISA: atom;
// memory consistency model): the caller's earlier writes (and, after a
// CTA barrier, its CTA's) are visible to whoever observes the new value, and
// the writes that the previous adders released are visible to the caller.
__device__ __forceinline__ int atomic_add_acq_rel_gpu(int* p, int v) {
  int old = 0;
  FUSED_GEMM_BN_SM90A_ASM("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// ---- ldmatrix -------------------------------------------------------------

// Four 8 x 8 matrices of 16-bit words from shared memory (PTX ISA 9.7.9.23
// ldmatrix): lanes 8 i .. 8 i + 7 give the row addresses of matrix i, and
// r[i] of lane 4 g + t holds that matrix's row g, words 2 t and 2 t + 1.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_addr) {
  FUSED_GEMM_BN_SM90A_ASM("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                          : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                          : "r"(smem_addr));
}

// The same four matrices transposed (ldmatrix .trans): r[i] of lane 4 g + t
// holds words g of rows 2 t and 2 t + 1 of matrix i (row 2 t in the low half).
// From a tile stored k-row by k-row (MN-major), this is the K-major fragment.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t smem_addr) {
  FUSED_GEMM_BN_SM90A_ASM("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                          : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                          : "r"(smem_addr));
}

// Four 8 x 8 matrices of 16-bit words to shared memory, transposed
// (stmatrix .trans, PTX ISA 9.7.9.24): r[i] of lane 4 g + t holds words 2 t and
// 2 t + 1 of row g of matrix i (the lower one in the low half); lanes 8 i ..
// 8 i + 7 give the addresses of matrix i's stored rows (16 bytes each), row j
// of the stored matrix being column j of the held one.
__device__ __forceinline__ void stmatrix_x4_trans(const uint32_t (&r)[4], uint32_t smem_addr) {
  FUSED_GEMM_BN_SM90A_ASM("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr),
                          "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                          : "memory");
}

// ---- TMA stores (PTX ISA 9.7.9.25.5 cp.async.bulk.tensor, 9.7.9.25.4 bulk groups) ----

// Orders this thread's generic-proxy shared-memory writes before later async-proxy
// (TMA) reads of them (with a barrier, the CTA's writes before one thread's store).
__device__ __forceinline__ void fence_proxy_async_shared() {
  FUSED_GEMM_BN_SM90A_ASM("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Stores the box at (inner = c0, outer = c1) of a 2-D tensor map from shared
// memory; elements outside the tensor are not written.  Completes in the bulk group.
__device__ __forceinline__ void tma_store_2d(const void* tmap, const void* src, int c0, int c1) {
  FUSED_GEMM_BN_SM90A_ASM("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
                              reinterpret_cast<uint64_t>(tmap)),
                          "r"(smem_u32(src)), "r"(c0), "r"(c1)
                          : "memory");
  FUSED_GEMM_BN_SM90A_ASM("cp.async.bulk.commit_group;\n" ::: "memory");
}

// Waits until at most the kPending most recent of this thread's committed TMA stores have
// yet to read their shared memory (every older one has; 0: all have).
template <int kPending>
__device__ __forceinline__ void tma_store_wait_read() {
  FUSED_GEMM_BN_SM90A_ASM("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}

// One round of a warpgroup's staged TMA store (both sm_90a GEMMs' epilogues:
// store_tile_staged, lowp's store_tile_tma): the elected thread waits until at most
// kPendingStores of its stores have yet to read shared memory (the buffer about to be
// written is free), the warpgroup meets at hardware barrier `barrier_id` (a register
// from a warp-uniform warpgroup index: an immediate chosen by a branch cost fp16x3's
// mainloop its uniform datapath, docs/perf.md v112), every thread runs write() into
// the buffer, fences its writes for the async proxy and meets the warpgroup again, and
// the elected thread runs store() (the TMA stores of the buffer).  v115 measured one
// barrier a round (the wait moved before the second) slower past one k-block a tile.
template <int kPendingStores, typename Write, typename Store>
__device__ __forceinline__ void staged_store_round(bool elected, uint32_t barrier_id, Write&& write, Store&& store) {
  if (elected) tma_store_wait_read<kPendingStores>();
  named_barrier_sync<128>(barrier_id);
  write();
  fence_proxy_async_shared();
  named_barrier_sync<128>(barrier_id);
  if (elected) store();
}

// ---- wgmma ----------------------------------------------------------------

// Shared-memory matrix descriptor (PTX ISA 9.7.15.5.1) for a K-major tile
// written by TMA with CU_TENSOR_MAP_SWIZZLE_128B: rows of 128 bytes (32 fp32),
// 16-byte chunks XOR-swizzled by (row % 8), 8-row atoms of 1024 bytes.  The
// tile must start on a 1024-byte boundary (base offset 0); a k-step inside
// the 128-byte row is selected by adding its byte offset to the start address.
__device__ __forceinline__ uint64_t desc_kmajor_sw128(const void* tile, uint32_t byte_offset) {
  const uint32_t addr = smem_u32(tile) + byte_offset;
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);  // start address
  desc |= static_cast<uint64_t>(1) << 16;                 // leading byte offset (unused when swizzled K-major)
  desc |= static_cast<uint64_t>(1024 >> 4) << 32;         // stride byte offset: next 8-row atom
  desc |= static_cast<uint64_t>(1) << 62;                 // swizzle mode: 128B
  return desc;
}

// Descriptor for an MN-major tile of 16-bit words written by TMA with
// CU_TENSOR_MAP_SWIZZLE_128B: one 128-byte row (64 MN elements) per k, 16-byte
// chunks XOR-swizzled by (k % 8), 8-k atoms of 1024 bytes (the stride byte
// offset); MN blocks of 64 elements `mn_block_bytes` apart (the leading byte
// offset; read only by wgmmas wider than 64 in MN).  The canonical MN-major
// SWIZZLE_128B layout of PTX ISA 9.7.15.5.1, in CuTe's notation
// ((8, n), (8, k)) : ((1, LBO), (8, SBO)) in 16-byte units.  A k-step of 16
// starts two atoms (2048 bytes) further on.
__device__ __forceinline__ uint64_t desc_mnmajor_sw128(const void* tile, uint32_t byte_offset,
                                                       uint32_t mn_block_bytes) {
  const uint32_t addr = smem_u32(tile) + byte_offset;
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);             // start address
  desc |= static_cast<uint64_t>((mn_block_bytes >> 4) & 0x3FFF) << 16;  // leading byte offset: next 64 MN
  desc |= static_cast<uint64_t>(1024 >> 4) << 32;                    // stride byte offset: next 8 k
  desc |= static_cast<uint64_t>(1) << 62;                            // swizzle mode: 128B
  return desc;
}

__device__ __forceinline__ void wgmma_fence() {
  FUSED_GEMM_BN_SM90A_ASM("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  FUSED_GEMM_BN_SM90A_ASM("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  FUSED_GEMM_BN_SM90A_ASM("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Tells the compiler a register is read and written here, so it neither moves
// accesses of wgmma accumulators / A fragments across the wgmma wait nor reuses
// their registers while an asynchronous wgmma may still read them.
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void fence_operand(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }

#define FUSED_GEMM_BN_D64 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define FUSED_GEMM_BN_D64_LIST \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// D(64 x 128, fp32) (+)= A(64 x 16, registers) * B(16 x 128, shared memory), fp16
// inputs (exact products, fp32 accumulation; the tensor core's accumulation
// chain is not round-to-nearest, so callers promote partial sums).  B is
// K-major (kTransB false: imm-trans-b 0, desc_kmajor_sw128) or N-major
// (kTransB true: imm-trans-b 1, desc_mnmajor_sw128, its two 64-column blocks
// the descriptor's leading byte offset apart).  A fragment (PTX ISA
// 9.7.15.5.2, .f16): warp w of the warpgroup holds rows 16 w .. 16 w + 15;
// lane l = 4 g + t holds, as fp16 pairs (lower k in the low half),
// a0 = (16 w + g, 2 t .. 2 t + 1), a1 = (16 w + g + 8, 2 t ..),
// a2 = (16 w + g, 2 t + 8 ..), a3 = (16 w + g + 8, 2 t + 8 ..).  The A
// registers must stay unchanged until the wgmma has completed.  D register
// 4 i + 2 h + e (i = 0 .. 15) holds row 16 w + g + 8 h, column 8 i + 2 t + e
// (the m64nNk16 D fragment).
template <bool kTransB = false>
__device__ __forceinline__ void wgmma_m64n128k16_f16_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b,
                                                        bool accumulate) {
  FUSED_GEMM_BN_SM90A_ASM(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " FUSED_GEMM_BN_D64_LIST
      ", {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n"
      "}\n"
      : FUSED_GEMM_BN_D64
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<uint32_t>(accumulate)),
        "n"(kTransB ? 1 : 0));
}

#undef FUSED_GEMM_BN_D64
#undef FUSED_GEMM_BN_D64_LIST

}  // namespace sm90
}  // namespace fused_gemm_bn
