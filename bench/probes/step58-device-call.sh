#!/usr/bin/env bash
# Step 58's device call (bench/NOTES.md): the grouping's grid form past 8192 rows, on the GPU machine
# after step57-device-call.sh unpacked out/prebuilt.tar.xz into build-gpu-check. The grouping tests
# (both forms, graph capture, the layer's bytes at 8800 rows), then EXPERTQMM_GROUP_ROWS=0 (CUB above
# 8192 rows) against 1 (the grid form) at 2048 tokens (16384 rows), both layouts, alternated 0 1 0 1,
# then the grouping kernels alone under nsys-free ncu timing at 2048 tokens.
set -uo pipefail
OUT=${OUT:-./out}
export EXPERTQMM_COMMIT=$(cat out/commit)
b=build-gpu-check
d=$(scripts/cublas-lib-dir "$b/expertqmm"); [ -n "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
echo "=== group rows tests (t=${SECONDS}s)"
timeout 90 "$b/tests/expertqmm_gpu_tests" --gtest_filter='*GroupRows*' --gtest_brief=1 >"$OUT/tests58.log" 2>&1
echo "tests exit $?"; tail -n 3 "$OUT/tests58.log"
echo "=== switch A/B (t=${SECONDS}s)"
mkdir -p "$OUT/sw" "$OUT/swmlx"
for round in 1 2; do
  for v in 0 1; do
    who=baseline; [ "$v" = 1 ] && who=current
    EXPERTQMM_GROUP_ROWS=$v timeout 30 "$b/expertqmm" bench --preset gemma4-26b-a4b --tokens 2048 --routing uniform \
      --product fused --tiled --json "$OUT/sw/sw-gemma4-26b-a4b-$who-$round.json" >>"$OUT/bench58.log" 2>&1
    EXPERTQMM_GROUP_ROWS=$v timeout 30 "$b/expertqmm" bench --preset gemma4-26b-a4b --tokens 2048 --routing uniform \
      --product fused --json "$OUT/swmlx/sw-gemma4-26b-a4b-$who-$round.json" >>"$OUT/bench58.log" 2>&1
  done
done
python3 scripts/ab_summary.py "$OUT/sw" "$OUT/sw-tiled.json" sw --label "EXPERTQMM_GROUP_ROWS=0 against 1" gemma4-26b-a4b
python3 scripts/ab_summary.py "$OUT/swmlx" "$OUT/sw-mlx.json" sw --label "EXPERTQMM_GROUP_ROWS=0 against 1" gemma4-26b-a4b
echo "=== grouping kernels under ncu, 2048 tokens (t=${SECONDS}s)"
for v in 0 1; do
  EXPERTQMM_GROUP_ROWS=$v timeout 45 ncu --clock-control none --kernel-name regex:'group_rows|Radix|Scan|sort' \
    --metrics gpu__time_duration.sum --csv --print-units base "$b/expertqmm" bench --preset gemma4-26b-a4b \
    --tokens 2048 --routing uniform --product fused --replays 2 --ungated --tiled >"$OUT/ncu58-$v.csv" 2>/dev/null
  echo "GROUP_ROWS=$v:"; grep gpu__time_duration "$OUT/ncu58-$v.csv" | cut -d, -f5,15- | sort | uniq -c | head -12
done
tar czf "$OUT/step58.tgz" -C "$OUT" tests58.log bench58.log sw swmlx sw-tiled.json sw-mlx.json ncu58-0.csv ncu58-1.csv 2>/dev/null
echo "=== end (t=${SECONDS}s)"
