"""The `oracle` variant: the reference's committed tokens replayed through the plain path only.

Owns: `ORACLE` (the variant), `committed_view` (the part of a verify reference run that a plain
replay can reproduce), `run_oracle` (that replay) and `oracle_comparison` (the two compared, with
the oracle's detection control).

The verify family's reference runs the speculative machinery (write-on-accept verify, stash,
fold, rewind, commit, propose trimmed back). Every other variant replays that machinery, so a
bug in it is in the reference and the replay alike. The oracle runs none of it: each sequence
is prefilled in one pass (the serve's chunk) and then decodes (`decode_batch`), step by step,
exactly the tokens the reference committed at that step (row 0 and the accepted drafts), the
sequences that still have tokens at a sub-step decoding together; with the drafter it then
proposes from the committed context (the reference's next token), whose drafter context is
then the committed tokens (the oracle sets it; the reference's trim must agree). It is compared
with the reference's committed view:

- prefill: the last position's logits, then each sequence's state (`state.state_parts`:
  every layer's GDN h and conv window, K and V at the live positions, the MTP stash and
  drafter KV, the tokens), each part named `seq i <part>`;
- each step, per sequence: the logits of rows 0..na (every accepted row and the row after the
  last accepted draft, whose argmax is the emitted token), then its state after the step; then,
  with the drafter, the propose's parts (`compare.propose_parts`: each draft's logits, the drafts,
  their confidences).

Contract (`oracle_contract`): bounded, `ORACLE_RTOL` times each part's max |ref| (the prefill is
one pass against the reference's chunks of `slot_layout.PREFILL_CHUNK`, a verify's rows are one
program and a decode's another: XLA CPU fuses and rounds them differently), every argmax equal
and every token (drafts, committed tokens) exact; a structural difference (a sequence whose
host length or drafter length differs) breaks it. With a float32 model and a KV cache narrower
than float32 the bound is `ORACLE_RTOL_ROUNDED`. With a model computing in a narrower type
(bf16) the bound is `compute_rtol` (`ORACLE_SIGMAS` x sqrt(rounding stages) x eps of that type,
at least `ORACLE_RTOL_ROUNDED`), and an argmax flip is excused where the reference's gap between
the two argmaxes is within it (`Contract.argmax_gap`), and a greedy draft that flips so is
judged up to that draft (`compare.draft_chain_cuts`: the drafts after it follow another token);
other tokens stay exact. Under `--batch-invariant`
(`EngineSettings.batch_invariant`) the contract is bit-identical for every part
(`ORACLE_INVARIANT_CONTRACT`): a verify row, a decode and a prefill chunk on the GDN chunk grid run
the same arithmetic per token, whatever the KV dtype (a narrow KV rounds each written row once, and
every reader reads those bytes).

Invariants:
- The oracle never calls `verify_batched`, `accept`, `speculative_step`, the stash, fold,
  rewind, commit or trim; its engine calls are `prefill`, `decode_batch`, `propose_batched`
  and `save_sequence_state`.
- The control feeds the oracle one committed token changed (sequence n // 2's row 0, halfway):
  it must break the contract from that step on. The verify modes run it on the first shape of
  each width (the oracle's code is the same for every shape).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import ml_dtypes
import numpy as np

from metrale_jax.diff.compare import Comparison, Contract, Part, Recording, bounded, compare, propose_parts
from metrale_jax.diff.schedule import Layout, offsets
from metrale_jax.diff.slot_layout import SequenceBatch
from metrale_jax.diff.state import state_parts
from metrale_jax.engine.sampling import Sampling

#: The oracle variant's label (and its engine forward is the reference's).
ORACLE = "oracle"
#: The oracle's declared bound where the model and the KV cache are float32: a verify and a
#: decode, a chunked and a one-pass prefill round differently (a few ULP of a part's largest
#: value; tolerance: 25x the largest such difference measured, see BUILD_NOTES), while a
#: state-handling bug moves a logit or a state element by far more.
ORACLE_RTOL = 1e-4
#: The bound where the KV cache (or the model) rounds to a narrower type: a rounding-level
#: difference of a row then flips the rounding of a KV element now and then (one step of that
#: type), which the propose's chained drafts read back (10x the largest measured).
ORACLE_RTOL_ROUNDED = 5e-3
ORACLE_CONTRACT = bounded(ORACLE_RTOL, "the plain path: one-pass prefill, decodes instead of verify rows")
#: The bound's margin over the expected spread of a narrow compute type's rounding (in standard deviations).
ORACLE_SIGMAS = 4


def rounding_stages(cfg) -> int:
    """The stages that round a value to the compute dtype between the first token and a compared
    part: each trunk layer's residual update, each MTP layer's, and the final norm with the head."""
    return cfg.num_hidden_layers + cfg.num_mtp_layers + 1


def compute_rtol(dtype, cfg) -> float:
    """The oracle's relative bound for a model computing in `dtype` (narrower than float32).
    NOTE: derivation. Each stage rounds its output to `dtype`, at most eps/2 relative in either run;
    the two runs round at different points (another fusion, another chunking), so a stage moves a
    value by up to eps of its part's scale, and independent stages add in quadrature: after n
    stages the spread is sqrt(n) eps · max|ref|. The bound is `ORACLE_SIGMAS` spreads."""
    return ORACLE_SIGMAS * math.sqrt(rounding_stages(cfg)) * float(ml_dtypes.finfo(dtype).eps)


ORACLE_INVARIANT_CONTRACT = Contract(
    reason="--batch-invariant: verify rows, decodes and prefill chunks share each token's arithmetic"
)


def oracle_contract(engine) -> Contract:
    """The oracle's contract on `engine`: bit-identical under --batch-invariant, else `ORACLE_RTOL` with a
    float32 model and KV cache, `ORACLE_RTOL_ROUNDED` with a float32 model and a narrower KV cache, and
    `compute_rtol` with argmax near-ties excused for a model computing in a narrower type."""
    if getattr(engine.settings, "batch_invariant", False):
        return ORACLE_INVARIANT_CONTRACT
    dtype = np.dtype(engine.dtype)
    if dtype == np.float32:
        if engine.settings.kv_cache_dtype == "f32":
            return ORACLE_CONTRACT
        return bounded(ORACLE_RTOL_ROUNDED, "the plain path, and a KV cache or model that rounds to a narrower type")
    n, rtol = rounding_stages(engine.cfg), compute_rtol(dtype, engine.cfg)
    reason = (
        f"the plain path in {dtype.name} compute: {ORACLE_SIGMAS} x sqrt({n} rounding stages) x eps "
        f"{float(ml_dtypes.finfo(dtype).eps):g}; argmax flips excused within the bound"
    )
    return Contract(max(rtol, ORACLE_RTOL_ROUNDED), reason, argmax_gap=True)


@dataclasses.dataclass(frozen=True)
class Committed:
    """One reference verify step as the oracle replays it: per sequence, the tokens it committed
    (row 0, then its accepted drafts) and the token it emits next (the argmax of its last
    accepted row, which the propose pairs with the stash)."""

    tokens: tuple[tuple[int, ...], ...]
    nexts: tuple[int, ...]


def committed_steps(log, run: Recording, ks: Sequence[int]) -> list[Committed]:
    """The reference's committed tokens per step, from its `verify.Logged` steps and its run
    (part 0 of a step: the flat verify logits; a sampled step's next tokens are its logged draws)."""
    off, out = offsets(ks), []
    for logged, parts in zip(log, run.steps):
        argmax = parts[0].data.argmax(axis=1)
        rows = [logged.tokens[off[i] : off[i] + a + 1] for i, a in enumerate(logged.accepted)]
        nexts = list(logged.nexts) or [int(argmax[off[i] + a]) for i, a in enumerate(logged.accepted)]
        out.append(Committed(tuple(tuple(r) for r in rows), tuple(nexts)))
    return out


def _seq_parts(cfg, i: int, records) -> list[Part]:
    return [dataclasses.replace(p, name=f"seq {i} {p.name}") for p in state_parts(cfg, records[i])]


def committed_view(cfg, run: Recording, log, ks: Sequence[int], states: Sequence[list], drafter: bool) -> Recording:
    """The reference verify `run` cut to what the plain path reproduces (module docstring).
    states[0]: each sequence's `save_sequence_state` record after the prefill; states[s + 1]:
    after step s (after its propose and trim)."""
    off = offsets(ks)
    view = Recording(prefill=[run.prefill[0]] + [p for i in range(len(ks)) for p in _seq_parts(cfg, i, states[0])])
    for s, (logged, parts) in enumerate(zip(log, run.steps)):
        step = []
        for i, a in enumerate(logged.accepted):
            step.append(Part(f"seq {i} logits", parts[0].data[off[i] : off[i] + a + 1], "logits"))
            step += _seq_parts(cfg, i, states[s + 1])
        view.steps.append(step + (list(parts[1:]) if drafter else []))
    return view


def run_oracle(
    engine,
    rows: Sequence[Sequence[int]],
    steps: Sequence[Committed],
    *,
    fragment: Layout = False,
    num_drafts: int | None = None,
    sampling: Sequence[Sampling] | None = None,
) -> Recording:
    """The plain-path replay of `steps` for prompts `rows` (module docstring), in the slot layout
    of the reference (`SequenceBatch`): a `Recording` shaped like `committed_view`'s. `sampling`
    (per sequence): the propose drafts with the coupled drafter, as the sampled reference's."""
    cfg, n = engine.cfg, len(rows)
    with SequenceBatch(engine, n, fragment) as batch:
        seqs = batch.seqs
        first = np.stack([engine.prefill(q, p) for q, p in zip(seqs, rows)])
        records = [engine.save_sequence_state(q) for q in seqs]
        run = Recording(
            prefill=[Part("logits", first, "logits")] + [p for i in range(n) for p in _seq_parts(cfg, i, records)]
        )
        for c in steps:
            logits: list[list[np.ndarray]] = [[] for _ in range(n)]
            for j in range(max(len(t) for t in c.tokens)):
                idx = [i for i in range(n) if j < len(c.tokens[i])]
                out = engine.decode_batch([seqs[i] for i in idx], [c.tokens[i][j] for i in idx])
                for i, row in zip(idx, out):
                    logits[i].append(row)
            tail = []
            if num_drafts:
                drafts, conf, draft_logits = engine.propose_batched(seqs, list(c.nexts), num_drafts, sampling)
                for q in seqs:
                    # NOTE: the oracle states the drafter's context itself (the committed tokens;
                    # the propose wrote its last row) instead of calling the engine's trim.
                    q.drafter_len = q.seq_len
                tail = propose_parts(drafts, conf, draft_logits)
            records = [engine.save_sequence_state(q) for q in seqs]
            step = []
            for i in range(n):
                step.append(Part(f"seq {i} logits", np.stack(logits[i]), "logits"))
                step += _seq_parts(cfg, i, records)
            run.steps.append(step + tail)
    return run


def changed_commit(steps: Sequence[Committed], at: int, seq: int, vocab: int) -> list[Committed]:
    """`steps` with sequence `seq`'s first committed token at step `at` bumped by one."""
    out = list(steps)
    tokens = [list(t) for t in out[at].tokens]
    tokens[seq][0] = (tokens[seq][0] + 1) % vocab
    out[at] = dataclasses.replace(out[at], tokens=tuple(tuple(t) for t in tokens))
    return out


def broke_from(control: Comparison, at: int, clean: Comparison) -> bool:
    """A bounded control's pass condition: its contract breaks at a step `at` or later at which the
    clean comparison (the same run without the change) keeps it: a violation the clean run has
    too is not the change's, and a control that only repeats it has detected nothing."""
    return any(isinstance(s, int) and s >= at and s not in clean.violating_steps for s in control.violating_steps)


def oracle_comparison(
    engine,
    rows,
    ks,
    log,
    ref: Recording,
    states,
    contract: Contract,
    *,
    fragment: Layout,
    num_drafts: int | None,
    control: bool = True,
    sampling: Sequence[Sampling] | None = None,
) -> tuple[Comparison, Comparison | None, int]:
    """(the oracle against the reference's committed view under `contract`, with `control` its
    control (else None), the control's step); `sampling` as `run_oracle`'s."""
    steps = committed_steps(log, ref, ks)
    view = committed_view(engine.cfg, ref, log, ks, states, bool(num_drafts))
    run = run_oracle(engine, rows, steps, fragment=fragment, num_drafts=num_drafts, sampling=sampling)
    at, seq = len(steps) // 2, len(rows) // 2
    # NOTE: compared before the control runs, so that one replay's recording (every sequence's state
    # after every step) is held at a time.
    clean = compare(ORACLE, view, run, contract)
    del run
    if not control:
        return clean, None, at
    changed = run_oracle(
        engine,
        rows,
        changed_commit(steps, at, seq, engine.cfg.vocab_size),
        fragment=fragment,
        num_drafts=num_drafts,
        sampling=sampling,
    )
    label = f"{ORACLE}, sequence {seq}'s committed token changed (step {at})"
    return clean, compare(label, view, changed, contract), at
