// Argument checks shared by the public entry points (ops.cpp, moe.cpp, norm.cpp, gemma4_ffn.cpp).
#pragma once
#include <string>

#include "expertqmm/tensor.h"

namespace expertqmm::detail {

// Throws Error(op): the inputs are on cuda but this build has no CUDA backend.
[[noreturn]] void no_cuda_backend(const std::string& op);

// Throws Error(op) unless `t` (named `name` in the message) is defined and bf16, f16 or f32.
void check_floating(const std::string& op, const char* name, const Tensor& t);

}  // namespace expertqmm::detail
