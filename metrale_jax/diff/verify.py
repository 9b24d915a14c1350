"""The verify family: `--verify K,..` (one sequence) and `--verify-batch n,..`.

Owns: `run_verify`, the run loop of the family (the scheduler's composed step after every
verdict, as `speculative_generate(fused=False)` runs it), `run_fused` (the fused step in
lock-step with the composed one), `verify_plan` (the widths and capped shapes each mode runs)
and the driver `diff_verify`.

A step, for n sequences at widths ks (rows flat and seq-major, sequence i's rows
`[last_i, d_1 .. d_{K_i - 1}]`): `verify_batched` (write-on-accept); each sequence's accepted
drafts; `Engine.accept` (the GDN fold, the host rewind of the rejected rows, the commit of rows
0..na, with the drafter the accepted rows' hiddens stashed); with the drafter, the batched
propose of `num_drafts` drafts and the trim of every drafter back to the committed context. A
step's parts: the R = Σ K verify logits rows, then (drafter) `compare.propose_parts`: each draft
position's logits, the drafts and their confidences.

The `fused` variant's step (`run_fused`): from one copy of the pool and of the host state, the
composed step above, then `Engine.speculative_step` on the same rows; each side's parts are the
ones above, then the accepted counts, the emitted tokens, the lengths and every pool leaf (junk
included), compared byte for byte (the pool leaves as the step is recorded, `state.settle_pools`: a run
holds their diffs, not 2 x steps copies of the pool). The run continues from the fused side.

Invariants:
- The reference's drafts are each sequence's greedy continuation (plain greedy decoding of the
  same prompts, `decode.run_decode`) with one corrupted on odd steps (offset by the sequence's
  index), so full and partial accepts both occur; every other run replays the reference's
  logged tokens and accept counts and never recomputes them.
- The `oracle` variant (`diff.oracle`) replays the reference's committed tokens through the
  plain path; the reference run then also records every sequence's state after the prefill and
  after each step (a read that changes nothing).
- A shape whose reference saw no full accept or no partial accept fails ("it needs both").
- The control (reference forward) changes the last draft of sequence n // 2 halfway; the fused
  variant's control changes it on the fused side of that step only.
- With the drafter, two identical one-step reference runs go first at each width: the drafter's
  state is a pure function of the steps, so the two must agree; `drafter_warmup` reports
  whether they did (a disagreement reports one run as discarded).
- Sampled (`--temperature`, sequence i seeded seed + i, `sampling.per_sequence`): the reference's
  drafts come from plain sampling's continuation (`greedy_generate` with the seeds), its verify
  draws and accepts on the draws (gumbel speculative sampling) and its propose drafts with the
  coupled drafter; every replay passes the same parameters. The `plain sampling` check: each
  sequence's committed tokens equal plain sampling's, token for token; its control runs plain
  sampling with sequence n // 2's seed changed and must see a difference.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

import jax
import numpy as np

from metrale_jax.diff.compare import (
    BIT_IDENTICAL,
    Comparison,
    Part,
    Recording,
    compare,
    propose_parts,
    saw_difference,
    timing,
)
from metrale_jax.diff.decode import run_decode
from metrale_jax.diff.oracle import broke_from, oracle_comparison
from metrale_jax.diff.progress import SILENT, Progress
from metrale_jax.diff.prompts import batch_prompts, prompts
from metrale_jax.diff.report import failure_line
from metrale_jax.diff.schedule import (
    Layout,
    accept_coverage,
    accept_histogram,
    batch_shapes,
    capped,
    dedup_consecutive,
    offsets,
    slot_of,
    step_drafts,
)
from metrale_jax.diff.slot_layout import SequenceBatch
from metrale_jax.diff.state import settle_pools
from metrale_jax.diff.variants import REFERENCE, Variant, selected
from metrale_jax.engine.sampling import Sampling, per_sequence
from metrale_jax.engine.speculative import accepted_drafts as accepted
from metrale_jax.engine.speculative import greedy_generate


@dataclasses.dataclass(frozen=True)
class Logged:
    """One verify step as the reference ran it: the flat tokens and each sequence's accepts; a
    sampled reference also logs each sequence's draw after its accepted drafts (`nexts`)."""

    tokens: tuple[int, ...]
    accepted: tuple[int, ...]
    nexts: tuple[int, ...] = ()


