"""Section `e2e`: steady-state tokens/s of speculative generation against plain greedy generation, in one run.

Owns: `OracleDrafts` (a draft source that replays the greedy continuation with a planted per-position
acceptance) and `run`; a call is timed by `metrale_jax.engine.throughput.StepClock`.

Cases, each over n prompts generated together:
- `small` (the shipped preset, its trained MTP head drafting): n held-out text prompts, `speculative_generate`
  with d drafts per verify under the engine's default K ladder, fused (one program per step) and, at the
  largest d, composed (the separate verify, stash, fold, commit and propose programs; `modes_at`), against
  `greedy_generate`;
- the realistic-width model (`e2e_oracle_model`, random weights) with oracle drafts (`OracleDrafts`), so
  the engine's cost is measured apart from a drafter's quality;
- `small` sampled (`e2e_sample_ns` prompts, temperature `e2e_temperature`, top-p `e2e_top_p`, prompt i
  seeded `seed` + i): both speculative sampling modes at the largest draft count, fused, against plain
  sampling on the non-speculative engine (the "sampled_rows" of the result): `gumbel` (the coupled MTP
  drafter) and `rejection` (the drafter samples its own drafts; accept with min(1, p/q)).

Engines: greedy runs on a non-speculative engine (a serve without --speculative: its decode runs no
drafter catch-up); each draft count d has its own speculative engine with num_drafts = d (verify rows are
padded to K_max = num_drafts + 1, so d drafts on a deeper engine would pay for rows it never fills).

Timing: one warm-up call of every (engine, mode) at each n first (it compiles every program and width
bucket the timed calls use: the same prompts take the same path). Then `e2e_rounds` rounds, each calling
greedy and every speculative variant once, in reversed order on odd rounds. A call's tokens/s is its
steady state (`metrale_jax.engine.throughput`): after the warm-up, the tokens emitted from its first progress
report (after the prefill) to its last over the time between them (tokens past max_new_tokens per prompt are
not counted). The ratio is the median of the per-round ratios speculative / greedy.

Invariant checked on every call: speculative generation emits exactly the greedy tokens ("same"); sampled
with `gumbel`, exactly plain sampling's tokens with the same seeds (`rejection` preserves only the law, which
tests/test_sampling.py checks; its "same" is None). Every row also gives the acceptance by draft position
(accepted / verified drafts at each position, over every step of its calls).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections.abc import Sequence

import numpy as np

from benchmarks import models
from benchmarks.settings import Settings
from benchmarks.steps import max_seq_len_for
from benchmarks.timing import Stats
from metrale_jax.engine.engine import Engine
from metrale_jax.engine.sampling import Sampling, per_sequence
from metrale_jax.engine.speculative import DraftSchedule, DraftSource, greedy_generate, speculative_generate
from metrale_jax.engine.throughput import StepClock
from metrale_jax.research import heldout_prompts

DRAFTER_MODEL = "small"
MODES = ("fused", "composed")


def modes_at(d: int, drafts: Sequence[int]) -> tuple[str, ...]:
    """The speculative modes timed at d drafts: fused at every draft count, composed (the reference path,
    whose cost the fused step removes) at the largest only.
    NOTE: a variant's warm-up compiles its programs at every width bucket the case reaches, and compiling
    is most of the section's time; composed at every draft count would add a third to it."""
    return MODES if d == max(drafts) else MODES[:1]


def _log(msg: str) -> None:
    print(f"[bench e2e] {msg}", file=sys.stderr, flush=True)


class OracleDrafts:
    """A `DraftSource` replaying each prompt's greedy continuation, every draft position right with
    probability `accept`: position j of prompt i's continuation is planted right or wrong once (seeded),
    and a wrong one is proposed as (the right token + 1) mod V. The planting depends on the position
    alone, so every call over the same prompts accepts the same drafts."""

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        continuation: Sequence[Sequence[int]],
        accept: float,
        *,
        vocab: int,
        seed: int,
    ):
        rng = np.random.default_rng(seed)
        self.prompt_lens = [len(p) for p in prompts]
        self.continuation = [list(c) for c in continuation]
        self.right = [rng.random(len(c)) < accept for c in continuation]
        self.vocab = vocab

    def __call__(self, prompt_index: int, committed: list[int], n: int) -> list[int]:
        """The n drafts after `committed` (prompt + emitted tokens, the last included)."""
        cont, right = self.continuation[prompt_index], self.right[prompt_index]
        start = len(committed) - self.prompt_lens[prompt_index]
        out = []
        for j in range(start, start + n):
            tok = cont[j] if j < len(cont) else 0
            out.append(tok if j < len(cont) and right[j] else (tok + 1) % self.vocab)
        return out


