"""The diff's memory accounting: the report's `memory` field and the lock-step runs' settled parts.

`settle_pools` must change what a run holds, never what a comparison finds; `footprint` counts the
engine's one copy of the weights and its pool."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import settings

from metrale_jax.diff.compare import BIT_IDENTICAL, Part, Recording, bounded, compare
from metrale_jax.diff.footprint import footprint, peak_rss_bytes
from metrale_jax.diff.state import settle_pools
from metrale_jax.engine.engine import Engine
from metrale_jax_cli import diff_cmd


def _parts(seed: int, changed: bool) -> list[Part]:
    rng = np.random.default_rng(seed)
    pool = rng.standard_normal((64, 32)).astype(np.float32)
    logits = rng.standard_normal((3, 50)).astype(np.float32)
    if changed:
        pool = pool.copy()
        pool[5, 7] += 1.0
    return [
        Part("verify logits", logits, "logits"),
        Part("drafts", np.arange(4, dtype=np.int32), "tokens"),
        Part("pool kv", pool, "values"),
    ]


def test_settled_parts_compare_as_the_whole_recording_does():
    """A lock-step run that settles its pools as it records them (`settle_pools`) gets the same
    comparison as one that kept both sides' arrays, equal and differing steps alike."""
    a_steps = [_parts(s, False) for s in range(4)]
    b_steps = [_parts(s, s >= 2) for s in range(4)]  # the pool differs from step 2 on
    whole = compare("v", Recording([], a_steps), Recording([], b_steps), BIT_IDENTICAL)
    ref, run = Recording([], [a[:2] for a in a_steps]), Recording([], [b[:2] for b in b_steps])
    run.settled = {
        s: settle_pools({"kv": a[2].data}, {"kv": b[2].data}, BIT_IDENTICAL)
        for s, (a, b) in enumerate(zip(a_steps, b_steps))
    }
    assert compare("v", ref, run, BIT_IDENTICAL) == whole
    assert whole.first_mismatch == 2 and whole.first_diff["part"] == "pool kv" and not whole.ok
    with pytest.raises(ValueError, match="settled under"):
        compare("v", ref, run, bounded(1e-3, "another contract"))


def test_footprint_counts_the_engines_weights_and_pool_once(tiny):
    cfg, params = tiny
    engine = Engine(cfg, params, settings(max_batch_size=2, max_seq_len=64))
    mem = footprint(engine)
    assert mem["weights_bytes"] == sum(x.nbytes for x in jax.tree_util.tree_leaves(engine.params))
    assert mem["pool_bytes"] == sum(x.nbytes for x in jax.tree_util.tree_leaves(engine.pool)) > 0
    assert mem["peak_rss_bytes"] >= mem["weights_bytes"] + mem["pool_bytes"]
    assert peak_rss_bytes() >= mem["peak_rss_bytes"]  # a high-water mark never falls


def test_the_report_states_the_memory_it_held(tmp_path):
    out = tmp_path / "report.json"
    args = ["--checkpoint", "tiny", "--steps", "2", "--prefill", "20", "--forwards", "xla-repeat", "--out", str(out)]
    result = CliRunner().invoke(diff_cmd.diff, args)
    assert result.exit_code == 0, result.output
    mem = json.loads(out.read_text())["memory"]
    assert set(mem) == {"weights_bytes", "pool_bytes", "peak_rss_bytes"}
    assert 0 < mem["weights_bytes"] + mem["pool_bytes"] < mem["peak_rss_bytes"]
