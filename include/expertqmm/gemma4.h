// The feed-forward half of a Gemma 4 MoE decoder layer (spec mlx-semantics 4.1, gemma4-moe.md 4):
//   h1  = post_feedforward_layernorm_1( mlp( pre_feedforward_layernorm(h) ) )   dense GeGLU MLP
//   idx, w = route(h)                                                            un-normalised h
//   h2  = post_feedforward_layernorm_2( experts( pre_feedforward_layernorm_2(h), idx, w ) )
//   out = (h + post_feedforward_layernorm(h1 + h2)) * layer_scalar
// plus the elementwise ops it needs (rms_norm, add, add_scaled) and a Linear that is quantized or
// dense. Attention is not part of this: h is the post-attention residual.
#pragma once
#include "expertqmm/moe.h"

namespace expertqmm {

// RMSNorm as mx.fast.rms_norm: y = x * rsqrt(mean(x^2) + eps) * weight, fp32 math, one rounding
// to x's dtype. Gemma 4 has NO (1 + weight) offset. x [T, D], weight [D] (any float dtype).
Tensor rms_norm(const Tensor& x, const Tensor& weight, float eps);

// a + b, elementwise, same shape and dtype; fp32 sum, one rounding.
Tensor add(const Tensor& a, const Tensor& b);

// (a + b) * scalar[0], rounded to a's dtype after the add and again after the multiply (the two
// MLX ops). scalar: a one-element float tensor (Gemma 4's layer_scalar [1]).
Tensor add_scaled(const Tensor& a, const Tensor& b, const Tensor& scalar);

// A linear layer without bias, y = x @ W^T: quantized (MLX affine, any bits / group size the
// checkpoint uses; w [N, K*bits/32]) or dense (float [N, K]). Exactly one is defined.
struct Linear {
  QuantizedWeight quantized;
  Tensor dense;
  bool is_quantized() const { return quantized.defined(); }
  bool defined() const { return quantized.defined() || dense.defined(); }
  int64_t out_features() const;  // N
  int64_t in_features() const;    // K
};

// x [T, K] -> [T, N]. Quantized: gather_qmm with x as one batch of T rows (B = 1, identity
// indices), output in promote(x, scales). Dense: fp32 dot products, output in promote(x, W).
Tensor linear(const Tensor& x, const Linear& w);

// The dense GeGLU MLP beside the experts: down(gelu_tanh(gate(x)) * up(x)).
struct Gemma4Mlp {
  Linear gate;  // [I_dense, H]
  Linear up;    // [I_dense, H]
  Linear down;  // [H, I_dense]
};

// Weights of one layer's feed-forward part. Norm weights are [H]; layer_scalar is [1].
struct Gemma4FfnWeights {
  Tensor pre_feedforward_layernorm;
  Tensor post_feedforward_layernorm_1;
  Tensor pre_feedforward_layernorm_2;
  Tensor post_feedforward_layernorm_2;
  Tensor post_feedforward_layernorm;
  Gemma4Mlp mlp;
  MoeWeights moe;  // router (its own eps and top_k) and experts
  Tensor layer_scalar;
  float eps = 1e-6f;  // of the five norms above

  // A copy with every tensor on `device` (undefined members stay undefined).
  Gemma4FfnWeights to(Device device) const;
  // Bytes of every tensor held (codes, scales, biases, norms).
  size_t nbytes() const;
};

// The feed-forward part of the layer: h [T, H] -> [T, H] in h's dtype. Runs on h's device; on
// CUDA through gemma4_ffn_into with a workspace owned by the call.
Tensor gemma4_ffn(const Tensor& h, const Gemma4FfnWeights& weights);

// gemma4_ffn writing into a caller-owned contiguous `out` [T, H] (h's dtype and device), with the
// scratch from `ws`. On CUDA, once `ws` has grown to a size (one call at that T or larger), a call
// performs no allocation and no host synchronization, so it can be captured in a CUDA graph.
// Dense MLP weights on CUDA must have scales in h's dtype (as every MLX checkpoint has).
void gemma4_ffn_into(Tensor& out, const Tensor& h, const Gemma4FfnWeights& weights, Workspace& ws);

}  // namespace expertqmm
