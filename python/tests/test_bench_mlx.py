"""bench/python/bench_mlx.py --tiny on MLX's CPU: one run writes both peers' rows for both cases,
the patched MoE layer passes its check against MLX, and every row carries the protocol's numbers."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("mlx.core", reason="mlx is not installed")
pytest.importorskip("expertqmm.mlx", reason="expertqmm was built without its MLX extension")
if __import__("importlib.util").util.find_spec("mlx_lm") is None:
    pytest.skip("mlx-lm is not installed", allow_module_level=True)

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "python", "bench_mlx.py")


def test_bench_mlx_tiny_on_the_cpu(tmp_path):
    out = tmp_path / "bench-mlx.json"
    run = subprocess.run([sys.executable, SCRIPT, "--tiny", "--device", "cpu", "--tokens", "1,8,64", "--reps", "2",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["preset"] == "tiny" and "cpu" in result["device"]
    rows = result["rows"]
    keys = {(r["case"], r["tokens"], r["peer"]) for r in rows}
    assert keys == {(c, t, p) for c in ("moe_layer", "model_forward") for t in (1, 8, 64)
                    for p in ("mlx", "mlx+expertqmm")}
    for r in rows:
        assert 0 < r["us_p10"] <= r["us_median"] <= r["us_p90"]
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / (r["us_median"] * 1e-6))
    ours = [r for r in rows if r["peer"] == "mlx+expertqmm"]
    assert all(r["speedup"] > 0 and 0 <= r["tokens_within_5e-2"] <= 1 for r in ours)
    layer = [r for r in ours if r["case"] == "moe_layer"]
    assert all(r["check"] == "PASS" and r["rel_err_same_routing"] <= 5e-2 for r in layer)
    assert "moe_layer" in run.stdout and "model_forward" in run.stdout  # the table
