"""What a diff holds in memory: the report's `memory` field.

Owns: `footprint` (the engine's weights and pool in bytes, the process's peak resident set so
far) and `compact_equal` (a lock-step pair of parts held as one digest where their bytes are equal).

Invariants:
- The weights and the pool are counted once each, whichever variants ran: every variant runs
  on the one engine's weights and pool (a variant selects a forward or a mesh; it never copies
  the weights), so the figures are the engine's leaves' bytes.
- `peak_rss_bytes` is the kernel's high-water mark of this process's resident set
  (`getrusage`), loading included: it only grows, so a report written later never shows less.
- `compact_equal` changes what is held, never what a comparison finds: a byte-equal pair
  becomes one part (its bytes' sha256, same name and kind) on both sides, which compares equal
  as the pair did and adds nothing to any count; a differing pair is kept whole.
"""

from __future__ import annotations

import hashlib
import resource
import sys

import jax
import numpy as np

from metrale_jax.diff.compare import Part


def tree_bytes(tree) -> int:
    """Bytes of every array leaf of `tree` (shape structs count as their arrays would)."""
    return sum(
        int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree)
    )


def peak_rss_bytes() -> int:
    """This process's peak resident set so far, in bytes (`ru_maxrss`: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def footprint(engine) -> dict:
    """The report's `memory` field: {weights_bytes, pool_bytes, peak_rss_bytes} of `engine`'s
    one copy of the weights, its pool, and the process's peak resident set."""
    return {
        "weights_bytes": tree_bytes(engine.params),
        "pool_bytes": tree_bytes(engine.pool),
        "peak_rss_bytes": peak_rss_bytes(),
    }


def _digest(p: Part) -> Part:
    h = hashlib.sha256(f"{p.data.shape}{p.data.dtype}".encode())
    h.update(np.ascontiguousarray(p.data).tobytes())
    return Part(p.name, np.frombuffer(h.digest(), np.uint8), p.kind)


def _same(p: Part, q: Part) -> bool:
    if (p.name, p.kind, p.data.dtype, p.data.shape) != (q.name, q.kind, q.data.dtype, q.data.shape):
        return False
    return bool(
        np.array_equal(np.ascontiguousarray(p.data).view(np.uint8), np.ascontiguousarray(q.data).view(np.uint8))
    )


def compact_equal(a: list[Part], b: list[Part]) -> tuple[list[Part], list[Part]]:
    """(a, b), two lock-step sides' parts of one step, with every same-index pair whose name,
    kind, dtype, shape and bytes are equal replaced on both sides by one digest part (module
    invariants); the other parts (and any unpaired tail) as they are."""
    pairs = [(_digest(p),) * 2 if _same(p, q) else (p, q) for p, q in zip(a, b)]
    return [x for x, _ in pairs] + a[len(pairs) :], [y for _, y in pairs] + b[len(pairs) :]
