"""The typed inputs of the engine's compiled programs, and the one constructor of each.

Owns: one `flax.struct.PyTreeNode` per program input kind (`PrefillChunk`, `StepBatch`,
`ProposeBatch`, `VerdictBatch`, `StashBatch`, `SequenceAddress`, `SnapshotCopy`), the frozen static part of the
programs that run the model (`PrefillStatic`, `StepStatic`, `ProposeStatic`, `SpeculativeStatic`:
the fused speculative step takes a verify's `StepBatch`), the swap-out record (`SwapArrays` on
device, `SwapRecord` with the host facts), and `abstract`.

Each input's `padded(counts, ...)` is its only constructor: the input at its program's shapes with
every row a padding row. The `Engine` fills its real rows in (host numpy, in place) and calls the
program; the memory planner compiles the program on `abstract(padded(...))`. Engine and planner
therefore build one tree structure, one set of shapes and dtypes per program.

Padding, stated here only: a padding sequence addresses the dummy slot (`counts.dummy_slot`), the
null KV and drafter blocks, and the verify dummy's slot and h rows (0 in a step that does not
verify); it has no rows (length 0, so every position is -1), its tokens (and a real sequence's
rows past its length) are `PAD_TOKEN`, its row_index entries and stash rows are 0, its propose
is invalid at seq_len 1, and its verdict keeps the live state (rows == ks == 1, no restore).

Invariants:
- Leaves are int32 (bool where a field says so); each field's comment gives its shape, in
  letters: B the batch width (a `capacity.DECODE_BATCH_LADDER` rung), T rows per sequence, Tb a
  prefill bucket (`PoolCounts.prefill_bucket`), MB `counts.max_blocks_per_seq`, MBd the drafter
  table width (`capacity.draft_table_width`).
- NOTE: the leaves are numpy, not jnp: a jnp array would dispatch a conversion op per argument.
  Every input kind is a `HostInput`, which a compiled call moves to the device as one int32
  vector (`programs.HostPacking`), not as one transfer per leaf.
- The static parts are frozen and hashable: they key `ProgramCache` and are closed over by the
  traced function, never traced.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import struct

from kernels_pallas.ops import Ops
from metrale_jax.config import ModelConfig
from metrale_jax.engine.capacity import PoolCounts

#: A leaf: host numpy when the engine builds it, a tracer inside a transition, a
#: `jax.ShapeDtypeStruct` in the planner's abstract inputs.
Array = Any


#: The token of a step's padding rows: no real token id (0 .. vocab - 1) and no argmax equals it, so
#: a comparison of drafts with argmaxes that strays past a sequence's rows can never agree there.
#: NOTE: the embedding gathers it as the last id (jnp wraps negative indices); padding rows are junk
#: that only the dummy slot and null blocks receive.
PAD_TOKEN = -1


def _full(shape: tuple[int, ...], value: int) -> np.ndarray:
    return np.full(shape, value, np.int32)


def abstract[T](tree: T) -> T:
    """`tree` with every leaf replaced by its `jax.ShapeDtypeStruct` (what `jax.jit.lower` takes)."""
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


# ---------------------------------------------------------------- static parts


@dataclasses.dataclass(frozen=True)
class ModelStatic:
    """What a program that runs the model is specialised on: the model config, the pool counts
    and the forward's ops (`ProgramCache.disclosure` selects programs by `ops.name`)."""

    cfg: ModelConfig
    counts: PoolCounts
    ops: Ops


@dataclasses.dataclass(frozen=True)
class PrefillStatic(ModelStatic):
    """`transitions.prefill_chunk`'s static part; drafter: also write the MTP drafter's KV and stash;
    samples: also draw the next token (`engine.sampling`) from a `SamplingRows` argument."""

    drafter: bool
    samples: bool = False


@dataclasses.dataclass(frozen=True)
class StepStatic(ModelStatic):
    """`transitions.step_rows`' static part; verify: a batched verify (T = K, write-on-accept)
    rather than a decode (T = 1); drafter: also write the MTP drafter's KV (and, decoding, the stash);
    samples: each row's token is its draw (`engine.sampling.draw`, a `SamplingRows` argument)
    rather than its argmax; rejection (a sampled verify): the rows' tokens are rejection
    sampling's verdict (`engine.sampling.rejection_rows`) against the pool's drafter laws."""

    verify: bool
    drafter: bool
    samples: bool = False
    rejection: bool = False


@dataclasses.dataclass(frozen=True)
class ProposeStatic(ModelStatic):
    """`transitions.propose`'s static part: the number of chained drafts; samples: each draft is
    the drafter's draw with the target's noise at its position (a `SamplingRows` argument);
    rejection (sampled): each draft is drawn with the drafter's own keys and its law kept in the
    pool (`engine.sampling.draft_draw`)."""

    num_drafts: int
    samples: bool = False
    rejection: bool = False


