// CPU reference of mx.gather_qmm (spec mlx-semantics.md 2.1, 2.5): for each batch slot b,
//   out[b] = x[lhs[b]] (M x K) @ dequant(w[rhs[b]])^T (K x N)   (transpose = true)
//   out[b] = x[lhs[b]] (M x K) @ dequant(w[rhs[b]])   (K x N)   (transpose = false)
// Weights are dequantized in fp32 as float(s) * q + float(b) (never rounded to the activation
// dtype, like MLX's CPU _qmm_t_simd), products are accumulated in fp32 in increasing k, and each
// output is rounded once to p.dtype. The fp modes (mxfp4, mxfp8, nvfp4) read each weight as its
// E2M1 / E4M3 value times the group's decoded scale (exact in fp32; MLX's CPU fp_qmm_t with T=float
// sums x * value per group and multiplies by the scale once: the same products, another order).
#include <cstring>
#include <vector>

#include "core/gather_qmm_problem.h"
#include "cpu/cpu_backend.h"
#include "cpu/elements.h"
#include "cpu/gathered_matmul.h"
#include "cpu/quantize_fp.h"

namespace expertqmm::cpu {

namespace {

// Code i of one packed row: bits [i*bits, (i+1)*bits) of the little-endian, LSB-first bit stream
// formed by the row's uint32 words (spec 1.2). Works for every width 2..8, including 3, 5 and 6
// where a code may straddle two words.
uint32_t unpack_code(const uint32_t* row_words, int64_t i, int bits) {
  const int64_t bit = i * bits;
  const int64_t word = bit / 32;
  const int shift = static_cast<int>(bit % 32);
  uint64_t window = row_words[word] >> shift;
  if (shift + bits > 32) window |= static_cast<uint64_t>(row_words[word + 1]) << (32 - shift);
  return static_cast<uint32_t>(window) & ((1u << bits) - 1u);
}

// Dequantizes weight matrix `e` into `w_nk` as an N x K row-major fp32 matrix, whatever the
// stored orientation, so the dot products below always walk contiguous memory.
//   w:      (E, rows, row_words) uint32, rows = N (transpose) or K (not transpose)
//   value(words, c, g): the weight at value c of a stored row, g its group's flat index into the
//   (E, rows, row_values / group_size) scales (and affine biases): the mode's arithmetic.
template <class Value>
void dequantize_matrix(const detail::GatherQmmProblem& p, const uint32_t* w, int64_t e, Value value,
                       std::vector<float>& w_nk) {
  const int64_t rows = p.transpose ? p.N : p.K;
  const int64_t row_values = p.transpose ? p.K : p.N;
  const int64_t row_words = p.w_row_words();
  const int64_t groups = p.groups_per_row();
  w_nk.assign(static_cast<size_t>(p.N * p.K), 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const uint32_t* words = w + (e * rows + r) * row_words;
    const int64_t group0 = (e * rows + r) * groups;  // the row's first group in scales (and biases)
    for (int64_t c = 0; c < row_values; ++c) {
      // transpose: row r is output column n = r, c runs over k; otherwise r is k and c is n.
      const int64_t n = p.transpose ? r : c;
      const int64_t k = p.transpose ? c : r;
      w_nk[n * p.K + k] = value(words, c, group0 + c / p.group_size);
    }
  }
}

}  // namespace

Tensor gather_qmm(const detail::GatherQmmProblem& p) {
  const uint32_t* w = p.w.data_as<const uint32_t>();
  if (p.mode != QuantMode::affine) {  // scales are uint8 codes, one per group; no biases
    const uint8_t* scales = p.scales.data_as<const uint8_t>();
    const auto fp_value = [&](const uint32_t* words, int64_t c, int64_t g) {
      return fp_weight(p.mode, words, c, scales[g]);
    };
    return gathered_matmul(p, [&](int64_t e, std::vector<float>& w_nk) { dequantize_matrix(p, w, e, fp_value, w_nk); });
  }
  const std::vector<float> scales = to_f32(p.scales);
  const std::vector<float> biases = to_f32(p.biases);
  const auto affine_value = [&](const uint32_t* words, int64_t c, int64_t g) {
    return scales[g] * static_cast<float>(unpack_code(words, c, p.bits)) + biases[g];
  };
  return gathered_matmul(p, [&](int64_t e, std::vector<float>& w_nk) { dequantize_matrix(p, w, e, affine_value, w_nk); });
}

}  // namespace expertqmm::cpu
