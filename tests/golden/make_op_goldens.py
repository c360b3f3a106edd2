#!/usr/bin/env python3
"""Writes the op goldens that tests/cpu_golden_ops_test.cpp checks expertqmm against.

Usage: make_op_goldens.py OUTDIR   (needs `pip install mlx[cpu] mlx-lm`; runs on MLX's CPU stream)

Files written (small on purpose; all together well under 1.5 MB):
  ops_gather_qmm.safetensors   mx.gather_qmm on hand-picked cases. Case <c> stores
      gqmm.<c>.x / .w / .scales / .biases (affine only: the fp modes mxfp4 / mxfp8 / nvfp4 have
      uint8 scales and no biases), optionally .lhs / .rhs (int32), and two results:
      gqmm.<c>.out      MLX's bf16 result as it is (see below);
      gqmm.<c>.out_f32  the same call with x, scales and biases widened to float32 first.
      Its parameters are the metadata entry "case.<c>" = "bits=.. group_size=.. transpose=0|1
      sorted_indices=0|1 mode=.." (the convention of tests/support/golden.h).
  mlxlm_gemma4_moe.safetensors  mlx-lm gemma4_text Router + Experts (SwitchGLU with GeGLU) on a
      tiny random config, T=3 (unsorted SwitchGLU path) and T=40 (sorted path, T*k >= 64).
      Shared weights under router.* and experts.*, metadata "case.t<T>" = "T=.. top_k=..
      router_bits=.. router_group_size=.. expert_bits=.. expert_group_size=..". Per run: inputs
      t<T>.h (router input) and t<T>.x (expert input); outputs of the bf16 modules as they run:
      t<T>.indices (int32), .weights, .y (switch_glu, [T,k,D]), .out (combined, [T,D]),
      .dense_indices / .dense_weights (router with an unquantized bf16 proj); and the same
      outputs of float32 twins of the modules (same bf16 values widened, same codes):
      t<T>.f32_indices, .f32_weights, .f32_y, .f32_out, .f32_dense_indices, .f32_dense_weights.

Why the float32 twins: on the CPU stream (0.32.x) MLX's bf16 quantized matmul dequantizes in bf16
and accumulates in bf16, one rounding per multiply-add (measured: it reproduces MLX's output bit
for bit), so its bf16 results sit ~2% (norm-wise) from the exact product. The spec (Metal/CUDA
tile kernels, docs/numerics.md) accumulates in fp32; the float32 twins give MLX's semantics
without that CPU-only accumulation error, and the tests compare against both.

The router inputs are redrawn per token until the k-th and (k+1)-th logits are clearly apart
under all four routers, so the top-k set does not hinge on rounding (MLX and expertqmm round the
router intermediates at different points).
"""
import os
import sys

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.models import gemma4_text

SEED = 20261129
# The k-th and (k+1)-th logits of every token differ by at least this fraction of the token's
# largest |logit|: above the ~2% error of MLX's bf16 CPU accumulation and far above the few-ulp
# differences the fp32 implementations' roundings cause.
TOPK_MARGIN = 0.06


def gather_qmm_cases():
    """(name, x shape, w logical shape [E.., N, K] or [E.., K, N], lhs, rhs, transpose, sorted, bits, gs)."""
    k = mx.random.key(SEED)
    keys = iter(mx.random.split(k, 256))

    def ids(shape, limit):
        return mx.random.randint(0, limit, shape, key=next(keys)).astype(mx.int32)

    cases = [
        # SwitchGLU unsorted form: x [T,1,1,K], rhs [T,k], implied lhs broadcast.
        ("rhs_only", (6, 1, 1, 128), (4, 48, 128), None, ids((6, 3), 4), True, False, 4, 64),
        # Both indices, broadcast against each other: lhs [4,1] x rhs [1,5] -> S = [4,5], M = 2.
        ("lhs_rhs_broadcast", (3, 2, 128), (5, 32, 128), ids((4, 1), 3), ids((1, 5), 5), True, False, 4, 64),
        # No indices, matching batch dims on both sides: identity over S = [2,3], M = 4.
        ("batch_dims", (2, 3, 4, 64), (2, 3, 16, 64), None, None, True, False, 4, 32),
        # transpose=False: w stored [E, K, N/..], groups run along N.
        ("transpose_false", (4, 3, 64), (3, 64, 128), None, ids((4,), 3), False, False, 4, 64),
        ("transpose_false_8bit", (4, 3, 64), (3, 64, 64), None, ids((4,), 3), False, False, 8, 32),
        # Sorted rows (SwitchGLU sorted form: x [R,1,K], rhs [R] non-decreasing).
        ("sorted_rows", (16, 1, 128), (4, 40, 128), None, mx.sort(ids((16,), 4)), True, True, 4, 64),
        # The promise broken: MLX's result does not depend on the flag, ours must not either.
        ("sorted_flag_unsorted_ids", (16, 1, 128), (4, 40, 128), None, ids((16,), 4), True, True, 4, 64),
        # Several rows per matrix (M = 5) with rhs only.
        ("multi_row", (3, 5, 128), (4, 24, 128), None, ids((3,), 4), True, False, 4, 128),
    ]
    # Every bits x group_size pair on a small SwitchGLU-shaped case.
    for bits in (2, 3, 4, 5, 6, 8):
        for gs in (32, 64, 128):
            cases.append((f"b{bits}_g{gs}", (5, 1, 1, 256), (3, 16, 256), None, ids((5, 2), 3), True, False, bits, gs))
    cases = [c + ("affine",) for c in cases]
    # The fp modes (each has one bits and one group size): SwitchGLU unsorted and sorted forms,
    # transpose=False, and both indices broadcast. Their indices come from a key stream of their own,
    # so that the affine cases above keep their inputs.
    fp_keys = iter(mx.random.split(mx.random.key(SEED + 7), 64))

    def fp_ids(shape, limit):
        return mx.random.randint(0, limit, shape, key=next(fp_keys)).astype(mx.int32)

    for mode, bits, gs in (("mxfp4", 4, 32), ("mxfp8", 8, 32), ("nvfp4", 4, 16)):
        cases += [
            (f"{mode}_rhs_only", (6, 1, 1, 128), (4, 48, 128), None, fp_ids((6, 3), 4), True, False, bits, gs, mode),
            (f"{mode}_sorted_rows", (16, 1, 128), (4, 40, 128), None, mx.sort(fp_ids((16,), 4)), True, True, bits, gs,
             mode),
            (f"{mode}_transpose_false", (4, 3, 64), (3, 64, 96), None, fp_ids((4,), 3), False, False, bits, gs, mode),
            (f"{mode}_lhs_rhs_broadcast", (3, 2, 64), (5, 32, 64), fp_ids((4, 1), 3), fp_ids((1, 5), 5), True, False, bits,
             gs, mode),
        ]
    return cases, keys


