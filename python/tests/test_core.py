"""expertqmm over numpy arrays and DLPack on the CPU, checked against MLX's own outputs (tests/golden)."""
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import expertqmm
from goldens import cases, load, rel_error

BF16_ONE_ROUNDING = 4e-3  # tests/cpu_golden_ops_test.cpp: one bf16 rounding of an f32 result
BF16_BOUND = 1e-2         # docs/numerics.md: a few bf16 roundings in sequence
MLX_BF16_BOUND = 5e-2     # against MLX's own bf16 pipeline, which rounds at other points


@pytest.mark.parametrize("file", ["quant_f32.safetensors", "quant_f16.safetensors", "quant_bf16.safetensors"])
def test_quantize_and_dequantize_match_mlx_bit_for_bit(file):
    tensors, meta = load(file)
    checked = 0
    for name, p in cases(meta).items():
        bits, gs = int(p["bits"]), int(p["group_size"])
        if p["kind"] != "dequantize":
            w = tensors[name + ".w"]
            wq, scales, biases = expertqmm.quantize(w, bits, gs, "cpu")
            assert isinstance(wq, np.ndarray) and scales.dtype == w.dtype
            np.testing.assert_array_equal(wq, tensors[name + ".wq"], err_msg=name)
            np.testing.assert_array_equal(scales.view(np.uint8), tensors[name + ".scales"].view(np.uint8), err_msg=name)
            np.testing.assert_array_equal(biases.view(np.uint8), tensors[name + ".biases"].view(np.uint8), err_msg=name)
        w_hat = expertqmm.dequantize(tensors[name + ".wq"], tensors[name + ".scales"], tensors[name + ".biases"], gs, bits)
        np.testing.assert_array_equal(w_hat.view(np.uint8), tensors[name + ".w_hat"].view(np.uint8), err_msg=name)
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("file,dtype", [("quant_modes_f32.safetensors", "float32"),
                                        ("quant_modes_f16.safetensors", "float16"),
                                        ("quant_modes_bf16.safetensors", "bfloat16")])
def test_fp_modes_quantize_and_dequantize_match_mlx_bit_for_bit(file, dtype):
    tensors, meta = load(file)
    kinds = set()
    for name, p in cases(meta).items():
        mode, kind = p["mode"], p["kind"].split(":")[0]
        global_scale = tensors.get(name + ".global_scale")
        if kind != "dequantize":
            wq, scales, biases = expertqmm.quantize(tensors[name + ".w"], mode=mode, global_scale=global_scale)
            assert biases is None and scales.dtype == np.uint8, name
            np.testing.assert_array_equal(wq, tensors[name + ".wq"], err_msg=name)
            np.testing.assert_array_equal(scales, tensors[name + ".scales"], err_msg=name)
        w_hat = expertqmm.dequantize(tensors[name + ".wq"], tensors[name + ".scales"], None, mode=mode,
                                     global_scale=global_scale, dtype=dtype)
        want = tensors[name + ".w_hat"]
        assert w_hat.dtype == want.dtype, name  # float32 with a global scale, as MLX
        np.testing.assert_array_equal(w_hat.view(np.uint8), want.view(np.uint8), err_msg=name)
        kinds.add((mode, kind))
    for mode in ("mxfp4", "mxfp8", "nvfp4"):
        assert {(mode, "random"), (mode, "edge"), (mode, "dequantize")} <= kinds, mode
    assert ("nvfp4", "global") in kinds


