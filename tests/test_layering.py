"""One-way layering: cli -> tools -> engine -> model -> kernels, never back; no import cycle.

Each layer check imports every module of one layer in a fresh interpreter and asserts that
nothing from a layer above it was loaded: the engine loads no Click, no TOML reader and nothing
from the CLI or the tools; the model loads nothing from the engine; the kernels nothing from the
model. The package-level base modules (`metrale_jax.config`, `params`, `errors`, ...) belong to
no layer and any layer may import them.

The cycle check reads the source instead (`ast`), so it also sees the imports an interpreter
may never run: those inside functions and under `if TYPE_CHECKING:`. An edge is the project
module an import statement names (`from p import m` names `p.m` when that is a module, else
`p`); the parent packages Python also initialises are not edges (a package whose `__init__`
re-exports its submodules would otherwise be a cycle by construction). An import by a computed
name (`importlib.import_module`: the CLI's subcommands) is not an import statement and not seen.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator, Mapping
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


# ---- the import graph is a DAG ----

#: The project's packages, by import name, and their directories (the CLI installs from ./cli).
PACKAGES: dict[str, Path] = {
    "metrale_jax": REPO / "metrale_jax",
    "metrale_jax_cli": REPO / "cli",
    "kernels_pallas": REPO / "kernels_pallas",
    "kernels_cpu": REPO / "kernels_cpu",
    "benchmarks": REPO / "benchmarks",
}


def modules_of(packages: Mapping[str, Path]) -> dict[str, Path]:
    """Every module of `packages` by dotted name (`p/a/b.py` -> `p.a.b`, `p/a/__init__.py` -> `p.a`)."""
    out = {}
    for name, root in packages.items():
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join((name, *parts[: -1 if parts[-1] == "__init__" else None]))] = path
    return out


def imported_names(tree: ast.Module, module: str, is_package: bool) -> Iterator[str]:
    """Every dotted name an import statement anywhere in `tree` (top level, function bodies,
    `if TYPE_CHECKING:` blocks) names: `import a.b` -> `a.b`; `from a import b` -> `a.b`;
    relative imports resolved against `module`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")[: None if is_package else -1]
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph(packages: Mapping[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of `packages` it imports (the longest module prefix of each name an
    import statement names; imports from outside `packages` and of itself are dropped)."""
    modules = modules_of(packages)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        edges = graph[module] = set()
        for name in imported_names(ast.parse(path.read_text(), str(path)), module, path.name == "__init__.py"):
            parts = name.split(".")
            target = next((t for i in range(len(parts), 0, -1) if (t := ".".join(parts[:i])) in modules), None)
            if target not in (None, module):
                edges.add(target)
    return graph


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as `[a, b, ..., a]`, or None when `graph` is a DAG (a depth-first
    search in sorted order, so the cycle reported is the same every run)."""
    done: set[str] = set()
    for root in sorted(graph):
        if root in done:
            continue
        path, children = [root], [iter(sorted(graph[root]))]
        while path:
            child = next(children[-1], None)
            if child is None:
                done.add(path.pop())
                children.pop()
            elif child in path:
                return [*path[path.index(child) :], child]
            elif child not in done:
                path.append(child)
                children.append(iter(sorted(graph[child])))
    return None


def test_the_import_graph_is_a_dag_counting_lazy_and_type_checking_imports():
    graph = import_graph(PACKAGES)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_graph_is_not_vacuous():
    """Control: the graph holds every module of the tree and their edges (each kind of import
    statement is an edge: `test_a_planted_cycle_is_reported`)."""
    graph = import_graph(PACKAGES)
    assert "metrale_jax.engine.settings" in graph["metrale_jax_cli.serve_flags"]
    assert "metrale_jax.engine.capacity" in graph["metrale_jax.engine.settings"]
    assert len(graph) > 100 and sum(map(len, graph.values())) > 300


def _write_package(root: Path, files: Mapping[str, str]) -> dict[str, Path]:
    for name, text in {"__init__": "", **files}.items():
        (root / "pkg").mkdir(exist_ok=True)
        (root / "pkg" / f"{name}.py").write_text(text)
    return {"pkg": root / "pkg"}


@pytest.mark.parametrize(
    "back_edge",
    [
        "from pkg import a\n",
        "def f():\n    from pkg.a import A\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n",
        "from . import a\n",
    ],
    ids=["top-level", "function-level", "type-checking", "relative"],
)
def test_a_planted_cycle_is_reported(tmp_path, back_edge):
    """The check fails on a cycle however its back edge is written: pkg.a -> pkg.b -> pkg.a."""
    packages = _write_package(tmp_path, {"a": "import pkg.b\nA = 1\n", "b": back_edge, "c": "from pkg.a import A\n"})
    assert find_cycle(import_graph(packages)) == ["pkg.a", "pkg.b", "pkg.a"]


def test_a_dag_is_not_reported(tmp_path):
    """Control: the same package without the back edge (pkg.c imports pkg.a, which imports pkg.b)."""
    packages = _write_package(
        tmp_path, {"a": "import pkg.b\nA = 1\n", "b": "import os\n", "c": "from pkg.a import A\n"}
    )
    assert find_cycle(import_graph(packages)) is None