@dataclasses.dataclass(frozen=True)
class SpeculativeStatic(ModelStatic):
    """`transitions.speculative_step`'s static part: drafter (stash the accepted rows' hiddens and
    write the drafter's KV, as `StepStatic.drafter`), num_drafts (the chained drafts of the step's
    propose; 0: no propose), logits (also return the verify's and the propose's logits) and
    samples (verify and propose draw, as `StepStatic.samples` and `ProposeStatic.samples`) and
    rejection (sampled: rejection sampling, as `StepStatic.rejection` and `ProposeStatic.rejection`)."""

    drafter: bool
    num_drafts: int
    logits: bool = False
    samples: bool = False
    rejection: bool = False

    def __post_init__(self):
        if self.num_drafts and not self.drafter:
            raise ValueError("a speculative step proposes only with the MTP drafter")

    @property
    def step(self) -> StepStatic:
        """The verify's static part (write-on-accept)."""
        return StepStatic(
            self.cfg,
            self.counts,
            self.ops,
            verify=True,
            drafter=self.drafter,
            samples=self.samples,
            rejection=self.rejection,
        )

    @property
    def propose(self) -> ProposeStatic:
        """The propose's static part."""
        return ProposeStatic(
            self.cfg, self.counts, self.ops, num_drafts=self.num_drafts, samples=self.samples, rejection=self.rejection
        )


def sampled[S: (PrefillStatic, StepStatic, ProposeStatic, SpeculativeStatic)](static: S) -> S:
    """The sampling twin of a program's static part: `samples` set, and `rejection` where the
    serve accepts by rejection sampling (`PoolCounts.rejection`) and the program verifies or
    proposes (a prefill or a decode draws as plain sampling does). The one rule the engine and
    the program list both apply."""
    if isinstance(static, PrefillStatic) or (isinstance(static, StepStatic) and not static.verify):
        return dataclasses.replace(static, samples=True)
    return dataclasses.replace(static, samples=True, rejection=static.counts.rejection)


# ---------------------------------------------------------------- the model's programs


class HostInput(struct.PyTreeNode):
    """A program input the host builds, int32 (or bool) numpy leaves only: `programs` moves every
    such argument of a call to the device packed in one int32 vector (`programs.HostPacking`)."""


class PrefillChunk(HostInput):
    """One prefill chunk of one sequence; row t of the chunk sits at position start + t."""

    tokens: Array  # [1, Tb]; rows >= length are padding
    start: Array  # [1] tokens already cached
    length: Array  # [1] valid rows
    slot: Array  # [1]
    block_table: Array  # [1, MB]
    draft_table: Array  # [1, MBd]

    @classmethod
    def padded(cls, counts: PoolCounts, draft_width: int, tb: int) -> PrefillChunk:
        """A chunk of bucket `tb` with no tokens, on the dummy slot and null tables."""
        return cls(
            tokens=_full((1, tb), 0),
            start=_full((1,), 0),
            length=_full((1,), 0),
            slot=_full((1,), counts.dummy_slot),
            block_table=_full((1, counts.max_blocks_per_seq), counts.null_block),
            draft_table=_full((1, draft_width), counts.draft_null_block),
        )


class StepBatch(HostInput):
    """Decode (T = 1) or verify (T = K) rows of B sequences; row t of sequence b sits at position
    seq_lens[b] + t. vrow_base and vslot are read only by a verify."""

    tokens: Array  # [B, T]
    lens: Array  # [B] rows of each sequence (0: a padding sequence)
    seq_lens: Array  # [B] tokens already cached
    slots: Array  # [B]
    block_tables: Array  # [B, MB]
    draft_tables: Array  # [B, MBd]
    vrow_base: Array  # [B] first h row of the sequence's verify slot
    vslot: Array  # [B] the sequence's verify slot
    row_index: Array  # [B * T] flat seq-major row r -> b * T + t (padding -> 0)

    @classmethod
    def padded(cls, counts: PoolCounts, draft_width: int, b: int, t: int, *, verify: bool) -> StepBatch:
        """B padding sequences of T rows (verify addressing: the verify dummy's, else 0)."""
        return cls(
            tokens=_full((b, t), PAD_TOKEN),
            lens=_full((b,), 0),
            seq_lens=_full((b,), 0),
            slots=_full((b,), counts.dummy_slot),
            block_tables=_full((b, counts.max_blocks_per_seq), counts.null_block),
            draft_tables=_full((b, draft_width), counts.draft_null_block),
            vrow_base=_full((b,), counts.h_step_offsets[counts.verify_dummy_slot] if verify else 0),
            vslot=_full((b,), counts.verify_dummy_slot if verify else 0),
            row_index=_full((b * t,), 0),
        )


