"""expertqmm.torch on the CPU: torch tensors in and out (zero-copy), the custom ops (schema, fake
implementations, torch.compile), the MoE and Gemma 4 modules, and the plain-torch reference."""
import numpy as np
import pytest

from conftest import import_torch

torch = import_torch()

import expertqmm  # noqa: E402
import expertqmm.torch as eqt  # noqa: E402
import torch_reference as ref  # noqa: E402
from goldens import load  # noqa: E402

BF16_BOUND = 1e-2


def golden_moe_state_dict(prefix=""):
    """tests/golden/mlxlm_gemma4_moe.safetensors as a torch state dict with mlx-lm's names."""
    tensors, _ = load("mlxlm_gemma4_moe.safetensors")
    sd = {}
    for src, dst in (("router.proj", "router.proj"), ("experts.gate_proj", "experts.switch_glu.gate_proj"),
                     ("experts.up_proj", "experts.switch_glu.up_proj"),
                     ("experts.down_proj", "experts.switch_glu.down_proj")):
        sd[prefix + dst + ".weight"] = tensors[src + ".w"]
        sd[prefix + dst + ".scales"] = tensors[src + ".scales"]
        sd[prefix + dst + ".biases"] = tensors[src + ".biases"]
    sd[prefix + "router.scale"] = tensors["router.scale"]
    sd[prefix + "router.per_expert_scale"] = tensors["router.per_expert_scale"]
    as_torch = {k: torch.from_numpy(v.view(np.int16).copy()).view(torch.bfloat16) if v.dtype.name == "bfloat16"
                else torch.from_numpy(v.copy()) for k, v in sd.items()}
    as_torch = {k: v.view(torch.uint32) if v.dtype == torch.uint32 else v for k, v in as_torch.items()}
    bf16 = lambda a: torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)  # noqa: E731
    h = {T: bf16(tensors[f"t{T}.h"]) for T in (3, 40)}
    x = {T: bf16(tensors[f"t{T}.x"]) for T in (3, 40)}
    want = {T: torch.from_numpy(tensors[f"t{T}.f32_out"].copy()) for T in (3, 40)}
    return as_torch, h, x, want


def test_torch_tensors_in_and_out_share_memory():
    w = torch.randn(8, 128, dtype=torch.bfloat16)
    wq, scales, biases = expertqmm.quantize(w)
    assert (wq.dtype, scales.dtype, wq.shape, scales.shape) == (torch.uint32, torch.bfloat16, (8, 16), (8, 2))
    t = expertqmm.Tensor.wrap(torch.utils.dlpack.to_dlpack(w))
    assert torch.from_dlpack(t).data_ptr() == w.data_ptr()
    back = expertqmm.dequantize(wq, scales, biases)
    assert isinstance(back, torch.Tensor) and ref.rel_error(back, w) < 0.1
    # the reference computes s*q+b in float32; MLX (and so the library) rounds s*q to bf16, then the sum
    assert ref.rel_error(ref.dequantize(wq, scales, biases, 64, 4), back) <= BF16_BOUND


@pytest.mark.parametrize("op, args", [
    ("quantize", lambda: (torch.randn(2, 4, 128), 4, 64, "cpu")),
    ("dequantize", lambda: (*eqt.quantize(torch.randn(4, 128, dtype=torch.bfloat16), 8, 32), 32, 8)),
    ("gather_qmm", lambda: (torch.randn(5, 1, 128, dtype=torch.bfloat16),
                            *eqt.quantize(torch.randn(3, 16, 128, dtype=torch.bfloat16)),
                            None, torch.tensor([2, 0, 1, 1, 2], dtype=torch.int32), True, 64, 4, False)),
    ("gather_mm", lambda: (torch.randn(2, 3, 64), torch.randn(4, 64, 8), None, torch.tensor([3, 1]), False)),
])
def test_custom_ops_pass_opcheck(op, args):
    torch.library.opcheck(getattr(torch.ops.expertqmm, op).default, args())


