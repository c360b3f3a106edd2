#!/usr/bin/env python3
"""scripts/ab_summary.py on bench JSON written here: the change is the means' ratio, a preset with a
missing run or a missing token row is named and left out (exit 1), --label lands in the JSON, and no
complete preset writes no JSON (exit 1); the model bench's JSON (results, us_per_layer) is read by its
default configuration."""
import json
import os
import subprocess
import sys
import tempfile

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "ab_summary.py")


def write(tmp, prefix, preset, who, rnd, rows):
    with open(os.path.join(tmp, f"{prefix}-{preset}-{who}-{rnd}.json"), "w") as f:
        json.dump({"commit": who, "gpu": "test GPU",
                   "rows": [{"tokens": t, "us_median": us} for t, us in rows]}, f)


def write_model(tmp, preset, who, rnd, rows):
    # bench --model: a default and a --versus row per size; only the default counts.
    results = []
    for t, us in rows:
        results.append({"phase": "prefill", "tokens": t, "product": "fused", "us_per_layer": us, "config": "default"})
        results.append({"phase": "prefill", "tokens": t, "product": "fused", "us_per_layer": 1.0, "config": "versus"})
    with open(os.path.join(tmp, f"model-{preset}-{who}-{rnd}.json"), "w") as f:
        json.dump({"commit": who, "gpu": "test GPU", "results": results}, f)


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)


def main():
    failures = []

    def check(cond, what):
        if not cond:
            failures.append(what)

    with tempfile.TemporaryDirectory() as tmp:
        for rnd in (1, 2):
            write(tmp, "ab", "a", "baseline", rnd, [(1, 10.0), (8, 20.0)])
            write(tmp, "ab", "a", "current", rnd, [(1, 9.0), (8, 22.0)])
            write(tmp, "ab", "b", "baseline", rnd, [(1, 10.0), (8, 20.0)])
        write(tmp, "ab", "b", "current", 1, [(1, 10.0), (8, 20.0)])  # round 2 missing
        for rnd in (1, 2):
            write(tmp, "ab", "c", "baseline", rnd, [(1, 10.0), (8, 20.0)])
            write(tmp, "ab", "c", "current", rnd, [(1, 10.0)] if rnd == 2 else [(1, 10.0), (8, 20.0)])
        out = os.path.join(tmp, "out.json")

        r = run(tmp, out, "ab", "a")
        check(r.returncode == 0, f"complete preset: exit {r.returncode}: {r.stderr}")
        summary = json.load(open(out))
        changes = {row["tokens"]: round(row["change"], 6) for row in summary["rows"]}
        check(changes == {1: -0.1, 8: 0.1}, f"changes {changes}")
        check(summary["baseline"] == "baseline" and summary["current"] == "current", "commits")
        check("compared" not in summary, "no label asked")

        r = run(tmp, out, "ab", "--label", "X=0 against 1", "a", "b", "c")
        check(r.returncode == 1, f"missing runs: exit {r.returncode}")
        summary = json.load(open(out))
        check(summary["left_out"] == ["b", "c"], f"left_out {summary['left_out']}")
        check(summary["compared"] == "X=0 against 1", "label")
        check("b: left out" in r.stdout and "c: left out" in r.stdout, r.stdout)

        for rnd in (1, 2):
            write_model(tmp, "m", "baseline", rnd, [(512, 400.0), (2048, 900.0)])
            write_model(tmp, "m", "current", rnd, [(512, 380.0), (2048, 900.0)])
        r = run(tmp, out, "model", "m")
        check(r.returncode == 0, f"model bench: exit {r.returncode}: {r.stderr}")
        changes = {row["tokens"]: round(row["change"], 6) for row in json.load(open(out))["rows"]}
        check(changes == {512: -0.05, 2048: 0.0}, f"model bench changes {changes}")

        os.remove(out)
        r = run(tmp, out, "ab", "b")
        check(r.returncode == 1 and not os.path.exists(out), "no complete preset: exit 1, no JSON")

    for f in failures:
        print("FAIL:", f)
    print("ab_summary_test:", "FAILED" if failures else "passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
