"""The engine's counts (`metrale_jax.engine.capacity`): K-ladder drafts, slots, pool units, KV blocks.

The worked vectors are the unit counts of two shipped configs (dense 27B at one slot with K = 4;
MoE 35B-A3B at eight slots with K = 2).
"""

from __future__ import annotations

import dataclasses

import pytest

from metrale_jax.engine.capacity import (
    DECODE_BATCH_LADDER,
    DEFAULT_K_LADDER,
    bucket_width,
    kv_blocks_for,
    ladder_drafts,
    mtp_state_slots,
    pool_counts,
    prefill_chunk_tokens,
    verify_slot_drafts,
)
from metrale_jax.engine.settings import SettingsError, parse_k_ladder, resolve_settings


@dataclasses.dataclass(frozen=True)
class Arch:
    num_linear_layers: int = 3
    num_mtp_layers: int = 1


def settings(**raw):
    raw = {k: str(v) if k in ("max_batch_size", "ssm_decode_ring_slots") else v for k, v in raw.items()}
    return resolve_settings(raw, None, auto_slots=8)


# ---- ladder_drafts / verify_slot_drafts ----


def test_ladder_drafts_first_step_wins_and_last_step_applies_past_the_end():
    got = {n: ladder_drafts(n, 3, DEFAULT_K_LADDER) for n in (1, 4, 5, 8, 9, 16, 17, 32, 33, 500)}
    assert got == {1: 3, 4: 3, 5: 3, 8: 3, 9: 1, 16: 1, 17: 1, 32: 1, 33: 1, 500: 1}


def test_ladder_drafts_clamps_to_one_through_num_drafts():
    assert ladder_drafts(1, 2, DEFAULT_K_LADDER) == 2
    assert ladder_drafts(1, 7, ((4, 9),)) == 7
    with pytest.raises(ValueError):
        ladder_drafts(1, 0, DEFAULT_K_LADDER)
    with pytest.raises(ValueError):
        ladder_drafts(1, 3, ())


def test_default_ladder_three_drafts_slots_0_to_7_hold_3_and_8_up_hold_1():
    caps = [verify_slot_drafts(s, 3, 32, DEFAULT_K_LADDER) for s in range(128)]
    assert caps[:8] == [3] * 8
    assert caps[8:] == [1] * 120


def test_verify_slot_drafts_other_ladders_caps_and_zero_drafts():
    ladder = parse_k_ladder("2:2,32:1")
    assert [verify_slot_drafts(s, 2, 32, ladder) for s in range(4)] == [2, 2, 1, 1]
    # a slot past the dispatch cap still implies slot + 1 active sequences
    assert verify_slot_drafts(10, 3, 4, DEFAULT_K_LADDER) == 1
    assert verify_slot_drafts(3, 3, 4, DEFAULT_K_LADDER) == 3
    assert verify_slot_drafts(0, 0, 32, DEFAULT_K_LADDER) == 0


def test_mtp_state_slots_floor_of_32_capped_by_slots():
    assert mtp_state_slots(8, 32) == 8
    assert mtp_state_slots(64, 32) == 32
    assert mtp_state_slots(64, 48) == 48
    assert mtp_state_slots(40, 4) == 32
    assert mtp_state_slots(128, 128) == 128


# ---- widths, blocks, chunks ----


def test_bucket_width_pads_to_the_next_rung():
    widths = (1, 2, 3, 5, 9, 13, 17, 25, 33, 49, 65, 97, 128)
    assert [bucket_width(n) for n in widths] == [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 128]
    assert all(bucket_width(w) == w for w in DECODE_BATCH_LADDER)
    for bad in (0, 129):
        with pytest.raises(ValueError):
            bucket_width(bad)


def test_kv_blocks_two_sequences_of_256k_at_block_16():
    assert kv_blocks_for(2, 256 * 1024, 16) == 32_771


