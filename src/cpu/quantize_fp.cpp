// CPU reference of MLX's fp quantization modes, bit for bit with MLX 0.32's CPU stream, which runs
// quantize / dequantize as a graph of ordinary ops (mlx/ops.cpp fp_quantize / fp_dequantize
// fallbacks): every op computes in fp32 and rounds to its output dtype, and that dtype follows
// MLX's promotion (T = the weight's dtype; a float32 operand promotes to float32). Those roundings
// are reproduced one by one below. Formulas: docs/numerics.md "fp modes".
//
// Layout as affine: codes LSB first in uint32 words (E2M1: 8 per word, E4M3: 4 per word), one
// uint8 scale per group (mxfp4/mxfp8: E8M0, 32 values; nvfp4: E4M3, 16 values); no biases.
#include "cpu/quantize_fp.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "core/fp_codes.h"
#include "cpu/elements.h"
#include "expertqmm/error.h"

namespace expertqmm::cpu {

namespace {

// MLX's E2M1 table order: code c has value e2m1_value(c).
constexpr int kE2m1Codes = 16;

// argmin over c of |T(x - v_c)| with MLX's argmin: the first strictly smaller distance wins, so a
// tie goes to the lower code (the smaller magnitude, +0 before -0) and all-NaN distances give 0.
// `t` is the dtype MLX subtracts in (the weight's for mxfp4, float32 for nvfp4).
uint32_t nearest_e2m1(float x, DType t) {
  uint32_t best = 0;
  float best_d = std::fabs(round_as(x - e2m1_value(0), t));
  for (uint32_t c = 1; c < kE2m1Codes; ++c) {
    const float d = std::fabs(round_as(x - e2m1_value(c), t));
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  return best;
}

void put_code(uint32_t* row, int64_t i, int bits, uint32_t code) {
  const int64_t bit = i * bits;
  row[bit >> 5] |= code << (bit & 31);
}

uint32_t get_code(const uint32_t* row, int64_t i, int bits) {
  const int64_t bit = i * bits;
  return (row[bit >> 5] >> (bit & 31)) & ((1u << bits) - 1u);
}

// ceil(log2(s)) for a finite s > 0, exactly (frexp: s = m 2^p, m in [0.5, 1)).
int ceil_log2(float s) {
  int p;
  const float m = std::frexp(s, &p);
  return m == 0.5f ? p - 1 : p;
}

// mxfp4 / mxfp8 group (MLX 0.32.4, measured: the goldens' log2 edge rows): scale = T(amax /
// maxval) (maxval 6 or 448); e = ceil(log2 scale), 0 for a zero scale, clamped to [-127, 127]; the
// values are T(w / 2^e); the code byte is e + 127. ceil, not round: no value exceeds maxval.
uint8_t quantize_mx_group(const float* v, int gs, DType t, int bits, uint32_t* row, int64_t first) {
  float amax = 0;
  for (int j = 0; j < gs; ++j) amax = std::fmax(amax, std::fabs(v[j]));
  const float scale = round_as(amax / (bits == 4 ? 6.0f : 448.0f), t);
  int e = scale == 0 ? 0 : ceil_log2(scale);
  e = e < -127 ? -127 : (e > 127 ? 127 : e);
  const float pow2 = std::ldexp(1.0f, e);
  for (int j = 0; j < gs; ++j) {
    const float x = round_as(v[j] / pow2, t);
    put_code(row, first + j, bits, bits == 4 ? nearest_e2m1(x, t) : e4m3_code(x));
  }
  return static_cast<uint8_t>(e + 127);
}

// nvfp4 group (MLX: scale = T(amax / 6) * enc in float32, enc = 2688 / global (1 without one);
// the E4M3 code of that; w / T(scale decoded) in T, times enc in float32; nearest E2M1 in float32).
uint8_t quantize_nv_group(const float* v, int gs, DType t, float enc, uint32_t* row, int64_t first) {
  float amax = 0;
  for (int j = 0; j < gs; ++j) amax = std::fmax(amax, std::fabs(v[j]));
  const float scale = round_as(amax / 6.0f, t) * enc;
  const uint8_t code = e4m3_code(scale);
  const float decoded = round_as(e4m3_value(code), t);
  for (int j = 0; j < gs; ++j) {
    const float x = round_as(v[j] / decoded, t) * enc;
    put_code(row, first + j, 4, nearest_e2m1(x, DType::f32));
  }
  return code;
}

float global_scale_value(const Tensor& g) {
  const Tensor c = g.contiguous();
  float v;
  std::memcpy(&v, c.to_host_bytes().data(), 4);
  return v;
}

}  // namespace

QuantizedWeight quantize_fp(const Tensor& w_in, const QuantSpec& spec) {
  const Tensor w = w_in.contiguous();
  const DType t = w.dtype();
  const int bits = spec.bits, gs = spec.group_size;
  const int64_t K = w.size(-1);
  const int64_t rows = K == 0 ? 0 : w.numel() / K;
  const int64_t row_words = K * bits / 32, groups = K / gs;
  // 448 * 6 / global, in float32 (MLX: divide(array(2688.f), global_scale)).
  const float enc = spec.global_scale.defined() ? 2688.0f / global_scale_value(spec.global_scale) : 1.0f;

  QuantizedWeight q;
  q.bits = bits;
  q.group_size = gs;
  q.mode = spec.mode;
  q.global_scale = spec.global_scale;
  Shape wq_shape = w.shape(), s_shape = w.shape();
  wq_shape.back() = row_words;
  s_shape.back() = groups;
  q.w = Tensor::empty(wq_shape, DType::u32, Device::cpu);
  q.scales = Tensor::empty(s_shape, DType::u8, Device::cpu);
  if (q.w.nbytes()) std::memset(q.w.data(), 0, q.w.nbytes());
  std::vector<float> group(gs);
  uint8_t* scales = q.scales.data_as<uint8_t>();
  for (int64_t r = 0; r < rows; ++r) {
    uint32_t* row = q.w.data_as<uint32_t>() + r * row_words;
    for (int64_t g = 0; g < groups; ++g) {
      for (int j = 0; j < gs; ++j) group[j] = load_float("quantize", w.data(), t, r * K + g * gs + j);
      scales[r * groups + g] = spec.mode == QuantMode::nvfp4
                                   ? quantize_nv_group(group.data(), gs, t, enc, row, g * gs)
                                   : quantize_mx_group(group.data(), gs, t, bits, row, g * gs);
    }
  }
  return q;
}

// MLX: values from the table (E2M1) or from_fp8 in T (exact); mx scales T(2^(T(s) - 127)) in T;
// nvfp4 scales E4M3 decoded in T (times global / 2688 in float32 when given); one product rounded
// to the product's dtype.
Tensor dequantize_fp(const QuantizedWeight& q, DType dtype) {
  const Tensor w = q.w.contiguous(), scales = q.scales.contiguous();
  const bool global = q.global_scale.defined();
  const DType out_t = global ? DType::f32 : dtype;
  const float inv_enc = global ? global_scale_value(q.global_scale) / 2688.0f : 1.0f;
  const int64_t row_words = w.size(-1);
  const int64_t K = row_words * 32 / q.bits;
  const int64_t rows = row_words == 0 ? 0 : w.numel() / row_words;
  const int64_t groups = K / q.group_size;

  Shape out_shape = w.shape();
  out_shape.back() = K;
  Tensor out = Tensor::empty(out_shape, out_t, Device::cpu);
  const uint8_t* s = scales.data_as<const uint8_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const uint32_t* row = w.data_as<const uint32_t>() + r * row_words;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t code = s[r * groups + g];
      const float scale = q.mode == QuantMode::nvfp4
                              ? round_as(round_as(e4m3_value(code), dtype) * inv_enc, out_t)
                              : round_as(std::pow(2.0f, static_cast<float>(code) - 127.0f), dtype);
      for (int64_t i = g * q.group_size; i < (g + 1) * q.group_size; ++i) {
        const uint32_t c = get_code(row, i, q.bits);
        const float v = round_as(q.bits == 4 ? e2m1_value(c) : e4m3_value(static_cast<uint8_t>(c)), dtype);
        store_float("dequantize", out.data(), out_t, r * K + i, v * scale);
      }
    }
  }
  return out;
}

float fp_weight(QuantMode mode, const uint32_t* row, int64_t i, uint8_t scale_code) {
  const float scale = mode == QuantMode::nvfp4 ? e4m3_value(scale_code) : e8m0_value(scale_code);
  const float v = mode == QuantMode::mxfp8 ? e4m3_value(static_cast<uint8_t>(get_code(row, i, 8)))
                                           : e2m1_value(get_code(row, i, 4));
  return v * scale;
}

}  // namespace expertqmm::cpu
