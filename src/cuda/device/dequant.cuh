// Element conversions and MLX affine dequantization helpers shared by the gather_qmm kernels.
// Codes are MLX's LSB-first bit stream: value i of a row sits at bits [i*bits, (i+1)*bits) of the
// row's little-endian uint32 words (spec 1.2).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "core/fp_codes.h"
#include "cuda/device/elem.cuh"

namespace expertqmm::cuda::device {

// Exact float of an unsigned integer below 2^23 without I2F (a quarter-rate conversion on sm_90):
// 0x4B000000 | q is the float 2^23 + q, and subtracting 2^23 is exact.
__device__ __forceinline__ float small_uint_to_float(uint32_t q) {
  return __uint_as_float(0x4B000000u | q) - 8388608.0f;
}

// The GEMV inner product (qmv, the decode layer): sum_i x[i] * q[i] over the values of one word of codes (8 for 4-bit, 4 for 8-bit), x given as
// those values. 4-bit: x arrives pre-divided by 16^(i % 4) and each nibble is read masked in place
// inside its 16-bit half (MLX's qdot trick), so one LOP3 gives the code times 16^(i % 4) as an
// exact float. 8-bit: byte_perm moves each byte under the float exponent 2^23. Both are exact;
// only the fp32 sums round.
template <int kBits>
__device__ __forceinline__ float word_dot(uint32_t w, const float* xv, float dot) {
  if constexpr (kBits == 4) {
    const uint32_t hi = w >> 16;
#pragma unroll
    for (int j = 0; j < 4; ++j) dot += xv[j] * small_uint_to_float(w & (0xFu << (4 * j)));
#pragma unroll
    for (int j = 0; j < 4; ++j) dot += xv[4 + j] * small_uint_to_float(hi & (0xFu << (4 * j)));
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) dot += xv[j] * (__uint_as_float(__byte_perm(w, 0x4B000000u, 0x7540u | j)) - 8388608.0f);
  }
  return dot;
}

// The x values of word wi of a chunk of codes (8 floats for 4-bit, 4 for 8-bit) from a row staged
// as floats in shared memory (16-byte aligned words), in word_dot's order.
template <int kBits>
__device__ __forceinline__ void word_x(const float* xc, int wi, float (&xv)[32 / kBits]) {
  constexpr int kPerWord = 32 / kBits;
#pragma unroll
  for (int q = 0; q < kPerWord / 4; ++q) {
    const float4 f = reinterpret_cast<const float4*>(xc + wi * kPerWord)[q];
    xv[4 * q] = f.x;
    xv[4 * q + 1] = f.y;
    xv[4 * q + 2] = f.z;
    xv[4 * q + 3] = f.w;
  }
}

// Elem<T> (element conversions by CUDA type): device/elem.cuh.

// Two codes with one scale and bias to a register of two T: T(float(s) * q + float(b)), fp32 math
// with a single fused rounding, then one rounding to T (MLX v0.32.1+ tile dequantization).
template <class T>
__device__ __forceinline__ uint32_t dequant_pair(uint32_t q_lo, uint32_t q_hi, float s, float b) {
  return Elem<T>::pack2(__fmaf_rn(s, small_uint_to_float(q_lo), b), __fmaf_rn(s, small_uint_to_float(q_hi), b));
}

// d = (a & b) | c in one LOP3 (the compiler does not always fuse the AND/OR pair itself).
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));  // 0xEA = (A & B) | C
  return d;
}

// The raw 16-bit value in the low (high == false) or high half of `word`, copied to both halves:
// a scale or bias ready for a packed fma.
__device__ __forceinline__ uint32_t broadcast_half(uint32_t word, bool high) {
  return __byte_perm(word, 0u, high ? 0x3232u : 0x1010u);
}

// Packed dequantization for the tensor-core B fragment: one register of two T, the low half the
// lower k, computed as fma(q, s, b) in T arithmetic on both halves at once (s2, b2: the column's
// scale and bias in both halves, see broadcast_half). The integer code is turned into an exact T
// with a magic exponent: (code | M) is the T value M + code while the code fits the mantissa at
// ulp 1, and subtracting M is exact. The packed fma rounds once (s*q + b exact, then rounded to T)
// where MLX's tile loader rounds twice (fp32 fma, then T): results differ by one ulp of T in the
// rare cases where the double rounding goes the other way.
//
// 4-bit: lane t of a quad owns byte t of a word, k = 2t (low nibble) and 2t+1 (high nibble).
// 8-bit: lane t owns the 16-bit half t % 2 of its word, k = 2t' and 2t'+1 (bytes 2(t%2), +1).
template <class T>
struct PackedDequant;

