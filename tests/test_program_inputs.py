"""Typed program inputs (`metrale_jax.engine.inputs`): one constructor per input kind, shared by the
engine and the memory planner, and the widths they are built at (`capacity`).

The engine's calls are captured on a real tiny speculative serve and compared, leaf by leaf, with
the abstract calls the planner compiles: any drift between what the engine runs and what the
planner analyses (a field, a width, a dtype, a static flag) fails here.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import settings

from metrale_jax.engine import transitions as tr
from metrale_jax.engine.capacity import MIN_PREFILL_BUCKET, bucket_width, draft_table_width
from metrale_jax.engine.engine import Engine
from metrale_jax.engine.inputs import (
    PrefillChunk,
    ProposeBatch,
    StashBatch,
    StepBatch,
    StepStatic,
    SwapArrays,
    SwapRecord,
    VerdictBatch,
    abstract,
)
from metrale_jax.engine.pool import allocate_pool
from metrale_jax.engine.programs import HostPacking
from metrale_jax.memory.activations import ActivationModel

N = 4  # sequences: a DECODE_BATCH_LADDER rung, so the full-width calls are the planner's widths


def _signature(args) -> tuple:
    leaves, tree = jax.tree_util.tree_flatten(args)
    return tree, [(tuple(x.shape), jnp.dtype(x.dtype)) for x in leaves]


@pytest.fixture(scope="module")
def served(tiny):
    """A tiny speculative engine after a full-width prefill, decode, verify (rolled back, then
    verified again and committed), propose and fused speculative step, with every program call it
    made (first per (program, static part))."""
    cfg, params = tiny
    s = settings(max_batch_size=N, max_seq_len=128, max_prefill_tokens=32, speculative=True, num_drafts=3)
    eng = Engine(cfg, params, s)
    calls = {}  # (program, static part) -> its first call's arguments
    run = eng.programs.run

    def capture(name, fn, static, *args):
        calls.setdefault((name, static), args)
        return run(name, fn, static, *args)

    eng.programs.run = capture
    seqs = [eng.alloc_sequence() for _ in range(N)]
    rng = np.random.default_rng(0)
    for q in seqs:
        eng.prefill(q, rng.integers(0, cfg.vocab_size, eng.counts.prefill_chunk).tolist())
    eng.decode_batch(seqs, [1] * N)
    eng.verify_batched(seqs, [2, 3] * N, [2] * N)
    eng.rollback_verify(seqs)
    eng.verify_batched(seqs, [2, 3] * N, [2] * N)
    eng.accept(seqs, [0] * N)  # fold, commit and stash
    eng.propose_batched(seqs, [3] * N, s.num_drafts)
    for q in seqs:
        eng.trim_proposer(q)
    eng.speculative_step(seqs, [2, 3] * N, [2] * N, s.num_drafts)
    record = eng.save_sequence_state(seqs[0])
    eng.programs.run = run
    return eng, calls, record


def test_engine_and_planner_build_the_same_abstract_inputs(served):
    """Every program the planner analyses is called by the engine with the same static part and
    arguments of the same tree structure, shapes and dtypes (pool and params included)."""
    eng, calls, _ = served
    planner = ActivationModel(eng.cfg, eng.dtype).programs_at(eng.settings, eng.counts)
    assert [p.name for p in planner] == ["prefill", "decode", "verify", "propose", "speculative"]
    for p in planner:
        assert (p.transition, p.static) in calls, p.name
        engine_args = calls[p.transition, p.static]
        assert _signature(engine_args) == _signature(p.args), p.name
    verify = next(p for p in planner if p.name == "verify")
    assert isinstance(verify.static, StepStatic) and verify.static.verify
    assert isinstance(verify.args[2], StepBatch)


def test_the_verdict_programs_take_their_constructors_inputs(served):
    """fold, commit, restore and stash get exactly their constructor's record at the width bucket."""
    eng, calls, _ = served
    w = bucket_width(N)
    want = {
        "gdn_fold": VerdictBatch.padded(eng.counts, w),
        "commit_conv": VerdictBatch.padded(eng.counts, w),
        "restore_ckpt": VerdictBatch.padded(eng.counts, w),
        "stash_rows": StashBatch.padded(eng.counts, w),
    }
    for name, x in want.items():
        (args,) = [a for (n, static), a in calls.items() if n == name]
        assert _signature(args[-1]) == _signature(x), name
        assert _signature(args[0]) == _signature(eng.pool), name


