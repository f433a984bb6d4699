// lowp_types.cuh -- the 16-bit element types of kernels/lowp/ and the
// conversions every 16-bit kernel uses.  Device helpers, and the launchers'
// host-side dispatch on the dtype code (dispatch_dtype).
//
// Element types: __half (IEEE binary16) and __nv_bfloat16 (bfloat16), both
// 2 bytes; the tensors around the GEMM are either of that type or float32
// (Storage: a float32 module under torch.autocast).  The host launchers take
// untyped pointers and a Dtype code (the torch binding maps the tensor's dtype
// to it) and instantiate each kernel for both types (dispatch_dtype); loads and
// stores move raw 16-bit patterns (uint16_t).
//
// Numerics: all arithmetic is float32; a value becomes 16-bit only through
// from_float (round to nearest, ties to even: __float2half_rn /
// __float2bfloat16_rn, as PyTorch's float -> Half / BFloat16 conversions on
// CUDA).  round16(v) is the value a 16-bit tensor holding v would give back.
// Each kernel header lists where it rounds, i.e. where PyTorch's eager ops do.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

namespace fused_gemm_bn {
namespace lowp {

// The element type of a call, as the binding passes it.
enum class Dtype : int { kF16 = 0, kBF16 = 1 };

// An element type as a value: what dispatch_dtype hands its callable.
template <typename T>
struct DtypeTag {
  using type = T;
};

// Host side, the launchers' one dispatch on the call's dtype code:
// f(DtypeTag<__half>{}) or f(DtypeTag<__nv_bfloat16>{}), whose result it returns
// (f instantiates the kernels for that type); cudaErrorInvalidValue for any
// other code.
template <class F>
cudaError_t dispatch_dtype(int dtype, F&& f) {
  switch (static_cast<Dtype>(dtype)) {
    case Dtype::kF16:
      return f(DtypeTag<__half>{});
    case Dtype::kBF16:
      return f(DtypeTag<__nv_bfloat16>{});
  }
  return cudaErrorInvalidValue;
}

template <typename T>
struct Bits;
template <>
struct Bits<__half> {
  static __device__ __forceinline__ float to_float(uint16_t b) { return __half2float(__ushort_as_half(b)); }
  static __device__ __forceinline__ uint16_t from_float(float v) { return __half_as_ushort(__float2half_rn(v)); }
};
template <>
struct Bits<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(uint16_t b) { return __bfloat162float(__ushort_as_bfloat16(b)); }
  static __device__ __forceinline__ uint16_t from_float(float v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
};

// A 16-bit pattern of type T as float32 (exact).
template <typename T>
__device__ __forceinline__ float load_float(const uint16_t* p) {
  return Bits<T>::to_float(*p);
}

// v rounded to T, as its 16-bit pattern.
template <typename T>
__device__ __forceinline__ uint16_t to_bits(float v) {
  return Bits<T>::from_float(v);
}

// v rounded to T and converted back (exact): the value a T tensor holding v gives.
template <typename T>
__device__ __forceinline__ float round16(float v) {
  return Bits<T>::to_float(Bits<T>::from_float(v));
}

// The storage of the tensors beside the GEMM operands (bias, scale, BatchNorm's
// parameters and running statistics, the output), S: a 16-bit module's (S = T:
// 16-bit patterns of T) or a float32 module's under torch.autocast (S = float:
// float32 words, which store() does not round).  Storage<S>::round(v) is the
// value a tensor of S holding v gives back.
template <typename S>
struct Storage {
  using word = uint16_t;
  static __device__ __forceinline__ float load(const word* p) { return Bits<S>::to_float(*p); }
  static __device__ __forceinline__ void store(word* p, float v) { *p = Bits<S>::from_float(v); }
  static __device__ __forceinline__ float round(float v) { return Bits<S>::to_float(Bits<S>::from_float(v)); }
};
template <>
struct Storage<float> {
  using word = float;
  static __device__ __forceinline__ float load(const word* p) { return *p; }
  static __device__ __forceinline__ void store(word* p, float v) { *p = v; }
  static __device__ __forceinline__ float round(float v) { return v; }
};
template <typename S>
using word_t = typename Storage<S>::word;

// Two patterns packed into 32 bits, the lower address in the low half.
__device__ __forceinline__ uint32_t pack2(uint16_t lo, uint16_t hi) {
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

// lo and hi rounded to T (to nearest, ties to even: one cvt.rn.f16x2.f32 /
// cvt.rn.bf16x2.f32, the values to_bits gives) and packed as pack2 packs them.
template <typename T>
__device__ __forceinline__ uint32_t pack2_rn(float lo, float hi) {
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// Arithmetic on two T values packed as pack2 packs them, on sm_80+ only (callers
// compile it under __CUDA_ARCH__ >= 800):
//   mul2_rn: each product rounded once to T, to nearest even (fma.rn.{f16,bf16}x2
//     with -0 added: a * b + (-0) is a * b, its sign kept; PTX ISA "Half Precision
//     Floating-Point Instructions: fma").  The product of two T values is exact in
//     float32 (22 or 16 significand bits) unless it falls below float32's normal
//     range, so this is to_bits(float(a) * float(b)) there: to nearest even, once.
//   max2: the larger of each pair (max.{f16,bf16}x2): a NaN gives the other value,
//     as fmaxf does; +0 ranks above -0.
template <typename T>
__device__ __forceinline__ uint32_t mul2_rn(uint32_t a, uint32_t b) {
  uint32_t d;
  if constexpr (std::is_same_v<T, __half>) {
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  } else {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  }
  return d;
}
template <typename T>
__device__ __forceinline__ uint32_t max2(uint32_t a, uint32_t b) {
  uint32_t d;
  if constexpr (std::is_same_v<T, __half>) {
    asm("max.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  } else {
    asm("max.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  }
  return d;
}

// Eight consecutive S values as loaded: one 16-byte word for 16-bit S, two for float.
// Memory-bound kernels hold their loads in this form (4 or 8 registers, not 8 floats)
// until they use them, so that more rows fit in flight per thread.
template <typename S>
struct Group8 {
  uint4 w[sizeof(word_t<S>) / 2];
};

// The group at p (16-byte aligned).
template <typename S>
__device__ __forceinline__ Group8<S> load_group8(const word_t<S>* p) {
  Group8<S> g;
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(word_t<S>) / 2); ++i) g.w[i] = reinterpret_cast<const uint4*>(p)[i];
  return g;
}

// The group's values as floats (exact).
template <typename S>
__device__ __forceinline__ void unpack8(const Group8<S>& g, float (&v)[8]) {
  if constexpr (sizeof(word_t<S>) == 2) {
    const uint32_t w[4] = {g.w[0].x, g.w[0].y, g.w[0].z, g.w[0].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = Bits<S>::to_float(static_cast<uint16_t>(w[i] & 0xffffu));
      v[2 * i + 1] = Bits<S>::to_float(static_cast<uint16_t>(w[i] >> 16));
    }
  } else {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      v[4 * i] = __uint_as_float(g.w[i].x), v[4 * i + 1] = __uint_as_float(g.w[i].y);
      v[4 * i + 2] = __uint_as_float(g.w[i].z), v[4 * i + 3] = __uint_as_float(g.w[i].w);
    }
  }
}

// Eight consecutive S values at p (16-byte aligned) as floats, and back (store_group
// rounds to S, to nearest even): one 16-byte access for 16-bit S, two for float.
template <typename S>
__device__ __forceinline__ void load_group(const word_t<S>* p, float (&v)[8]) {
  unpack8<S>(load_group8<S>(p), v);
}
template <typename S>
__device__ __forceinline__ void store_group(word_t<S>* p, const float (&v)[8]) {
  if constexpr (sizeof(word_t<S>) == 2) {
    *reinterpret_cast<uint4*>(p) =
        make_uint4(pack2(to_bits<S>(v[0]), to_bits<S>(v[1])), pack2(to_bits<S>(v[2]), to_bits<S>(v[3])),
                   pack2(to_bits<S>(v[4]), to_bits<S>(v[5])), pack2(to_bits<S>(v[6]), to_bits<S>(v[7])));
  } else {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
}

// kV (8 or 1) consecutive S values at p as floats, and back (store_values rounds to
// S, to nearest even): kV = 8 is one group (load_group / store_group: p 16-byte
// aligned), kV = 1 one element.
template <typename S, int kV>
__device__ __forceinline__ void load_values(const word_t<S>* p, float (&v)[kV]) {
  static_assert(kV == 8 || kV == 1, "kV: 8 (a 16-byte group of 16-bit S) or 1");
  if constexpr (kV == 8) {
    load_group<S>(p, v);
  } else {
    v[0] = Storage<S>::load(p);
  }
}
template <typename S, int kV>
__device__ __forceinline__ void store_values(word_t<S>* p, const float (&v)[kV]) {
  static_assert(kV == 8 || kV == 1, "kV: 8 (a 16-byte group of 16-bit S) or 1");
  if constexpr (kV == 8) {
    store_group<S>(p, v);
  } else {
    Storage<S>::store(p, v[0]);
  }
}

}  // namespace lowp
}  // namespace fused_gemm_bn
