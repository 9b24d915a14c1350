"""The decode family: the default mode (one sequence per prompt), `--batch` and `--swap`.

Owns: `run_decode`, the one run loop of the family (prefill n prompts one by one, then decode
them together, optionally spilling and restoring every sequence halfway), and the three mode
drivers `diff_prompts`, `diff_widths` and `diff_swap`.

Invariants:
- The reference decodes greedily; every other run is fed the reference's tokens, so all runs
  decode the same inputs at every row (replays never recompute a token).
- Controls run under the reference forward with one input changed, and must see a difference.
- `--batch`: a row whose prefill breaks a variant's contract is left out of that variant's
  step comparison and reported (`prefill_row_deltas`); more than rows / 8 left out, or the
  control's row left out, fails the width.
- `--swap` with the `oracle` variant: a sequence that never spilled decodes the reference's
  tokens; its logits and final state must equal the spilled reference's byte for byte.
- `--swap`: every run spills before step steps / 2 and restores into another slot and other
  blocks (`SequenceBatch.relocate`). Each variant restores its own record; the last variant
  also restores the reference's (records are exchangeable across forwards); two controls
  restore the reference's record with one element changed and must differ after the spill.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import numpy as np

from metrale_jax.diff.compare import (
    BIT_IDENTICAL,
    Comparison,
    Part,
    Recording,
    compare,
    diff_part,
    diff_parts,
    saw_difference,
    timing,
    without_rows,
)
from metrale_jax.diff.oracle import broke_from
from metrale_jax.diff.progress import SILENT, Progress
from metrale_jax.diff.prompts import batch_prompts, prompts
from metrale_jax.diff.report import describe, failure_line
from metrale_jax.diff.schedule import control_row
from metrale_jax.diff.slot_layout import SequenceBatch
from metrale_jax.diff.state import perturbed, state_parts
from metrale_jax.diff.variants import REFERENCE, Variant, compare_all, replay_all, selected
from metrale_jax.engine.inputs import SwapRecord


@dataclasses.dataclass(frozen=True)
class Spill:
    """Spill every sequence before step `at`, then restore `restore(own records)`."""

    at: int
    restore: Callable[[list[SwapRecord]], list[SwapRecord]] = lambda own: own


@dataclasses.dataclass
class Decoded:
    """A decode run: each row's fed tokens (steps + 1), the run, and with a spill the saved
    records and where each sequence moved."""

    tokens: list[list[int]]
    run: Recording
    records: list[SwapRecord] = dataclasses.field(default_factory=list)
    moves: list[dict] = dataclasses.field(default_factory=list)
    final: list[SwapRecord] = dataclasses.field(default_factory=list)


def run_decode(
    engine,
    rows: Sequence[Sequence[int]],
    steps: int,
    *,
    tokens: list[list[int]] | None = None,
    fragment: bool = False,
    spill: Spill | None = None,
    final: bool = False,
    progress: Progress = SILENT,
) -> Decoded:
    """Prefill `rows` (one sequence each, batch order), then `steps` `decode_batch` steps.
    tokens: per row, the steps + 1 tokens to feed (None: greedy from the run's own logits);
    `final`: also save every sequence's state record after the last step (`Decoded.final`)."""
    out = Decoded(tokens=[], run=Recording(prefill=[]))
    with SequenceBatch(engine, len(rows), fragment) as batch:
        first = batch.prefill(rows)
        out.run.prefill = [Part("logits", first, "logits")]
        out.tokens = [[t[0]] for t in tokens] if tokens else [[int(x)] for x in first.argmax(axis=1)]
        progress.advance()
        for s in range(steps):
            if spill is not None and s == spill.at:
                out.records = [engine.save_sequence_state(q) for q in batch.seqs]
                out.moves = batch.relocate(spill.restore(out.records), rows[0])
            t0 = time.perf_counter()
            logits = engine.decode_batch(batch.seqs, [t[s] for t in out.tokens])
            t1 = time.perf_counter()
            for i, t in enumerate(out.tokens):
                t.append(tokens[i][s + 1] if tokens else int(logits[i].argmax()))
            out.run.steps.append([Part("logits", logits, "logits")])
            out.run.enqueue_ms.append((t1 - t0) * 1e3)
            out.run.step_ms.append((time.perf_counter() - t0) * 1e3)
            progress.advance()
        if final:
            out.final = [engine.save_sequence_state(q) for q in batch.seqs]
    return out


def _changed(tokens: list[list[int]], row: int, at: int, vocab: int) -> list[list[int]]:
    """`tokens` with row `row`'s input at step `at` bumped by one."""
    out = copy.deepcopy(tokens)
    out[row][at] = (out[row][at] + 1) % vocab
    return out


def diff_prompts(engine, variants: Sequence[Variant], *, n_prompts: int, steps: int, progress: Progress):
    """Default mode. Returns (report fields, reasons)."""
    vocab = engine.cfg.vocab_size
    sections: list[dict] = []
    reasons: list[str] = []
    control: Comparison | None = None
    for p, prompt in enumerate(prompts(n_prompts, vocab)):
        progress.section(f"prompt {p}", (len(variants) + 1 + (p == 0)) * (steps + 1))
        ref = run_decode(engine, [prompt], steps, progress=progress)
        replay = functools.partial(run_decode, engine, [prompt], steps, tokens=ref.tokens, progress=progress)
        runs = [d.run for d in replay_all(engine, variants, replay)]
        comparisons, timings = compare_all(variants, ref.run, runs)
        reasons += [failure_line(f"prompt {p}", c) for c in comparisons if not c.ok]
        sections.append({"tokens": len(prompt), "comparisons": [c.to_json() for c in comparisons], "timings": timings})
        if p == 0:
            at = steps // 2
            r = run_decode(engine, [prompt], steps, tokens=_changed(ref.tokens, 0, at, vocab), progress=progress)
            control = compare(f"{REFERENCE}, token changed at step {at}", ref.run, r.run, BIT_IDENTICAL)
            if not saw_difference(control):
                reasons.append("the detection control saw no difference after changing a token")
    assert control is not None, "prompt 0 runs the control (DiffRequest.check: at least one prompt)"
    return {"prompts": sections, "detection_control": control.to_json()}, reasons


def diff_widths(
    engine, variants: Sequence[Variant], *, widths: Sequence[int], fragment: bool, steps: int, progress: Progress
):
    """`--batch`. Returns (report fields, reasons)."""
    vocab = engine.cfg.vocab_size
    sections, reasons = [], []
    for n in widths:
        progress.section(f"batch n={n}", (len(variants) + 2) * (steps + 1))
        rows = batch_prompts(n, vocab)
        ref = run_decode(engine, rows, steps, fragment=fragment, progress=progress)
        replay = functools.partial(
            run_decode, engine, rows, steps, tokens=ref.tokens, fragment=fragment, progress=progress
        )
        runs = [d.run for d in replay_all(engine, variants, replay)]
        left_out = [_left_out(ref.run, r, v.contract) for v, r in zip(variants, runs)]
        comparisons = [
            compare(v.label, without_rows(ref.run, skip), without_rows(r, skip), v.contract)
            for v, r, skip in zip(variants, runs, left_out)
        ]
        row = control_row(n, sorted({i for skip in left_out for i in skip}))
        at = steps // 2
        r = run_decode(
            engine, rows, steps, tokens=_changed(ref.tokens, row, at, vocab), fragment=fragment, progress=progress
        )
        control_skip = _left_out(ref.run, r.run, BIT_IDENTICAL)
        control = compare(
            f"{REFERENCE}, row {row}'s token changed at step {at}",
            without_rows(ref.run, control_skip),
            without_rows(r.run, control_skip),
            BIT_IDENTICAL,
        )
        left_out.append(control_skip)
        deltas = [_row_deltas(ref.run, run, skip) for run, skip in zip(runs + [r.run], left_out)]
        where = f"batch n={n}"
        for label, skip in zip([v.label for v in variants] + ["the control"], left_out):
            if len(skip) * 8 > n:
                reasons.append(f"{where}, {label}: {len(skip)} of {n} rows left out for a differing prefill")
        if row in control_skip:
            reasons.append(f"{where}: the detection control's changed row {row} was left out")
        reasons += [failure_line(where, c) for c in comparisons if not c.ok]
        if not saw_difference(control):
            reasons.append(f"{where}: the detection control saw no difference after changing a token")
        sections.append(
            {
                "rows": n,
                "changed_row": row,
                "comparisons": [c.to_json() for c in comparisons],
                "prefill_rows_differ": left_out,
                "prefill_row_deltas": deltas,
                "timings": [timing(REFERENCE, ref.run)] + [timing(v.label, x) for v, x in zip(variants, runs)],
                "detection_control": control.to_json(),
            }
        )
    return {"fragment_slots": fragment, "widths": sections}, reasons


def _left_out(reference: Recording, run: Recording, contract) -> list[int]:
    """Rows whose prefill logits break `contract`."""
    return [int(i) for i in np.nonzero(diff_part(reference.prefill[0], run.prefill[0], contract).bad_rows)[0]]


def _row_deltas(reference: Recording, run: Recording, rows: Sequence[int]) -> list[dict]:
    """{row, bytes, max_abs, argmax_equal} of each left-out row's prefill logits."""
    out = []
    for i in rows:
        a, b = (Part("logits", x.prefill[0].data[i : i + 1], "logits") for x in (reference, run))
        d = diff_part(a, b, BIT_IDENTICAL)
        out.append({"row": i, "bytes": d.differing_bytes, "max_abs": d.max_abs, "argmax_equal": d.argmax_equal})
    return out


def diff_swap(engine, variants: Sequence[Variant], *, steps: int, progress: Progress):
    """`--swap`. Returns (report fields, reasons)."""
    prompt = prompts(1, engine.cfg.vocab_size)[0]
    at = steps // 2
    oracles = [v for v in variants if v.step == "oracle"]
    variants = [v for v in variants if v.step != "oracle"] or [Variant("xla-repeat", REFERENCE)]
    last = variants[-1]
    progress.section("swap", (len(variants) + 4 + 2 * bool(oracles)) * (steps + 1))
    ref = run_decode(engine, [prompt], steps, spill=Spill(at), final=bool(oracles), progress=progress)
    ref_record = state_parts(engine.cfg, ref.records[0])

    def spilled(restore=Spill(at).restore):
        return run_decode(engine, [prompt], steps, tokens=ref.tokens, spill=Spill(at, restore), progress=progress)

    runs = [(v.label, v.contract, r) for v, r in zip(variants, replay_all(engine, variants, spilled))]
    with selected(engine, last.forward):
        runs.append((f"{last.label}, {REFERENCE}'s record", last.contract, spilled(lambda own: ref.records)))
    changed, where = perturbed(ref.records[0])
    controls = []
    for label, forward in [(REFERENCE, REFERENCE), (last.label, last.forward)]:
        with selected(engine, forward):
            controls.append((f"{label}, record changed ({where})", BIT_IDENTICAL, spilled(lambda own: [changed])))
    comparisons = [_swap_comparison(engine.cfg, label, ref, ref_record, r, c, at) for label, c, r in runs]
    control_rows = [_swap_comparison(engine.cfg, label, ref, ref_record, r, c, at) for label, c, r in controls]
    reasons = [
        f"swap, {c['variant']}: record {'ok' if c['record_ok'] else 'differs'}, steps before the spill "
        f"{'ok' if c['steps_before_ok'] else 'differ'}, after {'ok' if c['steps_after_ok'] else 'differ'}; "
        f"first at {describe(c['comparison']['first_violation'] or c['record_first_violation'])}"
        for c in comparisons
        if not (c["record_ok"] and c["steps_before_ok"] and c["steps_after_ok"])
    ]
    reasons += [
        f"swap control `{c['variant']}` saw no difference after the spill"
        for c in control_rows
        if not c["saw_difference_after"]
    ]
    fields = {}
    for v in oracles:
        c, control = _never_spilled(engine, v, prompt, ref, at, progress)
        fired = broke_from(control, at, c)
        fields = {"oracle": c.to_json(), "oracle_detection_control": {**control.to_json(), "fired": fired}}
        reasons += [failure_line("swap", c)] if not c.ok else []
        if not fired:
            reasons.append(f"swap control `{control.variant}` kept the oracle's contract after a token changed")
    return {
        **fields,
        "prompt_tokens": len(prompt),
        "spill_before_step": at,
        "moves": ref.moves,
        "timings": [timing(REFERENCE, ref.run)] + [timing(label, r.run) for label, _, r in runs[:-1]],
        "comparisons": comparisons,
        "controls": control_rows,
    }, reasons


def _never_spilled(engine, v: Variant, prompt, ref: Decoded, at: int, progress: Progress):
    """The swap's oracle: the reference's tokens decoded by a sequence that never spilled, its
    logits every step and its state after the last compared with the spilled reference's
    (bit-identical, `v.contract`: the same programs at the same shapes, only the slot and
    blocks differ).
    Returns (comparison, control: the same with the token of step `at` changed)."""

    def with_final(d: Decoded) -> Recording:
        steps = d.run.steps[:-1] + [d.run.steps[-1] + state_parts(engine.cfg, d.final[0])]
        return Recording(prefill=d.run.prefill, steps=steps)

    def never(tokens):
        with selected(engine, v.forward):
            return with_final(
                run_decode(engine, [prompt], len(ref.run.steps), tokens=tokens, final=True, progress=progress)
            )

    reference = with_final(ref)
    c = compare(f"{v.label} (never spilled)", reference, never(ref.tokens), v.contract)
    changed = never(_changed(ref.tokens, 0, at, engine.cfg.vocab_size))
    return c, compare(f"{v.label}, token changed at step {at}", reference, changed, v.contract)


def _swap_comparison(cfg, label: str, ref: Decoded, ref_record: list[Part], run: Decoded, contract, at: int) -> dict:
    """A spilled run against the reference: its record, then its steps before and after."""
    record = diff_parts(ref_record, state_parts(cfg, run.records[0]), contract)
    bad = next((d.violation for d in record if d.violation), None)
    c: Comparison = compare(label, ref.run, run.run, contract)
    steps = [s for s in c.violating_steps if s != "prefill"]
    return {
        "variant": label,
        "record_equal": not any(d.differing_bytes for d in record),
        "record_ok": bad is None,
        "record_first_violation": None if bad is None else {"step": f"the record saved before step {at}", **bad},
        "record_bytes": sum(p.data.nbytes for p in ref_record),
        "steps_before_ok": all(s >= at for s in steps) and "prefill" not in c.violating_steps,
        "steps_after_ok": all(s < at for s in steps),
        "saw_difference_after": any(s >= at for s in steps),
        "first_mismatch": c.first_mismatch,
        "comparison": c.to_json(),
    }
