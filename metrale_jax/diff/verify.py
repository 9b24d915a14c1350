"""The verify family: `--verify K,..` (one sequence) and `--verify-batch n,..`.

Owns: `run_verify`, the one run loop of the family (the scheduler's step after every verdict,
as `speculative_generate` runs it), `verify_plan` (the widths and capped shapes each mode
runs) and the driver `diff_verify`.

A step, for n sequences at widths ks (rows flat and seq-major, sequence i's rows
`[last_i, d_1 .. d_{K_i - 1}]`): `verify_batched` (write-on-accept); each sequence's accepted
drafts; with the drafter, the accepted rows' hiddens stashed; the GDN fold of the whole batch;
then per sequence the host rewind of its rejected rows and the commit of rows 0..na; with the
drafter, the batched propose of `num_drafts` drafts and the trim of every drafter back to the
committed context. A step's parts: the R = Σ K verify logits rows, then (drafter) the last
draft position's logits, the drafts and their confidences.

Invariants:
- The reference's drafts are each sequence's greedy continuation (plain greedy decoding of the
  same prompts, `decode.run_decode`) with one corrupted on odd steps (offset by the sequence's
  index), so full and partial accepts both occur; every other run replays the reference's
  logged tokens and accept counts and never recomputes them.
- A shape whose reference saw no full accept or no partial accept fails ("it needs both").
- The control (reference forward) changes the last draft of sequence n // 2 halfway.
- With the drafter, two identical one-step reference runs go first at each width: the drafter's
  state is a pure function of the steps, so the two must agree; `drafter_warmup` reports
  whether they did (a disagreement reports one run as discarded).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

from metrale_jax.diff.compare import BIT_IDENTICAL, Part, Run, compare, saw_difference
from metrale_jax.diff.decode import run_decode
from metrale_jax.diff.layout import SequenceBatch
from metrale_jax.diff.progress import SILENT, Progress
from metrale_jax.diff.prompts import batch_prompts, prompts
from metrale_jax.diff.report import failure_line
from metrale_jax.diff.schedule import (
    accept_coverage,
    accept_histogram,
    batch_shapes,
    capped,
    dedup_consecutive,
    offsets,
    slot_of,
    step_drafts,
)
from metrale_jax.diff.variants import REFERENCE, Variant, compare_all, replay_all
from metrale_jax.engine.speculative import accepted_drafts as accepted


@dataclasses.dataclass(frozen=True)
class Logged:
    """One verify step as the reference ran it: the flat tokens and each sequence's accepts."""

    tokens: tuple[int, ...]
    accepted: tuple[int, ...]


def run_verify(
    engine,
    rows: Sequence[Sequence[int]],
    ks: Sequence[int],
    steps: int,
    *,
    greedy: Sequence[Sequence[int]] | None = None,
    log: Sequence[Logged] | None = None,
    fragment: bool = False,
    num_drafts: int | None = None,
    progress: Progress = SILENT,
) -> tuple[list[Logged], Run]:
    """One run of `steps` verify steps of `rows` at widths `ks` (see the module docstring).
    Exactly one of `greedy` (reference: drafts from each row's greedy continuation, accepts
    from the verify's argmax) and `log` (replay) is given; `num_drafts` turns the drafter on."""
    if (greedy is None) == (log is None):
        raise ValueError("run_verify needs exactly one of greedy and log")
    vocab, n, off = engine.cfg.vocab_size, len(rows), offsets(ks)
    out: list[Logged] = []
    run = Run(prefill=[])
    with SequenceBatch(engine, n, fragment) as batch:
        seqs = batch.seqs
        first = batch.prefill(rows)
        run.prefill = [Part("logits", first, "logits")]
        last = [int(x) for x in first.argmax(axis=1)]
        pos = [0] * n
        progress.advance()
        # The slots and widths are fixed for the run, so one check covers every step.
        reason = engine.can_batch_verify(seqs, ks)
        if reason:
            raise RuntimeError(f"the engine refuses a batched verify of {list(ks)}: {reason}")
        for s in range(steps):
            if log is not None:
                tokens = list(log[s].tokens)
            else:
                assert greedy is not None  # exactly one of greedy and log (checked above)
                tokens = [t for i in range(n) for t in [last[i], *step_drafts(greedy[i], pos[i], s + i, ks[i], vocab)]]
            t0 = time.perf_counter()
            logits, argmax = engine.verify_batched(seqs, tokens, ks)
            t1 = time.perf_counter()
            na = (
                list(log[s].accepted)
                if log is not None
                else [accepted(tokens[off[i] : off[i + 1]], argmax[off[i] : off[i + 1]]) for i in range(n)]
            )
            if num_drafts:
                engine.stash_verify_hidden_rows(seqs, [off[i] + na[i] for i in range(n)])
            engine.gdn_fold_accepted(seqs, [a + 1 for a in na], ks)
            for i, seq in enumerate(seqs):
                engine.rewind(seq, ks[i] - 1 - na[i])
                engine.commit_accepted_prefix(seq, na[i] + 1, ks[i])
                if log is not None and s + 1 < len(log):  # a replay feeds the next logged token
                    last[i] = log[s + 1].tokens[off[i]]
                else:
                    last[i] = int(argmax[off[i] + na[i]])
                pos[i] += na[i] + 1
            parts = [Part("verify logits", logits, "logits")]
            if num_drafts:
                drafts, conf, draft_logits = engine.propose_batched(seqs, last, num_drafts)
                for seq in seqs:
                    engine.trim_proposer(seq, 0)
                parts += [
                    Part("propose logits", draft_logits, "logits"),
                    Part("drafts", drafts, "tokens"),
                    Part("confidences", conf, "values"),
                ]
            out.append(Logged(tuple(int(t) for t in tokens), tuple(na)))
            run.steps.append(parts)
            run.enqueue_ms.append((t1 - t0) * 1e3)
            run.step_ms.append((time.perf_counter() - t0) * 1e3)
            progress.advance()
    return out, run


