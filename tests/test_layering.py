"""One-way layering: cli -> tools -> engine -> model -> kernels, never back.

Each check imports every module of one layer in a fresh interpreter and asserts that nothing
from a layer above it was loaded: the engine loads no Click, no TOML reader and nothing from the
CLI or the tools; the model loads nothing from the engine; the kernels nothing from the model.
The package-level base modules (`metrale_jax.config`, `params`, `errors`, ...) belong to no layer
and any layer may import them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: Top-down: each layer may import the layers after it, never those before it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("cli", ("metrale_jax_cli",)),
    (
        "tools",
        (
            "metrale_jax.diff",
            "metrale_jax.memory",
            "metrale_jax.recipes",
            "metrale_jax.research",
            "metrale_jax.sharded_check",
            "metrale_jax.sharded_lowering",
            "metrale_jax.training",
        ),
    ),
    ("engine", ("metrale_jax.engine",)),
    ("model", ("metrale_jax.model",)),
    ("kernels", ("kernels_pallas", "kernels_cpu")),
)
#: Libraries only the CLI uses: the engine and everything below it must not load them.
CLI_LIBRARIES = ("click", "tomli")

_PROBE = """
import importlib, json, pkgutil, sys
roots, forbidden = json.loads(sys.argv[1])
for root in roots:
    module = importlib.import_module(root)
    for info in pkgutil.walk_packages(getattr(module, "__path__", []), root + "."):
        importlib.import_module(info.name)
loaded = sorted(n for n in sys.modules if any(n == f or n.startswith(f + ".") for f in forbidden))
print(json.dumps(loaded))
"""


def loaded_from(roots: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    """Import every module under `roots` in a fresh interpreter; the loaded modules that are, or
    sit under, a name in `forbidden`."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps([roots, forbidden])],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _above(layer: str) -> tuple[str, ...]:
    """Every package of the layers above `layer` (plus the bare `cli` directory name)."""
    names = [name for name, _ in LAYERS]
    above = tuple(pkg for name, pkgs in LAYERS[: names.index(layer)] for pkg in pkgs)
    return (*above, "cli") if "metrale_jax_cli" in above else above


def test_tools_do_not_import_the_cli():
    assert loaded_from(dict(LAYERS)["tools"], _above("tools")) == []


@pytest.mark.parametrize("layer", ["engine", "model", "kernels"])
def test_layer_imports_nothing_above_it_and_no_cli_library(layer):
    assert loaded_from(dict(LAYERS)[layer], (*_above(layer), *CLI_LIBRARIES)) == []


def test_the_probe_sees_what_a_layer_loads():
    """Control: the CLI loads Click and the engine, so the probe is not vacuous."""
    assert {"click", "metrale_jax.engine"} <= set(loaded_from(dict(LAYERS)["cli"], ("click", "metrale_jax.engine")))