def run_verify(
    engine,
    rows: Sequence[Sequence[int]],
    ks: Sequence[int],
    steps: int,
    *,
    greedy: Sequence[Sequence[int]] | None = None,
    log: Sequence[Logged] | None = None,
    fragment: Layout = False,
    num_drafts: int | None = None,
    states: list | None = None,
    progress: Progress = SILENT,
    sampling: Sequence[Sampling] | None = None,
) -> tuple[list[Logged], Recording]:
    """One run of `steps` verify steps of `rows` at widths `ks` (see the module docstring).
    Exactly one of `greedy` (reference: drafts from each row's greedy continuation, accepts
    from the verify's argmax) and `log` (replay) is given; `num_drafts` turns the drafter on.
    `states`, when given, gets each sequence's `save_sequence_state` record after the prefill
    and after every step (for the oracle; reading the state changes nothing). `sampling` (per
    sequence): the verify draws and the propose drafts with the coupled drafter; the reference's
    first token is then `greedy`'s (plain sampling's draw after the same prompt)."""
    if (greedy is None) == (log is None):
        raise ValueError("run_verify needs exactly one of greedy and log")
    vocab, n, off = engine.cfg.vocab_size, len(rows), offsets(ks)
    out: list[Logged] = []
    run = Recording(prefill=[])
    with SequenceBatch(engine, n, fragment) as batch:
        seqs = batch.seqs
        first = batch.prefill(rows)
        run.prefill = [Part("logits", first, "logits")]
        last = [int(x) for x in first.argmax(axis=1)]
        if sampling is not None and greedy is not None:
            last = [int(g[0]) for g in greedy]
        pos = [0] * n
        if states is not None:
            states.append([engine.save_sequence_state(q) for q in seqs])
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
            logits, argmax = engine.verify_batched(seqs, tokens, ks, sampling)
            t1 = time.perf_counter()
            na = (
                list(log[s].accepted)
                if log is not None
                else [accepted(tokens[off[i] : off[i + 1]], argmax[off[i] : off[i + 1]]) for i in range(n)]
            )
            engine.accept(seqs, na)
            for i in range(n):
                if log is not None and s + 1 < len(log):  # a replay feeds the next logged token
                    last[i] = log[s + 1].tokens[off[i]]
                else:
                    last[i] = int(argmax[off[i] + na[i]])
                pos[i] += na[i] + 1
            proposed = None
            if num_drafts:
                proposed = engine.propose_batched(seqs, last, num_drafts, sampling)
                for seq in seqs:
                    engine.trim_proposer(seq, 0)
            parts = _step_parts(logits, proposed)
            if states is not None:
                states.append([engine.save_sequence_state(q) for q in seqs])
            nexts = tuple(int(argmax[off[i] + na[i]]) for i in range(n)) if sampling is not None else ()
            out.append(Logged(tuple(int(t) for t in tokens), tuple(na), nexts))
            run.steps.append(parts)
            run.enqueue_ms.append((t1 - t0) * 1e3)
            run.step_ms.append((time.perf_counter() - t0) * 1e3)
            progress.advance()
    return out, run


