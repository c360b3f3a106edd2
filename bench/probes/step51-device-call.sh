#!/usr/bin/env bash
# The first device call of the eighteenth session (bench/NOTES.md steps 50-51), run by `run` from the
# repository root with carry ["out/prebuilt.tar.xz", "out/commit"] after `scripts/gpu-check
# --pack-prebuilt build` and `git rev-parse --short HEAD > out/commit` here. TOTAL: its seconds
# (default 540). In order of value, each stage only with time left for it:
#   tests    the tile layout's, the column windows', the warp-specialized build's and the MoE layer's
#   ab51     step 51: the two-CTA kernel (EXPERTQMM_WGMMA_WS=0) on MLX's layout against it on the tile
#            layout (bench --tiled), Gemma layer at 512 / 1024 / 2048 tokens, alternated twice
#   probe    each expert GEMM alone: route, route_tiled (and, with time, route_ws, route_ws_tiled)
#   ncu      --set full plus every warp stall ratio on the expert GEMM kernels of one 2048-token
#            layer: two-CTA on MLX's layout, two-CTA tiled (then, with time, WS tiled)
#   bench    the layer at every token count (bench/results)
#   gpu-check every GPU test and the sanitizers with what is left
# Everything is written under /tmp/step51 and packed into $OUT/step51.tgz after each stage, so that a
# call cut short still brings back what it measured.
W=/tmp/step51
mkdir -p $W
pack() { tar czf $OUT/.step51.tgz -C /tmp step51 && mv $OUT/.step51.tgz $OUT/step51.tgz; }  # whole or the last one
left() { [ $((${TOTAL:-540} - SECONDS)) -gt ${1:-40} ]; }  # time left for a stage of ~$1 s
cap() { local l=$((${TOTAL:-540} - SECONDS - 10)); l=$((l < 1 ? 1 : l)); echo $((l < $1 ? l : $1)); }  # a stage's timeout (>= 1: 0 is none)
export EXPERTQMM_COMMIT=$(cat out/commit 2>/dev/null || echo unknown)
B=build-gpu-check
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $W/gpu.txt
mkdir -p $B && tar xJf out/prebuilt.tar.xz -C $B
timeout 120 $B/tests/expertqmm_gpu_tests \
  --gtest_filter='*WarpSpecialized*:*TileLayout*:*TiledExperts*:*ColumnWindows*:*mxfp4*picks_expert_tiles*:GpuMoe.*' \
  > $W/tests.log 2>&1; echo "tests rc $? t=$SECONDS"
grep -E "^\[  (FAILED|PASSED|SKIPPED)|Failure" $W/tests.log | head -20
pack

# ab DIR TOKENS FLAG: the same commit and settings on both sides, FLAG on the current side only.
ab() {
  mkdir -p $W/$1
  for round in 1 2; do for who in baseline current; do
    left 45 || return 1
    extra=""; [ $who = current ] && extra=$3
    EXPERTQMM_WGMMA_WS=0 EXPERTQMM_COMMIT=$EXPERTQMM_COMMIT$extra timeout $(cap 60) $B/expertqmm bench \
      --preset gemma4-26b-a4b --tokens $2 --routing uniform --product fused --replays 30 $extra \
      --json $W/$1/ab-gemma4-26b-a4b-$who-$round.json > $W/$1/ab-$who-$round.log 2>&1 || echo "bench $who $round failed"
  done; done
  python3 scripts/ab_summary.py $W/$1 $W/bench-$1.json ab --label "EXPERTQMM_WGMMA_WS=0, without (baseline) and with $3 (current)" gemma4-26b-a4b
  echo "t=$SECONDS"
}
ab ab51 512,1024,2048 --tiled
pack

left && {
for v in route route_tiled ${MORE_PROBES:-route_ws_tiled}; do left 30 || break; timeout $(cap 40) $B/ws_tiles_probe $v > $W/probe-$v.json 2>&1; echo "probe $v rc $?"; done
grep -h gemm $W/probe-*.json
pack
}

stalls='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
for cfg in "0 wgmma" "0 wgmma --tiled" "1 ws --tiled"; do
  left 100 || break
  set -- $cfg
  name=ws$1${3:+-tiled}
  EXPERTQMM_WGMMA_WS=$1 timeout $(cap 100) ncu --set full --metrics "$stalls" --clock-control none --import-source no \
    -k "regex:expert_tiles_$2_kernel" --launch-count 4 --print-kernel-base demangled \
    $B/expertqmm bench --preset gemma4-26b-a4b --tokens 2048 --routing uniform --product fused --replays 1 \
    --ungated ${3:-} > $W/ncu-$name.txt 2>&1
  echo "ncu $name rc $? t=$SECONDS"
  grep -E "^  [a-z_]+.*expert_tiles|Duration|Compute \(SM\) Throughput|Issue Slots Busy|Registers Per|Achieved Occupancy" \
    $W/ncu-$name.txt | head -40
  pack
done

left && {
timeout $(cap 90) $B/expertqmm bench --preset gemma4-26b-a4b --tokens 1,8,32,128,512,1024,2048 --routing uniform \
  --product fused --replays 30 --json $W/bench-gemma4-26b-a4b.json > $W/bench.log 2>&1; echo "bench rc $? t=$SECONDS"
grep -E "^tokens|^ +(fused|floor)" $W/bench.log | head -20
pack
}
left 60 || exit 0  # gpu-check needs a minute at least
export GPU_CHECK_PREBUILT=out/prebuilt.tar.xz
export GPU_CHECK_SKIP="bench bench-extra torch cutlass model python bench-python bench-mlx"
export GPU_TEST_SHARDS=14
export GPU_CHECK_SECONDS=$((${TOTAL:-540} - SECONDS - 20))  # 20 s for the last pack
echo "gpu-check gets $GPU_CHECK_SECONDS s"
OUT=$W/gpu-check scripts/gpu-check > $W/gpu-check.txt 2>&1
grep -E "^(==|gpu-check)|FAILED|memcheck|racecheck|ERROR SUMMARY|hazard" $W/gpu-check.txt | tail -30
pack
