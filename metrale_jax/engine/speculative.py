"""Greedy generation, plain and speculative (MTP drafts verified in batches), on an `Engine`.

Owns: the scheduler loop run after every verdict (verify, accept counting, stash,
fold, rewind, commit, propose), draft schedules (drafts per active width, the K ladder, a
confidence stop), and per-step statistics.

Invariant: greedy speculative generation emits exactly the tokens plain greedy decoding emits
(the verify's argmax decides every token; drafts only decide how many are checked at once).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from metrale_jax.engine.capacity import KLadder, ladder_drafts
from metrale_jax.engine.engine import Engine


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


def accepted_drafts(rows: Sequence[int], argmax: Sequence[int]) -> int:
    """Greedy acceptance: how many leading drafts (rows[1:]) equal the argmax of the row before
    them (rows = [last, d1, ...] of one sequence, argmax = that sequence's verify argmaxes)."""
    a = 0
    while a < len(rows) - 1 and int(argmax[a]) == int(rows[a + 1]):
        a += 1
    return a


def greedy_generate(engine: Engine, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """Plain greedy decoding of all prompts as one batch (decode_batch). Returns the first
    max_new_tokens generated tokens of each prompt (the prefill's argmax first)."""
    seqs = [engine.alloc_sequence() for _ in prompts]
    try:
        out = [[int(engine.prefill(s, p).argmax())] for s, p in zip(seqs, prompts)]
        while len(out[0]) < max_new_tokens:
            logits = engine.decode_batch(seqs, [o[-1] for o in out])
            for o, row in zip(out, logits):
                o.append(int(row.argmax()))
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
) -> GenerationResult:
    """Greedy generation verified in batches.

    Drafts come from the engine's MTP drafter (batched propose after every verdict), or from
    `draft_source(prompt_index, committed_tokens, n)` when given (e.g. an oracle for tests).
    Each step every unfinished sequence verifies K = min(schedule, slot capacity) + 1 rows
    [last, drafts...]; the scheduler then stashes the accepted rows' hiddens, folds the GDN
    state of the whole batch, rewinds and commits each sequence, and proposes again.
    """
    seqs = [engine.alloc_sequence() for _ in prompts]
    try:
        last = [int(engine.prefill(s, p).argmax()) for s, p in zip(seqs, prompts)]
        out = [[t] for t in last]
        drafts: list[list[int]] = [[] for _ in prompts]
        confs: list[list[float]] = [[] for _ in prompts]
        steps: list[StepRecord] = []
        active = list(range(len(prompts)))

        def refill(idx):
            n_d = schedule.drafts_at(len(idx))
            caps = {i: min(n_d, engine.counts.slot_draft_capacity(seqs[i].slot)) for i in idx}
            if draft_source is not None:
                for i in idx:
                    drafts[i] = [int(t) for t in draft_source(i, seqs[i].tokens + [last[i]], caps[i])][: caps[i]]
                    confs[i] = [0.0] * len(drafts[i])
                return
            nd = max(caps.values())
            if nd == 0:
                for i in idx:
                    drafts[i], confs[i] = [], []
                return
            d, c, _ = engine.propose_batched([seqs[i] for i in idx], [last[i] for i in idx], nd)
            for row, i in enumerate(idx):
                keep = caps[i]
                if schedule.confidence_stop is not None:
                    below = np.nonzero(c[row, :keep] < schedule.confidence_stop)[0]
                    keep = int(below[0]) if below.size else keep
                drafts[i], confs[i] = [int(x) for x in d[row, :keep]], [float(x) for x in c[row, :keep]]
                engine.trim_proposer(seqs[i])

        refill(active)
        while active:
            batch = [seqs[i] for i in active]
            ks = [len(drafts[i]) + 1 for i in active]
            rows = [[last[i], *drafts[i]] for i in active]
            _, argmax = engine.verify_batched(batch, [t for r in rows for t in r], ks)
            off = np.concatenate([[0], np.cumsum(ks)])
            na = [accepted_drafts(rows[j], argmax[off[j] : off[j + 1]]) for j in range(len(active))]
            if engine.drafter:
                engine.stash_verify_hidden_rows(batch, [int(off[j]) + na[j] for j in range(len(active))])
            engine.gdn_fold_accepted(batch, [a + 1 for a in na], ks)
            for j, s in enumerate(batch):
                engine.rewind(s, ks[j] - 1 - na[j])
            engine.commit_accepted_prefixes(batch, [a + 1 for a in na], ks)
            steps.append(StepRecord(list(active), ks, na, [drafts[i] for i in active], [confs[i] for i in active]))
            for j, i in enumerate(active):
                out[i] += [int(t) for t in argmax[off[j] : off[j] + na[j] + 1]]
                last[i] = int(argmax[off[j] + na[j]])
            active = [i for i in active if len(out[i]) < max_new_tokens]
            if active:
                refill(active)
        return GenerationResult([o[:max_new_tokens] for o in out], steps)
    finally:
        for s in reversed(seqs):
            engine.free_sequence(s)
