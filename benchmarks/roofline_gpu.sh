#!/usr/bin/env bash
# The roofline section (`python -m benchmarks all --gpu`) as one prepared command for a GPU machine:
# a Qwen3.5-35B-A3B-width 8-layer stack (bf16), decode n = 1/8/32 and verify n = 8/32 x K = 4 over
# 2048 cached tokens, each step against its bytes / measured-bandwidth floor, plus the GDN-rows and
# paged-attention kernels at the same shapes (most of its time is compilation).
#
# Needs python3 with jax (CUDA), flax, chex, click, pyyaml, safetensors, ml-dtypes (the device
# image's python3 holds them); `tomli` is shimmed from the standard tomllib when it is missing.
# No network. Writes $OUT/roofline.json (or out/roofline.json) and prints the table last.
#
# Usage: bash benchmarks/roofline_gpu.sh [--dry-run] [other `python -m benchmarks all` options]
#        bash benchmarks/roofline_gpu.sh --dry-run     # any machine: tiny shapes, interpreter
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
DEST="${OUT:-$ROOT/out}"
SHIM="$(mktemp -d)"
trap 'rm -rf "$SHIM"' EXIT
if ! "$PY" -c 'import tomli' 2>/dev/null; then
  printf 'from tomllib import *  # noqa: F401,F403\nfrom tomllib import TOMLDecodeError, load, loads  # noqa: F401\n' > "$SHIM/tomli.py"
fi
mkdir -p "$DEST"
cd "$ROOT"
"$PY" -c 'import jax; print("jax", jax.__version__, "devices", jax.devices())' >&2
PYTHONPATH="$ROOT:$SHIM${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
  "$PY" -W "ignore:The Pallas Triton backend is deprecated" -m benchmarks all --gpu \
  --json "$DEST/roofline.json" --workdir "$DEST/bench" "$@"
