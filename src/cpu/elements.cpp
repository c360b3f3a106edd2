#include "cpu/elements.h"

#include <cstring>

#include "core/float16.h"
#include "core/gather_qmm_problem.h"

namespace expertqmm::cpu {

std::vector<float> to_f32(const Tensor& t) {
  Tensor f = detail::cast_floating(t, DType::f32).contiguous();
  std::vector<float> v(static_cast<size_t>(f.numel()));
  if (v.empty()) return v;
  if (f.device() == Device::cpu) std::memcpy(v.data(), f.data(), v.size() * sizeof(float));
  else std::memcpy(v.data(), f.to_host_bytes().data(), v.size() * sizeof(float));
  return v;
}

float round_as(float v, DType dtype) {
  if (dtype == DType::bf16) return round_to_bf16(v);
  if (dtype == DType::f16) return f16_to_float(float_to_f16(v));
  return v;
}

}  // namespace expertqmm::cpu
