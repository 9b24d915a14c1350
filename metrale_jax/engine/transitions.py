"""The engine's state transitions: pure functions `(pool, params, input, *, static) -> (outputs, pool)`.

Owns: prefill (one chunk of one sequence), decode / batched verify rows (write-on-accept), the GDN
fold of accepted rows, the conv commit, the hidden stash, the MTP drafter's batched propose, the
fused speculative step (all of a scheduler step in one program: verify, acceptance, stash,
fold, commit, propose), swap-out/swap-in of a sequence's state, and the prefix cache's copies
between a sequence slot and a snapshot slot. The engine (`engine.py`)
compiles each once per shape bucket and donates the pool (the first argument); nothing here syncs
with the host.

Inputs are the typed records of `engine.inputs` (shapes stated there); their addressing arrays
are int32 and traced (never static), so slot indices, lengths and K per sequence change without
recompiling. The static part (config, counts, ops, flags) is a frozen `inputs.*Static`. Padding
rows/sequences address the dummy slot, the null block and the dummy verify rows, and have
position -1.

Token selection: every token a transition picks (prefill's last row, a decode or verify row, a
draft) is its first argmax, or with the static `samples` flag its draw (`_draw`, `engine.sampling`)
at the drawn token's absolute position; with the static `rejection` flag too, a verify's rows
and a propose's drafts follow rejection sampling (`_rejection_rows`, `sampling.draft_draw`; the
drafter's laws kept in the pool's `draft_probs` from the propose to the verify). With the flags
off a program is exactly the greedy (or gumbel) program (no sampling argument, no sampling op).

Drafter invariant (exact MTP context): every trunk transition also runs the MTP layer over the
pairs (hidden of the previous trunk row, this row's token) at position p - 1, writing the
drafter's KV; the hidden of the last processed row waits in `stash[slot]` (pre-final-norm) for the
next propose, which pairs it with the last sampled token. The drafter KV therefore always holds
exactly the committed context, and rows past it (rejected drafts, chained proposals) are
overwritten before they are ever read, as in the trunk's KV.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas.reductions import first_argmax, log_softmax
from metrale_jax.config import ModelConfig
from metrale_jax.engine import inputs, sampling
from metrale_jax.engine.pool import EnginePool
from metrale_jax.model.invariant import products_invariant
from metrale_jax.model.state_io import GdnMode, PoolIO, TrunkState, ordered_read
from metrale_jax.model.trunk import final_norm, head, mtp_forward, trunk


def _positions(starts: jax.Array, lens: jax.Array, t: int) -> jax.Array:
    """[B, T] absolute positions starts + t for t < lens, else -1."""
    r = jnp.arange(t, dtype=jnp.int32)[None, :]
    return jnp.where(r < lens[:, None], starts[:, None] + r, -1)


def _pool_io(
    static: inputs.ModelStatic,
    positions: jax.Array,
    block_tables: jax.Array,
    *,
    drafter: bool = False,
    gdn_mode: GdnMode = "rows",
    slots: jax.Array | None = None,
    lens: jax.Array | None = None,
    fresh: jax.Array | None = None,
) -> PoolIO:
    """The addressing of B sequences' rows at `positions` [B, T] through `block_tables`, with
    `static`'s config and ops: into the trunk's KV and null block (slots, lens [B] int32 and fresh
    as `PoolIO`'s), or with `drafter` into the drafter's KV and null block (the drafter holds no GDN
    state: no slots or lens). No verify rows (a verify adds vrow_base and vslot)."""
    counts = static.counts
    return PoolIO(
        cfg=static.cfg,
        slots=slots,
        lens=lens,
        positions=positions,
        block_tables=block_tables,
        null_block=counts.draft_null_block if drafter else counts.null_block,
        gdn_mode=gdn_mode,
        ops=static.ops,
        fresh=fresh,
    )


def _mtp_hidden(params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """The trunk hidden as the MTP head reads it (after the final norm unless configured not to)."""
    return final_norm(params, cfg, hidden) if cfg.mtp_hidden_postnorm else hidden


def _drafter_catch_up(
    pool: EnginePool,
    params,
    static: inputs.ModelStatic,
    tokens: jax.Array,
    hidden: jax.Array,
    positions: jax.Array,
    slots: jax.Array,
    draft_tables: jax.Array,
) -> EnginePool:
    """Write the drafter KV of pairs (previous row's hidden, this row's token) at position p - 1."""
    assert pool.stash is not None and pool.draft_k is not None and pool.draft_v is not None
    draft_k, draft_v = pool.draft_k, pool.draft_v
    stashed, (stash,) = ordered_read(pool.stash[slots], pool.stash)  # before a decode's stash write
    pool = pool.replace(stash=stash)
    prev = jnp.concatenate([stashed[:, None, :], hidden[:, :-1]], axis=1)
    mtp_pos = jnp.where(positions > 0, positions - 1, -1)
    io = _pool_io(static, mtp_pos, draft_tables, drafter=True)
    state = TrunkState(gdn_h=None, gdn_conv=None, kv_k=draft_k, kv_v=draft_v)
    _, _, state = mtp_forward(params, static.cfg, tokens, _mtp_hidden(params, static.cfg, prev), io, state, 0)
    return pool.replace(draft_k=state.kv_k, draft_v=state.kv_v)


def _live(pool: EnginePool) -> tuple[jax.Array, jax.Array]:
    """The trunk's live GDN (h, conv): always arrays in the engine's pool (None only in the
    drafter's attention-only state)."""
    h, c = pool.trunk.gdn_h, pool.trunk.gdn_conv
    assert h is not None and c is not None
    return h, c


def _draw(logits: jax.Array, rows: sampling.SamplingRows | None, seq: jax.Array, positions: jax.Array) -> jax.Array:
    """The draw of each logits row [R, V] (`sampling.draw`) with sequence seq [R]'s parameters in
    `rows` at positions [R] (of the drawn token). Returns [R] int32. A sampling program's one
    token-selection point; a greedy program selects `first_argmax` and traces none of this."""
    assert rows is not None, "a sampling program takes its SamplingRows"
    return sampling.draw(logits, sampling.take(rows, seq), positions)


def _last_rows(x: jax.Array, lens: jax.Array) -> jax.Array:
    """x [B, T, ...] -> x[b, lens[b] - 1] (row 0 where lens == 0)."""
    idx = jnp.maximum(lens - 1, 0)
    return jnp.take_along_axis(x, idx.reshape(-1, 1, *([1] * (x.ndim - 2))), axis=1)[:, 0]


def prefill_chunk(
    pool: EnginePool,
    params,
    chunk: inputs.PrefillChunk,
    rows: sampling.SamplingRows | None = None,
    *,
    static: inputs.PrefillStatic,
) -> tuple[jax.Array, EnginePool] | tuple[jax.Array, jax.Array, EnginePool]:
    """One prefill chunk of one sequence (`PrefillChunk`; draft_table ignored without drafter).

    Donated: pool. A chunk at start 0 begins from a zero GDN state and conv window; after it the
    slot holds the state after the chunk's last valid row and its KV rows are written (with
    drafter, also the drafter KV of the chunk and the stash). Returns (logits of the last valid
    row [1, V] f32, pool); with `static.samples` (logits, the draw [1] int32 of the token at
    start + length with `rows` [1], pool).
    """
    cfg, counts = static.cfg, static.counts
    tokens, start, length, slot = chunk.tokens, chunk.start, chunk.length, chunk.slot
    chex.assert_shape(tokens, (1, None))
    chex.assert_shape([start, length, slot], (1,))
    chex.assert_shape(chunk.block_table, (1, counts.max_blocks_per_seq))
    positions = _positions(start, length, tokens.shape[1])
    io = _pool_io(static, positions, chunk.block_table, gdn_mode="chunk", slots=slot, lens=length, fresh=start == 0)
    hidden, trunk_state = trunk(params, cfg, tokens, io, pool.trunk)
    pool = pool.replace(trunk=trunk_state)
    last_hidden = _last_rows(hidden, length)
    if static.drafter:
        pool = _drafter_catch_up(pool, params, static, tokens, hidden, positions, slot, chunk.draft_table)
        assert pool.stash is not None
        pool = pool.replace(stash=pool.stash.at[slot].set(last_hidden))
    logits = head(params, cfg, last_hidden)
    if not static.samples:
        return logits, pool
    return logits, _draw(logits, rows, jnp.zeros((1,), jnp.int32), start + length), pool


def step_rows(
    pool: EnginePool,
    params,
    batch: inputs.StepBatch,
    rows: sampling.SamplingRows | None = None,
    *,
    static: inputs.StepStatic,
) -> tuple[jax.Array, jax.Array, jax.Array, EnginePool]:
    """Decode (T = 1) or batched verify (T = K_max) rows of B sequences (`StepBatch`).

    Donated: pool. With verify, every GDN layer copies each sequence's pre-verify live state (h and
    conv) into its checkpoint slot (vslot) where checkpoint pools exist (replay rollback) and
    (write-on-accept, snapshot rollback) writes the state after rows 0..K_i-2 into the slot's
    verify h rows and the window after every row into its verify conv rows; the live slot holds
    the state after row K_i - 1. Without verify (decode), the stash takes the row's hidden.
    Returns (logits [R_b, V] f32, tokens [R_b] int32, hidden [R_b, Hd] pre-norm, pool), R_b = B * T:
    a row's token is its argmax, or with `static.samples` its draw of the token at its position
    + 1 with its sequence's parameters in `rows` [B].
    """
    cfg, counts, verify = static.cfg, static.counts, static.verify
    tokens, lens, seq_lens, slots = batch.tokens, batch.lens, batch.seq_lens, batch.slots
    vrow_base, vslot, row_index = batch.vrow_base, batch.vslot, batch.row_index
    b, t = tokens.shape
    chex.assert_shape([lens, seq_lens, slots, vrow_base, vslot], (b,))
    chex.assert_shape(batch.block_tables, (b, counts.max_blocks_per_seq))
    chex.assert_shape(row_index, (b * t,))
    chex.assert_type([tokens, lens, seq_lens, slots, row_index], jnp.int32)
    positions = _positions(seq_lens, lens, t)
    io = _pool_io(static, positions, batch.block_tables, slots=slots, lens=lens)
    if verify:  # write-on-accept: the GDN layers also write the sequences' verify rows
        io = dataclasses.replace(io, vrow_base=vrow_base, vslot=vslot)
    hidden, trunk_state = trunk(params, cfg, tokens, io, pool.trunk)
    pool = pool.replace(trunk=trunk_state)
    if static.drafter:
        pool = _drafter_catch_up(pool, params, static, tokens, hidden, positions, slots, batch.draft_tables)
        if not verify:
            assert pool.stash is not None
            pool = pool.replace(stash=pool.stash.at[slots].set(_last_rows(hidden, lens)))
    flat = hidden.reshape(b * t, -1)[row_index]
    logits = head(params, cfg, flat)
    if static.samples and static.rejection and verify:
        return logits, _rejection_rows(pool, logits, batch, rows, t), flat, pool
    if static.samples:
        return logits, _draw(logits, rows, row_index // t, positions.reshape(-1)[row_index] + 1), flat, pool
    return logits, first_argmax(logits), flat, pool


def _rejection_rows(
    pool: EnginePool, logits: jax.Array, batch: inputs.StepBatch, rows: sampling.SamplingRows | None, t: int
) -> jax.Array:
    """A verify's row tokens under rejection sampling (`sampling.rejection_rows`, flat as the
    logits [R_b, V]): the target's laws from the logits with `rows` [B], the drafter's laws of
    the sequences' pending drafts from the pool's `draft_probs` (written by their propose)."""
    assert rows is not None and pool.draft_probs is not None, "a rejection verify needs its rows and drafter laws"
    p = sampling.probabilities(logits, sampling.take(rows, batch.row_index // t))
    q = pool.draft_probs[batch.slots]
    chex.assert_shape(q, (batch.slots.shape[0], t - 1, logits.shape[-1]))
    grid = sampling.rejection_rows(_grid(p, batch.lens, t), q, batch.tokens, batch.lens, rows.seed, batch.seq_lens + 1)
    return grid.reshape(-1)[batch.row_index]


def _per_layer_select(live: jax.Array, other: jax.Array, slots: jax.Array, mask: jax.Array, index) -> jax.Array:
    """live [L, S, ...] with slot slots[i] of every layer set to other[l, *index][i] where mask [B]
    holds, and kept elsewhere.

    NOTE: one layer at a time (a loop over L): selecting every layer at once holds an
    [L, B, ...] buffer (one GDN state per sequence and layer) to the program's end.
    """

    def layer(li, live):
        src = other[(li, *index)]
        keep = mask.reshape(mask.shape + (1,) * (src.ndim - 1))
        return live.at[li, slots].set(jnp.where(keep, src, live[li, slots]))

    return jax.lax.fori_loop(0, live.shape[0], layer, live)


def _take_accepted(
    live: jax.Array, verify: jax.Array | None, slots: jax.Array, mask: jax.Array, index: tuple[jax.Array, ...]
) -> jax.Array:
    """live [L, S, ...] with slot slots[i] set to verify[:, *index][:, i] where mask [B] (the
    sequences that accepted fewer rows than they verified) holds, and kept elsewhere.
    verify: the verify pool the accepted rows are read from (an array whenever a verify ran)."""
    assert verify is not None, "a verify's accepted state needs its verify pool"
    return _per_layer_select(live, verify, slots, mask, index)


def gdn_fold_accepted(pool: EnginePool, verdicts: inputs.VerdictBatch) -> EnginePool:
    """Select each sequence's accepted GDN state (reads slots, rows, ks, vrow_base of `verdicts`).

    Donated: pool. rows == K keeps the live state (already the last row's); rows < K copies verify
    h row vrow_base + rows - 1 into the live slot. Padding entries have rows == ks.
    """
    slots, rows, ks, vrow_base = verdicts.slots, verdicts.rows, verdicts.ks, verdicts.vrow_base
    chex.assert_equal_shape([slots, rows, ks, vrow_base])
    h, _ = _live(pool)
    partial = rows < ks
    src = jnp.where(partial, vrow_base + rows - 1, 0)
    h = _take_accepted(h, pool.trunk.verify_h, slots, partial, (src,))
    return pool.replace(trunk=pool.trunk.replace(gdn_h=h))


def restore_checkpoint(pool: EnginePool, verdicts: inputs.VerdictBatch) -> EnginePool:
    """Put back the pre-verify live state (h and conv) of the sequences where `verdicts.restore`
    is set (reads slots, vslots, restore): the replay rollback's first half, and the undo of a
    verify whose verdict is abandoned. Donated: pool."""
    slots, vslots, mask = verdicts.slots, verdicts.vslots, verdicts.restore
    ckpt_h, ckpt_conv = pool.trunk.ckpt_h, pool.trunk.ckpt_conv
    assert ckpt_h is not None and ckpt_conv is not None
    live_h, live_c = _live(pool)
    h = _per_layer_select(live_h, ckpt_h, slots, mask, (vslots,))
    c = _per_layer_select(live_c, ckpt_conv, slots, mask, (vslots,))
    return pool.replace(trunk=pool.trunk.replace(gdn_h=h, gdn_conv=c))


def commit_conv(pool: EnginePool, verdicts: inputs.VerdictBatch) -> EnginePool:
    """Roll each sequence's conv window back to the one after its last accepted row (rows < K;
    reads slots, vslots, rows, ks of `verdicts`); rows == K keeps the live window. Padding
    entries have rows == ks. Donated: pool."""
    slots, vslots, rows, ks = verdicts.slots, verdicts.vslots, verdicts.rows, verdicts.ks
    chex.assert_equal_shape([slots, vslots, rows, ks])
    _, c = _live(pool)
    partial = rows < ks
    c = _take_accepted(c, pool.trunk.verify_conv, slots, partial, (vslots, jnp.maximum(rows - 1, 0)))
    return pool.replace(trunk=pool.trunk.replace(gdn_conv=c))


def stash_hidden_rows(pool: EnginePool, hidden: jax.Array, stash: inputs.StashBatch) -> EnginePool:
    """stash[slots[i]] = hidden[rows[i]]: the accepted row's pre-norm hidden, before a propose.
    hidden [R_b, Hd]: a verify's hidden output. Donated: pool."""
    assert pool.stash is not None
    return pool.replace(stash=pool.stash.at[stash.slots].set(hidden[stash.rows]))


def propose(
    pool: EnginePool,
    params,
    batch: inputs.ProposeBatch,
    rows: sampling.SamplingRows | None = None,
    *,
    static: inputs.ProposeStatic,
) -> tuple[jax.Array, jax.Array, jax.Array, EnginePool]:
    """The MTP drafter's batched propose of `static.num_drafts` chained drafts (`ProposeBatch`).

    Donated: pool. The stash holds the hidden of position seq_len - 1. Draft j (0-based) pairs
    token (last, then draft j-1) with hidden (the stash, then the previous step's normed MTP
    output) at drafter position seq_len - 1 + j, using MTP layer j % n; only the drafter KV
    changes. Returns (drafts [B, nd] int32, confidences [B, nd] f32 = log_softmax(logits)[draft],
    each draft position's logits [B, nd, V] f32, pool). A draft is the drafter's argmax, or with
    `static.samples` its draw with the target's noise: `sampling.draw` of the drafter's logits
    with `rows` [B] at the drafted token's position, seq_len + 1 + j (the coupled drafter); with
    `static.rejection` too, its draw with its own keys (`sampling.draft_draw`), whose law q goes
    to `draft_probs[slot, j]` for the verify, and whose confidence is max log_softmax(logits) (the
    drafter's top token's, whatever it drew: a confidence stop then cuts independently of the drawn
    token, which keeps the law; at temperature 0 the same value as the argmax draft's).
    """
    cfg = static.cfg
    last, seq_lens, slots, valid = batch.last, batch.seq_lens, batch.slots, batch.valid
    chex.assert_shape([last, seq_lens, slots, valid], (last.shape[0],))
    chex.assert_rank(batch.draft_tables, 2)
    assert pool.stash is not None and pool.draft_k is not None and pool.draft_v is not None
    hidden = _mtp_hidden(params, cfg, pool.stash[slots])[:, None, :]
    tok = last[:, None]
    state = TrunkState(gdn_h=None, gdn_conv=None, kv_k=pool.draft_k, kv_v=pool.draft_v)
    drafts, confs, laws, every = [], [], [], []
    for j in range(static.num_drafts):
        pos = jnp.where(valid, seq_lens - 1 + j, -1)[:, None]
        io = _pool_io(static, pos, batch.draft_tables, drafter=True)
        hidden, logits, state = mtp_forward(params, cfg, tok, hidden, io, state, j % cfg.num_mtp_layers)
        logits = logits[:, 0]
        every.append(logits)
        if static.samples and static.rejection:
            assert rows is not None, "a sampling program takes its SamplingRows"
            d, q = sampling.draft_draw(logits, rows, seq_lens + 1 + j)
            laws.append(q)
        elif static.samples:
            d = _draw(logits, rows, jnp.arange(last.shape[0]), seq_lens + 1 + j)
        else:
            d = first_argmax(logits)
        lsm = log_softmax(logits, products_invariant())
        drafts.append(d)
        # NOTE: under rejection the confidence is the drafter's top log-probability, a function of
        # its logits only: a stop that read the drafted token's own probability would drop drafts
        # by their identity and bias the emitted law (a dropped draft's position draws from p).
        conf = jnp.max(lsm, axis=-1) if static.rejection else jnp.take_along_axis(lsm, d[:, None], axis=-1)[:, 0]
        confs.append(conf)
        tok = d[:, None]
    pool = pool.replace(draft_k=state.kv_k, draft_v=state.kv_v)
    if laws:
        assert pool.draft_probs is not None, "rejection sampling keeps its drafter laws in the pool"
        pool = pool.replace(draft_probs=pool.draft_probs.at[slots, : len(laws)].set(jnp.stack(laws, 1)))
    return jnp.stack(drafts, 1), jnp.stack(confs, 1), jnp.stack(every, 1), pool


def _grid(flat: jax.Array, lens: jax.Array, t: int) -> jax.Array:
    """A verify's flat rows [R_b, ...] (compacted seq-major, as `StepBatch.row_index` gathers them)
    as a grid [B, T, ...]: row t of sequence b is flat[lens[:b].sum() + t]; rows t >= lens[b] are
    junk (another sequence's row or the last one)."""
    off = jnp.cumsum(lens) - lens
    idx = jnp.minimum(off[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :], flat.shape[0] - 1)
    return flat[idx]


def greedy_accepts(tokens: jax.Array, argmax: jax.Array, lens: jax.Array) -> jax.Array:
    """Greedy acceptance on the device: per sequence, how many leading drafts tokens[b, 1:lens[b]]
    equal the argmax of the row before them. tokens, argmax [B, T] int32 (rows [last, drafts..]
    and their argmaxes), lens [B]. Returns [B] int32 in 0..max(lens - 1, 0)."""
    t = tokens.shape[1]
    agree = (argmax[:, :-1] == tokens[:, 1:]) & (jnp.arange(1, t, dtype=jnp.int32)[None, :] < lens[:, None])
    return jnp.sum(jnp.cumprod(agree.astype(jnp.int32), axis=1), axis=1, dtype=jnp.int32)


def speculative_step(
    pool: EnginePool,
    params,
    batch: inputs.StepBatch,
    rows: sampling.SamplingRows | None = None,
    *,
    static: inputs.SpeculativeStatic,
) -> tuple[jax.Array, tuple[jax.Array, ...], EnginePool]:
    """One scheduler step of B sequences in one program (snapshot rollback): the write-on-accept
    verify of `batch` (a verify's `StepBatch`, row_index the seq-major compaction the engine
    builds), greedy acceptance, then the verdict (the accepted row's hidden stashed with the
    drafter, the GDN fold, the conv commit) and, with `static.num_drafts` = nd > 0, the next
    propose from the committed context (last = the argmax of the accepted row, at position
    seq_len + na + 1). The transitions are the composed path's own functions on the same values
    (padding sequences get the padded inputs of each), so the pool and every output are those of
    `step_rows`, `stash_hidden_rows`, `gdn_fold_accepted`, `commit_conv` and `propose` run one
    after the other.

    Donated: pool. Returns (packed, extras, pool): packed [B, 1 + T + 2 nd] int32, per sequence
    [na, the T row argmaxes (the emitted tokens are the first na + 1), nd drafts, nd confidences
    (f32 bits)], the one array the host fetches; extras = (verify logits [R_b, V] f32, then the
    propose's logits [B, nd, V] f32 when nd > 0) with `static.logits`, else ().
    With `static.samples` (gumbel speculative sampling) the row tokens are the verify's draws and
    the drafts the coupled drafter's, with `rows` [B]: acceptance is the same rule on the draws.
    With `static.rejection` too the row tokens are rejection sampling's (`sampling.rejection_rows`,
    laid out so that the same rule finds its accepted count) and the propose keeps its laws.
    """
    logits, argmax, hidden, pool = step_rows(pool, params, batch, rows, static=static.step)
    b, t = batch.tokens.shape
    lens, valid = batch.lens, batch.lens > 0
    grid = _grid(argmax, lens, t)
    na = greedy_accepts(batch.tokens, grid, lens)
    # NOTE: a barrier between the phases keeps XLA from fusing one program's ops into another's,
    # which could round differently from the composed programs.
    pool, hidden, grid, na = lax.optimization_barrier((pool, hidden, grid, na))
    if static.drafter:
        off = jnp.cumsum(lens) - lens
        pool = stash_hidden_rows(pool, hidden, inputs.StashBatch(rows=jnp.where(valid, off + na, 0), slots=batch.slots))
    verdicts = inputs.VerdictBatch(
        slots=batch.slots,
        vslots=batch.vslot,
        rows=jnp.where(valid, na + 1, 1),
        ks=jnp.where(valid, lens, 1),
        vrow_base=batch.vrow_base,
        restore=jnp.zeros((b,), bool),
    )
    pool = commit_conv(gdn_fold_accepted(pool, verdicts), verdicts)
    parts, extras = [na[:, None], grid], [logits]
    if static.num_drafts:
        pool, grid, na = lax.optimization_barrier((pool, grid, na))
        nxt = inputs.ProposeBatch(
            last=jnp.where(valid, jnp.take_along_axis(grid, na[:, None], axis=1)[:, 0], 0),
            seq_lens=jnp.where(valid, batch.seq_lens + na + 1, 1),
            slots=batch.slots,
            draft_tables=batch.draft_tables,
            valid=valid,
        )
        drafts, confs, draft_logits, pool = propose(pool, params, nxt, rows, static=static.propose)
        parts += [drafts, lax.bitcast_convert_type(confs, jnp.int32)]
        extras.append(draft_logits)
    return jnp.concatenate(parts, axis=1), tuple(extras) if static.logits else (), pool


def read_sequence_state(pool: EnginePool, at: inputs.SequenceAddress) -> tuple[inputs.SwapArrays, EnginePool]:
    """Swap-out: everything the sequence at `at` owns (`SwapArrays`: live GDN state and window,
    its KV blocks, with a drafter its stash row and drafter KV blocks, with rejection sampling its
    pending drafts' laws). Donated: pool (returned
    unchanged)."""
    h, c = _live(pool)
    t = pool.trunk
    arrays = inputs.SwapArrays(
        gdn_h=h[:, at.slot], gdn_conv=c[:, at.slot], kv_k=t.kv_k[:, at.blocks], kv_v=t.kv_v[:, at.blocks]
    )
    if pool.stash is not None:
        assert pool.draft_k is not None and pool.draft_v is not None
        arrays = arrays.replace(
            stash=pool.stash[at.slot],
            draft_k=pool.draft_k[:, at.draft_blocks],
            draft_v=pool.draft_v[:, at.draft_blocks],
        )
    if pool.draft_probs is not None:
        arrays = arrays.replace(draft_probs=pool.draft_probs[at.slot])
    return arrays, pool


def write_sequence_state(pool: EnginePool, arrays: inputs.SwapArrays, at: inputs.SequenceAddress) -> EnginePool:
    """Swap-in: the inverse of `read_sequence_state` into a (possibly different) slot and blocks.
    Null-padded block entries write the null block, which nothing reads. Donated: pool."""
    h, c = _live(pool)
    t = pool.trunk
    t = t.replace(
        gdn_h=h.at[:, at.slot].set(arrays.gdn_h),
        gdn_conv=c.at[:, at.slot].set(arrays.gdn_conv),
        kv_k=t.kv_k.at[:, at.blocks].set(arrays.kv_k),
        kv_v=t.kv_v.at[:, at.blocks].set(arrays.kv_v),
    )
    pool = pool.replace(trunk=t)
    if pool.stash is not None:
        assert pool.draft_k is not None and pool.draft_v is not None
        pool = pool.replace(
            stash=pool.stash.at[at.slot].set(arrays.stash),
            draft_k=pool.draft_k.at[:, at.draft_blocks].set(arrays.draft_k),
            draft_v=pool.draft_v.at[:, at.draft_blocks].set(arrays.draft_v),
        )
    if pool.draft_probs is not None:
        pool = pool.replace(draft_probs=pool.draft_probs.at[at.slot].set(arrays.draft_probs))
    return pool


def take_snapshot(pool: EnginePool, x: inputs.SnapshotCopy) -> EnginePool:
    """Prefix-cache snapshot: snapshot slot x.snap takes sequence slot x.slot's live GDN h and conv
    window (every recurrent layer) and, with a drafter, its stash row and drafter block
    x.draft_block. Called only at the end of a prefill program (committed state, never a verify's
    rows). An out-of-range x.snap (padding) copies nothing. Donated: pool."""
    assert pool.snap_h is not None and pool.snap_conv is not None
    h, c = _live(pool)
    pool = pool.replace(
        snap_h=pool.snap_h.at[:, x.snap].set(h[:, x.slot], mode="drop"),
        snap_conv=pool.snap_conv.at[:, x.snap].set(c[:, x.slot], mode="drop"),
    )
    if pool.snap_stash is not None:
        assert pool.stash is not None and pool.draft_k is not None and pool.draft_v is not None
        assert pool.snap_draft_k is not None and pool.snap_draft_v is not None
        pool = pool.replace(
            snap_stash=pool.snap_stash.at[x.snap].set(pool.stash[x.slot], mode="drop"),
            snap_draft_k=pool.snap_draft_k.at[:, x.snap].set(pool.draft_k[:, x.draft_block], mode="drop"),
            snap_draft_v=pool.snap_draft_v.at[:, x.snap].set(pool.draft_v[:, x.draft_block], mode="drop"),
        )
    return pool


def restore_snapshot(pool: EnginePool, x: inputs.SnapshotCopy) -> EnginePool:
    """The inverse of `take_snapshot`: sequence slot x.slot's live GDN h and conv (and stash row
    and drafter block x.draft_block, the sequence's own) become snapshot slot x.snap's. The
    sequence's other state (shared KV blocks, the drafter's full blocks) is mapped by the host.
    Donated: pool."""
    assert pool.snap_h is not None and pool.snap_conv is not None
    h, c = _live(pool)
    t = pool.trunk.replace(gdn_h=h.at[:, x.slot].set(pool.snap_h[:, x.snap]))
    pool = pool.replace(trunk=t.replace(gdn_conv=c.at[:, x.slot].set(pool.snap_conv[:, x.snap])))
    if pool.snap_stash is not None:
        assert pool.stash is not None and pool.draft_k is not None and pool.draft_v is not None
        assert pool.snap_draft_k is not None and pool.snap_draft_v is not None
        pool = pool.replace(
            stash=pool.stash.at[x.slot].set(pool.snap_stash[x.snap]),
            draft_k=pool.draft_k.at[:, x.draft_block].set(pool.snap_draft_k[:, x.snap]),
            draft_v=pool.draft_v.at[:, x.draft_block].set(pool.snap_draft_v[:, x.snap]),
        )
    return pool
