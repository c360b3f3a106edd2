#include "core/op_checks.h"

#include "expertqmm/error.h"

namespace expertqmm::detail {

void no_cuda_backend(const std::string& op) {
  throw Error(op, "the inputs are on cuda but this build of expertqmm has no CUDA backend");
}

void check_floating(const std::string& op, const char* name, const Tensor& t) {
  EXPERTQMM_CHECK(t.defined(), op, name, " is undefined");
  EXPERTQMM_CHECK(is_floating(t.dtype()), op, name, " must be bfloat16, float16 or float32, got ",
                  t.describe());
}

}  // namespace expertqmm::detail