def run_fused(
    engine,
    rows: Sequence[Sequence[int]],
    ks: Sequence[int],
    log: Sequence[Logged],
    *,
    fragment: Layout = False,
    num_drafts: int | None = None,
    changed: tuple[int, int] | None = None,
    progress: Progress = SILENT,
    sampling: Sequence[Sampling] | None = None,
) -> tuple[Recording, Recording]:
    """The fused step in lock-step with the composed one over the reference's `log` (see the
    module docstring): (composed run, fused run). `changed` = (step, flat row): the fused side of
    that step verifies that row's token bumped by one (the control). `sampling`: as `run_verify`'s."""
    n, off, nd = len(rows), offsets(ks), num_drafts or 0
    composed, fused = Recording(prefill=[]), Recording(prefill=[])
    with SequenceBatch(engine, n, fragment) as batch:
        seqs = batch.seqs
        first = batch.prefill(rows)
        composed.prefill = fused.prefill = [Part("logits", first, "logits")]
        progress.advance()
        for s, logged in enumerate(log):
            tokens, na = list(logged.tokens), list(logged.accepted)
            pool = jax.tree_util.tree_map(lambda x: x.copy(), engine.pool)
            host = [(q.seq_len, list(q.tokens), q.drafter_len, q.last_num_drafted) for q in seqs]
            t0 = time.perf_counter()
            logits, argmax = engine.verify_batched(seqs, tokens, ks, sampling)
            engine.accept(seqs, na)
            emitted = [int(argmax[off[i] + j]) for i in range(n) for j in range(na[i] + 1)]
            proposed = None
            if nd:
                proposed = engine.propose_batched(seqs, [int(argmax[off[i] + na[i]]) for i in range(n)], nd, sampling)
                for seq in seqs:
                    engine.trim_proposer(seq, 0)
            parts = _step_parts(logits, proposed)
            composed.step_ms.append((time.perf_counter() - t0) * 1e3)
            composed.steps.append(parts + _outcome(engine, seqs, na, emitted))
            composed_pool, engine.pool = engine.pool, pool
            for q, (seq_len, toks, drafter_len, drafted) in zip(seqs, host):
                q.seq_len, q.tokens, q.drafter_len, q.last_num_drafted = seq_len, toks, drafter_len, drafted
            if changed is not None and changed[0] == s:
                tokens[changed[1]] = (tokens[changed[1]] + 1) % engine.cfg.vocab_size
            t0 = time.perf_counter()
            out = engine.speculative_step(seqs, tokens, ks, nd, logits=True, sampling=sampling)
            fused.step_ms.append((time.perf_counter() - t0) * 1e3)
            parts = _step_parts(out.verify_logits, (out.drafts, out.confidences, out.draft_logits) if nd else None)
            emitted = [t for e in out.emitted for t in e]
            fused.steps.append(parts + _outcome(engine, seqs, [int(a) for a in out.accepted], emitted))
            # NOTE: the two pools are compared now, leaf by leaf, and only their diffs kept: both sides'
            # whole pools at every step would be 2 x steps pools (the 0.8B stand-in's: past 12 GB at 8 steps).
            fused.settled[s] = settle_pools(composed_pool, engine.pool, BIT_IDENTICAL)
            del composed_pool
            progress.advance()
    composed.enqueue_ms, fused.enqueue_ms = composed.step_ms, fused.step_ms
    return composed, fused


def _step_parts(verify_logits, proposed) -> list[Part]:
    """A step's verify logits and, when it proposed, (drafts, confidences, each draft's logits) as parts."""
    parts = [Part("verify logits", verify_logits, "logits")]
    return parts + (propose_parts(*proposed) if proposed is not None else [])


def _outcome(engine, seqs, accepted: Sequence[int], emitted: Sequence[int]) -> list[Part]:
    """A lock-step side's verdict and host lengths as parts (its whole pool: settled apart, `state.settle_pools`)."""
    lengths = np.asarray([[q.seq_len, q.drafter_len] for q in seqs], np.int32)
    return [
        Part("accepted", np.asarray(accepted, np.int32), "tokens"),
        Part("emitted", np.asarray(emitted, np.int32), "tokens"),
        Part("seq_len, drafter_len", lengths, "tokens"),
    ]


def committed_streams(log: Sequence[Logged], ks: Sequence[int]) -> list[list[int]]:
    """Each sequence's committed tokens in a verify log: per step its anchor and accepted drafts."""
    off = offsets(ks)
    return [[t for x in log for t in x.tokens[off[i] : off[i] + x.accepted[i] + 1]] for i in range(len(ks))]


