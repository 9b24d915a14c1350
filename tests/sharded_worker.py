"""The sharded-engine scenarios of `tests/test_sharding.py`, run in a process of its own with 8 forced
host devices (the device count is fixed when jax starts). Prints one JSON object:

- `logits`: `metrale_jax.sharded_check.logits_agreement` (per mesh "tp x ep" of 1, 2, 4 x 1, 2,
  per call of its scenario, max |logit - tp 1 x ep 1 logit| and whether the argmaxes agree);
- `speculative`: per mesh, `metrale_jax.sharded_check.speculative_agreement` on the tiny model;
- `nan_isolation`: per mesh, whether test_engine's NaN-elsewhere scenario left every output
  bit-identical (the poisoned pool placed back with the engine's shardings);
- `planned`: per mesh, the pool buffers and weight leaves whose bytes on each device differ from
  the planner's (`memory.plan.pool_terms`, `sharding.param_divisors`), and how many were compared.

Usage: python tests/sharded_worker.py (from the repository root).
"""

from __future__ import annotations

import json
import os

# NOTE: LLVM level 0 cuts the CPU compiles (most of this process's time) by ~a quarter; every claim
# here compares programs compiled alike in this process (meshes, NaN-poisoned runs, speculative vs greedy).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
)

import conftest  # noqa: E402, F401  (thread environment, CPU platform)
import jax  # noqa: E402
import numpy as np  # noqa: E402
import test_engine  # noqa: E402

from metrale_jax import sharded_check  # noqa: E402
from metrale_jax.engine.engine import Engine  # noqa: E402
from metrale_jax.engine.pool import pool_buffers  # noqa: E402
from metrale_jax.engine.sharding import make_mesh, param_divisors, pool_shardings  # noqa: E402
from metrale_jax.memory.plan import pool_terms  # noqa: E402
from metrale_jax.presets import resolve_checkpoint  # noqa: E402


def speculative_and_isolation() -> tuple[dict, dict]:
    cfg, params = resolve_checkpoint("tiny")
    st = sharded_check.settings(speculative=True, num_drafts=3)
    _, greedy_ref = test_engine.prefill_and_decode(params, cfg, test_engine.PROMPT, 12)
    plain = test_engine._poison_except
    spec, nan = {}, {}
    for tp, ep in [(2, 1), (2, 2)]:
        eng = Engine(cfg, params, st, mesh=make_mesh(cfg, tp, ep))
        spec[f"{tp}x{ep}"] = sharded_check.speculative_agreement(eng)
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
            {
                "logits": sharded_check.logits_agreement(8),
                "speculative": spec,
                "nan_isolation": nan,
                "planned": planned_vs_allocated(),
            }
        )
    )
