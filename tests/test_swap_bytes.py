"""Swap compared by bytes: a sequence spilled and restored (into another slot and other blocks) owns,
leaf by leaf, the same bytes as a twin that never swapped: GDN h and conv, the KV of every live
position, the stash and the drafter's KV up to its length, its last partial block included.

Both are compared at the spill (the record against the twin's record at that length) and after
more decode steps (the restored sequence's state against the twin's), so a restore that drops or
misplaces any leaf, or a record missing part of one, fails here by name.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import settings
from diff_mutants import planted_coverage

from metrale_jax.diff.decode import Spill, run_decode
from metrale_jax.diff.prompts import prompt_of_len
from metrale_jax.diff.state import state_parts
from metrale_jax.engine.engine import Engine


@pytest.fixture(scope="module")
def engine(tiny):
    cfg, params = tiny
    return Engine(cfg, params, settings(max_batch_size=4, max_seq_len=96, speculative=True, num_drafts=3))


def _differing(a, b) -> list[str]:
    assert [p.name for p in a] == [p.name for p in b]
    return [p.name for p, q in zip(a, b) if p.data.shape != q.data.shape or p.data.tobytes() != q.data.tobytes()]


def _swapped_and_twin(engine):
    prompt, steps, at = prompt_of_len(21, engine.cfg.vocab_size), 6, 3
    swapped = run_decode(engine, [prompt], steps, spill=Spill(at), final=True)
    twin = run_decode(engine, [prompt], steps, tokens=swapped.tokens, final=True)
    return swapped, twin


def test_a_record_missing_the_partial_drafter_block_fails_by_name(engine):
    with planted_coverage(engine, "swap-drops-partial-drafter-block"):
        swapped, twin = _swapped_and_twin(engine)
    cfg = engine.cfg
    differing = _differing(state_parts(cfg, twin.final[0]), state_parts(cfg, swapped.final[0]))
    assert differing and differing[0].startswith("mtp layer 0 kv"), differing


def test_a_restored_sequence_owns_the_never_swapped_twins_bytes(engine):
    cfg = engine.cfg
    prompt, steps, at = prompt_of_len(21, cfg.vocab_size), 6, 3
    swapped = run_decode(engine, [prompt], steps, spill=Spill(at), final=True)
    assert swapped.moves[0]["slot"][0] != swapped.moves[0]["slot"][1]
    record = swapped.records[0]
    assert record.device.stash is not None and record.drafter_len % engine.counts.draft_block_size, (
        "the drafter's last block is partial"
    )
    twin_at = run_decode(engine, [prompt], at, tokens=swapped.tokens, final=True)
    twin = run_decode(engine, [prompt], steps, tokens=swapped.tokens, final=True)
    names = [p.name for p in state_parts(cfg, record)]
    assert any("gdn conv" in n for n in names) and any("mtp layer" in n for n in names) and "mtp stash" in names
    assert _differing(state_parts(cfg, twin_at.final[0]), state_parts(cfg, record)) == []
    assert _differing(state_parts(cfg, twin.final[0]), state_parts(cfg, swapped.final[0])) == []
    for a, b in zip(twin.run.steps, swapped.run.steps):
        assert np.array_equal(a[0].data, b[0].data)
