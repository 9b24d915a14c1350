"""Gumbel speculative sampling on the paths that move a sequence's state: with prefix caching on (a
request restores a cached prefix's snapshot) and after a swap (a sequence spilled mid-generation
and restored into another slot), it emits exactly the tokens plain sampling emits for the same
seeds without the cache and without the swap, at num_drafts 1..3, T 0.3 / 0.7 / 1.0, composed and
fused; on `small` (a trained drafter) with drafts accepted. Plain sampling on a hidden-width model
(`qwen3-next-h512`): the same seed gives the same tokens at n = 1 and n = 8, in any slot, composed
or fused, and in another process.

The claim is token for token, as the greedy oracle tests' (tests/test_prefix_cache.py): a restored
prefill equals the computed one split at the restore position byte for byte, but not the unsplit
one, so plain sampling's tokens are the reference, not the bytes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import resolve_checkpoint, settings
from conversations import conversations, random_tokens

from metrale_jax.engine.engine import Engine
from metrale_jax.engine.sampling import Sampling
from metrale_jax.engine.speculative import (
    DraftSchedule,
    Generation,
    GenerationResult,
    Scheduler,
    SchedulerState,
    SequenceParams,
    greedy_generate,
    speculative_generate,
)

TEMPERATURES = (0.3, 0.7, 1.0)
PROMPTS = [random_tokens(40 + n, n) for n in (9, 17, 30)]


def _sampling(t: float, n: int, base: int = 3) -> list[Sampling]:
    return [Sampling(temperature=t, top_p=0.9, seed=base + 10 * i) for i in range(n)]


def _engine(cfg, params, cache: bool, slots: int = 6) -> Engine:
    flags = dict(max_batch_size=slots, max_seq_len=256, speculative=True, num_drafts=3, block_size=16)
    return Engine(cfg, params, settings(**flags, enable_prefix_caching=cache, ssm_cache_slots=4, max_prefill_tokens=32))


@pytest.fixture(scope="module")
def cached(tiny):
    return _engine(*tiny, cache=True)


@pytest.fixture(scope="module")
def uncached(tiny):
    return _engine(*tiny, cache=False)


def swapped_generate(
    eng: Engine,
    prompts: list[list[int]],
    max_new_tokens: int,
    num_drafts: int,
    sampling: list[Sampling],
    *,
    fused: bool,
    swap_before: tuple[int, ...],
    namespace: str | None = None,
) -> tuple[GenerationResult, list[list[int]]]:
    """`speculative_generate` (MTP drafts) with every live sequence spilled and restored before
    each step in `swap_before`, its drafts pending: each is saved, restored into a fresh sequence
    allocated while it still holds its own slot (so another slot, other blocks), then freed.
    Returns the result and each sequence's slots in order."""
    scheduler = Scheduler(eng, DraftSchedule(num_drafts), None, fused)
    gens = []
    try:
        for p, s in zip(prompts, sampling):
            gens.append(Generation(SequenceParams(max_new_tokens, sampling=s), eng.alloc_sequence(namespace), []))
            gens[-1].tokens.append(eng.prefill_sampled(gens[-1].seq, p, s)[1])
        state = SchedulerState(gens, list(range(len(gens))))
        slots = [[g.seq.slot] for g in gens]
        scheduler.next_drafts(state, None)
        while state.active:
            if len(state.steps) in swap_before:
                for i in state.active:
                    g = gens[i]
                    record, back = eng.save_sequence_state(g.seq), eng.alloc_sequence(namespace)
                    eng.free_sequence(g.seq)
                    g.seq = back
                    eng.restore_sequence_state(back, record)
                    slots[i].append(back.slot)
            scheduler.advance(state)
        return state.result(), slots
    finally:
        for g in reversed(gens):
            eng.free_sequence(g.seq)


def _accepted(result: GenerationResult) -> int:
    return sum(sum(s.accepted) for s in result.steps)


# ---------------------------------------------------------------- prefix caching on


@pytest.mark.parametrize("num_drafts", [1, 2, 3])
def test_gumbel_with_prefix_cache_emits_plain_samplings_tokens_without_it(cached, uncached, num_drafts):
    """Multi-turn conversations (test_prefix_cache's: misses, partial hits on a shared system
    prompt, hits on each conversation's own history) generate with the cache on, MTP drafts and
    gumbel speculative sampling, composed and fused, exactly the tokens plain sampling generates
    without the cache, at T 0.3 / 0.7 / 1.0."""
    assert cached.blocks.prefix is not None
    for t in TEMPERATURES:
        p = _sampling(t, 2, base=num_drafts)
        plain = conversations(uncached, 3, lambda e, ps, p=p: greedy_generate(e, ps, 10, sampling=p))
        for fused in (False, True):
            cached.blocks.default_namespace = f"sampled-{num_drafts}-{t}-{fused}"
            hits = cached.blocks.prefix.hits
            got = conversations(
                cached,
                3,
                lambda e, ps, p=p, f=fused: (
                    speculative_generate(e, ps, 10, DraftSchedule(num_drafts), fused=f, sampling=p).tokens
                ),
            )
            assert got == plain, (t, fused)
            assert cached.blocks.prefix.hits - hits >= 5, "the conversations restore cached prefixes"
    cached.blocks.default_namespace = None


# ---------------------------------------------------------------- after a swap


