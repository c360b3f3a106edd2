#!/usr/bin/env python3
"""MLX alone against MLX + expertqmm (expertqmm.mlx.patch), in one process, on mlx-lm's Gemma 4.

Two cases per token count T, each timed unpatched ("mlx") and patched ("mlx+expertqmm") on the same
modules and inputs:
  - moe_layer: one decoder layer's MoE block as mlx-lm runs it, experts(x, *router(h)) (router,
    SwitchGLU with gather_qmm, weighted sum);
  - model_forward: the text model's forward (embedding, every decoder layer with MLX's own attention
    and dense MLP, final norm; the vocabulary projection is left out) over T tokens, no KV cache.
Weights: mlx-lm's random init, cast to bf16, quantized 4-bit (group 64) per layer as mlx-lm's
convert does (nn.quantize). The default preset is Gemma 4 26B-A4B's geometry with 30 layers
(shared/spec/gemma4-moe.md); --tiny is a small one that runs on a CPU in seconds.
Protocol: per (case, T, peer): 2 warm-up calls, then --reps calls each timed by the host wall
clock around the call, mx.eval of its output and mx.synchronize(); median / p10 / p90.
Check (moe_layer rows), in bf16 as timed: (1) the experts on MLX's own routing, ours against MLX's,
relative Frobenius error <= 5e-2 (docs/numerics.md: anything vs MLX's own bf16 output); (2) the
fused block: at most max(1, T/10) tokens off MLX's output by more than 5e-2 each. A token whose k-th
and (k+1)-th router logits sit within rounding of each other may pick another expert on either side
(2.5% of tokens at the real geometry, docs/numerics.md), so (2) counts tokens instead of bounding
the whole output. Every row records its error and the share of tokens within 5e-2.

  python3 bench/python/bench_mlx.py --json out/bench-mlx.json            # the GPU (MLX's default device)
  python3 bench/python/bench_mlx.py --tiny --device cpu --json out.json   # small, anywhere
"""
import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time

import mlx.core as mx
import mlx.nn as nn

import expertqmm.mlx as eqmlx

eqmlx.import_mlx_lm_models()
from mlx_lm.models import gemma4_text  # noqa: E402

PRESETS = {
    # Gemma 4 26B-A4B (shared/spec/gemma4-moe.md), 30 layers.
    "gemma4-26b-a4b": dict(hidden_size=2816, num_hidden_layers=30, intermediate_size=2112, num_attention_heads=16,
                           head_dim=256, global_head_dim=512, num_key_value_heads=8, num_global_key_value_heads=2,
                           attention_k_eq_v=True, sliding_window=1024, sliding_window_pattern=6,
                           vocab_size=262144, vocab_size_per_layer_input=262144, hidden_size_per_layer_input=0,
                           num_kv_shared_layers=0, enable_moe_block=True, num_experts=128, top_k_experts=8,
                           moe_intermediate_size=704),
    "tiny": dict(hidden_size=256, num_hidden_layers=2, intermediate_size=256, num_attention_heads=2, head_dim=64,
                 global_head_dim=128, num_key_value_heads=1, num_global_key_value_heads=1, sliding_window=64,
                 sliding_window_pattern=2, vocab_size=512, vocab_size_per_layer_input=512,
                 hidden_size_per_layer_input=0, num_kv_shared_layers=0, enable_moe_block=True, num_experts=16,
                 top_k_experts=4, moe_intermediate_size=128),
}
PEERS = ("mlx", "mlx+expertqmm")
BOUND = 5e-2  # vs MLX's own bf16 output (docs/numerics.md); also what a token "agrees" within


def build_model(preset, bits, group_size, seed):
    """mlx-lm's Gemma 4 text model with random weights, bf16, quantized one layer at a time (so the
    float weights of only one layer are ever materialized)."""
    mx.random.seed(seed)
    model = gemma4_text.Model(gemma4_text.ModelArgs(**PRESETS[preset]))
    model.set_dtype(mx.bfloat16)
    for layer in model.model.layers:
        layer.router.scale = mx.random.uniform(0.5, 1.5, layer.router.scale.shape).astype(mx.bfloat16)
        layer.router.per_expert_scale = mx.random.uniform(0.5, 1.5, layer.router.per_expert_scale.shape).astype(
            mx.bfloat16)
        nn.quantize(layer, group_size=group_size, bits=bits)
        mx.eval(layer.parameters())
    nn.quantize(model.model, group_size=group_size, bits=bits,
                class_predicate=lambda path, m: path == "embed_tokens" and hasattr(m, "to_quantized"))
    mx.eval(model.parameters())
    return model


def time_call(fn, reps):
    """Host wall clock of fn + mx.eval + mx.synchronize, after 2 warm-up calls: (median, p10, p90) us, output."""
    out = None
    for _ in range(2):
        out = fn()
        mx.eval(out)
    mx.synchronize()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        mx.eval(out)
        mx.synchronize()
        samples.append((time.perf_counter() - t0) * 1e6)
    samples.sort()
    pick = lambda q: samples[min(len(samples) - 1, int(q * (len(samples) - 1) + 0.5))]  # noqa: E731
    return statistics.median(samples), pick(0.1), pick(0.9), out


