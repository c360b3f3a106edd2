#!/usr/bin/env bash
# The device call that measures steps 46-49 (bench/NOTES.md "Plan for the next device session",
# fourteenth session), run by `run` from the repository root with carry ["out/prebuilt.tar.xz",
# "out/commit"] after `scripts/gpu-check --pack-prebuilt build` and `git rev-parse --short HEAD >
# out/commit` here. TOTAL: the seconds it may take (default 420). In order: the warp-specialized
# build's and the tile layout's tests, the step-47 probe, the EXPERTQMM_WGMMA_WS A/B, the tile
# layout's A/B (step 49: bench --tiled; SKIP_TILED=1 skips it) and the EXPERTQMM_DETERMINISTIC A/B
# (Gemma layer), the 2048-token layer kernel by kernel (scripts/profile-layer), then gpu-check on the
# prebuilt binaries (every GPU test, sanitizers) with what is left.
REAL_OUT=$OUT
NAME=step47
export OUT=$REAL_OUT/$NAME  # in $OUT itself so that a timed-out call still brings back what it wrote
mkdir -p $OUT
export EXPERTQMM_COMMIT=$(cat out/commit 2>/dev/null || echo unknown)
B=build-gpu-check
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
mkdir -p $B && tar xJf out/prebuilt.tar.xz -C $B
timeout 90 $B/tests/expertqmm_gpu_tests --gtest_filter='*WarpSpecialized*:*TileLayout*:*TiledExperts*' > $OUT/ws-tests.log 2>&1; echo "ws tests rc $? t=$SECONDS"
grep -E "^\[  (FAILED|PASSED|  OK|SKIPPED)|Failure|apart|did not run" $OUT/ws-tests.log | head -20
for v in ${PROBES:-route route_ws ws_n128 ws_n128_persistent ws_n256_persistent}; do
  timeout 30 $B/ws_tiles_probe $v > $OUT/ws-$v.json 2>&1; echo "probe $v rc $? t=$SECONDS"
done
grep -h gemm $OUT/ws-*.json
ab() {  # ab VAR TOKENS DIR [FLAG]: VAR=0 (baseline) against VAR=1 (current), alternated, Gemma layer;
        # with FLAG: VAR=1 on both sides, FLAG on the current side only
  mkdir -p $OUT/$3
  for round in 1 2; do for who in baseline current; do
    v=0; [ $who = current ] && v=1
    extra=""
    if [ -n "${4:-}" ]; then v=1; [ $who = current ] && extra=$4; fi
    env $1=$v EXPERTQMM_COMMIT=$EXPERTQMM_COMMIT-$1=$v$extra timeout 60 $B/expertqmm bench --preset gemma4-26b-a4b \
      --tokens $2 --routing uniform --product fused --replays 30 $extra --json $OUT/$3/ab-gemma4-26b-a4b-$who-$round.json \
      > $OUT/$3/ab-$who-$round.log 2>&1 || echo "$1 bench $who $round failed"
  done; done
  label="$1=0 (baseline) against 1 (current)"
  [ -n "${4:-}" ] && label="$1=1 without (baseline) and with $4 (current)"
  python3 scripts/ab_summary.py $OUT/$3 $OUT/bench-$3.json ab --label "$label" gemma4-26b-a4b
  echo "t=$SECONDS"
}
ab EXPERTQMM_WGMMA_WS 512,1024,2048 switch-ws
# Step 49: the experts' tile layout in the warp-specialized build (bench --tiled).
[ -n "${SKIP_TILED:-}" ] || ab EXPERTQMM_WGMMA_WS 512,1024,2048 switch-tiled --tiled
[ -n "${SKIP_DET:-}" ] || ab EXPERTQMM_DETERMINISTIC 512,1024,2048 switch-deterministic
# Where the 2048-token layer's time goes with the warp-specialized build (scripts/profile-layer).
[ -n "${SKIP_PROFILE:-}" ] || BUILD_DIR=$B EXPERTQMM_WGMMA_WS=1 SECONDS_PER_RUN=90 scripts/profile-layer $OUT/profile-ws
echo "t=$SECONDS"
export GPU_CHECK_PREBUILT=out/prebuilt.tar.xz
export GPU_CHECK_SKIP="bench bench-extra torch cutlass model python bench-python bench-mlx"
export GPU_TEST_SHARDS=14
export GPU_CHECK_SECONDS=$((${TOTAL:-420} - SECONDS))
echo "gpu-check gets $GPU_CHECK_SECONDS s"
scripts/gpu-check > $OUT/gpu-check.txt 2>&1
grep -E "^(==|gpu-check)|FAILED|spill|memcheck|racecheck|ERROR SUMMARY|hazard" $OUT/gpu-check.txt | tail -40
