"""Where a `--checkpoint` value's files are: a preset's folder, a directory, or a snapshot a hub id
already has in the local Hugging Face cache.

Owns: `hub_cache_dir` (the cache root as huggingface_hub finds it: `HF_HUB_CACHE`, else
`HF_HOME/hub`, else `~/.cache/huggingface/hub`), `find_snapshot` (a hub id such as
`Qwen/Qwen3.5-0.8B` → its snapshot folder) and `checkpoint_directory` (any `--checkpoint` value →
its folder, or None for a seeded preset or a value that names nothing).

Invariants:
- Nothing is downloaded and the network is never touched: only folders already on disk count.
- The cache layout is huggingface_hub's: `models--<org>--<name>/snapshots/<revision>/`, with
  `refs/main` naming the revision `from_pretrained` would use; without a usable ref the most
  recently modified snapshot holding a `config.json` is taken.
- A directory given as such always wins over a cache entry of the same spelling.
"""

from __future__ import annotations

import os

from metrale_jax.presets_data import PRESET_DIRS


def hub_cache_dir() -> str:
    """The Hugging Face hub cache root (`HF_HUB_CACHE`, else `$HF_HOME/hub`, else
    `~/.cache/huggingface/hub`), whether or not it exists."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def _is_repo_id(value: str) -> bool:
    parts = value.split("/")
    return len(parts) == 2 and all(p and p not in (".", "..") for p in parts)


def find_snapshot(repo_id: str, cache_dir: str | None = None) -> str | None:
    """The local snapshot folder of hub model `repo_id` ("org/name") in `cache_dir` (default
    `hub_cache_dir()`): the revision `refs/main` names, else the newest snapshot with a
    config.json; None when the cache holds no usable snapshot of it."""
    if not _is_repo_id(repo_id):
        return None
    repo = os.path.join(cache_dir or hub_cache_dir(), "models--" + repo_id.replace("/", "--"))
    snapshots = os.path.join(repo, "snapshots")
    if not os.path.isdir(snapshots):
        return None
    try:
        with open(os.path.join(repo, "refs", "main")) as f:
            ref = os.path.join(snapshots, f.read().strip())
        if os.path.isfile(os.path.join(ref, "config.json")):
            return ref
    except OSError:
        pass
    found = [os.path.join(snapshots, s) for s in os.listdir(snapshots)]
    found = [s for s in found if os.path.isfile(os.path.join(s, "config.json"))]
    return max(found, key=os.path.getmtime) if found else None


def checkpoint_directory(value: str) -> str | None:
    """The folder of a `--checkpoint` value: a shipped preset's, the directory itself, or the hub
    cache's snapshot of a hub id; None for a seeded preset (no files) or a value naming nothing."""
    if value in PRESET_DIRS:
        return PRESET_DIRS[value]
    if os.path.isdir(value):
        return value
    return find_snapshot(value)
