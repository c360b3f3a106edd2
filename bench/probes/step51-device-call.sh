#!/usr/bin/env bash
# The device call of the seventeenth session (bench/NOTES.md step 50), run by `run` from the
# repository root with carry ["out/prebuilt.tar.xz", "out/commit"] after `scripts/gpu-check
# --pack-prebuilt build` and `git rev-parse --short HEAD > out/commit` here. TOTAL: its seconds
# (default 480). In order: the tests the first device run in four sessions failed (now fixed); the
# probe's three variants (two-CTA, warp-specialized, warp-specialized on the tile layout); ncu
# (--set full plus every warp stall ratio) on the expert GEMM kernels of one 2048-token Gemma layer
# with the two-CTA kernel (EXPERTQMM_WGMMA_WS=0), the warp-specialized one (=1) and that on the tile
# layout (=1 --tiled), to say why the warp-specialized build lost; the layer bench at every token
# count for bench/results; then gpu-check (every GPU test, sanitizers) with what is left. Everything
# is written under /tmp/step50 and packed into $OUT/step50.tgz after each stage (8 files come back).
W=/tmp/step50
mkdir -p $W
pack() { tar czf $OUT/step50.tgz -C /tmp step50; }
left() { [ $((${TOTAL:-480} - SECONDS)) -gt ${1:-40} ]; }  # time left for a stage of ~$1 s
cap() { local l=$((${TOTAL:-480} - SECONDS - 10)); echo $((l < $1 ? l : $1)); }  # a stage's timeout
export EXPERTQMM_COMMIT=$(cat out/commit 2>/dev/null || echo unknown)
B=build-gpu-check
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $W/gpu.txt
mkdir -p $B && tar xJf out/prebuilt.tar.xz -C $B
timeout 120 $B/tests/expertqmm_gpu_tests \
  --gtest_filter='*WarpSpecialized*:*TileLayout*:*TiledExperts*:*ColumnWindows*:*mxfp4*picks_expert_tiles*:GpuMoe.*' \
  > $W/tests.log 2>&1; echo "tests rc $? t=$SECONDS"
grep -E "^\[  (FAILED|PASSED|SKIPPED)|Failure" $W/tests.log | head -20
pack
stalls='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
for cfg in "0 wgmma" "1 ws --tiled" "1 ws"; do
  left || break
  set -- $cfg
  name=ws$1${3:+-tiled}
  EXPERTQMM_WGMMA_WS=$1 timeout $(cap 100) ncu --set full --metrics "$stalls" --clock-control none --import-source no \
    -k "regex:expert_tiles_$2_kernel" --launch-count 5 --print-kernel-base demangled \
    $B/expertqmm bench --preset gemma4-26b-a4b --tokens 2048 --routing uniform --product fused --replays 1 \
    --ungated ${3:-} > $W/ncu-$name.txt 2>&1
  echo "ncu $name rc $? t=$SECONDS"
  grep -E "^  [a-z_]+.*expert_tiles|Duration|Compute \(SM\) Throughput|Issue Slots Busy|Registers Per|Achieved Occupancy" \
    $W/ncu-$name.txt | head -40
  pack
done
left && {
for v in route route_ws route_ws_tiled; do timeout $(cap 40) $B/ws_tiles_probe $v > $W/probe-$v.json 2>&1; echo "probe $v rc $?"; done
grep -h gemm $W/probe-*.json
pack
}
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
export GPU_CHECK_SECONDS=$((${TOTAL:-480} - SECONDS))
echo "gpu-check gets $GPU_CHECK_SECONDS s"
OUT=$W/gpu-check scripts/gpu-check > $W/gpu-check.txt 2>&1
grep -E "^(==|gpu-check)|FAILED|memcheck|racecheck|ERROR SUMMARY|hazard" $W/gpu-check.txt | tail -30
pack
