"""The prefill family: `--prefill L,.. [--prefill-chunk C,..]`, single pass against chunked.

Owns: `run_prefill` (one fresh sequence prefilled along one path: its last-position logits and
its state as per-layer parts) and the driver `diff_prefill`.

Paths: `single` (the serve's prefill chunk, one pass for any L up to it) and `chunk C` (the
prompt fed C tokens at a time). The reference is `xla` single; every other (forward, path)
pair is compared with it: last-position logits, then every layer's state (GDN h and conv
window, attention K and V at live positions, the MTP head's stash and KV); `state_diff` names
the first layer whose state bytes differ.

Invariants:
- A path that splits the prompt like the reference's does is bit-identical to it under a
  bit-identical forward; one that splits it otherwise runs other program shapes and another
  GDN chunking, so it is declared bounded (`CHUNK_RTOL`).
- The control prefills the longest prompt with its middle token changed (reference forward,
  single pass); its logits must differ.
- The cached leg (prompts of `CACHED_MIN_TOKENS` or more, prefix caching on): per forward and
  path, prime the prompt in a private namespace, then prefill it plus a `CACHED_TAIL`-token tail
  in the same namespace. It must restore (FAIL otherwise), and its logits and state must equal,
  byte for byte, the same forward's uncached prefill of the same tokens split at the restore
  position (a private namespace of its own: nothing to restore). Each entry names the path taken.
  Then, reference forward, the same prompt under a cache too small for it (`pressure.pressure_leg`:
  eviction every step, a held sequence's bytes unchanged, namespace isolation asserted).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from metrale_jax.diff.compare import BIT_IDENTICAL, Part, Recording, bounded, combine, compare, diff_parts
from metrale_jax.diff.pressure import pressure_leg
from metrale_jax.diff.progress import Progress
from metrale_jax.diff.prompts import prompt_of_len
from metrale_jax.diff.report import failure_line
from metrale_jax.diff.request import CACHED_MIN_TOKENS, CACHED_TAIL
from metrale_jax.diff.slot_layout import SequenceBatch, private_namespace
from metrale_jax.diff.state import digests, state_parts
from metrale_jax.diff.variants import REFERENCE, Variant, selected
from metrale_jax.engine.engine import Engine

#: The declared bound of a chunked prefill against a single pass (f32 model).
CHUNK_RTOL = 1e-3


def run_prefill(engine: Engine, prompt: Sequence[int], chunk: int | None) -> tuple[Recording, float]:
    """Prefill `prompt` into a fresh sequence `chunk` tokens at a time (None: the serve's
    chunk). Returns (run with the logits and state parts as its prefill, prefill ms)."""
    with SequenceBatch(engine, 1) as batch:
        t0 = time.perf_counter()
        logits = engine.prefill(batch.seqs[0], prompt, chunk)
        ms = (time.perf_counter() - t0) * 1e3
        record = engine.save_sequence_state(batch.seqs[0])
    return Recording(prefill=[Part("logits", logits[None], "logits")] + state_parts(engine.cfg, record)), ms


def _prefilled_run(
    engine: Engine, parts: Sequence[Sequence[int]], chunk: int | None, namespace: str
) -> tuple[Recording, int]:
    """A fresh sequence of `namespace` prefilled with each of `parts` in turn: (its run, the last
    prefill's logits and the state parts; the position its first prefill restored from, 0: none)."""
    with SequenceBatch(engine, 1, namespace=namespace) as batch:
        seq = batch.seqs[0]
        logits = engine.prefill(seq, parts[0], chunk)
        at = seq.restored_at
        for p in parts[1:]:
            logits = engine.prefill(seq, p, chunk)
        record = engine.save_sequence_state(seq)
    return Recording(prefill=[Part("logits", logits[None], "logits")] + state_parts(engine.cfg, record)), at


def cached_leg(engine: Engine, v: Variant, name: str, chunk: int | None, prompt: list[int], tail: list[int]):
    """One (forward, path) of the cached leg (module docstring). Returns (entry, reason or None)."""
    ns, full = private_namespace(), prompt + tail
    with selected(engine, v.forward):
        _prefilled_run(engine, [prompt], chunk, ns)  # prime
        restored, at = _prefilled_run(engine, [full], chunk, ns)
        computed, _ = _prefilled_run(engine, [full[:at], full[at:]] if at else [full], chunk, private_namespace())
    taken = f"restored at {at}" if at else "computed"
    c = compare(f"{v.label}, {name}, L={len(full)}, {taken}", computed, restored, BIT_IDENTICAL)
    entry = {
        "tokens": len(full),
        "path": name,
        "forward": v.forward,
        "taken": taken,
        "restored": at > 0,
        "restored_at": at,
        "comparisons": [{**c.to_json(), "state_diff": _first_state_diff(computed, restored)}],
    }
    where = f"prefill cached L={len(full)}"
    if not at:
        return entry, f"{where}, {v.label}, {name}: did not restore the primed prompt (computed)"
    return entry, None if c.ok else failure_line(where, c)


def _splits(length: int, chunk: int | None, cap: int) -> tuple[int, ...]:
    """The chunk lengths a prefill of `length` tokens runs (the engine caps chunks at `cap`)."""
    c = min(chunk or cap, cap)
    return tuple(min(c, length - o) for o in range(0, length, c))


def _first_state_diff(reference: Recording, run: Recording) -> str | None:
    """The first state part (model layer order) whose bytes differ, or None."""
    states = [p for p in reference.prefill if p.name != "logits"]
    diffs = diff_parts(states, [p for p in run.prefill if p.name != "logits"], BIT_IDENTICAL)
    return next((p.name for p, d in zip(states, diffs) if d.differing_bytes), None)


def _outputs(run: Recording) -> Recording:
    """`run` without its input tokens, so a control is judged on what the model computed."""
    return Recording(prefill=[p for p in run.prefill if p.name != "tokens"])


def diff_prefill(
    engine: Engine, variants: Sequence[Variant], *, lengths: Sequence[int], chunks: Sequence[int], progress: Progress
):
    """`--prefill`. Returns (report fields, reasons)."""
    vocab, cap = engine.cfg.vocab_size, engine.counts.prefill_chunk
    forwards = [Variant(REFERENCE, REFERENCE)] + list(variants)
    paths = [("single", None)] + [(f"chunk {c}", c) for c in chunks]
    chunked = bounded(CHUNK_RTOL, "another chunking: other program shapes and GDN chunk boundaries")
    sections, reasons, refs, cached, pressured = [], [], {}, [], []
    for length in lengths:
        prompt = prompt_of_len(length, vocab)
        progress.section(f"prefill L={length}", len(forwards) * len(paths))
        ref, ref_ms = run_prefill(engine, prompt, None)
        refs[length] = ref
        progress.advance()
        comparisons, timings = [], [{"variant": f"{REFERENCE}, single", "prefill_ms": ref_ms}]
        for v in forwards:
            for name, chunk in paths:
                if v is forwards[0] and chunk is None:
                    continue  # the reference itself
                same_split = _splits(length, chunk, cap) == _splits(length, None, cap)
                contract = combine(v.contract, BIT_IDENTICAL if same_split else chunked)
                with selected(engine, v.forward, v.mesh):
                    run, ms = run_prefill(engine, prompt, chunk)
                progress.advance()
                label = f"{v.label}, {name}"
                c = compare(label, ref, run, contract)
                comparisons.append(
                    {"path": name, "forward": v.forward, **c.to_json(), "state_diff": _first_state_diff(ref, run)}
                )
                timings.append({"variant": label, "prefill_ms": ms})
                if not c.ok:
                    reasons.append(failure_line(f"prefill L={length}", c))
        sections.append(
            {
                "tokens": length,
                "reference_state_digest": digests(ref.prefill[1:]),
                "comparisons": comparisons,
                "timings": timings,
            }
        )
        if length >= CACHED_MIN_TOKENS and engine.blocks.prefix is not None:
            progress.section(f"prefill cached L={length}+{CACHED_TAIL}", len(forwards) * len(paths))
            tail = prompt_of_len(CACHED_TAIL + 1, vocab)[1:]
            for v in forwards:
                for name, chunk in paths:
                    entry, reason = cached_leg(engine, v, name, chunk, prompt, tail)
                    cached.append(entry)
                    reasons += [reason] if reason else []
                    progress.advance()
            entry, why = pressure_leg(engine, prompt, tail)
            pressured.append(entry)
            reasons += why
    longest = max(lengths)
    prompt = prompt_of_len(longest, vocab)
    prompt[longest // 2] = (prompt[longest // 2] + 1) % vocab
    changed, _ = run_prefill(engine, prompt, None)
    control = compare(
        f"{REFERENCE}, single, token {longest // 2} of {longest} changed",
        _outputs(refs[longest]),
        _outputs(changed),
        BIT_IDENTICAL,
    )
    if control.prefill_equal:
        reasons.append("the prefill detection control saw no difference after changing a token")
    fields = {"lengths": sections, "cached": cached, "detection_control": control.to_json(), "pressure": pressured}
    if engine.blocks.prefix is None and longest >= CACHED_MIN_TOKENS:
        fields["cached_skipped"] = "the engine serves without --enable-prefix-caching"
    return fields, reasons