def test_gather_qmm_matches_mlx():
    tensors, meta = load("ops_gather_qmm.safetensors")
    all_cases = cases(meta)
    modes = [p.get("mode", "affine") for p in all_cases.values()]
    assert len(all_cases) == 38 and modes.count("affine") == 26, modes  # and 12 in MLX's fp modes
    for name, p in all_cases.items():
        g = lambda k: tensors.get(f"gqmm.{name}.{k}")  # noqa: E731
        out = expertqmm.gather_qmm(g("x"), g("w"), g("scales"), g("biases"), g("lhs"), g("rhs"),
                                   transpose=p["transpose"] == "1", group_size=int(p["group_size"]), bits=int(p["bits"]),
                                   sorted_indices=p["sorted_indices"] == "1", mode=p.get("mode", "affine"))
        assert out.shape == g("out").shape and out.dtype == g("out").dtype == ml_dtypes.bfloat16, name
        assert rel_error(out, g("out_f32")) <= BF16_ONE_ROUNDING, name
        assert rel_error(out, g("out")) <= MLX_BF16_BOUND, name


def mlx_moe_weights(tensors, **kw):
    """MoeWeights of tests/golden/mlxlm_gemma4_moe.safetensors (its names end in .w, not .weight)."""
    q = lambda n: (tensors[n + ".w"], tensors[n + ".scales"], tensors[n + ".biases"])  # noqa: E731
    return expertqmm.MoeWeights(q("router.proj"), tensors["router.scale"], tensors["router.per_expert_scale"],
                                gate=q("experts.gate_proj"), up=q("experts.up_proj"), down=q("experts.down_proj"),
                                top_k=2, **kw)


@pytest.mark.parametrize("T", [3, 40])
def test_moe_layer_and_route_match_mlx_lm(T):
    tensors, _ = load("mlxlm_gemma4_moe.safetensors")
    weights = mlx_moe_weights(tensors)
    assert weights.top_k == 2 and weights.num_experts == 8 and weights.output_dtype("bfloat16") == "bfloat16"
    h, x = tensors[f"t{T}.h"], tensors[f"t{T}.x"]
    out = expertqmm.moe_layer(h, weights, x)
    assert out.shape == (T, 128) and out.dtype == ml_dtypes.bfloat16
    assert rel_error(out, tensors[f"t{T}.f32_out"]) <= BF16_BOUND
    assert rel_error(out, tensors[f"t{T}.out"]) <= MLX_BF16_BOUND
    idx, w = expertqmm.route(h, weights)
    assert idx.dtype == np.int32 and w.dtype == ml_dtypes.bfloat16
    for t in range(T):
        assert set(idx[t]) == set(tensors[f"t{T}.indices"][t]), t


def test_tile_experts_adds_the_layout_and_keeps_the_results():
    tensors, _ = load("mlxlm_gemma4_moe.safetensors")
    weights = mlx_moe_weights(tensors)
    h, x = tensors["t40.h"], tensors["t40.x"]
    before = expertqmm.moe_layer(h, weights, x)
    assert weights.tile_experts() == 3  # gate, up and down: 4-bit affine
    assert weights.tile_experts() == 0  # each has one now
    np.testing.assert_array_equal(expertqmm.moe_layer(h, weights, x).view(np.uint16), before.view(np.uint16))


def test_moe_layer_into_writes_the_callers_array():
    tensors, _ = load("mlxlm_gemma4_moe.safetensors")
    weights = mlx_moe_weights(tensors)
    h, x = tensors["t40.h"], tensors["t40.x"]
    out = np.zeros((40, 128), dtype=ml_dtypes.bfloat16)
    ws = expertqmm.Workspace()
    assert expertqmm.moe_layer(h, weights, x, out=out, workspace=ws) is out
    np.testing.assert_array_equal(out.view(np.uint16), expertqmm.moe_layer(h, weights, x).view(np.uint16))


