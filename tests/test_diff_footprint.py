"""The diff's memory accounting: the report's `memory` field and the lock-step compaction.

`compact_equal` must change what a run holds, never what a comparison finds; `footprint`
counts the engine's one copy of the weights and its pool."""

from __future__ import annotations

import json

import jax
import numpy as np
from click.testing import CliRunner
from conftest import settings

from metrale_jax.diff.compare import BIT_IDENTICAL, Part, Recording, bounded, compare
from metrale_jax.diff.footprint import compact_equal, footprint, peak_rss_bytes
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


def test_compaction_keeps_every_comparison_and_holds_equal_pairs_once():
    a_steps = [_parts(s, False) for s in range(4)]
    b_steps = [_parts(s, s >= 2) for s in range(4)]  # the pool differs from step 2 on
    packed = [compact_equal(a, b) for a, b in zip(a_steps, b_steps)]
    for contract in (BIT_IDENTICAL, bounded(1e-3, "test")):
        whole = compare("v", Recording([], a_steps), Recording([], b_steps), contract)
        small = compare("v", Recording([], [a for a, _ in packed]), Recording([], [b for _, b in packed]), contract)
        assert small == whole
    assert whole.first_mismatch == 2 and whole.first_diff["part"] == "pool kv"
    for s, (a, b) in enumerate(packed):
        # equal pairs: one 32-byte digest part on both sides; differing pairs: both arrays kept
        assert a[0] is b[0] and a[0].data.nbytes == 32 and a[0].name == "verify logits"
        assert (a[2] is b[2]) == (s < 2)
        assert (b[2].data.nbytes == 32) == (s < 2)


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
