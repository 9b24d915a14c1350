"""Batch assembly: each compiled program's input, filled from the host's sequences.

Owns one pure function per program input the engine builds (`step_batch`, `prefill_chunk`,
`propose_batch`, `verdict_batch`, `stash_batch`, `sequence_address`, `snapshot_copy`,
`sampling_batch`) and
`prefill_bounds`, where a prefill splits into programs. Each takes the pool counts and the
sequences (with their rows), starts from the input's `X.padded` constructor (`engine.inputs`) at
the batch's width bucket, and fills in only the real rows; none reads or changes anything else.

Invariants:
- Every input comes from its `padded` constructor, so the engine and the memory planner build
  one tree structure and one set of shapes per program; padding rows are the constructor's.
- Widths are `capacity.bucket_width` of the sequence count; verify rows are K_max per sequence
  (`counts.k`), flat rows compacted seq-major through `row_index`.
- Block tables list a sequence's blocks in logical order, null-padded.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from metrale_jax.engine.capacity import PoolCounts, bucket_width
from metrale_jax.engine.inputs import (
    PrefillChunk,
    ProposeBatch,
    SequenceAddress,
    SnapshotCopy,
    StashBatch,
    StepBatch,
    VerdictBatch,
)
from metrale_jax.engine.sampling import Sampling, SamplingRows
from metrale_jax.engine.sequences import EngineError, SequenceState


def _set_tables(block_tables: np.ndarray, draft_tables: np.ndarray, i: int, seq: SequenceState) -> None:
    """Write row i of a batch's (null-filled) block and drafter tables from `seq`'s blocks."""
    block_tables[i, : len(seq.blocks)] = seq.blocks
    draft_tables[i, : len(seq.draft_blocks)] = seq.draft_blocks


def step_batch(
    counts: PoolCounts,
    seqs: Sequence[SequenceState],
    tokens_per_seq: Sequence[Sequence[int]],
    verify: bool,
    starts: Sequence[int] | None = None,
) -> tuple[StepBatch, int]:
    """The `StepBatch` of seqs' ragged rows at positions starts[i].. (default: their lengths),
    flat rows compacted seq-major; returns (batch, R = the real rows). Refuses zero sequences."""
    n = len(seqs)
    if n == 0:
        raise EngineError("a step over zero sequences")
    t = counts.k if verify else 1
    batch = StepBatch.padded(counts, counts.draft_table_width, bucket_width(n), t, verify=verify)
    r = 0
    for i, (s, rows) in enumerate(zip(seqs, tokens_per_seq)):
        batch.tokens[i, : len(rows)] = rows
        batch.lens[i] = len(rows)
        batch.seq_lens[i] = s.seq_len if starts is None else starts[i]
        batch.slots[i] = s.slot
        if verify:
            batch.vrow_base[i] = counts.verify_row_base(s.slot)
            batch.vslot[i] = counts.verify_slot(s.slot)
        batch.row_index[r : r + len(rows)] = i * t + np.arange(len(rows))
        _set_tables(batch.block_tables, batch.draft_tables, i, s)
        r += len(rows)
    return batch, r


def prefill_bounds(block_size: int, start: int, n: int, chunk: int, cached: bool, branch: int) -> list[tuple[int, int]]:
    """The (offset, end) into the n tokens of a prefill starting at `start` of each program:
    chunks of `chunk`, and with `cached` more splits at the last full block and at `branch`
    (where the prompt leaves the cached KV blocks: a snapshot there serves the next prompt
    sharing that prefix)."""
    cuts = set(range(chunk, n, chunk))
    full = (start + n) // block_size * block_size
    for at in (full - start, branch - start) if cached else ():
        if 0 < at < n:
            cuts.add(at)
    edges = [0, *sorted(cuts), n]
    return list(zip(edges[:-1], edges[1:]))


def prefill_chunk(counts: PoolCounts, seq: SequenceState, part: Sequence[int]) -> PrefillChunk:
    """The `PrefillChunk` of `part`, the next tokens of `seq` (at its length), at its bucket."""
    x = PrefillChunk.padded(counts, counts.draft_table_width, counts.prefill_bucket(len(part)))
    x.tokens[0, : len(part)] = part
    x.start[0], x.length[0], x.slot[0] = seq.seq_len, len(part), seq.slot
    _set_tables(x.block_table, x.draft_table, 0, seq)
    return x


def propose_batch(counts: PoolCounts, seqs: Sequence[SequenceState], last: Sequence[int]) -> ProposeBatch:
    """The `ProposeBatch` of seqs, each from its last sampled token last[i] at its length."""
    x = ProposeBatch.padded(counts, counts.draft_table_width, bucket_width(len(seqs)))
    for i, (s, tok) in enumerate(zip(seqs, last)):
        x.last[i], x.seq_lens[i], x.slots[i], x.valid[i] = tok, s.seq_len, s.slot, True
        x.draft_tables[i, : len(s.draft_blocks)] = s.draft_blocks
    return x


def verdict_batch(
    counts: PoolCounts,
    seqs: Sequence[SequenceState],
    rows: Sequence[int],
    ks: Sequence[int],
    restore: Sequence[bool] | None = None,
) -> VerdictBatch:
    """The `VerdictBatch` of seqs' verdicts (rows kept of ks verified; `restore`: put the
    pre-verify state back where True)."""
    v = VerdictBatch.padded(counts, bucket_width(len(seqs)))
    for i, (s, r, k) in enumerate(zip(seqs, rows, ks)):
        v.slots[i], v.vslots[i], v.rows[i], v.ks[i] = s.slot, counts.verify_slot(s.slot), r, k
        v.vrow_base[i] = counts.verify_row_base(s.slot)
    if restore is not None:
        v.restore[: len(seqs)] = restore
    return v


def stash_batch(counts: PoolCounts, seqs: Sequence[SequenceState], rows: Sequence[int]) -> StashBatch:
    """The `StashBatch` stashing flat verify row rows[i] into seqs[i]'s slot."""
    x = StashBatch.padded(counts, bucket_width(len(seqs)))
    for i, (s, r) in enumerate(zip(seqs, rows)):
        x.rows[i], x.slots[i] = r, s.slot
    return x


def sequence_address(counts: PoolCounts, seq: SequenceState) -> SequenceAddress:
    """Where `seq`'s state lives (slot, null-padded block tables)."""
    at = SequenceAddress.padded(counts, counts.draft_table_width)
    at.slot[...] = seq.slot
    at.blocks[: len(seq.blocks)] = seq.blocks
    at.draft_blocks[: len(seq.draft_blocks)] = seq.draft_blocks
    return at


def snapshot_copy(counts: PoolCounts, seq: SequenceState, snap_slot: int, position: int) -> SnapshotCopy:
    """The input of a snapshot copy between `seq`'s slot and snapshot slot `snap_slot` at
    `position` tokens: with a drafter, the drafter block holding position - 1 (the partial
    block the snapshot carries)."""
    x = SnapshotCopy.padded(counts)
    x.slot[...], x.snap[...] = seq.slot, snap_slot
    if counts.drafter:
        x.draft_block[...] = seq.draft_blocks[(position - 1) // counts.draft_block_size]
    return x


def sampling_batch(counts: PoolCounts, params: Sequence[Sampling], width: int | None = None) -> SamplingRows:
    """The `SamplingRows` of a batch of len(params) sequences (their parameters, in batch order) at
    its width bucket (`width`: a given width, e.g. a prefill's 1); padding rows are greedy."""
    x = SamplingRows.padded(counts, bucket_width(len(params)) if width is None else width)
    for i, s in enumerate(params):
        x.set_row(i, s)
    return x
