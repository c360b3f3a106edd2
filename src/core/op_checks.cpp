#include "core/op_checks.h"

#include "expertqmm/error.h"
#include "expertqmm/quant.h"

namespace expertqmm {

// The MLX affine table (here, not in quant.cpp, so that the checkpoint reader and its fuzzer need
// none of the quantizer).
bool valid_bits(int bits) {
  return bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8;
}

bool valid_group_size(int group_size) { return group_size == 32 || group_size == 64 || group_size == 128; }

}  // namespace expertqmm

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