template <>
struct PackedDequant<__nv_bfloat16> {
  // __byte_perm selector: byte t of `word` into byte 0, byte t of `word >> 4` into byte 2.
  static __device__ __forceinline__ uint32_t nibble_selector(int t) { return 0x4400u + 0x1111u * t; }
  static __device__ __forceinline__ uint32_t nibbles(uint32_t word, uint32_t selector, uint32_t s2, uint32_t b2) {
    // bf16 keeps 7 mantissa bits, so the high nibble must move to bits 16-19 (it cannot sit at
    // bits 20-23, whose top bit is the exponent's lowest): byte t of word >> 4 puts it there.
    const uint32_t y = __byte_perm(word, word >> 4, selector);
    const uint32_t magic = and_or(y, 0x000F000Fu, 0x43004300u);  // {128 + lo, 128 + hi}, exact
    const __nv_bfloat162 q = __hsub2(as_pair(magic), as_pair(0x43004300u));
    return as_bits(__hfma2(q, as_pair(s2), as_pair(b2)));
  }
  // __byte_perm selectors building the floats 2^23 + code for bytes 2(t%2) and 2(t%2)+1 (the
  // second operand supplies 0x4B and zeros): bf16 holds 0..255 exactly but no single bf16 magic
  // spans 256 codes at ulp 1, so the codes go through fp32 and one packing conversion.
  static __device__ __forceinline__ uint32_t byte_selector(int t) { return 0x4550u | (2u * (t & 1)); }
  static __device__ __forceinline__ uint32_t bytes(uint32_t word, uint32_t selector, uint32_t s2, uint32_t b2) {
    const float lo = __uint_as_float(__byte_perm(word, 0x4Bu, selector)) - 8388608.0f;
    const float hi = __uint_as_float(__byte_perm(word, 0x4Bu, selector + 1u)) - 8388608.0f;
    const __nv_bfloat162 q = __floats2bfloat162_rn(lo, hi);  // exact: integers below 256
    return as_bits(__hfma2(q, as_pair(s2), as_pair(b2)));
  }

 private:
  static __device__ __forceinline__ __nv_bfloat162 as_pair(uint32_t bits) {
    return *reinterpret_cast<const __nv_bfloat162*>(&bits);
  }
  static __device__ __forceinline__ uint32_t as_bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }
};

template <>
struct PackedDequant<__half> {
  // __byte_perm selector: byte t of `word` into bytes 0 and 2, zeros in bytes 1 and 3.
  static __device__ __forceinline__ uint32_t nibble_selector(int t) { return 0x4040u + 0x0101u * t; }
  static __device__ __forceinline__ uint32_t nibbles(uint32_t word, uint32_t selector, uint32_t s2, uint32_t b2) {
    // f16 has 10 mantissa bits: the high nibble may stay at bits 4-7 of its half, giving
    // 1024 + 16 * hi, and one packed fma with {1, 1/16} and {-1024, -64} yields {lo, hi} exactly.
    const uint32_t y = __byte_perm(word, 0u, selector);
    const uint32_t magic = and_or(y, 0x00F0000Fu, 0x64006400u);  // {1024 + lo, 1024 + 16 hi}
    const __half2 q = __hfma2(as_pair(magic), as_pair(0x2C003C00u), as_pair(0xD400E400u));
    return as_bits(__hfma2(q, as_pair(s2), as_pair(b2)));
  }
  // __byte_perm selector: bytes 2(t%2) and 2(t%2)+1 of `word` into bytes 0 and 2, 0x64 (the
  // second operand's byte 4) into bytes 1 and 3: {1024 + c0, 1024 + c1}, exact up to 1023.
  static __device__ __forceinline__ uint32_t byte_selector(int t) { return 0x4140u + 0x0202u * (t & 1); }
  static __device__ __forceinline__ uint32_t bytes(uint32_t word, uint32_t selector, uint32_t s2, uint32_t b2) {
    const uint32_t magic = __byte_perm(word, 0x64u, selector);
    const __half2 q = __hsub2(as_pair(magic), as_pair(0x64006400u));
    return as_bits(__hfma2(q, as_pair(s2), as_pair(b2)));
  }

