// Argument checks shared by the public entry points (ops.cpp, moe.cpp, norm.cpp, gemma4_ffn.cpp).
#pragma once
#include <string>

#include "expertqmm/tensor.h"

namespace expertqmm {
struct SwitchGLUWeights;
}

namespace expertqmm::detail {

// Throws Error(op): the inputs are on cuda but this build has no CUDA backend.
[[noreturn]] void no_cuda_backend(const std::string& op);

// Throws Error(op): the CUDA backend has no kernels for 16-bit (unquantized) expert weights yet;
// `name` and `w` say which weight was 16-bit. Called at the op front, before any CUDA dispatch.
[[noreturn]] void no_cuda_16bit_experts(const std::string& op, const std::string& name, const Tensor& w);
// no_cuda_16bit_experts for the first 16-bit projection of `w` when `device` is cuda; else nothing.
void reject_16bit_experts_on_cuda(const std::string& op, const SwitchGLUWeights& w, Device device);

// Throws Error(op) unless `t` (named `name` in the message) is defined and bf16, f16 or f32.
void check_floating(const std::string& op, const char* name, const Tensor& t);

}  // namespace expertqmm::detail
