#!/usr/bin/env python3
"""Writes the Qwen3-MoE goldens checked by tests/cpu_golden_qwen3_test.cpp.

Usage: make_qwen3_goldens.py OUTDIR   (needs `pip install mlx[cpu] mlx-lm`; runs on MLX's CPU stream)

Outputs (well under 1 MB together):
  qwen3_tiny_ckpt/   a tiny random mlx-lm qwen3_moe model (hidden 128, moe_intermediate 64, 8
      experts, top-k 2, 2 layers, every layer an MoE layer), quantized the mlx-lm way with
      mlx_lm.utils.quantize_model and the model's own quant_predicate (the router mlp.gate 8-bit
      g64, everything else 4-bit g64) and saved with mlx_lm.utils.save_model + save_config. Its
      experts are stored as mlx-lm stores them after sanitize(): model.layers.N.mlp.switch_mlp.
      {gate,up,down}_proj.{weight,scales,biases}.
  qwen3_layer_ffn.safetensors   per layer L and token count T (3: unsorted SwitchGLU path; 40:
      sorted, T*k >= 64): l<L>.t<T>.h (bf16 post-attention residual), .out (the bf16 layer's
      feed-forward output as mlx-lm computes it: h + mlp(post_attention_layernorm(h))), .f32_out
      (the same with every float parameter and h widened to float32, same codes), .indices (int32)
      and .weights (float32) of the f32 twin's router (the block's own steps: gate, softmax
      precise, argpartition, take, renormalise), and .no_renorm_f32_out / .no_renorm_weights: the
      f32 twin with norm_topk_prob = False. Metadata "case.l<L>_t<T>" = "layer=L T=T".

The feed-forward path is Qwen3MoeDecoderLayer.__call__ from `h = x + r` on: attention is not run,
h is fed directly. Why the float32 twins: MLX 0.32's CPU bf16 quantized matmul accumulates in bf16
(docs/numerics.md), so the tight bound compares against the f32 twin, the loose one against MLX's
own bf16 output.

Tokens are redrawn until the k-th and (k+1)-th router logits of every token are apart by 6% of the
token's largest |logit| under both the bf16 and the f32 model, so the expected top-k set does not
hinge on rounding (softmax is monotone: the same gap orders the probabilities).
"""
import importlib.util
import os
import sys

import mlx.core as mx
from mlx_lm.models import qwen3_moe
from mlx_lm.utils import quantize_model, save_config, save_model

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("layer_goldens", os.path.join(HERE, "make_layer_goldens.py"))
layer_goldens = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layer_goldens)  # well_separated (the 6% top-k margin), float32_twin, separated_tokens

SEED = 20261214
CONFIG = {
    "model_type": "qwen3_moe",
    "hidden_size": 128,
    "intermediate_size": 192,
    "moe_intermediate_size": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "vocab_size": 64,
    "rms_norm_eps": 1e-6,
}


def randomize(text_model):
    """Random post-attention norms, so that the norm weight matters to the output."""
    for layer in text_model.layers:
        norm = layer.post_attention_layernorm
        norm.weight = 1.0 + 0.2 * mx.random.normal(norm.weight.shape)


def routing(block, x):
    """Qwen3MoeSparseMoeBlock.__call__'s router steps: the experts and their scores."""
    gates = mx.softmax(block.gate(x), axis=-1, precise=True)
    k = block.top_k
    inds = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if block.norm_topk_prob:
        scores /= mx.sum(scores, axis=-1, keepdims=True)
    return inds, scores


def ffn(layer, h):
    """Qwen3MoeDecoderLayer.__call__ from `h = x + r` on (the MoE branch), attention excluded."""
    return h + layer.mlp(layer.post_attention_layernorm(h))


def main(out_dir):
    mx.set_default_device(mx.cpu)
    mx.random.seed(SEED)
    args = qwen3_moe.ModelArgs.from_dict(CONFIG)
    model = qwen3_moe.Model(args)
    randomize(model.model)
    model.set_dtype(mx.bfloat16)
    model, config = quantize_model(model, dict(CONFIG), group_size=64, bits=4, quant_predicate=model.quant_predicate)
    mx.eval(model.parameters())

    ckpt = os.path.join(out_dir, "qwen3_tiny_ckpt")
    os.makedirs(ckpt, exist_ok=True)
    save_model(ckpt, model)
    save_config(config, os.path.join(ckpt, "config.json"))

    # Float32 twin: same codes, every float parameter widened.
    twin = qwen3_moe.Model(args)
    twin, _ = quantize_model(twin, dict(CONFIG), group_size=64, bits=4, quant_predicate=twin.quant_predicate)
    twin = layer_goldens.float32_twin(twin, model)

    k = CONFIG["num_experts_per_tok"]
    H = CONFIG["hidden_size"]
    tensors, metadata = {}, {"format": "mlx"}
    for li in range(CONFIG["num_hidden_layers"]):
        layer, layer32 = model.model.layers[li], twin.model.layers[li]
        for T in (3, 40):
            def keep(cand):
                x, x32 = layer.post_attention_layernorm(cand), layer32.post_attention_layernorm(cand.astype(mx.float32))
                return layer_goldens.well_separated(layer.mlp.gate(x), k) & layer_goldens.well_separated(
                    layer32.mlp.gate(x32), k)

            h = layer_goldens.separated_tokens(T, H, keep)
            h32 = h.astype(mx.float32)
            key = f"l{li}.t{T}"
            tensors[f"{key}.h"] = h
            tensors[f"{key}.out"] = ffn(layer, h)
            tensors[f"{key}.f32_out"] = ffn(layer32, h32)
            inds, scores = routing(layer32.mlp, layer32.post_attention_layernorm(h32))
            tensors[f"{key}.indices"] = inds.astype(mx.int32)
            tensors[f"{key}.weights"] = scores.astype(mx.float32)
            layer32.mlp.norm_topk_prob = False
            tensors[f"{key}.no_renorm_f32_out"] = ffn(layer32, h32)
            _, scores = routing(layer32.mlp, layer32.post_attention_layernorm(h32))
            tensors[f"{key}.no_renorm_weights"] = scores.astype(mx.float32)
            layer32.mlp.norm_topk_prob = True
            metadata[f"case.l{li}_t{T}"] = f"layer={li} T={T}"
    mx.eval(tensors)
    mx.save_safetensors(os.path.join(out_dir, "qwen3_layer_ffn.safetensors"), tensors, metadata=metadata)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
