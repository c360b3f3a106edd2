// The feed-forward half of a Qwen3-MoE decoder layer (mlx-lm qwen3_moe.Qwen3MoeDecoderLayer, from
// `h = x + r` on; attention is not part of this, h is the post-attention residual):
//   x   = post_attention_layernorm(h)                       RMSNorm, eps rms_norm_eps
//   out = h + Qwen3MoeSparseMoeBlock(x)                     moe_layer(x, x, moe)
// where the block is a RouterKind::softmax_topk router (gate Linear -> softmax over all experts ->
// top-k -> renormalised when norm_topk_prob) and a SwitchGLU with SwiGLU experts
// (silu(gate) * up), weighted sum over the k. The block itself is moe_layer (moe.h): Qwen3 is a
// router kind and an activation, not new kernels.
#pragma once
#include "expertqmm/gemma4.h"  // rms_norm, add
#include "expertqmm/moe.h"

namespace expertqmm {

struct Qwen3MoeFfnWeights {
  Tensor post_attention_layernorm;  // [H]
  MoeWeights moe;                   // router.kind softmax_topk; experts.activation swiglu
  float eps = 1e-6f;                // of post_attention_layernorm

  Qwen3MoeFfnWeights to(Device device) const;
  size_t nbytes() const;
};

// h [T, H] -> h + moe(post_attention_layernorm(h)), in h's dtype, on h's device.
Tensor qwen3_moe_ffn(const Tensor& h, const Qwen3MoeFfnWeights& weights);

// qwen3_moe_ffn into a caller-owned contiguous `out` [T, H] (h's dtype and device) with scratch
// from `ws`; on CUDA, once `ws` has grown, no allocation and no host synchronization.
void qwen3_moe_ffn_into(Tensor& out, const Tensor& h, const Qwen3MoeFfnWeights& weights, Workspace& ws);

}  // namespace expertqmm
