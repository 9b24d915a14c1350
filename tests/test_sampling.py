"""Token selection (`engine.sampling`): the mask order against HF's warpers on hand-made logits,
temperature 0 = greedy exactly, keys from (seed, position) only, the Gumbel draw's law, and
rejection sampling's output law against its closed form (chi-square over 2e5 draws); on the tiny
engine, plain sampling by seed in any slot and width, and gumbel speculative sampling emitting
plain sampling's tokens (composed and fused); `generate`'s sampling flags; the sampled diff and a
planted noise bug it catches."""

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import resolve_checkpoint, settings

from metrale_jax.diff import render_summary, run_diff
from metrale_jax.diff.request import DiffRequest
from metrale_jax.diff.variants import Variant, default_variants
from metrale_jax.engine import sampling as sm
from metrale_jax.engine import transitions as tr
from metrale_jax.engine.batching import sampling_batch
from metrale_jax.engine.capacity import PoolCounts
from metrale_jax.engine.engine import Engine
from metrale_jax.engine.sequences import EngineError
from metrale_jax.engine.speculative import DraftSchedule, greedy_generate, speculative_generate
from metrale_jax_cli.generate_cmd import generate


def _rows(params: list[sm.Sampling]) -> sm.SamplingRows:
    return sampling_batch(PoolCounts.__new__(PoolCounts), params, len(params))  # the counts fix nothing here


_draw = jax.jit(sm.draw)


def _hf_allowed(scores: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """HF's TopK, TopP, MinP warpers (transformers `generation/logits_process.py`) in numpy, in
    `_get_logits_processor`'s order, on logits already divided by the temperature."""
    s = scores.astype(np.float64).copy()
    if top_k > 0:
        kth = np.sort(s)[::-1][min(top_k, s.size) - 1]
        s[s < kth] = -np.inf
    if top_p < 1.0:
        order = np.argsort(s, kind="stable")
        srt = s[order]
        p = np.exp(srt - srt.max())
        cum = np.cumsum(p / p.sum())
        remove = cum <= 1 - top_p
        remove[-1] = False
        s[order[remove]] = -np.inf
    if min_p > 0:
        p = np.exp(s - s.max())
        p /= p.sum()
        s[p < min_p * p.max()] = -np.inf
    return np.isfinite(s)


@pytest.mark.parametrize(
    "params",
    [(0, 1.0, 0.0), (3, 1.0, 0.0), (0, 0.6, 0.0), (0, 1.0, 0.2), (4, 0.7, 0.0), (5, 0.9, 0.3), (2, 0.5, 0.5)],
)
def test_the_allowed_set_follows_hf_order(params):
    top_k, top_p, min_p = params
    rng = np.random.default_rng(top_k * 100 + int(top_p * 10))
    for _ in range(20):
        logits = rng.normal(size=12).astype(np.float32) * 2
        for t in (0.5, 1.0, 1.7):
            scaled = logits / np.float32(t)
            got = np.asarray(sm.allowed(jnp.asarray(scaled), jnp.int32(top_k), jnp.float32(top_p), jnp.float32(min_p)))
            np.testing.assert_array_equal(got, _hf_allowed(scaled, top_k, top_p, min_p))


def test_the_order_matters_and_is_hfs():
    """top-p over what top-k left: top-k 2 renormalises (0.4, 0.3) to (4/7, 3/7), so top-p 0.5
    cuts the second token; top-p on the full row first (mass 0.4 above it) would have kept it."""
    logits = jnp.log(jnp.asarray([0.4, 0.3, 0.2, 0.1], jnp.float32))
    got = sm.allowed(logits, jnp.int32(2), jnp.float32(0.5), jnp.float32(0.0))
    assert np.asarray(got).tolist() == [True, False, False, False]
    got = sm.allowed(logits, jnp.int32(0), jnp.float32(0.5), jnp.float32(0.0))
    assert np.asarray(got).tolist() == [True, True, False, False]
    got = sm.allowed(logits, jnp.int32(0), jnp.float32(1.0), jnp.float32(0.45))
    assert np.asarray(got).tolist() == [True, True, True, False]


def test_temperature_zero_is_first_argmax_exactly():
    logits = jnp.asarray([[1.0, 3.0, 3.0, -1.0], [0.0, 0.0, 0.0, 0.0], [2.0, jnp.nan, 5.0, 1.0]], jnp.float32)
    rows = _rows([sm.Sampling(seed=s, top_k=1, top_p=0.3) for s in range(3)])
    got = sm.draw(logits, rows, jnp.arange(3, dtype=jnp.int32))
    assert np.asarray(got).tolist() == [1, 0, 1]


def test_a_draw_depends_on_seed_and_position_only():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(1, 64)), jnp.float32)
    p = sm.Sampling(temperature=1.0, seed=11)
    one = _draw(logits, _rows([p]), jnp.asarray([5], jnp.int32))
    wide = jnp.tile(logits, (8, 1))
    mixed = _rows([sm.Sampling(temperature=0.5, seed=i) for i in range(8)])
    mixed.set_row(6, p)
    many = _draw(wide, mixed, jnp.asarray([5, 1, 2, 3, 4, 5, 5, 7], jnp.int32))
    assert int(many[6]) == int(one[0])
    at = jnp.arange(40, dtype=jnp.int32)
    draws = np.asarray(_draw(jnp.tile(logits, (40, 1)), _rows([p] * 40), at)).tolist()
    assert len(set(draws)) > 5, "positions draw independently"
    other = np.asarray(_draw(jnp.tile(logits, (40, 1)), _rows([sm.Sampling(1.0, seed=12)] * 40), at)).tolist()
    assert draws != other


