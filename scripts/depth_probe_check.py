"""Check the memory planner's depth probes on this backend: a serve's step programs compiled at the
model's full depth against the affine extension from 1 and 2 layer groups (what `metrale-jax
memory` charges on the backends of `DEPTH_PROBE_BACKENDS`), byte for byte.

Usage: .venv/bin/python scripts/depth_probe_check.py --checkpoint Qwen/Qwen3-Next-80B-A3B-Instruct \
           --recipe qwen3-next/qwen3-next-80b-a3b-mtp [--dtype bfloat16] [--concurrency 4]

Prints one row per program (bytes both ways, compile seconds) and exits 1 when any differs.
Nothing is cached: both sides compile into fresh temporary directories.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import click

from metrale_jax import runtime_env

runtime_env.prepare()

from metrale_jax.engine.capacity import pool_counts  # noqa: E402
from metrale_jax.engine.settings import resolve_settings  # noqa: E402
from metrale_jax.memory.activations import ActivationModel  # noqa: E402
from metrale_jax.memory.source import resolve_model  # noqa: E402
from metrale_jax.model.layer_groups import layer_groups  # noqa: E402
from metrale_jax.presets import parse_dtype  # noqa: E402
from metrale_jax_cli.model_toml import load_behavior  # noqa: E402
from metrale_jax_cli.recipes import REPO_RECIPES_DIR, serve_argv  # noqa: E402
from metrale_jax_cli.serve_flags import parse_serve_argv  # noqa: E402


@click.command()
@click.option("--checkpoint", required=True)
@click.option("--recipe", default=None)
@click.option("--dtype", default=None, help="served dtype (default: the checkpoint's)")
@click.option("--concurrency", default=4, show_default=True, help="slots when the recipe says auto")
def main(checkpoint: str, recipe: str | None, dtype: str | None, concurrency: int) -> None:
    source = resolve_model(checkpoint, REPO_RECIPES_DIR)
    _, raw = parse_serve_argv(serve_argv(REPO_RECIPES_DIR, source.id, recipe, ()))
    settings = resolve_settings(raw, load_behavior(source.model_toml), auto_slots=concurrency)
    counts = pool_counts(settings, source.config)
    served = parse_dtype(dtype or source.dtype)
    rows = {}
    for label, full in (("probed", False), ("full", True)):
        model = ActivationModel(source.config, served, cache_dir=Path(tempfile.mkdtemp()), full_depth=full)
        t0 = time.perf_counter()
        rows[label] = model.exact(settings, counts)
        print(f"{label}: {len(model.depths())} depth(s), {model.compiled} programs, {time.perf_counter() - t0:.1f} s")
    print(f"{source.id}: {layer_groups(source.config)} layer groups, backend {model.backend} ({model.device_kind})")
    bad = 0
    for name, p in rows["probed"].items():
        q = rows["full"][name]
        same = (p.temp, p.outputs) == (q.temp, q.outputs)
        bad += not same
        verdict = "equal" if same else "DIFFERENT"
        print(
            f"{name:12s} temp {p.temp:>14,d} / {q.temp:>14,d}  outputs {p.outputs:>12,d} / {q.outputs:>12,d}  {verdict}"
        )
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
