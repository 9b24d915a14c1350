"""The engine's host-side counts: slots, K-ladder draft capacities, pool unit counts, KV blocks.

Owns: every count the engine allocates by and the memory planner reports, so that the two can
never disagree. `pool_counts` is the single place a pool's *number of units* is decided; the
bytes per unit belong to the allocator (`metrale_jax.engine.pool`), never to this module.

Invariants:
- Pure functions of plain Python ints (and of a frozen settings/config); no JAX, no I/O.
- Sequence slots carry one padding dummy (`PoolCounts.slots = real_slots + 1`); the paged KV pool
  carries one null block that padding rows write into.
- The MTP verify pools cover slots `0..mtp_slots` plus one shared verify dummy (index
  `mtp_slots`), which every slot at or above `mtp_slots` maps to.
- A verify slot's draft capacity comes from the K ladder: with the default ladder and 3 drafts,
  slots 0..7 hold 3 drafts and slots 8 and up hold 1.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

KLadder = tuple[tuple[int, int], ...]

#: Default K ladder, `(n_max, drafts)` steps: up to `n_max` active sequences verify `drafts`.
DEFAULT_K_LADDER: KLadder = ((4, 3), (8, 3), (16, 1), (32, 1))
#: The widths the engine pads a decode/verify/propose batch to (one compiled program each).
DECODE_BATCH_LADDER: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
#: The most sequence slots a serve may hold (`--max-batch-size auto`'s ceiling).
AUTO_MAX_SLOTS = DECODE_BATCH_LADDER[-1]
#: Upper bound of `--mtp-max-seqs` (the widest batched verify).
MAX_MTP_MAX_SEQS = 128
#: The MTP state pools never cover fewer slots than this (unless the serve has fewer slots).
MTP_STATE_SLOTS_FLOOR = 32
#: The deepest decode-rollback ring `--ssm-decode-ring-slots` accepts.
DECODE_ROLLBACK_RING_SLOTS = 8
#: Tokens per block of the MTP head's own paged KV, whatever `--block-size` says.
DRAFT_KV_BLOCK_SIZE = 16
#: The largest prefill chunk, in tokens, rounded down to a whole number of KV blocks.
MAX_PREFILL_CHUNK = 65535
#: `--max-prefill-tokens` at this value means "not set": the chunk is then capped by the context.
UNSET_PREFILL_TOKENS = 8192
#: The shortest prefill bucket, in tokens (`PoolCounts.prefill_bucket`).
MIN_PREFILL_BUCKET = 16


class ModelCounts(Protocol):
    """The two architecture counts `pool_counts` reads from a model config."""

    @property
    def num_linear_layers(self) -> int: ...

    @property
    def num_mtp_layers(self) -> int: ...


class PoolSettings(Protocol):
    """The serve settings `pool_counts` reads (`engine.settings.EngineSettings` has them all; a
    protocol, so that the settings, which validate against this module's limits, are not
    imported back)."""

    @property
    def max_batch_size(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def speculative(self) -> bool: ...
    @property
    def num_drafts(self) -> int: ...
    @property
    def mtp_max_seqs(self) -> int: ...
    @property
    def k_ladder(self) -> KLadder: ...
    @property
    def ssm_rollback_mode(self) -> str: ...
    @property
    def max_prefill_tokens(self) -> int: ...
    @property
    def enable_prefix_caching(self) -> bool: ...
    @property
    def ssm_cache_slots(self) -> int: ...
    @property
    def ssm_decode_ring_slots(self) -> int: ...
    @property
    def speculative_sampling(self) -> str: ...


def ladder_drafts(n_active: int, num_drafts: int, ladder: KLadder) -> int:
    """Drafts per sequence when `n_active` sequences verify together.

    Contract: the first step with `n_active <= n_max` wins; past the last step the last step
    applies; the result is clamped to `1..=num_drafts`. Requires `num_drafts >= 1` and a
    non-empty ladder (ValueError otherwise).
    """
    if num_drafts < 1:
        raise ValueError(f"ladder_drafts needs num_drafts >= 1, got {num_drafts}")
    if not ladder:
        raise ValueError("ladder_drafts needs a non-empty K ladder")
    drafts = next((k for n_max, k in ladder if n_active <= n_max), ladder[-1][1])
    return max(1, min(drafts, num_drafts))


def verify_slot_drafts(slot: int, num_drafts: int, mtp_max_seqs: int, ladder: KLadder) -> int:
    """The most drafts a sequence on verify slot `slot` may ever carry.

    Slots are compacted (active sequences occupy the lowest slots), so a sequence on `slot`
    implies at least `slot + 1` active sequences; the capacity is the largest ladder step over
    `n in slot+1 ..= max(mtp_max_seqs, slot+1)`, clamped to `1..=num_drafts`. 0 when
    `num_drafts == 0`.
    """
    if num_drafts == 0:
        return 0
    top = max(mtp_max_seqs, slot + 1)
    best = max(ladder_drafts(n, num_drafts, ladder) for n in range(slot + 1, top + 1))
    return max(1, min(best, num_drafts))


def mtp_state_slots(slots: int, mtp_max_seqs: int) -> int:
    """How many sequence slots own MTP verify state: `min(slots, max(mtp_max_seqs, 32))`.

    `slots` is the real slot count (no dummy). Slots at or above the result share the verify
    dummy and verify without drafts.
    """
    return min(slots, max(mtp_max_seqs, MTP_STATE_SLOTS_FLOOR))


def bucket_width(n: int) -> int:
    """The `DECODE_BATCH_LADDER` width a batch of `n` rows is padded to (smallest rung >= n).

    Raises ValueError for `n < 1` or `n` above the widest rung.
    """
    if n < 1 or n > DECODE_BATCH_LADDER[-1]:
        raise ValueError(f"batch width {n} is outside 1..={DECODE_BATCH_LADDER[-1]}")
    return next(w for w in DECODE_BATCH_LADDER if w >= n)


def kv_blocks_for(sequences: int, tokens: int, block_size: int) -> int:
    """Paged-KV blocks for `sequences` sequences of `tokens` tokens each.

    `sequences × (tokens // block_size + 1) + 1`: each sequence may hold the block its next
    token opens (admission reserves it), and the pool has one null block that padding rows
    write into.
    """
    return sequences * (tokens // block_size + 1) + 1


def draft_table_width(max_seq_len: int) -> int:
    """Entries of a sequence's drafter block table: `max_seq_len // DRAFT_KV_BLOCK_SIZE + 2`.

    It holds every drafter block a sequence of up to `max_seq_len` tokens may reserve (at most
    `ceil(max_seq_len / DRAFT_KV_BLOCK_SIZE)`); unused entries hold the drafter's null block.
    """
    return max_seq_len // DRAFT_KV_BLOCK_SIZE + 2


def prefill_chunk_tokens(max_prefill_tokens: int, max_seq_len: int, block_size: int) -> int:
    """The prefill chunk, in tokens: what one prefill forward may process.

    `--max-prefill-tokens` when set (any value but the 8192 default), else
    `min(max_seq_len, 8192)`; then at most 65535 tokens, rounded down to whole blocks.
    """
    chunk = max_prefill_tokens if max_prefill_tokens != UNSET_PREFILL_TOKENS else min(max_seq_len, UNSET_PREFILL_TOKENS)
    if chunk > MAX_PREFILL_CHUNK:
        chunk = MAX_PREFILL_CHUNK // block_size * block_size
    return chunk


@dataclasses.dataclass(frozen=True)
class PoolCounts:
    """Unit counts of every engine pool, for one serve configuration.

    Fields (all host ints):
    - `real_slots`: sequence slots the serve admits; `slots = real_slots + 1` (padding dummy).
    - `speculative`, `k = num_drafts + 1` (K is defined even when speculation is off).
    - `mtp_slots`: slots owning MTP verify state (0 without speculation); verify pools have
      `mtp_slots + 1` slots.
    - `slot_drafts`: the ladder's draft capacity of verify slots `0..mtp_slots` (no dummy).
    - `h_steps`: h-intermediate rows per verify slot `0..=mtp_slots` (the last is the verify
      dummy, with `k - 1` rows); `slot_drafts` under snapshot rollback, zeros under replay;
      empty without speculation.
    - `h_step_offsets`: prefix sums of `h_steps` (`len(h_steps) + 1` entries): slot `s`'s rows
      are `[h_step_offsets[s], h_step_offsets[s + 1])` of one flat array of
      `h_step_offsets[-1]` rows.
    - `conv_steps`: conv-intermediate rows per verify slot (`k` under snapshot, else 0).
    - `checkpoint_slots`: pre-verify checkpoints (`mtp_slots + 1` when speculative, else 0).
    - `snapshot_slots`: prefix-cache (Marconi) SSM snapshots: `--ssm-cache-slots` while prefix
      caching is on, else 0 (without prefix caching no snapshot is ever read).
    - `ring_slots`: decode-rollback ring depth per sequence slot (ring units are
      `ring_slots × slots`).
    - `stash_rows`: accepted-hidden stash rows, one per sequence slot with the dummy (the stash
      is indexed by slot: it holds the hidden of each sequence's last processed trunk row until
      the next propose pairs it with the sampled token; padding rows use the dummy's row).
    - `block_size`, `kv_tokens` (tokens per sequence the KV pool is sized for), `kv_blocks`
      (main model), `max_blocks_per_seq` (block-table width, sized for `max_seq_len`).
    - `draft_table_width`: entries of a sequence's drafter block table (MBd,
      `draft_table_width(max_seq_len)`; the programs' drafter tables have this width with or
      without a drafter).
    - `draft_kv_blocks`: the MTP head's paged KV in `DRAFT_KV_BLOCK_SIZE`-token blocks: with
      `p = kv_tokens // 16 + 1` blocks per sequence, `min(p × mtp_max_seqs, p × real_slots) + 1`
      (at most `mtp_max_seqs` sequences draft; +1 null block, as in the main pool); 0 without
      speculation or MTP layers.
    - `draft_prob_rows`: per sequence slot (the dummy included), the drafter laws rejection
      sampling keeps from a propose to its verify (`k - 1`, one per draft, each a row of the
      vocabulary) under `--speculative-sampling rejection` with an MTP drafter, else 0.
    - `prefill_chunk`: tokens one prefill forward may take; `max_batch_tokens`: the widest
      forward (`max(prefill_chunk + real_slots, k + 1 if speculative else 1, real_slots)`).
    """

    real_slots: int
    slots: int
    speculative: bool
    k: int
    mtp_slots: int
    slot_drafts: tuple[int, ...]
    h_steps: tuple[int, ...]
    h_step_offsets: tuple[int, ...]
    conv_steps: int
    checkpoint_slots: int
    snapshot_slots: int
    ring_slots: int
    stash_rows: int
    block_size: int
    kv_tokens: int
    kv_blocks: int
    max_blocks_per_seq: int
    draft_block_size: int
    draft_table_width: int
    draft_kv_blocks: int
    prefill_chunk: int
    max_batch_tokens: int
    draft_prob_rows: int = 0

    @property
    def rejection(self) -> bool:
        """Sampled speculative steps accept by rejection sampling (their drafter laws are kept)."""
        return self.draft_prob_rows > 0

    @property
    def verify_slots(self) -> int:
        """Verify-pool slots, the dummy included (0 without speculation)."""
        return len(self.h_steps)

    @property
    def h_step_rows(self) -> int:
        """Total h-intermediate rows over all verify slots (one flat array)."""
        return self.h_step_offsets[-1]

    def verify_slot(self, slot: int) -> int:
        """The verify-pool slot sequence slot `slot` uses: itself, or the dummy past `mtp_slots`."""
        return slot if slot < self.mtp_slots else self.mtp_slots

    def slot_draft_capacity(self, slot: int) -> int:
        """How many drafts a verify on sequence slot `slot` may carry (0 past `mtp_slots`)."""
        return self.slot_drafts[slot] if slot < self.mtp_slots else 0

    @property
    def propose_drafts(self) -> int:
        """The most drafts one propose may chain: `k - 1` with an MTP drafter, else 0."""
        return self.k - 1 if self.drafter else 0

    @property
    def drafter(self) -> bool:
        """An MTP drafter runs (a speculative serve of a model with MTP layers): exactly when the
        drafter's stash has rows."""
        return self.stash_rows > 0

    @property
    def dummy_slot(self) -> int:
        """The padding sequence slot (`slots - 1`), which no real sequence uses."""
        return self.slots - 1

    @property
    def null_block(self) -> int:
        """The paged KV pool's null block (`kv_blocks - 1`), which padding rows write into."""
        return self.kv_blocks - 1

    @property
    def draft_null_block(self) -> int:
        """The drafter KV pool's null block (`draft_kv_blocks - 1`; 0 without a drafter pool)."""
        return max(self.draft_kv_blocks - 1, 0)

    @property
    def verify_dummy_slot(self) -> int:
        """The shared verify dummy (`verify_slots - 1`, i.e. `mtp_slots`); -1 without speculation."""
        return self.verify_slots - 1

    def verify_row_base(self, slot: int) -> int:
        """The first flat h-intermediate row of sequence slot `slot`'s verify slot."""
        return self.h_step_offsets[self.verify_slot(slot)]

    def prefill_bucket(self, n: int) -> int:
        """The padded length of a prefill chunk of `n` tokens: the next power of two, at least
        `MIN_PREFILL_BUCKET`, at most `prefill_chunk` (one compiled prefill program per bucket)."""
        return min(self.prefill_chunk, max(MIN_PREFILL_BUCKET, 1 << (n - 1).bit_length()))


