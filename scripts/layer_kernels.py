#!/usr/bin/env python3
"""One layer pass kernel by kernel, from ncu's table of gpu__time_duration.sum over an `expertqmm
bench` run (scripts/profile-layer writes it with --csv --print-units base): per kernel name its
launches, the median duration, its launches per layer pass and their total, largest first.

  scripts/layer_kernels.py FILE.csv [--label TEXT]

A layer pass: the launch count that most kernel names share (every kernel of the layer runs once per
pass in the bench's eager warm-up, graph warm-up and replays alike); a name launched about m times
as often runs m times per pass, give or take m launches (the bench routes once more outside the
layer, so the router's kernels count one launch over). Names launched less than about once a pass
(the bench's ceilings) are listed apart and left out of the sum.
"""
import argparse
import collections
import csv
import io
import statistics
import sys


def rows(path):
    lines = open(path, encoding="utf-8", errors="replace").read().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        sys.exit(f"layer_kernels: no ncu table (a line starting with \"ID\") in {path}")
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = row.get("Metric Unit", "nsecond")
        scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}.get(unit)
        if scale is None:
            sys.exit(f"layer_kernels: unknown unit {unit!r}")
        yield row["Kernel Name"], float(row["Metric Value"].replace(",", "")) * scale


def short(name, width=100):
    """The name without its parameter list (the part in the last balanced parentheses), cut to width."""
    if name.endswith(")"):
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i] if i > 0 else name
                break
    return name if len(name) <= width else name[: width - 3] + "..."


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv_file")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    times = collections.defaultdict(list)
    for name, us in rows(args.csv_file):
        times[name].append(us)
    if not times:
        sys.exit("layer_kernels: no durations in the table")
    counts = collections.Counter(len(v) for v in times.values())
    passes = max(counts.items(), key=lambda kv: (kv[1], -kv[0]))[0]
    layer, apart = [], []
    for name, us in times.items():
        per_pass = round(len(us) / passes)
        entry = (statistics.median(us), per_pass, len(us), name)
        (layer if per_pass >= 1 and abs(len(us) - per_pass * passes) <= per_pass else apart).append(entry)
    layer.sort(key=lambda e: -e[0] * e[1])
    total = sum(med * per_pass for med, per_pass, _, _ in layer)
    print(f"{args.label}: {passes} layer passes profiled; per pass {total:.1f} us in "
          f"{sum(per_pass for _, per_pass, _, _ in layer)} launches")
    print(f"{'us/pass':>9} {'share':>6} {'per pass':>8} {'median us':>10}  kernel")
    for med, per_pass, _, name in layer:
        print(f"{med * per_pass:9.1f} {med * per_pass / total:6.1%} {per_pass:8d} {med:10.1f}  {short(name)}")
    for med, _, n, name in sorted(apart, key=lambda e: -e[0]):
        print(f"{'':9} {'':6} {'apart':>8} {med:10.1f}  {short(name)} ({n} launches)")


if __name__ == "__main__":
    main()