@pytest.mark.parametrize(
    "mpt, msl, bs, want",
    [
        (8192, 32768, 16, 8192),  # unset: 8192
        (8192, 4096, 16, 4096),  # unset: capped by the context
        (10000, 4096, 16, 10000),  # set by the user: taken as is
        (100_000, 262144, 16, 65520),  # over 65535: whole blocks below it
    ],
)
def test_prefill_chunk(mpt, msl, bs, want):
    assert prefill_chunk_tokens(mpt, msl, bs) == want


# ---- pool_counts ----


def test_without_speculation_there_are_no_verify_pools():
    c = pool_counts(settings(max_batch_size=8), Arch())
    assert (c.real_slots, c.slots, c.speculative) == (8, 9, False)
    assert (c.h_steps, c.h_step_offsets, c.h_step_rows, c.verify_slots) == ((), (0,), 0, 0)
    assert (c.conv_steps, c.checkpoint_slots, c.stash_rows, c.draft_kv_blocks) == (0, 0, 0, 0)
    assert c.slot_draft_capacity(0) == 0
    assert c.ring_slots == 0  # auto: this engine has no decode-rollback ring


def test_a_drafter_runs_only_in_a_speculative_serve_of_a_model_with_mtp_layers():
    spec = settings(max_batch_size=4, speculative=True)
    assert pool_counts(spec, Arch()).drafter
    assert not pool_counts(spec, Arch(num_mtp_layers=0)).drafter
    assert not pool_counts(settings(max_batch_size=4), Arch()).drafter


def test_sixteen_slots_three_drafts_tiered_h_rows_and_flat_offsets():
    c = pool_counts(settings(max_batch_size=16, speculative=True, num_drafts=3), Arch())
    assert (c.k, c.mtp_slots, c.verify_slots) == (4, 16, 17)
    assert c.h_steps == (3,) * 8 + (1,) * 8 + (3,)
    assert c.h_step_offsets == (0, 3, 6, 9, 12, 15, 18, 21, 24, 25, 26, 27, 28, 29, 30, 31, 32, 35)
    assert c.h_step_rows == 35
    # stash: one row per slot, the dummy included
    assert (c.conv_steps, c.checkpoint_slots, c.stash_rows, c.ring_slots) == (4, 17, 17, 0)
    assert [c.slot_draft_capacity(s) for s in range(16)] == [3] * 8 + [1] * 8


def test_slots_past_the_mtp_slots_share_the_verify_dummy_and_carry_no_drafts():
    c = pool_counts(settings(max_batch_size=40, speculative=True, num_drafts=3), Arch())
    assert c.mtp_slots == 32 and c.verify_slots == 33
    assert c.verify_slot(31) == 31 and c.verify_slot(32) == 32 and c.verify_slot(39) == 32
    assert c.slot_draft_capacity(31) == 1 and c.slot_draft_capacity(32) == 0
    assert len(c.slot_drafts) == 32


def test_replay_keeps_no_intermediates_but_the_ladder_still_caps_drafts():
    c = pool_counts(settings(max_batch_size=12, speculative=True, num_drafts=3, ssm_rollback_mode="replay"), Arch())
    assert c.h_steps == (0,) * 13 and c.h_step_rows == 0 and c.conv_steps == 0
    assert c.checkpoint_slots == 13
    assert [c.slot_draft_capacity(s) for s in (0, 7, 8, 11)] == [3, 3, 1, 1]


def test_worked_vector_dense_27b_one_slot_k4():
    """Spec: per layer h (2+6+2) units, conv (2+8+2) units."""
    c = pool_counts(settings(max_batch_size=1, speculative=True, num_drafts=3), Arch())
    assert c.k == 4 and c.mtp_slots == 1
    assert (c.slots, c.h_step_rows, c.checkpoint_slots) == (2, 6, 2)
    assert (c.slots, c.conv_steps * c.verify_slots, c.checkpoint_slots) == (2, 8, 2)


