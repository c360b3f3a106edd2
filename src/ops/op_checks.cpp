#include "ops/op_checks.h"

#include <utility>

#include "core/settings.h"
#include "expertqmm/error.h"

namespace expertqmm::detail {

const BackendOps& backend_ops(const std::string& op, Device device) {
  check_settings();
  if (device == Device::cpu) return cpu_backend_ops();
  const BackendOps* cuda = cuda_backend_ops();
  EXPERTQMM_CHECK(cuda != nullptr, op, "the inputs are on cuda but this build of expertqmm has no CUDA backend");
  return *cuda;
}

void no_cuda_16bit_experts(const std::string& op, const std::string& name, const Tensor& w) {
  throw Error(op, name + " is an unquantized " + dtype_name(w.dtype()) + " expert weight " + shape_str(w.shape()) +
                      " on cuda: the CUDA backend has no 16-bit expert kernels (MLX gather_mm) yet; run this"
                      " layer on the CPU, or use quantized experts");
}

void reject_16bit_experts_on_cuda(const std::string& op, const SwitchGLUWeights& w, Device device) {
  if (device != Device::cuda || !w.has_dense()) return;
  const std::pair<const char*, const Tensor*> named[] = {
      {"gate", &w.gate_dense}, {"up", &w.up_dense}, {"gate_up", &w.gate_up_dense}, {"down", &w.down_dense}};
  for (const auto& [name, t] : named)
    if (t->defined()) no_cuda_16bit_experts(op, std::string("experts ") + name, *t);
}

void check_floating(const std::string& op, const char* name, const Tensor& t) {
  EXPERTQMM_CHECK(t.defined(), op, name, " is undefined");
  EXPERTQMM_CHECK(is_floating(t.dtype()), op, name, " must be bfloat16, float16 or float32, got ",
                  t.describe());
}

}  // namespace expertqmm::detail
