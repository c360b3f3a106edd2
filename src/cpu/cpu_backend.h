// The CPU reference backend: scalar, readable, the executable spec. Its ops are the list of
// core/backend_ops.h; inputs arrive validated by the op front (src/ops), so these functions may
// assume valid shapes and dtypes. It leaves the fused layer paths (switch_glu, moe_layer_into,
// gemma4_ffn_into, qwen3_moe_ffn_into) to the front, which composes them from these ops in mlx-lm's order.
#pragma once
#include "core/backend_ops.h"

namespace expertqmm::cpu {

EXPERTQMM_DECLARE_BACKEND_OPS()

// The router's logits [T, E] for host h [T, H] (Gemma 4: of the normed h), in the dtype route ranks
// them in: route's first half, for callers that need the scores themselves (the CLI's bench picks
// the tokens it checks away from near-ties of these).
Tensor router_logits(const Tensor& h, const RouterWeights& router);

}  // namespace expertqmm::cpu
