// The one element trait of the CUDA backend: per activation dtype, its storage, its CUDA type and
// every conversion the kernels use. Host and device conversions of storage values go through
// core/float16.h, so the device rounds exactly as the CPU backend does (round to nearest even);
// the CUDA-type conversions are the intrinsics the GEMM kernels use. device::Elem<T> is the same
// trait keyed by the CUDA type (the GEMM kernels are templated on __nv_bfloat16 / __half).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "core/float16.h"
#include "expertqmm/dtype.h"

namespace expertqmm::cuda {

template <DType D>
struct Elem;

template <>
struct Elem<DType::bf16> {
  using storage = uint16_t;
  using cuda_type = __nv_bfloat16;
  static __host__ __device__ __forceinline__ float load(storage v) { return bf16_to_float(v); }
  static __host__ __device__ __forceinline__ storage store(float f) { return float_to_bf16(f); }
  static __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float f) { return __float2bfloat16_rn(f); }
  static __device__ __forceinline__ float raw_to_float(uint32_t bits16) { return __uint_as_float(bits16 << 16); }
  // Two floats to one register of two values, `lo` in the low half (one rounding each).
  static __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

template <>
struct Elem<DType::f16> {
  using storage = uint16_t;
  using cuda_type = __half;
  static __host__ __device__ __forceinline__ float load(storage v) { return f16_to_float(v); }
  static __host__ __device__ __forceinline__ storage store(float f) { return float_to_f16(f); }
  static __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half from_float(float f) { return __float2half_rn(f); }
  static __device__ __forceinline__ float raw_to_float(uint32_t bits16) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits16)));
  }
  static __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

template <>
struct Elem<DType::f32> {
  using storage = float;
  using cuda_type = float;
  static __host__ __device__ __forceinline__ float load(storage v) { return v; }
  static __host__ __device__ __forceinline__ storage store(float f) { return f; }
  static __device__ __forceinline__ float to_float(float v) { return v; }
  static __device__ __forceinline__ float from_float(float f) { return f; }
};

// Rounds an fp32 value to the precision of D and back (identity for f32).
template <DType D>
__host__ __device__ __forceinline__ float round_to(float f) {
  return Elem<D>::load(Elem<D>::store(f));
}

// Element i of a float array of any float dtype, in two halves for a run of loads that should all
// be in flight before the first use (a conversion right after each load in a dtype switch makes
// every load wait for the one before): the element's bits (zero-extended for 16-bit dtypes), then
// their value.
__device__ __forceinline__ uint32_t load_raw_any(const void* p, DType dtype, int64_t i) {
  return dtype == DType::bf16 || dtype == DType::f16 ? static_cast<const uint16_t*>(p)[i]
                                                      : static_cast<const uint32_t*>(p)[i];
}
__device__ __forceinline__ float raw_any_to_float(uint32_t bits, DType dtype) {
  switch (dtype) {
    case DType::bf16: return bf16_to_float(static_cast<uint16_t>(bits));
    case DType::f16: return f16_to_float(static_cast<uint16_t>(bits));
    default: return __uint_as_float(bits);
  }
}

// Element i of a float array of any float dtype, as float (a dtype known only at run time).
__device__ __forceinline__ float load_any(const void* p, DType dtype, int64_t i) {
  return raw_any_to_float(load_raw_any(p, dtype, i), dtype);
}

// Elements per 16-byte vector.
template <DType D>
constexpr int kVec16 = 16 / static_cast<int>(sizeof(typename Elem<D>::storage));

// The dtype of a CUDA element type.
template <class T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return DType::bf16;
  else if constexpr (std::is_same_v<T, __half>) return DType::f16;
  else {
    static_assert(std::is_same_v<T, float>, "an element type of the CUDA kernels: __nv_bfloat16, __half or float");
    return DType::f32;
  }
}

namespace device {
template <class T>
using Elem = cuda::Elem<dtype_of<T>()>;
}  // namespace device

}  // namespace expertqmm::cuda