def _changed(log: Sequence[Logged], at: int, row: int, vocab: int) -> list[Logged]:
    """`log` with flat row `row`'s token at step `at` bumped by one (accepts unchanged)."""
    tokens = list(log[at].tokens)
    tokens[row] = (tokens[row] + 1) % vocab
    return [dataclasses.replace(x, tokens=tuple(tokens)) if s == at else x for s, x in enumerate(log)]


def verify_plan(
    engine, *, single_ks: Sequence[int] = (), widths: Sequence[int] = (), ks: Sequence[int] = (), fragment: bool = False
) -> list[tuple[list[list[int]], list[list[int]]]]:
    """[(prompts, shapes)]: `--verify` runs prompt 0 alone at each K in `single_ks`;
    `--verify-batch` runs `batch_prompts(n)` for each n in `widths` at `batch_shapes(n, ks)`.
    Each sequence's K is capped by its slot's verify capacity (drafts + 1), then consecutive
    repeats are dropped."""

    def cap_for(n):
        return lambda i: engine.counts.slot_draft_capacity(slot_of(i, n, fragment)) + 1

    vocab = engine.cfg.vocab_size
    if single_ks:
        shapes = [capped([k], cap_for(1)) for k in single_ks]
        return [(prompts(1, vocab), dedup_consecutive(shapes))]
    return [
        (batch_prompts(n, vocab), dedup_consecutive([capped(s, cap_for(n)) for s in batch_shapes(n, ks)]))
        for n in widths
    ]


def diff_verify(
    engine,
    variants: Sequence[Variant],
    plan,
    *,
    steps: int,
    fragment: bool,
    mtp: bool,
    progress: Progress,
    single: bool,
):
    """`--verify` (single) or `--verify-batch`. Returns (report fields, reasons)."""
    nd = engine.settings.num_drafts if mtp else None
    sections, warmups, reasons = [], [], []
    for rows, shapes in plan:
        n = len(rows)
        greedy = run_decode(engine, rows, steps * max(max(s) for s in shapes)).tokens
        for j, ks in enumerate(shapes):
            where = f"verify K={ks[0]}" if single else f"verify-batch n={n} ks={ks}"
            probe = mtp and j == 0
            progress.section(where, (len(variants) + 2) * (steps + 1) + 4 * probe)

            verify = functools.partial(
                run_verify, engine, rows, ks, fragment=fragment, num_drafts=nd, progress=progress
            )
            if probe:
                equal = compare(
                    "first propose", verify(1, greedy=greedy)[1], verify(1, greedy=greedy)[1], BIT_IDENTICAL
                ).ok
                warmups.append({"rows": n, "first_proposes_equal": equal, "discarded_run": not equal})
            log, ref = verify(steps, greedy=greedy)
            runs = [run for _, run in replay_all(engine, variants, functools.partial(verify, steps, log=log))]
            comparisons, timings = compare_all(variants, ref, runs)
            at, row = steps // 2, offsets(ks)[n // 2] + ks[n // 2] - 1
            changed = _changed(log, at, row, engine.cfg.vocab_size)
            _, r = verify(steps, log=changed)
            control = compare(f"{REFERENCE}, one draft changed (step {at}, row {row})", ref, r, BIT_IDENTICAL)
            acc = [list(x.accepted) for x in log]
            full, partial = accept_coverage(acc, ks)
            reasons += [failure_line(where, c) for c in comparisons if not c.ok]
            if not saw_difference(control):
                reasons.append(f"{where}: the detection control saw no difference after changing a draft")
            if full == 0 or partial == 0:
                reasons.append(f"{where}: {full} full and {partial} partial accepts; it needs both")
            section = {
                "rows": n,
                "ks": list(ks),
                "accepted": acc,
                "accept_histogram": accept_histogram(acc),
                "full_accepts": full,
                "partial_accepts": partial,
                "comparisons": [c.to_json() for c in comparisons],
                "timings": timings,
                "detection_control": control.to_json(),
            }
            sections.append({"k": ks[0], **section} if single else section)
    fields = (
        {"mtp": mtp, "verify": sections} if single else {"fragment_slots": fragment, "drafter": mtp, "shapes": sections}
    )
    if mtp:
        fields["drafter_warmup"] = warmups
    return fields, reasons
