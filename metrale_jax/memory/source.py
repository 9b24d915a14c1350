"""What `--checkpoint` names, for planning: a preset, a directory, or a model id with a local config.

Owns: turning the `--checkpoint` text into the model's id (what a recipe's `model` must equal),
its `ModelConfig`, where its MODEL.toml is (the CLI reads it: `metrale_jax_cli.model_toml`), the
dtype it is served in, and, when its weights are on disk, the checkpoint's tensor index. Nothing
is downloaded and no tensor is read.

Invariants:
- Resolution order: preset (`tiny` or `metrale-jax/tiny`), then an existing directory with a
  config.json, then a hub id's snapshot in the local Hugging Face cache
  (`metrale_jax.hub_cache.find_snapshot`), then `<recipes>/models/<id>/config.json`; anything
  else is refused.
- A local copy of a model (a directory, a cache snapshot) is that model when the `expected` id
  (a recipe's model) has `<recipes>/models/<expected>/config.json` and both config.json files give
  the same `ModelConfig`: the id becomes `expected`.
- MODEL.toml is `<model dir>/MODEL.toml` (presets: `<recipes>/models/metrale-jax/<name>/`); a
  copy without one takes `<recipes>/models/<id>/MODEL.toml`, where a download never has it.
  Absent everywhere, it means engine defaults.
- With safetensors present, the config is completed from the headers exactly as the loader
  completes it (`metrale_jax.checkpoint.plan_load`), so planner and loader see one model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from metrale_jax.checkpoint import Binding, TensorRef, declared_dtype, index_checkpoint, plan_load
from metrale_jax.config import ModelConfig, load_model_config
from metrale_jax.hub_cache import find_snapshot
from metrale_jax.memory.errors import PlanError
from metrale_jax.presets import PRESETS
from metrale_jax.presets_data import PRESET_DIRS
from metrale_jax.quantization import Quantization, read_quantization

#: The id prefix of the embedded presets (`metrale-jax/tiny`).
PRESET_ORG = "metrale-jax"


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A resolved `--checkpoint`: `id`, `config`, where the config came from, the path of its
    MODEL.toml (`model_toml`, possibly absent), the default served `dtype` name, and the local
    tensor index with its load bindings (both empty when no weights are on disk)."""

    id: str
    config: ModelConfig
    config_from: str
    model_toml: Path
    dtype: str
    tensors: dict[str, TensorRef] = dataclasses.field(default_factory=dict)
    bindings: tuple[Binding, ...] = ()
    quantization: Quantization | None = None


def resolve_model(arg: str, recipes_dir: Path, expected: str | None = None) -> ModelSource:
    """Resolve `--checkpoint arg` against the presets, the directories, the local HF cache and
    `<recipes_dir>/models`; `expected` (a recipe's model id) names the model a local copy may be.

    Raises PlanError (unknown checkpoint), `ConfigError` or `CheckpointError`,
    each with one clear line.
    """
    models_dir = recipes_dir / "models"
    name = arg.removeprefix(f"{PRESET_ORG}/")
    if name in PRESETS:
        model_id = f"{PRESET_ORG}/{name}"
        return ModelSource(
            id=model_id,
            config=PRESETS[name][0],
            config_from=f"preset {name}",
            model_toml=models_dir / model_id / "MODEL.toml",
            dtype="float32",
        )
    path = Path(PRESET_DIRS.get(name, arg))
    snapshot = find_snapshot(arg)
    if (path / "config.json").is_file():
        directory = path
        try:
            model_id = path.resolve().relative_to(models_dir.resolve()).as_posix()
        except ValueError:
            model_id = arg
    elif snapshot is not None:
        directory, model_id = Path(snapshot), arg
    elif (models_dir / arg / "config.json").is_file():
        directory, model_id = models_dir / arg, arg
    else:
        known = ", ".join(
            sorted(f"{PRESET_ORG}/{p}" for p in [*PRESETS, *PRESET_DIRS])
            + sorted(p.parent.relative_to(models_dir).as_posix() for p in models_dir.glob("*/*/config.json"))
        )
        raise PlanError(
            f"unknown checkpoint {arg!r}: not a preset, a directory with a "
            f"config.json, or a model id under {models_dir} (known: {known})"
        )
    config = load_model_config(directory)
    expected_config = models_dir / (expected or "") / "config.json"
    if expected and model_id != expected and expected_config.is_file() and load_model_config(expected_config) == config:
        model_id = expected  # a local copy of the recipe's model
    model_toml = directory / "MODEL.toml"
    if not model_toml.is_file() and (models_dir / model_id / "MODEL.toml").is_file():
        model_toml = models_dir / model_id / "MODEL.toml"
    raw = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    quant = read_quantization(directory, raw)
    tensors: dict[str, TensorRef] = {}
    binds: tuple[Binding, ...] = ()
    if any(directory.glob("*.safetensors")):
        tensors = index_checkpoint(str(directory))
        config, bound = plan_load(config, tensors, quant)
        binds = tuple(bound)
    return ModelSource(
        id=model_id,
        config=config,
        config_from=str(directory / "config.json"),
        model_toml=model_toml,
        dtype=declared_dtype(raw) or "bfloat16",
        tensors=tensors,
        bindings=binds,
        quantization=quant,
    )