def edge_hits(log: Sequence[Logged], ks: Sequence[int], vocab: int, k_max: int) -> dict:
    """What `--vocab-stress` made the reference meet: committed tokens 0 and vocab - 1, and full
    accepts below K_max whose last row's argmax (the next step's first token) is 0, the case a
    padding sentinel of 0 collides with."""
    committed = [t for stream in committed_streams(log, ks) for t in stream]
    off = offsets(ks)
    collisions = sum(
        log[s].accepted[i] == ks[i] - 1 and ks[i] < k_max and log[s + 1].tokens[off[i]] == 0
        for s in range(len(log) - 1)
        for i in range(len(ks))
    )
    return {
        "committed_0": committed.count(0),
        "committed_last_id": committed.count(vocab - 1),
        "full_accepts_below_k_max_then_0": collisions,
    }


def plain_sampling_check(label: str, streams: Sequence[Sequence[int]], plain: Sequence[Sequence[int]]) -> dict:
    """Whether each sequence's committed tokens are plain sampling's (`plain`: its continuation
    of the same prompts and seeds): {label, ok, tokens compared, first_mismatch (sequence,
    index) or None}."""
    first = next(
        ([i, j] for i, (a, b) in enumerate(zip(streams, plain)) for j, (x, y) in enumerate(zip(a, b)) if x != y),
        None,
    )
    return {"label": label, "ok": first is None, "tokens": sum(map(len, streams)), "first_mismatch": first}


def _changed(log: Sequence[Logged], at: int, row: int, vocab: int) -> list[Logged]:
    """`log` with flat row `row`'s token at step `at` bumped by one (accepts unchanged)."""
    tokens = list(log[at].tokens)
    tokens[row] = (tokens[row] + 1) % vocab
    return [dataclasses.replace(x, tokens=tuple(tokens)) if s == at else x for s, x in enumerate(log)]


