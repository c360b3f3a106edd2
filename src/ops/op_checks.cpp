#include "ops/op_checks.h"

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

void check_block_out(const char* op, const Tensor& out, const Tensor& h) {
  EXPERTQMM_CHECK(out.defined(), op, "out is undefined");
  EXPERTQMM_CHECK(out.shape() == h.shape() && out.dtype() == h.dtype() && out.device() == h.device(), op,
                  "out must be ", dtype_name(h.dtype()), shape_str(h.shape()), " on ", device_name(h.device()),
                  ", got ", out.describe());
  EXPERTQMM_CHECK(out.is_contiguous(), op, "out must be contiguous, got ", out.describe());
}

void check_floating(const std::string& op, const char* name, const Tensor& t) {
  EXPERTQMM_CHECK(t.defined(), op, name, " is undefined");
  EXPERTQMM_CHECK(is_floating(t.dtype()), op, name, " must be bfloat16, float16 or float32, got ",
                  t.describe());
}

}  // namespace expertqmm::detail
