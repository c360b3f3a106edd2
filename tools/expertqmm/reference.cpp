#include "reference.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <cstring>

#include "core/float16.h"
#include "core/fp_codes.h"
#include "expertqmm/error.h"

namespace expertqmm::cli {

namespace {

float to_f32(const void* base, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::bf16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::f16: return f16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::f32: return static_cast<const float*>(base)[i];
    default: throw Error("reference", detail::cat("unsupported float dtype ", dtype_name(dtype)));
  }
}

// One quantized [E, N, K] weight on the host, read row by row.
struct PackedRows {
  const uint32_t* w;
  const void* scales;
  const void* biases;
  DType group_dtype;
  int64_t N, K, row_words, groups;
  int bits, group_size;
  QuantMode mode;

  explicit PackedRows(const QuantizedWeight& q)
      : w(q.w.data_as<uint32_t>()), scales(q.scales.data()), biases(q.biases.defined() ? q.biases.data() : nullptr),
        group_dtype(q.scales.dtype()), N(q.w.size(-2)), K(q.w.size(-1) * 32 / q.bits),
        row_words(q.w.size(-1)), groups(q.scales.size(-1)), bits(q.bits), group_size(q.group_size), mode(q.mode) {
    EXPERTQMM_CHECK(q.w.device() == Device::cpu && q.w.is_contiguous() && q.scales.is_contiguous() &&
                        (!q.biases.defined() || q.biases.is_contiguous()),
                    "reference", "weights must be contiguous host tensors, got ", q.w.describe());
  }

  // Group g's scale of row r: affine from the float scales; the fp modes decode their uint8 code
  // (E4M3 for nvfp4, E8M0 for the mx modes), and a code is E2M1 (4 bits) or E4M3 (8 bits).
  float fp_scale(int64_t i) const {
    const uint8_t c = static_cast<const uint8_t*>(scales)[i];
    return mode == QuantMode::nvfp4 ? e4m3_value(c) : e8m0_value(c);
  }
  float fp_value(uint32_t code) const { return bits == 8 ? e4m3_value(uint8_t(code)) : e2m1_value(code); }

  // Row n of expert e, dequantized: element i is bits [i*bits, (i+1)*bits) of the row's LSB-first
  // bit stream (spec 1.2), so 3/5/6-bit codes may straddle two words.
  void row(int64_t e, int64_t n, std::vector<float>& out) const {
    out.resize(K);
    const int64_t r = e * N + n;
    const uint32_t* words = w + r * row_words;
    const uint32_t mask = (1u << bits) - 1u;
    for (int64_t g = 0; g < groups; ++g) {
      const bool affine = mode == QuantMode::affine;
      const float s = affine ? to_f32(scales, group_dtype, r * groups + g) : fp_scale(r * groups + g);
      const float b = affine ? to_f32(biases, group_dtype, r * groups + g) : 0.0f;
      for (int64_t i = g * group_size; i < (g + 1) * group_size; ++i) {
        const int64_t bit = i * bits, word = bit / 32, shift = bit % 32;
        uint64_t v = words[word] >> shift;
        if (shift + bits > 32) v |= uint64_t(words[word + 1]) << (32 - shift);
        const uint32_t code = uint32_t(v) & mask;
        out[i] = affine ? s * float(code) + b : fp_value(code) * s;
      }
    }
  }
};

double activation(Activation a, double g) {
  if (a == Activation::swiglu) return g / (1.0 + std::exp(-g));
  const double c = std::sqrt(2.0 / 3.14159265358979323846);
  return 0.5 * g * (1.0 + std::tanh(c * (g + 0.044715 * g * g * g)));
}

}  // namespace

