#!/usr/bin/env bash
# Where the prefill combine's bytes come from (issue 15): at 2048 tokens, --tiled, L2 flushed by the
# bench, the combine kernel and the down GEMM under ncu with DRAM bytes and the L2 hit rate of their
# loads. CACHE=none (default) leaves the L2 as the previous kernel left it, as in the graph; ncu's own
# default (all) flushes it before every kernel, so a kernel reading what the last one wrote reads it
# cold (the twenty-first session's reading was taken so). Run after a device script (e.g. session22-device-call.sh) unpacked out/prebuilt.tar.xz into build-gpu-check.
set -uo pipefail
OUT=${OUT:-./out}
b=build-gpu-check
d=$(scripts/cublas-lib-dir "$b/expertqmm"); [ -n "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
timeout 60 ncu --clock-control none --cache-control "${CACHE:-none}" --kernel-name regex:'weighted_combine|expert_tiles_wgmma' \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \
  --csv --print-units base "$b/expertqmm" bench --preset gemma4-26b-a4b --tokens 2048 --routing uniform \
  --product fused --replays 1 --ungated --tiled >"$OUT/ncu-combine.csv" 2>/dev/null
echo "ncu exit $?"
python3 - "$OUT/ncu-combine.csv" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 12]
hdr = rows[0]; ki = hdr.index("Kernel Name"); mi = hdr.index("Metric Name"); vi = hdr.index("Metric Value"); ii = hdr.index("ID")
by = collections.OrderedDict()
for r in rows[1:]:
    by.setdefault((r[ii], r[ki][:60]), {})[r[mi]] = r[vi]
for (i, k), m in list(by.items())[-12:]:
    print(i, k, {a: m[a] for a in sorted(m)})
PY