class ProposeBatch(HostInput):
    """The MTP drafter's batched propose over B sequences, from the last sampled token."""

    last: Array  # [B] the last sampled token
    seq_lens: Array  # [B] its position
    slots: Array  # [B]
    draft_tables: Array  # [B, MBd]
    valid: Array  # [B] bool (False: a padding sequence)

    @classmethod
    def padded(cls, counts: PoolCounts, draft_width: int, b: int) -> ProposeBatch:
        """B invalid proposes on the dummy slot and the drafter's null block."""
        return cls(
            last=_full((b,), 0),
            seq_lens=_full((b,), 1),
            slots=_full((b,), counts.dummy_slot),
            draft_tables=_full((b, draft_width), counts.draft_null_block),
            valid=np.zeros((b,), bool),
        )


# ---------------------------------------------------------------- the verdict's programs


class VerdictBatch(HostInput):
    """A batched verify's verdict, per sequence. Each program reads its own fields:
    `gdn_fold_accepted` slots, rows, ks, vrow_base; `commit_conv` slots, vslots, rows, ks;
    `restore_checkpoint` slots, vslots, restore.
    NOTE: the fields are in the order every program reads them, so each program's parameters
    (jit drops the fields it does not read) keep that order."""

    slots: Array  # [B]
    vslots: Array  # [B] verify slots (which hold the pre-verify checkpoint)
    rows: Array  # [B] rows kept: accepted drafts + 1, the anchor included
    ks: Array  # [B] rows verified
    vrow_base: Array  # [B] first h row of the verify slot
    restore: Array  # [B] bool: put the pre-verify state back

    @classmethod
    def padded(cls, counts: PoolCounts, b: int) -> VerdictBatch:
        """B verdicts that keep the live state of the dummy slot."""
        return cls(
            slots=_full((b,), counts.dummy_slot),
            vslots=_full((b,), counts.verify_dummy_slot),
            rows=_full((b,), 1),
            ks=_full((b,), 1),
            vrow_base=_full((b,), counts.h_step_offsets[counts.verify_dummy_slot]),
            restore=np.zeros((b,), bool),
        )


class StashBatch(HostInput):
    """Which verify hidden row each sequence's stash row takes."""

    rows: Array  # [B] flat verify row
    slots: Array  # [B]

    @classmethod
    def padded(cls, counts: PoolCounts, b: int) -> StashBatch:
        """B entries stashing verify row 0 into the dummy slot."""
        return cls(rows=_full((b,), 0), slots=_full((b,), counts.dummy_slot))


# ---------------------------------------------------------------- swap


class SequenceAddress(HostInput):
    """Where one sequence's state lives (block tables null-padded)."""

    slot: Array  # []
    blocks: Array  # [MB] its KV blocks
    draft_blocks: Array  # [MBd] its drafter KV blocks

    @classmethod
    def padded(cls, counts: PoolCounts, draft_width: int) -> SequenceAddress:
        """The dummy slot with null tables."""
        return cls(
            slot=np.asarray(counts.dummy_slot, np.int32),
            blocks=_full((counts.max_blocks_per_seq,), counts.null_block),
            draft_blocks=_full((draft_width,), counts.draft_null_block),
        )


class SnapshotCopy(HostInput):
    """One copy between a sequence slot and a prefix-cache snapshot slot (either way)."""

    slot: Array  # [] the sequence slot
    snap: Array  # [] the snapshot slot
    draft_block: Array  # [] the drafter block holding the snapshot position - 1 (null: none)

    @classmethod
    def padded(cls, counts: PoolCounts) -> SnapshotCopy:
        """The dummy slot, the null drafter block and snapshot slot `snapshot_slots` (out of range:
        a copy into it is dropped)."""
        return cls(
            slot=np.asarray(counts.dummy_slot, np.int32),
            snap=np.asarray(counts.snapshot_slots, np.int32),
            draft_block=np.asarray(counts.draft_null_block, np.int32),
        )


class SwapArrays(struct.PyTreeNode):
    """Everything one sequence owns on device (L_lin GDN, L_full attention, L_mtp MTP layers; the
    KV at its block table's blocks, null-padded); the drafter's part is None without a drafter,
    its pending drafts' laws None unless the serve keeps them (rejection sampling)."""

    gdn_h: Array  # [L_lin, nv, dk, dv] live GDN state
    gdn_conv: Array  # [L_lin, C, Kc] live conv window
    kv_k: Array  # [L_full, MB, bs, KV, D]
    kv_v: Array  # [L_full, MB, bs, KV, D]
    stash: Array | None = None  # [Hd]
    draft_k: Array | None = None  # [L_mtp, MBd, DRAFT_KV_BLOCK_SIZE, KV, D]
    draft_v: Array | None = None  # [L_mtp, MBd, DRAFT_KV_BLOCK_SIZE, KV, D]
    draft_probs: Array | None = None  # [draft_prob_rows, V] its pending drafts' laws (rejection sampling)


@dataclasses.dataclass(frozen=True)
class SwapRecord:
    """A swapped-out sequence: `device` (numpy copies of its `SwapArrays`) and the host facts a
    restore needs: seq_len, tokens, blocks and draft_blocks (how many it held), drafter_len."""

    device: SwapArrays
    seq_len: int
    tokens: tuple[int, ...]
    blocks: int
    draft_blocks: int
    drafter_len: int