def test_the_swap_record_is_typed(served):
    """save_sequence_state returns a `SwapRecord` whose device part is numpy, shaped per `SwapArrays`."""
    eng, _, record = served
    cfg, counts = eng.cfg, eng.counts
    assert isinstance(record, SwapRecord) and isinstance(record.device, SwapArrays)
    assert all(isinstance(x, np.ndarray) for x in jax.tree_util.tree_leaves(record.device))
    dev = record.device
    chex.assert_shape(
        dev.gdn_h,
        (cfg.num_linear_layers, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
    )
    chex.assert_shape(dev.gdn_conv, (cfg.num_linear_layers, cfg.conv_dim, cfg.linear_conv_kernel_dim))
    kv = (cfg.num_key_value_heads, cfg.head_dim)
    chex.assert_shape([dev.kv_k, dev.kv_v], (cfg.num_full_layers, counts.max_blocks_per_seq, counts.block_size, *kv))
    mbd = draft_table_width(eng.settings.max_seq_len)
    chex.assert_shape([dev.draft_k, dev.draft_v], (cfg.num_mtp_layers, mbd, counts.draft_block_size, *kv))
    chex.assert_shape(dev.stash, (cfg.hidden_size,))
    assert record.seq_len == len(record.tokens) and record.blocks >= math.ceil(record.seq_len / counts.block_size)


@pytest.mark.parametrize("max_seq_len", [1, 15, 16, 17, 128, 32768])
def test_draft_table_width_holds_every_drafter_block(max_seq_len):
    """The drafter table has an entry for every drafter block a sequence may reserve."""
    w = draft_table_width(max_seq_len)
    assert w >= math.ceil(max_seq_len / 16) and w == max_seq_len // 16 + 2


def test_the_engine_builds_its_drafter_tables_at_that_width(served):
    """Every drafter table the engine passes (prefill, decode / verify, propose) has that width."""
    eng, calls, _ = served
    assert eng.draft_width == draft_table_width(eng.settings.max_seq_len)
    for (name, _), args in calls.items():
        tables = {"prefill_chunk": "draft_table", "step_rows": "draft_tables", "propose": "draft_tables"}
        if name in tables:
            assert getattr(args[2], tables[name]).shape[1] == eng.draft_width, name


def test_prefill_bucket_is_a_power_of_two_between_the_floor_and_the_chunk(served):
    eng, calls, _ = served
    counts = dataclasses.replace(eng.counts, prefill_chunk=100)
    got = {n: counts.prefill_bucket(n) for n in (1, 15, 16, 17, 33, 64, 65, 100)}
    assert got == {1: 16, 15: 16, 16: 16, 17: 32, 33: 64, 64: 64, 65: 100, 100: 100}
    assert MIN_PREFILL_BUCKET == 16
    # the engine pads a full chunk to the planner's bucket
    (args,) = [a for (n, _), a in calls.items() if n == "prefill_chunk"]
    assert args[2].tokens.shape == (1, eng.counts.prefill_bucket(eng.counts.prefill_chunk))


def test_constructors_state_shapes_and_padding(served):
    """Each constructor's shapes and dtypes, and its padding addresses: the dummy slot, the null
    blocks, the verify dummy, no rows."""
    eng, _, _ = served
    c, mbd, b, t = eng.counts, eng.draft_width, 4, 3
    x = StepBatch.padded(c, mbd, b, t, verify=True)
    chex.assert_shape(x.tokens, (b, t))
    chex.assert_shape([x.lens, x.seq_lens, x.slots, x.vrow_base, x.vslot], (b,))
    chex.assert_shape(x.block_tables, (b, c.max_blocks_per_seq))
    chex.assert_shape(x.draft_tables, (b, mbd))
    chex.assert_shape(x.row_index, (b * t,))
    chex.assert_type(jax.tree_util.tree_leaves(x), jnp.int32)
    assert (x.slots == c.slots - 1).all() and (x.lens == 0).all() and (x.block_tables == c.kv_blocks - 1).all()
    assert (x.draft_tables == c.draft_kv_blocks - 1).all()
    assert (x.vslot == c.verify_slots - 1).all() and (x.vrow_base == c.h_step_offsets[-2]).all()
    d = StepBatch.padded(c, mbd, b, 1, verify=False)
    assert (d.vslot == 0).all() and (d.vrow_base == 0).all()
    p = PrefillChunk.padded(c, mbd, 32)
    chex.assert_shape(p.tokens, (1, 32))
    chex.assert_shape([p.start, p.length, p.slot], (1,))
    chex.assert_shape([p.block_table, p.draft_table], [(1, c.max_blocks_per_seq), (1, mbd)])
    q = ProposeBatch.padded(c, mbd, b)
    chex.assert_shape([q.last, q.seq_lens, q.slots, q.valid], (b,))
    chex.assert_type([q.last, q.seq_lens, q.slots, q.draft_tables, q.valid], [jnp.int32] * 4 + [jnp.bool_])
    assert not q.valid.any() and (q.seq_lens == 1).all()
    v = VerdictBatch.padded(c, b)
    assert (v.rows == v.ks).all(), "a padding verdict keeps the live state"
    assert v.restore.dtype == np.bool_ and not v.restore.any()
    assert (v.vslots == c.verify_slots - 1).all()


def test_the_transition_refuses_a_batch_of_the_wrong_shape(served):
    """The constructor's batch traces through `step_rows`; a block table of another width is
    refused at the boundary (chex), before anything is computed."""
    eng, _, _ = served
    static = StepStatic(eng.cfg, eng.counts, eng.ops, verify=True, drafter=True)
    pool = jax.eval_shape(lambda: allocate_pool(eng.cfg, eng.counts, eng.settings, dtype=eng.dtype))
    params = abstract(eng.params)
    step = functools.partial(tr.step_rows, static=static)
    batch = StepBatch.padded(eng.counts, eng.draft_width, N, eng.counts.k, verify=True)
    logits, *_ = jax.eval_shape(step, pool, params, abstract(batch))
    assert logits.shape == (N * eng.counts.k, eng.cfg.vocab_size)
    narrow = batch.replace(block_tables=batch.block_tables[:, :-1])
    with pytest.raises(AssertionError):
        jax.eval_shape(step, pool, params, abstract(narrow))


def test_host_inputs_travel_as_one_int32_vector(served):
    """`HostPacking` moves every host input of a call as one int32 vector and rebuilds each leaf
    inside the trace: same tree, shapes, dtypes and values (the bool fields included); the other
    arguments pass as they are, and the program is lowered on the vector's shape struct."""
    eng, _, _ = served
    c, mbd = eng.counts, eng.draft_width
    step = StepBatch.padded(c, mbd, 2, 3, verify=True)
    step.tokens[:] = [[1, 2, 3], [4, 5, 6]]
    propose = ProposeBatch.padded(c, mbd, 2)
    propose.valid[1] = True
    verdict = VerdictBatch.padded(c, 2)
    verdict.restore[0] = True
    device = jnp.arange(3.0)
    args = (device, step, 7, propose, verdict)
    packing = HostPacking.of(args)
    packed = packing.pack(args)
    assert packing.positions == (1, 3, 4)
    assert packed[:2] == (device, 7) and len(packed) == 3
    assert packed[2].dtype == np.int32 and packed[2].shape == (packing.size,)
    assert packing.size == sum(x.size for a in (step, propose, verdict) for x in jax.tree_util.tree_leaves(a))
    unpacked = packing.unpack(packed)
    assert unpacked[0] is device and unpacked[2] == 7
    traced = jax.jit(lambda d, v: [packing.unpack((d, 7, v))[i] for i in packing.positions])(device, packed[2])
    for got in ([unpacked[i] for i in packing.positions], traced):
        for g, want in zip(got, (step, propose, verdict)):
            chex.assert_trees_all_equal(jax.tree_util.tree_map(np.asarray, g), want, strict=True)
    lowered_on = packing.lowering_args((device, abstract(step), 7, abstract(propose), abstract(verdict)))
    assert lowered_on == (device, 7, jax.ShapeDtypeStruct((packing.size,), np.int32))
