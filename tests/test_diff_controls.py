"""The diff's detection controls cannot be blind: each perturbs something the compared output reads.

The swap control's record change (`diff.state.perturbed`) is checked over every `--steps` from the
mode's minimum (4) to 12 and over several prompt streams: restoring the changed record must change
the first logits after the spill; `run_diff --swap` must PASS with its controls firing at each
`--steps`. The token- and draft-changing controls of the other modes change a model input, so they
reach the logits by construction (`test_diff.py` runs each mode with its control).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import settings

from metrale_jax.diff import DiffRequest, DiffRequestError, Variant, run_diff
from metrale_jax.diff.decode import Spill, run_decode
from metrale_jax.diff.prompts import prompt_of_len, prompts
from metrale_jax.diff.state import perturbed, state_parts
from metrale_jax.engine.engine import Engine

STEPS = range(4, 13)


@pytest.fixture(scope="module")
def engine(tiny):
    cfg, params = tiny
    return Engine(cfg, params, settings(max_batch_size=2, max_seq_len=96))


def test_the_record_change_is_finite_and_touches_every_head_column_and_attention_layer(engine):
    cfg = engine.cfg
    ref = run_decode(engine, [prompts(1, cfg.vocab_size)[0]], 4, spill=Spill(2))
    record = ref.records[0]
    changed, where = perturbed(record)
    dev, new = record.device, changed.device
    assert "GDN" in where and "attention" in where
    h_heads = (dev.gdn_h != new.gdn_h).reshape(*dev.gdn_h.shape[:2], -1).sum(-1)
    assert (h_heads == 1).all(), "one element in every head of every GDN layer"
    assert ((dev.gdn_conv != new.gdn_conv).sum(1) == 1).all(), "one element in every conv column"
    assert ((dev.kv_k[:, 0, 0] != new.kv_k[:, 0, 0]).reshape(dev.kv_k.shape[0], -1).sum(-1) == 1).all()
    assert all(np.isfinite(p.data.astype(np.float64)).all() for p in state_parts(cfg, changed) if p.kind == "values")
    assert (record.device.gdn_h == ref.records[0].device.gdn_h).all(), "the original record is untouched"


@pytest.mark.parametrize("prompt_len", [23, 37, 61])
def test_the_swap_control_reaches_the_first_step_after_the_spill_at_every_steps(engine, prompt_len):
    prompt = prompt_of_len(prompt_len, engine.cfg.vocab_size)
    for steps in STEPS:
        at = steps // 2
        ref = run_decode(engine, [prompt], at + 1, spill=Spill(at))
        changed, _ = perturbed(ref.records[0])
        run = run_decode(engine, [prompt], at + 1, tokens=ref.tokens, spill=Spill(at, lambda own, c=changed: [c]))
        before, after = (
            [bool((a[0].data != b[0].data).any()) for a, b in zip(ref.run.steps[s], run.run.steps[s])]
            for s in (slice(0, at), slice(at, at + 1))
        )
        assert not any(before) and all(after), (steps, prompt_len)


@pytest.mark.parametrize("steps", STEPS)
def test_swap_passes_with_every_control_firing(engine, steps):
    report = run_diff(engine, DiffRequest(steps=steps, swap=True), [Variant("xla-repeat", "xla")])
    assert report["verdict"] == "PASS", report["reasons"]
    assert report["controls"] and all(c["saw_difference_after"] for c in report["controls"])


def test_generate_requests_are_checked():
    with pytest.raises(DiffRequestError, match="--confidence-stop applies to --generate"):
        DiffRequest(steps=4, confidence_stop=-1.0).check()
    with pytest.raises(DiffRequestError, match="separate diffs"):
        DiffRequest(steps=4, generate=True, swap=True).check()
    DiffRequest(steps=4, generate=True, confidence_stop=-1.0).check()


def test_generate_needs_the_mtp_scheduler(engine):
    with pytest.raises(DiffRequestError, match="--generate runs the MTP scheduler"):
        DiffRequest(steps=4, generate=True).check_engine(engine)
