// CPU reference of MLX affine quantize / dequantize (spec shared/spec/mlx-semantics.md 1.2-1.4);
// the fp modes are in quantize_fp.cpp.
//
// Layout, for w of shape [..., N, K] viewed as R = numel / K rows:
//   w        (R, K) bf16/f16/f32, row-major
//   codes    (R, K*bits/32) uint32: each row is a little-endian LSB-first bit stream; element i
//            occupies bits [i*bits, (i+1)*bits) and 3/5/6-bit elements may span two words
//   scales   (R, K/group_size) in w's dtype, one per group of group_size consecutive values
//   biases   (R, K/group_size) same
// Everything is computed in fp32; only the stored scale and bias are rounded to w's dtype, and the
// codes come from the unrounded fp32 scale and bias, as MLX does.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/float16.h"
#include "cpu/cpu_backend.h"
#include "cpu/elements.h"
#include "cpu/quantize_fp.h"
#include "expertqmm/error.h"

namespace expertqmm::cpu {

namespace {

// The product rounded to fp32 before anything else uses it: keeps -ffp-contract from fusing it
// with the following add into an FMA, which MLX's separate multiply and add kernels never do.
float rounded_product(float a, float b) {
  volatile float p = a * b;
  return p;
}

struct GroupAffine {
  float scale;  // fp32, unrounded; may be negative
  float bias;
};

constexpr float kEps = 1e-7f;

// MLX CPU backend (backend/cpu/quantized.cpp): exact min/max over the group, std::rint (ties to
// even under the default rounding mode). std::max/std::min keep their first argument on NaN, so a
// NaN element never becomes the min or the max.
GroupAffine group_affine_cpu(const float* v, int group_size, float n_bins) {
  float w_min = std::numeric_limits<float>::infinity();
  float w_max = -w_min;
  for (int j = 0; j < group_size; ++j) {
    w_max = std::max(w_max, v[j]);
    w_min = std::min(w_min, v[j]);
  }
  const bool side = std::abs(w_min) > std::abs(w_max);  // strict: a tie picks w_max as the edge
  float scale = std::max((w_max - w_min) / n_bins, kEps);
  scale = side ? scale : -scale;
  const float edge = side ? w_min : w_max;
  const float q0 = std::rint(edge / scale);
  float bias = 0;
  if (q0 != 0) {
    scale = edge / q0;
    bias = edge;
  }
  return {scale, bias};
}

// MLX Metal / CUDA (affine_quantize kernels): w_min starts at FLT_MAX and w_max at 0, so an
// all-negative group gets the range [w_min, 0]; fminf/fmaxf skip NaN; round() is half away from 0.
GroupAffine group_affine_gpu(const float* v, int group_size, float n_bins) {
  float w_min = std::numeric_limits<float>::max();
  float w_max = 0;
  for (int j = 0; j < group_size; ++j) {
    w_min = std::fmin(w_min, v[j]);
    w_max = std::fmax(w_max, v[j]);
  }
  float scale = std::fmax((w_max - w_min) / n_bins, kEps);
  const bool side = std::fabs(w_min) > std::fabs(w_max);
  scale = side ? scale : -scale;
  const float edge = side ? w_min : w_max;
  const float q0 = std::round(edge / scale);
  const bool at_zero = q0 == 0.0f;
  return {at_zero ? scale : edge / q0, at_zero ? 0.0f : edge};
}

// One code in [0, n_bins]. CPU: clamp(rint(.), 0, n); a NaN code reads as 0 (what MLX's
// float -> uint64 cast yields on x86 and ARM). GPU: fminf(round(.), n) then a saturating
// float -> unsigned conversion, so NaN becomes n and negatives 0.
uint32_t code_of(float w, const GroupAffine& g, float n_bins, Rounding rounding) {
  const float x = (w - g.bias) / g.scale;
  if (rounding == Rounding::cpu) {
    const float c = std::min(std::max(std::rint(x), 0.0f), n_bins);
    return std::isnan(c) ? 0u : static_cast<uint32_t>(c);
  }
  const float c = std::fmin(std::round(x), n_bins);
  return c > 0 ? static_cast<uint32_t>(c) : 0u;
}

// Bit-stream access to one row of packed codes (LSB first; an element may straddle two words).
void put_code(uint32_t* row, int64_t i, int bits, uint32_t code) {
  const int64_t bit = i * bits;
  const int64_t word = bit >> 5;
  const int shift = static_cast<int>(bit & 31);
  row[word] |= code << shift;
  if (shift + bits > 32) row[word + 1] |= code >> (32 - shift);
}

uint32_t get_code(const uint32_t* row, int64_t i, int bits) {
  const int64_t bit = i * bits;
  const int64_t word = bit >> 5;
  const int shift = static_cast<int>(bit & 31);
  uint64_t v = row[word] >> shift;
  if (shift + bits > 32) v |= static_cast<uint64_t>(row[word + 1]) << (32 - shift);
  return static_cast<uint32_t>(v & ((1u << bits) - 1u));
}

}  // namespace

QuantizedWeight quantize(const Tensor& w_in, QuantSpec spec) {
  if (spec.mode != QuantMode::affine) return quantize_fp(w_in, spec);
  const Tensor w = w_in.contiguous();
  const int bits = spec.bits, gs = spec.group_size;
  const int64_t K = w.size(-1);
  const int64_t rows = K == 0 ? 0 : w.numel() / K;
  const int64_t row_words = K * bits / 32;
  const int64_t groups = K / gs;
  const float n_bins = static_cast<float>((1 << bits) - 1);

  Shape wq_shape = w.shape(), s_shape = w.shape();
  wq_shape.back() = row_words;
  s_shape.back() = groups;
  QuantizedWeight q;
  q.bits = bits;
  q.group_size = gs;
  q.w = Tensor::empty(wq_shape, DType::u32, Device::cpu);
  q.scales = Tensor::empty(s_shape, w.dtype(), Device::cpu);
  q.biases = Tensor::empty(s_shape, w.dtype(), Device::cpu);
  if (q.w.nbytes()) std::memset(q.w.data(), 0, q.w.nbytes());

  std::vector<float> group(gs);
  for (int64_t r = 0; r < rows; ++r) {
    uint32_t* row = q.w.data_as<uint32_t>() + r * row_words;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t first = r * K + g * gs;
      for (int j = 0; j < gs; ++j) group[j] = load_float("quantize", w.data(), w.dtype(), first + j);
      const GroupAffine a = spec.rounding == Rounding::cpu ? group_affine_cpu(group.data(), gs, n_bins)
                                                           : group_affine_gpu(group.data(), gs, n_bins);
      for (int j = 0; j < gs; ++j) put_code(row, g * gs + j, bits, code_of(group[j], a, n_bins, spec.rounding));
      store_float("quantize", q.scales.data(), w.dtype(), r * groups + g, a.scale);
      store_float("quantize", q.biases.data(), w.dtype(), r * groups + g, a.bias);
    }
  }
  return q;
}

