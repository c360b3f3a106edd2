// Argument checks and dispatch shared by the op front (ops.cpp, moe.cpp, quant.cpp, norm.cpp,
// gemma4_ffn.cpp).
#pragma once
#include <string>

#include "core/backend_ops.h"
#include "expertqmm/moe.h"
#include "expertqmm/tensor.h"

namespace expertqmm::detail {

// The backend table for inputs on `device` (core/backend_ops.h). Checks the settings first, so a
// bad EXPERTQMM_* variable is an Error from every op on every build; a device whose backend this
// build lacks is an Error naming `op`.
const BackendOps& backend_ops(const std::string& op, Device device);

// The checks of moe_layer(h, x = h-shaped, w) for a caller that runs the layer inside a larger block
// (gemma4_ffn); returns the layer's output dtype.
DType check_moe_weights(const char* op, const Tensor& h, const MoeWeights& w);

// Throws Error(op): the CUDA backend has no kernels for 16-bit (unquantized) expert weights yet;
// `name` and `w` say which weight was 16-bit. Called at the op front, before any CUDA dispatch.
[[noreturn]] void no_cuda_16bit_experts(const std::string& op, const std::string& name, const Tensor& w);
// no_cuda_16bit_experts for the first 16-bit projection of `w` when `device` is cuda; else nothing.
void reject_16bit_experts_on_cuda(const std::string& op, const SwitchGLUWeights& w, Device device);

// Throws Error(op) unless `t` (named `name` in the message) is defined and bf16, f16 or f32.
void check_floating(const std::string& op, const char* name, const Tensor& t);

}  // namespace expertqmm::detail
