#!/usr/bin/env python3
"""Writes tiny Gemma 4 checkpoints that mlx-lm itself quantizes per module in other ways than the
default, and mlx-lm's feed-forward outputs on them, checked by tests/cpu_golden_checkpoints_test.cpp.

Usage: make_checkpoint_goldens.py OUTDIR   (needs `pip install mlx[cpu] mlx-lm`; runs on MLX's CPU stream)

Checkpoints (hidden 128, 8 experts, top-k 2; saved with mlx_lm.utils.save_model + save_config, and
reloaded with mlx_lm.utils.load_model, whose output must equal the saved model's: so each one is a
checkpoint mlx-lm loads as written):
  gemma4_dense_mlp_ckpt/   gemma4_text, 1 layer. quant_predicate skips ".mlp.": the dense MLP stays bf16
      and config.json says nothing about it (quantize_model writes no entry for a skipped module);
      router.proj's entry is {"bits": 8} (no group_size: to_quantized's default 64), the rest 4-bit g64.
  gemma4_mixed_bits_ckpt/  gemma4 (the multimodal wrapper: text_config, names language_model.model.*), 2
      layers: per-module bits and group sizes that differ per projection and per layer, layer 1's
      mlp.up_proj left bf16, and config.json rewritten by mlx-lm's AWQ update_config, which lists
      every leaf module: a dict for each quantized one, `false` for the others.
  gemma4_bf16_down_ckpt/   gemma4_text, 1 layer, expert width 80 with group size 64: quantize_model
      leaves the experts' down_proj (80 inputs, not a multiple of 64) in bf16 with no config entry
      (an unquantized SwitchLinear: MLX gather_mm); gate and up are 4-bit g64, router.proj 8-bit g64.
  gemma4_one_expert_ckpt/  gemma4_text, 1 layer, a single expert and top-1 (num_experts 1,
      top_k_experts 1): every token goes to expert 0 with weight per_expert_scale[0].
  gemma4_fp_modes_ckpt/    gemma4_text, 1 layer, quantize_model(mode="mxfp4"): the default mxfp4 (experts'
      gate and up), the experts' down_proj nvfp4 (group 16), the dense MLP {"mode": "mxfp8"} (bits
      and group size from the mode), router.proj {"group_size": 64, "bits": 8} (no mode: affine).
(No golden for T = 0: MLX 0.32.4's CPU quantized_matmul stops the process with SIGFPE on an input
with zero rows, so mlx-lm's router.proj cannot run it; gather_qmm and the dense router give the
empty shapes, [0, H] and [0, k], which is what expertqmm returns.)
<name>_ffn.safetensors (for <name>_ckpt), per layer L and token count T (3: unsorted SwitchGLU; 40: sorted):
  l<L>.t<T>.h (bf16 post-attention residual), .f32_out (the layer's feed-forward output with every
  float parameter and h widened to float32, same codes), .indices (the f32 twin's router choice,
  int32), and .out (mlx-lm's own bf16 output) where MLX can compute it: MLX 0.32's CPU gather_mm is
  float32-only, so a bf16 checkpoint with 16-bit experts has no .out (metadata mlx_bf16=0).
  Metadata "case.l<L>_t<T>" = "layer=L T=T mlx_bf16=0|1".
"""
import copy
import importlib.util
import os
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models import gemma4, gemma4_text
from mlx_lm.quant import awq
from mlx_lm.utils import load_model, quantize_model, save_config, save_model

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("layer_goldens", os.path.join(HERE, "make_layer_goldens.py"))
layer_goldens = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layer_goldens)  # CONFIG, randomize, ffn, router_logits, well_separated

SEED = 20261213
# The text config of make_layer_goldens.py, smaller: one full-attention layer, MLP 64 wide, vocab 32.
TEXT = dict(layer_goldens.CONFIG, intermediate_size=64, num_hidden_layers=1, vocab_size=32,
            vocab_size_per_layer_input=32, layer_types=["full_attention"])


def mlx_lm_predicate(path, module):
    """mlx-lm's own Gemma 4 quant_predicate (gemma4_text.Model.quant_predicate)."""
    return {"group_size": 64, "bits": 8} if path.endswith("router.proj") else True


def dense_mlp_predicate(path, module):
    if ".mlp." in path:
        return False
    return {"bits": 8} if path.endswith("router.proj") else True


MIXED = {  # per-module settings of ckpt_mixed_bits, by layer; missing: the default
    0: {"experts.switch_glu.gate_proj": {"group_size": 32, "bits": 3},
        "experts.switch_glu.up_proj": {"group_size": 128, "bits": 6},
        "experts.switch_glu.down_proj": {"group_size": 64, "bits": 2},
        "mlp.gate_proj": {"bits": 8},
        "mlp.down_proj": {"group_size": 32, "bits": 5},
        "router.proj": {"group_size": 64, "bits": 8}},
    1: {"experts.switch_glu.gate_proj": {"group_size": 128, "bits": 8},
        "experts.switch_glu.down_proj": {"group_size": 32, "bits": 5},
        "mlp.up_proj": False,
        "router.proj": {"group_size": 32, "bits": 6}},
}