def test_the_gumbel_draw_follows_the_processed_softmax():
    """Over 2e4 positions the draw's frequencies match softmax(l / T) on the allowed set."""
    logits = jnp.asarray([2.0, 1.5, 1.0, 0.0, -1.0, -3.0], jnp.float32)
    p = sm.Sampling(temperature=0.7, top_k=5, top_p=0.95, seed=3)
    n = 20000
    rows = _rows([p] * n)
    law = np.asarray(sm.probabilities(logits[None], _rows([p])))[0]
    got = np.bincount(np.asarray(sm.draw(jnp.tile(logits, (n, 1)), rows, jnp.arange(n, dtype=jnp.int32))), minlength=6)
    assert got[law == 0].sum() == 0
    _chi_square_ok(got[law > 0], law[law > 0] * n)


def _chi_square_ok(observed: np.ndarray, expected: np.ndarray) -> None:
    """Pearson's chi-square p-value > 1e-3 (survival function of the chi-square law, by the
    regularised upper incomplete gamma, jax.scipy)."""
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = observed.size - 1
    pval = float(jax.scipy.special.gammaincc(dof / 2, stat / 2))
    assert pval > 1e-3, (stat, dof, pval, observed, expected)


def _rejection_law(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Closed form of (accepted drafts, emitted token) over one draft x ~ q[0]: accept x w.p.
    min(1, p0(x)/q0(x)) and then draw the bonus from p[1]; else draw from norm(max(0, p0 - q0))."""
    v = p.shape[1]
    law = np.zeros((2, v))
    acc = np.minimum(q[0], p[0])  # P(draft x and accepted)
    law[1] = acc.sum() * p[1]
    res = np.maximum(p[0] - q[0], 0)
    law[0] = (1 - acc.sum()) * res / res.sum()
    return law


def test_rejection_sampling_preserves_the_target_law():
    """One draft: the emitted pair (token at position, token after it when accepted) follows p's
    law; the first token's marginal is p[0] exactly, acceptance is 1 - TV(p0, q0)."""
    p = np.asarray([[0.5, 0.2, 0.2, 0.1, 0.0], [0.1, 0.1, 0.3, 0.3, 0.2]], np.float32)
    q = np.asarray([[0.1, 0.4, 0.2, 0.2, 0.1]], np.float32)
    n = 200_000
    seeds = jnp.arange(n, dtype=jnp.int32)
    drafts = jax.vmap(lambda s: jax.random.categorical(sm.draw_key(s, 0, sm.TAG_DRAFT), jnp.log(q[0])))(seeds)
    verdict = jax.jit(jax.vmap(lambda d, s: sm.rejection_verdict(p, q, d[None], 1, s, 0)))
    na, tok = (np.asarray(x) for x in verdict(drafts.astype(jnp.int32), seeds))
    first = np.where(na == 1, np.asarray(drafts), tok)
    law = _rejection_law(p, q)
    observed = np.stack([np.bincount(tok[na == a], minlength=5) for a in (0, 1)]).ravel()
    nz = law.ravel() > 0
    assert observed[~nz].sum() == 0
    _chi_square_ok(observed[nz], law.ravel()[nz] * n)
    _chi_square_ok(np.bincount(first, minlength=5)[p[0] > 0], p[0][p[0] > 0] * n)
    tv = 0.5 * np.abs(p[0] - q[0]).sum()
    assert abs(na.mean() - (1 - tv)) < 4 * np.sqrt(tv * (1 - tv) / n)


def test_bad_parameters_are_refused():
    assert sm.sampling_problems(0.7, 20, 0.9, 0.0, 7) == []
    for bad in [(-0.1, 0, 1.0, 0.0, 0), (1.0, -1, 1.0, 0.0, 0), (1.0, 0, 0.0, 0.0, 0), (1.0, 0, 1.5, 0.0, 0)]:
        assert sm.sampling_problems(*bad)
    assert sm.sampling_problems(1.0, 0, 1.0, 0.0, 1.5) and sm.sampling_problems(1.0, 0, 1.0, 0.0, "7")
    with pytest.raises(ValueError, match="top-p"):
        sm.Sampling(top_p=0.0)


def test_padded_rows_are_greedy():
    x = sm.SamplingRows.padded(PoolCounts.__new__(PoolCounts), 3)
    t, top_p, min_p = x.floats()
    assert np.asarray(t).tolist() == [0.0] * 3 and np.asarray(top_p).tolist() == [1.0] * 3
    assert np.asarray(min_p).tolist() == [0.0] * 3


# ---------------------------------------------------------------- the engine, on the tiny model

PROMPTS = [[int(x) for x in np.random.default_rng(5).integers(0, 256, size=n)] for n in (9, 17, 30)]


@pytest.fixture(scope="module")
def eng(tiny):
    cfg, params = tiny
    return Engine(cfg, params, settings(max_batch_size=8, max_seq_len=160, speculative=True, num_drafts=3))


def test_plain_sampling_draws_by_seed_and_position_in_any_slot_and_width(eng):
    """The same seeds give the same tokens alone (n = 1) and among 8 sequences in other slots;
    other seeds give other tokens."""
    p = [sm.Sampling(temperature=0.8, top_p=0.95, seed=s) for s in (7, 8, 9)]
    alone = [greedy_generate(eng, [pr], 24, sampling=[s])[0] for pr, s in zip(PROMPTS, p)]
    prompts = [PROMPTS[i % 3] for i in range(8)]
    mixed = [sm.Sampling(temperature=1.0, top_k=5, seed=100 + i) for i in range(8)]
    mixed[6], mixed[1], mixed[3] = p
    wide = greedy_generate(
        eng, [prompts[i] if i not in (6, 1, 3) else PROMPTS[(6, 1, 3).index(i)] for i in range(8)], 24, sampling=mixed
    )
    assert [wide[6], wide[1], wide[3]] == alone
    other = greedy_generate(eng, PROMPTS[:1], 24, sampling=[sm.Sampling(temperature=0.8, top_p=0.95, seed=70)])
    assert other[0] != alone[0]


def test_temperature_zero_rows_of_a_sampling_program_are_greedy(eng):
    greedy = greedy_generate(eng, PROMPTS, 24)
    p = [sm.Sampling(), sm.Sampling(temperature=1.0, seed=1), sm.Sampling(top_k=3, seed=4)]
    sampled = greedy_generate(eng, PROMPTS, 24, sampling=p)
    assert sampled[0] == greedy[0] and sampled[2] == greedy[2] and sampled[1] != greedy[1]


@pytest.mark.parametrize("fused", [False, True])
def test_gumbel_speculative_sampling_emits_plain_samplings_tokens(eng, fused):
    """At num_drafts 1..3 and T 0.3 / 0.7 / 1.0, MTP drafts (the coupled drafter) and oracle drafts
    with planted errors (full and partial accepts) emit exactly plain sampling's tokens."""
    for t in (0.3, 0.7, 1.0):
        p = [sm.Sampling(temperature=t, top_p=0.9, seed=10 * i + 3) for i in range(3)]
        ref = greedy_generate(eng, PROMPTS, 40, sampling=p)
        for nd in (1, 2, 3):
            r = speculative_generate(eng, PROMPTS, 40, DraftSchedule(nd), fused=fused, sampling=p)
            assert r.tokens == ref, (t, nd)

        def oracle(i, toks, n, ref=ref):
            done = len(toks) - len(PROMPTS[i])
            d = list(ref[i][done : done + n]) + [0] * n
            if (done + i) % 3 == 1 and n >= 2:
                d[1] = (d[1] + 1) % 256
            return d[: (i % 3) + 1 if n > 1 else n]

        r = speculative_generate(eng, PROMPTS, 40, DraftSchedule(3), draft_source=oracle, fused=fused, sampling=p)
        assert r.tokens == ref
        acc = [(a, k) for s in r.steps for a, k in zip(s.accepted, s.ks)]
        assert any(a == k - 1 and k > 1 for a, k in acc) and any(a < k - 1 for a, k in acc)


# ---------------------------------------------------------------- generate's sampling flags


def _generate(*args):
    return CliRunner().invoke(generate, ["--checkpoint", "small", "--prompt", "def f(x):\n    return ", *args])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--temperature", "-0.5"], "error: temperature -0.5 is negative"),
        (["--temperature", "0.7", "--top-p", "0"], "error: top-p 0.0 is outside (0, 1]"),
        (["--temperature", "0.7", "--top-p", "1.5"], "error: top-p 1.5 is outside (0, 1]"),
        (["--temperature", "0.7", "--top-k", "-1"], "error: top-k -1 is not an integer >= 0"),
        (["--temperature", "0.7", "--seed", "1.5"], "error: --seed '1.5' is not an integer"),
        (["--temperature", "hot"], "error: --temperature 'hot' is not a number"),
        (["--seed", "3"], "error: --seed need(s) --temperature > 0"),
    ],
)
def test_bad_sampling_flags_are_one_error_line(args, message):
    res = _generate(*args)
    assert res.exit_code == 2 and res.output.startswith(message), res.output
    assert len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output


