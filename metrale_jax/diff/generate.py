"""The scheduler mode, `--generate`: the speculative scheduler against plain greedy decoding.

Owns: `diff_generate` (the mode driver) and `GENERATE_WIDTH` (its prompts: `batch_prompts` of that
width, so the K ladder's width steps and slots of the serve apply).

The runs, all on the reference forward: plain greedy decoding (`greedy_generate`), then
`speculative_generate` composed (verify, host acceptance, `Engine.accept`, propose one by one) and
fused (`Engine.speculative_step`), each with the serve's K ladder and with `confidence_stop` when
given. Compared:
- each speculative run's tokens equal greedy's (speculative greedy decoding emits greedy's tokens);
- the composed and fused step records are equal: active sequences, K, accepted counts and drafts
  exactly; the drafts' confidences within `confidence_bound_ulp` float32 ulps (`CONFIDENCE_ULPS`;
  0, bit for bit, under --batch-invariant). NOTE: the bound, not bits, by default: XLA CPU
  contracts `a * b + c` into an FMA by fusion boundaries, which differ between the composed
  propose and the fused step, and leave a chained draft's confidence 1-2 ulp apart on some
  streams; the FMA pin of --batch-invariant removes that. A stop within the bound of a
  confidence can cut the two paths differently, which the drafts then show;
- with a confidence stop, no verified draft's confidence lies below it;
- the control changes one draft of the composed run (the first draft of sequence 0 at the middle
  step, bumped by one): its step records must differ from the fused run's while its tokens stay
  greedy's (the verify rejects the changed draft).

Invariants: every run allocates its own sequences and frees them (the scheduler's functions do);
the reference forward stays selected.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from metrale_jax.diff.compare import ulp_distance
from metrale_jax.diff.progress import Progress
from metrale_jax.diff.prompts import batch_prompts
from metrale_jax.engine.speculative import (
    DraftSchedule,
    GenerationResult,
    StepRecord,
    greedy_generate,
    speculative_generate,
)

#: The prompts of `--generate`: `batch_prompts(GENERATE_WIDTH)`.
GENERATE_WIDTH = 3
#: The composed and fused confidences' bound in float32 ulps, outside --batch-invariant.
CONFIDENCE_ULPS = 4


@dataclasses.dataclass(frozen=True)
class _ChangedDraft(DraftSchedule):
    """A schedule whose cut bumps the first draft the `at`-th time it cuts (the control)."""

    at: int = 0
    vocab: int = 1
    calls: list[int] = dataclasses.field(default_factory=lambda: [0], compare=False, hash=False)

    def cut(self, drafts, confidences, keep):
        out, conf = super().cut(drafts, confidences, keep)
        self.calls[0] += 1
        if self.calls[0] - 1 == self.at and out:
            out = [(out[0] + 1) % self.vocab] + out[1:]
        return out, conf


def _confidence_ulps(x: StepRecord, y: StepRecord) -> int:
    """The largest float32 ulp distance between two records' confidences (same drafts)."""
    flat = lambda r: np.asarray([c for cs in r.confidences for c in cs], np.float32)  # noqa: E731
    return int(ulp_distance(flat(x), flat(y)).max(initial=0))


def _first_step_difference(a: list[StepRecord], b: list[StepRecord], bound_ulp: int = 0) -> dict | None:
    """The first step and field where two step records differ (confidences: by over `bound_ulp` ulps)."""
    for s, (x, y) in enumerate(zip(a, b)):
        for field in ("seqs", "ks", "accepted", "drafts"):
            if getattr(x, field) != getattr(y, field):
                return {"step": s, "field": field, "composed": getattr(x, field), "fused": getattr(y, field)}
        if _confidence_ulps(x, y) > bound_ulp:
            return {"step": s, "field": "confidences", "composed": x.confidences, "fused": y.confidences}
    if len(a) != len(b):
        return {"step": min(len(a), len(b)), "field": "steps", "composed": len(a), "fused": len(b)}
    return None


def diff_generate(engine, *, steps: int, confidence_stop: float | None, progress: Progress):
    """`--generate`: `steps` new tokens per prompt. Returns (report fields, reasons)."""
    prompts = batch_prompts(GENERATE_WIDTH, engine.cfg.vocab_size)
    s = engine.settings
    schedule = DraftSchedule(s.num_drafts, s.k_ladder, confidence_stop)
    progress.section("generate", 4)
    greedy = greedy_generate(engine, prompts, steps)
    progress.advance()
    runs: dict[str, GenerationResult] = {}
    for path, fused in (("composed", False), ("fused", True)):
        runs[path] = speculative_generate(engine, prompts, steps, schedule, fused=fused)
        progress.advance()
    at = len(runs["composed"].steps) // 2
    changed = _ChangedDraft(s.num_drafts, s.k_ladder, confidence_stop, at=at, vocab=engine.cfg.vocab_size)
    control = speculative_generate(engine, prompts, steps, changed, fused=False)
    progress.advance()
    reasons = []
    for path, r in runs.items():
        if [t[:steps] for t in r.tokens] != greedy:
            reasons.append(f"generate, {path}: the tokens differ from plain greedy decoding")
    bound = 0 if s.batch_invariant else CONFIDENCE_ULPS
    first = _first_step_difference(runs["composed"].steps, runs["fused"].steps, bound)
    pairs = zip(runs["composed"].steps, runs["fused"].steps)
    same_steps = first is None or first["field"] == "confidences"
    max_ulp = max((_confidence_ulps(x, y) for x, y in pairs), default=0) if same_steps else None
    if first is not None:
        reasons.append(
            f"generate: composed and fused step records differ first at step {first['step']} ({first['field']})"
        )
    if confidence_stop is not None:
        below = [
            (path, i)
            for path, r in runs.items()
            for i, x in enumerate(r.steps)
            if any(c < confidence_stop for cs in x.confidences for c in cs)
        ]
        if below:
            path, i = below[0]
            reasons.append(f"generate, {path}: step {i} verifies a draft below the confidence stop")
    seen = _first_step_difference(control.steps, runs["fused"].steps)
    if seen is None:
        reasons.append("generate: the detection control (one draft changed) saw no difference in the step records")
    if [t[:steps] for t in control.tokens] != greedy:
        reasons.append("generate: the control's tokens differ from greedy (a changed draft must only be rejected)")
    fields = {
        "generate": {
            "prompts": len(prompts),
            "new_tokens": steps,
            "k_ladder": [list(x) for x in s.k_ladder] if s.k_ladder else None,
            "confidence_stop": confidence_stop,
            "verify_steps": {p: len(r.steps) for p, r in runs.items()},
            "emitted_per_step": {p: round(r.emitted / max(len(r.steps), 1), 3) for p, r in runs.items()},
            "drafts_cut": sum(s.num_drafts * len(x.seqs) - sum(len(d) for d in x.drafts) for x in runs["fused"].steps),
            "tokens_equal_greedy": {p: [t[:steps] for t in r.tokens] == greedy for p, r in runs.items()},
            "first_difference": first,
            "confidence_bound_ulp": bound,
            "confidence_max_ulp": max_ulp,
            "detection_control": {"changed_at_cut": at, "first_difference": seen},
        }
    }
    return fields, reasons
