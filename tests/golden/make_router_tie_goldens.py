#!/usr/bin/env python3
"""Writes router_ties.safetensors: mlx-lm's Gemma 4 Router on tokens whose k-th place is an exact tie.

Usage: make_router_tie_goldens.py OUTDIR   (needs `pip install mlx[cpu] mlx-lm`; runs on MLX's CPU stream)

The router (E=16 experts, H=64) has proj rows that repeat: experts in one group share one row, so
their logits are equal bit for bit in any implementation that computes each logit the same way
(groups of 3, 2 and 1 experts, ids scattered so a tie is never just two neighbours). Tokens are
drawn until, under the case's router, the group holding the k-th place has members on both sides
of it (an exact tie at the k-th place decides which experts are picked) and the distinct logits
around it are apart by TOPK_MARGIN of the token's largest |logit| (so the ranking of the groups does
not hinge on rounding). MLX keeps the higher expert id of a tie; the generator asserts that on
every token, so the file itself records MLX's rule.

Weights: bf16 values (proj, its 8-bit group-64 quantization, scale, per_expert_scale), stored once
per dtype: bf16.* as they are and f32.* widened to float32 (same numbers, float32 routers).
  <dtype>.proj (dense [E, H]); <dtype>.proj_q.w / .scales / .biases (8-bit g64); <dtype>.scale [H];
  <dtype>.per_expert_scale [E]
Cases, metadata "case.<dtype>_<proj>_k<k>" = "dtype=f32|bf16 quantized=0|1 top_k=k T=..":
  <case>.h [T, H] (the router input), <case>.indices [T, k] int32 and <case>.weights [T, k] (MLX's
  Router output: slots in argpartition's order, which MLX does not promise).
"""
import os
import sys

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4_text

SEED = 20261212
E, H, T = 16, 64, 8
TOPK_MARGIN = 0.06
# Expert e uses proj row GROUP[e]: groups 0 and 1 have three experts, 2..5 two, 6 and 7 one.
GROUP = [0, 2, 1, 0, 3, 4, 1, 5, 2, 6, 3, 0, 7, 5, 4, 1]


def make_router(proj, scale, per_expert_scale):
    args = gemma4_text.ModelArgs(
        hidden_size=H, num_hidden_layers=1, intermediate_size=128, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, global_head_dim=32, num_kv_shared_layers=0,
        hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=E, top_k_experts=1,
        moe_intermediate_size=64)
    router = gemma4_text.Router(args)
    router.proj.weight = proj
    router.scale = scale
    router.per_expert_scale = per_expert_scale
    return router


def logits_of(router, h):
    """The scores mlx-lm's Router ranks (Router.__call__ up to the argpartition), as float32."""
    r = mx.fast.rms_norm(h, router.scale * router._root_size, router.eps)
    return router.proj(r).astype(mx.float32)


def tie_at_kth(scores, k):
    """True when the group holding the k-th place straddles it and the groups are well apart."""
    order = sorted(range(E), key=lambda e: (scores[e], e), reverse=True)
    kth = scores[order[k - 1]]
    inside = sum(1 for e in order[:k] if scores[e] == kth)
    outside = sum(1 for e in order[k:] if scores[e] == kth)
    if inside == 0 or outside == 0:
        return False
    distinct = sorted(set(scores), reverse=True)
    gaps = [a - b for a, b in zip(distinct, distinct[1:])]
    big = max(abs(s) for s in scores)
    return min(gaps) >= TOPK_MARGIN * big


def higher_id_top_k(scores, k):
    return set(sorted(range(E), key=lambda e: (scores[e], e), reverse=True)[:k])


def lower_id_top_k(scores, k):
    return set(sorted(range(E), key=lambda e: (scores[e], -e), reverse=True)[:k])


def main(out_dir):
    mx.set_default_device(mx.cpu)
    key = mx.random.key(SEED)
    k_rows, k_scale, k_pes, key = mx.random.split(key, 4)
    rows = 0.3 * mx.random.normal((max(GROUP) + 1, H), key=k_rows)
    proj = rows[mx.array(GROUP)].astype(mx.bfloat16)
    scale = (1.0 + 0.2 * mx.random.normal((H,), key=k_scale)).astype(mx.bfloat16)
    per_expert_scale = mx.random.uniform(0.5, 1.5, (E,), key=k_pes).astype(mx.bfloat16)

    arrays, metadata = {}, {"mlx": mx.__version__, "generator": "tests/golden/make_router_tie_goldens.py"}
    for tag, dtype in (("f32", mx.float32), ("bf16", mx.bfloat16)):
        arrays[f"{tag}.proj"] = proj.astype(dtype)
        arrays[f"{tag}.scale"] = scale.astype(dtype)
        arrays[f"{tag}.per_expert_scale"] = per_expert_scale.astype(dtype)
        # Quantized from the bf16 weight (as mlx-lm converts), then scales/biases widened.
        wq, sq, bq = mx.quantize(proj, group_size=64, bits=8)
        arrays[f"{tag}.proj_q.w"] = wq
        arrays[f"{tag}.proj_q.scales"] = sq.astype(dtype)
        arrays[f"{tag}.proj_q.biases"] = bq.astype(dtype)
        for quantized in (False, True):
            router = make_router(arrays[f"{tag}.proj"], arrays[f"{tag}.scale"], arrays[f"{tag}.per_expert_scale"])
            if quantized:
                nn.quantize(router, group_size=64, bits=8)  # then the stored codes, scales, biases
                router.proj.weight = wq
                router.proj.scales = arrays[f"{tag}.proj_q.scales"]
                router.proj.biases = arrays[f"{tag}.proj_q.biases"]
            for k in (1, 3):
                router.config.top_k_experts = k
                rows_h = []
                for _ in range(200):
                    key, sub = mx.random.split(key)
                    cand = (2.0 * mx.random.normal((64, H), key=sub)).astype(dtype)
                    scores = logits_of(router, cand).tolist()
                    rows_h += [cand[i] for i in range(64) if tie_at_kth(scores[i], k)]
                    if len(rows_h) >= T:
                        break
                if len(rows_h) < T:
                    raise RuntimeError(f"too few tokens with a tie at place {k} ({tag}, quantized={quantized})")
                h = mx.stack(rows_h[:T])
                idx, w = router(h)
                scores = logits_of(router, h).tolist()
                for t, picked in enumerate(idx.tolist()):
                    want, other = higher_id_top_k(scores[t], k), lower_id_top_k(scores[t], k)
                    assert set(picked) == want and want != other, (tag, quantized, k, t, picked, want, other)
                name = f"{tag}_{'q8' if quantized else 'dense'}_k{k}"
                arrays.update({f"{name}.h": h, f"{name}.indices": idx.astype(mx.int32), f"{name}.weights": w})
                metadata[f"case.{name}"] = f"dtype={tag} quantized={int(quantized)} top_k={k} T={T}"
    mx.eval(arrays)
    mx.save_safetensors(os.path.join(out_dir, "router_ties.safetensors"), arrays, metadata=metadata)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
