"""What the host knows of a sequence, and the engine's one error.

Owns: `SequenceState` (a sequence's slot, blocks, lengths and tokens, as the block manager and
the engine keep them) and `EngineError` (a request the engine refuses).
Invariants: imports no JAX and no NumPy (the block manager, `engine.blocks`, builds on it); a
sequence's slot and blocks change only through the block manager.
"""

from __future__ import annotations

import dataclasses

from metrale_jax.errors import MetraleError


class EngineError(MetraleError, RuntimeError):
    """A request the engine refuses (capacity, exhaustion, misuse); its state is unchanged."""


@dataclasses.dataclass
class SequenceState:
    """slot: GDN state slot; blocks / draft_blocks: physical KV blocks in logical order; seq_len:
    tokens in the cache; tokens: prompt + generated (committed) tokens; drafter_len: positions
    of drafter context the host considers live; last_num_drafted: drafts of the last propose;
    namespace: its prefix-cache namespace (None: uncached); restored_at: the position its first
    prefill restored from a snapshot (0: computed); shared_len: positions below it lie in
    prefix-cache blocks (read-only, never rewound into)."""

    seq_id: int
    slot: int
    blocks: list[int] = dataclasses.field(default_factory=list)
    draft_blocks: list[int] = dataclasses.field(default_factory=list)
    seq_len: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)
    drafter_len: int = 0
    last_num_drafted: int = 0
    freed: bool = False
    namespace: str | None = None
    restored_at: int = 0
    shared_len: int = 0