 private:
  static __device__ __forceinline__ __half2 as_pair(uint32_t bits) { return *reinterpret_cast<const __half2*>(&bits); }
  static __device__ __forceinline__ uint32_t as_bits(__half2 v) { return *reinterpret_cast<uint32_t*>(&v); }
};

// The fp modes' B fragment for bf16 (tile_gemm's kFp): one register of two bf16 weights, the low
// half the lower k, each the exact E2M1 / E4M3 value times the group's decoded scale. A code's
// magnitude bits go under the bf16 exponent's lowest bits (E2M1: 3 bits at bits 6-8, giving
// 2^-126 * value; E4M3: 7 bits at bits 4-10, 2^-120 * value; the zero-exponent codes land on bf16
// subnormals, which the bf16 multiply keeps) and one exact multiply by 2^126 / 2^120 restores the
// value. Times the scale (a power of two for E8M0, an E4M3 value for nvfp4) the product has at most
// 4 significant bits, so it is exact, as the CPU's fp32 value * scale, unless it leaves bf16's (=
// fp32's) normal range. Lane roles as PackedDequant<bf16>: nibble_selector / byte_selector below.
struct FpDequantBf16 {
  static __device__ __forceinline__ uint32_t nibble_selector(int t) { return PackedDequant<__nv_bfloat16>::nibble_selector(t); }
  // byte t%2's pair of codes into bytes 0 and 2, zeros in bytes 1 and 3.
  static __device__ __forceinline__ uint32_t byte_selector(int t) { return 0x4140u + 0x0202u * (t & 1); }
  static __device__ __forceinline__ uint32_t e2m1(uint32_t word, uint32_t selector, uint32_t scale2) {
    return e2m1_pair(__byte_perm(word, word >> 4, selector), scale2);
  }
  // The E2M1 codes at bits 0-3 (low half) and 16-19 (high half) of y, other bits ignored, times
  // scale2 (the decode kernels' A pairs: y = word >> 4j holds codes j and j + 4).
  static __device__ __forceinline__ uint32_t e2m1_pair(uint32_t y, uint32_t scale2) {
    const uint32_t bits = and_or(y << 12, 0x80008000u, (y << 6) & 0x01C001C0u);  // sign | magnitude
    return mul(mul(bits, 0x7E807E80u), scale2);  // * 2^126, * scale
  }
  static __device__ __forceinline__ uint32_t e4m3(uint32_t word, uint32_t selector, uint32_t scale2) {
    const uint32_t y = __byte_perm(word, 0u, selector);  // codes at bits 0-7 and 16-23
    const uint32_t magnitude = y & 0x007F007Fu;
    const uint32_t bits = and_or(y << 8, 0x80008000u, magnitude << 4);
    const uint32_t nan = __vcmpeq2(magnitude, 0x007F007Fu);  // 0x7F / 0xFF: NaN (0xFFFF), as MLX decodes
    return mul(mul(bits, 0x7B807B80u), scale2) | nan;       // * 2^120, * scale
  }
  // A group's scale code as a bf16 pair: E8M0 2^(s-127) is the bf16 with exponent field s (s = 0:
  // the subnormal 2^-127; s = 255: inf, as core/fp_codes.h); an E4M3 code through its fp32 value
  // (3 mantissa bits: exact in bf16).
  static __device__ __forceinline__ uint32_t scale_pair(uint32_t code, bool e4m3_scale) {
    uint32_t bits;
    if (e4m3_scale) {
      const uint32_t magnitude = code & 0x7Fu;
      const float v = magnitude == 0x7Fu ? __uint_as_float(0x7fc00000u) : __uint_as_float(magnitude << 20) * 0x1p120f;
      bits = (__float_as_uint(v) >> 16) | ((code & 0x80u) << 8);  // exact: the low 16 bits are zero
    } else {
      bits = code == 0 ? 0x0040u : code << 7;
    }
    return bits | (bits << 16);
  }

 private:
  static __device__ __forceinline__ uint32_t mul(uint32_t a, uint32_t b) {
    const __nv_bfloat162 p = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a), *reinterpret_cast<const __nv_bfloat162*>(&b));
    return *reinterpret_cast<const uint32_t*>(&p);
  }
};