// MLX on a CPU stream (ops.cpp dequantize fallback): multiply(codes, scales) in the scales dtype,
// then add(biases) in that dtype: T(T(q * s) + b), each op in fp32 then rounded to T.
// The fp modes: dequantize_fp (quantize_fp.cpp). Affine ignores `dtype` (the front casts).
Tensor dequantize(const QuantizedWeight& q, DType dtype) {
  if (q.mode != QuantMode::affine) return dequantize_fp(q, dtype);
  const int group_size = q.group_size, bits = q.bits;
  const Tensor w = q.w.contiguous(), scales = q.scales.contiguous(), biases = q.biases.contiguous();
  const DType t = scales.dtype();
  const int64_t row_words = w.size(-1);
  const int64_t K = row_words * 32 / bits;
  const int64_t rows = row_words == 0 ? 0 : w.numel() / row_words;
  const int64_t groups = K / group_size;

  Shape out_shape = w.shape();
  out_shape.back() = K;
  Tensor out = Tensor::empty(out_shape, t, Device::cpu);
  for (int64_t r = 0; r < rows; ++r) {
    const uint32_t* row = w.data_as<uint32_t>() + r * row_words;
    for (int64_t g = 0; g < groups; ++g) {
      const float s = load_float("dequantize", scales.data(), t, r * groups + g);
      const float b = load_float("dequantize", biases.data(), t, r * groups + g);
      for (int64_t i = g * group_size; i < (g + 1) * group_size; ++i) {
        const float q = static_cast<float>(get_code(row, i, bits));
        const float scaled = round_as(rounded_product(q, s), t);
        store_float("dequantize", out.data(), t, r * K + i, scaled + b);
      }
    }
  }
  return out;
}

}  // namespace expertqmm::cpu
