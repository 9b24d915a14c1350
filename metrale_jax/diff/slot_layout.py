"""The slot layout of a diff run: sequences allocated in batch order, freed in reverse.

Owns: `SequenceBatch`, the context manager every decode and verify run allocates and prefills
through. With `fragment` True it holds a spare slot before sequence n // 2, with a `TierSpread`
(`--tier-slots`) spares on every slot between them; `relocate` is the swap's spill and restore.

Invariants:
- The engine's slot free list is a stack, so freeing in reverse allocation order hands the next
  run the same slots in the same order: every run of a diff sees one slot layout.
- Sequence i sits on `schedule.slot_of(i, n, fragment)`; anything else means another live
  sequence shares the engine, and the run refuses to start (`SlotLayoutError`).
- Every sequence (spare and spacer included) is freed on exit, also when the run raises.
- With prefix caching on, every batch's sequences get a namespace of their own (a fresh counter
  value unless the caller names one), so no run restores another run's KV or snapshot.
- Prompts are prefilled in chunks of `PREFILL_CHUNK` tokens, the engine's smallest prefill
  bucket, so every prompt of every run uses one compiled prefill program per forward (the
  prefill is not what these runs compare; `--prefill` diffs the chunking itself).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from kernels_pallas.gdn.reference import CHUNK as GDN_CHUNK
from metrale_jax.diff.schedule import Layout, slot_of
from metrale_jax.engine.capacity import MIN_PREFILL_BUCKET
from metrale_jax.engine.engine import Engine
from metrale_jax.engine.inputs import SwapRecord
from metrale_jax.engine.sequences import SequenceState
from metrale_jax.errors import MetraleError

PREFILL_CHUNK = MIN_PREFILL_BUCKET
#: The chunk under --batch-invariant: the GDN chunk's multiple, so chunks fall on its grid and equal one pass.
INVARIANT_PREFILL_CHUNK = max(PREFILL_CHUNK, GDN_CHUNK)


def prefill_chunk(engine) -> int:
    """The chunk the diff's reference prefills in on `engine` (`PREFILL_CHUNK`, or `INVARIANT_PREFILL_CHUNK`)."""
    return INVARIANT_PREFILL_CHUNK if getattr(engine.settings, "batch_invariant", False) else PREFILL_CHUNK


_RUNS = itertools.count()


def private_namespace() -> str:
    """A prefix-cache namespace no other diff run uses."""
    return f"diff-run-{next(_RUNS)}"


class SlotLayoutError(MetraleError, RuntimeError):
    """The engine's slots are not where a diff run needs them (another sequence is live)."""


class SequenceBatch:
    """`n` sequences of `engine` for one run; `seqs` in batch order (see the module docstring).
    `namespace`: their prefix-cache namespace (default: a private one when the engine caches)."""

    def __init__(self, engine: Engine, n: int, fragment: Layout = False, namespace: str | None = None):
        self.engine, self.n, self.fragment = engine, n, fragment
        cached = engine.blocks.prefix is not None
        self.namespace = (namespace or private_namespace()) if cached else None
        self.seqs: list[SequenceState] = []
        self._allocated: list[SequenceState] = []

    def _alloc(self) -> SequenceState:
        seq = self.engine.alloc_sequence(self.namespace)
        self._allocated.append(seq)
        return seq

    def __enter__(self) -> SequenceBatch:
        try:
            for i in range(self.n):
                want = slot_of(i, self.n, self.fragment)
                seq = self._alloc()
                while seq.slot < want:  # a spare holds a slot below the sequence's
                    seq = self._alloc()
                if seq.slot != want:
                    raise SlotLayoutError(
                        f"sequence {i} took slot {seq.slot}, not {want}: another sequence is live on this engine"
                    )
                self.seqs.append(seq)
        except BaseException:
            self._free_all()
            raise
        return self

    def _free_all(self) -> None:
        while self._allocated:
            self.engine.free_sequence(self._allocated.pop())

    def __exit__(self, *exc) -> None:
        self._free_all()

    def prefill(self, prompts: Sequence[Sequence[int]]) -> np.ndarray:
        """Prefill sequence i with prompts[i]; returns the last positions' logits [n, vocab]."""
        return np.stack([self.engine.prefill(s, p, prefill_chunk(self.engine)) for s, p in zip(self.seqs, prompts)])

    def relocate(self, records: Sequence[SwapRecord], spacer_prompt: Sequence[int]) -> list[dict]:
        """Spill and restore: free every sequence, let a spacer sequence (prefilled with
        `spacer_prompt`) take the first freed slot and KV blocks, then restore `records[i]`
        into a new sequence i, which therefore lands on another slot and other blocks.
        Returns, per sequence, where it moved: {slot: [old, new], blocks: [old, new]}."""
        old = [(s.slot, list(s.blocks)) for s in self.seqs]
        self._free_all()
        spacer = self._alloc()
        self.engine.prefill(spacer, spacer_prompt, prefill_chunk(self.engine))
        self.seqs = [self._alloc() for _ in old]
        for seq, rec in zip(self.seqs, records):
            self.engine.restore_sequence_state(seq, rec)
        return [{"slot": [o[0], s.slot], "blocks": [o[1], list(s.blocks)]} for o, s in zip(old, self.seqs)]
