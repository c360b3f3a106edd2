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

// Whether the backends' fused layer paths (switch_glu, moe_layer_into, gemma4_ffn_into) may take
// these weights: they compute MLX affine quantization only, so a layer with a weight in an fp mode
// (mxfp4, mxfp8, nvfp4) is composed from the ops instead (gather_qmm's generic routes take every
// mode).
bool fused_layer_takes(const SwitchGLUWeights& w);
bool fused_layer_takes(const MoeWeights& w);
// Copies `from` into `out` (same shape, dtype and device; contiguous): a composed result into a
// caller's buffer.
void copy_into(Tensor& out, const Tensor& from);

// Throws Error(op) unless `t` (named `name` in the message) is defined and bf16, f16 or f32.
void check_floating(const std::string& op, const char* name, const Tensor& t);

}  // namespace expertqmm::detail
