#!/usr/bin/env bash
# Regenerates the MLX goldens: runs every tests/golden/make_*.py with OUTDIR as its only argument.
# Usage: tests/golden/regen.sh [OUTDIR]   (default: tests/golden itself). Needs python3 with mlx.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here}
mkdir -p "$out"
shopt -s nullglob
scripts=("$here"/make_*.py)
if [ ${#scripts[@]} -eq 0 ]; then
  echo "regen.sh: no make_*.py in $here" >&2
  exit 1
fi
for script in "${scripts[@]}"; do
  echo "regen.sh: $(basename "$script") -> $out"
  python3 "$script" "$out"
done
