#include "ops/op_checks.h"

#include <cstring>

#include "core/device_memory.h"
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

bool fused_layer_takes(const SwitchGLUWeights& w) {
  for (const QuantizedWeight* q : {&w.gate, &w.up, &w.gate_up, &w.down})
    if (q->defined() && q->mode != QuantMode::affine) return false;
  return true;
}

bool fused_layer_takes(const MoeWeights& w) {
  if (w.router.proj.defined() && w.router.proj.mode != QuantMode::affine) return false;
  return fused_layer_takes(w.experts);
}

void copy_into(Tensor& out, const Tensor& from) {
  EXPERTQMM_CHECK(out.shape() == from.shape() && out.dtype() == from.dtype() && out.device() == from.device() &&
                      out.is_contiguous(),
                  "copy", "cannot copy ", from.describe(), " into ", out.describe());
  const Tensor src = from.contiguous();
  if (src.nbytes() == 0) return;
  if (out.device() == Device::cuda) copy_device_to_device(out.data(), src.data(), src.nbytes());
  else std::memcpy(out.data(), src.data(), src.nbytes());
}

void check_floating(const std::string& op, const char* name, const Tensor& t) {
  EXPERTQMM_CHECK(t.defined(), op, name, " is undefined");
  EXPERTQMM_CHECK(is_floating(t.dtype()), op, name, " must be bfloat16, float16 or float32, got ",
                  t.describe());
}

}  // namespace expertqmm::detail
