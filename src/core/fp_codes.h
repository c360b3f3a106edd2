// The element and scale codes of MLX's fp quantization modes (mxfp4, mxfp8, nvfp4), identical on
// host and device. Exact formulas and MLX's rounding: docs/numerics.md "fp modes".
//   E2M1 (4-bit value): sign, 2 exponent bits (bias 1), 1 mantissa bit: 0, .5, 1, 1.5, 2, 3, 4, 6
//   E4M3 (8-bit value / nvfp4 scale): sign, 4 exponent bits (bias 7), 3 mantissa bits, max 448
//   E8M0 (mx scale): 2^(s - 127); s = 255 reads as +inf (MLX's CPU, not the OCP spec's NaN)
#pragma once
#include <cstdint>

#include "core/float16.h"

namespace expertqmm {

// E2M1 code (low 4 bits of `code`) to its value; code 8 is -0.
EXPERTQMM_HD float e2m1_value(uint32_t code) {
  const uint32_t e = (code >> 1) & 3u, m = code & 1u;
  const float mag = e == 0 ? 0.5f * static_cast<float>(m) : bits_to_float(((e + 126u) << 23) | (m << 22));
  return (code & 8u) ? -mag : mag;
}

// E4M3 code to its value: the 7 magnitude bits are an f16 bit pattern shifted by 7 (same mantissa
// width below, exponent bias 15 vs 7), times 2^8. 0x7F / 0xFF are NaN (as MLX 0.32.4 decodes them).
EXPERTQMM_HD float e4m3_value(uint8_t code) {
  if ((code & 127u) == 127u) return bits_to_float(0x7fc00000u);
  const float mag = f16_to_float(static_cast<uint16_t>((code & 127u) << 7)) * 256.0f;
  return (code & 128u) ? -mag : mag;
}

// float to E4M3 as MLX's ToFP8: round to nearest even; below 2^-6 through the subnormal grid (add
// 2^14 and keep the low bits); |f| >= 448 (and inf, NaN) gives 448 with f's sign, so a
// magnitude code 0x7F never comes out.
EXPERTQMM_HD uint8_t e4m3_code(float f) {
  uint32_t bits = float_to_bits(f);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  uint8_t result;
  if (bits >= (543u << 21)) {
    result = 0x7E;
  } else if (bits < (121u << 23)) {
    const uint32_t denorm = 141u << 23;
    result = static_cast<uint8_t>(float_to_bits(bits_to_float(bits) + bits_to_float(denorm)) - denorm);
  } else {
    const uint32_t mant_odd = (bits >> 20) & 1u;
    result = static_cast<uint8_t>((bits + ((7u - 127u) << 23) + 0x7FFFFu + mant_odd) >> 20);
  }
  return static_cast<uint8_t>(result | (sign >> 24));
}

// E8M0 scale code to 2^(s - 127) in fp32 (s = 0: 2^-127, a subnormal; s = 255: +inf).
EXPERTQMM_HD float e8m0_value(uint8_t s) {
  return s == 0 ? bits_to_float(0x00400000u) : bits_to_float(static_cast<uint32_t>(s) << 23);
}

}  // namespace expertqmm