def _generate_process(*args) -> str:
    """generate's stdout from its own process (the installed command), which must exit 0.
    NOTE: its own process: a suite process that has compiled every earlier test's programs can
    meet XLA CPU's memory-mapping limit inside these compiles."""
    cmd = [str(Path(sys.executable).with_name("metrale-jax")), "generate", "--checkpoint", "small"]
    r = subprocess.run([*cmd, "--prompt", "def f(x):\n    return ", *args], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_generate_samples_by_seed_and_speculative_prints_the_same_text():
    args = ("--max-new-tokens", "20", "--temperature", "0.7", "--top-p", "0.9", "--seed")
    plain = _generate_process(*args, "7")
    assert "(plain sampling, sampled: T 0.7, top-p 0.9, seed 7;" in plain
    spec = _generate_process(*args, "7", "--speculative", "--num-drafts", "3")
    assert "; 0 compiled after the warm-up" in spec
    body = lambda out: out.split("\n", 1)[1].split("\n\n", 1)[0]  # noqa: E731
    assert body(spec) == body(plain)
    assert body(_generate_process(*args, "8")) != body(plain)


# ---------------------------------------------------------------- the diff, sampled

SAMPLED = DiffRequest(
    steps=3,
    verify_batch=(2,),
    verify_batch_ks=(4,),
    mtp=True,
    fragment_slots=True,
    sampling=sm.Sampling(0.7, top_p=0.9, seed=7),
)


def _variants():
    return [Variant("xla-repeat", "xla"), Variant("fused", "xla", step="fused"), *default_variants(["oracle"])[0]]


def test_the_sampled_diff_passes_and_its_plain_sampling_control_fires(eng):
    report = run_diff(eng, SAMPLED, _variants())
    assert report["verdict"] == "PASS", report["reasons"]
    (shape,) = report["shapes"]
    assert shape["plain_sampling"]["ok"] and shape["plain_sampling"]["tokens"] > 6
    assert not shape["plain_sampling_control"]["ok"], "the control changes a seed: it must see a difference"
    assert {c["variant"] for c in shape["comparisons"]} == {"xla-repeat", "fused", "oracle"}
    assert all(c["ok"] for c in shape["comparisons"]) and shape["full_accepts"] and shape["partial_accepts"]
    assert report["sampling"] == "T 0.7, top-p 0.9, seed 7"
    assert "plain sampling: " in render_summary(report)


def test_a_verify_reading_the_previous_positions_noise_fails_the_sampled_diff(tiny, monkeypatch):
    """The planted bug: the verify draws row t's token with position p - 1's noise (the decode and
    the drafter stay right). Replays agree with the buggy reference; plain sampling does not, from
    the tokens of the first verify on."""
    real_rows, real_draw = tr.step_rows, tr._draw

    def buggy(pool, params, batch, rows=None, *, static):
        if not (static.verify and static.samples):
            return real_rows(pool, params, batch, rows, static=static)
        monkeypatch.setattr(tr, "_draw", lambda logits, r, seq, pos: real_draw(logits, r, seq, pos - 1))
        try:
            return real_rows(pool, params, batch, rows, static=static)
        finally:
            monkeypatch.setattr(tr, "_draw", real_draw)

    monkeypatch.setattr(tr, "step_rows", buggy)
    cfg, params = tiny
    engine = Engine(cfg, params, settings(max_batch_size=4, max_seq_len=96, speculative=True, num_drafts=3))
    report = run_diff(engine, SAMPLED, [Variant("xla-repeat", "xla")])
    (shape,) = report["shapes"]
    assert report["verdict"] == "FAIL" and not shape["plain_sampling"]["ok"]
    seq, at = shape["plain_sampling"]["first_mismatch"]
    assert at <= shape["accepted"][0][seq] + 1, "the first verify's draws already differ"
    assert any("plain sampling emitted other tokens" in r for r in report["reasons"])


# ---------------------------------------------------------------- rejection speculative sampling


def test_rejection_rows_lay_out_the_verdict_for_the_greedy_rule():
    """The verify's rows under rejection: accepted drafts, then the emitted token, then -1; greedy
    acceptance of them (the host's and the fused step's rule) finds the verdict's count."""
    v = 6
    p = jnp.asarray(np.random.default_rng(1).dirichlet(np.ones(v), size=(16, 3)), jnp.float32)
    q = jnp.asarray(np.random.default_rng(2).dirichlet(np.ones(v), size=(16, 2)), jnp.float32)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, v, size=(16, 3)), jnp.int32)
    lens = jnp.asarray([3, 2, 1, 0] * 4, jnp.int32)
    seeds, pos = jnp.arange(16, dtype=jnp.int32), jnp.full((16,), 5, jnp.int32)
    got = np.asarray(sm.rejection_rows(p, q, tokens, lens, seeds, pos))
    na, x = (np.asarray(a) for a in jax.vmap(sm.rejection_verdict)(p, q, tokens[:, 1:], lens - 1, seeds, pos))
    for b in range(16):
        want = [*np.asarray(tokens[b, 1 : 1 + na[b]]).tolist(), x[b]] + [-1] * (2 - na[b])
        assert got[b].tolist() == want
    assert np.asarray(tr.greedy_accepts(tokens, jnp.asarray(got), lens)).tolist() == na.tolist()
    assert 0 < na.sum() and (na[lens > 1] < lens[lens > 1] - 1).any(), "accepts and rejections both"


