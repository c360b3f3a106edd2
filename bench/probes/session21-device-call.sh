#!/usr/bin/env bash
# The twenty-first session's one device call, in order of what decides most, each stage capped so
# the whole fits 540 s: unpack out/prebuilt.tar.xz (7c7c997's CLI as expertqmm-base), the GPU tests
# of what changed since the last device run (steps 57-59), step 59's probe and 10-layer model A/B,
# step 57's layer A/B and norm ncu, step 58's switch A/B, the combine's DRAM bytes. Results in
# $OUT/session21.tgz.
set -uo pipefail
OUT=${OUT:-./out}
export EXPERTQMM_COMMIT=$(cat out/commit)
b=build-gpu-check
mkdir -p "$b" && tar xJf out/prebuilt.tar.xz -C "$b"
d=$(scripts/cublas-lib-dir "$b/expertqmm"); [ -n "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}" && echo "cuBLAS from $d"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
echo "=== tests (t=${SECONDS}s)"
timeout 170 "$b/tests/expertqmm_gpu_tests" --gtest_brief=1 \
  --gtest_filter='*DenseCublas*:*Gemma4Ffn*:*GroupRows*:*Rout*:*GpuMoe.*:*Qwen3*' >"$OUT/tests.log" 2>&1
echo "tests exit $?"; grep -E "^\[  (FAILED|PASSED|SKIPPED) " "$OUT/tests.log" | head -n 12
echo "=== step 59: probe (t=${SECONDS}s)"
timeout 60 "$b/dense_cublas_probe" >"$OUT/probe-dense-cublas.json" 2>"$OUT/probe-dense-cublas.err"
echo "probe exit $?"; tail -n 2 "$OUT/probe-dense-cublas.err"
python3 - "$OUT/probe-dense-cublas.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(f'{r["linear"]:>12} {r["bits"]}b T={r["tokens"]:>5}  cublas {r["cublas_gemm_us"]:7.1f}  dequant {r["dequant_us"]:5.1f}'
          f'  both {r["dequant_and_cublas_us"]:7.1f}  ours {r["one_expert_rows_us"]:7.1f} ({r["route"]})  {r["cublas_tflops"]:.0f} TF/s  diff {r["rel_diff"]:.1e}')
PY
echo "=== step 59: 10-layer model, cuBLAS (default) against EXPERTQMM_DENSE_CUBLAS=0 (t=${SECONDS}s)"
m=$b/model-10
timeout 60 "$b/expertqmm" write-checkpoint --preset gemma4-26b-a4b --layers 10 --out "$m" --force >"$OUT/model.log" 2>&1
for tiled in --tiled ""; do
  timeout 80 "$b/expertqmm" bench --model "$m" --tokens 512,1024,2048 --product fused $tiled \
    --versus EXPERTQMM_DENSE_CUBLAS=0 --json "$OUT/model59${tiled:+-tiled}.json" >>"$OUT/model.log" 2>&1
  grep -E "default|versus" "$OUT/model.log" | tail -n 6
done
echo "=== step 57: layer A/B against 7c7c997, --tiled (t=${SECONDS}s)"
mkdir -p "$OUT/ab"
for round in 1 2; do
  for who in baseline current; do
    bin=$b/expertqmm; c=$EXPERTQMM_COMMIT
    [ "$who" = baseline ] && bin=$b/expertqmm-base && c=7c7c997
    EXPERTQMM_COMMIT=$c timeout 30 "$bin" bench --preset gemma4-26b-a4b --tokens 512,1024,2048 --routing uniform \
      --product fused --tiled --json "$OUT/ab/ab-gemma4-26b-a4b-$who-$round.json" >>"$OUT/bench.log" 2>&1
  done
done
python3 scripts/ab_summary.py "$OUT/ab" "$OUT/ab-tiled.json" ab gemma4-26b-a4b
echo "=== step 57: the norm under ncu, 2048 tokens (t=${SECONDS}s)"
for who in base current; do
  bin=$b/expertqmm; [ "$who" = base ] && bin=$b/expertqmm-base
  timeout 40 ncu --clock-control none --kernel-name regex:router_rms_norm --metrics gpu__time_duration.sum \
    --csv --print-units base "$bin" bench --preset gemma4-26b-a4b --tokens 2048 --routing uniform --product fused \
    --replays 2 --ungated --tiled >"$OUT/ncu-norm-$who.csv" 2>/dev/null
  echo "$who: $(grep gpu__time_duration "$OUT/ncu-norm-$who.csv" | tail -n 2 | awk -F'","' '{print $NF}' | tr -d '"' | tr '\n' ' ')"
done
echo "=== step 58: EXPERTQMM_GROUP_ROWS=0 against 1 at 2048 tokens, --tiled (t=${SECONDS}s)"
mkdir -p "$OUT/sw"
for round in 1 2; do
  for v in 0 1; do
    who=baseline; [ "$v" = 1 ] && who=current
    EXPERTQMM_GROUP_ROWS=$v timeout 25 "$b/expertqmm" bench --preset gemma4-26b-a4b --tokens 2048 --routing uniform \
      --product fused --tiled --json "$OUT/sw/sw-gemma4-26b-a4b-$who-$round.json" >>"$OUT/bench.log" 2>&1
  done
done
python3 scripts/ab_summary.py "$OUT/sw" "$OUT/sw-tiled.json" sw --label "EXPERTQMM_GROUP_ROWS=0 against 1" gemma4-26b-a4b
echo "=== combine's bytes under ncu (t=${SECONDS}s)"
[ "$SECONDS" -lt 470 ] && bash bench/probes/combine-bytes-ncu.sh
tar czf "$OUT/session21.tgz" -C "$OUT" --exclude=session21.tgz --exclude=prebuilt.tar.xz . 2>/dev/null
rm -rf "$OUT/ab" "$OUT/sw"
echo "=== end (t=${SECONDS}s)"