@dataclasses.dataclass
class Variant:
    """One speculative configuration of a case: its engine, draft count, mode and what its calls gave."""

    engine: Engine
    drafts: int
    mode: str
    rates: list[float] = dataclasses.field(default_factory=list)
    ratios: list[float] = dataclasses.field(default_factory=list)
    first_s: float = float("nan")
    tokens_per_verify: float = float("nan")
    verify_steps: int = 0
    same: bool = True
    exact: bool = True  # its tokens must equal the reference's (False: rejection sampling, the law only)
    verified: np.ndarray | None = None  # drafts verified at each position, over its calls
    accepted: np.ndarray | None = None  # drafts accepted at each position, over its calls

    def count(self, steps) -> None:
        """Add the drafts verified and accepted at each position by `steps` (`StepRecord`s)."""
        ks = np.array([k for st in steps for k in st.ks])
        acc = np.array([a for st in steps for a in st.accepted])
        pos = np.arange(self.drafts)[None, :]
        verified, accepted = (pos < ks[:, None] - 1).sum(0), (pos < acc[:, None]).sum(0)
        self.verified = verified if self.verified is None else self.verified + verified
        self.accepted = accepted if self.accepted is None else self.accepted + accepted

    def acceptance_by_position(self) -> list[float]:
        """Accepted / verified drafts at each draft position (NaN where none was verified)."""
        assert self.verified is not None and self.accepted is not None
        return [float(a / v) if v else float("nan") for a, v in zip(self.accepted, self.verified)]


def _case(
    greedy_engine: Engine,
    variants: list[Variant],
    prompts: list[list[int]],
    new_tokens: int,
    rounds: int,
    draft_source: DraftSource | None,
    reference: list[list[int]],
    sampling: Sampling | None,
) -> list[float]:
    """Warm up `variants` and time them against plain decoding (warmed up by the call that gave
    `reference`) over `prompts`, greedy or with `sampling` (prompt i seeded seed + i); fills each variant's
    figures and returns plain decoding's tokens/s per round."""
    per_prompt = per_sequence(sampling, len(prompts))

    def greedy() -> float:
        clock = StepClock(greedy_engine.programs)
        out = greedy_generate(greedy_engine, prompts, new_tokens, progress=clock, sampling=per_prompt)
        if out != reference:
            raise RuntimeError("plain generation is not deterministic across calls")
        return clock.rate()

    def spec(v: Variant) -> float:
        clock = StepClock(v.engine.programs)
        schedule = DraftSchedule(v.drafts, v.engine.settings.k_ladder)
        res = speculative_generate(
            v.engine,
            prompts,
            new_tokens,
            schedule,
            draft_source,
            fused=v.mode == "fused",
            progress=clock,
            sampling=per_prompt,
        )
        v.same = v.same and (res.tokens == reference or not v.exact)
        v.count(res.steps)
        v.verify_steps = len(res.steps)
        v.tokens_per_verify = res.emitted / max(sum(len(st.seqs) for st in res.steps), 1)
        return clock.rate()

    for v in variants:
        t0 = time.perf_counter()
        spec(v)
        v.first_s = time.perf_counter() - t0
    greedy_rates = []
    for r in range(rounds):
        order: list[Variant | None] = [None, *variants]
        rates: dict[int, float] = {}
        for item in order if r % 2 == 0 else reversed(order):
            if item is None:
                greedy_rates.append(greedy())
            else:
                rates[id(item)] = spec(item)
        for v in variants:
            v.rates.append(rates[id(v)])
            v.ratios.append(rates[id(v)] / greedy_rates[-1])
    return greedy_rates


def _engines(cfg, params, drafts: Sequence[int], *, max_batch: int, max_seq_len: int, speculative_sampling="gumbel"):
    """(the greedy engine, {d: the speculative engine with num_drafts = d and `speculative_sampling`})."""
    base = dict(max_batch_size=max_batch, max_seq_len=max_seq_len)
    greedy = Engine(cfg, params, models.settings(**base))
    spec = dict(base, speculative=True, speculative_sampling=speculative_sampling)
    return greedy, {d: Engine(cfg, params, models.settings(**spec, num_drafts=d)) for d in drafts}