def test_gemma4_ffn_matches_mlx_lm_on_the_golden_checkpoint():
    tensors, meta = load("gemma4_layer_ffn.safetensors")
    ck = expertqmm.Gemma4Checkpoint(f"{__import__('goldens').GOLDEN_DIR}/gemma4_tiny_ckpt")
    assert (ck.num_layers, ck.config.hidden_size, ck.config.top_k_experts, ck.prefix) == (2, 128, 2, "model.")
    for name in cases(meta):
        layer, T = name[1:].split("_t")
        key = f"l{layer}.t{T}"
        out = expertqmm.gemma4_ffn(tensors[key + ".h"], ck.layer(int(layer)))
        assert out.dtype == ml_dtypes.bfloat16 and out.shape == (int(T), 128)
        assert rel_error(out, tensors[key + ".f32_out"]) <= BF16_BOUND, key
        assert rel_error(out, tensors[key + ".out"]) <= MLX_BF16_BOUND, key


def test_gemma4_ffn_on_a_synthetic_checkpoint(tiny_checkpoint):
    ck = expertqmm.Gemma4Checkpoint(tiny_checkpoint)
    assert ck.num_layers == 2 and ck.has("model.layers.1.router.scale")
    scale = ck.tensor("model.layers.1.router.scale")
    assert scale.dtype == ml_dtypes.bfloat16 and scale.shape == (128,)
    h = np.random.default_rng(0).standard_normal((5, 128)).astype(ml_dtypes.bfloat16)
    layer = ck.layer(1)
    out = expertqmm.gemma4_ffn(h, layer)
    into = np.empty_like(out)
    expertqmm.gemma4_ffn(h, layer, out=into, workspace=expertqmm.Workspace())
    np.testing.assert_array_equal(out.view(np.uint16), into.view(np.uint16))
    # the same weights built in memory from the same seed give the same layer
    again = expertqmm.gemma4_ffn(h, expertqmm.synthetic_gemma4_layer("tiny", layer=1, seed=7))
    np.testing.assert_array_equal(out.view(np.uint16), again.view(np.uint16))
    assert rel_error(out, h.astype(np.float32)) > 0.1  # the layer does something


def test_views_are_zero_copy_and_outputs_follow_the_input_framework():
    w = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    t = expertqmm.Tensor.wrap(w)
    assert (t.shape, t.dtype, t.device) == ((4, 64), "float32", "cpu")
    assert np.shares_memory(np.from_dlpack(t), w)
    q = expertqmm.quantize(t)  # an expertqmm.Tensor in: expertqmm.Tensors out, any DLPack consumer takes them
    assert all(isinstance(a, expertqmm.Tensor) for a in q)
    np.testing.assert_array_equal(np.from_dlpack(q[0]), expertqmm.quantize(w)[0])


def test_strided_views_give_the_contiguous_result():
    rng = np.random.default_rng(2)
    a = rng.standard_normal((3, 2, 64)).astype(np.float32)
    w_enk = rng.standard_normal((4, 32, 64)).astype(np.float32)  # [E, N, K]
    idx = np.array([3, 0, 2], dtype=np.int64)                     # int64 is narrowed to int32
    strided = expertqmm.gather_mm(a, w_enk.swapaxes(-1, -2), rhs_indices=idx)
    dense = expertqmm.gather_mm(a, np.ascontiguousarray(w_enk.swapaxes(-1, -2)), rhs_indices=idx)
    np.testing.assert_array_equal(strided, dense)
    want = np.einsum("bmk,bnk->bmn", a.astype(np.float64), w_enk[idx].astype(np.float64))
    assert strided.shape == (3, 2, 32) and rel_error(strided, want) < 1e-5


def test_errors_are_expertqmm_error_with_the_ops_message():
    with pytest.raises(expertqmm.Error) as e:
        expertqmm.quantize(np.zeros((4, 100), dtype=np.float32), 4, 64)
    assert e.value.op == "quantize" and "K=100" in str(e.value) and "group_size=64" in str(e.value)
    assert isinstance(e.value, RuntimeError)
    with pytest.raises(expertqmm.Error, match="unsupported element type float64"):
        expertqmm.quantize(np.zeros((4, 64)))
    with pytest.raises(expertqmm.Error, match="rounding must be 'cpu' or 'gpu'"):
        expertqmm.quantize(np.zeros((4, 64), dtype=np.float32), rounding="nearest")
    with pytest.raises(expertqmm.Error, match="unknown preset"):
        expertqmm.gemma4_config("gemma5")