@pytest.mark.parametrize("fused", [False, True])
def test_gumbel_after_a_swap_emits_plain_samplings_tokens(uncached, fused):
    """Three sequences spilled with their drafts pending before steps 2 and 5 and restored into
    other slots each time keep emitting plain sampling's tokens, at num_drafts 1..3 and
    T 0.3 / 0.7 / 1.0."""
    for t in TEMPERATURES:
        p = _sampling(t, 3)
        ref = greedy_generate(uncached, PROMPTS, 24, sampling=p)
        for nd in (1, 2, 3):
            result, slots = swapped_generate(uncached, PROMPTS, 24, nd, p, fused=fused, swap_before=(2, 5))
            assert result.tokens == ref, (t, nd)
            assert all(len(set(s)) == 3 for s in slots), slots


# ---------------------------------------------------------------- on `small`: drafts accepted


@pytest.fixture(scope="module")
def small_cached():
    return _engine(*resolve_checkpoint("small"), cache=True, slots=4)


def test_gumbel_on_small_with_a_restore_and_a_swap_accepts_drafts_and_emits_plain_sampling(small_cached):
    """`small`'s trained drafter: a request restoring a primed prefix (namespace of its own) and
    swapped twice mid-generation emits, composed and fused, plain sampling's tokens computed
    without a restore, with drafts accepted at every temperature."""
    eng = small_cached
    assert eng.blocks.prefix is not None
    system = [int(x) for x in b"def fibonacci(n):\n    if n < 2:\n        return n\n    return "]
    prompts = [system + [int(x) for x in tail] for tail in (b"fib", b"(n - 1)")]
    for t in TEMPERATURES:
        p = _sampling(t, 2)
        ref = greedy_generate(eng, prompts, 32, sampling=p)  # no namespace: computed, nothing cached
        for fused in (False, True):
            ns = f"small-{t}-{fused}"
            primer = eng.alloc_sequence(ns)
            eng.prefill(primer, system)
            eng.free_sequence(primer)
            hits = eng.blocks.prefix.hits
            result, _ = swapped_generate(eng, prompts, 32, 3, p, fused=fused, swap_before=(2, 4), namespace=ns)
            assert result.tokens == ref, (t, fused)
            assert eng.blocks.prefix.hits - hits >= 2, "both requests restore the primed prefix"
            print(f"small T {t} fused {fused}: {_accepted(result)} drafts accepted in {len(result.steps)} steps")
            assert _accepted(result) > 0, "the trained drafter's drafts are accepted"


# ---------------------------------------------------------------- plain sampling at a hidden width

WIDE = "qwen3-next-h512"
WIDE_SAMPLING = [Sampling(temperature=0.8, top_p=0.95, seed=s) for s in (7, 8, 9)]


def wide_model():
    """(cfg, params) of the hidden-width model, seeded as the benchmarks seed it (seed 0)."""
    from metrale_jax.model_registry import config
    from metrale_jax.params import init_params

    cfg = config(WIDE)
    return cfg, init_params(cfg, 0)


def wide_prompts(vocab: int) -> list[list[int]]:
    return [[(37 * i * n + 11) % vocab for i in range(n)] for n in (9, 17, 30)]


def wide_alone(eng: Engine, fused: bool | None) -> list[list[int]]:
    """Each of the three prompts sampled alone (n = 1): plain (`fused` None), or gumbel
    speculative, fused or composed, 2 drafts."""
    prompts = wide_prompts(eng.cfg.vocab_size)
    if fused is None:
        return [greedy_generate(eng, [pr], 12, sampling=[s])[0] for pr, s in zip(prompts, WIDE_SAMPLING)]
    return [
        speculative_generate(eng, [pr], 12, DraftSchedule(2), fused=fused, sampling=[s]).tokens[0]
        for pr, s in zip(prompts, WIDE_SAMPLING)
    ]


@pytest.fixture(scope="module")
def wide():
    cfg, params = wide_model()
    return Engine(cfg, params, settings(max_batch_size=8, max_seq_len=64, speculative=True, num_drafts=2))


def test_plain_sampling_at_a_hidden_width_draws_by_seed_in_any_slot_and_width(wide):
    """At hidden 512 (products of 256 KiB and more, whose path follows the row count): the same
    seeds give the same tokens alone and among 8 sequences in other slots, plain and speculative
    (composed and fused); other seeds give other tokens."""
    alone = wide_alone(wide, None)
    prompts = wide_prompts(wide.cfg.vocab_size)
    mixed = [Sampling(temperature=1.0, top_k=5, seed=100 + i) for i in range(8)]
    where = (6, 1, 3)
    for i, s in zip(where, WIDE_SAMPLING):
        mixed[i] = s
    rows = [prompts[where.index(i)] if i in where else prompts[i % 3] for i in range(8)]
    wide8 = greedy_generate(wide, rows, 12, sampling=mixed)
    assert [wide8[i] for i in where] == alone
    for fused in (False, True):
        assert wide_alone(wide, fused) == alone, fused
    other = greedy_generate(wide, prompts[:1], 12, sampling=[Sampling(temperature=0.8, top_p=0.95, seed=70)])
    assert other[0] != alone[0]


@pytest.mark.parametrize("model", ["tiny", WIDE])
def test_plain_sampling_is_the_same_in_another_process(tiny, model):
    """A fresh interpreter draws the same tokens for the same seeds as this one (keys from
    (seed, position) only; weights from their seed or files)."""
    cfg, params = tiny if model == "tiny" else wide_model()
    eng = Engine(cfg, params, settings(max_batch_size=2, max_seq_len=64))
    here = wide_alone(eng, None)
    code = (
        f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        "import conftest, test_sampling_paths as t; "
        f"m = {model!r}; cfg, params = conftest.resolve_checkpoint(m) if m == 'tiny' else t.wide_model(); "
        "eng = t.Engine(cfg, params, conftest.settings(max_batch_size=2, max_seq_len=64)); "
        "print(json.dumps(t.wide_alone(eng, None)))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == here
