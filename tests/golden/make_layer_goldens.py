#!/usr/bin/env python3
"""Writes the Gemma 4 decoder-layer feed-forward goldens checked by tests/cpu_golden_gemma4_layer_test.cpp.

Usage: make_layer_goldens.py OUTDIR   (needs `pip install mlx[cpu] mlx-lm`; runs on MLX's CPU stream)

Outputs (well under 1 MB together):
  gemma4_tiny_ckpt/   a tiny random mlx-lm gemma4_text model (hidden 128, intermediate 192,
      moe_intermediate 64, 8 experts, top-k 2, 2 layers), quantized the mlx-lm way with
      mlx_lm.utils.quantize_model (experts and everything else 4-bit group 32, the dense
      mlp.{gate,up,down}_proj and router.proj 8-bit group 64 through the per-module predicate) and
      saved with mlx_lm.utils.save_model + save_config (model.safetensors, its index, config.json).
  gemma4_layer_ffn.safetensors   per layer L and token count T (3: unsorted SwitchGLU path; 40:
      sorted, T*k >= 64): l<L>.t<T>.h (bf16 post-attention residual), l<L>.t<T>.out (the bf16
      layer's feed-forward output as mlx-lm computes it), l<L>.t<T>.f32_out (the same with every
      float parameter and h widened to float32, same codes), and the router's indices of the f32
      twin l<L>.t<T>.indices (int32). Metadata "case.l<L>_t<T>" = "layer=L T=T".

The feed-forward path is DecoderLayer.__call__ from `residual = h` on (gemma4_text.py:353-389):
attention is not run; h is fed directly. Why the float32 twins: MLX 0.32's CPU bf16 quantized matmul
accumulates in bf16 (1.4-2.6% off the exact product, docs/numerics.md), so the tight bound compares
against the f32 twin and the loose bound against MLX's own bf16 output.

Tokens are redrawn until the k-th and (k+1)-th router logits of every token are apart by 6% of
the token's largest |logit| under both the bf16 and the f32 model, so the expected top-k set does
not hinge on rounding.
"""
import copy
import json
import os
import sys

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import gemma4_text
from mlx_lm.utils import quantize_model, save_config, save_model

SEED = 20261207
TOPK_MARGIN = 0.06
CONFIG = {
    "model_type": "gemma4_text",
    "hidden_size": 128,
    "intermediate_size": 192,
    "moe_intermediate_size": 64,
    "num_experts": 8,
    "top_k_experts": 2,
    "num_hidden_layers": 2,
    "enable_moe_block": True,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_global_key_value_heads": 1,
    "head_dim": 32,
    "global_head_dim": 64,
    "num_kv_shared_layers": 0,
    "hidden_size_per_layer_input": 0,
    "vocab_size": 64,
    "vocab_size_per_layer_input": 64,
    "sliding_window": 16,
    "layer_types": ["sliding_attention", "full_attention"],
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}


def predicate(path, module):
    # mlx-lm's Gemma 4 predicate puts router.proj at 8-bit g64; the QAT checkpoints also have the
    # dense MLP at 8-bit g64 (mlx-semantics 4.6). Everything else gets the default (4-bit g32).
    if path.endswith("router.proj") or ".mlp." in path:
        return {"group_size": 64, "bits": 8}
    return True


def randomize(text_model):
    """Random norms, router scales and layer scalars, so that every parameter matters to the output."""
    for layer in text_model.layers:
        for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm", "post_feedforward_layernorm_1",
                     "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2"):
            norm = getattr(layer, name)
            norm.weight = 1.0 + 0.2 * mx.random.normal(norm.weight.shape)
        layer.router.scale = 1.0 + 0.1 * mx.random.normal(layer.router.scale.shape)
        layer.router.per_expert_scale = 1.0 + 0.2 * mx.random.normal(layer.router.per_expert_scale.shape)
        layer.layer_scalar = 0.5 + mx.random.uniform(shape=(1,))


