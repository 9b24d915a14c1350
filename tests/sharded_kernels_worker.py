"""Run by tests/test_sharding.py in a process of its own (2 forced host devices): the `pallas`
forward's kernels (interpreted) under a tp 2 mesh, each on its device's heads (`PallasOps` runs them
in a `shard_map`), against the same kernels on one device. Prints one JSON line:
{op: {"equal": bitwise equal outputs, "sharded": the outputs' head axes split over the 2 devices,
"shard_map": the kernel traced inside a shard_map}, "refusals": the kernels' fallbacks, "engine": per call
of `metrale_jax.sharded_check.scenario` (prefill, decode, ragged verify, decode after the verdict) on the
`pallas` forward at tp 2 against tp 1, {max_abs, argmax_equal}}.
"""

from __future__ import annotations

import json
import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from kernels_pallas import testing  # noqa: E402
from kernels_pallas.ops import PallasOps  # noqa: E402
from metrale_jax import sharded_check  # noqa: E402
from metrale_jax.engine.engine import Engine  # noqa: E402
from metrale_jax.engine.sharding import make_mesh  # noqa: E402

OPS = PallasOps(interpret=True)
HEADS = {2: P(None, None, "tp"), 3: P(None, None, "tp", None), 4: P(None, "tp", None, None)}


def compare(fn, args, specs) -> dict:
    """fn(*args) on one device, and under the (ep 1, tp 2) mesh with args placed by `specs`."""
    one = jax.jit(fn)(*args)
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("ep", "tp"))
    placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
    with jax.set_mesh(mesh):
        two = jax.jit(fn)(*placed)
        traced = str(jax.make_jaxpr(fn)(*placed))
    one, two = jax.tree_util.tree_leaves(one), jax.tree_util.tree_leaves(two)
    return {
        "equal": all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(one, two)),
        "sharded": all(len(b.sharding.device_set) == 2 and not b.sharding.is_fully_replicated for b in two),
        "shard_map": "shard_map" in traced,
    }


def main() -> None:
    rng = np.random.default_rng(0)
    gdn = testing.gdn_inputs(rng, 2, 8, 4, 8, 16, 16, initial_state=True)
    gdn_specs = (HEADS[3], HEADS[3], HEADS[3], HEADS[2], HEADS[2], HEADS[4])
    attn = testing.attention_inputs(rng, np.float32, b=2, t=3, h=4, kvh=2, d=16, bs=4, nb=16, mb=4, starts=[5, (2, 2)])
    attn_specs = (HEADS[3], HEADS[3], HEADS[3], P(), P())
    out = {
        "gdn_chunk": compare(OPS.gdn_chunk, gdn, gdn_specs),
        "gdn_rows": compare(OPS.gdn_rows, gdn, gdn_specs),
        "attention": compare(lambda q, kc, vc, tb, pos: OPS.attention(q, kc, vc, tb, pos, 0.25), attn, attn_specs),
        "refusals": list(PallasOps.refusals()),
    }
    cfg, params = sharded_check.wide_tiny()
    st = sharded_check.settings(speculative=True, num_drafts=3)
    one, two = (
        sharded_check.scenario(Engine(cfg, params, st, mesh=make_mesh(cfg, tp, 1), forward="pallas")) for tp in (1, 2)
    )
    out["engine"] = [
        {"max_abs": float(np.abs(x - r).max()), "argmax_equal": bool((x.argmax(-1) == r.argmax(-1)).all())}
        for x, r in zip(two, one)
    ]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
