#!/usr/bin/env bash
# Step 57's device call (bench/NOTES.md): the router norm's warp kernel against 7c7c997, on the GPU
# machine from the repository root with out/prebuilt.tar.xz (PACK_BASELINE_CLI = 7c7c997's CLI) and
# out/commit carried. The router and layer GPU tests, the layer A/B on the tile layout (two rounds a
# side, alternated) and the MLX layout at 2048, then both CLIs' norm kernel alone under ncu at 2048.
set -uo pipefail
OUT=${OUT:-./out}
export EXPERTQMM_COMMIT=$(cat out/commit)
b=build-gpu-check
mkdir -p "$b" && tar xJf out/prebuilt.tar.xz -C "$b"
d=$(scripts/cublas-lib-dir "$b/expertqmm"); [ -n "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
echo "=== tests (t=${SECONDS}s)"
timeout 120 "$b/tests/expertqmm_gpu_tests" --gtest_filter='*Rout*:*Gemma4*:*GpuMoe*:*Qwen3*' --gtest_brief=1 \
  >"$OUT/tests.log" 2>&1
echo "tests exit $?"; tail -n 3 "$OUT/tests.log"
echo "=== A/B (t=${SECONDS}s)"
mkdir -p "$OUT/ab" "$OUT/mlx"
for round in 1 2; do
  for who in baseline current; do
    bin=$b/expertqmm; c=$EXPERTQMM_COMMIT
    [ "$who" = baseline ] && bin=$b/expertqmm-base && c=7c7c997
    EXPERTQMM_COMMIT=$c timeout 40 "$bin" bench --preset gemma4-26b-a4b --tokens 512,1024,2048 --routing uniform \
      --product fused --tiled --json "$OUT/ab/ab-gemma4-26b-a4b-$who-$round.json" >>"$OUT/bench.log" 2>&1
    EXPERTQMM_COMMIT=$c timeout 30 "$bin" bench --preset gemma4-26b-a4b --tokens 2048 \
      --routing uniform --product fused --json "$OUT/mlx/ab-gemma4-26b-a4b-$who-$round.json" >>"$OUT/bench.log" 2>&1
  done
done
python3 scripts/ab_summary.py "$OUT/ab" "$OUT/ab-tiled.json" ab gemma4-26b-a4b
python3 scripts/ab_summary.py "$OUT/mlx" "$OUT/ab-mlx.json" ab gemma4-26b-a4b
echo "=== norm kernel under ncu, 2048 tokens (t=${SECONDS}s)"
for who in base current; do
  bin=$b/expertqmm; [ "$who" = base ] && bin=$b/expertqmm-base
  timeout 45 ncu --clock-control none --kernel-name regex:router_rms_norm --metrics gpu__time_duration.sum,dram__bytes.sum \
    --csv --print-units base "$bin" bench --preset gemma4-26b-a4b --tokens 2048 --routing uniform --product fused \
    --replays 2 --ungated --tiled >"$OUT/ncu-$who.csv" 2>/dev/null
  echo "$who:"; grep -E "gpu__time_duration|dram__bytes" "$OUT/ncu-$who.csv" | tail -n 4 | cut -d, -f5,13- 
done
tar czf "$OUT/step57.tgz" -C "$OUT" --exclude=step57.tgz . 2>/dev/null
echo "=== end (t=${SECONDS}s)"
