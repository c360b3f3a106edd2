#!/usr/bin/env python3
"""The table and JSON of an A/B that scripts/gpu-check ran (bench --json files, two rounds a side).

Reads the layer bench's JSON ("rows", us_median) and the model bench's ("results", us_per_layer of
the default configuration; the first product per token count).

    ab_summary.py BUILD OUT PREFIX [--label TEXT] PRESET...

Reads BUILD/PREFIX-PRESET-{baseline,current}-{1,2}.json, prints one row per preset and token count
(both rounds' medians a side and the change of the means) and writes OUT. A preset whose four runs
are not all there (a run failed, or the check's deadline cut it) is named and left out; the exit
status is then 1. --label says what was compared (e.g. the setting of a switch A/B: both sides are
then the same commit).
"""
import json
import os
import statistics
import sys


def timed_rows(run):
    """[{"tokens", "us"}] of a layer bench JSON (rows) or a model bench JSON (results, per layer)."""
    if "rows" in run:
        return [{"tokens": r["tokens"], "us": r["us_median"]} for r in run["rows"]]
    rows = []
    for r in run.get("results", []):
        if r.get("config", "default") == "default" and all(x["tokens"] != r["tokens"] for x in rows):
            rows.append({"tokens": r["tokens"], "us": r["us_per_layer"]})
    return rows


def main(argv):
    build, out, prefix, rest = argv[1], argv[2], argv[3], argv[4:]
    label = None
    if rest[:1] == ["--label"]:
        label, rest = rest[1], rest[2:]
    rows, first, missing = [], None, []
    print(f"{'preset':>16} {'tokens':>6} {'baseline us':>22} {'current us':>22} {'change':>7}")
    for preset in rest:
        paths = {w: [f"{build}/{prefix}-{preset}-{w}-{r}.json" for r in (1, 2)] for w in ("baseline", "current")}
        docs = {w: [json.load(open(p)) for p in ps if os.path.exists(p)] for w, ps in paths.items()}
        runs = {w: [timed_rows(d) for d in ds] for w, ds in docs.items()}
        tokens = sorted({r["tokens"] for run in runs["current"][:1] for r in run})
        complete = all(len(runs[w]) == 2 for w in runs) and all(
            any(r["tokens"] == t for r in run) for w in runs for run in runs[w] for t in tokens)
        if not complete or not tokens:
            missing.append(preset)
            print(f"{preset:>16}: left out, not every run wrote its JSON (the check's deadline, or see bench.log)")
            continue
        first = first or docs
        for t in tokens:
            med = {w: [next(r["us"] for r in run if r["tokens"] == t) for run in runs[w]] for w in runs}
            b, c = statistics.mean(med["baseline"]), statistics.mean(med["current"])
            rows.append({"preset": preset, "tokens": t, "baseline_us": med["baseline"], "current_us": med["current"],
                         "change": c / b - 1})
            print(f"{preset:>16} {t:>6} {' / '.join(f'{v:.1f}' for v in med['baseline']):>22} "
                  f"{' / '.join(f'{v:.1f}' for v in med['current']):>22} {100 * (c / b - 1):>+6.1f}%")
    if first:
        summary = {"baseline": first["baseline"][0].get("commit"), "current": first["current"][0].get("commit"),
                   "gpu": first["current"][0].get("gpu"), "order": "per preset: baseline, current, baseline, current",
                   "rows": rows, "left_out": missing}
        if label:
            summary["compared"] = label
        with open(out, "w") as f:
            json.dump(summary, f, indent=1)
    return 1 if missing or not first else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
