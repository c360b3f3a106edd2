#!/usr/bin/env bash
# The nineteenth session's device call (bench/NOTES.md step 54), on the GPU machine from the
# repository root with out/prebuilt.tar.xz and out/commit carried (scripts/gpu-check --pack-prebuilt):
# gpu-check without the sanitizers and the model stage (every GPU test, the layer benches, step 54's
# switch A/B on the tile layout, the torch and CUTLASS peers), then the 30-layer block (the default
# sizes and --tiled), memcheck of the grouping's tests, and the tiled layer kernel by kernel.
set -uo pipefail
OUT=${OUT:-./out}
export EXPERTQMM_COMMIT=$(cat out/commit)
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
GPU_CHECK_PREBUILT=out/prebuilt.tar.xz GPU_CHECK_SECONDS=${CHECK_SECONDS:-420} \
  GPU_CHECK_SKIP="sanitize bench-extra model python bench-python bench-mlx" \
  SWITCH_AB=EXPERTQMM_GROUP_ROWS SWITCH_AB_TOKENS=32,128,512,2048 AB_FLAGS=--tiled \
  OUT="$OUT" scripts/gpu-check >"$OUT/gpu-check.log" 2>&1
grep -E "^=== |FAILED|^gpu-check:" "$OUT/gpu-check.log"
cli=build-gpu-check/expertqmm
model=build-gpu-check/model-30
echo "=== model (t=${SECONDS}s)"
timeout 70 "$cli" write-checkpoint --preset gemma4-26b-a4b --layers 30 --out "$model" --force >"$OUT/model.log" 2>&1
timeout 70 "$cli" bench --model "$model" --tokens 1,8,16,32,64,512,1024,2048 --product fused \
  --json "$OUT/bench-model.json" 2>&1 | tee -a "$OUT/model.log" | grep -E "^ *[0-9]|tokens" | head -20
timeout 40 "$cli" bench --model "$model" --tokens 512,1024,2048 --product fused --tiled \
  --json "$OUT/bench-model-tiled.json" 2>&1 | tee -a "$OUT/model.log" | grep -E "^ *[0-9]|tokens" | head -10
echo "=== memcheck, the grouping's tests (t=${SECONDS}s)"
timeout 45 compute-sanitizer --tool memcheck --error-exitcode 9 build-gpu-check/tests/expertqmm_gpu_tests \
  --gtest_filter='*GroupRows*' --gtest_brief=1 >"$OUT/memcheck-group-rows.log" 2>&1
echo "memcheck exit $?"; tail -n 4 "$OUT/memcheck-group-rows.log"
echo "=== profile (t=${SECONDS}s)"
BENCH_FLAGS=--tiled TOKENS="512 2048" SECONDS_PER_RUN=30 timeout 65 scripts/profile-layer "$OUT/profile-tiled" >/dev/null 2>&1
cat "$OUT"/profile-tiled/*.txt 2>/dev/null | head -60
echo "=== end (t=${SECONDS}s)"