@pytest.fixture(scope="module")
def rejection_eng(tiny):
    cfg, params = tiny
    s = settings(max_batch_size=8, max_seq_len=160, speculative=True, num_drafts=3, speculative_sampling="rejection")
    return Engine(cfg, params, s)


def test_rejection_keeps_the_drafter_laws_only_when_asked(rejection_eng, tiny):
    assert rejection_eng.counts.draft_prob_rows == 3
    assert rejection_eng.pool.draft_probs.shape == (9, 3, tiny[0].vocab_size)
    plain = settings(max_batch_size=8, max_seq_len=160, speculative=True, num_drafts=3)
    assert plain.speculative_sampling == "gumbel" and sm.SPECULATIVE_MODES == ("gumbel", "rejection")


def test_rejection_at_temperature_zero_is_greedy_and_fused_equals_composed(rejection_eng):
    """Temperature-0 rows of a rejection program (every law a one-hot of the first argmax) emit
    greedy decoding's tokens, beside a sampled row (an all-greedy run takes the greedy programs);
    the fused step emits the composed path's tokens, the sampled row's included (same seeds)."""
    greedy = greedy_generate(rejection_eng, PROMPTS, 16)
    p = [sm.Sampling(), sm.Sampling(temperature=1.0, seed=1), sm.Sampling(top_k=3, seed=4)]
    runs = [speculative_generate(rejection_eng, PROMPTS, 16, DraftSchedule(3), fused=f, sampling=p) for f in (0, 1)]
    for r in runs:
        assert r.tokens[0] == greedy[0] and r.tokens[2] == greedy[2] and r.tokens[1] != greedy[1]
    assert runs[0].tokens == runs[1].tokens


