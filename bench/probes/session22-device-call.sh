#!/usr/bin/env bash
# The twenty-second session's first device call, in order of what decides most, each stage capped so
# the whole fits 540 s: unpack out/prebuilt.tar.xz (2fd1211's CLI as expertqmm-base), every GPU test,
# step 60's probe (the dequantization alone) and 10-layer block A/B against 2fd1211, the cuBLAS
# threshold at 512 tokens, step 61's sweep of the down window cap, and the layer's kernels at 2048 tokens under ncu with the L2 left as the
# graph leaves it (the twenty-first session's combine bytes were taken with ncu's default, which
# flushes the L2 before every kernel). Results in $OUT/session22.tgz; the key lines on stdout.
set -uo pipefail
OUT=${OUT:-./out}
export EXPERTQMM_COMMIT=$(cat out/commit)
base_commit=2fd1211
b=build-gpu-check
mkdir -p "$b" && tar xJf out/prebuilt.tar.xz -C "$b"
d=$(scripts/cublas-lib-dir "$b/expertqmm"); [ -n "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}" && echo "cuBLAS from $d"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"

echo "=== every GPU test, 8 shards at once (t=${SECONDS}s)"
# One process needs more than 200 s (this call's first run hit that cap); 8 shards took 169 s.
for i in 0 1 2 3 4 5 6 7; do
  GTEST_TOTAL_SHARDS=8 GTEST_SHARD_INDEX=$i timeout 230 "$b/tests/expertqmm_gpu_tests" --gtest_brief=1 \
    >"$OUT/tests-$i.log" 2>&1 &
done
wait
cat "$OUT"/tests-*.log >"$OUT/tests.log" && rm -f "$OUT"/tests-*.log
grep -E "^\[  (PASSED|FAILED|SKIPPED) " "$OUT/tests.log" | sort | uniq -c
grep -B2 -A12 "Failure" "$OUT/tests.log" | head -n 40

echo "=== step 60: the dequantization alone (t=${SECONDS}s)"
timeout 60 "$b/dense_cublas_probe" >"$OUT/probe-dense-cublas.json" 2>"$OUT/probe-dense-cublas.err"
echo "probe exit $?"; tail -n 2 "$OUT/probe-dense-cublas.err"
python3 - "$OUT/probe-dense-cublas.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(f'{r["linear"]:>12} {r["bits"]}b T={r["tokens"]:>5}  cublas {r["cublas_gemm_us"]:7.1f}  dequant {r["dequant_us"]:5.1f}'
          f'  both {r["dequant_and_cublas_us"]:7.1f}  ours {r["one_expert_rows_us"]:7.1f} ({r["route"]})  diff {r["rel_diff"]:.1e}')
PY

echo "=== step 60: 10-layer block against $base_commit, MLX layout (t=${SECONDS}s)"
m=$b/model-10
timeout 60 "$b/expertqmm" write-checkpoint --preset gemma4-26b-a4b --layers 10 --out "$m" --force >"$OUT/model.log" 2>&1
mkdir -p "$OUT/ab"
for round in 1 2; do
  for who in baseline current; do
    bin=$b/expertqmm; c=$EXPERTQMM_COMMIT
    [ "$who" = baseline ] && bin=$b/expertqmm-base && c=$base_commit
    EXPERTQMM_COMMIT=$c timeout 45 "$bin" bench --model "$m" --tokens 1024,2048 --product fused \
      --json "$OUT/ab/model-gemma4-26b-a4b-$who-$round.json" >>"$OUT/model.log" 2>&1
  done
done
python3 scripts/ab_summary.py "$OUT/ab" "$OUT/ab-model.json" model gemma4-26b-a4b

echo "=== the cuBLAS threshold: 512 tokens, EXPERTQMM_DENSE_CUBLAS=1 against the default (t=${SECONDS}s)"
timeout 60 "$b/expertqmm" bench --model "$m" --tokens 512 --product fused --versus EXPERTQMM_DENSE_CUBLAS=1 \
  --json "$OUT/model-cublas512.json" >>"$OUT/model.log" 2>&1
grep -E "default|versus" "$OUT/model.log" | tail -n 4

echo "=== the down window cap: EXPERTQMM_DOWN_WINDOW_MIB 24 (default) / 12 / 48, --tiled, alternated (t=${SECONDS}s)"
mkdir -p "$OUT/win"
for round in 1 2; do
  for mib in 24 12 48; do
    [ "$SECONDS" -lt 430 ] || break
    EXPERTQMM_DOWN_WINDOW_MIB=$mib timeout 30 "$b/expertqmm" bench --preset gemma4-26b-a4b --tokens 1024,2048 \
      --routing uniform --product fused --tiled --json "$OUT/win/win-$mib-$round.json" >>"$OUT/bench.log" 2>&1
  done
done
python3 - "$OUT/win" <<'PY'
import glob, json, os, sys
rows = {}
for p in sorted(glob.glob(os.path.join(sys.argv[1], "win-*.json"))):
    mib = os.path.basename(p).split("-")[1]
    for r in json.load(open(p))["rows"]:
        rows.setdefault((r["tokens"], int(mib)), []).append((r["us_median"], r["workspace_mb"]))
for (t, mib), us in sorted(rows.items()):
    print(f"T={t:>5} window {mib:>2} MiB: " + " / ".join(f"{u:.1f}" for u, _ in us) + f" us, scratch {us[0][1]:.1f} MB")
PY

echo "=== compute-sanitizer: memcheck over gpu-check's subset plus the dequantization and the window tests (t=${SECONDS}s)"
filter='Sanitize*:GpuDenseCublas.*:GpuMoe.DownWindow*'
for tool in memcheck racecheck; do
  [ "$SECONDS" -lt 400 ] || { echo "$tool: no time left"; break; }
  timeout 75 compute-sanitizer --tool $tool --error-exitcode 97 "$b/tests/expertqmm_gpu_tests" --gtest_filter="$filter" \
    >"$OUT/sanitizer-$tool.log" 2>&1
  echo "$tool exit $?"; grep -E "SUMMARY|\[==========\]|\[  FAILED  \]" "$OUT/sanitizer-$tool.log" | head -n 6
done

echo "=== the layer's kernels at 2048 tokens, --tiled, L2 as the graph leaves it (t=${SECONDS}s)"
[ "$SECONDS" -lt 440 ] && BUILD_DIR=$b BENCH_FLAGS=--tiled SECONDS_PER_RUN=60 scripts/profile-layer "$OUT/profile"

echo "=== the combine's DRAM bytes, L2 as the graph leaves it (t=${SECONDS}s)"
[ "$SECONDS" -lt 490 ] && bash bench/probes/combine-bytes-ncu.sh
tar czf "$OUT/session22.tgz" -C "$OUT" --exclude=session22.tgz --exclude=prebuilt.tar.xz . 2>/dev/null
rm -rf "$OUT/ab" "$OUT/win"
echo "=== end (t=${SECONDS}s)"
