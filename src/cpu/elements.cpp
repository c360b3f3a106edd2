#include "cpu/elements.h"

#include <cstring>

#include "core/float16.h"
#include "core/gather_qmm_problem.h"
#include "expertqmm/error.h"

namespace expertqmm::cpu {

std::vector<float> to_f32(const Tensor& t) {
  Tensor f = detail::cast_floating(t, DType::f32).contiguous();
  std::vector<float> v(static_cast<size_t>(f.numel()));
  if (v.empty()) return v;
  if (f.device() == Device::cpu) std::memcpy(v.data(), f.data(), v.size() * sizeof(float));
  else std::memcpy(v.data(), f.to_host_bytes().data(), v.size() * sizeof(float));
  return v;
}

float load_float(const char* op, const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::bf16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::f16: return f16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::f32: return static_cast<const float*>(base)[i];
    default: throw Error(op, detail::cat("not a float dtype: ", dtype_name(t)));
  }
}

void store_float(const char* op, void* base, DType t, int64_t i, float v) {
  switch (t) {
    case DType::bf16: static_cast<uint16_t*>(base)[i] = float_to_bf16(v); return;
    case DType::f16: static_cast<uint16_t*>(base)[i] = float_to_f16(v); return;
    case DType::f32: static_cast<float*>(base)[i] = v; return;
    default: throw Error(op, detail::cat("not a float dtype: ", dtype_name(t)));
  }
}

float round_as(float v, DType dtype) {
  if (dtype == DType::bf16) return round_to_bf16(v);
  if (dtype == DType::f16) return f16_to_float(float_to_f16(v));
  return v;
}

}  // namespace expertqmm::cpu