def write_gather_qmm(outdir):
    cases, keys = gather_qmm_cases()
    arrays, metadata = {}, {"mlx": mx.__version__, "generator": "tests/golden/make_op_goldens.py"}
    for name, xs, ws, lhs, rhs, transpose, sorted_indices, bits, gs, mode in cases:
        x = mx.random.normal(xs, key=next(keys)).astype(mx.bfloat16)
        w_dense = (0.05 * mx.random.normal(ws, key=next(keys))).astype(mx.bfloat16)
        p = f"gqmm.{name}."
        common = dict(lhs_indices=lhs, rhs_indices=rhs, transpose=transpose, group_size=gs, bits=bits,
                      sorted_indices=sorted_indices, mode=mode)
        if mode == "affine":
            wq, scales, biases = mx.quantize(w_dense, group_size=gs, bits=bits)
            arrays[p + "biases"] = biases
            out = mx.gather_qmm(x, wq, scales, biases, **common)
            out_f32 = mx.gather_qmm(x.astype(mx.float32), wq, scales.astype(mx.float32),
                                    biases.astype(mx.float32), **common)
        else:  # no biases; uint8 scales; MLX computes in x's dtype
            wq, scales = mx.quantize(w_dense, mode=mode)
            out = mx.gather_qmm(x, wq, scales, **common)
            out_f32 = mx.gather_qmm(x.astype(mx.float32), wq, scales, **common)
        arrays[p + "x"] = x
        arrays[p + "w"] = wq
        arrays[p + "scales"] = scales
        arrays[p + "out"] = out
        arrays[p + "out_f32"] = out_f32
        metadata["case." + name] = (f"bits={bits} group_size={gs} transpose={int(transpose)} "
                                    f"sorted_indices={int(sorted_indices)} mode={mode}")
        if lhs is not None:
            arrays[p + "lhs"] = lhs
        if rhs is not None:
            arrays[p + "rhs"] = rhs
    mx.eval(arrays)
    mx.save_safetensors(os.path.join(outdir, "ops_gather_qmm.safetensors"), arrays, metadata=metadata)


def router_logits(router, h):
    """The logits mlx-lm's Router ranks (same ops as Router.__call__ up to the argpartition)."""
    r = mx.fast.rms_norm(h, router.scale * router._root_size, router.eps)
    return router.proj(r).astype(mx.float32)


def redraw_close_tokens(routers, h, k, key):
    """Redraws rows of h until every router's k-th and (k+1)-th logits are TOPK_MARGIN apart."""
    for _ in range(1000):
        bad = mx.zeros((h.shape[0],), dtype=mx.bool_)
        for router in routers:
            logits = router_logits(router, h)
            top = mx.sort(logits, axis=-1)[:, ::-1]
            gap = top[:, k - 1] - top[:, k]
            scale = mx.max(mx.abs(logits), axis=-1)
            bad = mx.logical_or(bad, gap < TOPK_MARGIN * scale)
        if not mx.any(bad).item():
            return h
        key, sub = mx.random.split(key)
        fresh = mx.random.normal(h.shape, key=sub).astype(h.dtype)
        h = mx.where(bad[:, None], fresh, h)
    raise RuntimeError("could not draw router inputs with a clear top-k margin")


