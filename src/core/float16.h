// bf16 / fp16 <-> fp32 conversions, identical on host and device (round to nearest even, NaN kept
// quiet). Storage is uint16_t so that backend-neutral code needs no CUDA header.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define EXPERTQMM_HD __host__ __device__ __forceinline__
#else
#define EXPERTQMM_HD inline
#endif

namespace expertqmm {

EXPERTQMM_HD float bits_to_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
EXPERTQMM_HD uint32_t float_to_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

EXPERTQMM_HD float bf16_to_float(uint16_t b) { return bits_to_float(uint32_t(b) << 16); }

EXPERTQMM_HD uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

EXPERTQMM_HD float round_to_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

EXPERTQMM_HD float f16_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {
    if (man == 0) return bits_to_float(sign);
    // subnormal: man * 2^-24
    float v = float(man) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
}

EXPERTQMM_HD uint16_t float_to_f16(float f) {
  uint32_t u = float_to_bits(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);  // NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u); // rounds to >= 65520: inf
  if (a < 0x38800000u) {                                  // below 2^-14: subnormal or zero
    // value * 2^24 rounded to nearest even integer = subnormal mantissa
    float v = bits_to_float(a) * 16777216.0f;
    uint32_t m = uint32_t(v);
    float rem = v - float(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return uint16_t(sign | m);
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - (112u << 23);
  return uint16_t(sign | (r >> 13));
}

}  // namespace expertqmm
