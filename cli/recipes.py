"""Serve recipes: `recipes/<family>/<stem>.yaml` → a serve argv.

Owns: the recipe schema (parse and validate), rendering a recipe's `defaults` as serve flags,
and run-time flag overrides (`override_flags`, `serve_argv`). The final argv is parsed by the
serve options (`metrale_jax_cli.serve_flags.parse_serve_argv`); the flags a recipe may name are
those of `metrale_jax_cli.serve_flags.SERVE_FLAGS`.

Invariants:
- A recipe is refused whole: unknown top-level keys, missing required keys, non-scalar
  defaults, a `defaults` key that names no serve flag, a presence-only boolean set to anything
  but true/false, or a value flag set to a boolean.
- Key → flag: `_` becomes `-`, except `max_model_len` → `--max-seq-len`, `tensor_parallel` →
  `--tp-size`, `host` → `--bind`. A boolean renders as the bare flag (true) or nothing (false).
- Overrides: a flag named after `--` (either spelling of a boolean) removes the recipe's
  occurrences (with the value, unless written `--flag=v` or followed by another flag), then the
  extra flags are appended; the result names each flag as often as the extra flags do.
- Every problem with a recipe file surfaces as `RecipeError`, one line per problem.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from metrale_jax.errors import MetraleError, read_text
from metrale_jax_cli.serve_flags import SERVE_FLAGS

#: The repository's own recipes (the `--root` default of the commands that read recipes).
REPO_RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
#: The only recipe schema version this parser reads.
RECIPE_VERSION = "2"
#: The runtime a recipe must name to render for this engine.
RUNTIME = "metrale-jax"
_REQUIRED = ("recipe_version", "model", "runtime", "container", "defaults")
_OPTIONAL = ("min_nodes", "max_nodes", "metadata", "env")
_METADATA_KEYS = frozenset(
    {
        "description",
        "maintainer",
        "category",
        "model_params",
        "model_dtype",
        "quantization",
        "kv_dtype",
        "updated",
    }
)
_KEY_TO_FLAG = {"max_model_len": "--max-seq-len", "tensor_parallel": "--tp-size", "host": "--bind"}

Scalar = str | int | float | bool


class RecipeError(MetraleError, ValueError):
    """A recipe that cannot be found, read, validated or rendered (one clear line)."""


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A validated recipe. `defaults` keeps the file's order; `env` is carried, never applied."""

    id: str
    recipe_version: str
    model: str
    runtime: str
    container: str
    min_nodes: int
    max_nodes: int | None
    metadata: tuple[tuple[str, str], ...]
    defaults: tuple[tuple[str, Scalar], ...]
    env: tuple[tuple[str, str], ...]


#: Every serve flag spelling (`--x`, and the negative one of a boolean) → whether it is a
#: presence-only boolean.
_FLAG_KINDS: dict[str, bool] = {spelling: flag.type is bool for flag in SERVE_FLAGS for spelling in flag.spellings}
#: Every serve flag spelling → all spellings of its flag (a boolean's two).
_SPELLINGS: dict[str, tuple[str, ...]] = {
    spelling: flag.spellings for flag in SERVE_FLAGS for spelling in flag.spellings
}


def flag_for_key(key: str) -> str:
    """The serve flag a recipe `defaults` key renders as."""
    return _KEY_TO_FLAG.get(key, "--" + key.replace("_", "-"))


def _scalar_text(value: Any) -> str | None:
    """A YAML scalar as text (dates in ISO form); None for a non-scalar."""
    if isinstance(value, (datetime.date, datetime.datetime)):
        return value.isoformat()
    if isinstance(value, (str, int, float)):  # bool is an int
        return str(value).lower() if isinstance(value, bool) else str(value)
    return None


def parse_recipe(recipe_id: str, text: str) -> Recipe:
    """Parse and validate recipe `recipe_id` from YAML `text`. Raises RecipeError."""
    where = f"recipe {recipe_id}"
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise RecipeError(f"{where}: malformed YAML{at}: {problem}") from None
    if not isinstance(doc, dict):
        raise RecipeError(f"{where}: the top level must be a mapping")
    unknown = sorted(str(k) for k in doc if k not in _REQUIRED + _OPTIONAL)
    if unknown:
        raise RecipeError(
            f"{where}: unknown top-level key(s) {', '.join(unknown)} (allowed: {', '.join(_REQUIRED + _OPTIONAL)})"
        )
    missing = [k for k in _REQUIRED if k not in doc]
    if missing:
        raise RecipeError(f"{where}: missing required key(s) {', '.join(missing)}")

    version = _scalar_text(doc["recipe_version"])
    if version != RECIPE_VERSION:
        raise RecipeError(f'{where}: recipe_version must be "{RECIPE_VERSION}", got {doc["recipe_version"]!r}')
    strings = {}
    for key in ("model", "runtime", "container"):
        if not isinstance(doc[key], str) or not doc[key].strip():
            raise RecipeError(f"{where}: {key} must be a non-empty string, got {doc[key]!r}")
        strings[key] = doc[key].strip()

    min_nodes = doc.get("min_nodes", 1)
    max_nodes = doc.get("max_nodes")
    for key, n in (("min_nodes", min_nodes), ("max_nodes", max_nodes)):
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise RecipeError(f"{where}: {key} must be a positive integer, got {n!r}")
    if max_nodes is not None and max_nodes < min_nodes:
        raise RecipeError(f"{where}: max_nodes {max_nodes} is below min_nodes {min_nodes}")

    metadata = _scalar_map(where, "metadata", doc.get("metadata", {}))
    bad_meta = sorted(k for k, _ in metadata if k not in _METADATA_KEYS)
    if bad_meta:
        raise RecipeError(f"{where}: unknown metadata key(s) {', '.join(bad_meta)}")
    env = _scalar_map(where, "env", doc.get("env", {}))
    return Recipe(
        id=recipe_id,
        recipe_version=version,
        model=strings["model"],
        runtime=strings["runtime"],
        container=strings["container"],
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        metadata=metadata,
        defaults=_defaults(where, doc["defaults"]),
        env=env,
    )