def verify_plan(
    engine,
    *,
    single_ks: Sequence[int] = (),
    widths: Sequence[int] = (),
    ks: Sequence[int] = (),
    fragment: Layout = False,
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
    fragment: Layout,
    mtp: bool,
    progress: Progress,
    single: bool,
    sampling: Sampling | None = None,
):
    """`--verify` (single) or `--verify-batch`; with `sampling` sampled (module docstring).
    Returns (report fields, reasons)."""
    nd = engine.settings.num_drafts if mtp else None
    sections, warmups, reasons = [], [], []
    for rows, shapes in plan:
        n = len(rows)
        length = steps * max(max(s) for s in shapes)
        seeded = per_sequence(sampling, n)
        if seeded is None:
            greedy = run_decode(engine, rows, length).tokens
        else:
            greedy = greedy_generate(engine, rows, length + 1, sampling=seeded)
            other = list(seeded)
            other[n // 2] = dataclasses.replace(other[n // 2], seed=other[n // 2].seed + 1000)
            reseeded = greedy_generate(engine, rows, length + 1, sampling=other)
        for j, ks in enumerate(shapes):
            where = f"verify K={ks[0]}" if single else f"verify-batch n={n} ks={ks}"
            probe = mtp and j == 0
            fused = sum(v.step == "fused" for v in variants)
            oracles = [v for v in variants if v.step == "oracle"]
            progress.section(where, (len(variants) + 2 + bool(fused) + bool(oracles)) * (steps + 1) + 4 * probe)

            verify = functools.partial(
                run_verify, engine, rows, ks, fragment=fragment, num_drafts=nd, progress=progress, sampling=seeded
            )
            if probe:
                equal = compare(
                    "first propose", verify(1, greedy=greedy)[1], verify(1, greedy=greedy)[1], BIT_IDENTICAL
                ).ok
                warmups.append({"rows": n, "first_proposes_equal": equal, "discarded_run": not equal})
            states: list | None = [] if oracles else None
            log, ref = verify(steps, greedy=greedy, states=states)
            at, row = steps // 2, offsets(ks)[n // 2] + ks[n // 2] - 1
            comparisons: list[Comparison] = []
            timings, fused_control, oracle_at = [timing(REFERENCE, ref)], None, 0
            oracle_control: tuple[Comparison, Comparison] | None = None  # (control, the clean comparison)
            for v in variants:
                with selected(engine, v.forward, v.mesh):
                    if v.step == "oracle":
                        c, control, oracle_at = oracle_comparison(
                            engine,
                            rows,
                            ks,
                            log,
                            ref,
                            states,
                            v.contract,
                            fragment=fragment,
                            num_drafts=nd,
                            control=j == 0,
                            sampling=seeded,
                        )
                        comparisons.append(dataclasses.replace(c, variant=v.label))
                        if oracle_control is None and control is not None:
                            oracle_control = control, c
                        if states is not None:
                            states.clear()  # only the oracle reads them: the variants after it run without
                        progress.advance((1 + (j == 0)) * (steps + 1))
                    elif v.step == "fused":
                        lockstep = functools.partial(
                            run_fused,
                            engine,
                            rows,
                            ks,
                            log,
                            fragment=fragment,
                            num_drafts=nd,
                            progress=progress,
                            sampling=seeded,
                        )
                        a, b = lockstep()
                        comparisons.append(compare(v.label, a, b, v.contract))
                        timings += [timing(f"{v.label}: its composed side", a), timing(v.label, b)]
                        if fused_control is None:
                            a, b = lockstep(changed=(at, row))
                            fused_control = compare(
                                f"{v.label}, one draft changed on the fused side (step {at}, row {row})",
                                a,
                                b,
                                BIT_IDENTICAL,
                            )
                    else:
                        _, r = verify(steps, log=log)
                        comparisons.append(compare(v.label, ref, r, v.contract))
                        timings.append(timing(v.label, r))
            _, r = verify(steps, log=_changed(log, at, row, engine.cfg.vocab_size))
            control = compare(f"{REFERENCE}, one draft changed (step {at}, row {row})", ref, r, BIT_IDENTICAL)
            acc = [list(x.accepted) for x in log]
            full, partial = accept_coverage(acc, ks)
            reasons += [failure_line(where, c) for c in comparisons if not c.ok]
            if not saw_difference(control):
                reasons.append(f"{where}: the detection control saw no difference after changing a draft")
            if fused_control is not None and not saw_difference(fused_control):
                reasons.append(f"{where}: the fused step's detection control saw no difference after changing a draft")
            oracle_fired = (
                None if oracle_control is None else broke_from(oracle_control[0], oracle_at, oracle_control[1])
            )
            if oracle_fired is False:
                reasons.append(
                    f"{where}: the oracle's detection control kept its contract after a committed token changed"
                )
            if full == 0 or partial == 0:
                reasons.append(f"{where}: {full} full and {partial} partial accepts; it needs both")
            plain = None
            if seeded is not None:
                streams = committed_streams(log, ks)
                plain = [
                    plain_sampling_check("plain sampling", streams, greedy),
                    plain_sampling_check(f"plain sampling, sequence {n // 2}'s seed changed", streams, reseeded),
                ]
                if not plain[0]["ok"]:
                    reasons.append(
                        f"{where}: plain sampling emitted other tokens than the speculative reference "
                        f"(sequence, token) {plain[0]['first_mismatch']}"
                    )
                if plain[1]["ok"]:
                    reasons.append(f"{where}: the plain-sampling control saw no difference after changing a seed")
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
            if not isinstance(fragment, bool):
                section["slots"] = [slot_of(i, n, fragment) for i in range(n)]
            if getattr(engine.cfg, "vocab_stress", False):
                section["edge_hits"] = edge_hits(log, ks, engine.cfg.vocab_size, engine.counts.k)
            if fused_control is not None:
                section["fused_detection_control"] = fused_control.to_json()
            if oracle_control is not None:
                section["oracle_detection_control"] = {**oracle_control[0].to_json(), "fired": oracle_fired}
            if plain is not None:
                section["plain_sampling"], section["plain_sampling_control"] = plain
            sections.append({"k": ks[0], **section} if single else section)
    layout = {"fragment_slots": fragment} if isinstance(fragment, bool) else {"tier_slots": True}
    fields = {"mtp": mtp, "verify": sections} if single else {**layout, "drafter": mtp, "shapes": sections}
    if mtp:
        fields["drafter_warmup"] = warmups
    return fields, reasons
