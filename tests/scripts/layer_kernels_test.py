#!/usr/bin/env python3
"""scripts/layer_kernels.py against a small ncu table written here: three layer passes of four
kernels (one launched twice a pass, one once more outside the passes), the bench's copy kernel apart, units in ns and us, totals per
pass largest first; a file without a table is an error that names it."""
import os
import subprocess
import sys
import tempfile

from script_check import expect_refusal

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "layer_kernels.py")

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def row(i, name, unit, value):
    return (f'"{i}","1","expertqmm","host","{name}","1","7","(256, 1, 1)","(132, 1, 1)","0","9.0",'
            f'"Command line profiler metrics","gpu__time_duration.sum","{unit}","{value}"')


def run(path):
    return subprocess.run([sys.executable, SCRIPT, path, "--label", "T=2048"], capture_output=True, text=True)


def main():
    pass_kernels = [  # name, unit, value per pass (the plan kernel twice)
        ("void router_kernel<(Kind)1>(RouterArgs)", "nsecond", "10,000"),
        ("void plan_kernel(int const*, int)", "nsecond", "2,000"),
        ("void plan_kernel(int const*, int)", "nsecond", "4,000"),
        ("void ws_kernel<__nv_bfloat16, (expertqmm::cuda::WgmmaForm)1>(expertqmm::cuda::WgmmaTileArgs)", "usecond", "300"),
        ("void combine_kernel(float const*, __nv_bfloat16*)", "nsecond", "20,000"),
    ]
    lines = ["==PROF== Connected to process 1", "tokens 2048: floor 185 us", HEADER,
             row(0, "copy_kernel(float*, float const*)", "nsecond", "5,000")]
    for p in range(3):
        for name, unit, value in pass_kernels:
            lines.append(row(len(lines), name, unit, value))
    lines.append(row(len(lines), pass_kernels[0][0], "nsecond", "10,000"))  # the bench's own routing
    with tempfile.TemporaryDirectory() as tmp:
        table = os.path.join(tmp, "T2048.csv")
        with open(table, "w") as f:
            f.write("\n".join(lines) + "\n")
        r = run(table)
        assert r.returncode == 0, r.stderr
        out = r.stdout.splitlines()
        assert out[0] == "T=2048: 3 layer passes profiled; per pass 336.0 us in 5 launches", out[0]
        first, plan = out[2], out[5]
        assert first.split()[:4] == ["300.0", "89.3%", "1", "300.0"], first
        assert first.endswith("ws_kernel<__nv_bfloat16, (expertqmm::cuda::WgmmaForm)1>"), first
        assert plan.split()[:4] == ["6.0", "1.8%", "2", "3.0"] and plan.endswith("void plan_kernel"), plan
        assert "apart" in out[6] and "copy_kernel (1 launches)" in out[6], out[6]
        assert len(out) == 7, out

        expect_refusal(run, tmp, "==PROF== no kernels were profiled\n", "no ncu table")
    print("layer_kernels: PASS")


if __name__ == "__main__":
    main()