def _scalar_map(where: str, name: str, value: Any) -> tuple[tuple[str, str], ...]:
    """A mapping of scalars (`metadata`, `env`) as text pairs; `{}` or an empty value is none."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise RecipeError(f"{where}: {name} must be a mapping")
    out = []
    for k, v in value.items():
        text = _scalar_text(v)
        if not isinstance(k, str) or text is None:
            raise RecipeError(f"{where}: {name}.{k} must be a scalar, got {v!r}")
        out.append((k, text))
    return tuple(out)


def _defaults(where: str, value: Any) -> tuple[tuple[str, Scalar], ...]:
    """Validate `defaults`: scalar values, known flags, presence-only booleans."""
    if not isinstance(value, dict):
        raise RecipeError(f"{where}: defaults must be a mapping of serve flags")
    out: list[tuple[str, Scalar]] = []
    for key, v in value.items():
        if not isinstance(key, str):
            raise RecipeError(f"{where}: defaults key {key!r} must be a string")
        flag = flag_for_key(key)
        if flag not in _FLAG_KINDS:
            raise RecipeError(f"{where}: defaults.{key} ({flag}) is not a metrale-jax serve flag")
        if _FLAG_KINDS[flag]:
            if not isinstance(v, bool):
                raise RecipeError(f"{where}: defaults.{key} is a presence-only flag; write true or false, not {v!r}")
        elif isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise RecipeError(f"{where}: defaults.{key} ({flag}) takes a scalar value, got {v!r}")
        out.append((key, v))
    return tuple(out)


def recipe_ids(recipes_dir: Path) -> list[str]:
    """Every recipe id (`family/stem`) under `recipes_dir`, sorted."""
    return sorted(p.relative_to(recipes_dir).with_suffix("").as_posix() for p in recipes_dir.glob("*/*.yaml"))


def load_recipe(recipes_dir: Path, recipe_id: str) -> Recipe:
    """Read and parse `<recipes_dir>/<recipe_id>.yaml`. Raises RecipeError (unknown id too)."""
    parts = recipe_id.split("/")
    if len(parts) != 2 or not all(p and p not in (".", "..") for p in parts):
        raise RecipeError(f"recipe id {recipe_id!r} is not FAMILY/STEM")
    path = recipes_dir / f"{recipe_id}.yaml"
    if not path.is_file():
        known = ", ".join(recipe_ids(recipes_dir)) or "none"
        raise RecipeError(f"unknown recipe {recipe_id!r} (no {path}; known: {known})")
    return parse_recipe(recipe_id, read_text(path, RecipeError))


def render_argv(recipe: Recipe) -> list[str]:
    """`[model, --flag, value, ...]` for `recipe`'s defaults, in file order.

    Raises RecipeError for another runtime or a multi-node recipe (this engine serves on one).
    """
    if recipe.runtime != RUNTIME:
        raise RecipeError(f"recipe {recipe.id} is for runtime {recipe.runtime!r}, not {RUNTIME!r}")
    if recipe.min_nodes > 1:
        raise RecipeError(f"recipe {recipe.id} needs {recipe.min_nodes} nodes; {RUNTIME} serves on one")
    argv = [recipe.model]
    for key, value in recipe.defaults:
        flag = flag_for_key(key)
        if isinstance(value, bool):
            argv += [flag] if value else []
        else:
            argv += [flag, str(value)]
    return argv


def override_flags(argv: Sequence[str], extra: Sequence[str]) -> list[str]:
    """`argv` without every flag `extra` names, then `extra` appended.

    A named flag is dropped with the value after it unless it is written `--flag=v` or the
    next token is itself a flag; `--flag=v` in `extra` names `--flag`, and a boolean's either
    spelling names both. So a later flag replaces the recipe's, value and all, and a boolean
    flag stays (moved to the end) or is turned off by its negative spelling.
    """
    named = {
        spelling
        for tok in extra
        if tok.startswith("--")
        for spelling in _SPELLINGS.get(tok.split("=", 1)[0], (tok.split("=", 1)[0],))
    }
    out: list[str] = []
    skip_value = False
    for tok in argv:
        if skip_value and not tok.startswith("--"):
            skip_value = False
            continue
        skip_value = False
        if tok.startswith("--") and tok.split("=", 1)[0] in named:
            skip_value = "=" not in tok
            continue
        out.append(tok)
    return out + list(extra)


def serve_argv(recipes_dir: Path, checkpoint: str, recipe_id: str | None, extra: Sequence[str]) -> list[str]:
    """The serve argv for `checkpoint`: `recipe_id` rendered (its model must be `checkpoint`: a
    local copy is resolved to its model's id first, `metrale_jax.memory.source.resolve_model`), or
    just `[checkpoint]`, then `extra` overriding. Raises RecipeError."""
    if recipe_id is None:
        return override_flags([checkpoint], extra)
    recipe = load_recipe(recipes_dir, recipe_id)
    if recipe.model != checkpoint:
        raise RecipeError(
            f"recipe {recipe_id} serves {recipe.model}, not --checkpoint {checkpoint} (a local copy of "
            f"{recipe.model} is taken for it when its config.json gives the same model)"
        )
    return override_flags(render_argv(recipe), extra)
