"""bench/python/bench_torch.py without a GPU: its derived numbers against the C++ bench's, and the table
and plot it makes from a results file."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SCRIPT = os.path.join(ROOT, "bench", "python", "bench_torch.py")
CPP_RESULT = os.path.join(ROOT, "bench", "results", "h200-2026-12-01-affa89b-gpu-check.json")
sys.path.insert(0, os.path.dirname(SCRIPT))
import bench_torch  # noqa: E402


def cpp_bench():
    return json.load(open(CPP_RESULT))["runs"]


def test_derived_numbers_match_the_cpp_bench():
    run = cpp_bench()["bench-uniform"]
    rows = [r for r in run["rows"] if r["product"] == "fused" and r.get("expert_tiles", "auto") == "auto"]
    assert len(rows) >= 6
    for r in rows:
        d = bench_torch.derived(bench_torch.PRESET, r["tokens"], r["experts_hit"], r["us_median"], run["ceilings"])
        for key in ("flops", "bytes", "floor_us", "time_over_floor", "tflops", "gbps"):
            assert d[key] == pytest.approx(r[key], rel=1e-4), (r["tokens"], key)


def test_table_and_plot_from_a_results_file(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: the bench plot test is SKIPPED")
    runs = cpp_bench()
    ceilings = runs["bench-uniform"]["ceilings"]
    rows = []
    for peer, source in (("expertqmm.torch", runs["bench-uniform"]["rows"]), ("torch bf16 _grouped_mm", runs["torch"]["rows"])):
        for r in source:
            if r.get("product", "fused") == "fused" and r.get("expert_tiles", "auto") == "auto" and r.get("routing", "uniform") == "uniform":
                row = {"tokens": r["tokens"], "peer": peer, "us_median": r["us_median"], "check": "PASS"}
                row.update(bench_torch.derived(bench_torch.PRESET, r["tokens"], r["experts_hit"], r["us_median"], ceilings))
                rows.append(row)
    result = {"commit": "affa89b", "gpu": "NVIDIA H200", "preset": "gemma4-26b-a4b", "routing": "uniform",
              "ceilings": ceilings, "rows": rows}
    src, png = tmp_path / "result.json", tmp_path / "plot.png"
    src.write_text(json.dumps(result))
    out = subprocess.run([sys.executable, SCRIPT, "--from-json", str(src), "--png", str(png)],
                         capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert "expertqmm.torch us" in lines[0] and "torch bf16 _grouped_mm us" in lines[0]
    assert [int(line.split()[0]) for line in lines[1:-1]] == sorted({r["tokens"] for r in rows})
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_a_failed_check_fails_the_run(tmp_path):
    result = {"commit": "x", "gpu": "g", "preset": "p", "routing": "uniform", "rows": [
        {"tokens": 1, "peer": "expertqmm.torch", "us_median": 1.0, "time_over_floor": 2.0, "floor_us": 0.5,
         "check": "FAIL"}]}
    src = tmp_path / "result.json"
    src.write_text(json.dumps(result))
    run = subprocess.run([sys.executable, SCRIPT, "--from-json", str(src)], capture_output=True, text=True)
    assert run.returncode != 0 and "failed its check" in run.stderr
