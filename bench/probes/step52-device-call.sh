#!/usr/bin/env bash
# The second device call of the eighteenth session (bench/NOTES.md step 52), run by `run` from the
# repository root with carry ["out/prebuilt.tar.xz", "out/commit"]: the prebuilt binaries of this
# tree (`scripts/gpu-check --pack-prebuilt build`) plus the previous commit's CLI as expertqmm-base,
# repacked into the same xz stream (their device code is mostly the same, so it adds ~3 MB). TOTAL:
# its seconds (default 560). In order of value, each stage only with time left for it:
#   tests    the expert tile route's, the tile layout's and the MoE layer's GPU tests
#   ab52     step 52 against the base CLI, Gemma layer at 512 / 1024 / 2048, alternated twice,
#            EXPERTQMM_WGMMA_WS=0, with --tiled (ab52-tiled) and without (ab52-mlx)
#   probe    each expert GEMM alone: route, route_tiled
#   ncu      --set full plus every warp stall ratio on the tiled gate/up kernel at 2048 tokens
#   sanitize gpu-check (every GPU test, memcheck, racecheck)
#   model    (MODEL=1) the 30-layer feed-forward block, --tiled and not, T = 1, 8, 512, 1024, 2048
# Everything is written under /tmp/step52 and packed into $OUT/step52.tgz after each stage.
W=/tmp/step52
mkdir -p $W
pack() { tar czf $OUT/.step52.tgz -C /tmp step52 && mv $OUT/.step52.tgz $OUT/step52.tgz; }
left() { [ $((${TOTAL:-560} - SECONDS)) -gt ${1:-40} ]; }  # time left for a stage of ~$1 s
want() { [[ " ${SKIP_STAGES:-} " != *" $1 "* ]]; }  # SKIP_STAGES: stages left out (ab52-mlx probe ncu ...)
cap() { local l=$((${TOTAL:-560} - SECONDS - 10)); l=$((l < 1 ? 1 : l)); echo $((l < $1 ? l : $1)); }
export EXPERTQMM_COMMIT=$(cat out/commit 2>/dev/null || echo unknown)
B=build-gpu-check
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $W/gpu.txt
mkdir -p $B && tar xJf out/prebuilt.tar.xz -C $B
timeout 150 $B/tests/expertqmm_gpu_tests \
  --gtest_filter='*ExpertTiles*:*Wgmma*:*TileLayout*:*TiledExperts*:*ColumnWindows*:*WarpSpecialized*:GpuMoe.*' \
  > $W/tests.log 2>&1; echo "tests rc $? t=$SECONDS"
grep -E "^\[  (FAILED|PASSED|SKIPPED)|Failure" $W/tests.log | head -20
pack

# ab DIR TOKENS [FLAG]: the base CLI (baseline) against this tree's (current), FLAG on both sides.
ab() {
  mkdir -p $W/$1
  for round in 1 2; do for who in baseline current; do
    left 45 || return 1
    cli=$B/expertqmm; commit=$EXPERTQMM_COMMIT
    [ $who = baseline ] && { cli=$B/expertqmm-base; commit=base; }
    EXPERTQMM_WGMMA_WS=0 EXPERTQMM_COMMIT=$commit${3:-} timeout $(cap 60) $cli bench \
      --preset gemma4-26b-a4b --tokens $2 --routing uniform --product fused --replays 30 ${3:-} \
      --json $W/$1/ab-gemma4-26b-a4b-$who-$round.json > $W/$1/ab-$who-$round.log 2>&1 || echo "bench $who $round failed"
  done; done
  python3 scripts/ab_summary.py $W/$1 $W/bench-$1.json ab --label "base CLI (baseline) against $EXPERTQMM_COMMIT (current), EXPERTQMM_WGMMA_WS=0 ${3:-}" gemma4-26b-a4b
  echo "t=$SECONDS"
}
want ab52-tiled && ab ab52-tiled 512,1024,2048 --tiled
pack
want ab52-mlx && ab ab52-mlx 512,1024,2048
pack

want probe && left && {
for v in route route_tiled; do left 30 || break; timeout $(cap 40) $B/ws_tiles_probe $v > $W/probe-$v.json 2>&1; echo "probe $v rc $?"; done
grep -h gemm $W/probe-*.json
pack
}

stalls='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
want ncu && left 60 && {
EXPERTQMM_WGMMA_WS=0 timeout $(cap 60) ncu --set full --metrics "$stalls" --clock-control none --import-source no \
  -k "regex:expert_tiles_wgmma_kernel" --launch-count 2 --print-kernel-base demangled \
  $B/expertqmm bench --preset gemma4-26b-a4b --tokens 2048 --routing uniform --product fused --replays 1 \
  --ungated --tiled > $W/ncu-tiled.txt 2>&1
echo "ncu rc $? t=$SECONDS"
grep -E "^  [a-z_]+.*expert_tiles|Duration|Issue Slots Busy|No Eligible|L2 Cache Throughput|stalled_(barrier|long_score|wait|short_score|not_sel)" $W/ncu-tiled.txt | head -24
pack
}

left ${SANITIZE_NEEDS:-150} && {
export GPU_CHECK_PREBUILT=out/prebuilt.tar.xz
export GPU_CHECK_SKIP="bench bench-extra torch cutlass model python bench-python bench-mlx ${EXTRA_SKIP:-}"  # EXTRA_SKIP=gpu-tests: sanitizers only
export GPU_TEST_SHARDS=14
# MODEL=1 keeps ~110 s for the model stage after it; otherwise gpu-check takes what is left.
reserve=20; [ -n "${MODEL:-}" ] && reserve=110
export GPU_CHECK_SECONDS=$((${TOTAL:-560} - SECONDS - reserve > 240 ? 240 : ${TOTAL:-560} - SECONDS - reserve))
echo "gpu-check gets $GPU_CHECK_SECONDS s"
OUT=$W/gpu-check scripts/gpu-check > $W/gpu-check.txt 2>&1
grep -E "^(==|gpu-check)|FAILED|memcheck|racecheck|ERROR SUMMARY|hazard" $W/gpu-check.txt | tail -30
pack
}

[ -n "${MODEL:-}" ] && left 60 || exit 0
M=/tmp/model-30
timeout $(cap 80) $B/expertqmm write-checkpoint --preset gemma4-26b-a4b --layers 30 --out $M --force > $W/model.log 2>&1
echo "checkpoint rc $? t=$SECONDS"
for flag in --tiled ""; do
  left 30 || break
  timeout $(cap 60) $B/expertqmm bench --model $M --tokens 1,8,512,1024,2048 --product fused $flag \
    --json $W/bench-model${flag:+-tiled}.json >> $W/model.log 2>&1; echo "model bench $flag rc $? t=$SECONDS"
done
grep -E "tokens|per layer|tok/s" $W/model.log | head -30
pack