def test_a_swap_carries_the_pending_drafts_laws(rejection_eng):
    """A sequence swapped out between its propose and its verify takes its drafter laws along,
    into whatever slot it is swapped into."""
    eng = rejection_eng
    s, blocker = eng.alloc_sequence(), eng.alloc_sequence()
    eng.prefill(s, PROMPTS[0])
    eng.propose_batched([s], [5], 3, [sm.Sampling(1.0, seed=3)])
    laws = np.asarray(eng.pool.draft_probs[s.slot])
    np.testing.assert_allclose(laws.sum(-1), 1.0, rtol=1e-5)
    record, held = eng.save_sequence_state(s), s.slot
    eng.free_sequence(s)
    taken, back = eng.alloc_sequence(), eng.alloc_sequence()
    eng.restore_sequence_state(back, record)
    assert taken.slot == held != back.slot
    assert np.array_equal(np.asarray(eng.pool.draft_probs[back.slot]), laws)
    for x in (back, taken, blocker):
        eng.free_sequence(x)


def test_rejection_refuses_a_draft_source(rejection_eng):
    with pytest.raises(EngineError, match="draft source"):
        speculative_generate(
            rejection_eng, PROMPTS[:1], 4, DraftSchedule(2), lambda i, t, n: [0] * n, sampling=sm.Sampling(1.0)
        )


