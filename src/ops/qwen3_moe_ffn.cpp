// The Qwen3-MoE feed-forward part (include/expertqmm/qwen3_moe.h). The CPU path is composed from
// the public ops in mlx-lm's order (qwen3_moe.py Qwen3MoeDecoderLayer.__call__ after attention);
// the CUDA path (src/cuda/qwen3_moe_ffn.cu) runs the same sequence into workspace buffers.
#include <cmath>
#include <cstring>

#include "ops/op_checks.h"
#include "expertqmm/error.h"
#include "expertqmm/qwen3_moe.h"

namespace expertqmm {

namespace {

constexpr const char* kOp = "qwen3_moe_ffn";

void check_ffn(const Tensor& h, const Qwen3MoeFfnWeights& w) {
  EXPERTQMM_CHECK(h.defined(), kOp, "h is undefined");
  EXPERTQMM_CHECK(is_floating(h.dtype()), kOp, "h must be bfloat16, float16 or float32, got ", h.describe());
  EXPERTQMM_CHECK(h.ndim() == 2, kOp, "h must be [T, H], got ", h.describe());
  const Tensor& norm = w.post_attention_layernorm;
  EXPERTQMM_CHECK(norm.defined() && is_floating(norm.dtype()) && norm.shape() == Shape{h.size(1)}, kOp,
                  "post_attention_layernorm must be a float [", h.size(1), "], got ",
                  norm.defined() ? norm.describe() : std::string("undefined"));
  EXPERTQMM_CHECK(norm.device() == h.device(), kOp, "post_attention_layernorm is on ", device_name(norm.device()),
                  " but h is on ", device_name(h.device()));
  EXPERTQMM_CHECK(std::isfinite(w.eps) && w.eps >= 0.f, kOp, "eps must be finite and >= 0, got ", w.eps);
  // The router and experts, as moe_layer checks them (the CUDA block runs the layer without the front).
  const DType moe_out = detail::check_moe_weights(kOp, h, w.moe);
  EXPERTQMM_CHECK(moe_out == h.dtype(), kOp, "the experts would produce ", dtype_name(moe_out), " from h ",
                  dtype_name(h.dtype()), "; the residual add needs their scales (or 16-bit weights) in h's dtype");
}

}  // namespace

Qwen3MoeFfnWeights Qwen3MoeFfnWeights::to(Device device) const {
  Qwen3MoeFfnWeights r = *this;
  if (post_attention_layernorm.defined()) r.post_attention_layernorm = post_attention_layernorm.to(device);
  r.moe = moe.to(device);
  return r;
}

size_t Qwen3MoeFfnWeights::nbytes() const {
  return (post_attention_layernorm.defined() ? post_attention_layernorm.nbytes() : 0) + moe.nbytes();
}

Tensor qwen3_moe_ffn(const Tensor& h, const Qwen3MoeFfnWeights& w) {
  check_ffn(h, w);
  if (h.size(0) == 0) return Tensor::empty(h.shape(), h.dtype(), h.device());
  const detail::BackendOps& be = detail::backend_ops(kOp, h.device());
  if (be.qwen3_moe_ffn_into) {  // checked once above, so straight to the backend
    Tensor out = Tensor::empty(h.shape(), h.dtype(), h.device());
    Workspace ws;  // owned by this call: the allocating convenience path
    be.qwen3_moe_ffn_into(out, h.contiguous(), w, ws);
    return out;
  }
  // r = self.mlp(self.post_attention_layernorm(h)); out = h + r
  const Tensor x = rms_norm(h, w.post_attention_layernorm, w.eps);
  return add(h, moe_layer(x, x, w.moe));
}

void qwen3_moe_ffn_into(Tensor& out, const Tensor& h, const Qwen3MoeFfnWeights& w, Workspace& ws) {
  check_ffn(h, w);
  detail::check_block_out(kOp, out, h);
  if (h.size(0) == 0) return;
  const detail::BackendOps& be = detail::backend_ops(kOp, h.device());
  if (be.qwen3_moe_ffn_into) return be.qwen3_moe_ffn_into(out, h.contiguous(), w, ws);
  // Composed (the CPU reference): allocates as it goes.
  const Tensor result = qwen3_moe_ffn(h, w);
  std::memcpy(out.data(), result.data(), result.nbytes());
}

}  // namespace expertqmm