// The bias M of biased_code_pairs: the T value whose ulp is 1 (bf16 128, f16 1024).
template <class T>
constexpr float kCodeBias = std::is_same<T, __nv_bfloat16>::value ? 128.0f : 1024.0f;

// The eight 4-bit codes of a word as exact T values M + q (M = kCodeBias<T>) in four registers of
// two: pair j holds code j (low half) and code j + 4 (high half), j = 0..3, i.e. (word >> 4j) &
// 0x000F000F put under M's exponent. One shift and one LOP3 per pair; the caller removes M * sum(x)
// once per group instead of subtracting M from every code (tensor-core dot products whose k order
// is free: the decode kernels).
template <class T>
__device__ __forceinline__ void biased_code_pairs(uint32_t word, uint32_t (&pair)[4]) {
  constexpr uint32_t kMagic = std::is_same<T, __nv_bfloat16>::value ? 0x43004300u : 0x64006400u;
#pragma unroll
  for (int j = 0; j < 4; ++j) pair[j] = and_or(word >> (4 * j), 0x000F000Fu, kMagic);
}

// A pair of biased_code_pairs as two T weights: M subtracted (exact), then one packed fma with the
// row's scale and bias in both halves (s2, b2: broadcast_half), as PackedDequant<T>::nibbles computes
// them: the same bits for the same codes.
template <class T>
__device__ __forceinline__ uint32_t dequant_biased_pair(uint32_t pair, uint32_t s2, uint32_t b2) {
  using T2 = std::conditional_t<std::is_same<T, __nv_bfloat16>::value, __nv_bfloat162, __half2>;
  constexpr uint32_t kMagic = std::is_same<T, __nv_bfloat16>::value ? 0x43004300u : 0x64006400u;
  const uint32_t magic = kMagic;
  const T2 q = __hsub2(*reinterpret_cast<const T2*>(&pair), *reinterpret_cast<const T2*>(&magic));
  const T2 w = __hfma2(q, *reinterpret_cast<const T2*>(&s2), *reinterpret_cast<const T2*>(&b2));
  return *reinterpret_cast<const uint32_t*>(&w);
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

// Weight i of a packed fp-mode row (QuantMode mode: 1 mxfp4, 2 mxfp8, 3 nvfp4) whose group scale
// code is `scale_code`, in fp32: the E2M1 / E4M3 value times the decoded E8M0 / E4M3 scale (exact
// in fp32; core/fp_codes.h, as the CPU reference).
__device__ __forceinline__ float fp_weight(int mode, const uint32_t* row, int64_t i, uint8_t scale_code) {
  const float scale = mode == 3 ? e4m3_value(scale_code) : e8m0_value(scale_code);
  if (mode == 2) return e4m3_value(static_cast<uint8_t>(row[i >> 2] >> ((i & 3) * 8))) * scale;
  return e2m1_value(row[i >> 3] >> ((i & 7) * 4)) * scale;
}

// fp-mode GEMV inner product over one word of codes (8 E2M1 or 4 E4M3 values), x given as those
// values. Decoding by bit placement: the 3 magnitude bits of an E2M1 code as a float's lowest
// exponent bits and top mantissa bit give 2^-126 * its value (a subnormal for 0 and 0.5), the 7 of
// an E4M3 code 2^-120 * its value; one exact multiply by 2^126 / 2^120 restores it (denormals are
// not flushed: no fast math). E4M3 0x7F / 0xFF read as NaN, as fp_weight and the CPU.
template <int kBits>
__device__ __forceinline__ float fp_word_dot(uint32_t w, const float* xv, float dot) {
  if constexpr (kBits == 4) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t c = (w >> (4 * j)) & 0xFu;
      const float v = __uint_as_float(((c & 8u) << 28) | ((c & 7u) << 22)) * 0x1p126f;
      dot = fmaf(xv[j], v, dot);
    }
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t c = (w >> (8 * j)) & 0xFFu;
      const float v = (c & 0x7Fu) == 0x7Fu ? __uint_as_float(0x7fc00000u)
                                          : __uint_as_float(((c & 0x80u) << 24) | ((c & 0x7Fu) << 20)) * 0x1p120f;
      dot = fmaf(xv[j], v, dot);
    }
  }
  return dot;
}

}  // namespace expertqmm::cuda::device