def rel_err(out, ref):
    o, r = out.astype(mx.float32), ref.astype(mx.float32)
    return float(mx.sqrt(mx.sum((o - r) ** 2)) / mx.maximum(mx.sqrt(mx.sum(r * r)), 1e-30))


def run_case(case, model, T, reps, seed):
    """Rows of both peers for one case at T tokens."""
    H = model.args.hidden_size
    key = mx.random.key(seed + T)
    if case == "moe_layer":
        layer = model.model.layers[0]
        h = mx.random.normal((1, T, H), key=key).astype(mx.bfloat16)
        x = mx.random.normal((1, T, H), key=mx.random.split(key)[1]).astype(mx.bfloat16)
        target, fn = layer, (lambda: layer.experts(x, *layer.router(h)))
    else:
        tokens = mx.random.randint(0, model.args.vocab_size, (1, T), key=key)
        target, fn = model, (lambda: model.model(tokens))
    rows, outs = [], {}
    for peer in PEERS:
        if peer == "mlx+expertqmm":
            swapped = eqmlx.patch(target)
            assert swapped, f"expertqmm.mlx.patch swapped nothing in {case}"
        try:
            med, p10, p90, outs[peer] = time_call(fn, reps)
        finally:
            eqmlx.unpatch(target)
        rows.append({"case": case, "tokens": T, "peer": peer, "us_median": med, "us_p10": p10, "us_p90": p90,
                     "tokens_per_s": T / (med * 1e-6)})
    ours, ref = outs["mlx+expertqmm"].reshape(T, H), outs["mlx"].reshape(T, H)
    agreeing = sum(rel_err(ours[t], ref[t]) <= BOUND for t in range(T))
    rows[1].update({"speedup": rows[0]["us_median"] / rows[1]["us_median"], "rel_err_vs_mlx": rel_err(ours, ref),
                    "tokens_within_5e-2": agreeing / T})
    if case == "moe_layer":
        idx, w = layer.router(h)  # MLX's routing, for both
        ref_experts = layer.experts(x, idx, w)
        eqmlx.patch(layer)
        try:
            ours_experts = layer.experts(x, idx, w)  # the patched experts given a routing: SwitchGLU primitive
        finally:
            eqmlx.unpatch(layer)
        err = rel_err(ours_experts, ref_experts)
        ok = err <= BOUND and T - agreeing <= max(1, T // 10)
        rows[1].update({"rel_err_same_routing": err, "check": "PASS" if ok else "FAIL"})
    return rows


def table(result):
    lines = [f"{'case':>13} {'tokens':>6} {'mlx us':>12} {'+expertqmm us':>14} {'speedup':>8} {'tok/s (ours)':>13} "
             f"{'bf16 agree':>10} check"]
    by = {}
    for r in result["rows"]:
        by.setdefault((r["case"], r["tokens"]), {})[r["peer"]] = r
    for (case, T), peers in sorted(by.items()):
        a, b = peers["mlx"], peers["mlx+expertqmm"]
        lines.append(f"{case:>13} {T:>6} {a['us_median']:>12.1f} {b['us_median']:>14.1f} {b['speedup']:>7.2f}x "
                     f"{b['tokens_per_s']:>13.0f} {b['tokens_within_5e-2']:>10.0%} {b.get('check', '-')}")
    return "\n".join(lines)


def commit():
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the tiny preset (CPU-sized)")
    ap.add_argument("--device", choices=("default", "cpu", "gpu"), default="default",
                    help="MLX device (default: MLX's default device)")
    ap.add_argument("--tokens", default=None, help="comma-separated token counts (default 1,8,512,2048)")
    ap.add_argument("--cases", default="moe_layer,model_forward", help="moe_layer and/or model_forward")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per row (default 20, --tiny 3)")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.device != "default":
        mx.set_default_device(mx.cpu if args.device == "cpu" else mx.gpu)
    preset = "tiny" if args.tiny else "gemma4-26b-a4b"
    tokens = [int(t) for t in (args.tokens or "1,8,512,2048").split(",")]
    reps = args.reps or (3 if args.tiny else 20)
    model = build_model(preset, args.bits, args.group_size, args.seed)
    rows = []
    for case in args.cases.split(","):
        for T in tokens:
            rows += run_case(case, model, T, reps, args.seed)
    result = {"bench": "bench_mlx.py", "preset": preset, "layers": model.args.num_hidden_layers, "bits": args.bits,
              "group_size": args.group_size, "device": str(mx.default_device()), "mlx": mx.__version__,
              "commit": commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "protocol": f"2 warm-up, {reps} timed calls; host wall clock around call + mx.eval + mx.synchronize; "
                          "median/p10/p90",
              "rows": rows}
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if any(r.get("check") == "FAIL" for r in rows):
        sys.exit("bench_mlx.py: a patched MoE layer is off MLX's output (check FAIL above)")


if __name__ == "__main__":
    main()
