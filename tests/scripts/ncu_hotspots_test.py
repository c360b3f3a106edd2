#!/usr/bin/env python3
"""scripts/ncu-hotspots against a small source page written here: the instruction holding the most
stall samples comes first with its main reason, the tensor-core loop's shares are right, and a file
without a source table is an error that names it."""
import os
import subprocess
import sys
import tempfile

from script_check import expect_refusal

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "ncu-hotspots")

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
          '"Instructions Executed","stall_long_sb","stall_barrier","stall_math","stall_long_sb (Not Issued)"')
ROWS = [  # address, source, samples, executed, long_sb, barrier, math
    ("0000", "LDG.E R2, desc[UR4][R2.64]", 5, 100, 5, 0, 0),
    ("0010", "IABS R4, R2", 60, 100, 55, 0, 5),
    ("0020", "HMMA.16816.F32.BF16 R8, R12, R16, R8", 10, 400, 0, 0, 10),
    ("0030", "LOP3.LUT R5, R6, 0xf, RZ, 0xc0, !PT", 5, 300, 0, 0, 5),
    ("0040", "HMMA.16816.F32.BF16 R8, R12, R18, R8", 10, 400, 0, 0, 10),
    ("0050", "BAR.SYNC.DEFER_BLOCKING 0x0", 10, 100, 0, 10, 0),
]


def run(path):
    return subprocess.run([sys.executable, SCRIPT, path, "--top", "3"], capture_output=True, text=True)


def main():
    with tempfile.TemporaryDirectory() as tmp:
        page = os.path.join(tmp, "k-T8-sass.csv")
        with open(page, "w") as f:
            f.write("==PROF== Connected to process 1\nsome bench output\n" + HEADER + "\n")
            for a, src, samples, executed, lsb, bar, math in ROWS:
                f.write(f'"{a}","{src}","{samples}","0","{executed:,}","{lsb}","{bar}","{math}","0"\n')
        r = run(page)
        assert r.returncode == 0, r.stderr
        out = r.stdout.splitlines()
        assert "6 SASS instructions, 1,400 warp-instructions executed, 100 stall samples" in out[0], out[0]
        # every row lies within +-60 of the two HMMAs: the whole page
        assert "100.0% of executed, 100.0% of samples" in out[1], out[1]
        assert out[2].startswith("stall reasons: long_sb 60.0%, math 30.0%, barrier 10.0%"), out[2]
        first = out[4]
        assert "60.0%" in first and "IABS R4, R2" in first and "[long_sb 55, math 5]" in first, first
        assert len(out) == 4 + 3, out

        expect_refusal(run, tmp, "==PROF== no kernel matched\n", "no source table")
    print("ncu-hotspots: PASS")


if __name__ == "__main__":
    main()
