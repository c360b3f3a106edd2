// What the dense-linear probes share (dense_linear.cu, dense_cublas.cu): seeded random bf16 tensors and
// a quantized [N, K] weight (g64, the CPU quantizer) copied to the device.
#pragma once
#include <cstdint>
#include <random>
#include <vector>

#include "core/float16.h"
#include "expertqmm/quant.h"
#include "expertqmm/tensor.h"

namespace expertqmm::probe {

inline Tensor random_bf16(const Shape& shape, float stddev, uint32_t seed, Device device) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, stddev);
  std::vector<uint16_t> v(static_cast<size_t>(n));
  for (uint16_t& b : v) b = float_to_bf16(dist(rng));
  return Tensor::from_host(v.data(), shape, DType::bf16, device);
}

inline QuantizedWeight device_weight(int64_t N, int64_t K, int bits, uint32_t seed) {
  const QuantizedWeight q = quantize(random_bf16({N, K}, 0.02f, seed, Device::cpu), QuantSpec(bits, 64));
  QuantizedWeight d = q;
  d.w = q.w.to(Device::cuda);
  d.scales = q.scales.to(Device::cuda);
  d.biases = q.biases.to(Device::cuda);
  return d;
}

}  // namespace expertqmm::probe
