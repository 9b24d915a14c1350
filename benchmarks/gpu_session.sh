#!/usr/bin/env bash
# A lent GPU machine's whole session as one prepared command, in three stages, each under its own time limit:
#   1. gpu_check: every Pallas kernel against its reference at real shapes, and the sharded engine where
#      several devices are found (`benchmarks/gpu_check.sh`);
#   2. roofline: the Qwen3.5-35B-A3B-width steps and kernels against the HBM floor (`benchmarks/roofline_gpu.sh`);
#   3. e2e: speculative against plain greedy tokens/s on the GPU (the `e2e` section through the same shim):
#      `small` with its MTP drafter at n = 1 and 8, 3 drafts, and the 45 M model with oracle drafts at n = 1.
# A stage that outruns its limit is stopped with every process it started (`timeout` signals its process
# group) and the next stage runs, so one hang costs one stage. Each stage's output goes to $OUT/<stage>.log
# (or out/gpu_session/) as it is printed, the JSON of stages 2 and 3 next to it (7 files: a device call
# brings back 8 at most); the last lines give each stage's exit status and seconds (124: stopped at its
# limit). Exit status: 0 when every stage passed.
#
# Usage: bash benchmarks/gpu_session.sh            # on the GPU machine (about 7 minutes at most)
#        bash benchmarks/gpu_session.sh --dry-run  # any machine: interpreter, tiny shapes
# Limits in seconds: GPU_CHECK_S (default 120), ROOFLINE_S (170), E2E_S (150). PYTHON as the stages take it.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${OUT:-$ROOT/out/gpu_session}"
DRY=()
E2E_SIZES=(--e2e-ns 1,8 --e2e-drafts 3 --e2e-oracle-ns 1)
if [[ "${1:-}" == "--dry-run" ]]; then
  DRY=(--dry-run)
  E2E_SIZES=(--e2e-ns 1 --e2e-drafts 2 --e2e-new-tokens 8 --e2e-oracle-model tiny-2L --e2e-oracle-ns 1
    --e2e-oracle-new-tokens 8 --e2e-rounds 1)
elif [[ $# -gt 0 ]]; then
  echo "usage: bash benchmarks/gpu_session.sh [--dry-run]" >&2
  exit 2
fi
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$DEST"
cd "$ROOT"
export PYTHONUNBUFFERED=1
summary=()
status=0

stage() {  # stage NAME LIMIT_S COMMAND...
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$DEST/$name.log"
  rc=${PIPESTATUS[0]}
  summary+=("$name: exit $rc, $(($(date +%s) - start)) s (limit $limit s)")
  [[ $rc -eq 0 ]] || status=1
}

(command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv) \
  > "$DEST/machine.txt" 2>&1
stage gpu_check "${GPU_CHECK_S:-120}" bash benchmarks/gpu_check.sh "${DRY[@]}"
stage roofline "${ROOFLINE_S:-170}" bash benchmarks/roofline_gpu.sh "${DRY[@]}" --json "$DEST/roofline.json" \
  --workdir "$WORK"
stage e2e "${E2E_S:-150}" bash benchmarks/roofline_gpu.sh "${DRY[@]}" --sections e2e --json "$DEST/e2e.json" \
  --workdir "$WORK" "${E2E_SIZES[@]}"
printf '%s\n' "gpu_session:" "${summary[@]}" | tee "$DEST/summary.txt"
exit "$status"
