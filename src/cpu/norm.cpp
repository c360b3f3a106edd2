// CPU reference: RMSNorm (mx.fast.rms_norm), add, add-then-scale and the dense linear. fp32 math on
// the widened inputs, one rounding to the output dtype per MLX op.
#include "cpu/cpu_backend.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "core/float16.h"
#include "cpu/elements.h"

namespace expertqmm::cpu {

namespace {


// fp32 values rounded into a new contiguous host tensor of `dtype`.
Tensor narrow(const std::vector<float>& v, const Shape& shape, DType dtype) {
  Tensor out = Tensor::empty(shape, dtype, Device::cpu);
  for (size_t i = 0; i < v.size(); ++i) {
    if (dtype == DType::f32) {
      out.data_as<float>()[i] = v[i];
    } else {
      out.data_as<uint16_t>()[i] = dtype == DType::bf16 ? float_to_bf16(v[i]) : float_to_f16(v[i]);
    }
  }
  return out;
}


}  // namespace

Tensor rms_norm(const Tensor& x, const Tensor& weight, float eps) {
  const int64_t D = x.size(-1), rows = x.numel() / (D ? D : 1);
  const std::vector<float> xv = to_f32(x), wv = to_f32(weight);
  std::vector<float> out(xv.size());
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = xv.data() + r * D;
    float sum_sq = 0.f;  // fp32 accumulation, as MLX's kernel
    for (int64_t i = 0; i < D; ++i) sum_sq += row[i] * row[i];
    const float inv = 1.f / std::sqrt(sum_sq / static_cast<float>(D) + eps);
    for (int64_t i = 0; i < D; ++i) out[r * D + i] = row[i] * inv * wv[i];
  }
  return narrow(out, x.shape(), x.dtype());
}

Tensor add(const Tensor& a, const Tensor& b) {
  const std::vector<float> av = to_f32(a), bv = to_f32(b);
  std::vector<float> out(av.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = av[i] + bv[i];
  return narrow(out, a.shape(), a.dtype());
}

Tensor add_scaled(const Tensor& a, const Tensor& b, const Tensor& scalar_tensor) {
  const float scalar = to_f32(scalar_tensor)[0];
  const std::vector<float> av = to_f32(a), bv = to_f32(b);
  std::vector<float> out(av.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = round_as(av[i] + bv[i], a.dtype()) * scalar;
  return narrow(out, a.shape(), a.dtype());
}

Tensor dense_linear(const Tensor& x, const Tensor& w, DType out_dtype) {
  const int64_t T = x.size(0), K = x.size(1), N = w.size(0);
  const std::vector<float> xv = to_f32(x), wv = to_f32(w);
  std::vector<float> out(static_cast<size_t>(T * N));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0.0;
      for (int64_t k = 0; k < K; ++k) acc += double(xv[t * K + k]) * double(wv[n * K + k]);
      out[t * N + n] = static_cast<float>(acc);
    }
  return narrow(out, {T, N}, out_dtype);
}

}  // namespace expertqmm::cpu
