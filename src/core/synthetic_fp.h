// Synthetic weights in MLX's fp modes, shared by the checkpoint writer and the CLI's presets: the
// caller fills the codes with random words (any nibble is an E2M1 value), this drops the E4M3 NaN
// codes (0x7F / 0xFF) from mxfp8 words and draws the uint8 scales, so that the weights come out
// about 0.01 to 0.05 in magnitude: E8M0 2^-8 or 2^-7 (mxfp4: values up to 6), 2^-14 or 2^-13
// (mxfp8: up to 448), nvfp4 E4M3 codes 0x08..0x0F (2^-6 to 1.875 * 2^-6).
#pragma once
#include <cstdint>
#include <cstring>

#include "expertqmm/quant.h"

namespace expertqmm::detail {

inline void finish_synthetic_fp(QuantMode mode, uint32_t* words, int64_t n_words, uint8_t* scales, int64_t n_scales,
                                uint64_t seed) {
  if (mode == QuantMode::mxfp8)
    for (int64_t i = 0; i < n_words; ++i) {
      uint8_t b[4];
      std::memcpy(b, &words[i], 4);
      for (uint8_t& x : b)
        if ((x & 0x7F) == 0x7F) x &= 0xFE;
      std::memcpy(&words[i], b, 4);
    }
  const int base = mode == QuantMode::mxfp4 ? 127 - 8 : (mode == QuantMode::mxfp8 ? 127 - 14 : 0x08);
  const uint64_t spread = mode == QuantMode::nvfp4 ? 8 : 2;
  uint64_t state = seed ^ 0x5bf03635f0b4f3a1ull;
  for (int64_t i = 0; i < n_scales; ++i) {  // splitmix64
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    scales[i] = static_cast<uint8_t>(base + static_cast<int>((z ^ (z >> 31)) % spread));
  }
}

}  // namespace expertqmm::detail
