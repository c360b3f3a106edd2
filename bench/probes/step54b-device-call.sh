#!/usr/bin/env bash
# The nineteenth session's second device call (bench/NOTES.md "Step 54 measured"): the grouping
# kernel's second build (shared atomics to count, one ballot per label bit to rank) against CUB's
# path in the same binary (EXPERTQMM_GROUP_ROWS 0 / 1, --tiled, alternated twice), its time under
# ncu at 2048 tokens, then gpu-check's GPU tests and sanitizers. Carry out/prebuilt.tar.xz, out/commit.
set -uo pipefail
OUT=${OUT:-./out}
export EXPERTQMM_COMMIT=$(cat out/commit)
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
mkdir -p build-gpu-check && tar xJf out/prebuilt.tar.xz -C build-gpu-check || exit 1
cli=build-gpu-check/expertqmm
echo "=== A/B (t=${SECONDS}s)"
for round in 1 2; do
  for v in 0 1; do
    EXPERTQMM_GROUP_ROWS=$v timeout 60 "$cli" bench --preset gemma4-26b-a4b --tokens 32,128,512,1024,2048 \
      --routing uniform --product fused --tiled --json "$OUT/ab-group-rows-$v-$round.json" >>"$OUT/ab.log" 2>&1 ||
      echo "bench GROUP_ROWS=$v round $round failed"
  done
done
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
rows = {}
for v in (0, 1):
    for r in (1, 2):
        try:
            d = json.load(open(f"{out}/ab-group-rows-{v}-{r}.json"))
        except OSError:
            continue
        for row in d["rows"]:
            rows.setdefault(row["tokens"], {0: [], 1: []})[v].append(row["us_median"])
print("tokens  GROUP_ROWS=0 us      GROUP_ROWS=1 us      change")
for t, s in sorted(rows.items()):
    if s[0] and s[1]:
        a, b = sum(s[0]) / len(s[0]), sum(s[1]) / len(s[1])
        print(f"{t:6d}  {s[0]}  {s[1]}  {100 * (b - a) / a:+.1f}%")
PY
echo "=== ncu, T=2048 (t=${SECONDS}s)"
BENCH_FLAGS=--tiled TOKENS=2048 SECONDS_PER_RUN=35 timeout 45 scripts/profile-layer "$OUT/profile-tiled" >/dev/null 2>&1
head -n 12 "$OUT/profile-tiled/T2048.txt" 2>/dev/null
echo "=== gpu-check: GPU tests and sanitizers (t=${SECONDS}s)"
GPU_CHECK_PREBUILT=out/prebuilt.tar.xz GPU_CHECK_SECONDS=${CHECK_SECONDS:-340} \
  GPU_CHECK_SKIP="bench bench-extra torch cutlass model python bench-python bench-mlx" \
  OUT="$OUT" scripts/gpu-check >"$OUT/gpu-check.log" 2>&1
grep -E "^=== |FAILED|^gpu-check:|memcheck|racecheck|ERROR SUMMARY|hazard" "$OUT/gpu-check.log" | head -30
rm -f "$OUT"/profile-tiled/*.csv
echo "=== end (t=${SECONDS}s)"
# One archive: the device returns a limited number of files.
tar czf /tmp/step54b.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/step54b.tgz "$OUT/"
