"""The engine core: write-on-accept verify, fold, commit, drafter, isolation, errors, recompiles,
and the fused speculative step (one program, one transfer) against the composed one.

Bytewise claims compare runs of identical program shapes (XLA CPU dots are not batch-invariant,
so a [B, 4] verify grid and a [B, 1] decode differ in the last ulp); claims across shapes use
float32 tolerances. Every generation oracle runs on both step paths (`fused`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import settings
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from metrale_jax.engine.engine import Engine
from metrale_jax.engine.programs import ProgramCache
from metrale_jax.engine.sequences import EngineError
from metrale_jax.engine.speculative import DraftSchedule, greedy_generate, speculative_generate
from metrale_jax.model.cache import prefill_and_decode

K = 4
PROMPT = [int(x) for x in np.random.default_rng(7).integers(0, 256, size=21)]


@pytest.fixture(scope="module")
def eng(tiny):
    cfg, params = tiny
    return Engine(cfg, params, settings(max_batch_size=12, max_seq_len=256, speculative=True, num_drafts=3))


@pytest.fixture(scope="module")
def greedy_ref(tiny):
    cfg, params = tiny
    _, fed = prefill_and_decode(params, cfg, PROMPT, 12)
    return fed


def _free_all(eng, seqs):
    for s in reversed(seqs):
        eng.free_sequence(s)


def _slot_state(eng, slot):
    t = eng.pool.trunk
    return np.asarray(t.gdn_h[:, slot]), np.asarray(t.gdn_conv[:, slot])


def _step(eng, seqs, rows, na):
    """Verify `rows` (one list per sequence), then its verdict with `na` (`Engine.accept`)."""
    logits, am = eng.verify_batched(seqs, [t for r in rows for t in r], [len(r) for r in rows])
    eng.accept(seqs, na)
    return logits, am


@hsettings(max_examples=5, deadline=None)
@given(a=st.integers(0, K - 1), bump=st.integers(1, 255))
def test_partial_accept_equals_verifying_only_the_accepted_prefix(eng, greedy_ref, a, bump):
    """Accepting a of K-1 drafts leaves exactly the state (h, conv, KV) of a verify that carried
    only the accepted prefix (bytewise: same program shape), and the next logits are equal."""
    seqs = [eng.alloc_sequence(), eng.alloc_sequence()]
    try:
        last = [int(eng.prefill(s, PROMPT).argmax()) for s in seqs]
        drafts = list(greedy_ref[1:K])
        drafts[-1] = (drafts[-1] + bump) % 256  # the rows past `a` are junk either way
        _step(eng, seqs, [[last[0], *drafts], [last[1], *drafts[:a]]], [a, a])
        for x, y in zip(_slot_state(eng, seqs[0].slot), _slot_state(eng, seqs[1].slot)):
            np.testing.assert_array_equal(x, y)
        assert seqs[0].seq_len == seqs[1].seq_len == len(PROMPT) + a + 1
        nxt = eng.decode_batch(seqs, [7, 7])
        np.testing.assert_array_equal(nxt[0], nxt[1])
    finally:
        _free_all(eng, seqs)


def test_full_accept_equals_sequential_decodes(eng, greedy_ref):
    """K rows verified and all accepted == K single-token decodes (f32 tolerance: other shapes)."""
    seqs = [eng.alloc_sequence(), eng.alloc_sequence()]
    try:
        last = int(eng.prefill(seqs[0], PROMPT).argmax())
        eng.prefill(seqs[1], PROMPT)
        rows = [last, *greedy_ref[1:K]]
        vlogits, _ = _step(eng, [seqs[0]], [rows], [K - 1])
        dlogits = np.stack([eng.decode(seqs[1], t) for t in rows])
        np.testing.assert_allclose(vlogits, dlogits, rtol=0, atol=2e-5 * np.abs(dlogits).max())
        (h0, c0), (h1, c1) = _slot_state(eng, seqs[0].slot), _slot_state(eng, seqs[1].slot)
        np.testing.assert_allclose(h0, h1, atol=1e-5)
        np.testing.assert_allclose(c0, c1, atol=1e-5)
    finally:
        _free_all(eng, seqs)


def test_anchor_only_accept_a0_commits_row_zero(eng, greedy_ref):
    """a = 0 (every draft rejected): the committed state is the one after the anchor row alone
    (no index -1, no rejected draft in the conv window) — spec_decode_gdn_state.md bugs 4, 5, 17."""
    seqs = [eng.alloc_sequence(), eng.alloc_sequence()]
    try:
        last = [int(eng.prefill(s, PROMPT).argmax()) for s in seqs]
        bad = [(t + 1) % 256 for t in greedy_ref[1:K]]
        _step(eng, seqs, [[last[0], *bad], [last[1]]], [0, 0])
        for x, y in zip(_slot_state(eng, seqs[0].slot), _slot_state(eng, seqs[1].slot)):
            np.testing.assert_array_equal(x, y)
    finally:
        _free_all(eng, seqs)


def test_non_speculative_step_after_speculative_one(eng, tiny, greedy_ref):
    """A plain decode after a partial accept reads the folded state: the tokens
    continue exactly as plain greedy decoding."""
    seq = eng.alloc_sequence()
    try:
        last = int(eng.prefill(seq, PROMPT).argmax())
        drafts = [greedy_ref[1], (greedy_ref[2] + 1) % 256, greedy_ref[3]]
        _, am = _step(eng, [seq], [[last, *drafts]], [1])
        assert list(am[:2]) == greedy_ref[1:3]
        tok, out = int(am[1]), []
        for _ in range(4):
            tok = int(eng.decode(seq, tok).argmax())
            out.append(tok)
        assert out == greedy_ref[3:7]
    finally:
        eng.free_sequence(seq)


def test_mixed_widths_ragged_rows_are_independent(eng, greedy_ref):
    """Ragged K [4, 2, 3] in one batch: each sequence's logits equal its own uniform-shape run of
    the same width bucket (rows never read another sequence's rows)."""
    seqs = [eng.alloc_sequence() for _ in range(3)]
    try:
        last = [int(eng.prefill(s, PROMPT).argmax()) for s in seqs]
        rows = [[last[0], *greedy_ref[1:4]], [last[1], greedy_ref[1]], [last[2], *greedy_ref[1:3]]]
        ragged, _ = eng.verify_batched(seqs, [t for r in rows for t in r], [4, 2, 3])
        _free_all(eng, seqs)
        seqs = [eng.alloc_sequence() for _ in range(3)]
        for s in seqs:
            eng.prefill(s, PROMPT)
        full, _ = eng.verify_batched(seqs, [t for _ in range(3) for t in rows[0]], [4, 4, 4])
        np.testing.assert_array_equal(ragged[0:2], full[0:2])  # seq 0 rows 0..1 == seq 1's rows
        np.testing.assert_array_equal(ragged[4:6], full[4:6])
        np.testing.assert_array_equal(ragged[6:9], full[8:11])
    finally:
        _free_all(eng, seqs)


def test_rejected_kv_never_influences_later_logits(eng, greedy_ref):
    """After a partial accept, poisoning every KV entry past the sequence's length (where the
    rejected rows wrote) with NaN changes nothing in the next step."""
    seq = eng.alloc_sequence()
    try:
        last = int(eng.prefill(seq, PROMPT).argmax())
        _step(eng, [seq], [[last, greedy_ref[1], 0, 0]], [1])
        snap = jax.tree_util.tree_map(lambda x: x.copy(), eng.pool)
        clean = eng.decode(seq, greedy_ref[2])
        eng.blocks.rewind(seq, 1)
        bs = eng.counts.block_size
        t = snap.trunk
        kv_k, kv_v = np.array(t.kv_k), np.array(t.kv_v)
        for p in range(seq.seq_len, len(seq.blocks) * bs):
            kv_k[:, seq.blocks[p // bs], p % bs] = np.nan
            kv_v[:, seq.blocks[p // bs], p % bs] = np.nan
        eng.pool = snap.replace(trunk=t.replace(kv_k=jnp.asarray(kv_k), kv_v=jnp.asarray(kv_v)))
        np.testing.assert_array_equal(eng.decode(seq, greedy_ref[2]), clean)
    finally:
        eng.free_sequence(seq)


def _poison_except(pool, eng, seqs):
    """NaN in every slot, verify row, KV block and stash row not owned by `seqs` (dummy included)."""
    own_slots = {s.slot for s in seqs}
    own_blocks = {b for s in seqs for b in s.blocks}
    own_dblocks = {b for s in seqs for b in s.draft_blocks}
    own_vrows = {
        r for s in seqs for r in range(eng.counts.h_step_offsets[s.slot], eng.counts.h_step_offsets[s.slot + 1])
    }

    def poison(a, axis, keep):
        a = np.array(a)
        idx = [i for i in range(a.shape[axis]) if i not in keep]
        sl = [slice(None)] * a.ndim
        sl[axis] = idx
        a[tuple(sl)] = np.nan
        return jnp.asarray(a)

    t = pool.trunk
    t = t.replace(
        gdn_h=poison(t.gdn_h, 1, own_slots),
        gdn_conv=poison(t.gdn_conv, 1, own_slots),
        kv_k=poison(t.kv_k, 1, own_blocks),
        kv_v=poison(t.kv_v, 1, own_blocks),
        verify_h=poison(t.verify_h, 1, own_vrows),
        verify_conv=poison(t.verify_conv, 1, own_slots),
    )
    return pool.replace(
        trunk=t,
        stash=poison(pool.stash, 0, own_slots),
        draft_k=poison(pool.draft_k, 1, own_dblocks),
        draft_v=poison(pool.draft_v, 1, own_dblocks),
    )


def _run_isolated(eng, greedy_ref, poison, fused):
    seqs = [eng.alloc_sequence() for _ in range(3)]
    try:
        outs = []
        for s in seqs:
            outs.append(eng.prefill(s, PROMPT))
        if poison:
            eng.pool = _poison_except(eng.pool, eng, seqs)
        last = [int(o.argmax()) for o in outs]
        rows = [[last[0], *greedy_ref[1:4]], [last[1], (greedy_ref[1] + 1) % 256], [last[2], *greedy_ref[1:3]]]
        if fused:
            r = eng.speculative_step(seqs, [t for x in rows for t in x], [4, 2, 3], 3, logits=True)
            outs += [r.accepted, np.concatenate(r.emitted), r.drafts, r.confidences, r.verify_logits, r.draft_logits]
        else:
            outs.append(_step(eng, seqs, rows, [3, 0, 2])[0])
            d, c, lg = eng.propose_batched(seqs, [1, 2, 3], 3)
            outs += [d, c, lg]
        outs.append(eng.decode_batch(seqs, [4, 5, 6]))
        outs += [np.asarray(eng.pool.trunk.gdn_h[:, s.slot]) for s in seqs]
        return outs
    finally:
        _free_all(eng, seqs)


@pytest.mark.parametrize("fused", [False, True])
def test_slot_isolation_nan_elsewhere_changes_nothing(eng, greedy_ref, fused):
    """NaN in every other slot, block, verify row and stash row (the padding dummy included):
    logits, drafts, confidences and state are bit-identical — bugs 13, 16."""
    clean = _run_isolated(eng, greedy_ref, poison=False, fused=fused)
    dirty = _run_isolated(eng, greedy_ref, poison=True, fused=fused)
    if fused:
        assert clean[3].tolist() == [3, 0, 2], "the device accepted every agreeing draft"
    for a, b in zip(clean, dirty):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("fused", [False, True])
def test_speculative_equals_greedy_mtp_and_oracle(eng, tiny, fused):
    """Greedy speculative generation (MTP drafts, and oracle drafts with planted errors so full
    and partial accepts both happen) emits exactly plain greedy's tokens, ragged K included."""
    rng = np.random.default_rng(3)
    prompts = [[int(x) for x in rng.integers(0, 256, size=n)] for n in (9, 17, 30)]
    ref = greedy_generate(eng, prompts, 64)
    for nd in (1, 3):
        r = speculative_generate(eng, prompts, 64, DraftSchedule(nd), fused=fused)
        assert r.tokens == ref

    def oracle(i, toks, n):
        done = len(toks) - len(prompts[i])
        d = list(ref[i][done : done + n]) + [0] * n
        if (done + i) % 3 == 1 and n >= 2:
            d[1] = (d[1] + 1) % 256
        return d[: (i % 3) + 1 if n > 1 else n]

    r = speculative_generate(eng, prompts, 64, DraftSchedule(3), draft_source=oracle, fused=fused)
    assert r.tokens == ref
    acc = [(a, k) for s in r.steps for a, k in zip(s.accepted, s.ks)]
    assert any(a == k - 1 and k > 1 for a, k in acc) and any(a < k - 1 for a, k in acc)
    assert len({k for s in r.steps for k in s.ks}) > 1


def test_drafter_chains_its_own_normed_hidden(eng, tiny):
    """Draft j >= 1 pairs the previous draft with the MTP head's own normed output at position
    p + j (bugs 8-10): the engine's batched propose equals a dense re-computation."""
    from metrale_jax.model.cache import forward, new_cache
    from metrale_jax.model.state_io import PoolIO
    from metrale_jax.model.trunk import final_norm, mtp_forward

    cfg, params = tiny
    seq = eng.alloc_sequence()
    try:
        last = int(eng.prefill(seq, PROMPT).argmax())
        drafts, conf, lg = eng.propose_batched([seq], [last], 3)
    finally:
        eng.free_sequence(seq)
    n = len(PROMPT)
    _, hidden, _ = forward(params, cfg, jnp.asarray([PROMPT]), new_cache(cfg, 1, n + 8), jnp.int32(0))
    cache = new_cache(cfg, 1, n + 8)
    state = cache.replace(kv_k=cache.kv_k[:1], kv_v=cache.kv_v[:1])

    def io(pos):
        return PoolIO(
            cfg=cfg,
            slots=None,
            lens=None,
            positions=jnp.asarray([pos], jnp.int32),
            block_tables=jnp.zeros((1, 1), jnp.int32),
            null_block=1,
            gdn_mode="rows",
        )

    toks = jnp.asarray([PROMPT[1:] + [last]])
    m, logits, state = mtp_forward(params, cfg, toks, final_norm(params, cfg, hidden), io(list(range(n))), state)
    want, want_logits = [int(jnp.argmax(logits[0, -1]))], [logits[0, -1]]
    h = m[:, -1:]
    for j in range(1, 3):
        h, logits, state = mtp_forward(params, cfg, jnp.asarray([[want[-1]]]), h, io([n - 1 + j]), state)
        want.append(int(jnp.argmax(logits[0, -1])))
        want_logits.append(logits[0, -1])
    assert list(drafts[0]) == want and lg.shape == (1, 3, cfg.vocab_size)
    np.testing.assert_allclose(lg[0], np.stack(want_logits), atol=1e-4)
    lsm = jax.nn.log_softmax(logits[0, -1])
    np.testing.assert_allclose(conf[0, -1], lsm[want[-1]], atol=1e-5)


def test_errors_leave_no_leak(eng):
    slots_live, free = eng.blocks.slots.live, eng.blocks.kv.free_count
    seq = eng.alloc_sequence()
    with pytest.raises(EngineError, match="over --max-seq-len"):
        eng.prefill(seq, [1] * 300)
    with pytest.raises(EngineError, match="outside the vocabulary"):
        eng.prefill(seq, [1, 999])
    eng.prefill(seq, [1, 2, 3])
    with pytest.raises(EngineError, match="cannot verify K=5"):
        eng.verify_batched([seq], [1] * 5, [5])
    taken = eng.blocks.kv.alloc_many(eng.blocks.kv.free_count)
    held = list(seq.blocks)
    with pytest.raises(EngineError, match="KV blocks exhausted"):
        eng.prefill(seq, [1] * 40)
    assert (seq.seq_len, seq.blocks) == (3, held)  # the refused prefill changed nothing
    eng.blocks.kv.free_many(taken)
    eng.free_sequence(seq)
    with pytest.raises(EngineError, match="already freed"):
        eng.free_sequence(seq)
    assert (eng.blocks.slots.live, eng.blocks.kv.free_count) == (slots_live, free)
    seqs = [eng.alloc_sequence() for _ in range(12)]
    with pytest.raises(EngineError, match="no free sequence slot"):
        eng.alloc_sequence()
    # slots 8.. hold 1 draft under the default ladder with 3 drafts
    assert [eng.counts.slot_draft_capacity(s.slot) for s in seqs] == [3] * 8 + [1] * 4
    _free_all(eng, seqs)
    assert (eng.blocks.slots.live, eng.blocks.kv.free_count) == (slots_live, free)


@pytest.mark.parametrize("fused", [False, True])
def test_zero_recompiles_in_a_ragged_verify_loop(eng, greedy_ref, fused):
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *a, **k: compiles.append(name) if name == "/jax/core/compile/backend_compile_duration" else None
    )
    seqs = [eng.alloc_sequence() for _ in range(3)]
    try:
        last = [int(eng.prefill(s, PROMPT).argmax()) for s in seqs]
        pattern = [[4, 2, 3], [2, 2, 2], [3, 4, 1]]
        for step in range(53):
            if step == 3:
                before, compiles[:] = eng.programs.compilations, []
            ks = pattern[step % 3]
            rows = [[last[i], *greedy_ref[1 : ks[i]]] for i in range(3)]
            if fused:
                eng.speculative_step(seqs, [t for r in rows for t in r], ks, 3)
            else:
                _step(eng, seqs, rows, [(step + i) % k for i, k in enumerate(ks)])
                eng.propose_batched(seqs, last, 3)
            for s in seqs:
                eng.trim_proposer(s)
                if s.seq_len > 200:
                    eng.blocks.rewind(s, s.seq_len - len(PROMPT))
        assert eng.programs.compilations == before
        assert compiles == []
    finally:
        _free_all(eng, seqs)


def test_replay_rollback_matches_snapshot(eng, tiny, greedy_ref):
    """--ssm-rollback-mode replay (checkpoint + re-run of the accepted rows) commits the state
    the write-on-accept snapshot commits, and an abandoned verify rolls back to the pre-verify
    state exactly."""
    cfg, params = tiny
    rep = Engine(
        cfg,
        params,
        settings(max_batch_size=2, max_seq_len=256, speculative=True, num_drafts=3, ssm_rollback_mode="replay"),
    )
    assert rep.pool.trunk.verify_h is None and rep.pool.trunk.ckpt_h is not None
    results = []
    for e in (eng, rep):
        seqs = [e.alloc_sequence(), e.alloc_sequence()]
        try:
            last = [int(e.prefill(s, PROMPT).argmax()) for s in seqs]
            rows = [[last[0], *greedy_ref[1:3], 9], [last[1], 5, 6, 7]]
            _step(e, seqs, rows, [2, 0])
            nxt = e.decode_batch(seqs, [3, 3])
            results.append([*_slot_state(e, seqs[0].slot), *_slot_state(e, seqs[1].slot), nxt])
            before = _slot_state(e, seqs[0].slot)
            e.verify_batched(seqs, [1, 2, 3, 4, 1, 2], [4, 2])
            e.rollback_verify(seqs)
            for x, y in zip(before, _slot_state(e, seqs[0].slot)):
                np.testing.assert_array_equal(x, y)
            assert seqs[0].seq_len == len(PROMPT) + 4
        finally:
            _free_all(e, seqs)
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_speculative_equals_greedy_on_a_loaded_checkpoint():
    """The oracle on real HF-layout weights (the Qwen3-Next MoE fixture with its mtp.* head),
    ragged K from a confidence stop and widths 1 and 3, on both step paths (the same steps)."""
    import os

    from conftest import FIXTURES

    from metrale_jax.checkpoint import load_checkpoint

    cfg, params = load_checkpoint(os.path.join(FIXTURES, "hf", "qwen3_next_moe"), np.float32)
    eng = Engine(cfg, params, settings(max_batch_size=4, max_seq_len=256, speculative=True, num_drafts=3))
    rng = np.random.default_rng(11)
    prompts = [[int(x) for x in rng.integers(0, cfg.vocab_size, size=n)] for n in (40, 13, 70)]
    for batch in (prompts[:1], prompts):
        ref = greedy_generate(eng, batch, 64)
        runs = [speculative_generate(eng, batch, 64, DraftSchedule(3, confidence_stop=-2.0), fused=f) for f in (0, 1)]
        assert runs[0].tokens == runs[1].tokens == ref
        assert runs[0].steps == runs[1].steps
    assert len({k for s in runs[1].steps for k in s.ks}) > 1


def test_program_digest_ignores_source_locations():
    """The disclosed digest hashes the computation, not where it was traced from: one function
    traced from two source lines gives one text; a different computation another."""
    from metrale_jax.engine.programs import computation_text

    def text(fn):
        return jax.jit(fn).lower(jnp.ones(4)).compile().as_text()

    a = lambda x: jnp.sin(x) * 2 + 1
    b = lambda x: jnp.sin(x) * 2 + 1
    c = lambda x: jnp.cos(x) * 2 + 1
    assert text(a) != text(b)  # the raw text carries each lambda's line
    assert computation_text(text(a)) == computation_text(text(b))
    assert computation_text(text(a)) != computation_text(text(c))


def test_a_fused_step_is_one_program_call_and_one_transfer(eng, greedy_ref, monkeypatch):
    """A fused step runs one compiled program and makes one device-to-host transfer, counted at the
    engine's one fetch point (`Engine._fetch`; no other line of engine.py converts a device array
    to numpy), and one host-to-device transfer: its host inputs go as one vector (`HostPacking`),
    the only numpy argument of the compiled call; it updates the pool in place."""
    import inspect

    from metrale_jax.engine import engine as engine_module
    from metrale_jax.engine.programs import HostPacking

    sent = []  # per compiled call: the numpy arrays among the arguments it was given
    pack = HostPacking.pack

    def counting(self, args):
        packed = pack(self, args)
        sent.append(sum(isinstance(x, np.ndarray) for x in jax.tree_util.tree_leaves(packed)))
        return packed

    monkeypatch.setattr(HostPacking, "pack", counting)

    source = inspect.getsource(engine_module)
    assert source.count("np.asarray(") == source.count("np.array(") + 1 == 1, "only _fetch converts"
    fetched = []
    fetch = Engine._fetch
    monkeypatch.setattr(Engine, "_fetch", staticmethod(lambda x: fetched.append(x.shape) or fetch(x)))
    seqs = [eng.alloc_sequence() for _ in range(3)]
    try:
        last = [int(eng.prefill(s, PROMPT).argmax()) for s in seqs]
        rows = [last[0], *greedy_ref[1:4], last[1], greedy_ref[1], last[2], *greedy_ref[1:3]]
        eng.speculative_step(seqs, rows, [4, 2, 3], 3)  # compiles
        calls, fetched[:] = eng.programs.calls, []
        for _ in range(3):
            out = eng.speculative_step(seqs, [x for s in seqs for x in (s.tokens[-1], 1, 2)], [3] * 3, 3)
        assert eng.programs.calls - calls == 3 and fetched == [(4, 1 + 4 + 2 * 3)] * 3
        assert sent[-3:] == [1] * 3, "the step's host inputs cross as one array"
        assert out.drafts.shape == out.confidences.shape == (3, 3) and out.verify_logits is None
        eng.decode_batch(seqs, [1, 2, 3])
        assert len(fetched) == 3 + 2, "a decode fetches its logits and argmaxes"
        infos = [i for i in eng.programs.info.values() if i.name == "speculative_step"]
        assert infos and all(i.pool_copies == 0 for i in infos)
    finally:
        _free_all(eng, seqs)


def test_accept_and_the_fused_step_refuse_misuse(eng, tiny, greedy_ref):
    seqs = [eng.alloc_sequence() for _ in range(2)]
    try:
        for s in seqs:
            eng.prefill(s, PROMPT)
        with pytest.raises(EngineError, match="no verify awaiting a verdict"):
            eng.accept(seqs, [0, 0])
        eng.verify_batched(seqs, [1, 2, 3, 4, 5], [3, 2])
        with pytest.raises(EngineError, match="3 accepted drafts of a K=3 verify"):
            eng.accept(seqs, [3, 0])
        with pytest.raises(EngineError, match="awaiting its verdict"):
            eng.speculative_step(seqs, [1, 2], [1, 1], 3)
        eng.verify_batched(seqs[1:], [1, 2], [2])
        with pytest.raises(EngineError, match="another verify ran since theirs"):
            eng.accept(seqs, [0, 0])
        eng.accept(seqs[1:], [1])
        eng.rollback_verify(seqs[:1])
        with pytest.raises(EngineError, match="num_drafts 4 outside 0..3"):
            eng.speculative_step(seqs, [1, 2], [1, 1], 4)
    finally:
        _free_all(eng, seqs)
    cfg, params = tiny
    rep = Engine(cfg, params, settings(max_batch_size=2, max_seq_len=64, speculative=True, ssm_rollback_mode="replay"))
    seq = rep.alloc_sequence()
    rep.prefill(seq, PROMPT)
    with pytest.raises(EngineError, match="needs --ssm-rollback-mode snapshot"):
        rep.speculative_step([seq], [1], [1], 0)


def test_the_program_cache_keys_each_argument_by_its_shapes_whether_or_not_it_is_the_last_object_passed():
    """An argument passed again as the same object reuses its signature (the engine's params); a new
    object is keyed by its own shapes: a new shape compiles, the same shapes do not, and a program
    is never reused for an argument of other shapes."""
    cache = ProgramCache()

    def step(pool, params, batch):
        return pool + params["w"].sum() + batch.sum()

    params = {"w": jnp.ones((2, 3))}
    pool, batch = jnp.zeros((4,)), np.ones((5,), np.int32)
    pool = cache.run("step", step, None, pool, params, batch)
    pool = cache.run("step", step, None, pool, params, np.ones((5,), np.int32))
    assert cache.compilations == 1
    out = cache.run("step", step, None, pool, params, np.ones((6,), np.int32))
    assert cache.compilations == 2 and out.shape == (4,)
    wide = {"w": jnp.ones((3, 3))}
    out = cache.run("step", step, None, out, wide, np.ones((6,), np.int32))
    # each call adds its weights' and batch's sums: (6 + 5) + (6 + 5) + (6 + 6) + (9 + 6)
    assert cache.compilations == 3 and float(out[0]) == 49.0
