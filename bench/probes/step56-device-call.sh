#!/usr/bin/env bash
# The twentieth session's first device call (bench/NOTES.md steps 56-57), on the GPU machine from the
# repository root with out/prebuilt.tar.xz (scripts/gpu-check --pack-prebuilt, PACK_BASELINE_CLI =
# 7c7c997's CLI) and out/commit carried. STAGE=all (default): see below. STAGE=1: gpu-check's GPU tests, the layer benches, step 56's
# switch A/B and the A/B against 7c7c997 (steps 56 + 57), both on the tile layout, and the torch and
# CUTLASS peers. STAGE=2 (the warm machine next): the 30-layer block (this build and 7c7c997's), the
# sanitizers and the Python package (build-deps/python-wheels carried too). Each call's files are
# packed into $OUT/gpu-check.tgz.
set -uo pipefail
OUT=${OUT:-./out}
export EXPERTQMM_COMMIT=$(cat out/commit)
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "${STAGE:-all}" = all ]; then
  # One call when machines are scarce: no peers (measured at e071982 on this machine type), no Python;
  # memcheck of the new code's tests after the check.
  GPU_CHECK_PREBUILT=out/prebuilt.tar.xz GPU_CHECK_SECONDS=${CHECK_SECONDS:-470} \
    GPU_CHECK_SKIP="sanitize bench-extra torch cutlass python bench-python bench-mlx" \
    BASELINE_CLI=expertqmm-base BASELINE_COMMIT=7c7c997 AB_TOKENS=512,1024,2048 AB_FLAGS=--tiled \
    SWITCH_AB=EXPERTQMM_COMBINE_IN_DOWN SWITCH_AB_TOKENS=32,128,512,1024,2048 MODEL_TOKENS=1,8,16,32,64,512,1024,2048 \
    OUT="$OUT" scripts/gpu-check >"$OUT/gpu-check.log" 2>&1
  echo "=== memcheck (t=${SECONDS}s)"
  timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 build-gpu-check/tests/expertqmm_gpu_tests \
    --gtest_filter='*CombineInDown*:*Route*:*GroupRows*' --gtest_brief=1 >"$OUT/memcheck-new.log" 2>&1
  echo "memcheck exit $?"; tail -n 3 "$OUT/memcheck-new.log"
  tar czf "$OUT/gpu-check.tgz" -C "$OUT" --exclude=gpu-check.tgz . 2>/dev/null
elif [ "${STAGE}" = 1 ]; then
  GPU_CHECK_PREBUILT=out/prebuilt.tar.xz GPU_CHECK_SECONDS=${CHECK_SECONDS:-540} GPU_CHECK_ARCHIVE=1 \
    GPU_CHECK_SKIP="sanitize bench-extra model python bench-python bench-mlx" \
    BASELINE_CLI=expertqmm-base BASELINE_COMMIT=7c7c997 AB_TOKENS=512,1024,2048 AB_FLAGS=--tiled \
    SWITCH_AB=EXPERTQMM_COMBINE_IN_DOWN SWITCH_AB_TOKENS=32,128,512,1024,2048 \
    OUT="$OUT" scripts/gpu-check >"$OUT/gpu-check.log" 2>&1
else
  GPU_CHECK_PREBUILT=out/prebuilt.tar.xz GPU_CHECK_SECONDS=${CHECK_SECONDS:-560} GPU_CHECK_ARCHIVE=1 \
    PYTHON_STAGE_SECONDS=200 GPU_CHECK_SKIP="gpu-tests bench bench-extra torch cutlass bench-python bench-mlx" \
    BASELINE_CLI=expertqmm-base BASELINE_COMMIT=7c7c997 \
    OUT="$OUT" scripts/gpu-check >"$OUT/gpu-check.log" 2>&1
fi
grep -E "^=== |FAILED|^gpu-check:|^\[  FAILED|change|->" "$OUT/gpu-check.log" | head -80
echo "=== end (t=${SECONDS}s)"
