#!/usr/bin/env bash
# Device check of the Pallas kernels: every kernel against its reference at real shapes, timed
# against the HBM bandwidth floor measured in the same run; prints a short table last and exits 1
# when a case fails. Needs an NVIDIA GPU with jax >= 0.11.2 (CUDA) already installed; no network,
# and nothing from the repo but kernels_pallas/ and metrale_jax/text_table.py (no flax). Then, where
# flax and chex are installed, the sharded engine on every device found (metrale_jax/sharded_check.py;
# one device: nothing to shard); the exit status is 1 when either fails.
#
# Usage: bash benchmarks/gpu_check.sh [--only NAME] [--iters N] [--seed S]
#        bash benchmarks/gpu_check.sh --dry-run      # any machine: interpreter, tiny shapes
# PYTHON=... picks the interpreter (default: python3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
cd "$ROOT"
"$PY" -c 'import jax; print("jax", jax.__version__, "devices", jax.devices())' >&2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
status=0
"$PY" -W "ignore:The Pallas Triton backend is deprecated" benchmarks/gpu_check.py "$@" || status=$?
# The sharded engine (tensor / expert parallel meshes) on every device found, against one device;
# it needs the package's own dependencies (flax, chex), and more than one device to shard over.
if [[ " $* " != *" --dry-run "* ]] && "$PY" -c 'import flax, chex' 2>/dev/null; then
  "$PY" -m metrale_jax.sharded_check || status=1
fi
exit "$status"
