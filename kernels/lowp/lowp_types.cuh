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

}  // namespace lowp
}  // namespace fused_gemm_bn