def _rows(
    label: str,
    cfg,
    params,
    prompts_for,
    ns,
    drafts,
    new_tokens: int,
    rounds: int,
    oracle: float | None,
    seed: int,
    sampling: Sampling | None = None,
) -> list[dict]:
    """Every (n, d, mode) row of one model: `prompts_for(n)` gives n prompts; `oracle` the planted acceptance
    of oracle drafts (None: the engine's MTP drafter); `sampling`: plain and gumbel speculative sampling
    (prompt i seeded seed + i), fused only, both speculative sampling modes, instead of greedy decoding.
    NOTE: sampled rows time the fused step alone: the composed sampled path is what the tests check
    token for token, and each mode's warm-up compiles its own sampled programs."""
    longest = max(len(p) for p in prompts_for(max(ns)))
    max_seq_len = max_seq_len_for(longest + new_tokens + max(drafts) + 2)
    greedy_engine, spec_engines = _engines(cfg, params, drafts, max_batch=max(ns), max_seq_len=max_seq_len)
    rejection_engines = {}
    if sampling is not None:
        _, rejection_engines = _engines(
            cfg, params, drafts, max_batch=max(ns), max_seq_len=max_seq_len, speculative_sampling="rejection"
        )
    rows = []
    for n in ns:
        prompts = prompts_for(n)
        # The reference (with the oracle: the continuation it replays, past the last draft) is greedy's
        # warm-up call: it compiles every program the timed greedy calls run.
        t0 = time.perf_counter()
        continuation = greedy_generate(
            greedy_engine,
            prompts,
            new_tokens + (max(drafts) + 1 if oracle else 0),
            sampling=per_sequence(sampling, len(prompts)),
        )
        greedy_first = time.perf_counter() - t0
        reference = [c[:new_tokens] for c in continuation]
        source = (
            None if oracle is None else OracleDrafts(prompts, continuation, oracle, vocab=cfg.vocab_size, seed=seed)
        )
        variants = [
            Variant(spec_engines[d], d, mode)
            for d in drafts
            for mode in (modes_at(d, drafts) if sampling is None else MODES[:1])
        ] + [Variant(e, d, MODES[0], exact=False) for d, e in rejection_engines.items()]
        greedy_rates = _case(greedy_engine, variants, prompts, new_tokens, rounds, source, reference, sampling)
        g = Stats.of(greedy_rates)
        for v in variants:
            row = {
                "model": label,
                "drafter": "oracle" if oracle is not None else "MTP",
                "accept": oracle,
                "n": n,
                "new_tokens": new_tokens,
                "drafts": v.drafts,
                "k_ladder": v.engine.settings.k_ladder,
                "mode": v.mode,
                "greedy_tok_s": g.__dict__,
                "spec_tok_s": Stats.of(v.rates).__dict__,
                "ratio": Stats.of(v.ratios).__dict__,
                "tokens_per_verify_per_seq": v.tokens_per_verify,
                "verify_steps": v.verify_steps,
                "same_tokens": v.same if v.exact else None,
                "greedy_first_s": greedy_first,
                "spec_first_s": v.first_s,
                "sampling": None if sampling is None else sampling.describe(),
                "speculative_sampling": None if sampling is None else v.engine.settings.speculative_sampling,
                "acceptance_by_position": v.acceptance_by_position(),
            }
            _log(
                f"{label}{'' if sampling is None else ' ' + sampling.describe()} n={n} d={v.drafts} {v.mode}"
                f"{'' if sampling is None else ' ' + v.engine.settings.speculative_sampling}: "
                f"plain {g.median:.0f} tok/s, speculative "
                f"{statistics.median(v.rates):.0f} tok/s, x{row['ratio']['median']:.2f}, "
                f"{v.tokens_per_verify:.2f} tokens/verify/seq, same tokens {v.same}"
            )
            rows.append(row)
    return rows


def run(s: Settings) -> dict:
    """The section from the `e2e_*` fields of `s` (see the module docstring); a model whose list of n is
    empty is not run."""
    rows: list[dict] = []
    sampled: list[dict] = []
    sampling = Sampling(temperature=s.e2e_temperature, top_p=s.e2e_top_p, seed=s.seed)
    if s.e2e_ns or s.e2e_sample_ns:
        cfg, params = models.model(DRAFTER_MODEL)
        texts = heldout_prompts(max(s.e2e_ns + s.e2e_sample_ns), s.e2e_prompt_len, seed=s.seed)
    if s.e2e_ns:
        rows += _rows(
            DRAFTER_MODEL,
            cfg,
            params,
            lambda n: texts[:n],
            s.e2e_ns,
            s.e2e_drafts,
            s.e2e_new_tokens,
            s.e2e_rounds,
            None,
            s.seed,
        )
    if s.e2e_sample_ns:
        sampled = _rows(
            DRAFTER_MODEL,
            cfg,
            params,
            lambda n: texts[:n],
            s.e2e_sample_ns,
            [max(s.e2e_drafts)],
            s.e2e_new_tokens,
            s.e2e_rounds,
            None,
            s.seed,
            sampling,
        )
    if s.e2e_oracle_ns:
        ocfg, oparams = models.model(s.e2e_oracle_model)
        rng = np.random.default_rng(s.seed)
        randoms = rng.integers(0, ocfg.vocab_size, size=(max(s.e2e_oracle_ns), s.e2e_prompt_len)).tolist()
        rows += _rows(
            s.e2e_oracle_model,
            ocfg,
            oparams,
            lambda n: randoms[:n],
            s.e2e_oracle_ns,
            s.e2e_oracle_drafts,
            s.e2e_oracle_new_tokens,
            s.e2e_rounds,
            s.e2e_accept,
            s.seed,
        )
    return {
        "rounds": s.e2e_rounds,
        "prompt_len": s.e2e_prompt_len,
        "modes": list(MODES),
        "rows": rows,
        "sampled_rows": sampled,
    }
