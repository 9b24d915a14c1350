"""The `pallas` forward (Pallas kernels under the CPU interpreter) against the `xla` forward (their
jnp reference twins), end to end on the embedded tiny model.

Scenario (`_scenario`, the same calls on every engine): prefill, one prompt in 64-token chunks
whose keys cross a 64-key attention tile; decode; batched decode; propose; ragged batched verify
with write-on-accept, then its verdict (`accept`: fold, rewind, commit and stash); propose again; a
batched decode.

Claims:
- The two forwards return byte-identical logits, argmaxes, drafts and confidences and hold a
  byte-identical device pool (every leaf of `engine.pool`) after every call of this scenario
  (not yet of every program: see `test_wide_verify_prefill_byte_equal_verify_within_ulps`). The state IO fences every
  kernel-backed op with optimization barriers (see
  `metrale_jax.model.state_io`): unfenced, XLA CPU fused GDN's sigmoid gate differently into the
  reference GDN and into the Pallas call (layer 0's beta then differed in the last bit: LLVM
  contracts exp's last multiply and the `+ 1` into an FMA inside one fusion and not the other).
- Each forward's disclosure names a different plan, and the kernels refused nothing at these
  shapes (every op ran as a kernel).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import settings

from kernels_pallas.ops import PallasOps
from metrale_jax.engine.engine import Engine

FORWARDS = ("xla", "pallas")
_rng = np.random.default_rng(11)
PROMPTS = [[int(x) for x in _rng.integers(0, 256, size=n)] for n in (70, 21, 9)]  # A crosses 64
KS = [4, 2, 3]  # ragged verify: rows [last, d_1 .. d_{K-1}] per sequence
ACCEPTED = [3, 0, 1]  # the verdict folded in: all, none, and part of the drafts
STEPS = ["prefill", "decode", "decode_batch", "propose", "verify", "fold_commit", "propose_again", "decode_after"]


def _bytes(x) -> np.ndarray:
    x = np.asarray(x)
    return x if x.dtype.kind in "biu" else x.view(np.dtype(f"u{x.dtype.itemsize}"))


def _pool(eng: Engine) -> dict:
    """Every leaf of the device pool, by its tree path, as numpy."""
    leaves = jax.tree_util.tree_leaves_with_path(eng.pool)
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def _scenario(eng: Engine) -> dict:
    """Run the same calls on `eng`; {step: (outputs {name: array}, pool after the step)}."""
    out = {}
    a, b, c = seqs = [eng.alloc_sequence() for _ in PROMPTS]
    logits = [eng.prefill(a, PROMPTS[0], chunk=64), eng.prefill(b, PROMPTS[1]), eng.prefill(c, PROMPTS[2])]
    last = [int(x.argmax()) for x in logits]
    out["prefill"] = ({f"logits{i}": x for i, x in enumerate(logits)}, _pool(eng))

    x = eng.decode(a, last[0])
    last[0] = int(x.argmax())
    out["decode"] = ({"logits": x}, _pool(eng))

    x = eng.decode_batch(seqs, last)
    last = [int(r.argmax()) for r in x]
    out["decode_batch"] = ({"logits": x, "argmax": x.argmax(-1)}, _pool(eng))

    drafts, conf, x = eng.propose_batched(seqs, last, 3)
    for s in seqs:
        eng.trim_proposer(s)
    out["propose"] = ({"drafts": drafts, "confidences": conf, "logits": x}, _pool(eng))

    rows = [[last[i], *[int(t) for t in drafts[i, : k - 1]]] for i, k in enumerate(KS)]
    x, am = eng.verify_batched(seqs, [t for r in rows for t in r], KS)
    out["verify"] = ({"logits": x, "argmax": am}, _pool(eng))

    eng.accept(seqs, ACCEPTED)  # the GDN fold, the rewind, the conv commit and the stash
    out["fold_commit"] = ({"seq_lens": np.array([s.seq_len for s in seqs])}, _pool(eng))

    off = np.concatenate([[0], np.cumsum(KS)])
    last = [int(am[off[i] + na]) for i, na in enumerate(ACCEPTED)]
    drafts, conf, x = eng.propose_batched(seqs, last, 3)
    for s in seqs:
        eng.trim_proposer(s)
    out["propose_again"] = ({"drafts": drafts, "confidences": conf, "logits": x}, _pool(eng))

    x = eng.decode_batch(seqs, last)
    out["decode_after"] = ({"logits": x, "argmax": x.argmax(-1)}, _pool(eng))
    for s in reversed(seqs):
        eng.free_sequence(s)
    return out


def _engine(tiny, forward: str) -> Engine:
    cfg, params = tiny
    return Engine(
        cfg, params, settings(max_batch_size=4, max_seq_len=256, speculative=True, num_drafts=3), forward=forward
    )


@pytest.fixture(scope="module")
def runs(tiny):
    """{forward: (engine, scenario results)} and the refusals recorded before."""
    refusals_before = set(PallasOps.refusals())
    out = {}
    for f in FORWARDS:
        eng = _engine(tiny, f)
        out[f] = (eng, _scenario(eng))
    return out, refusals_before


@pytest.mark.parametrize("step", STEPS)
def test_forwards_byte_equal(runs, step):
    results, _ = runs
    (out_x, pool_x), (out_p, pool_p) = results["xla"][1][step], results["pallas"][1][step]
    assert out_x.keys() == out_p.keys() and pool_x.keys() == pool_p.keys()
    for name in out_x:
        assert out_x[name].dtype == out_p[name].dtype, name
        np.testing.assert_array_equal(_bytes(out_p[name]), _bytes(out_x[name]), err_msg=f"{step}: {name}")
    for path in pool_x:
        assert pool_x[path].dtype == pool_p[path].dtype and pool_x[path].shape == pool_p[path].shape, path
        np.testing.assert_array_equal(_bytes(pool_p[path]), _bytes(pool_x[path]), err_msg=f"{step}: pool{path}")


def test_scenario_exercises_what_it_claims(runs):
    """The chunked prompt crossed both the 64-token chunk and the 64-key tile, verify folded a
    partial accept, and the pool was written (the equalities above are not vacuous)."""
    results, _ = runs
    eng, res = results["xla"]
    assert len(PROMPTS[0]) > 64 and eng.counts.block_size * 4 == 64
    assert res["fold_commit"][0]["seq_lens"].tolist() == [
        len(p) + (i == 0) + 1 + na + 1 for i, (p, na) in enumerate(zip(PROMPTS, ACCEPTED))
    ]
    assert np.abs(res["decode_after"][1][".trunk.kv_k"]).max() > 0


def test_disclosure_plans_differ_and_nothing_refused(runs):
    results, refusals_before = runs
    plans = {f: results[f][0].disclosure(f) for f in FORWARDS}
    assert plans["xla"]["plan_digest"] and plans["pallas"]["plan_digest"]
    assert plans["xla"]["plan_digest"] != plans["pallas"]["plan_digest"]
    assert plans["xla"]["refusals"] == []
    assert set(plans["pallas"]["refusals"]) - refusals_before == set()


def test_every_program_updates_the_pool_in_place(runs):
    """No compiled program copies a whole pool leaf. Before `state_io.ordered_read` (in
    `PoolIO.gdn`, step_rows' checkpoint and the drafter's stash read), a one-sequence
    decode copied the GDN state, the conv windows and the stash, a verify the state and the
    windows, and every prefill the stash: at a released model's size, gigabytes a step."""
    results, _ = runs
    for f in FORWARDS:
        programs = list(results[f][0].programs.info.values())
        assert {p.name for p in programs} >= {"prefill_chunk", "step_rows", "propose", "gdn_fold", "commit_conv"}
        assert [p for p in programs if p.pool_copies] == [], f


