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

// The output of a residual block (gemma4_ffn_into, qwen3_moe_ffn_into): defined, contiguous and of
// h's shape, dtype and device.
void check_block_out(const char* op, const Tensor& out, const Tensor& h);

// Throws Error(op) unless `t` (named `name` in the message) is defined and bf16, f16 or f32.
void check_floating(const std::string& op, const char* name, const Tensor& t);

}  // namespace expertqmm::detail
