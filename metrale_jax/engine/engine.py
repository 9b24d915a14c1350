"""`Engine`: the thin imperative shell over the pure transitions.

Owns: the device pool (replaced by each transition's output), the host bookkeeping (slots,
blocks, sequence lengths, tokens), shape bucketing, the selected forward, and the checks that
turn a bad request into an `EngineError` before anything changes.

Invariants:
- Every device-state change goes through one compiled transition with the pool donated; the
  host never edits device state.
- A refused request (capacity, exhaustion, misuse) leaves host and device state unchanged and
  leaks no slot or block.
- Widths are padded to `capacity.DECODE_BATCH_LADDER` and verify rows to K_max = num_drafts + 1
  per sequence, so one program per (transition, width bucket, forward) is compiled; K per
  sequence, slots and lengths are traced.
- Verify is always write-on-accept: after it, `gdn_fold_accepted` must see every verdict before
  `commit_accepted_prefix` runs; `accept` runs the whole verdict in that order (fold, rewind,
  commit, then the stash), as `speculative.speculative_generate`'s composed scheduler does.
- `speculative_step` is one scheduler step (verify, acceptance, verdict, propose) as one compiled
  program and one device-to-host transfer; it leaves no verify awaiting a verdict.
- Every device-to-host transfer goes through `_fetch`.
- Every program input is built by its `engine.inputs` constructor (padding rows included) and
  only its real rows are filled in here; every count and width comes from `capacity`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import get_args

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.ops import Forward, Ops, PallasOps, ReferenceOps
from metrale_jax.config import ModelConfig
from metrale_jax.engine import transitions as tr
from metrale_jax.engine.capacity import bucket_width, draft_table_width, pool_counts
from metrale_jax.engine.inputs import (
    PrefillChunk,
    PrefillStatic,
    ProposeBatch,
    ProposeStatic,
    SequenceAddress,
    SpeculativeStatic,
    StashBatch,
    StepBatch,
    StepStatic,
    SwapRecord,
    VerdictBatch,
)
from metrale_jax.engine.pool import allocate_pool
from metrale_jax.engine.programs import ProgramCache
from metrale_jax.engine.sequences import BlockAllocator, EngineError, SequenceState, SlotAllocator
from metrale_jax.engine.settings import EngineSettings, unsupported
from metrale_jax.model.layout import arrange_layers

FORWARDS: tuple[str, ...] = get_args(Forward)


def make_ops(name: str) -> Ops:
    """The ops object of a forward: `xla` (jnp reference twins) or `pallas` (kernels)."""
    if name == "xla":
        return ReferenceOps()
    if name == "pallas":
        return PallasOps()
    raise EngineError(f"unknown forward {name!r} (choose from {', '.join(FORWARDS)})")


@dataclasses.dataclass(frozen=True)
class Verified:
    """A verify awaiting its verdict, per sequence: the rows verified, the seq_len before them,
    its first flat row in that verify and which verify it was (the engine's count)."""

    rows: list[int]
    before: int
    row0: int
    serial: int


@dataclasses.dataclass(frozen=True)
class SpeculativeOutput:
    """A fused speculative step's outcome for its n sequences (host numpy): accepted [n] drafts
    accepted, emitted (per sequence its accepted + 1 tokens, the verify's argmaxes), drafts [n, nd]
    int32 and confidences [n, nd] f32 of the next propose (nd = 0: none); with logits asked for,
    verify_logits [R, V] f32 (R = sum K) and draft_logits [n, V] f32 (nd > 0), else None."""

    accepted: np.ndarray
    emitted: list[list[int]]
    drafts: np.ndarray
    confidences: np.ndarray
    verify_logits: np.ndarray | None = None
    draft_logits: np.ndarray | None = None


class Engine:
    """Host shell of the engine. See the module docstring for the invariants."""

    def __init__(
        self, cfg: ModelConfig, params, settings: EngineSettings, *, forward: str = "xla", layout: str = "list"
    ):
        refused = unsupported(settings, cfg)
        if refused:
            raise EngineError("not supported: " + "; ".join(refused))
        self.cfg = cfg
        self.params = arrange_layers(params, cfg, layout)
        self.settings = settings
        self.dtype = params["embed"].dtype
        self.counts = pool_counts(settings, cfg)
        self.pool = allocate_pool(cfg, self.counts, settings, dtype=self.dtype)
        self.drafter = self.counts.drafter
        self.slots = SlotAllocator(self.counts.real_slots)
        self.blocks = BlockAllocator(self.counts.kv_blocks - 1, "KV blocks")
        self.draft_blocks = BlockAllocator(max(self.counts.draft_kv_blocks - 1, 0), "drafter KV blocks")
        self.programs = ProgramCache()
        self.forward = forward
        self.ops = make_ops(forward)
        self._next_id = 0
        self._verify_hidden = None  # hidden rows of the last verify (device)
        self.replay = settings.ssm_rollback_mode == "replay"
        self._verifies = 0  # verifies run (`Verified.serial`)
        self._verified: dict[int, Verified] = {}  # seq_id -> its verify, until its verdict is committed
        self.draft_width = draft_table_width(settings.max_seq_len)  # MBd, the drafter tables' width

    # ------------------------------------------------------------ forward selection

    def set_forward(self, name: str) -> None:
        """Select the forward used from the next transition on (the model code is untouched)."""
        self.ops = make_ops(name)
        self.forward = name

    def disclosure(self, name: str | None = None) -> dict:
        """What a forward compiled (plan digest, launches per step, per-program digests) and, for
        a kernel forward, the shapes its kernels refused (run by the reference instead)."""
        name = name or self.forward
        out = self.programs.disclosure(name)
        ops = make_ops(name)
        out["refusals"] = list(ops.refusals()) if hasattr(ops, "refusals") else []
        return out

    # ------------------------------------------------------------ sequences

    def alloc_sequence(self) -> SequenceState:
        slot = self.slots.alloc()
        seq = SequenceState(seq_id=self._next_id, slot=slot)
        self._next_id += 1
        return seq

    def free_sequence(self, seq: SequenceState) -> None:
        if seq.freed:
            raise EngineError(f"sequence {seq.seq_id} was already freed")
        self.slots.free(seq.slot)
        self.blocks.free_many(seq.blocks)
        self.draft_blocks.free_many(seq.draft_blocks)
        seq.blocks, seq.draft_blocks, seq.freed = [], [], True

    def _reserve(self, seqs: Sequence[SequenceState], upto: Sequence[int], held: tuple[int, int] | None = None) -> None:
        """Give each sequence KV blocks (and drafter blocks) for positions < upto[i]; all or none.
        `held`: instead, exactly this many (KV, drafter) blocks each (a swap-in restores the count
        it saved). Refuses (EngineError, nothing changed) a sequence given twice, freed, not
        allocated by this engine, past --max-seq-len, or more blocks than are free."""
        bs, dbs = self.counts.block_size, self.counts.draft_block_size
        ids = [s.seq_id for s in seqs]
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice or len({s.slot for s in seqs}) < len(seqs):
            raise EngineError(f"sequence(s) {twice or ids} given twice (or sharing a slot) in one batch")
        for s, u in zip(seqs, upto):
            if s.freed:
                raise EngineError(f"sequence {s.seq_id} was freed")
            if not (0 <= s.seq_id < self._next_id and 0 <= s.slot < self.counts.real_slots):
                raise EngineError(f"sequence {s.seq_id} (slot {s.slot}) was not allocated by this engine")
            if u > self.settings.max_seq_len:
                raise EngineError(
                    f"sequence {s.seq_id} would reach {u} tokens, over --max-seq-len {self.settings.max_seq_len}"
                )
        if held is None:
            need = [max(0, math.ceil(u / bs) - len(s.blocks)) for s, u in zip(seqs, upto)]
            dneed = [
                max(0, math.ceil(u / dbs) - len(s.draft_blocks)) if self.drafter else 0 for s, u in zip(seqs, upto)
            ]
        else:
            most = (math.ceil(self.settings.max_seq_len / bs), math.ceil(self.settings.max_seq_len / dbs))
            if held[0] > most[0] or held[1] > (most[1] if self.drafter else 0):
                raise EngineError(f"{held} (KV, drafter) blocks per sequence exceed this engine's {most}")
            need = [max(0, held[0] - len(s.blocks)) for s in seqs]
            dneed = [max(0, held[1] - len(s.draft_blocks)) for s in seqs]
        if sum(need) > self.blocks.free_count:
            raise EngineError(f"KV blocks exhausted: {sum(need)} needed, {self.blocks.free_count} free")
        if sum(dneed) > self.draft_blocks.free_count:
            raise EngineError(f"drafter KV blocks exhausted: {sum(dneed)} needed, {self.draft_blocks.free_count} free")
        for s, n, dn in zip(seqs, need, dneed):
            s.blocks += self.blocks.alloc_many(n)
            s.draft_blocks += self.draft_blocks.alloc_many(dn)

    @staticmethod
    def _set_tables(block_tables: np.ndarray, draft_tables: np.ndarray, i: int, seq: SequenceState) -> None:
        """Write row i of a batch's (null-filled) block and drafter tables from `seq`'s blocks."""
        block_tables[i, : len(seq.blocks)] = seq.blocks
        draft_tables[i, : len(seq.draft_blocks)] = seq.draft_blocks

    # ------------------------------------------------------------ prefill / decode

    def prefill(self, seq: SequenceState, tokens: Sequence[int], chunk: int | None = None) -> np.ndarray:
        """Prefill `tokens` (appended after the sequence's cache) in chunks of at most
        `chunk` (default: the serve's prefill chunk). Returns the last position's logits [V] f32."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise EngineError("prefill of zero tokens")
        self._check_tokens(tokens)
        chunk = min(chunk or self.counts.prefill_chunk, self.counts.prefill_chunk)
        self._reserve([seq], [seq.seq_len + len(tokens) + 1])
        static = PrefillStatic(self.cfg, self.counts, self.ops, drafter=self.drafter)
        for off in range(0, len(tokens), chunk):
            part = tokens[off : off + chunk]
            x = PrefillChunk.padded(self.counts, self.draft_width, self.counts.prefill_bucket(len(part)))
            x.tokens[0, : len(part)] = part
            x.start[0], x.length[0], x.slot[0] = seq.seq_len, len(part), seq.slot
            self._set_tables(x.block_table, x.draft_table, 0, seq)
            logits, self.pool = self.programs.run("prefill_chunk", tr.prefill_chunk, static, self.pool, self.params, x)
            seq.seq_len += len(part)
            seq.tokens += part
        seq.drafter_len = seq.seq_len - 1
        return self._fetch(logits)[0]

    @staticmethod
    def _fetch(x: jax.Array) -> np.ndarray:
        """The engine's one device-to-host transfer point: `x` as numpy."""
        return np.asarray(x)

    def _check_tokens(self, tokens: Sequence[int]) -> None:
        bad = [t for t in tokens if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise EngineError(f"token(s) {bad[:5]} outside the vocabulary 0..{self.cfg.vocab_size - 1}")

    def _step_batch(
        self,
        seqs: Sequence[SequenceState],
        tokens_per_seq: Sequence[Sequence[int]],
        verify: bool,
        starts: Sequence[int] | None = None,
    ) -> tuple[StepBatch, int]:
        """The `StepBatch` of seqs' ragged rows at positions starts[i].. (default: their lengths),
        flat rows compacted seq-major; returns (batch, R = the real rows)."""
        n = len(seqs)
        if n == 0:
            raise EngineError("a step over zero sequences")
        t = self.counts.k if verify else 1
        batch = StepBatch.padded(self.counts, self.draft_width, bucket_width(n), t, verify=verify)
        r = 0
        for i, (s, rows) in enumerate(zip(seqs, tokens_per_seq)):
            batch.tokens[i, : len(rows)] = rows
            batch.lens[i] = len(rows)
            batch.seq_lens[i] = s.seq_len if starts is None else starts[i]
            batch.slots[i] = s.slot
            if verify:
                batch.vrow_base[i] = self.counts.verify_row_base(s.slot)
                batch.vslot[i] = self.counts.verify_slot(s.slot)
            batch.row_index[r : r + len(rows)] = i * t + np.arange(len(rows))
            self._set_tables(batch.block_tables, batch.draft_tables, i, s)
            r += len(rows)
        return batch, r

    def _rows(
        self,
        seqs: Sequence[SequenceState],
        tokens_per_seq: Sequence[Sequence[int]],
        verify: bool,
        starts: Sequence[int] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Run `step_rows` for seqs with ragged rows at positions starts[i].. (default: their
        lengths, which then grow by the rows); returns (logits [R, V], argmax [R]) numpy."""
        batch, r = self._step_batch(seqs, tokens_per_seq, verify, starts)
        static = StepStatic(self.cfg, self.counts, self.ops, verify=verify, drafter=self.drafter)
        logits, argmax, hidden, self.pool = self.programs.run(
            "step_rows", tr.step_rows, static, self.pool, self.params, batch
        )
        if starts is None:
            if verify:
                self._verify_hidden = hidden
            for s, rows in zip(seqs, tokens_per_seq):
                s.seq_len += len(rows)
                s.tokens += [int(x) for x in rows]
        return self._fetch(logits)[:r], self._fetch(argmax)[:r]

    def decode_batch(self, seqs: Sequence[SequenceState], tokens: Sequence[int]) -> np.ndarray:
        """One token per sequence. Returns logits [n, V] f32."""
        if len(tokens) != len(seqs):
            raise EngineError(f"{len(tokens)} tokens for {len(seqs)} sequences")
        self._check_tokens(tokens)
        self._reserve(seqs, [s.seq_len + 1 for s in seqs])
        logits, _ = self._rows(seqs, [[int(t)] for t in tokens], verify=False)
        for s in seqs:
            s.drafter_len = s.seq_len - 1
        return logits

    def decode(self, seq: SequenceState, token: int) -> np.ndarray:
        return self.decode_batch([seq], [token])[0]

    # ------------------------------------------------------------ speculative verify

    def can_batch_verify(self, seqs: Sequence[SequenceState], ks: Sequence[int]) -> str | None:
        """Why a batched verify of `ks` over `seqs` is refused, or None."""
        if not self.counts.speculative:
            return "verify needs a speculative serve (--speculative)"
        if len(ks) != len(seqs):
            return f"{len(ks)} widths for {len(seqs)} sequences"
        for s, k in zip(seqs, ks):
            cap = self.counts.slot_draft_capacity(s.slot)
            if not 1 <= k <= cap + 1:
                return f"sequence {s.seq_id} (slot {s.slot}) cannot verify K={k}: its slot holds {cap} draft row(s)"
        return None

    def verify_batched(self, seqs: Sequence[SequenceState], tokens: Sequence[int], ks: Sequence[int]):
        """Batched verify with write-on-accept. tokens: flat seq-major rows, sequence i's rows
        [last_i, d_1 .. d_{K_i-1}]. On success each sequence gains K_i tokens. Returns
        (logits [R, V] f32, argmax [R] int32) with R = sum(ks)."""
        reason = self.can_batch_verify(seqs, ks)
        if reason:
            raise EngineError(reason)
        if len(tokens) != sum(ks):
            raise EngineError(f"{len(tokens)} tokens for ks summing to {sum(ks)}")
        self._check_tokens(tokens)
        self._reserve(seqs, [s.seq_len + k + 1 for s, k in zip(seqs, ks)])
        off = np.concatenate([[0], np.cumsum(ks)])
        rows = [[int(t) for t in tokens[off[i] : off[i + 1]]] for i in range(len(seqs))]
        before = [s.seq_len for s in seqs]
        out = self._rows(seqs, rows, verify=True)
        self._verifies += 1
        self._verified.update(
            {s.seq_id: Verified(r, b, int(o), self._verifies) for s, r, b, o in zip(seqs, rows, before, off)}
        )
        return out

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
        self.gdn_fold_accepted(seqs, rows, ks)
        for s, r, k in zip(seqs, rows, ks):
            self.rewind(s, k - r)
        self.commit_accepted_prefixes(seqs, rows, ks)
        if self.drafter:
            # NOTE: after the commit: replay rollback's commit re-runs the accepted rows, whose drafter
            # catch-up pairs row 0 with the stash, which must still hold the pre-verify hidden.
            self.stash_verify_hidden_rows(seqs, [v.row0 + a for v, a in zip(verified, accepted)])
        for s in seqs:
            s.drafter_len = s.seq_len - 1

    def speculative_step(
        self,
        seqs: Sequence[SequenceState],
        tokens: Sequence[int],
        ks: Sequence[int],
        num_drafts: int,
        *,
        logits: bool = False,
    ) -> SpeculativeOutput:
        """One scheduler step as one program (`transitions.speculative_step`): the write-on-accept
        verify of `tokens` (flat seq-major rows, sequence i's `[last_i, d_1 .. d_{K_i - 1}]`),
        greedy acceptance on the device, the verdict, and a propose of `num_drafts` drafts (0:
        none) from each committed context. One compiled-program call and one device-to-host
        transfer (`logits`: the verify's and the propose's logits too, two more). Each sequence
        gains its accepted drafts + 1 tokens, as `verify_batched` then `accept` leave it (a
        propose then trims back to the committed context). KV and drafter blocks are reserved up
        front for seq_len + K_i + num_drafts + 1 positions. Snapshot rollback only (replay
        rollback runs the composed step)."""
        if self.replay:
            raise EngineError("the fused speculative step needs --ssm-rollback-mode snapshot")
        reason = self.can_batch_verify(seqs, ks)
        if reason:
            raise EngineError(reason)
        if not 0 <= num_drafts <= (self.settings.num_drafts if self.drafter else 0):
            raise EngineError(f"num_drafts {num_drafts} outside 0..{self.settings.num_drafts if self.drafter else 0}")
        if len(tokens) != sum(ks):
            raise EngineError(f"{len(tokens)} tokens for ks summing to {sum(ks)}")
        pending = [s.seq_id for s in seqs if s.seq_id in self._verified]
        if pending:
            raise EngineError(f"sequence(s) {pending} have a verify awaiting its verdict (Engine.accept)")
        self._check_tokens(tokens)
        self._reserve(seqs, [s.seq_len + k + num_drafts + 1 for s, k in zip(seqs, ks)])
        off = np.concatenate([[0], np.cumsum(ks)])
        rows = [[int(t) for t in tokens[off[i] : off[i + 1]]] for i in range(len(seqs))]
        batch, r = self._step_batch(seqs, rows, verify=True)
        static = SpeculativeStatic(
            self.cfg, self.counts, self.ops, drafter=self.drafter, num_drafts=num_drafts, logits=logits
        )
        packed, extras, self.pool = self.programs.run(
            "speculative_step", tr.speculative_step, static, self.pool, self.params, batch
        )
        n, t = len(seqs), self.counts.k
        out = self._fetch(packed)[:n]
        accepted = out[:, 0]
        for s, row, a in zip(seqs, rows, accepted.tolist()):
            s.seq_len += a + 1
            s.tokens += row[: a + 1]
            s.drafter_len = s.seq_len if num_drafts else s.seq_len - 1
            s.last_num_drafted = 0
        fetched = [self._fetch(x) for x in extras]
        return SpeculativeOutput(
            accepted=accepted,
            emitted=[g[: a + 1] for g, a in zip(out[:, 1 : 1 + t].tolist(), accepted.tolist())],
            drafts=out[:, 1 + t : 1 + t + num_drafts],
            confidences=np.ascontiguousarray(out[:, 1 + t + num_drafts :]).view(np.float32),
            verify_logits=fetched[0][:r] if fetched else None,
            draft_logits=fetched[1][:n] if len(fetched) > 1 else None,
        )

    def _verdicts(self, seqs: Sequence[SequenceState], rows: Sequence[int], ks: Sequence[int]) -> VerdictBatch:
        """The `VerdictBatch` of `seqs`' verdicts (rows kept of ks verified)."""
        v = VerdictBatch.padded(self.counts, bucket_width(len(seqs)))
        for i, (s, r, k) in enumerate(zip(seqs, rows, ks)):
            v.slots[i], v.vslots[i], v.rows[i], v.ks[i] = s.slot, self.counts.verify_slot(s.slot), r, k
            v.vrow_base[i] = self.counts.verify_row_base(s.slot)
        return v

    def gdn_fold_accepted(self, seqs: Sequence[SequenceState], rows: Sequence[int], ks: Sequence[int]) -> None:
        """Fold every sequence's verdict into its live GDN state: rows = accepted drafts + 1.
        Snapshot rollback copies the accepted row's state; replay rollback puts the pre-verify
        state back (the commit then replays the accepted rows)."""
        self._check_rows(seqs, rows, ks)
        if self.replay:
            self._restore(seqs, [r < k for r, k in zip(rows, ks)])
            return
        verdicts = self._verdicts(seqs, rows, ks)
        self.pool = self.programs.run("gdn_fold", tr.gdn_fold_accepted, None, self.pool, verdicts)

    def _restore(self, seqs: Sequence[SequenceState], mask: Sequence[bool]) -> None:
        """Put back the pre-verify GDN state of seqs[i] where mask[i]."""
        v = self._verdicts(seqs, [1] * len(seqs), [1] * len(seqs))
        v.restore[: len(seqs)] = mask
        self.pool = self.programs.run("restore_ckpt", tr.restore_checkpoint, None, self.pool, v)

    def rollback_verify(self, seqs: Sequence[SequenceState]) -> None:
        """Abandon the last verify of `seqs`: live GDN state, length and tokens as before it (its
        KV rows lie past the length and are overwritten before they are read)."""
        missing = [s.seq_id for s in seqs if s.seq_id not in self._verified]
        if missing:
            raise EngineError(f"sequence(s) {missing} have no verify to roll back")
        self._restore(seqs, [True] * len(seqs))
        for s in seqs:
            self.rewind(s, s.seq_len - self._verified.pop(s.seq_id).before)

    def commit_accepted_prefixes(self, seqs: Sequence[SequenceState], rows: Sequence[int], ks: Sequence[int]) -> None:
        """Roll each sequence's conv window back to its last accepted row (rows < K); under
        replay rollback, re-run the accepted rows from the restored pre-verify state instead
        (same program shape as the verify, so the state and KV come out bit-identical)."""
        self._check_rows(seqs, rows, ks)
        verified = [self._verified.pop(s.seq_id, None) for s in seqs]
        if self.replay:
            redo = [
                (s, v.rows[:r], v.before) for s, v, r, k in zip(seqs, verified, rows, ks) if v is not None and r < k
            ]
            if redo:
                self._rows([x[0] for x in redo], [x[1] for x in redo], verify=True, starts=[x[2] for x in redo])
            return
        verdicts = self._verdicts(seqs, rows, ks)
        self.pool = self.programs.run("commit_conv", tr.commit_conv, None, self.pool, verdicts)

    def commit_accepted_prefix(self, seq: SequenceState, rows: int, k: int) -> None:
        """`commit_accepted_prefixes` of one sequence (rows == K is a no-op)."""
        self.commit_accepted_prefixes([seq], [rows], [k])

    @staticmethod
    def _check_rows(seqs: Sequence[SequenceState], rows: Sequence[int], ks: Sequence[int]) -> None:
        if not len(seqs) == len(rows) == len(ks):
            raise EngineError("seqs, rows and ks differ in length")
        for s, r, k in zip(seqs, rows, ks):
            if not 1 <= r <= k:
                raise EngineError(f"sequence {s.seq_id}: {r} committed rows of a K={k} verify (must be 1..K)")

    @staticmethod
    def rewind(seq: SequenceState, rejected: int) -> None:
        """Host-side rewind of `rejected` trailing verify rows (their KV is left in place and
        overwritten before it is ever read)."""
        if not 0 <= rejected <= seq.seq_len:
            raise EngineError(f"cannot rewind {rejected} rows of sequence {seq.seq_id}")
        seq.seq_len -= rejected
        del seq.tokens[len(seq.tokens) - rejected :]

    def stash_verify_hidden_rows(self, seqs: Sequence[SequenceState], rows: Sequence[int]) -> None:
        """Stash the pre-norm hidden of flat verify row rows[i] for seqs[i] (its accepted row)."""
        if self._verify_hidden is None:
            raise EngineError("no verify to stash hidden rows from")
        if not self.drafter:
            raise EngineError("no MTP drafter to stash hidden rows for")
        x = StashBatch.padded(self.counts, bucket_width(len(seqs)))
        for i, (s, r) in enumerate(zip(seqs, rows)):
            x.rows[i], x.slots[i] = r, s.slot
        self.pool = self.programs.run("stash_rows", tr.stash_hidden_rows, None, self.pool, self._verify_hidden, x)

    # ------------------------------------------------------------ MTP drafter

    def propose_batched(self, seqs: Sequence[SequenceState], last: Sequence[int], num_drafts: int):
        """Batched MTP propose. Returns (drafts [n, nd] int32, confidences [n, nd] f32, logits of
        the last draft position [n, V] f32), numpy."""
        if not self.drafter:
            raise EngineError("no MTP drafter (needs --speculative and a checkpoint with MTP layers)")
        if not 1 <= num_drafts <= self.settings.num_drafts:
            raise EngineError(f"num_drafts {num_drafts} outside 1..{self.settings.num_drafts}")
        self._reserve(seqs, [s.seq_len + num_drafts + 1 for s in seqs])
        n = len(seqs)
        x = ProposeBatch.padded(self.counts, self.draft_width, bucket_width(n))
        for i, (s, tok) in enumerate(zip(seqs, last)):
            x.last[i], x.seq_lens[i], x.slots[i], x.valid[i] = tok, s.seq_len, s.slot, True
            x.draft_tables[i, : len(s.draft_blocks)] = s.draft_blocks
        static = ProposeStatic(self.cfg, self.counts, self.ops, num_drafts=num_drafts)
        drafts, conf, logits, self.pool = self.programs.run("propose", tr.propose, static, self.pool, self.params, x)
        for s in seqs:
            s.last_num_drafted = num_drafts
            s.drafter_len = s.seq_len + num_drafts - 1
        return self._fetch(drafts)[:n], self._fetch(conf)[:n], self._fetch(logits)[:n]

    def trim_proposer(self, seq: SequenceState, keep: int = 0) -> None:
        """Forget the drafter rows a propose chained past the committed context, keeping `keep`.
        Host-only: the drafter KV past the context is overwritten before it is read."""
        seq.drafter_len = min(seq.drafter_len, seq.seq_len + keep)
        seq.last_num_drafted = 0

    # ------------------------------------------------------------ swap

    def _address(self, seq: SequenceState) -> SequenceAddress:
        """Where `seq`'s state lives (slot, null-padded block tables)."""
        at = SequenceAddress.padded(self.counts, self.draft_width)
        at.slot[...] = seq.slot
        at.blocks[: len(seq.blocks)] = seq.blocks
        at.draft_blocks[: len(seq.draft_blocks)] = seq.draft_blocks
        return at

    def save_sequence_state(self, seq: SequenceState) -> SwapRecord:
        """Swap-out record: numpy copies of everything the sequence owns on device, plus host facts."""
        arrays, self.pool = self.programs.run("read_state", tr.read_sequence_state, None, self.pool, self._address(seq))
        return SwapRecord(
            device=jax.tree_util.tree_map(self._fetch, arrays),
            seq_len=seq.seq_len,
            tokens=tuple(seq.tokens),
            blocks=len(seq.blocks),
            draft_blocks=len(seq.draft_blocks),
            drafter_len=seq.drafter_len,
        )

    def restore_sequence_state(self, seq: SequenceState, record: SwapRecord) -> None:
        """Swap-in `record` into a freshly allocated sequence (its own slot and new blocks)."""
        if seq.seq_len or seq.blocks or seq.draft_blocks:
            raise EngineError("restore needs a freshly allocated sequence")
        self._reserve([seq], [record.seq_len], held=(record.blocks, record.draft_blocks))
        dev = jax.tree_util.tree_map(jnp.asarray, record.device)
        self.pool = self.programs.run("write_state", tr.write_sequence_state, None, self.pool, dev, self._address(seq))
        seq.seq_len, seq.tokens, seq.drafter_len = record.seq_len, list(record.tokens), record.drafter_len