def test_settings_and_diagnostics():
    table = {row["variable"]: row for row in expertqmm.settings.table()}
    assert "EXPERTQMM_EXPERT_TILES" in table and "EXPERTQMM_DETERMINISTIC" in table
    before = expertqmm.settings.expert_tiles()
    try:
        expertqmm.settings.set_expert_tiles("off")
        assert expertqmm.settings.expert_tiles() == "off"
        assert {r["variable"]: r for r in expertqmm.settings.table()}["EXPERTQMM_EXPERT_TILES"]["current"] == "0"
    finally:
        expertqmm.settings.set_expert_tiles(before)
    with pytest.raises(expertqmm.Error):
        expertqmm.settings.set_decode_layer("sometimes")
    # Any variable by name, as its environment variable's text; None hands it back to the environment.
    def current(variable):
        return {r["variable"]: r for r in expertqmm.settings.table()}[variable]["current"]

    try:
        expertqmm.settings.set_setting("EXPERTQMM_DOWN_WINDOW_MIB", "48")
        assert current("EXPERTQMM_DOWN_WINDOW_MIB") == "48"
        with pytest.raises(expertqmm.Error, match="EXPERTQMM_DOWN_WINDOW_MIB='0'"):
            expertqmm.settings.set_setting("EXPERTQMM_DOWN_WINDOW_MIB", "0")
        assert current("EXPERTQMM_DOWN_WINDOW_MIB") == "48"
        with pytest.raises(expertqmm.Error, match="not a setting"):
            expertqmm.settings.set_setting("EXPERTQMM_NO_SUCH_THING", "1")
    finally:
        expertqmm.settings.set_setting("EXPERTQMM_DOWN_WINDOW_MIB", None)
    assert current("EXPERTQMM_DOWN_WINDOW_MIB") == "auto"
    expertqmm.diagnostics.reset()
    snap = {c["primitive"]: c for c in expertqmm.diagnostics.snapshot()}
    assert "gather_qmm" in snap
    for c in snap.values():
        assert c["attempts"] == 0 and c["attempts"] == c["hits"] + sum(c["fallbacks"].values())
    assert "gather_qmm" in expertqmm.diagnostics.format()
    assert isinstance(expertqmm.cuda_built(), bool) and isinstance(expertqmm.cuda_available(), bool)


def test_every_public_function_has_a_docstring_and_the_stub_lists_the_module():
    import inspect
    import os

    import expertqmm.diagnostics
    import expertqmm.settings

    missing = []
    for module in (expertqmm, expertqmm.diagnostics, expertqmm.settings):
        for name in getattr(module, "__all__", dir(module)):
            obj = getattr(module, name)
            if name.startswith("_") or inspect.ismodule(obj) or not callable(obj):
                continue
            if not (obj.__doc__ or "").strip():
                missing.append(f"{module.__name__}.{name}")
            for member_name, member in inspect.getmembers(obj) if inspect.isclass(obj) else []:
                if not member_name.startswith("_") and callable(member) and not (member.__doc__ or "").strip():
                    missing.append(f"{module.__name__}.{name}.{member_name}")
    assert not missing, missing
    stub = os.path.join(os.path.dirname(expertqmm._core.__file__), "_core.pyi")
    text = open(stub).read()
    for name in ("def quantize", "def gather_qmm", "def moe_layer_into", "class MoeWeights", "class Gemma4Checkpoint"):
        assert name in text, name


def test_import_takes_less_than_a_second():
    code = "import time; t = time.perf_counter(); import expertqmm; print(time.perf_counter() - t)"
    seconds = min(float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
                  for _ in range(3))
    print(f"import expertqmm: {seconds * 1e3:.0f} ms")
    assert seconds < 1.0
