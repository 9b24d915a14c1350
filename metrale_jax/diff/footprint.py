"""What a diff holds in memory: the report's `memory` field.

Owns: `footprint` (the engine's weights and pool in bytes, the process's peak resident set so
far).

Invariants:
- The weights and the pool are counted once each, whichever variants ran: every variant runs
  on the one engine's weights and pool (a variant selects a forward or a mesh; it never copies
  the weights), so the figures are the engine's leaves' bytes.
- `peak_rss_bytes` is the kernel's high-water mark of this process's resident set
  (`getrusage`), loading included: it only grows, so a report written later never shows less.
"""

from __future__ import annotations

import resource
import sys

import jax
import numpy as np


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
