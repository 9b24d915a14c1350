"""The `--prefill` cached leg under pressure: a prefix cache too small for its prompts.

Owns: `pressure_leg` (one run, reference forward) and its report entry.

The run starts from an empty LRU (every unreferenced cached block evicted), so its evictions
reach its own blocks. A primer prefills the prompt in a private namespace and is freed (its full blocks wait
unreferenced in the LRU); the held sequence prefills the prompt plus a tail, restoring it (so it
references those blocks again), and stays live across every step. The trunk KV free list is then
squeezed to exactly what one more prompt needs (the rest held aside for the run), so from the
second step on every fresh prefill must evict the previous step's cached blocks. Each step
prefills another prompt of the same length in the same namespace and frees it. Then a sequence
of another namespace prefills the held sequence's tokens, before the steps (while the prompt's
snapshot is still cached) and after them (the squeeze released).

Invariants (each a FAIL reason when broken):
- every step after the first evicts (the pressure is real);
- the held sequence restores, and its state (every leaf it owns) is byte-equal before and after
  the steps: an eviction that freed a block it references would let a later prefill overwrite it;
- namespace isolation, asserted directly: the other namespace's prefill of A's very prompt
  restores nothing and maps none of the held sequence's blocks;
- the squeezed blocks go back to the free list when the leg ends, also when it raises.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

from metrale_jax.diff.compare import BIT_IDENTICAL, diff_parts
from metrale_jax.diff.prompts import prompt_of_len
from metrale_jax.diff.slot_layout import private_namespace
from metrale_jax.diff.state import state_parts
from metrale_jax.engine.engine import Engine
from metrale_jax.engine.sequences import EngineError

#: Prompts the squeezed cache sees after A's.
PRESSURE_STEPS = 3


@contextlib.contextmanager
def squeezed(engine: Engine, keep: int) -> Iterator[int]:
    """Hold all but `keep` free trunk KV blocks aside for the block (given back on exit); yields
    how many were held. NOTE: held blocks are taken from the allocator, never mapped or written."""
    held = engine.blocks.kv.alloc_many(max(0, engine.blocks.kv.free_count - keep))
    try:
        yield len(held)
    finally:
        engine.blocks.kv.free_many(held)


@contextlib.contextmanager
def _sequence(engine: Engine, namespace: str):
    """One sequence of `namespace`, freed on exit. NOTE: not a `SequenceBatch`: the held sequence
    is live beside it, so it does not sit on the batch layout's slot."""
    seq = engine.alloc_sequence(namespace)
    try:
        yield seq
    finally:
        engine.free_sequence(seq)


def _other_namespace(engine: Engine, prompt: Sequence[int], held, where: str, reasons: list[str]) -> dict:
    """Prefill `prompt` (the held sequence's own tokens) in a fresh namespace: it must restore
    nothing and map none of `held`'s blocks (appends to `reasons` otherwise). Returns
    {restored_at, shared_blocks}."""
    with _sequence(engine, private_namespace()) as foreign:
        engine.prefill(foreign, prompt)
        leaked = sorted(set(foreign.blocks) & set(held.blocks))
        if foreign.restored_at:
            reasons.append(f"{where}: namespace {foreign.namespace} restored {held.namespace}'s prompt")
        if leaked:
            reasons.append(f"{where}: a sequence of another namespace maps {len(leaked)} of the held blocks")
        return {"restored_at": foreign.restored_at, "shared_blocks": len(leaked)}


def _flush(engine: Engine) -> int:
    """Evict every unreferenced cached block of both pools, so the leg's evictions reach its own
    blocks (not older runs'). Returns the trunk blocks evicted."""
    blocks, cache = engine.blocks, engine.blocks.prefix
    assert cache is not None
    n = cache.kv.evictable
    blocks.make_room(blocks.kv.free_count + n, blocks.draft.free_count + cache.draft.evictable)
    return n


def pressure_leg(engine: Engine, prompt: Sequence[int], tail: Sequence[int]) -> tuple[dict, list[str]]:
    """The pressure run over `prompt` (module docstring). Returns (entry, reasons); an engine
    refusal inside the run (a bookkeeping bug can exhaust the blocks) is a reason, not a crash."""
    try:
        return _pressure_run(engine, prompt, tail)
    except EngineError as e:
        return {"tokens": len(prompt), "error": str(e)}, [f"prefill cached L={len(prompt)} under pressure: {e}"]


def _pressure_run(engine: Engine, prompt: Sequence[int], tail: Sequence[int]) -> tuple[dict, list[str]]:
    cache = engine.blocks.prefix
    assert cache is not None, "the pressure leg needs prefix caching"
    vocab, n, ns = engine.cfg.vocab_size, len(prompt), private_namespace()
    need = math.ceil((n + 1) / engine.counts.block_size)
    reasons, evictions = [], []
    where = f"prefill cached L={n} under pressure"
    flushed = _flush(engine)
    with _sequence(engine, ns) as primer:
        engine.prefill(primer, prompt)
    with _sequence(engine, ns) as held:
        engine.prefill(held, list(prompt) + list(tail))
        if not held.restored_at:
            reasons.append(f"{where}: the held sequence did not restore the primed prompt")
        before = state_parts(engine.cfg, engine.save_sequence_state(held))
        isolated = [_other_namespace(engine, list(held.tokens), held, where, reasons)]
        with squeezed(engine, need) as aside:
            for step in range(PRESSURE_STEPS):
                e0 = cache.kv.evictions
                with _sequence(engine, ns) as seq:
                    engine.prefill(seq, prompt_of_len(n + 1 + step, vocab)[:n])
                evictions.append(cache.kv.evictions - e0)
                if step and not evictions[-1]:
                    reasons.append(f"{where}: step {step} evicted nothing (the cache was not under pressure)")
        isolated.append(_other_namespace(engine, list(held.tokens), held, where, reasons))
        after = state_parts(engine.cfg, engine.save_sequence_state(held))
        restored_at = held.restored_at
    changed = [p.name for p, d in zip(before, diff_parts(before, after, BIT_IDENTICAL)) if d.differing_bytes]
    if changed:
        reasons.append(f"{where}: the held sequence's state changed under eviction, first in {changed[0]}")
    entry = {
        "tokens": n,
        "held_restored_at": restored_at,
        "blocks_flushed": flushed,
        "blocks_held_aside": aside,
        "evictions_per_step": evictions,
        "held_state_equal": not changed,
        "other_namespace": isolated,
    }
    return entry, reasons
