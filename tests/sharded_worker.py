"""The sharded-engine scenarios of `tests/test_sharding.py`, run in a process of its own with 8 forced
host devices (the device count is fixed when jax starts). Prints one JSON object:

- `logits`: per mesh "tp x ep", per call of the scenario (two prefills, a batched decode, a ragged
  verify K = 4/2, a decode after the verdict), max |logit - tp 1 x ep 1 logit| and whether the
  argmaxes agree, on the tiny model widened to 4 attention KV heads and 4 GDN key heads;
- `speculative`: per mesh, whether greedy speculative generation emitted plain greedy's tokens
  (the tiny model, MTP drafts, composed and fused steps) and the pool copies of every program;
- `nan_isolation`: per mesh, whether test_engine's NaN-elsewhere scenario left every output
  bit-identical (the poisoned pool placed back with the engine's shardings);
- `planned`: per mesh, the pool buffers and weight leaves whose bytes on each device differ from
  the planner's (`memory.plan.pool_terms`, `sharding.param_divisors`), and how many were compared.

Usage: python tests/sharded_worker.py (from the repository root).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(__file__))

import conftest  # noqa: E402  (thread environment, CPU platform, settings builder)
import jax  # noqa: E402
import numpy as np  # noqa: E402
import test_engine  # noqa: E402

from metrale_jax.engine.engine import Engine  # noqa: E402
from metrale_jax.engine.pool import pool_buffers  # noqa: E402
from metrale_jax.engine.sharding import make_mesh, param_divisors, pool_shardings  # noqa: E402
from metrale_jax.engine.speculative import DraftSchedule, greedy_generate, speculative_generate  # noqa: E402
from metrale_jax.memory.plan import pool_terms  # noqa: E402
from metrale_jax.params import init_params  # noqa: E402
from metrale_jax.presets import resolve_checkpoint  # noqa: E402

MESHES = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)]


def _scenario(eng: Engine) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    a, b = eng.alloc_sequence(), eng.alloc_sequence()
    out = [
        eng.prefill(a, [int(x) for x in rng.integers(0, 256, 21)]),
        eng.prefill(b, [int(x) for x in rng.integers(0, 256, 9)]),
    ]
    out.append(eng.decode_batch([a, b], [int(out[0].argmax()), int(out[1].argmax())]))
    last = [int(x) for x in out[2].reshape(2, -1).argmax(-1)]
    logits, _ = eng.verify_batched([a, b], [last[0], 3, 4, 5, last[1], 7], [4, 2])
    out.append(logits)
    eng.accept([a, b], [2, 0])
    out.append(eng.decode_batch([a, b], [8, 9]))
    eng.free_sequence(b)
    eng.free_sequence(a)
    return [np.asarray(x, np.float32) for x in out]


def logits_agreement() -> dict:
    cfg, _ = resolve_checkpoint("tiny")
    wide = dataclasses.replace(cfg, num_key_value_heads=4, linear_num_key_heads=4, linear_num_value_heads=8)
    params = init_params(wide, seed=1)
    st = conftest.settings(max_batch_size=4, max_seq_len=128, speculative=True, num_drafts=3)
    runs = {f"{tp}x{ep}": _scenario(Engine(wide, params, st, mesh=make_mesh(wide, tp, ep))) for tp, ep in MESHES}
    ref = runs["1x1"]
    return {
        name: [
            {"max_abs": float(np.abs(x - r).max()), "argmax_equal": bool((x.argmax(-1) == r.argmax(-1)).all())}
            for x, r in zip(outs, ref)
        ]
        for name, outs in runs.items()
    }


def speculative_and_isolation() -> tuple[dict, dict]:
    cfg, params = resolve_checkpoint("tiny")
    st = conftest.settings(max_batch_size=12, max_seq_len=256, speculative=True, num_drafts=3)
    _, greedy_ref = test_engine.prefill_and_decode(params, cfg, test_engine.PROMPT, 12)
    plain = test_engine._poison_except
    spec, nan = {}, {}
    for tp, ep in [(2, 1), (2, 2)]:
        eng = Engine(cfg, params, st, mesh=make_mesh(cfg, tp, ep))
        rng = np.random.default_rng(3)
        prompts = [[int(x) for x in rng.integers(0, 256, size=n)] for n in (9, 17, 30)]
        ref = greedy_generate(eng, prompts, 24)
        same = [speculative_generate(eng, prompts, 24, DraftSchedule(3), fused=f).tokens == ref for f in (False, True)]
        # NOTE: the poisoned pool is built on the host; it goes back with the engine's shardings.
        test_engine._poison_except = lambda pool, e, seqs: jax.device_put(
            plain(pool, e, seqs), pool_shardings(pool, e.mesh)
        )
        isolated = []
        for fused in (False, True):
            clean = test_engine._run_isolated(eng, greedy_ref, poison=False, fused=fused)
            dirty = test_engine._run_isolated(eng, greedy_ref, poison=True, fused=fused)
            isolated.append(all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(clean, dirty)))
        test_engine._poison_except = plain
        copies = sum(i.pool_copies for i in eng.programs.info.values())
        spec[f"{tp}x{ep}"] = {"composed": same[0], "fused": same[1], "pool_copies": copies}
        nan[f"{tp}x{ep}"] = {"composed": isolated[0], "fused": isolated[1]}
    return spec, nan


def planned_vs_allocated() -> dict:
    cfg, params = resolve_checkpoint("tiny")
    out = {}
    for tp, ep in [(2, 1), (2, 2)]:
        st = conftest.settings(
            max_batch_size=4,
            max_seq_len=128,
            speculative=True,
            num_drafts=3,
            tensor_parallel_size=tp,
            expert_parallel_size=ep,
        )
        eng = Engine(cfg, params, st)
        bad, compared = [], 0
        terms = pool_terms(cfg, eng.counts, st, eng.dtype)
        for (name, *_), leaf, term in zip(pool_buffers(eng.pool), jax.tree_util.tree_leaves(eng.pool), terms):
            per_device = {s.data.nbytes for s in leaf.addressable_shards}
            compared += 1
            if per_device != {term.bytes} or len(leaf.addressable_shards) != tp * ep:
                bad.append([name, sorted(per_device), term.bytes])
        divisors = param_divisors(cfg, tp, ep)
        for path, leaf in jax.tree_util.tree_flatten_with_path(eng.params)[0]:
            key = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)
            compared += 1
            if {s.data.nbytes for s in leaf.addressable_shards} != {leaf.nbytes // divisors[key]}:
                bad.append([str(key), leaf.nbytes, divisors[key]])
        out[f"{tp}x{ep}"] = {"mismatches": bad, "compared": compared}
    return out


if __name__ == "__main__":
    assert len(jax.devices()) == 8, jax.devices()
    spec, nan = speculative_and_isolation()
    print(
        json.dumps(
            {"logits": logits_agreement(), "speculative": spec, "nan_isolation": nan, "planned": planned_vs_allocated()}
        )
    )
