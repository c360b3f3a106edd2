#include "cpu/elements.h"

#include <cstring>

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

}  // namespace expertqmm::cpu
