#!/usr/bin/env bash
# Regenerate the golden Hugging Face fixtures in tests/fixtures/hf (see tests/fixtures/hf/README.md).
#
# transformers 5.x needs Python >= 3.11 and torch, which the project's own (3.12, JAX) venv does not
# carry, so this uses a separate, throw-away venv (default /tmp/metrale-hf-venv, override with
# HF_VENV=...). Idempotent: the venv is made and filled once, and reruns write the same fixtures.
# Never touches the network beyond the package installs: the hub is off (HF_HUB_OFFLINE=1).
#
# torch is pinned to the CPU build (torch==2.13.0+cpu): pip must find it in its find-links / an extra
# CPU-wheel index configured for pip (this workplace's pip.conf points find-links at a folder that
# holds it). A plain PyPI torch would be the CUDA build; the pin makes pip fail instead of pulling it.
#
# Usage: bash scripts/make_hf_fixtures.sh [extra args for make_hf_fixtures.py, e.g. --only qwen3_5_moe]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HF_VENV:-/tmp/metrale-hf-venv}"
TORCH_REQ="${HF_TORCH_REQ:-torch==2.13.0+cpu}"
REQS=("$TORCH_REQ" "transformers==5.24.0" "safetensors>=0.4" "numpy>=1.26")
STAMP="$VENV/.metrale-hf-fixtures"

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 HF_HUB_DISABLE_PROGRESS_BARS=1
export PIP_DISABLE_PIP_VERSION_CHECK=1

find_python311() {
  local c
  for c in "${PYTHON311:-}" "$HOME/.pyenv/versions/3.11.7/bin/python3" python3.11; do
    [ -n "$c" ] || continue
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
      command -v "$c"
      return 0
    fi
  done
  # pyenv may hold another 3.11.x
  for c in "$HOME"/.pyenv/versions/3.11.*/bin/python3; do
    [ -x "$c" ] && { echo "$c"; return 0; }
  done
  return 1
}

if [ -x "$VENV/bin/python" ] && ! "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "error: $VENV exists but is not a Python 3.11 venv; remove it or set HF_VENV" >&2
  exit 2
fi

if [ ! -x "$VENV/bin/python" ]; then
  PY311="$(find_python311)" || { echo "error: no Python 3.11 found (pyenv 3.11.7 or python3.11; or set PYTHON311)" >&2; exit 2; }
  echo "creating $VENV with $PY311"
  "$PY311" -m venv "$VENV"
fi

WANT="${REQS[*]}"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "installing into $VENV: $WANT"
  "$VENV/bin/python" -m pip install -q "${REQS[@]}"
  echo "$WANT" > "$STAMP"
fi

"$VENV/bin/python" - <<'EOF'
import torch, transformers
assert torch.version.cuda is None, f"a CUDA torch ({torch.__version__}) is in the fixture venv; use the CPU build"
assert int(transformers.__version__.split(".")[0]) >= 5, transformers.__version__
EOF

if [ "${1:-}" = "--venv-only" ]; then exit 0; fi  # the benchmarks only need the venv
cd "$ROOT"
# PYTHONPATH: the fixtures' configs are read from metrale_jax/model_registry.py (plain data, no jax).
PYTHONPATH="$ROOT" exec "$VENV/bin/python" scripts/make_hf_fixtures.py --out tests/fixtures/hf "$@"
