// The Qwen3-MoE feed-forward part on the device (include/expertqmm/qwen3_moe.h,
// qwen3_moe_ffn_into): three launches' worth of sequence on the current stream into one workspace
// arena, no host synchronization and, once the arena has grown, no allocation (graph-capturable):
//   x = rms_norm(h, post_attention_layernorm) -> m = moe_layer_into(x, x) -> out = h + m
// Buffers are [T, H] in h's dtype (validated by src/ops/qwen3_moe_ffn.cpp).
#include "cuda/moe_internal.h"
#include "cuda/norm.h"

namespace expertqmm::cuda {

void qwen3_moe_ffn_into(Tensor& out, const Tensor& h, const Qwen3MoeFfnWeights& w, Workspace& ws) {
  const char* op = "qwen3_moe_ffn";
  EXPERTQMM_CHECK(h.device() == Device::cuda && out.device() == Device::cuda && h.is_contiguous(), op,
                  "cuda::qwen3_moe_ffn_into needs contiguous device tensors, got h ", h.describe(), " and out ",
                  out.describe());
  const DType dt = h.dtype();
  const int64_t T = h.size(0), H = h.size(1);
  const size_t bytes = static_cast<size_t>(T * H) * dtype_size(dt);
  ArenaLayout layout;
  const size_t x_off = layout.reserve(bytes);
  const size_t moe_off = layout.reserve(bytes);
  void* base = ws.get(detail::kSlotFfnArena, layout.bytes());

  const Tensor norm = w.post_attention_layernorm.contiguous();
  launch_rms_norm(dt, h.data(), T, H, norm.dtype(), norm.data(), w.eps, arena_at(base, x_off));
  const Tensor x = Tensor::view(arena_at(base, x_off), {T, H}, dt, Device::cuda);
  Tensor moe_out = Tensor::view(arena_at(base, moe_off), {T, H}, dt, Device::cuda);
  cuda::moe_layer_into(moe_out, x, x, w.moe, ws);  // the router reads the normalised x too
  launch_add(dt, h.data(), arena_at(base, moe_off), T * H, out.data());
}

}  // namespace expertqmm::cuda
