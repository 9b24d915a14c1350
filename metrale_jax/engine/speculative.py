"""Greedy generation, plain and speculative (MTP drafts verified in batches), on an `Engine`.

Owns: the scheduler loop (a step: verify, acceptance, verdict, the next drafts), draft schedules
(drafts per active width, the K ladder, a confidence stop), and per-step statistics. A step runs
either fused (`Engine.speculative_step`: one program, one transfer) or composed (`verify_batched`,
host acceptance, `Engine.accept`, `propose_batched`: the programs the diff replays one by one).

Invariants:
- Greedy speculative generation emits exactly the tokens plain greedy decoding emits (the
  verify's argmax decides every token; drafts only decide how many are checked at once).
- Both step paths verify the same drafts: the fused step proposes at least the drafts the next
  step may ask for (the most the schedule allows at any width the step can leave active, capped
  by the slots' capacity), and the host cuts them as the composed refill does; chained drafts do
  not depend on how many follow them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from metrale_jax.engine.capacity import KLadder, ladder_drafts
from metrale_jax.engine.engine import Engine
from metrale_jax.engine.sequences import SequenceState


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
        if self.ladder is None:
            return self.num_drafts
        return ladder_drafts(n_active, self.num_drafts, self.ladder)

    def most_drafts(self, low: int, high: int) -> int:
        """The most drafts at any width in low..high (1 <= low <= high)."""
        return max(self.drafts_at(n) for n in range(low, high + 1))

    def cut(self, drafts: np.ndarray, confidences: np.ndarray, keep: int) -> tuple[list[int], list[float]]:
        """One sequence's proposed drafts [nd] and confidences [nd] cut to at most `keep`, and
        before the first below the confidence stop."""
        if self.confidence_stop is not None:
            below = np.nonzero(confidences[:keep] < self.confidence_stop)[0]
            keep = int(below[0]) if below.size else keep
        return [int(x) for x in drafts[:keep]], [float(x) for x in confidences[:keep]]


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


#: Called after the prefill and after every step with the tokens emitted so far, all sequences
#: together (each counted up to max_new_tokens).
OnStep = Callable[[int], None]


def accepted_drafts(rows: Sequence[int], argmax: Sequence[int]) -> int:
    """Greedy acceptance: how many leading drafts (rows[1:]) equal the argmax of the row before
    them (rows = [last, d1, ...] of one sequence, argmax = that sequence's verify argmaxes)."""
    a = 0
    while a < len(rows) - 1 and int(argmax[a]) == int(rows[a + 1]):
        a += 1
    return a


def _emitted(out: Sequence[Sequence[int]], max_new_tokens: int) -> int:
    return sum(min(len(o), max_new_tokens) for o in out)


def greedy_generate(
    engine: Engine, prompts: Sequence[Sequence[int]], max_new_tokens: int, progress: OnStep | None = None
) -> list[list[int]]:
    """Plain greedy decoding of all prompts as one batch (decode_batch). Returns the first
    max_new_tokens generated tokens of each prompt (the prefill's argmax first); `progress` as
    `OnStep` says."""
    seqs = [engine.alloc_sequence() for _ in prompts]
    try:
        out = [[int(engine.prefill(s, p).argmax())] for s, p in zip(seqs, prompts)]
        if progress is not None:
            progress(_emitted(out, max_new_tokens))
        while len(out[0]) < max_new_tokens:
            logits = engine.decode_batch(seqs, [o[-1] for o in out])
            for o, row in zip(out, logits):
                o.append(int(row.argmax()))
            if progress is not None:
                progress(_emitted(out, max_new_tokens))
        return out
    finally:
        for s in reversed(seqs):
            engine.free_sequence(s)


DraftSource = Callable[[int, list[int], int], Sequence[int]]


def speculative_generate(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    schedule: DraftSchedule,
    draft_source: DraftSource | None = None,
    *,
    fused: bool = True,
    progress: OnStep | None = None,
) -> GenerationResult:
    """Greedy generation verified in batches.

    Drafts come from the engine's MTP drafter (a batched propose after the prefill, then after
    every verdict), or from `draft_source(prompt_index, committed_tokens, n)` when given (e.g. an
    oracle for tests). Each step every unfinished sequence verifies K = its drafts + 1 rows
    [last, drafts...], at most min(schedule at the active width, slot capacity) drafts, cut at the
    confidence stop. `fused` runs each step as `Engine.speculative_step` (the composed step under
    replay rollback, which the fused program does not implement); otherwise verify, host
    acceptance, `Engine.accept` and the propose run one by one. `progress` as `OnStep` says.
    """
    fused = fused and not engine.replay
    propose = draft_source is None and engine.drafter
    seqs = [engine.alloc_sequence() for _ in prompts]
    try:
        last = [int(engine.prefill(s, p).argmax()) for s, p in zip(seqs, prompts)]
        out = [[t] for t in last]
        if progress is not None:
            progress(_emitted(out, max_new_tokens))
        drafts: list[list[int]] = [[] for _ in prompts]
        confs: list[list[float]] = [[] for _ in prompts]
        steps: list[StepRecord] = []
        active = list(range(len(prompts)))

        def caps(idx: list[int]) -> list[int]:
            n_d = schedule.drafts_at(len(idx))
            return [min(n_d, engine.counts.slot_draft_capacity(seqs[i].slot)) for i in idx]

        def refill(idx: list[int], proposed: tuple[np.ndarray, np.ndarray] | None) -> None:
            """The next drafts of `idx` (`proposed`: the fused step's drafts and confidences of
            the same sequences; None: ask the drafter or the draft source)."""
            keep = caps(idx)
            if draft_source is not None:
                for i, k in zip(idx, keep):
                    drafts[i] = [int(t) for t in draft_source(i, seqs[i].tokens + [last[i]], k)][:k]
                    confs[i] = [0.0] * len(drafts[i])
                return
            if proposed is None:
                if max(keep) == 0:
                    for i in idx:
                        drafts[i], confs[i] = [], []
                    return
                d, c, _ = engine.propose_batched([seqs[i] for i in idx], [last[i] for i in idx], max(keep))
                for i in idx:
                    engine.trim_proposer(seqs[i])
                proposed = (d, c)
            for row, (i, k) in enumerate(zip(idx, keep)):
                drafts[i], confs[i] = schedule.cut(proposed[0][row], proposed[1][row], k)

        refill(active, None)
        while active:
            batch = [seqs[i] for i in active]
            ks = [len(drafts[i]) + 1 for i in active]
            flat = [t for i in active for t in (last[i], *drafts[i])]
            proposed = None
            if fused:
                remaining = [max_new_tokens - len(out[i]) for i in active]
                nd = _proposal(schedule, engine, batch, remaining, ks) if propose else 0
                res = engine.speculative_step(batch, flat, ks, nd)
                na, emitted = [int(a) for a in res.accepted], res.emitted
                proposed = (res.drafts, res.confidences) if nd else None
            else:
                _, argmax = engine.verify_batched(batch, flat, ks)
                off = np.concatenate([[0], np.cumsum(ks)])
                rows = [flat[off[j] : off[j + 1]] for j in range(len(active))]
                na = [accepted_drafts(r, argmax[off[j] : off[j + 1]]) for j, r in enumerate(rows)]
                engine.accept(batch, na)
                emitted = [[int(t) for t in argmax[off[j] : off[j] + na[j] + 1]] for j in range(len(active))]
            steps.append(StepRecord(list(active), ks, na, [drafts[i] for i in active], [confs[i] for i in active]))
            for j, i in enumerate(active):
                out[i] += emitted[j]
                last[i] = emitted[j][-1]
            still = [j for j, i in enumerate(active) if len(out[i]) < max_new_tokens]
            active = [active[j] for j in still]
            if active:
                refill(active, None if proposed is None else (proposed[0][still], proposed[1][still]))
            if progress is not None:
                progress(_emitted(out, max_new_tokens))
        return GenerationResult([o[:max_new_tokens] for o in out], steps)
    finally:
        for s in reversed(seqs):
            engine.free_sequence(s)


def _proposal(
    schedule: DraftSchedule, engine: Engine, batch: Sequence[SequenceState], remaining: Sequence[int], ks: Sequence[int]
) -> int:
    """The drafts a fused step proposes: the most the next step may ask for. A sequence with
    `remaining` tokens to emit stays active unless it emits them all; it emits 1..K, so the next
    width lies between those that stay whatever they accept and those that may stay."""
    sure = sum(r > k for r, k in zip(remaining, ks))
    maybe = [s for s, r in zip(batch, remaining) if r > 1]
    if not maybe:
        return 0
    cap = max(engine.counts.slot_draft_capacity(s.slot) for s in maybe)
    return min(schedule.most_drafts(max(sure, 1), len(maybe)), cap)
