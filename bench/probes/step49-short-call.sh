#!/usr/bin/env bash
# The shortest device call that still answers steps 47-49 (bench/NOTES.md "Plan for the next device
# session", sixteenth session), for when little device time is left: the warp-specialized build's and
# the tile layout's tests, the step-47 probe's route build against its persistent kernel, then one
# Gemma layer bench per configuration at 1024 and 2048 tokens: the two-CTA kernel
# (EXPERTQMM_WGMMA_WS=0), the warp-specialized build (=1), and the same with --tiled. Carry
# ["out/prebuilt.tar.xz", "out/commit"] as for step47-device-call.sh; about 4 minutes.
export OUT=$OUT/step49
mkdir -p $OUT
export EXPERTQMM_COMMIT=$(cat out/commit 2>/dev/null || echo unknown)
B=build-gpu-check
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
mkdir -p $B && tar xJf out/prebuilt.tar.xz -C $B
timeout 90 $B/tests/expertqmm_gpu_tests --gtest_filter='*WarpSpecialized*:*TileLayout*:*TiledExperts*:*ColumnWindows*' \
  > $OUT/ws-tests.log 2>&1; echo "tests rc $? t=$SECONDS"
grep -E "^\[  (FAILED|PASSED|  OK|SKIPPED)|Failure" $OUT/ws-tests.log | head -20
[ -z "${ONLY_TESTS:-}" ] || exit 0  # ONLY_TESTS=1: the tests alone (about 2 minutes)
for v in route_ws ws_n128_persistent; do timeout 30 $B/ws_tiles_probe $v > $OUT/ws-$v.json 2>&1; echo "probe $v rc $?"; done
grep -h gemm $OUT/ws-*.json
for cfg in "0" "1" "1 --tiled"; do
  set -- $cfg
  name=ws$1${2:+-tiled}
  EXPERTQMM_WGMMA_WS=$1 EXPERTQMM_COMMIT=$EXPERTQMM_COMMIT-$name timeout 50 $B/expertqmm bench --preset gemma4-26b-a4b \
    --tokens 1024,2048 --routing uniform --product fused --replays 30 ${2:-} --json $OUT/bench-$name.json \
    > $OUT/bench-$name.log 2>&1; echo "bench $name rc $? t=$SECONDS"
  grep -E "^tokens|^  fused " $OUT/bench-$name.log | head -6
done