def float32_twin(module, make):
    """A fresh module from make() with module's parameters, bf16 ones widened to float32."""
    twin = make()
    twin.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype == mx.bfloat16 else a, module.parameters()))
    return twin


def write_gemma4_moe(outdir):
    hidden, inter, experts, top_k = 128, 64, 8, 2
    args = gemma4_text.ModelArgs(
        hidden_size=hidden, num_hidden_layers=1, intermediate_size=256, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, global_head_dim=64, num_kv_shared_layers=0,
        hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=experts,
        top_k_experts=top_k, moe_intermediate_size=inter)
    key = mx.random.key(SEED + 1)
    k_proj, k_scale, k_pes, k_experts, k_inputs = mx.random.split(key, 5)

    router = gemma4_text.Router(args)
    router.proj.weight = (0.3 * mx.random.normal((experts, hidden), key=k_proj)).astype(mx.bfloat16)
    router.scale = (1.0 + 0.2 * mx.random.normal((hidden,), key=k_scale)).astype(mx.bfloat16)
    router.per_expert_scale = mx.random.uniform(0.5, 1.5, (experts,), key=k_pes).astype(mx.bfloat16)
    router_dense = gemma4_text.Router(args)
    router_dense.proj.weight = router.proj.weight
    router_dense.scale = router.scale
    router_dense.per_expert_scale = router.per_expert_scale
    # The real checkpoints quantize router.proj to 8-bit gs64 (mlx-semantics 4.5).
    nn.quantize(router, group_size=64, bits=8)

    mx.random.seed(SEED + 2)  # SwitchLinear draws its init from the global generator
    ex = gemma4_text.Experts(args)
    ex.set_dtype(mx.bfloat16)
    nn.quantize(ex, group_size=64, bits=4)  # SwitchLinear -> QuantizedSwitchLinear

    def quantized(module, group_size, bits):
        nn.quantize(module, group_size=group_size, bits=bits)
        return module

    router32 = float32_twin(router, lambda: quantized(gemma4_text.Router(args), 64, 8))
    router_dense32 = float32_twin(router_dense, lambda: gemma4_text.Router(args))
    ex32 = float32_twin(ex, lambda: quantized(gemma4_text.Experts(args), 64, 4))

    arrays = {
        "router.proj.w": router.proj.weight, "router.proj.scales": router.proj.scales,
        "router.proj.biases": router.proj.biases, "router.scale": router.scale,
        "router.per_expert_scale": router.per_expert_scale,
        "router_dense.proj": router_dense.proj.weight,
    }
    for proj in ("gate_proj", "up_proj", "down_proj"):
        layer = getattr(ex.switch_glu, proj)
        arrays[f"experts.{proj}.w"] = layer.weight
        arrays[f"experts.{proj}.scales"] = layer.scales
        arrays[f"experts.{proj}.biases"] = layer.biases

    metadata = {"mlx": mx.__version__, "generator": "tests/golden/make_op_goldens.py"}
    quant = (f"top_k={top_k} router_bits={router.proj.bits} router_group_size={router.proj.group_size} "
             f"expert_bits={ex.switch_glu.down_proj.bits} expert_group_size={ex.switch_glu.down_proj.group_size}")
    for T in (3, 40):
        metadata[f"case.t{T}"] = f"T={T} " + quant
        k_h, k_x, k_redraw, k_inputs = mx.random.split(k_inputs, 4)
        h = (2.0 * mx.random.normal((T, hidden), key=k_h)).astype(mx.bfloat16)
        h = redraw_close_tokens([router, router_dense, router32, router_dense32], h, top_k, k_redraw)
        x = mx.random.normal((T, hidden), key=k_x).astype(mx.bfloat16)
        p = f"t{T}."
        arrays.update({p + "h": h, p + "x": x})
        for tag, r, rd, e, hh, xx in (("", router, router_dense, ex, h, x),
                                      ("f32_", router32, router_dense32, ex32, h.astype(mx.float32),
                                       x.astype(mx.float32))):
            idx, w = r(hh)
            d_idx, d_w = rd(hh)
            arrays.update({p + tag + "indices": idx.astype(mx.int32), p + tag + "weights": w,
                           p + tag + "y": e.switch_glu(xx, idx), p + tag + "out": e(xx, idx, w),
                           p + tag + "dense_indices": d_idx.astype(mx.int32), p + tag + "dense_weights": d_w})
    mx.eval(arrays)
    mx.save_safetensors(os.path.join(outdir, "mlxlm_gemma4_moe.safetensors"), arrays, metadata=metadata)


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: make_op_goldens.py OUTDIR")
    outdir = sys.argv[1]
    os.makedirs(outdir, exist_ok=True)
    mx.set_default_device(mx.cpu)
    write_gather_qmm(outdir)
    write_gemma4_moe(outdir)


if __name__ == "__main__":
    main()