def ffn(layer, h):
    """DecoderLayer.__call__ from `residual = h` (the MoE branch), attention excluded."""
    residual = h
    h1 = layer.pre_feedforward_layernorm(h)
    h1 = layer.mlp(h1)
    h1 = layer.post_feedforward_layernorm_1(h1)
    top_k_indices, top_k_weights = layer.router(h)
    h2 = layer.pre_feedforward_layernorm_2(h)
    h2 = layer.experts(h2, top_k_indices, top_k_weights)
    h2 = layer.post_feedforward_layernorm_2(h2)
    h = layer.post_feedforward_layernorm(h1 + h2)
    h = residual + h
    return h * layer.layer_scalar, top_k_indices


def router_logits(layer, h):
    r = layer.router
    x = mx.fast.rms_norm(h, r.scale * r._root_size, r.eps)
    return r.proj(x)


def well_separated(logits, k):
    if k >= logits.shape[-1]:  # every expert is picked: nothing to separate
        return mx.ones(logits.shape[:-1], dtype=mx.bool_)
    s = mx.sort(logits.astype(mx.float32), axis=-1)
    gap = s[:, -k] - s[:, -k - 1]
    big = mx.max(mx.abs(logits.astype(mx.float32)), axis=-1)
    return gap >= TOPK_MARGIN * big


def float32_twin(twin, model):
    """`twin` (a fresh model of model's class, quantized the same way) given model's codes and every
    float parameter of model widened to float32."""
    twin.update(tree_map(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p,
                         model.parameters()))
    mx.eval(twin.parameters())
    return twin


def separated_tokens(T, H, keep):
    """T bf16 rows of 2 N(0, 1), drawn 64 at a time; keep(candidates) -> a bool per row says which
    may be used (their router's top-k does not hinge on rounding)."""
    rows = []
    while len(rows) < T:
        cand = (2.0 * mx.random.normal((64, H))).astype(mx.bfloat16)
        ok = keep(cand)
        for i in range(64):
            if ok[i].item() and len(rows) < T:
                rows.append(cand[i])
    return mx.stack(rows)


def main(out_dir):
    mx.set_default_device(mx.cpu)
    mx.random.seed(SEED)
    args = gemma4_text.ModelArgs.from_dict(CONFIG)
    model = gemma4_text.Model(args)
    randomize(model.model)
    model.set_dtype(mx.bfloat16)
    model, config = quantize_model(model, dict(CONFIG), group_size=32, bits=4, quant_predicate=predicate)
    mx.eval(model.parameters())

    ckpt = os.path.join(out_dir, "gemma4_tiny_ckpt")
    os.makedirs(ckpt, exist_ok=True)
    save_model(ckpt, model)
    save_config(config, os.path.join(ckpt, "config.json"))

    # Float32 twin: same codes, every float parameter widened.
    twin, _ = quantize_model(gemma4_text.Model(args), dict(CONFIG), group_size=32, bits=4, quant_predicate=predicate)
    twin = float32_twin(twin, model)

    k = CONFIG["top_k_experts"]
    H = CONFIG["hidden_size"]
    tensors, metadata = {}, {"format": "mlx"}
    for li in range(CONFIG["num_hidden_layers"]):
        layer, layer32 = model.model.layers[li], twin.model.layers[li]
        for T in (3, 40):
            h = separated_tokens(T, H, lambda cand: well_separated(router_logits(layer, cand), k) & well_separated(
                router_logits(layer32, cand.astype(mx.float32)), k))
            out, _ = ffn(layer, h)
            out32, idx32 = ffn(layer32, h.astype(mx.float32))
            key = f"l{li}.t{T}"
            tensors[f"{key}.h"] = h
            tensors[f"{key}.out"] = out
            tensors[f"{key}.f32_out"] = out32
            tensors[f"{key}.indices"] = idx32.astype(mx.int32)
            metadata[f"case.l{li}_t{T}"] = f"layer={li} T={T}"
    mx.eval(tensors)
    mx.save_safetensors(os.path.join(out_dir, "gemma4_layer_ffn.safetensors"), tensors, metadata=metadata)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
