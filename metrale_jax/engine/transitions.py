"""The engine's state transitions: pure functions `(pool, params, addressing...) -> (outputs, pool)`.

Owns: prefill (one chunk of one sequence), decode / batched verify rows (write-on-accept), the GDN
fold of accepted rows, the conv commit, the hidden stash, the MTP drafter's batched propose, and
swap-out/swap-in of a sequence's state. The engine (`engine.py`) compiles each once per shape
bucket and donates the pool; nothing here syncs with the host.

Addressing arrays are int32 and traced (never static), so slot indices, lengths and K per
sequence change without recompiling. Padding rows/sequences address the dummy slot, the null
block and the dummy verify rows, and have position -1.

Drafter invariant (exact MTP context): every trunk transition also runs the MTP layer over the
pairs (hidden of the previous trunk row, this row's token) at position p - 1, writing the
drafter's KV; the hidden of the last processed row waits in `stash[slot]` (pre-final-norm) for the
next propose, which pairs it with the last sampled token. The drafter KV therefore always holds
exactly the committed context, and rows past it (rejected drafts, chained proposals) are
overwritten before they are ever read, as in the trunk's KV.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from metrale_jax.config import ModelConfig
from metrale_jax.engine.capacity import PoolCounts
from metrale_jax.engine.pool import EnginePool
from metrale_jax.model.reductions import first_argmax
from metrale_jax.model.state_io import PoolIO, TrunkState, ordered_read
from metrale_jax.model.trunk import final_norm, head, mtp_forward, trunk


def _positions(starts, lens, t: int):
    """[B, T] absolute positions starts + t for t < lens, else -1."""
    r = jnp.arange(t, dtype=jnp.int32)[None, :]
    return jnp.where(r < lens[:, None], starts[:, None] + r, -1)


def _drafter_io(cfg, counts, ops, positions, draft_tables):
    return PoolIO(
        cfg=cfg,
        slots=None,
        lens=None,
        positions=positions,
        block_tables=draft_tables,
        null_block=counts.draft_kv_blocks - 1,
        gdn_mode="rows",
        ops=ops,
    )


def _mtp_hidden(params, cfg: ModelConfig, hidden):
    """The trunk hidden as the MTP head reads it (after the final norm unless configured not to)."""
    return final_norm(params, cfg, hidden) if cfg.mtp_hidden_postnorm else hidden


def _drafter_catch_up(pool: EnginePool, params, cfg, counts, ops, tokens, hidden, positions, slots, draft_tables):
    """Write the drafter KV of pairs (previous row's hidden, this row's token) at position p - 1."""
    stashed, (stash,) = ordered_read(pool.stash[slots], pool.stash)  # before a decode's stash write
    pool = pool.replace(stash=stash)
    prev = jnp.concatenate([stashed[:, None, :], hidden[:, :-1]], axis=1)
    mtp_pos = jnp.where(positions > 0, positions - 1, -1)
    io = _drafter_io(cfg, counts, ops, mtp_pos, draft_tables)
    state = TrunkState(gdn_h=None, gdn_conv=None, kv_k=pool.draft_k, kv_v=pool.draft_v)
    _, _, state = mtp_forward(params, cfg, tokens, _mtp_hidden(params, cfg, prev), io, state, 0)
    return pool.replace(draft_k=state.kv_k, draft_v=state.kv_v)


def _last_rows(x, lens):
    """x [B, T, ...] -> x[b, lens[b] - 1] (row 0 where lens == 0)."""
    idx = jnp.maximum(lens - 1, 0)
    return jnp.take_along_axis(x, idx.reshape(-1, 1, *([1] * (x.ndim - 2))), axis=1)[:, 0]


def prefill_chunk(
    pool: EnginePool,
    params,
    tokens,
    start,
    length,
    slot,
    block_table,
    draft_table,
    *,
    cfg: ModelConfig,
    counts: PoolCounts,
    ops,
    drafter: bool,
):
    """One prefill chunk of one sequence.

    tokens [1, Tb] (rows >= length are padding); start, length, slot: [1] int32; block_table
    [1, MB]; draft_table [1, MBd] (ignored without drafter). A chunk at start 0 begins from a zero
    GDN state and conv window. Returns (logits of the last valid row [1, V] f32, pool).
    """
    chex.assert_shape(tokens, (1, None))
    chex.assert_shape([start, length, slot], (1,))
    chex.assert_shape(block_table, (1, counts.max_blocks_per_seq))
    positions = _positions(start, length, tokens.shape[1])
    io = PoolIO(
        cfg=cfg,
        slots=slot,
        lens=length,
        positions=positions,
        block_tables=block_table,
        null_block=counts.kv_blocks - 1,
        gdn_mode="chunk",
        ops=ops,
        fresh=start == 0,
    )
    hidden, trunk_state = trunk(params, cfg, tokens, io, pool.trunk)
    pool = pool.replace(trunk=trunk_state)
    last_hidden = _last_rows(hidden, length)
    if drafter:
        pool = _drafter_catch_up(pool, params, cfg, counts, ops, tokens, hidden, positions, slot, draft_table)
        pool = pool.replace(stash=pool.stash.at[slot].set(last_hidden))
    return head(params, cfg, last_hidden), pool


def step_rows(
    pool: EnginePool,
    params,
    tokens,
    lens,
    seq_lens,
    slots,
    block_tables,
    draft_tables,
    vrow_base,
    vslot,
    row_index,
    *,
    cfg: ModelConfig,
    counts: PoolCounts,
    ops,
    verify: bool,
    drafter: bool,
):
    """Decode (T = 1) or batched verify (T = K_max) rows of B sequences.

    tokens [B, T]; lens [B] (K_i; 0 for padding sequences); seq_lens [B] (tokens already in the
    cache: row t sits at position seq_len + t); slots [B]; block_tables [B, MB]; draft_tables
    [B, MBd]; vrow_base / vslot [B] (verify addressing, used when verify); row_index [R_b] (flat
    seq-major row -> b*T + t, padding -> 0).
    With verify, each sequence's pre-verify live state (h and conv) is first copied into its
    checkpoint slot (vslot), then (write-on-accept, snapshot rollback) every GDN layer writes the state after rows 0..K_i-2 into the
    slot's verify h rows and the window after every row into its verify conv rows; the live slot
    holds the state after row K_i - 1. Without verify (decode), the stash takes the row's hidden.
    Returns (logits [R_b, V] f32, argmax [R_b] int32, hidden [R_b, Hd] pre-norm, pool).
    """
    b, t = tokens.shape
    chex.assert_shape([lens, seq_lens, slots, vrow_base, vslot], (b,))
    chex.assert_shape(block_tables, (b, counts.max_blocks_per_seq))
    chex.assert_shape(row_index, (b * t,))
    chex.assert_type([tokens, lens, seq_lens, slots, row_index], jnp.int32)
    positions = _positions(seq_lens, lens, t)
    if verify and pool.ckpt_h is not None:
        h, c = pool.trunk.gdn_h, pool.trunk.gdn_conv
        # NOTE: the checkpoint written, not the slots' state read, goes through the barrier: the
        # read then fuses into the checkpoint's write (a separate [L, B, ...] read cost 594 MiB of
        # scratch in the 80B recipe's verify).
        (ckpt_h, ckpt_conv), (h, c) = ordered_read(
            (pool.ckpt_h.at[:, vslot].set(h[:, slots]), pool.ckpt_conv.at[:, vslot].set(c[:, slots])), h, c
        )
        pool = pool.replace(trunk=pool.trunk.replace(gdn_h=h, gdn_conv=c), ckpt_h=ckpt_h, ckpt_conv=ckpt_conv)
    io = PoolIO(
        cfg=cfg,
        slots=slots,
        lens=lens,
        positions=positions,
        block_tables=block_tables,
        null_block=counts.kv_blocks - 1,
        gdn_mode="rows",
        ops=ops,
        vrow_base=vrow_base if verify else None,
        vslot=vslot if verify else None,
    )
    hidden, trunk_state = trunk(params, cfg, tokens, io, pool.trunk)
    pool = pool.replace(trunk=trunk_state)
    if drafter:
        pool = _drafter_catch_up(pool, params, cfg, counts, ops, tokens, hidden, positions, slots, draft_tables)
        if not verify:
            pool = pool.replace(stash=pool.stash.at[slots].set(_last_rows(hidden, lens)))
    flat = hidden.reshape(b * t, -1)[row_index]
    logits = head(params, cfg, flat)
    return logits, first_argmax(logits), flat, pool


def gdn_fold_accepted(pool: EnginePool, slots, rows, ks, vrow_base):
    """Select each sequence's accepted GDN state: rows [B] = accepted drafts + 1 (anchor
    included), ks [B]. rows == K keeps the live state (already the last row's); rows < K copies
    verify h row rows - 1 into the live slot. Padding entries use rows == ks."""
    chex.assert_equal_shape([slots, rows, ks, vrow_base])
    h = pool.trunk.gdn_h
    vh = pool.trunk.verify_h
    partial = rows < ks
    src = jnp.where(partial, vrow_base + rows - 1, 0)
    picked = jnp.where(partial[None, :, None, None, None], vh[:, src], h[:, slots])
    return pool.replace(trunk=pool.trunk.replace(gdn_h=h.at[:, slots].set(picked)))


def restore_checkpoint(pool: EnginePool, slots, vslots, mask):
    """Put back the pre-verify live state (h and conv) of the sequences where mask [B] is set:
    the replay rollback's first half, and the undo of a verify whose verdict is abandoned."""
    t = pool.trunk
    h = jnp.where(mask[None, :, None, None, None], pool.ckpt_h[:, vslots], t.gdn_h[:, slots])
    c = jnp.where(mask[None, :, None, None], pool.ckpt_conv[:, vslots], t.gdn_conv[:, slots])
    return pool.replace(trunk=t.replace(gdn_h=t.gdn_h.at[:, slots].set(h), gdn_conv=t.gdn_conv.at[:, slots].set(c)))


def commit_conv(pool: EnginePool, slots, vslots, rows, ks):
    """Roll each sequence's conv window back to the one after its last accepted row (rows < K);
    rows == K keeps the live window. Padding entries use rows == ks."""
    chex.assert_equal_shape([slots, vslots, rows, ks])
    c = pool.trunk.gdn_conv
    vc = pool.trunk.verify_conv
    partial = rows < ks
    picked = jnp.where(partial[None, :, None, None], vc[:, vslots, jnp.maximum(rows - 1, 0)], c[:, slots])
    return pool.replace(trunk=pool.trunk.replace(gdn_conv=c.at[:, slots].set(picked)))


def stash_hidden_rows(pool: EnginePool, hidden, rows, slots):
    """stash[slots[i]] = hidden[rows[i]]: the accepted row's pre-norm hidden, before a propose."""
    return pool.replace(stash=pool.stash.at[slots].set(hidden[rows]))


def propose(
    pool: EnginePool,
    params,
    last,
    seq_lens,
    slots,
    draft_tables,
    valid,
    *,
    cfg: ModelConfig,
    counts: PoolCounts,
    ops,
    num_drafts: int,
):
    """The MTP drafter's batched propose of `num_drafts` chained drafts.

    last [B] (the last sampled token), seq_lens [B] (its position is seq_len; the stash holds the
    hidden of position seq_len - 1), slots [B], draft_tables [B, MBd], valid [B] bool.
    Draft j (0-based) pairs token (last, then draft j-1) with hidden (the stash, then the previous
    step's normed MTP output) at drafter position seq_len - 1 + j, using MTP layer j % n.
    Returns (drafts [B, nd] int32, confidences [B, nd] f32 = log_softmax(logits)[draft], logits of
    the last draft position [B, V] f32, pool).
    """
    chex.assert_shape([last, seq_lens, slots, valid], (last.shape[0],))
    chex.assert_rank(draft_tables, 2)
    hidden = _mtp_hidden(params, cfg, pool.stash[slots])[:, None, :]
    tok = last[:, None]
    state = TrunkState(gdn_h=None, gdn_conv=None, kv_k=pool.draft_k, kv_v=pool.draft_v)
    drafts, confs = [], []
    logits = None
    for j in range(num_drafts):
        pos = jnp.where(valid, seq_lens - 1 + j, -1)[:, None]
        io = _drafter_io(cfg, counts, ops, pos, draft_tables)
        hidden, logits, state = mtp_forward(params, cfg, tok, hidden, io, state, j % cfg.num_mtp_layers)
        logits = logits[:, 0]
        d = first_argmax(logits)
        lsm = jax.nn.log_softmax(logits, axis=-1)
        drafts.append(d)
        confs.append(jnp.take_along_axis(lsm, d[:, None], axis=-1)[:, 0])
        tok = d[:, None]
    pool = pool.replace(draft_k=state.kv_k, draft_v=state.kv_v)
    return jnp.stack(drafts, 1), jnp.stack(confs, 1), logits, pool


def read_sequence_state(pool: EnginePool, slot, blocks, draft_blocks):
    """Swap-out: a pytree of everything a sequence owns (live GDN state and window, its KV
    blocks, its stash row and drafter KV blocks). blocks [MB], draft_blocks [MBd] (null-padded)."""
    t = pool.trunk
    rec = {
        "gdn_h": t.gdn_h[:, slot],
        "gdn_conv": t.gdn_conv[:, slot],
        "kv_k": t.kv_k[:, blocks],
        "kv_v": t.kv_v[:, blocks],
    }
    if pool.stash is not None:
        rec.update(stash=pool.stash[slot], draft_k=pool.draft_k[:, draft_blocks], draft_v=pool.draft_v[:, draft_blocks])
    return rec


def write_sequence_state(pool: EnginePool, rec, slot, blocks, draft_blocks):
    """Swap-in: the inverse of `read_sequence_state` into a (possibly different) slot and blocks.
    Null-padded block entries write the null block, which nothing reads."""
    t = pool.trunk
    t = t.replace(
        gdn_h=t.gdn_h.at[:, slot].set(rec["gdn_h"]),
        gdn_conv=t.gdn_conv.at[:, slot].set(rec["gdn_conv"]),
        kv_k=t.kv_k.at[:, blocks].set(rec["kv_k"]),
        kv_v=t.kv_v.at[:, blocks].set(rec["kv_v"]),
    )
    pool = pool.replace(trunk=t)
    if pool.stash is not None:
        pool = pool.replace(
            stash=pool.stash.at[slot].set(rec["stash"]),
            draft_k=pool.draft_k.at[:, draft_blocks].set(rec["draft_k"]),
            draft_v=pool.draft_v.at[:, draft_blocks].set(rec["draft_v"]),
        )
    return pool
