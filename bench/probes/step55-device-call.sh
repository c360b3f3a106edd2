#!/usr/bin/env bash
# The nineteenth session's last device call (bench/NOTES.md step 55): the router projection's BM=64
# split-K against a373374's CLI (packed as expertqmm-base), Gemma layer, --tiled, alternated twice,
# then the split-K and Gemma 4 block tests. Carry out/prebuilt.tar.xz and out/commit.
set -uo pipefail
OUT=${OUT:-./out}
mkdir -p b && tar xJf out/prebuilt.tar.xz -C b || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
for round in 1 2; do
  for who in base cur; do
    cli=b/expertqmm; [ "$who" = base ] && cli=b/expertqmm-base
    timeout 40 "$cli" bench --preset gemma4-26b-a4b --tokens 64,128,512,2048 --routing uniform --product fused \
      --tiled --replays 30 --json "$OUT/ab-$who-$round.json" >>"$OUT/ab.log" 2>&1 || echo "bench $who $round failed"
  done
done
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
rows = {}
for who in ("base", "cur"):
    for r in (1, 2):
        try:
            d = json.load(open(f"{out}/ab-{who}-{r}.json"))
        except OSError:
            continue
        for row in d["rows"]:
            rows.setdefault(row["tokens"], {"base": [], "cur": []})[who].append(row["us_median"])
for t, s in sorted(rows.items()):
    if s["base"] and s["cur"]:
        a, b = sum(s["base"]) / len(s["base"]), sum(s["cur"]) / len(s["cur"])
        print(f"{t:6d}  base {s['base']}  current {s['cur']}  {100 * (b - a) / a:+.1f}%")
PY
timeout 60 b/tests/expertqmm_gpu_tests --gtest_filter='*splitk*:*rhs_tiles*batch1x300*:GpuGemma4Ffn*' --gtest_brief=1 2>&1 | tail -n 4
