"""Draft-schedule research on the engine: run greedy speculative decoding over a prompt set under
a schedule, get tidy per-step and per-sequence records, and summarise them.

Owns: `Study` (a model and the engines its runs share, so a sweep compiles each program once),
the schedule constructors (`flat_schedule`, `ladder_schedule`), `ScheduleRun` (the tidy arrays) with its
summaries (mean accepted length, acceptance by draft position, tokens per verify row, confidence
calibration, the trade-off of a confidence cut-off), `Study.sweep`, the wall-clock measurement
(`Study.throughput` -> `Throughput`, on `Study.serving` engines, each sized as a serve, and
`machine_label`, the machine it ran on), speculative sampling with both laws at every drafted
position in either mode (`coupled_generate`, `Study.coupling` -> `CouplingRun`, its match rates
against the coupling's bounds, its acceptance where reached against 1 - TV), speculative sampling
on the engine's own step in either mode (`Study.sampled` -> `ScheduleRun`), `study_for` (a cached
study of a checkpoint, with the checkpoint's own tokenizer) and `heldout_prompts` (prompts from
the small model's held-out text, encoded by a given tokenizer: bytes by default).

Invariants:
- Runs are greedy: every emitted token is the verify's argmax, so a run's tokens equal plain
  greedy decoding whatever the schedule (`speculative_generate`'s invariant); a schedule moves
  only acceptance and cost. A coupling run in gumbel mode samples: every emitted token is the
  target's draw at its position, so its tokens equal plain sampling with the same seeds. In
  rejection mode its tokens follow plain sampling's law (not its tokens); every draw is keyed by
  (seed, position, tag), so the composed loop emits the engine's fused step's tokens.
- In a coupling run the drafter's draft at drafted position j and the target's draw at verify row
  j condition on the same prefix (the anchor and drafts before j) and share the Gumbel noise of
  their position, so at every drafted position, reached or not, the match is a coupled draw:
  P(match) >= (1 - TV) / (1 + TV) of the two filtered laws there (Daliri, Musco and Suresh 2024),
  and no coupling exceeds 1 - TV. In rejection mode a draft at a reached position is accepted
  with probability exactly 1 - TV there (sum over x of min(p(x), q(x))); reaching it depends only
  on the draws before it, so the acceptance over reached positions estimates the mean 1 - TV there.
- Draft position j (0-based) of a step is *reached* when drafts 0..j-1 were all accepted; it is
  *accepted* when reached and equal to the verify's row token (greedy prefix acceptance: the
  argmax, a sampled run's draw, or rejection's verdict in its layout), so
  `accepted_at[:, j]` implies `reached[:, j]` and `accepted == accepted_at.sum(1)`.
- Confidences are the drafter's log-probabilities of its drafts (log_softmax of the MTP logits),
  as `DraftSchedule.confidence_stop` reads them; calibration reports them as probabilities.
- A step's verify rows are K = drafts + 1 (the anchor row carries the last token): the rows that
  carry tokens, not the engine's padding to its widest K.
- A measured time is the steady state (`engine.throughput`'s definition: the decode loop after
  the prefills): every program was compiled by an untimed run of the same workload first (a timed
  step that compiles is refused), and greedy and speculative runs alternate so that both see the
  same load.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
import platform
from collections.abc import Iterable, Sequence

import jax
import numpy as np

from metrale_jax.config import ModelConfig
from metrale_jax.engine.capacity import DEFAULT_K_LADDER, KLadder
from metrale_jax.engine.engine import Engine
from metrale_jax.engine.sampling import Sampling, SamplingRows, per_sequence, probabilities
from metrale_jax.engine.settings import SPECULATIVE_SAMPLING_MODES, parse_k_ladder, resolve_settings
from metrale_jax.engine.speculative import (
    DraftSchedule,
    GenerationResult,
    StepRecord,
    accepted_drafts,
    greedy_generate,
    speculative_generate,
)
from metrale_jax.engine.throughput import StepClock
from metrale_jax.hub_cache import checkpoint_directory
from metrale_jax.presets import resolve_checkpoint
from metrale_jax.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, TokenizerError, tokenizer_for
from metrale_jax.training.corpus import default_stdlib_dir, is_validation_file, load_corpus
from metrale_jax.training.recipe import SMALL_RECIPE


def flat_schedule(num_drafts: int, confidence_stop: float | None = None) -> DraftSchedule:
    """`num_drafts` drafts at every batch width (optionally cut at a log-confidence)."""
    return DraftSchedule(num_drafts, None, confidence_stop)


def ladder_schedule(
    num_drafts: int, ladder: KLadder | str = DEFAULT_K_LADDER, confidence_stop: float | None = None
) -> DraftSchedule:
    """Drafts per width from a K ladder (`(n_max, drafts)` steps or its `"4:3,8:3,16:1,32:1"`
    text; default: the engine's), capped at `num_drafts`. Raises ValueError on a bad ladder."""
    return DraftSchedule(num_drafts, parse_k_ladder(ladder) if isinstance(ladder, str) else ladder, confidence_stop)


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Reached drafts binned by confidence (probability): bin `edges` [n + 1], per bin the
    `mean_confidence`, the empirical `acceptance` (NaN for an empty bin) and the `count`."""

    edges: np.ndarray
    mean_confidence: np.ndarray
    acceptance: np.ndarray
    count: np.ndarray


@dataclasses.dataclass(frozen=True)
class ScheduleRun:
    """One schedule over one prompt set. Step rows: one per (verify step, active sequence),
    in order; D = `schedule.num_drafts` draft positions.

    group, step, seq, active: int [N] — which group of `width` prompts ran together, the step
      number within the group, the prompt index, and how many sequences verified in that step;
    proposed: int [N] — drafts the schedule asks for at that width (an engine whose K ladder
      gives a slot less capacity verifies fewer; a `Study`'s never does); drafted: int [N] —
      drafts verified (after the confidence stop); accepted: int [N];
    confidence: float [N, D] — log-probability of each verified draft (NaN past `drafted`);
    reached, accepted_at: bool [N, D] (see the module invariants).
    tokens: per prompt, the `max_new_tokens` generated tokens.
    """

    schedule: DraftSchedule
    width: int
    max_new_tokens: int
    tokens: list[list[int]]
    group: np.ndarray
    step: np.ndarray
    seq: np.ndarray
    active: np.ndarray
    proposed: np.ndarray
    drafted: np.ndarray
    accepted: np.ndarray
    confidence: np.ndarray
    reached: np.ndarray
    accepted_at: np.ndarray

    @classmethod
    def from_generations(
        cls,
        schedule: DraftSchedule,
        width: int,
        max_new_tokens: int,
        parts: Sequence[tuple[Sequence[int], GenerationResult]],
    ) -> ScheduleRun:
        """Tidy the results of `speculative_generate` calls under `schedule`: part g is
        (the prompt indices it ran, in order; its result). Prompts are 0..P-1 over all parts."""
        d = schedule.num_drafts
        tokens: list[list[int]] = [[] for _ in range(sum(len(idx) for idx, _ in parts))]
        cols: dict[str, list] = {k: [] for k in ("group", "step", "seq", "active", "proposed", "drafted", "accepted")}
        confidence: list[np.ndarray] = []
        for g, (idx, res) in enumerate(parts):
            for j, i in enumerate(idx):
                tokens[i] = res.tokens[j]
            for s, rec in enumerate(res.steps):
                n = len(rec.seqs)
                for local, k, a, conf in zip(rec.seqs, rec.ks, rec.accepted, rec.confidences):
                    for name, v in (
                        ("group", g),
                        ("step", s),
                        ("seq", idx[local]),
                        ("active", n),
                        ("proposed", schedule.drafts_at(n)),
                        ("drafted", k - 1),
                        ("accepted", a),
                    ):
                        cols[name].append(v)
                    row = np.full(d, np.nan)
                    row[: k - 1] = conf
                    confidence.append(row)
        ints = {k: np.asarray(v, np.int64) for k, v in cols.items()}
        pos = np.arange(d)[None, :]
        return cls(
            schedule=schedule,
            width=width,
            max_new_tokens=max_new_tokens,
            tokens=tokens,
            **ints,
            confidence=np.stack(confidence) if confidence else np.zeros((0, d)),
            reached=(pos <= ints["accepted"][:, None]) & (pos < ints["drafted"][:, None]),
            accepted_at=pos < ints["accepted"][:, None],
        )

    @property
    def verify_rows(self) -> np.ndarray:
        """int [N]: rows each step row spent (drafts + the anchor)."""
        return self.drafted + 1

    @property
    def emitted(self) -> np.ndarray:
        """int [N]: tokens each step row produced (accepted drafts + the verify's own token). A
        sequence's first generated token comes from its prefill, not from a verify step."""
        return self.accepted + 1

    def per_sequence(self) -> dict[str, np.ndarray]:
        """Totals per prompt, int [P]: steps, drafted, accepted, verify_rows, emitted."""
        p = len(self.tokens)
        count = lambda w: np.bincount(self.seq, weights=w, minlength=p).astype(np.int64)
        return {
            "steps": count(np.ones_like(self.seq)),
            "drafted": count(self.drafted),
            "accepted": count(self.accepted),
            "verify_rows": count(self.verify_rows),
            "emitted": count(self.emitted),
        }

    def per_step(self) -> dict[str, np.ndarray]:
        """Totals per verify step, in order, int [S]: group, step, active (sequences verified),
        verify_rows (their K summed) and emitted tokens."""
        key = self.group * (int(self.step.max(initial=0)) + 1) + self.step
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        total = lambda w: np.bincount(inverse, weights=w).astype(np.int64)
        return {
            "group": self.group[first],
            "step": self.step[first],
            "active": self.active[first],
            "verify_rows": total(self.verify_rows),
            "emitted": total(self.emitted),
        }

    def acceptance_by_position(self) -> np.ndarray:
        """float [D]: accepted / verified drafts at each position (NaN where none was verified).
        Position 0 is the first-draft acceptance."""
        verified = np.arange(self.confidence.shape[1])[None, :] < self.drafted[:, None]
        return _ratio(self.accepted_at.sum(0), verified.sum(0))

    def conditional_acceptance_by_position(self) -> np.ndarray:
        """float [D]: accepted / reached drafts at each position — P(draft j right | drafts
        before it right)."""
        return _ratio(self.accepted_at.sum(0), self.reached.sum(0))

    def summary(self) -> dict:
        """The headline numbers: steps (verify steps), mean_accepted_length (tokens per sequence per verify),
        mean_drafted, tokens_per_verify_row, acceptance_by_position,
        conditional_acceptance_by_position."""
        return {
            "steps": int(self.per_step()["step"].size),
            "mean_accepted_length": float(self.emitted.mean()),
            "mean_drafted": float(self.drafted.mean()),
            "tokens_per_verify_row": float(self.emitted.sum() / self.verify_rows.sum()),
            "acceptance_by_position": self.acceptance_by_position(),
            "conditional_acceptance_by_position": self.conditional_acceptance_by_position(),
        }

    def calibration(self, bins: int = 10, position: int | None = None) -> Calibration:
        """Reached drafts (all, or those at draft `position`) in `bins` equal-width
        probability bins of their confidence."""
        reached = self.reached.copy()
        if position is not None:
            reached[:, np.arange(reached.shape[1]) != position] = False
        conf = np.exp(self.confidence[reached])
        hit = self.accepted_at[reached]
        edges = np.linspace(0.0, 1.0, bins + 1)
        idx = np.clip(np.digitize(conf, edges[1:-1]), 0, bins - 1)
        count = np.bincount(idx, minlength=bins)
        return Calibration(
            edges=edges,
            mean_confidence=_ratio(np.bincount(idx, weights=conf, minlength=bins), count),
            acceptance=_ratio(np.bincount(idx, weights=hit, minlength=bins), count),
            count=count,
        )

    def cutoff_tradeoff(self, thresholds: Sequence[float]) -> dict[str, np.ndarray]:
        """Replay each step under a confidence stop at each log-confidence threshold: keep the
        drafts before the first one below it; accepted drafts past the cut are lost. A per-step
        replay (later steps keep their recorded start), which `Study.run` with
        `confidence_stop` measures exactly. Returns float arrays [len(thresholds)]: threshold,
        rows_saved (fraction of verify rows), tokens_lost (fraction of emitted tokens),
        tokens_per_verify_row."""
        th = np.asarray(thresholds, np.float64)
        d = self.confidence.shape[1]
        verified = np.arange(d)[None, :] < self.drafted[:, None]
        conf = np.where(verified, self.confidence, np.inf)
        below = conf[None, :, :] < th[:, None, None]  # [M, N, D]
        kept = np.where(below.any(-1), below.argmax(-1), self.drafted[None, :])  # [M, N]
        acc = np.minimum(self.accepted[None, :], kept)
        rows = (kept + 1).sum(-1)
        tokens = (acc + 1).sum(-1)
        return {
            "threshold": th,
            "rows_saved": 1.0 - rows / self.verify_rows.sum(),
            "tokens_lost": 1.0 - tokens / self.emitted.sum(),
            "tokens_per_verify_row": tokens / rows,
        }

    def records(self) -> list[dict]:
        """The step rows as dicts (e.g. for `pandas.DataFrame`)."""
        cols = ("group", "step", "seq", "active", "proposed", "drafted", "accepted")
        return [
            {
                **{c: int(getattr(self, c)[i]) for c in cols},
                "confidences": self.confidence[i, : self.drafted[i]].tolist(),
            }
            for i in range(len(self.seq))
        ]


def _ratio(num, den) -> np.ndarray:
    num, den = np.asarray(num, np.float64), np.asarray(den, np.float64)
    return np.divide(num, den, out=np.full(num.shape, np.nan), where=den > 0)


@dataclasses.dataclass(frozen=True)
class Throughput:
    """Steady-state throughput (`engine.throughput`'s definition: the decode loop after the
    prefills, steps that compiled nothing) of one workload, the first `width` prompts at
    `max_new_tokens` each, generated by plain decoding on a plain serve and by speculative
    decoding under `schedule` on a serve of its drafts (`Study.serving`), both greedy or both
    sampled with `sampling` (prompt i with seed + i; speculatively in `speculative_sampling`
    mode): `repeats` alternated runs each, after an untimed warm-up of both.

    tokens: the steady-state tokens of one run (width x (max_new_tokens - 1): each prompt's first
    token is its prefill's; the same both ways); steps: verify steps of one speculative run;
    plain_seconds, speculative_seconds: float [repeats], each run's steady-state seconds."""

    label: str
    schedule: DraftSchedule
    width: int
    tokens: int
    steps: int
    plain_seconds: np.ndarray
    speculative_seconds: np.ndarray
    sampling: Sampling | None = None
    speculative_sampling: str = "gumbel"

    @property
    def plain_tokens_per_second(self) -> float:
        return self.tokens / float(np.median(self.plain_seconds))

    @property
    def speculative_tokens_per_second(self) -> float:
        return self.tokens / float(np.median(self.speculative_seconds))

    @property
    def speedup(self) -> float:
        """Median plain time over median speculative time (above 1: speculative is faster)."""
        return float(np.median(self.plain_seconds) / np.median(self.speculative_seconds))


@dataclasses.dataclass(frozen=True)
class CouplingRun:
    """One speculative sampling run with both laws kept (`coupled_generate`) under a flat schedule
    of D drafts, in `speculative_sampling` mode (gumbel or rejection): `run` its step rows
    (`ScheduleRun`: acceptance by position, tokens per verify), and per step row (N) and drafted
    position (D): `match` bool [N, D], the draft equals the verify's row token at its position (in
    gumbel mode the target's draw there; in rejection mode the verdict's layout makes it the
    draft's acceptance, `run.accepted_at`); `tv` float [N, D], the total variation between the
    drafter's and the target's filtered laws (`sampling.probabilities`) there. `sampling`: the
    first prompt's parameters (prompt i draws with seed + i)."""

    sampling: Sampling
    run: ScheduleRun
    match: np.ndarray
    tv: np.ndarray
    speculative_sampling: str = "gumbel"

    def bounds(self) -> dict[str, np.ndarray]:
        """Per drafted position, float [D]: `match_rate` (measured), `lower` (mean (1 - TV) / (1 +
        TV): the coupling's guarantee on average) and `upper` (mean 1 - TV: no coupling matches
        more); under `pooled`, float [3], the same three over every drafted position."""
        lower, upper = (1.0 - self.tv) / (1.0 + self.tv), 1.0 - self.tv
        cols = (self.match.astype(np.float64), lower, upper)
        return {
            "match_rate": cols[0].mean(0),
            "lower": cols[1].mean(0),
            "upper": cols[2].mean(0),
            "pooled": np.array([c.mean() for c in cols]),
        }

    def reached_bounds(self) -> dict[str, np.ndarray]:
        """Over the reached drafted positions only (`run.reached`), per position float [D] (NaN
        where none was reached): `acceptance` (measured: `run.conditional_acceptance_by_position`),
        `lower` (mean (1 - TV) / (1 + TV)) and `upper` (mean 1 - TV); under `pooled`, float [3],
        the same three over every reached position. Rejection mode's expected acceptance at a
        reached position is its 1 - TV; gumbel's lies between the two."""
        reached = self.run.reached
        lower, upper = (1.0 - self.tv) / (1.0 + self.tv), 1.0 - self.tv
        cols = (self.run.accepted_at.astype(np.float64), lower, upper)
        per = [_ratio(np.where(reached, c, 0.0).sum(0), reached.sum(0)) for c in cols]
        return {
            "acceptance": per[0],
            "lower": per[1],
            "upper": per[2],
            "pooled": np.array([_ratio(c[reached].sum(), reached.sum()) for c in cols]),
        }


def _laws(engine: Engine, logits: np.ndarray, params: Sequence[Sampling]) -> np.ndarray:
    """The filtered law (`sampling.probabilities`) of each logits row [R, V] under its sequence's
    parameters `params` [R]: float64 [R, V].
    NOTE: rows are padded to a multiple of 64, so a run compiles the law once per few widths,
    not once per step."""
    r = logits.shape[0]
    b = -(-r // 64) * 64
    rows = SamplingRows.padded(engine.counts, b)
    for i, s in enumerate(params):
        rows.set_row(i, s)
    padded = np.zeros((b, logits.shape[1]), np.float32)
    padded[:r] = logits
    return np.asarray(_jit_probabilities(padded, rows), np.float64)[:r]


_jit_probabilities = jax.jit(probabilities)


def coupled_generate(
    engine: Engine, prompts: Sequence[Sequence[int]], max_new_tokens: int, num_drafts: int, sampling: Sampling
) -> tuple[GenerationResult, np.ndarray, np.ndarray]:
    """Speculative sampling of all prompts as one batch (prompt i with `sampling`'s seed + i;
    temperature 0: greedy), `num_drafts` drafts per verify from the engine's MTP drafter in the
    engine's mode (gumbel: the coupled drafter; rejection: its own draws, their laws kept in the
    pool), composed (propose, verify, host acceptance, `Engine.accept`), keeping both laws: the
    drafter's logits at each drafted position from the propose (which, in rejection mode, leaves
    the laws the rejection verify reads), the target's from the verify.

    Returns (the result, as `speculative_generate`'s: in gumbel mode tokens equal plain
    sampling's with the same seeds; match bool [N, D] and tv float [N, D] per step row in
    `StepRecord` order, as `CouplingRun` says). Raises EngineError where the engine cannot draft
    `num_drafts`."""
    each = per_sequence(sampling, len(prompts))
    assert each is not None
    chosen = None if sampling.greedy else each
    seqs = [engine.alloc_sequence() for _ in prompts]
    try:
        tokens = []
        for s, p, smp in zip(seqs, prompts, each):
            tokens.append([engine.prefill_sampled(s, p, smp)[1] if chosen else int(engine.prefill(s, p).argmax())])
        active, steps, matches, tvs = list(range(len(prompts))), [], [], []
        while active:
            batch, last = [seqs[i] for i in active], [tokens[i][-1] for i in active]
            mine = None if chosen is None else [chosen[i] for i in active]
            drafts, conf, q_logits = engine.propose_batched(batch, last, num_drafts, mine)
            for s in batch:
                engine.trim_proposer(s)
            ks = [num_drafts + 1] * len(active)
            flat = [t for a, row in zip(last, drafts) for t in (a, *row)]
            p_logits, draws = engine.verify_batched(batch, flat, ks, mine)
            draws = np.asarray(draws).reshape(len(active), num_drafts + 1)
            accepted = [accepted_drafts(flat[r * ks[r] : (r + 1) * ks[r]], draws[r]) for r in range(len(active))]
            engine.accept(batch, accepted)
            steps.append(StepRecord(list(active), ks, accepted, drafts.tolist(), conf.tolist()))
            matches.append(drafts == draws[:, :num_drafts])
            row_params = [each[i] for i in active for _ in range(num_drafts)]
            v = p_logits.shape[-1]
            target = np.asarray(p_logits).reshape(len(active), num_drafts + 1, v)[:, :num_drafts]
            p_law = _laws(engine, target.reshape(-1, v), row_params)
            q_law = _laws(engine, q_logits.reshape(-1, v), row_params)
            tvs.append(0.5 * np.abs(p_law - q_law).sum(-1).reshape(len(active), num_drafts))
            for i, row, a in zip(active, draws, accepted):
                tokens[i] += [int(t) for t in row[: a + 1]]
            active = [i for i in active if len(tokens[i]) < max_new_tokens]
        result = GenerationResult([t[:max_new_tokens] for t in tokens], steps)
        return result, np.concatenate(matches), np.concatenate(tvs)
    finally:
        for s in reversed(seqs):
            engine.free_sequence(s)


def machine_label() -> str:
    """The machine a measurement runs on, for a figure: the CPU model (/proc/cpuinfo's first
    `model name`, else `platform.processor()`), the cores this process may run on, the 1-minute
    load average, and jax's version, backend and (where it says more) first device's kind."""
    model = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    backend, kind = jax.default_backend(), jax.devices()[0].device_kind
    return (
        f"{model}, {len(os.sched_getaffinity(0))} cores, load {os.getloadavg()[0]:.1f}; "
        f"jax {jax.__version__} on {backend}" + (f" ({kind})" if kind != backend else "")
    )


class Study:
    """A model under study. Its schedule runs share one speculative engine (`engine`) sized for
    `max_width` sequences of `max_seq_len` tokens with a flat capacity of `max_drafts` drafts per
    slot (so any schedule up to `max_drafts` fits at any width; the schedule decides what is
    used), and the engine compiles each program once while it lives. Sampled runs in
    rejection mode run on its twin, `serving(max_drafts, "rejection")`. Wall-clock measurements
    run on `serving` engines instead: a plain serve and one serve per draft count.
    `tokenizer`: the checkpoint's (None when it has none), for `heldout_prompts` and decoding.

    At most one speculative serve is live (plus the plain one): building another releases it,
    and `sweep` and `throughput` release every serve when they move to another width than the
    one the serves last ran at in either (so a study loops widths outermost).
    NOTE: XLA CPU maps each kernel of a loaded program as an object of its own (~400 memory
    mappings a program); a study that kept every serve of every width alive reached
    `vm.max_map_count` (65,530) and aborted (`LLVM ERROR: Unable to allocate section memory`).
    A released serve's programs are freed with it; rebuilding one recompiles, which JAX's
    persistent compilation cache makes cheap.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        params,
        *,
        max_width: int = 32,
        max_drafts: int = 4,
        max_seq_len: int = 512,
        tokenizer: Tokenizer | None = None,
    ):
        if cfg.num_mtp_layers == 0:
            raise ValueError("a draft-schedule study needs a model with an MTP head")
        self.cfg, self.params, self.tokenizer = cfg, params, tokenizer
        self.max_width, self.max_drafts, self.max_seq_len = max_width, max_drafts, max_seq_len
        self._engines: dict[tuple[int | None, str], Engine] = {}
        self._width: int | None = None  # the width `sweep` or `throughput` last ran the serves at

    @property
    def engine(self) -> Engine:
        """The study's engine: `serving(max_drafts)`."""
        return self.serving(self.max_drafts)

    def serving(self, num_drafts: int | None, speculative_sampling: str = "gumbel") -> Engine:
        """The engine of a serve of `max_width` slots of `max_seq_len` tokens (f32 KV): plain
        (None: no drafter; `speculative_sampling` is then moot) or speculative with K =
        `num_drafts + 1` verify rows per sequence, a flat capacity (every slot may verify
        `num_drafts` drafts) and sampled steps in `speculative_sampling` mode (gumbel or
        rejection), built once per (num_drafts, mode). Raises ValueError for another mode.

        A ladder schedule runs on it as on a serve with its own ladder: that serve pads every
        verify to the same K; only its verify h rows of the slots the ladder caps, which the
        schedule never uses, are missing there."""
        if speculative_sampling not in SPECULATIVE_SAMPLING_MODES:
            raise ValueError(
                f"speculative_sampling {speculative_sampling!r} is not one of {SPECULATIVE_SAMPLING_MODES}"
            )
        key = (num_drafts, "gumbel" if num_drafts is None else speculative_sampling)
        if key not in self._engines:
            if num_drafts is not None:
                self._release(lambda k: k[0] is not None)
            raw: dict = {
                "max_batch_size": str(self.max_width),
                "max_seq_len": self.max_seq_len,
                "kv_cache_dtype": "f32",
            }
            if num_drafts is not None:
                raw |= {
                    "speculative": True,
                    "num_drafts": num_drafts,
                    "mtp_max_seqs": self.max_width,
                    "mtp_k_ladder": f"{self.max_width}:{num_drafts}",
                    "speculative_sampling": speculative_sampling,
                }
            self._engines[key] = Engine(self.cfg, self.params, resolve_settings(raw, None, auto_slots=self.max_width))
        return self._engines[key]

    def live_serves(self) -> list[tuple[int | None, str]]:
        """The (num_drafts, mode) of every serve alive now (None: the plain serve)."""
        return list(self._engines)

    def release(self) -> None:
        """Drop every serve and its compiled programs; the next run builds what it needs."""
        self._release(lambda _key: True)

    def _at_width(self, width: int) -> None:
        """Release every serve unless they last ran at `width` (a width's programs serve no other)."""
        if width != self._width:
            self.release()
        self._width = width

    def _release(self, which) -> None:
        """Drop the serves whose key `which` selects, then collect them (an engine's reference
        cycles would otherwise keep its programs, and their mappings, until a later collection)."""
        for key in [k for k in self._engines if which(k)]:
            del self._engines[key]
        gc.collect()

    def _groups(self, prompts, max_new_tokens: int, width: int | None):
        width = width or len(prompts)
        if not prompts:
            raise ValueError("no prompts")
        if not 1 <= width <= self.max_width:
            raise ValueError(f"width {width} outside 1..{self.max_width} (the study's max_width)")
        # a step reserves a verify's K rows and the next propose's drafts past the committed tokens
        longest = max(len(p) for p in prompts) + max_new_tokens + 2 * self.max_drafts
        if longest > self.max_seq_len:
            raise ValueError(
                f"a sequence would reach {longest} tokens, over the study's max_seq_len {self.max_seq_len}"
            )
        return width, [list(range(i, min(i + width, len(prompts)))) for i in range(0, len(prompts), width)]

    def run(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        schedule: DraftSchedule,
        width: int | None = None,
        fused: bool = True,
    ) -> ScheduleRun:
        """Greedy speculative decoding of `max_new_tokens` per prompt, `width` prompts at a time
        (default: all at once), under `schedule`, each step `fused` or composed. Raises ValueError for a schedule over
        `max_drafts` or a run that does not fit the study's engine."""
        if not 1 <= schedule.num_drafts <= self.max_drafts:
            raise ValueError(f"num_drafts {schedule.num_drafts} outside 1..{self.max_drafts} (the study's max_drafts)")
        width, groups = self._groups(prompts, max_new_tokens, width)
        parts = [
            (idx, speculative_generate(self.engine, [prompts[i] for i in idx], max_new_tokens, schedule, fused=fused))
            for idx in groups
        ]
        return ScheduleRun.from_generations(schedule, width, max_new_tokens, parts)

    def greedy(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, width: int | None = None
    ) -> list[list[int]]:
        """Plain greedy decoding (no drafts) on the same engine: the reference a run must equal."""
        _, groups = self._groups(prompts, max_new_tokens, width)
        out: list[list[int]] = []
        for idx in groups:
            out += greedy_generate(self.engine, [prompts[i] for i in idx], max_new_tokens)
        return out

    def sweep(
        self, prompts, max_new_tokens: int, schedules: dict[str, DraftSchedule], widths: Iterable[int]
    ) -> list[dict]:
        """Every (schedule, width): one row {label, num_drafts, width, run, **run.summary()}."""
        rows = []
        for w in widths:
            self._at_width(w)
            for label, sched in schedules.items():
                run = self.run(prompts, max_new_tokens, sched, width=w)
                rows.append({"label": label, "num_drafts": sched.num_drafts, "width": w, "run": run, **run.summary()})
        return rows

    def coupling(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        num_drafts: int,
        sampling: Sampling,
        width: int | None = None,
        speculative_sampling: str = "gumbel",
    ) -> CouplingRun:
        """Speculative sampling with both laws kept (`coupled_generate`) in `speculative_sampling`
        mode of `max_new_tokens` per prompt, `width` prompts at a time (default: all), `num_drafts`
        drafts per verify; prompt i draws with `sampling`'s seed + i whatever its group. Raises
        ValueError as `run` does, or for another mode."""
        if not 1 <= num_drafts <= self.max_drafts:
            raise ValueError(f"num_drafts {num_drafts} outside 1..{self.max_drafts} (the study's max_drafts)")
        engine = self.serving(self.max_drafts, speculative_sampling)
        width, groups = self._groups(prompts, max_new_tokens, width)
        parts, matches, tvs = [], [], []
        for idx in groups:
            first = dataclasses.replace(sampling, seed=sampling.seed + idx[0])
            res, match, tv = coupled_generate(engine, [prompts[i] for i in idx], max_new_tokens, num_drafts, first)
            parts.append((idx, res))
            matches.append(match)
            tvs.append(tv)
        run = ScheduleRun.from_generations(flat_schedule(num_drafts), width, max_new_tokens, parts)
        return CouplingRun(sampling, run, np.concatenate(matches), np.concatenate(tvs), speculative_sampling)

    def sampled(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        num_drafts: int,
        sampling: Sampling,
        speculative_sampling: str = "gumbel",
        width: int | None = None,
        fused: bool = True,
    ) -> ScheduleRun:
        """Speculative sampling on the engine's own step (`speculative_generate`, `fused` or
        composed) in `speculative_sampling` mode, on `serving(max_drafts, mode)`, under a flat
        schedule of `num_drafts`, `width` prompts at a time (default: all); prompt i draws with
        `sampling`'s seed + i whatever its group (as `coupling`, whose tokens it equals). Raises
        ValueError as `coupling` does."""
        if not 1 <= num_drafts <= self.max_drafts:
            raise ValueError(f"num_drafts {num_drafts} outside 1..{self.max_drafts} (the study's max_drafts)")
        engine = self.serving(self.max_drafts, speculative_sampling)
        schedule = flat_schedule(num_drafts)
        width, groups = self._groups(prompts, max_new_tokens, width)
        parts = []
        for idx in groups:
            each = [dataclasses.replace(sampling, seed=sampling.seed + i) for i in idx]
            batch = [prompts[i] for i in idx]
            parts.append(
                (idx, speculative_generate(engine, batch, max_new_tokens, schedule, fused=fused, sampling=each))
            )
        return ScheduleRun.from_generations(schedule, width, max_new_tokens, parts)

    def throughput(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        schedules: dict[str, DraftSchedule],
        widths: Iterable[int],
        *,
        repeats: int = 3,
        fused: bool = True,
        sampling: Sampling | None = None,
        speculative_sampling: str = "gumbel",
    ) -> list[Throughput]:
        """Every (schedule, width): the steady-state wall-clock of plain against speculative
        generation (`fused` or composed step) of the first `width` prompts, one `Throughput`
        each: greedy, or sampled with `sampling` (prompt i with its seed + i, both ways; the
        speculative side in `speculative_sampling` mode). Raises ValueError for a schedule over
        `max_drafts`, a width over the prompts or the study, a run that does not fit a serve of
        the study's sizes, under 2 new tokens (no decode step to time) or an unknown mode."""
        if repeats < 1:
            raise ValueError(f"repeats {repeats} must be >= 1")
        if max_new_tokens < 2:
            raise ValueError(
                f"max_new_tokens {max_new_tokens} must be >= 2: the steady state is the steps after the prefill"
            )
        for sched in schedules.values():
            if not 1 <= sched.num_drafts <= self.max_drafts:
                raise ValueError(f"num_drafts {sched.num_drafts} outside 1..{self.max_drafts} (the study's max_drafts)")
        widths = tuple(widths)
        for w in widths:
            if w > len(prompts):
                raise ValueError(f"width {w} is over the {len(prompts)} prompts given")
            self._groups(prompts[:w], max_new_tokens, w)
        out = []
        for w in widths:
            batch = [list(p) for p in prompts[:w]]
            self._at_width(w)
            out += [
                self._timed(label, sched, batch, max_new_tokens, repeats, fused, sampling, speculative_sampling)
                for label, sched in schedules.items()
            ]
        return out

    def _timed(
        self,
        label: str,
        sched: DraftSchedule,
        batch: list[list[int]],
        max_new_tokens: int,
        repeats: int,
        fused: bool,
        sampling: Sampling | None,
        speculative_sampling: str,
    ) -> Throughput:
        """One `throughput` row: `batch` on the plain serve against the serve of `sched`.
        NOTE: its own frame, so no local keeps a serve alive once `serving` or `release` drops it."""
        w = len(batch)
        each = None if sampling is None else [dataclasses.replace(sampling, seed=sampling.seed + i) for i in range(w)]
        plain, spec = self.serving(None), self.serving(sched.num_drafts, speculative_sampling)
        plain_run = functools.partial(greedy_generate, plain, batch, max_new_tokens, sampling=each)
        speculative = functools.partial(
            speculative_generate, spec, batch, max_new_tokens, sched, fused=fused, sampling=each
        )
        plain_run()
        steps = len(speculative().steps)
        tokens = w * (max_new_tokens - 1)
        seconds = np.array(
            [
                [_steady_seconds(plain, plain_run, tokens), _steady_seconds(spec, speculative, tokens)]
                for _ in range(repeats)
            ]
        )
        return Throughput(label, sched, w, tokens, steps, seconds[:, 0], seconds[:, 1], sampling, speculative_sampling)


def _steady_seconds(engine: Engine, generate, tokens: int) -> float:
    """The steady-state seconds of `generate(progress=...)` on `engine`, which must emit `tokens`
    in steps that compile nothing (RuntimeError otherwise: its warm-up missed a program)."""
    clock = StepClock(engine.programs)
    generate(progress=clock)
    if clock.warm_tokens != tokens:
        raise RuntimeError(f"a timed run emitted {clock.warm_tokens} of its {tokens} tokens in steps that compiled")
    return clock.warm_seconds


@functools.lru_cache(maxsize=4)
def study_for(checkpoint: str, max_width: int = 32, max_drafts: int = 4, max_seq_len: int = 512) -> Study:
    """The `Study` of a preset name, checkpoint directory or hub id in the local HF cache, with the
    checkpoint's own tokenizer (bytes for a preset whose vocabulary covers them), cached:
    everything in one process that studies the same checkpoint (notebooks run back to back,
    tests) shares one engine and its compiled programs."""
    directory = checkpoint_directory(checkpoint)
    cfg, params = resolve_checkpoint(directory or checkpoint)
    tok = tokenizer_for(directory, cfg.vocab_size) if directory or cfg.vocab_size >= 256 else None
    return Study(cfg, params, max_width=max_width, max_drafts=max_drafts, max_seq_len=max_seq_len, tokenizer=tok)


def heldout_prompts(
    count: int, length: int, seed: int = 0, corpus_dir: str | None = None, tokenizer: Tokenizer | None = None
) -> list[list[int]]:
    """`count` prompts of `length` tokens from the small model's held-out stdlib files (the
    training recipe's split of `corpus_dir`, default this Python's stdlib), each starting at a
    line start, none crossing a file boundary; deterministic in `seed`. `tokenizer` encodes them
    (a checkpoint's `tokenizer.json`; None or a byte tokenizer: bytes, the small model's own).
    Raises ValueError when the held-out text is too short."""
    if isinstance(tokenizer, HFTokenizer):
        return _token_prompts(tokenizer, count, length, seed, corpus_dir or default_stdlib_dir())
    tokenizer = ByteTokenizer()
    val = load_corpus(corpus_dir or default_stdlib_dir(), tokenizer, SMALL_RECIPE.val_every_nth_file).val
    eos = tokenizer.eos_id
    starts = np.nonzero(val[:-length] == ord("\n"))[0] + 1
    ends = np.cumsum(val == eos)
    ok = starts[ends[starts + length - 1] == ends[np.maximum(starts - 1, 0)]]  # no <|endoftext|> inside
    if ok.size < count:
        raise ValueError(f"only {ok.size} held-out prompts of {length} tokens, {count} asked for")
    pick = np.sort(np.random.default_rng(seed).choice(ok, size=count, replace=False))
    return [[int(t) for t in val[s : s + length]] for s in pick]


def _token_prompts(tokenizer: HFTokenizer, count: int, length: int, seed: int, corpus_dir: str) -> list[list[int]]:
    """`heldout_prompts` through a `tokenizers` tokenizer: each held-out file encoded whole, a
    prompt is `length` ids from a token that starts a line; files the vocabulary cannot encode
    (or that are not UTF-8) are skipped."""
    windows: list[list[int]] = []
    for name in sorted(os.listdir(corpus_dir)):
        if not name.endswith(".py") or not is_validation_file(name, SMALL_RECIPE.val_every_nth_file):
            continue
        try:
            with open(os.path.join(corpus_dir, name), encoding="utf-8") as f:
                text = f.read()
            ids, starts = tokenizer.encode_with_starts(text)
        except (UnicodeDecodeError, TokenizerError):
            continue
        windows += [
            ids[i : i + length] for i, s in enumerate(starts[: len(ids) - length + 1]) if s == 0 or text[s - 1] == "\n"
        ]
    if len(windows) < count:
        raise ValueError(f"only {len(windows)} held-out prompts of {length} tokens, {count} asked for")
    pick = np.sort(np.random.default_rng(seed).choice(len(windows), size=count, replace=False))
    return [windows[i] for i in pick]
