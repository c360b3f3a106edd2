#!/usr/bin/env bash
# Step 59's device call (bench/NOTES.md): the dense MLP on cuBLAS. After step57-device-call.sh unpacked
# out/prebuilt.tar.xz into build-gpu-check: the cuBLAS probe (the GEMMs alone against our route), the
# new GPU tests, then a 10-layer model bench at 512 / 1024 / 2048 tokens with EXPERTQMM_DENSE_CUBLAS
# unset (cuBLAS) against =0 (the expert tile route), alternated in one process (--versus), both layouts.
set -uo pipefail
OUT=${OUT:-./out}
export EXPERTQMM_COMMIT=$(cat out/commit)
b=build-gpu-check
d=$(scripts/cublas-lib-dir "$b/expertqmm"); [ -n "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}" && echo "cuBLAS from $d"
echo "=== dense cuBLAS probe (t=${SECONDS}s)"
timeout 120 "$b/dense_cublas_probe" >"$OUT/probe-dense-cublas.json" 2>"$OUT/probe-dense-cublas.err"
echo "probe exit $?"; tail -n 3 "$OUT/probe-dense-cublas.err"
python3 - "$OUT/probe-dense-cublas.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(f'{r["linear"]:>12} {r["bits"]}b T={r["tokens"]:>5}  cublas {r["cublas_gemm_us"]:7.1f}  dequant {r["dequant_us"]:5.1f}'
          f'  both {r["dequant_and_cublas_us"]:7.1f}  ours {r["one_expert_rows_us"]:7.1f} ({r["route"]})  {r["cublas_tflops"]:.0f} TF/s  diff {r["rel_diff"]:.1e}')
PY
echo "=== tests (t=${SECONDS}s)"
timeout 150 "$b/tests/expertqmm_gpu_tests" --gtest_filter='*DenseCublas*:*Gemma4Ffn*' --gtest_brief=1 >"$OUT/tests59.log" 2>&1
echo "tests exit $?"; grep -E "FAILED|PASSED|SKIPPED \]" "$OUT/tests59.log" | head -n 12
echo "=== model bench, 10 layers (t=${SECONDS}s)"
m=$b/model-10
timeout 60 "$b/expertqmm" write-checkpoint --preset gemma4-26b-a4b --layers 10 --out "$m" --force >"$OUT/model59.log" 2>&1
for tiled in "" --tiled; do
  timeout 100 "$b/expertqmm" bench --model "$m" --tokens 512,1024,2048 --product fused $tiled \
    --versus EXPERTQMM_DENSE_CUBLAS=0 --json "$OUT/model59${tiled:+-tiled}.json" 2>&1 | tee -a "$OUT/model59.log" | tail -n 8
done
tar czf "$OUT/step59.tgz" -C "$OUT" probe-dense-cublas.json tests59.log model59.log model59.json model59-tiled.json 2>/dev/null
echo "=== end (t=${SECONDS}s)"
