"""Generation, plain and speculative (MTP drafts verified in batches), greedy or sampled, on an `Engine`.

Owns: the scheduler's state (`SchedulerState`: one `Generation` per prompt, with its
`SequenceParams`, and the `StepRecord` of every step), the one function that advances it by a
step (`Scheduler.advance`: verify, acceptance, verdict, the next drafts), the draft count
(`draft_limit`, the only place it is decided), draft schedules (drafts per active width, the K
ladder, a confidence stop) and per-step statistics. A step runs either fused
(`Engine.speculative_step`: one program, one transfer) or composed (`verify_batched`, host
acceptance, `Engine.accept`, `propose_batched`: the programs the diff replays one by one).

Invariants:
- Greedy speculative generation emits exactly the tokens plain greedy decoding emits (the
  verify's argmax decides every token; drafts only decide how many are checked at once).
  Sampled (a sequence's `SequenceParams.sampling`), the same holds for gumbel speculative
  sampling: a token is the draw of `engine.sampling` at its position, from the verify's logits
  and noise of (seed, position) alone, and the drafter drafts with the same noise
  (the coupling of `engine.sampling`); a generation whose sequences are all greedy runs the
  greedy programs. Under `--speculative-sampling rejection` the verify's rows carry rejection
  sampling's verdict in the same layout (`sampling.rejection_rows`), so both step paths and the
  draft schedules run unchanged: the tokens follow the target's law, not plain sampling's tokens.
- The state is all the loop carries from one step to the next: a step reads it and the engine
  and updates both. What one request asks for (today its token budget) is its `SequenceParams`.
- A draft count is `draft_limit`'s: the schedule at the active width, capped by the slot's
  draft capacity (`PoolCounts.slot_draft_capacity`, which the engine's own bound,
  `PoolCounts.propose_drafts`, contains).
- Both step paths verify the same drafts: the fused step proposes at least the drafts the next
  step may ask for (`draft_limit` over every width the step can leave active, for the widest
  capacity among the sequences that may stay), and the host cuts them as the composed refill
  does; chained drafts do not depend on how many follow them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from metrale_jax.engine.capacity import KLadder, ladder_drafts
from metrale_jax.engine.engine import Engine
from metrale_jax.engine.sampling import Sampling
from metrale_jax.engine.sequences import EngineError, SequenceState


@dataclasses.dataclass(frozen=True)
class DraftSchedule:
    """How many drafts each sequence verifies.

    num_drafts: the most drafts per verify; ladder: (n_max, drafts) steps applied to the number
    of active sequences (None: num_drafts at every width); confidence_stop: cut a sequence's
    drafts before the first whose log-confidence is below it (None: never)."""

    num_drafts: int
    ladder: KLadder | None = None
    confidence_stop: float | None = None

    def drafts_at(self, n_active: int) -> int:
        """The schedule's drafts at `n_active` active sequences (before any slot's capacity)."""
        if self.ladder is None:
            return self.num_drafts
        return ladder_drafts(n_active, self.num_drafts, self.ladder)

    def cut(self, drafts: np.ndarray, confidences: np.ndarray, keep: int) -> tuple[list[int], list[float]]:
        """One sequence's proposed drafts [nd] and confidences [nd] cut to at most `keep`, and
        before the first below the confidence stop."""
        if self.confidence_stop is not None:
            below = np.nonzero(confidences[:keep] < self.confidence_stop)[0]
            keep = int(below[0]) if below.size else keep
        return [int(x) for x in drafts[:keep]], [float(x) for x in confidences[:keep]]


def draft_limit(schedule: DraftSchedule, capacity: int, widths: range) -> int:
    """The most drafts a sequence whose slot holds `capacity` draft rows may verify at any of
    `widths` active sequences: the schedule's most over those widths, capped by the capacity.

    The one place the scheduler decides a draft count: a verify's (one width, the sequence's
    slot) and the fused step's proposal (the widths the next step may have, the widest capacity
    among the sequences that may stay)."""
    return min(max(schedule.drafts_at(n) for n in widths), capacity)


@dataclasses.dataclass
class StepRecord:
    """One verify step: for each active sequence (by prompt index) its K, accepted drafts, the
    drafts verified and their confidences."""

    seqs: list[int]
    ks: list[int]
    accepted: list[int]
    drafts: list[list[int]]
    confidences: list[list[float]]


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]
    steps: list[StepRecord]

    @property
    def verify_rows(self) -> int:
        return sum(sum(s.ks) for s in self.steps)

    @property
    def emitted(self) -> int:
        return sum(sum(a + 1 for a in s.accepted) for s in self.steps)


@dataclasses.dataclass(frozen=True)
class SequenceParams:
    """What one request asks of its generation. max_new_tokens: tokens to emit, the prefill's
    first; stop_ids: ids that end the generation once emitted (the checkpoint's EOS ids; the stop
    id is kept, as HF's `generate` keeps it, and nothing after it); sampling: its sampling
    parameters and seed (None or temperature 0: greedy)."""

    max_new_tokens: int
    stop_ids: frozenset[int] = frozenset()
    sampling: Sampling | None = None

    @property
    def samples(self) -> bool:
        return self.sampling is not None and not self.sampling.greedy


def sampling_of(params: Sequence[SequenceParams]) -> list[Sampling] | None:
    """The sampling argument of an engine call over sequences with `params`: None when every one
    is greedy (the greedy programs), else each one's parameters (greedy ones at temperature 0)."""
    if not any(p.samples for p in params):
        return None
    return [p.sampling if p.sampling is not None else Sampling() for p in params]


#: Per prompt sampling parameters (one for all, or one per prompt; None: greedy).
SamplingArg = Sampling | Sequence[Sampling | None] | None


def _sequence_params(
    max_new_tokens: int, n: int, sampling: SamplingArg, stop_ids: frozenset[int]
) -> list[SequenceParams]:
    each = sampling if isinstance(sampling, Sequence) else [sampling] * n
    if len(each) != n:
        raise ValueError(f"{len(each)} sampling parameters for {n} prompts")
    return [SequenceParams(max_new_tokens, stop_ids, s) for s in each]


@dataclasses.dataclass
class Generation:
    """One prompt's generation in progress.

    seq: its engine sequence (the committed context, `seq.tokens`); tokens: the tokens emitted so
    far, the prefill's argmax first (the last is the next verify's anchor row, not yet in the
    committed context); drafts, confidences: what the next verify carries after the anchor and
    their log-confidences (0.0 from a draft source)."""

    params: SequenceParams
    seq: SequenceState
    tokens: list[int]
    drafts: list[int] = dataclasses.field(default_factory=list)
    confidences: list[float] = dataclasses.field(default_factory=list)

    @property
    def limit(self) -> int:
        """The most tokens this generation emits: max_new_tokens, or fewer when a stop id is among
        them (up to and including the first)."""
        stop = self.params.stop_ids
        first = next((i for i, t in enumerate(self.tokens[: self.params.max_new_tokens]) if t in stop), None)
        return self.params.max_new_tokens if first is None else first + 1

    @property
    def remaining(self) -> int:
        """Tokens still to emit (0 or below: done)."""
        return self.limit - len(self.tokens)

    @property
    def emitted(self) -> int:
        """Tokens emitted so far, counted up to the limit."""
        return min(len(self.tokens), self.limit)


@dataclasses.dataclass
class SchedulerState:
    """Everything the scheduler loop carries between steps: one `Generation` per prompt (in
    prompt order), the prompt indices the next step verifies (`active`: every prompt at the
    first step, then those with tokens still to emit, in order) and the record of every step."""

    generations: list[Generation]
    active: list[int]
    steps: list[StepRecord] = dataclasses.field(default_factory=list)

    def emitted(self) -> int:
        """Tokens emitted so far, all sequences together (each counted up to its max_new_tokens)."""
        return sum(g.emitted for g in self.generations)

    def result(self) -> GenerationResult:
        return GenerationResult([g.tokens[: g.limit] for g in self.generations], self.steps)


#: Called after the prefill and after every step with the tokens emitted so far, all sequences
#: together (each counted up to max_new_tokens).
OnStep = Callable[[int], None]

#: `draft_source(prompt_index, committed_tokens, n)`: up to n drafts after the committed tokens.
DraftSource = Callable[[int, list[int], int], Sequence[int]]


def accepted_drafts(rows: Sequence[int], argmax: Sequence[int]) -> int:
    """Greedy acceptance: how many leading drafts (rows[1:]) equal the argmax of the row before
    them (rows = [last, d1, ...] of one sequence, argmax = that sequence's verify argmaxes)."""
    a = 0
    while a < len(rows) - 1 and int(argmax[a]) == int(rows[a + 1]):
        a += 1
    return a


def _first_token(engine: Engine, seq: SequenceState, prompt: Sequence[int], params: SequenceParams) -> int:
    """The prefill of `prompt` into `seq` and the token it selects (argmax, or drawn when sampled)."""
    if params.samples:
        assert params.sampling is not None
        return engine.prefill_sampled(seq, prompt, params.sampling)[1]
    return int(engine.prefill(seq, prompt).argmax())


def _prefilled(
    engine: Engine, seqs: Sequence[SequenceState], prompts: Sequence[Sequence[int]], params: Sequence[SequenceParams]
) -> SchedulerState:
    """The state after each prompt's prefill into its sequence, in order: one token each (the
    prefill's argmax or draw), no drafts, every prompt active."""
    gens = [Generation(q, s, [_first_token(engine, s, p, q)]) for s, p, q in zip(seqs, prompts, params)]
    return SchedulerState(gens, list(range(len(gens))))


def greedy_generate(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    progress: OnStep | None = None,
    *,
    sampling: SamplingArg = None,
    stop_ids: frozenset[int] = frozenset(),
) -> list[list[int]]:
    """Plain decoding of all prompts as one batch (decode_batch): greedy, or with `sampling` (one
    `Sampling` for all prompts or one per prompt) plain sampling, each token drawn on the device
    (`Engine.decode_sampled`). Returns the first max_new_tokens generated tokens of each prompt
    (the prefill's token first), each cut after its first id in `stop_ids`; `progress` as
    `OnStep` says."""
    params = _sequence_params(max_new_tokens, len(prompts), sampling, stop_ids)
    seqs = [engine.alloc_sequence() for _ in prompts]
    try:
        state = _prefilled(engine, seqs, prompts, params)
        gens = state.generations
        chosen = sampling_of(params)
        if progress is not None:
            progress(state.emitted())
        while any(g.remaining > 0 for g in gens):
            last = [g.tokens[-1] for g in gens]
            if chosen is None:
                picked = [int(row.argmax()) for row in engine.decode_batch(seqs, last)]
            else:
                picked = [int(t) for t in engine.decode_sampled(seqs, last, chosen)[1]]
            for g, tok in zip(gens, picked):
                g.tokens.append(tok)
            if progress is not None:
                progress(state.emitted())
        return [g.tokens[: g.limit] for g in gens]
    finally:
        for s in reversed(seqs):
            engine.free_sequence(s)


@dataclasses.dataclass(frozen=True)
class Scheduler:
    """What one speculative generation fixes for all its steps: the engine, the draft schedule,
    where drafts come from (`draft_source`, else the engine's MTP drafter) and the step path
    (`fused`: `Engine.speculative_step`; else the composed transitions)."""

    engine: Engine
    schedule: DraftSchedule
    draft_source: DraftSource | None
    fused: bool

    def _limit(self, g: Generation, widths: range) -> int:
        return draft_limit(self.schedule, self.engine.counts.slot_draft_capacity(g.seq.slot), widths)

    def advance(self, state: SchedulerState) -> None:
        """One step of `state`: each active generation verifies K = its drafts + 1 rows [anchor,
        drafts...]; its accepted drafts and the verify's own token are emitted; the step is
        recorded; generations with nothing left to emit leave `active`, and the rest get their
        next drafts (from the fused step's propose, the drafter or the draft source)."""
        gens = [state.generations[i] for i in state.active]
        batch = [g.seq for g in gens]
        ks = [len(g.drafts) + 1 for g in gens]
        flat = [t for g in gens for t in (g.tokens[-1], *g.drafts)]
        chosen = sampling_of([g.params for g in gens])
        proposed = None
        if self.fused:
            nd = self._proposal(gens, ks) if self.draft_source is None and self.engine.drafter else 0
            res = self.engine.speculative_step(batch, flat, ks, nd, sampling=chosen)
            accepted, emitted = [int(a) for a in res.accepted], res.emitted
            proposed = (res.drafts, res.confidences) if nd else None
        else:
            _, argmax = self.engine.verify_batched(batch, flat, ks, chosen)
            off = np.concatenate([[0], np.cumsum(ks)])
            rows = [flat[off[j] : off[j + 1]] for j in range(len(gens))]
            accepted = [accepted_drafts(r, argmax[off[j] : off[j + 1]]) for j, r in enumerate(rows)]
            self.engine.accept(batch, accepted)
            emitted = [[int(t) for t in argmax[off[j] : off[j] + accepted[j] + 1]] for j in range(len(gens))]
        state.steps.append(
            StepRecord(list(state.active), ks, accepted, [g.drafts for g in gens], [g.confidences for g in gens])
        )
        for g, e in zip(gens, emitted):
            g.tokens += e
        still = [j for j, g in enumerate(gens) if g.remaining > 0]
        state.active = [state.active[j] for j in still]
        if state.active:
            self.next_drafts(state, None if proposed is None else (proposed[0][still], proposed[1][still]))

    def next_drafts(self, state: SchedulerState, proposed: tuple[np.ndarray, np.ndarray] | None) -> None:
        """Give the active generations their next drafts, each at most its `draft_limit` at the
        active width and cut at the confidence stop. `proposed`: the fused step's drafts and
        confidences [n_active, nd] of the same generations; None: ask the draft source or the
        drafter (a batched propose)."""
        gens = [state.generations[i] for i in state.active]
        width = range(len(gens), len(gens) + 1)
        keep = [self._limit(g, width) for g in gens]
        if self.draft_source is not None:
            for i, g, k in zip(state.active, gens, keep):
                g.drafts = [int(t) for t in self.draft_source(i, g.seq.tokens + [g.tokens[-1]], k)][:k]
                g.confidences = [0.0] * len(g.drafts)
            return
        if proposed is None:
            if max(keep) == 0:
                for g in gens:
                    g.drafts, g.confidences = [], []
                return
            chosen = sampling_of([g.params for g in gens])
            d, c, _ = self.engine.propose_batched(
                [g.seq for g in gens], [g.tokens[-1] for g in gens], max(keep), chosen, logits=False
            )
            for g in gens:
                self.engine.trim_proposer(g.seq)
            proposed = (d, c)
        for row, (g, k) in enumerate(zip(gens, keep)):
            g.drafts, g.confidences = self.schedule.cut(proposed[0][row], proposed[1][row], k)

    def _proposal(self, gens: Sequence[Generation], ks: Sequence[int]) -> int:
        """The drafts a fused step proposes: the most the next step may ask for. A generation
        stays active unless it emits all it has left; it emits 1..K, so the next width lies
        between those that stay whatever they accept and those that may stay."""
        sure = sum(g.remaining > k for g, k in zip(gens, ks))
        maybe = [g for g in gens if g.remaining > 1]
        if not maybe:
            return 0
        widest = max(maybe, key=lambda g: self.engine.counts.slot_draft_capacity(g.seq.slot))
        return self._limit(widest, range(max(sure, 1), len(maybe) + 1))


def speculative_generate(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    schedule: DraftSchedule,
    draft_source: DraftSource | None = None,
    *,
    fused: bool = True,
    progress: OnStep | None = None,
    sampling: SamplingArg = None,
    stop_ids: frozenset[int] = frozenset(),
) -> GenerationResult:
    """Greedy generation verified in batches; with `sampling` (as `greedy_generate`'s) gumbel
    speculative sampling, which emits exactly the tokens of plain sampling with the same seeds, or
    under `--speculative-sampling rejection` rejection sampling, whose tokens follow the same law
    (MTP drafts only: a `draft_source` is refused, EngineError).

    Drafts come from the engine's MTP drafter (a batched propose after the prefill, then after
    every verdict), or from `draft_source(prompt_index, committed_tokens, n)` when given (e.g. an
    oracle for tests). Each step every unfinished sequence verifies K = its drafts + 1 rows
    [last, drafts...], at most `draft_limit` drafts (the schedule at the active width, capped by
    its slot's capacity), cut at the confidence stop. `fused` runs each step as
    `Engine.speculative_step` (the composed step under replay rollback, which the fused program
    does not implement); otherwise verify, host acceptance, `Engine.accept` and the propose run
    one by one. `progress` as `OnStep` says. A sequence ends after its first id in `stop_ids`
    (drafts accepted past it are dropped).
    """
    params = _sequence_params(max_new_tokens, len(prompts), sampling, stop_ids)
    if draft_source is not None and engine.counts.rejection and sampling_of(params) is not None:
        raise EngineError("rejection sampling verifies the MTP drafter's drafts (their laws), not a draft source's")
    scheduler = Scheduler(engine, schedule, draft_source, fused and not engine.replay)
    seqs = [engine.alloc_sequence() for _ in prompts]
    try:
        state = _prefilled(engine, seqs, prompts, params)
        if progress is not None:
            progress(state.emitted())
        scheduler.next_drafts(state, None)
        while state.active:
            scheduler.advance(state)
            if progress is not None:
                progress(state.emitted())
        return state.result()
    finally:
        for s in reversed(seqs):
            engine.free_sequence(s)