LAW_SEEDS, LAW_WIDTH = 20480, 128
LAW = sm.Sampling(temperature=1.0, top_k=6)
#: Cuts a fair share of first drafts: the stop must keep the law (it reads the drafter's top probability).
LAW_SCHEDULE = DraftSchedule(2, confidence_stop=-0.6)


@pytest.fixture(scope="module")
def law_eng():
    """`small` (a trained drafter: drafts are accepted and rejected), 128 slots that all verify 2 drafts."""
    cfg, params = resolve_checkpoint("small")
    s = settings(
        max_batch_size=LAW_WIDTH,
        max_seq_len=64,
        speculative=True,
        num_drafts=2,
        mtp_max_seqs=LAW_WIDTH,
        mtp_k_ladder=f"{LAW_WIDTH}:2",
        speculative_sampling="rejection",
    )
    return Engine(cfg, params, s)


def _two_sample_chi_square(a: np.ndarray, b: np.ndarray) -> tuple[float, int, float]:
    """Pearson's chi-square of a 2 x cells contingency table (cells with fewer than 10 counts in
    both samples together pooled into one): (statistic, degrees of freedom, p-value)."""
    keep = a + b >= 10
    a = np.append(a[keep], a[~keep].sum())
    b = np.append(b[keep], b[~keep].sum())
    a, b = (a, b) if b[-1] + a[-1] else (a[:-1], b[:-1])
    table = np.stack([a, b]).astype(np.float64)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    dof = table.shape[1] - 1
    return stat, dof, float(jax.scipy.special.gammaincc(dof / 2, stat / 2))


