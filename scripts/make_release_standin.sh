#!/usr/bin/env bash
# Write the Qwen3.5-0.8B stand-in (released layout, random HF-initialised bf16 weights) with the HF
# fixture venv (made by scripts/make_hf_fixtures.sh --venv-only: Python 3.11, torch CPU,
# transformers 5.x). Never touches the network (the hub is off).
#
# Usage: bash scripts/make_release_standin.sh [--out DIR]   (default ~/.cache/metrale-jax/standins/qwen3.5-0.8b)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HF_VENV:-/tmp/metrale-hf-venv}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
bash "$ROOT/scripts/make_hf_fixtures.sh" --venv-only
exec "$VENV/bin/python" "$ROOT/scripts/make_release_standin.py" "$@"
