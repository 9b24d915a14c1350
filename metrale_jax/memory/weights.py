"""Weight bytes for the memory planner, from the checkpoint's headers or the parameter tree's shapes.

Owns: grouping the served parameters into report rows (embedding, head, per mixer kind, MLP,
norms, MTP head) and finding the checkpoint bytes the engine never loads ("outside").

Invariants:
- With weights on disk, a parameter's bytes are its tensors' byte ranges in the safetensors
  headers, via the loader's own bindings (the loader keeps the stored dtype).
- Without, they are the shapes of the same bindings (the checkpoint tensors the config implies)
  at the serve dtype, or, for a quantised checkpoint, the bytes `quantization.tensor_bytes` gives
  the tensors its scheme converts (values and scales), so `tensors` counts checkpoint tensors
  either way.
- With weights on disk an FP8 tensor's bytes include its block scales (`stored_names`: the
  loader's own list of what a binding reads).
- No tensor data is read and no parameter is materialised.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from metrale_jax.checkpoint import bindings, stored_names
from metrale_jax.memory.plan import Term
from metrale_jax.memory.source import ModelSource
from metrale_jax.params import param_specs
from metrale_jax.quantization import converts, tensor_bytes

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
            for n in stored_names(b, source.tensors)
        )
    itemsize, name = np.dtype(dtype).itemsize, str(np.dtype(dtype))
    q, specs = source.quantization, param_specs(source.config)

    def stored(b, n, shape) -> tuple[int, str]:
        conv = converts(q, n, _spec(specs, b.path).kind)
        return tensor_bytes(shape, itemsize, q, conv), (q.method if conv and q else name)

    return _fold(
        (weight_group(b.path), size // share(b.path), kind)
        for b in bindings(source.config)
        for n, shape in zip(b.names, b.shapes)
        for size, kind in [stored(b, n, shape)]
    )


def _spec(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def outside_bytes(source: ModelSource) -> int:
    """Bytes of on-disk tensors no binding loads (e.g. a vision tower); 0 without weights."""
    bound = {n for b in source.bindings for n in b.names}
    return sum(r.end - r.start for name, r in source.tensors.items() if name not in bound)