def pool_counts(settings: PoolSettings, config: ModelCounts, *, tokens_per_seq: int | None = None) -> PoolCounts:
    """Every pool's unit count for `settings` over `config`.

    `tokens_per_seq` sizes the paged KV pools (default `settings.max_seq_len`; the memory
    planner passes ISL + OSL); it must lie in `1..=max_seq_len` (ValueError otherwise).
    Reads `settings.max_batch_size` as the real slot count; the config only for whether it has
    recurrent layers (ring) and MTP layers (draft KV).
    """
    s = settings
    tokens = s.max_seq_len if tokens_per_seq is None else tokens_per_seq
    if not 1 <= tokens <= s.max_seq_len:
        raise ValueError(f"tokens_per_seq {tokens} is outside 1..={s.max_seq_len} (max_seq_len)")
    real = s.max_batch_size
    k = s.num_drafts + 1
    spec = s.speculative
    snapshot = s.ssm_rollback_mode == "snapshot"
    mtp_slots = mtp_state_slots(real, s.mtp_max_seqs) if spec else 0
    if spec:
        slot_drafts = tuple(
            verify_slot_drafts(slot, s.num_drafts, s.mtp_max_seqs, s.k_ladder) for slot in range(mtp_slots)
        )
        h_steps = (*slot_drafts, k - 1) if snapshot else (0,) * (mtp_slots + 1)
    else:
        slot_drafts, h_steps = (), ()
    offsets = [0]
    for rows in h_steps:
        offsets.append(offsets[-1] + rows)
    kv_blocks = kv_blocks_for(real, tokens, s.block_size)
    per_seq_draft = tokens // DRAFT_KV_BLOCK_SIZE + 1
    drafter = spec and config.num_mtp_layers > 0
    draft_kv_blocks = min(per_seq_draft * s.mtp_max_seqs, per_seq_draft * real) + 1 if drafter else 0
    chunk = prefill_chunk_tokens(s.max_prefill_tokens, s.max_seq_len, s.block_size)
    return PoolCounts(
        real_slots=real,
        slots=real + 1,
        speculative=spec,
        k=k,
        mtp_slots=mtp_slots,
        slot_drafts=slot_drafts,
        h_steps=h_steps,
        h_step_offsets=tuple(offsets),
        conv_steps=k if spec and snapshot else 0,
        checkpoint_slots=mtp_slots + 1 if spec else 0,
        snapshot_slots=s.ssm_cache_slots if s.enable_prefix_caching else 0,
        ring_slots=s.ssm_decode_ring_slots if config.num_linear_layers > 0 else 0,
        stash_rows=real + 1 if drafter else 0,
        block_size=s.block_size,
        kv_tokens=tokens,
        kv_blocks=kv_blocks,
        max_blocks_per_seq=s.max_seq_len // s.block_size + 1,
        draft_block_size=DRAFT_KV_BLOCK_SIZE,
        draft_table_width=draft_table_width(s.max_seq_len),
        draft_kv_blocks=draft_kv_blocks,
        prefill_chunk=chunk,
        max_batch_tokens=max(chunk + real, k + 1 if spec else 1, real),
        draft_prob_rows=k - 1 if drafter and s.speculative_sampling == "rejection" else 0,
    )
