// MLX affine quantization: codes in uint32 words, one scale and bias per group of `group_size`
// consecutive values along the last axis. Spec: shared/spec/mlx-semantics.md section 1.
#pragma once
#include "expertqmm/tensor.h"

namespace expertqmm {

// The two MLX quantizers (spec 1.3). They differ only on all-negative groups and exact .5 ties.
enum class Rounding : uint8_t {
  cpu,  // exact min/max, std::rint (ties to even): MLX's CPU backend
  gpu,  // w_max starts at 0, round half away from zero: MLX's Metal and CUDA backends
};

struct QuantSpec {
  int bits = 4;         // 2, 3, 4, 5, 6 or 8
  int group_size = 64;  // 32, 64 or 128
  Rounding rounding = Rounding::cpu;
};

// A quantized weight as MLX stores it, for w of logical shape [..., N, K]:
//   w      [..., N, K*bits/32] uint32, LSB-first bit stream per row
//   scales [..., N, K/group_size] in the float dtype of the original weight
//   biases [..., N, K/group_size] same dtype as scales
struct QuantizedWeight {
  Tensor w;
  Tensor scales;
  Tensor biases;
  int bits = 4;
  int group_size = 64;
  bool defined() const { return w.defined(); }
};

bool valid_bits(int bits);
bool valid_group_size(int group_size);

// mx.quantize(w, group_size, bits, mode="affine"), with the chosen backend flavour of rounding.
QuantizedWeight quantize(const Tensor& w, QuantSpec spec = {});

// mx.dequantize: s*q + b, output in the dtype of scales, shape [..., N, K].
Tensor dequantize(const Tensor& w, const Tensor& scales, const Tensor& biases, int group_size,
                  int bits);
inline Tensor dequantize(const QuantizedWeight& q) {
  return dequantize(q.w, q.scales, q.biases, q.group_size, q.bits);
}

}  // namespace expertqmm
