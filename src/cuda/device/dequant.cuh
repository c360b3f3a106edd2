// Element conversions and MLX affine dequantization helpers shared by the gather_qmm kernels.
// Codes are MLX's LSB-first bit stream: value i of a row sits at bits [i*bits, (i+1)*bits) of the
// row's little-endian uint32 words (spec 1.2).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace expertqmm::cuda::device {

// Exact float of an unsigned integer below 2^23 without I2F (a quarter-rate conversion on sm_90):
// 0x4B000000 | q is the float 2^23 + q, and subtracting 2^23 is exact.
__device__ __forceinline__ float small_uint_to_float(uint32_t q) {
  return __uint_as_float(0x4B000000u | q) - 8388608.0f;
}

// Activation element <-> float; raw 16-bit storage -> float for bf16/f16 scales and biases.
template <class T>
struct Elem;

template <>
struct Elem<__nv_bfloat16> {
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
struct Elem<__half> {
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
struct Elem<float> {
  static __device__ __forceinline__ float to_float(float v) { return v; }
  static __device__ __forceinline__ float from_float(float f) { return f; }
};

// Two codes with one scale and bias to a register of two T: T(float(s) * q + float(b)), fp32 math
// with a single fused rounding, then one rounding to T (MLX v0.32.1+ tile dequantization).
template <class T>
__device__ __forceinline__ uint32_t dequant_pair(uint32_t q_lo, uint32_t q_hi, float s, float b) {
  return Elem<T>::pack2(__fmaf_rn(s, small_uint_to_float(q_lo), b), __fmaf_rn(s, small_uint_to_float(q_hi), b));
}

// Code i of a packed row for any bits in 1..8 (3, 5 and 6-bit codes may straddle two words; the
// second word is read only then, so a row is never read past its end).
__device__ __forceinline__ uint32_t extract_code(const uint32_t* row, int64_t i, int bits) {
  const int64_t bit = i * bits;
  const int64_t word = bit >> 5;
  const int shift = static_cast<int>(bit & 31);
  uint32_t v = row[word] >> shift;
  if (shift + bits > 32) v |= row[word + 1] << (32 - shift);
  return v & ((1u << bits) - 1u);
}

// Element i of a scale/bias array stored in the activation dtype T, as float.
template <class T>
__device__ __forceinline__ float load_param(const void* base, int64_t i) {
  return Elem<T>::to_float(static_cast<const T*>(base)[i]);
}

}  // namespace expertqmm::cuda::device