def mixed_predicate(path, module):
    for layer, modules in MIXED.items():
        for name, setting in modules.items():
            if path.endswith(f"layers.{layer}.{name}"):
                return copy.deepcopy(setting)
    return True


def fp_modes_predicate(path, module):
    if path.endswith("router.proj"):
        return {"group_size": 64, "bits": 8}
    if ".mlp." in path:
        return {"mode": "mxfp8"}
    # SwitchLinear.to_quantized defaults to group 64 / 4 bits whatever the mode: spell them out.
    return {"group_size": 16, "bits": 4, "mode": "nvfp4"} if path.endswith("switch_glu.down_proj") else True


def layers_of(model):
    return model.language_model.model.layers if hasattr(model, "language_model") else model.model.layers


def write(out_dir, name, config, predicate, group_size, list_every_module=False, mlx_bf16=True, mode="affine"):
    """Builds, quantizes (mlx-lm's quantize_model) and saves checkpoint `name`, then its goldens."""
    wrapped = config.get("model_type") == "gemma4"
    model = (gemma4.Model(gemma4.ModelArgs.from_dict(config)) if wrapped else
             gemma4_text.Model(gemma4_text.ModelArgs.from_dict(config)))
    layer_goldens.randomize(model.language_model.model if wrapped else model.model)
    model.set_dtype(mx.bfloat16)
    model, qconfig = quantize_model(model, copy.deepcopy(config), group_size=group_size, bits=4, mode=mode,
                                    quant_predicate=predicate)
    if list_every_module:
        qconfig = awq.update_config(model, qconfig)
    mx.eval(model.parameters())
    ckpt = os.path.join(out_dir, f"{name}_ckpt")
    os.makedirs(ckpt, exist_ok=True)
    save_model(ckpt, model)
    save_config(qconfig, os.path.join(ckpt, "config.json"))
    # mlx-lm's own loader on the files: the reload must compute what the saved model computes.
    reloaded, _ = load_model(Path(ckpt))
    twin, _ = load_model(Path(ckpt))  # float32 twin: same codes, every float parameter widened
    twin.update(tree_map(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p,
                         model.parameters()))
    mx.eval(twin.parameters())

    k, H = config.get("text_config", config)["top_k_experts"], config.get("text_config", config)["hidden_size"]
    tensors, metadata = {}, {"format": "mlx", "mlx": mx.__version__,
                             "generator": "tests/golden/make_checkpoint_goldens.py"}
    for li, (layer, layer32, again) in enumerate(zip(layers_of(model), layers_of(twin), layers_of(reloaded))):
        for T in (3, 40):
            rows = []
            while len(rows) < T:
                cand = (2.0 * mx.random.normal((64, H))).astype(mx.bfloat16)
                ok = layer_goldens.well_separated(layer_goldens.router_logits(layer32, cand.astype(mx.float32)), k)
                if mlx_bf16:
                    ok = ok & layer_goldens.well_separated(layer_goldens.router_logits(layer, cand), k)
                rows += [cand[i] for i in range(64) if ok[i].item()][: T - len(rows)]
            h = mx.stack(rows)
            out32, idx32 = layer_goldens.ffn(layer32, h.astype(mx.float32))
            key = f"l{li}.t{T}"
            tensors.update({f"{key}.h": h, f"{key}.f32_out": out32, f"{key}.indices": idx32.astype(mx.int32)})
            if mlx_bf16:
                out, _ = layer_goldens.ffn(layer, h)
                assert mx.array_equal(out, layer_goldens.ffn(again, h)[0]).item(), f"{name}: the reload differs"
                tensors[f"{key}.out"] = out
            else:
                twin_again = layer_goldens.ffn(layers_of(twin)[li], h.astype(mx.float32))[0]
                assert mx.array_equal(out32, twin_again).item()
            metadata[f"case.l{li}_t{T}"] = f"layer={li} T={T} mlx_bf16={int(mlx_bf16)}"
    mx.eval(tensors)
    mx.save_safetensors(os.path.join(out_dir, f"{name}_ffn.safetensors"), tensors, metadata=metadata)


def main(out_dir):
    mx.set_default_device(mx.cpu)
    mx.random.seed(SEED)
    write(out_dir, "gemma4_dense_mlp", TEXT, dense_mlp_predicate, 64)
    mixed = {"model_type": "gemma4", "vocab_size": 32,
             "text_config": dict(TEXT, model_type="gemma4_text", num_hidden_layers=2,
                                 layer_types=["sliding_attention", "full_attention"])}
    write(out_dir, "gemma4_mixed_bits", mixed, mixed_predicate, 64, list_every_module=True)
    bf16_down = dict(TEXT, moe_intermediate_size=80)
    write(out_dir, "gemma4_bf16_down", bf16_down, mlx_lm_predicate, 64, mlx_bf16=False)
    write(out_dir, "gemma4_one_expert", dict(TEXT, num_experts=1, top_k_experts=1), mlx_lm_predicate, 64)
    write(out_dir, "gemma4_fp_modes", TEXT, fp_modes_predicate, 32, mode="mxfp4")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