def test_moe_block_from_state_dict_matches_mlx_lm():
    sd, h, x, want = golden_moe_state_dict(prefix="model.layers.0.")
    sd["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(1)  # other tensors of the layer are ignored
    block = eqt.MoeBlock.from_state_dict(sd, prefix="model.layers.0.", top_k=2)
    assert sorted(block.state_dict()) == sorted(k[len("model.layers.0."):] for k in sd if "self_attn" not in k)
    for T in (3, 40):
        out = block(h[T], x[T])
        assert out.dtype == torch.bfloat16 and out.shape == (T, 128)
        assert ref.rel_error(out, want[T]) <= BF16_BOUND
    torch.library.opcheck(torch.ops.expertqmm.moe_layer.default, (h[3], x[3], block.handle()))


def test_moe_block_against_the_torch_bf16_reference():
    sd, h, _, _ = golden_moe_state_dict()
    block = eqt.MoeBlock(sd, top_k=2)
    weights = expertqmm.MoeWeights.from_mlx(sd, top_k=2)
    x = h[40]
    idx, w = expertqmm.route(x, weights)
    logits = ref.router_logits(x, sd, eps=1e-6)
    assert ref.rel_error(w, ref.router_weights(logits, idx, sd)) <= BF16_BOUND
    chosen = torch.gather(logits, 1, idx.long())
    rest = logits.scatter(1, idx.long(), float("-inf"))
    assert (chosen.min(1).values >= rest.max(1).values - 2e-2 * logits.abs().max()).all()  # top-k up to bf16 ties
    assert ref.rel_error(block(x), ref.experts(x, idx, w, sd)) <= BF16_BOUND


def test_state_dict_round_trip_and_moves(tiny_checkpoint):
    block = eqt.MoeBlock.from_mlx_checkpoint(tiny_checkpoint, 1)
    assert block.top_k == 2
    again = eqt.MoeBlock.from_state_dict(block.state_dict(), top_k=2)
    h = torch.randn(6, 128, dtype=torch.bfloat16)
    torch.testing.assert_close(block(h), again(h), rtol=0, atol=0)
    handle = block.handle()
    block.to(torch.float32)  # the float buffers change: the handle is rebuilt over the new ones
    assert block.handle() != handle and block(h.float()).dtype == torch.float32
    ck = expertqmm.Gemma4Checkpoint(tiny_checkpoint)
    torch.testing.assert_close(again(h), expertqmm.moe_layer(h, ck.moe_weights(1)), rtol=0, atol=0)


def test_torch_compile_traces_through_the_ops(tiny_checkpoint):
    block = eqt.MoeBlock.from_mlx_checkpoint(tiny_checkpoint, 0)
    ffn = eqt.Gemma4FeedForward.from_mlx_checkpoint(tiny_checkpoint, 0)
    h = torch.randn(4, 128, dtype=torch.bfloat16)
    compiled_block = torch.compile(block, backend="aot_eager", fullgraph=True)
    compiled_ffn = torch.compile(ffn, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled_block(h), block(h), rtol=0, atol=0)
    torch.testing.assert_close(compiled_ffn(h), ffn(h), rtol=0, atol=0)
    torch.testing.assert_close(ffn(h), expertqmm.gemma4_ffn(h, expertqmm.Gemma4Checkpoint(tiny_checkpoint).layer(0)),
                               rtol=0, atol=0)

    def quantize_then_dequantize(w):
        return torch.ops.expertqmm.dequantize(*torch.ops.expertqmm.quantize(w, 4, 64, "cpu"), 64, 4)

    w = torch.randn(16, 128)
    torch.testing.assert_close(torch.compile(quantize_then_dequantize, backend="aot_eager", fullgraph=True)(w),
                               quantize_then_dequantize(w), rtol=0, atol=0)


def test_released_handles_and_bad_activations_raise_expertqmm_error():
    with pytest.raises(expertqmm.Error, match="no weights are registered under handle"):
        torch.ops.expertqmm.moe_layer(torch.zeros(1, 128), torch.zeros(1, 128), 10**9)
    sd, h, _, _ = golden_moe_state_dict()
    block = eqt.MoeBlock(sd, top_k=2)
    with pytest.raises(expertqmm.Error, match="must be bfloat16, float16 or float32"):
        block(h[3].double())


def test_the_readmes_python_example_runs():
    import os
    import re

    readme = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "README.md")).read()
    section = readme[readme.index("### Python"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["y"].shape == (8, 128) and scope["z"].shape == (3, 1, 64) and scope["out"].shape == (8, 128)
    assert len(code.strip().splitlines()) <= 12


def test_expertqmm_torch_documents_its_functions_and_modules():
    import inspect

    missing = []
    for name, obj in vars(eqt).items():
        if name.startswith("_") or getattr(obj, "__module__", "") != eqt.__name__:
            continue
        if inspect.isfunction(obj) or inspect.isclass(obj):
            if not (obj.__doc__ or "").strip():
                missing.append(name)
        if inspect.isclass(obj):
            for member, fn in vars(obj).items():
                fn = fn.__func__ if isinstance(fn, classmethod) else fn
                if not member.startswith("_") and inspect.isfunction(fn) and not (fn.__doc__ or "").strip():
                    missing.append(f"{name}.{member}")
    assert not missing, missing
    for op in ("quantize", "dequantize", "gather_qmm", "gather_mm", "moe_layer", "gemma4_ffn"):
        fn = getattr(getattr(eqt, op), "_init_fn", getattr(eqt, op))  # the custom op's own function
        assert (fn.__doc__ or "").strip(), op
