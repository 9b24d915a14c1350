"""The draft-schedule research API (`metrale_jax.research`) on the shipped small model: the tidy
run tables (shapes by chex), their invariants, schedules, summaries, calibration, the cut-off
replay, and its refusals. Shares `study_for("small")` (one engine, compiled once) with
test_small_model and the notebooks."""

from pathlib import Path

import chex
import numpy as np
import pytest

from metrale_jax import research
from metrale_jax.engine.capacity import DEFAULT_K_LADDER
from metrale_jax.engine.sampling import Sampling, per_sequence
from metrale_jax.engine.speculative import greedy_generate
from metrale_jax.tokenizer import HFTokenizer, load_tokenizer

P, NEW, D = 8, 16, 3


@pytest.fixture(scope="module")
def study():
    return research.study_for("small")


@pytest.fixture(scope="module")
def prompts():
    return research.heldout_prompts(P, 64, seed=5)


@pytest.fixture(scope="module")
def run(study, prompts):
    return study.run(prompts, NEW, research.flat_schedule(D), width=4)


def test_run_tables_have_tidy_shapes(run):
    n = run.seq.shape[0]
    chex.assert_shape(
        [
            run.group,
            run.step,
            run.seq,
            run.active,
            run.proposed,
            run.drafted,
            run.accepted,
            run.verify_rows,
            run.emitted,
        ],
        (n,),
    )
    chex.assert_shape([run.confidence], (n, D))
    chex.assert_shape([run.reached, run.accepted_at], (n, D))
    chex.assert_type([run.seq, run.drafted, run.accepted], int)
    per = run.per_sequence()
    chex.assert_shape(list(per.values()), (P,))
    steps = run.per_step()
    chex.assert_equal_shape(list(steps.values()))
    assert steps["emitted"].sum() == run.emitted.sum() and steps["active"].sum() == n
    assert len(run.records()) == n and len(run.tokens) == P


def test_run_invariants(run):
    assert sorted(set(run.group.tolist())) == [0, 1]  # 8 prompts at width 4
    assert (run.active <= 4).all() and (run.drafted == run.proposed).all() and (run.drafted == D).all()
    assert (run.accepted <= run.drafted).all()
    np.testing.assert_array_equal(run.accepted_at.sum(1), run.accepted)
    assert not (run.accepted_at & ~run.reached).any()
    np.testing.assert_array_equal(np.isnan(run.confidence), np.arange(D)[None] >= run.drafted[:, None])
    assert (run.confidence[~np.isnan(run.confidence)] <= 0).all()
    per = run.per_sequence()
    # the prefill's argmax is the first generated token; the verify steps emit the rest (or more)
    assert (per["emitted"] + 1 >= NEW).all() and (per["emitted"] - per["accepted"] == per["steps"]).all()
    assert all(len(t) == NEW for t in run.tokens)


def test_summary_and_calibration(run):
    s = run.summary()
    chex.assert_shape([s["acceptance_by_position"], s["conditional_acceptance_by_position"]], (D,))
    assert s["acceptance_by_position"][0] == s["conditional_acceptance_by_position"][0]
    assert 1.0 <= s["mean_accepted_length"] <= D + 1
    assert s["tokens_per_verify_row"] == pytest.approx(run.emitted.sum() / run.verify_rows.sum())
    cal = run.calibration(bins=5)
    chex.assert_shape(cal.edges, (6,))
    chex.assert_shape([cal.mean_confidence, cal.acceptance, cal.count], (5,))
    assert cal.count.sum() == run.reached.sum()
    assert run.calibration(bins=5, position=0).count.sum() == run.reached[:, 0].sum()
    ok = cal.count > 0
    assert ((cal.mean_confidence[ok] >= cal.edges[:-1][ok]) & (cal.mean_confidence[ok] <= cal.edges[1:][ok])).all()


def test_cutoff_replay_bounds(run):
    t = run.cutoff_tradeoff([-np.inf, np.log(0.3), np.log(0.6), 0.1])
    chex.assert_shape(list(t.values()), (4,))
    assert t["rows_saved"][0] == 0 and t["tokens_lost"][0] == 0
    assert t["tokens_per_verify_row"][-1] == 1.0  # every draft cut: one row, one token per step
    assert (np.diff(t["rows_saved"]) >= 0).all() and (np.diff(t["tokens_lost"]) >= 0).all()


