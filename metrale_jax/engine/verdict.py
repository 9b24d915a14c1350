"""The verdict protocol behind `Engine.accept`: what a write-on-accept verify leaves to be decided.

Owns `Verified` (a verify awaiting its verdict) and `VerdictProtocol`, the part of `Engine` that
keeps the verifies awaiting a verdict and settles them: `accept` (keep each sequence's accepted
drafts) and `rollback_verify` (abandon the verify). Both are built from four steps, each one
compiled program or one host change:
- `_fold`: fold the verdict into the live GDN state (snapshot rollback copies the accepted row's
  state from the verify's per-row states; replay rollback puts the pre-verify state back);
- `_rewind`: drop the rejected rows on the host (`BlockManager.rewind`);
- `_commit`: roll each conv window back to its last accepted row (replay rollback instead re-runs
  the accepted rows from the restored state, the verify's program shape, so state and KV come out
  bit-identical);
- `_stash`: with the MTP drafter, stash the accepted row's hidden for the next propose.

The seam: `accept` and `rollback_verify` change device and host state only through these steps
and `_restore` (the pre-verify checkpoint put back, which replay's fold shares). Nothing outside
this module calls them; a subclass may override one (tests/diff_mutants.py plants its state bugs
there, each under its own name) and every caller, tests included, reaches them through `accept`
and `rollback_verify`. `Engine.speculative_step` runs the same verdict inside
its one fused program (`transitions.speculative_step`), not through these steps.

Invariants:
- `accept` runs fold, rewind, commit, then the stash: the fold must see every verdict before the
  commit, and the stash comes after the commit (replay's commit re-runs the accepted rows, whose
  drafter catch-up pairs row 0 with the stash, which must still hold the pre-verify hidden).
- A sequence's verify awaits its verdict from `_await_verdict` until `accept` commits it or
  `rollback_verify` abandons it; a refused verdict (`EngineError`) changes nothing.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

import jax
import numpy as np

from metrale_jax.engine import transitions as tr
from metrale_jax.engine.batching import stash_batch, verdict_batch
from metrale_jax.engine.blocks import BlockManager
from metrale_jax.engine.capacity import PoolCounts
from metrale_jax.engine.pool import EnginePool
from metrale_jax.engine.programs import ProgramCache
from metrale_jax.engine.sequences import EngineError, SequenceState


@dataclasses.dataclass(frozen=True)
class Verified:
    """A verify awaiting its verdict, per sequence: the rows verified, the seq_len before them,
    its first flat row in that verify and which verify it was (the engine's count)."""

    rows: list[int]
    before: int
    row0: int
    serial: int


class VerdictProtocol:
    """The verdict half of `Engine` (module docstring). It runs on the engine's `counts`,
    `programs`, `pool` (replaced by each program), `blocks`, `replay` (replay rollback) and
    `drafter`, and re-runs verify rows through the engine's `_rows`."""

    counts: PoolCounts
    programs: ProgramCache
    pool: EnginePool
    blocks: BlockManager
    replay: bool
    drafter: bool
    _rows: Callable[..., tuple[np.ndarray, np.ndarray]]  # `Engine._rows`: runs `transitions.step_rows`

    def __init__(self) -> None:
        self._verify_hidden: jax.Array | None = None  # hidden rows of the last verify (device)
        self._verifies = 0  # verifies run (`Verified.serial`)
        self._verified: dict[int, Verified] = {}  # seq_id -> its verify, until its verdict is committed

    def _await_verdict(self, seqs: Sequence[SequenceState], rows: list[list[int]], before: list[int]) -> None:
        """Record the verify that just ran: sequence i verified rows[i] after before[i] tokens."""
        self._verifies += 1
        row0 = itertools.accumulate(map(len, rows), initial=0)
        self._verified.update(
            {s.seq_id: Verified(r, b, o, self._verifies) for s, r, b, o in zip(seqs, rows, before, row0)}
        )

    def _awaiting(self, seqs: Sequence[SequenceState]) -> list[int]:
        """The ids of `seqs` whose verify awaits its verdict."""
        return [s.seq_id for s in seqs if s.seq_id in self._verified]

    def accept(self, seqs: Sequence[SequenceState], accepted: Sequence[int]) -> None:
        """The verdict of seqs' last `verify_batched`: accepted[i] of sequence i's drafts (its
        leading drafts the verify's argmax agreed with) are kept. In order: the GDN fold; the host
        rewind of the rejected rows; the commit of rows 0..accepted[i]; with the drafter, the
        accepted rows' hiddens stashed (the seqs must all come from the engine's last verify)."""
        missing = [s.seq_id for s in seqs if s.seq_id not in self._verified]
        if missing:
            raise EngineError(f"sequence(s) {missing} have no verify awaiting a verdict")
        if len(accepted) != len(seqs):
            raise EngineError(f"{len(accepted)} verdicts for {len(seqs)} sequences")
        verified = [self._verified[s.seq_id] for s in seqs]
        for s, v, a in zip(seqs, verified, accepted):
            if not 0 <= a < len(v.rows):
                raise EngineError(f"sequence {s.seq_id}: {a} accepted drafts of a K={len(v.rows)} verify")
        if self.drafter:
            stale = [s.seq_id for s, v in zip(seqs, verified) if v.serial != self._verifies]
            if stale:
                raise EngineError(
                    f"sequence(s) {stale}: another verify ran since theirs (accept before verifying again)"
                )
        rows, ks = [a + 1 for a in accepted], [len(v.rows) for v in verified]
        self._fold(seqs, rows, ks)
        for s, r, k in zip(seqs, rows, ks):
            self._rewind(s, k - r)
        self._commit(seqs, rows, ks)
        if self.drafter:
            self._stash(seqs, [v.row0 + a for v, a in zip(verified, accepted)])
        for s in seqs:
            s.drafter_len = s.seq_len - 1

    def rollback_verify(self, seqs: Sequence[SequenceState]) -> None:
        """Abandon the last verify of `seqs`: live GDN state, length and tokens as before it (its
        KV rows lie past the length and are overwritten before they are read)."""
        missing = [s.seq_id for s in seqs if s.seq_id not in self._verified]
        if missing:
            raise EngineError(f"sequence(s) {missing} have no verify to roll back")
        self._restore(seqs, [True] * len(seqs))
        for s in seqs:
            self._rewind(s, s.seq_len - self._verified.pop(s.seq_id).before)

    # ------------------------------------------------------------ the steps (the seam)

    def _fold(self, seqs: Sequence[SequenceState], rows: Sequence[int], ks: Sequence[int]) -> None:
        """Fold every sequence's verdict into its live GDN state: rows = accepted drafts + 1 of
        ks verified."""
        if self.replay:
            self._restore(seqs, [r < k for r, k in zip(rows, ks)])
            return
        verdicts = verdict_batch(self.counts, seqs, rows, ks)
        self.pool = self.programs.run("gdn_fold", tr.gdn_fold_accepted, None, self.pool, verdicts)

    def _rewind(self, seq: SequenceState, rejected: int) -> None:
        """Drop `seq`'s `rejected` trailing verify rows on the host."""
        self.blocks.rewind(seq, rejected)

    def _commit(self, seqs: Sequence[SequenceState], rows: Sequence[int], ks: Sequence[int]) -> None:
        """Commit rows 0..rows[i] - 1 of each sequence's verify (rows == K: nothing to undo); its
        verify no longer awaits a verdict."""
        verified = [self._verified.pop(s.seq_id, None) for s in seqs]
        if self.replay:
            redo = [
                (s, v.rows[:r], v.before) for s, v, r, k in zip(seqs, verified, rows, ks) if v is not None and r < k
            ]
            if redo:
                self._rows([x[0] for x in redo], [x[1] for x in redo], verify=True, starts=[x[2] for x in redo])
            return
        verdicts = verdict_batch(self.counts, seqs, rows, ks)
        self.pool = self.programs.run("commit_conv", tr.commit_conv, None, self.pool, verdicts)

    def _stash(self, seqs: Sequence[SequenceState], rows: Sequence[int]) -> None:
        """Stash the hidden of flat row rows[i] of the last verify for seqs[i] (its accepted row)."""
        x = stash_batch(self.counts, seqs, rows)
        self.pool = self.programs.run("stash_rows", tr.stash_hidden_rows, None, self.pool, self._verify_hidden, x)

    def _restore(self, seqs: Sequence[SequenceState], mask: Sequence[bool]) -> None:
        """Put back the pre-verify GDN state of seqs[i] where mask[i]."""
        v = verdict_batch(self.counts, seqs, [1] * len(seqs), [1] * len(seqs), restore=mask)
        self.pool = self.programs.run("restore_ckpt", tr.restore_checkpoint, None, self.pool, v)