def test_worked_vector_moe_35b_eight_slots_k2():
    """Spec: per layer h (9+9+9) units, conv (9+18+9) units."""
    c = pool_counts(settings(max_batch_size=8, speculative=True, num_drafts=1, mtp_max_seqs=128), Arch())
    assert c.k == 2 and c.mtp_slots == 8
    assert (c.slots, c.h_step_rows, c.checkpoint_slots) == (9, 9, 9)
    assert (c.slots, c.conv_steps * c.verify_slots, c.checkpoint_slots) == (9, 18, 9)


def test_snapshot_slots_only_with_prefix_caching():
    on = pool_counts(settings(enable_prefix_caching=True, ssm_cache_slots=256), Arch())
    off = pool_counts(settings(ssm_cache_slots=256), Arch())
    assert (on.snapshot_slots, off.snapshot_slots) == (256, 0)


def test_ring_needs_recurrent_layers():
    assert pool_counts(settings(), Arch(num_linear_layers=0)).ring_slots == 0
    assert pool_counts(settings(ssm_decode_ring_slots=2), Arch()).ring_slots == 2


def test_kv_blocks_follow_tokens_per_seq_or_max_seq_len():
    s = settings(max_batch_size=4, max_seq_len=4096, block_size=16)
    assert pool_counts(s, Arch()).kv_blocks == 4 * (4096 // 16 + 1) + 1
    c = pool_counts(s, Arch(), tokens_per_seq=1000)
    assert (c.kv_tokens, c.kv_blocks, c.max_blocks_per_seq) == (1000, 4 * 63 + 1, 257)
    for bad in (0, 4097):
        with pytest.raises(ValueError, match="tokens_per_seq"):
            pool_counts(s, Arch(), tokens_per_seq=bad)


def test_draft_kv_blocks_capped_by_the_mtp_dispatch_cap():
    p = 1000 // 16 + 1
    wide = pool_counts(settings(max_batch_size=12, speculative=True, mtp_max_seqs=4), Arch(), tokens_per_seq=1000)
    assert (wide.draft_block_size, wide.draft_kv_blocks) == (16, p * 4 + 1)
    narrow = pool_counts(settings(max_batch_size=2, speculative=True), Arch(), tokens_per_seq=1000)
    assert narrow.draft_kv_blocks == p * 2 + 1
    none = pool_counts(settings(max_batch_size=2, speculative=True), Arch(num_mtp_layers=0))
    assert none.draft_kv_blocks == 0


def test_max_batch_tokens_covers_a_chunk_plus_every_slot_and_a_verify():
    c = pool_counts(settings(max_batch_size=8, speculative=True, num_drafts=3, max_prefill_tokens=2), Arch())
    assert c.prefill_chunk == 2 and c.max_batch_tokens == 10
    c = pool_counts(settings(max_batch_size=1, speculative=True, num_drafts=3, max_prefill_tokens=1), Arch())
    assert c.max_batch_tokens == 5  # K + 1 rows of a verify step


def test_pool_counts_is_hashable_and_pure():
    s = settings(max_batch_size=16, speculative=True, num_drafts=3)
    assert pool_counts(s, Arch()) == pool_counts(s, Arch())
    assert hash(pool_counts(s, Arch())) == hash(pool_counts(s, Arch()))


def test_rejection_sampling_keeps_one_drafter_law_per_draft_and_slot_only_with_a_drafter():
    """`--speculative-sampling rejection` counts k - 1 drafter laws per slot (the pool's
    `draft_probs`); gumbel, no drafter or no speculation count none."""
    rej = settings(max_batch_size=4, speculative=True, num_drafts=3, speculative_sampling="rejection")
    c = pool_counts(rej, Arch())
    assert (c.draft_prob_rows, c.rejection) == (3, True)
    assert pool_counts(rej, Arch(num_mtp_layers=0)).draft_prob_rows == 0
    assert pool_counts(settings(max_batch_size=4, speculative=True, num_drafts=3), Arch()).draft_prob_rows == 0
    with pytest.raises(SettingsError, match="--speculative-sampling 'metropolis'"):
        settings(speculative_sampling="metropolis")