def test_confidence_stop_cuts_and_keeps_the_output(study, prompts, run):
    stop = float(np.log(0.5))
    cut = study.run(prompts, NEW, research.flat_schedule(D, confidence_stop=stop), width=4)
    assert cut.tokens == run.tokens
    assert (cut.drafted <= cut.proposed).all() and (cut.drafted < cut.proposed).any()
    assert (cut.confidence[~np.isnan(cut.confidence)] >= stop).all()


def test_ladder_drafts_by_width(study, prompts):
    sched = research.ladder_schedule(D, "2:3,8:1")
    assert sched.ladder == ((2, 3), (8, 1)) and research.ladder_schedule(2).ladder == DEFAULT_K_LADDER
    run = study.run(prompts, 8, sched, width=8)
    np.testing.assert_array_equal(run.proposed, np.where(run.active <= 2, 3, 1))
    rows = study.sweep(prompts[:4], 8, {"flat": research.flat_schedule(1)}, widths=[4])
    assert [(r["label"], r["width"], r["num_drafts"], r["run"].width) for r in rows] == [("flat", 4, 1, 4)]


def test_refusals(study, prompts):
    with pytest.raises(ValueError, match="max_drafts"):
        study.run(prompts, 4, research.flat_schedule(9))
    with pytest.raises(ValueError, match="width 40"):
        study.run(prompts, 4, research.flat_schedule(1), width=40)
    with pytest.raises(ValueError, match="max_seq_len"):
        study.run(prompts, 500, research.flat_schedule(1))
    with pytest.raises(ValueError, match="n_max"):
        research.ladder_schedule(2, "8:1,4:3")
    with pytest.raises(ValueError, match="MTP"):
        research.Study(research.study_for("small").cfg.replace(num_mtp_layers=0), {})


def test_heldout_prompts_are_deterministic_lines():
    a, b = research.heldout_prompts(4, 32, seed=9), research.heldout_prompts(4, 32, seed=9)
    assert a == b and all(len(p) == 32 for p in a)
    with pytest.raises(ValueError, match="held-out prompts"):
        research.heldout_prompts(10**7, 32)


# ---- any checkpoint, with its own tokenizer ----

HF_CHAT = Path(__file__).parent / "fixtures" / "hf" / "qwen3_5_dense"
QWEN_BPE = Path(__file__).parent / "fixtures" / "tokenizers" / "qwen_bpe"


def test_heldout_prompts_through_a_checkpoint_tokenizer():
    tok = load_tokenizer(str(QWEN_BPE))
    a = research.heldout_prompts(6, 24, seed=4, tokenizer=tok)
    assert a == research.heldout_prompts(6, 24, seed=4, tokenizer=tok) and all(len(p) == 24 for p in a)
    assert a != research.heldout_prompts(6, 24, seed=4)  # not bytes
    assert max(max(p) for p in a) > 255
    for p in a:  # each starts a line of a held-out file and is that file's encoding there
        text = tok.decode(p)
        assert tok.encode(text) == p
    assert research.heldout_prompts(2, 24, seed=4, tokenizer=research.study_for("small").tokenizer) == (
        research.heldout_prompts(2, 24, seed=4)
    )


def test_a_study_of_an_hf_checkpoint_runs_its_own_tokens():
    study = research.study_for(str(HF_CHAT), max_width=2, max_drafts=2, max_seq_len=64)
    assert isinstance(study.tokenizer, HFTokenizer)
    prompts = research.heldout_prompts(2, 16, seed=1, tokenizer=study.tokenizer)
    assert all(max(p) < study.cfg.vocab_size for p in prompts)
    run = study.run(prompts, 6, research.flat_schedule(2))
    assert run.tokens == study.greedy(prompts, 6)


