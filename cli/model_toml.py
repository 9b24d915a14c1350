"""A model's MODEL.toml, read into the `[behavior]` defaults the serve settings resolve against.

Owns: reading and checking the file (`load_behavior`, `parse_behavior`) and `BehaviorError`.
The values themselves are `metrale_jax.engine.settings.Behavior`; only this module parses TOML.

Invariants:
- Only `[behavior]` `default_num_drafts`, `mtp_max_seqs` (non-negative integers, not booleans)
  and `default_kv_dtype` (a string) are read; other keys and tables are ignored.
- An absent file is not an error: it gives the engine defaults, and `Behavior.source` says so;
  an unreadable or non-UTF-8 one is (one line naming the byte offset).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tomli

from metrale_jax.engine.settings import Behavior
from metrale_jax.errors import MetraleError, read_text


class BehaviorError(MetraleError, ValueError):
    """A MODEL.toml that cannot be read as `[behavior]` defaults (one clear line)."""


def parse_behavior(text: str, source: str) -> Behavior:
    """Parse MODEL.toml `text` (`source` names it in messages and in `Behavior.source`).

    Raises BehaviorError on bad TOML or a key of the wrong type (integers must be non-negative
    integers, not booleans; the dtype a string).
    """
    try:
        doc = tomli.loads(text)
    except tomli.TOMLDecodeError as e:
        raise BehaviorError(f"{source}: not valid TOML ({e})") from None
    table = doc.get("behavior", {})
    if not isinstance(table, dict):
        raise BehaviorError(f"{source}: [behavior] must be a table")
    values: dict[str, Any] = {}
    for key in ("default_num_drafts", "mtp_max_seqs"):
        v = table.get(key, 0)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise BehaviorError(f"{source}: [behavior] {key} must be a non-negative integer, got {v!r}")
        values[key] = v
    kv = table.get("default_kv_dtype", "")
    if not isinstance(kv, str):
        raise BehaviorError(f"{source}: [behavior] default_kv_dtype must be a string, got {kv!r}")
    return Behavior(**values, default_kv_dtype=kv, source=source)


def load_behavior(path: Path) -> Behavior:
    """Read `path`; an absent file gives the engine defaults (and says so in `source`)."""
    if not path.is_file():
        return Behavior(source=f"{path} absent: engine defaults")
    return parse_behavior(read_text(path, BehaviorError), str(path))