# The known divergence's size: both forwards' verify logits (|logit| <= ~6 here) and pools agree to
# a few float32 ulps; a wrong row, slot or state would be off by orders of magnitude more.
WIDE_VERIFY_ATOL = 1e-5


def test_wide_verify_prefill_byte_equal_verify_within_ulps(tiny):
    """A verify of 8 sequences x 4 rows over 128-token contexts, each prefilled by its own forward.
    The prefills are byte-equal (logits and every pool leaf); the verify agrees to WIDE_VERIFY_ATOL
    with the same argmaxes, but is NOT byte-equal yet: a known divergence, open (BUILD_NOTES.md, "Known
    issues"). The GDN rows kernel (interpreted) and its reference, run alone on this
    scenario's layer-0 inputs, give a few (sequence, head) states 1-2 ulp apart, because XLA CPU
    contracts the state update's multiply-adds into FMAs differently in the two; logits a few ulps
    apart. When it is fixed, this test should
    assert bytes for the verify too."""
    cfg, params = tiny
    rng = np.random.default_rng(4)
    prompts = rng.integers(0, cfg.vocab_size, size=(8, 128)).tolist()
    rows = rng.integers(0, cfg.vocab_size, size=(8, 4)).tolist()
    got = {}
    for f in FORWARDS:
        eng = Engine(
            cfg, params, settings(max_batch_size=8, max_seq_len=160, speculative=True, num_drafts=3), forward=f
        )
        seqs = [eng.alloc_sequence() for _ in prompts]
        prefill = {f"logits{i}": eng.prefill(s, p) for i, (s, p) in enumerate(zip(seqs, prompts))}
        prefill_pool = _pool(eng)
        logits, argmax = eng.verify_batched(seqs, [t for r in rows for t in r], [4] * 8)
        got[f] = (prefill, prefill_pool, logits, argmax, _pool(eng))
    (pre_x, ppool_x, lx, ax, pool_x), (pre_p, ppool_p, lp, ap, pool_p) = got["xla"], got["pallas"]
    for name in pre_x:
        np.testing.assert_array_equal(_bytes(pre_p[name]), _bytes(pre_x[name]), err_msg=f"prefill {name}")
    for path in ppool_x:
        np.testing.assert_array_equal(_bytes(ppool_p[path]), _bytes(ppool_x[path]), err_msg=f"prefill pool{path}")
    np.testing.assert_array_equal(ap, ax)
    np.testing.assert_allclose(lp, lx, rtol=0, atol=WIDE_VERIFY_ATOL)
    for path in pool_x:
        if pool_x[path].dtype.kind == "f":
            finite = np.isfinite(pool_x[path])  # unwritten rows may hold anything, alike on both sides
            np.testing.assert_array_equal(finite, np.isfinite(pool_p[path]), err_msg=f"pool{path}")
            np.testing.assert_allclose(
                pool_p[path][finite], pool_x[path][finite], rtol=0, atol=WIDE_VERIFY_ATOL, err_msg=f"pool{path}"
            )
        else:
            np.testing.assert_array_equal(pool_p[path], pool_x[path], err_msg=f"pool{path}")