def test_coupling_run_matches_plain_sampling_and_its_bounds(tiny):
    """Gumbel speculative sampling with both laws kept (tiny model, two prompts): sampled, its tokens
    are plain sampling's with the same seeds (prompt i seeded seed + i); a verify accepts the leading
    matches; at temperature 0 a draft matches exactly where the two one-hot laws agree (TV 0, else 1);
    sampled, the pooled match rate lies within four standard errors of [mean (1 - TV) / (1 + TV),
    mean (1 - TV)]."""
    cfg, params = tiny
    study = research.Study(cfg, params, max_width=2, max_drafts=2, max_seq_len=64)
    prompts = [[int(x) for x in np.random.default_rng(3).integers(0, 256, size=n)] for n in (7, 12)]
    sampled = Sampling(temperature=0.7, top_p=0.9, seed=11)
    for sampling in (Sampling(), sampled):
        c = study.coupling(prompts, 12, 2, sampling)
        n = len(c.run.seq)
        chex.assert_shape([c.match, c.tv], (n, 2))
        np.testing.assert_array_equal(c.run.accepted, np.cumprod(c.match, axis=1).sum(1))
        assert ((c.tv >= -1e-6) & (c.tv <= 1 + 1e-6)).all()
        b = c.bounds()
        assert (b["lower"] <= b["upper"] + 1e-9).all()
        if sampling.greedy:
            np.testing.assert_array_equal(c.match, c.tv < 0.5)
            np.testing.assert_allclose(c.tv, np.round(c.tv), atol=1e-6)
        else:
            plain = greedy_generate(study.engine, prompts, 12, sampling=per_sequence(sampled, 2))
            assert c.run.tokens == plain
            rate, lower, upper = b["pooled"]
            se = np.sqrt(max(lower * (1 - lower), 0.05) / c.match.size)
            assert lower - 4 * se <= rate <= upper + 4 * se, b


def test_rejection_coupling_run_is_the_engines_step_and_accepts_at_one_minus_tv(tiny):
    """Rejection speculative sampling with both laws kept (tiny model, two prompts): its composed
    loop emits the tokens of the engine's fused step in the same mode (`Study.sampled`, same
    seeds), which differ from gumbel's; a draft's match is its acceptance; over the reached
    positions the acceptance lies within four standard errors of mean 1 - TV there (its expected
    value). Gumbel's `sampled` run emits plain sampling's tokens."""
    cfg, params = tiny
    study = research.Study(cfg, params, max_width=2, max_drafts=2, max_seq_len=64)
    prompts = [[int(x) for x in np.random.default_rng(4).integers(0, 256, size=n)] for n in (9, 5)]
    sampling = Sampling(temperature=1.0, top_p=0.9, seed=3)
    c = study.coupling(prompts, 16, 2, sampling, speculative_sampling="rejection")
    assert c.speculative_sampling == "rejection" and study.serving(2, "rejection").counts.rejection
    fused = study.sampled(prompts, 16, 2, sampling, "rejection")
    assert fused.tokens == c.run.tokens and fused.schedule.num_drafts == 2
    np.testing.assert_array_equal(c.match, c.run.accepted_at)
    gumbel = study.sampled(prompts, 16, 2, sampling)
    assert gumbel.tokens == greedy_generate(study.engine, prompts, 16, sampling=per_sequence(sampling, 2))
    assert gumbel.tokens != c.run.tokens
    b = c.reached_bounds()
    chex.assert_shape([b["acceptance"], b["lower"], b["upper"]], (2,))
    rate, lower, upper = b["pooled"]
    assert lower <= upper and rate == pytest.approx(c.run.accepted_at.sum() / c.run.reached.sum())
    se = np.sqrt(max(upper * (1 - upper), 0.05) / c.run.reached.sum())
    assert upper - 4 * se <= rate <= upper + 4 * se, b
    with pytest.raises(ValueError, match="speculative_sampling"):
        study.serving(2, "typical")


def _mappings() -> int:
    with open("/proc/self/maps") as f:
        return len(f.readlines())


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="counts Linux memory mappings")
def test_a_study_keeps_one_speculative_serve_and_frees_a_released_ones_programs(tiny):
    """A study holds at most one speculative serve (plus the plain one): building the serve of
    another draft count or mode releases the previous one, and its compiled programs' memory
    mappings (XLA CPU: ~3 per kernel) go with it, so a sweep over draft counts cannot pile them
    up to vm.max_map_count; `release` drops every serve."""
    cfg, params = tiny
    study = research.Study(cfg, params, max_width=2, max_drafts=2, max_seq_len=32)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    start = _mappings()
    study.run(prompts, 4, research.flat_schedule(1))
    grown = _mappings() - start
    study.greedy(prompts, 4)
    assert study.live_serves() == [(2, "gumbel")] and grown > 300
    study.serving(None)
    study.serving(1)
    study.serving(2, "rejection")
    assert study.live_serves() == [(None, "gumbel"), (2, "rejection")]
    assert _mappings() - start < grown / 4
    study.release()
    assert study.live_serves() == []
