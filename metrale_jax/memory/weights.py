"""Weight bytes for the memory planner, from the checkpoint's headers or the parameter tree's shapes.

Owns: grouping the served parameters into report rows (embedding, head, per mixer kind, MLP,
norms, MTP head) and finding the checkpoint bytes the engine never loads ("outside").

Invariants:
- With weights on disk, a parameter's bytes are its tensors' byte ranges in the safetensors
  headers, via the loader's own bindings (the loader keeps the stored dtype).
- Without, they are the shapes of the same bindings (the checkpoint tensors the config implies)
  at the serve dtype, so `tensors` counts checkpoint tensors either way.
- No tensor data is read and no parameter is materialised.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from metrale_jax.checkpoint import bindings
from metrale_jax.memory.plan import Term
from metrale_jax.memory.source import ModelSource

WEIGHTS = "weights"
_MIXERS = {"gdn": "layers: gated deltanet", "attn": "layers: attention", "mlp": "layers: mlp"}


def weight_group(path: tuple[Any, ...]) -> str:
    """The report row of the parameter at `path` in the `metrale_jax.params` tree."""
    head = path[0]
    if head == "layers":
        return _MIXERS.get(path[2], "norms")
    if head == "mtp":
        return "mtp head"
    return head if head in ("embed", "lm_head") else "norms"


def _fold(items: Iterable[tuple[str, int, str]]) -> tuple[Term, ...]:
    """(group, bytes, dtype) items folded into one term per group, in first-seen order."""
    rows: dict[str, list[Any]] = {}
    for group, size, dtype in items:
        row = rows.setdefault(group, [0, set(), 0])
        row[0] += size
        row[1].add(dtype)
        row[2] += 1
    return tuple(Term(g, WEIGHTS, size, "+".join(sorted(dts)), (), n) for g, (size, dts, n) in rows.items())


def weight_terms(source: ModelSource, dtype: Any, divisors: Mapping[tuple, int] | None = None) -> tuple[Term, ...]:
    """The served weights of `source`, one term per group: one device's share when `divisors`
    ({parameter path: devices its leaf is split over}, `engine.sharding.param_divisors`) is given.

    From the headers when `source` has tensors on disk (their stored dtype), else from the
    shapes of the loader's bindings for the config, at `dtype`.
    """
    share = (lambda path: 1) if divisors is None else (lambda path: divisors.get(tuple(path), 1))
    if source.bindings:
        return _fold(
            (
                weight_group(b.path),
                (source.tensors[n].end - source.tensors[n].start) // share(b.path),
                source.tensors[n].dtype,
            )
            for b in source.bindings
            for n in b.names
        )
    itemsize, name = np.dtype(dtype).itemsize, str(np.dtype(dtype))
    return _fold(
        (weight_group(b.path), int(np.prod(shape, dtype=np.int64)) * itemsize // share(b.path), name)
        for b in bindings(source.config)
        for shape in b.shapes
    )


def outside_bytes(source: ModelSource) -> int:
    """Bytes of on-disk tensors no binding loads (e.g. a vision tower); 0 without weights."""
    bound = {n for b in source.bindings for n in b.names}
    return sum(r.end - r.start for name, r in source.tensors.items() if name not in bound)