std::vector<double> reference_tokens(const SwitchGLUWeights& ex, const std::vector<float>& x, int64_t H,
                                     const std::vector<int64_t>& tokens, const std::vector<int32_t>& indices,
                                     const std::vector<float>& weights, int64_t k) {
  // Gate and up as (weight, first row): fused gate_up holds gate in rows [0, I), up in [I, 2I).
  const QuantizedWeight& gate_q = ex.fused() ? ex.gate_up : ex.gate;
  const QuantizedWeight& up_q = ex.fused() ? ex.gate_up : ex.up;
  const PackedRows gate(gate_q), up(up_q), down(ex.down);
  const int64_t I = ex.fused() ? gate.N / 2 : gate.N;
  const int64_t up_row0 = ex.fused() ? I : 0;
  const int64_t E = gate_q.w.size(0);
  EXPERTQMM_CHECK(gate.K == H && down.N == H && down.K == I, "reference", "weights do not match H ", H, " I ", I);

  std::vector<double> out(tokens.size() * H, 0.0), hidden(I);
  std::vector<float> row;
  for (size_t n = 0; n < tokens.size(); ++n) {
    const int64_t t = tokens[n];
    const float* xt = x.data() + t * H;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = indices[t * k + j];
      EXPERTQMM_CHECK(e >= 0 && e < E, "reference", "expert ", e, " out of range [0, ", E, ")");
      for (int64_t i = 0; i < I; ++i) {
        double g = 0, u = 0;
        gate.row(e, i, row);
        for (int64_t d = 0; d < H; ++d) g += double(xt[d]) * row[d];
        up.row(e, up_row0 + i, row);
        for (int64_t d = 0; d < H; ++d) u += double(xt[d]) * row[d];
        hidden[i] = activation(ex.activation, g) * u;
      }
      const double wj = weights[t * k + j];
      for (int64_t d = 0; d < H; ++d) {
        down.row(e, d, row);
        double y = 0;
        for (int64_t i = 0; i < I; ++i) y += hidden[i] * row[i];
        out[n * H + d] += wj * y;
      }
    }
  }
  return out;
}

std::vector<int64_t> checked_tokens(const std::vector<float>& logits, const std::vector<int64_t>& candidates,
                                    int64_t E, int k) {
  auto clear = [&](size_t i) {
    if (k >= E) return true;
    std::vector<float> row(logits.begin() + static_cast<int64_t>(i) * E, logits.begin() + static_cast<int64_t>(i + 1) * E);
    std::sort(row.begin(), row.end(), std::greater<float>());
    const float largest = std::max(std::fabs(row.front()), std::fabs(row.back()));
    const float margin = std::fabs(row[k - 1]) * (1.0f / 64) + largest * (1.0f / 512) + 1e-6f;
    return row[k - 1] - row[k] > margin;
  };
  const size_t n = candidates.size();
  if (n == 0) return {};
  size_t first = 0, last = n - 1;
  while (first < n && !clear(first)) ++first;
  while (last > first && !clear(last)) --last;
  if (first == n) return n > 1 ? std::vector<int64_t>{candidates[0], candidates[n - 1]} : std::vector<int64_t>{candidates[0]};
  if (last == first) return {candidates[first]};
  return {candidates[first], candidates[last]};
}

double rel_error(const float* got, const double* ref, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    const double d = double(got[i]) - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  if (den == 0) return num == 0 ? 0.0 : INFINITY;
  return std::sqrt(num / den);
}

std::vector<float> host_floats(const Tensor& t) {
  std::vector<uint8_t> bytes = t.to_host_bytes();
  std::vector<float> out(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) out[i] = to_f32(bytes.data(), t.dtype(), i);
  return out;
}

std::vector<int32_t> host_i32(const Tensor& t) {
  EXPERTQMM_CHECK(t.dtype() == DType::i32 || t.dtype() == DType::u32, "host_i32", "expected int32 indices, got ",
                  t.describe());
  std::vector<uint8_t> bytes = t.to_host_bytes();
  std::vector<int32_t> out(t.numel());
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

}  // namespace expertqmm::cli