def test_rejection_emits_plain_samplings_law(law_eng):
    """The law of the first two tokens after a fixed prompt, over 20,480 seeds: token 1 is the
    prefill's draw (the same in both modes); token 2 is, under rejection, the engine's propose
    (2 drafts drawn with the drafter's keys, their laws in the pool), the confidence stop's cut
    and the verify (rejection rows), against plain sampling's draw at that position from the
    same logits. 128 sequences share the prompt's state: each batch of seeds proposes, verifies
    and rolls the verify back."""
    eng, v = law_eng, law_eng.cfg.vocab_size
    prompt = [int(x) for x in b"def f(x):\n    return "]
    seqs = [eng.alloc_sequence() for _ in range(LAW_WIDTH)]
    logits = [eng.prefill(s, prompt) for s in seqs][0]
    pos = len(prompt)
    spec, plain = np.zeros((v, v), np.int64), np.zeros((v, v), np.int64)
    accepted = cut = 0
    for start in range(0, LAW_SEEDS, LAW_WIDTH):
        each = [sm.Sampling(LAW.temperature, LAW.top_k, seed=start + i) for i in range(LAW_WIDTH)]
        rows = _rows(each)
        first = np.asarray(_draw(jnp.tile(jnp.asarray(logits)[None], (LAW_WIDTH, 1)), rows, jnp.full(LAW_WIDTH, pos)))
        proposed, confidences, _ = eng.propose_batched(seqs, first.tolist(), 2, each)
        drafts = [LAW_SCHEDULE.cut(d, c, 2)[0] for d, c in zip(proposed, confidences)]
        ks = [len(d) + 1 for d in drafts]
        verify_logits, out = eng.verify_batched(
            seqs, [t for f, d in zip(first, drafts) for t in (int(f), *d)], ks, each
        )
        eng.rollback_verify(seqs)
        for s in seqs:
            eng.trim_proposer(s)
        row0 = np.cumsum([0, *ks])[:-1]
        second = out[row0]
        accepted += sum(bool(d) and int(x) == d[0] for d, x in zip(drafts, second))
        cut += ks.count(1)
        drawn = np.asarray(_draw(jnp.asarray(verify_logits[row0]), rows, jnp.full(LAW_WIDTH, pos + 1)))
        np.add.at(spec, (first, second), 1)
        np.add.at(plain, (first, drawn), 1)
    stat, dof, pval = _two_sample_chi_square(spec.ravel(), plain.ravel())
    print(f"rejection vs plain, first two tokens: chi2 {stat:.2f}, dof {dof}, p {pval:.4f}, {LAW_SEEDS} seeds;")
    print(f"first draft accepted {accepted / LAW_SEEDS:.3f}, cut by the confidence stop {cut / LAW_SEEDS:.3f}")
    assert pval > 1e-3, (stat, dof, pval)
    assert 0.05 < accepted / LAW_SEEDS < 0.95, "both the accept and the residual path must be exercised"
    assert 0.05 < cut / LAW_SEEDS < 0.95, "the confidence stop must cut some first drafts and keep others"
    for s in reversed(seqs):
        eng.free_sequence(s)
