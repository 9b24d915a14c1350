"""FP8 block-scaled weights under a mesh (`tests/test_fp8_sharding.py`), run in a process of its own
with 4 forced host devices (the device count is fixed when jax starts). Prints one JSON object:

- `logits`: per FP8 fixture re-blocked to 4x4 scale blocks (`fp8_fixtures.reblocked`: the
  fixture's weights exactly, shard boundaries between blocks), per mesh "tp x ep", per call of
  `sharded_check.scenario`, max |logit - the one-device FP8 logit| and whether the argmaxes agree;
- `speculative`: tp 2 on the re-blocked MoE fixture, `sharded_check.speculative_agreement`;
- `refusal`: `generate --tensor-parallel-size 2` on the dense fixture as shipped (32x32 blocks over
  16-row KV heads): its exit code and output;
- `planned`: the planner's step programs at tp 2 on the re-blocked MoE fixture: how many of their
  weight leaves are FP8 (the loader's) and how many the loaded checkpoint has.

Usage: python tests/fp8_sharded_worker.py (from the repository root).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

# NOTE: LLVM level 0 cuts the CPU compiles; every claim compares programs compiled alike here.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0"
)

import conftest  # noqa: E402, F401  (thread environment, CPU platform)
import jax  # noqa: E402
import numpy as np  # noqa: E402
from click.testing import CliRunner  # noqa: E402
from fp8_fixtures import FP8_FIXTURES, fixture_dir, reblocked  # noqa: E402

from metrale_jax import sharded_check  # noqa: E402
from metrale_jax.checkpoint import load_checkpoint  # noqa: E402
from metrale_jax.engine.capacity import pool_counts  # noqa: E402
from metrale_jax.engine.engine import Engine  # noqa: E402
from metrale_jax.engine.sharding import make_mesh  # noqa: E402
from metrale_jax_cli.main import cli  # noqa: E402

MESHES = {"qwen3_5_dense_fp8": [(1, 1), (2, 1)], "qwen3_next_moe_fp8": [(1, 1), (2, 1), (1, 2), (2, 2)]}


def logits_and_speculative(tmp: str) -> tuple[dict, dict]:
    st = sharded_check.settings(speculative=True, num_drafts=3)
    logits, spec = {}, {}
    for name in FP8_FIXTURES:
        cfg, params = load_checkpoint(reblocked(name, os.path.join(tmp, name), 4))
        runs = {}
        for tp, ep in MESHES[name]:
            eng = Engine(cfg, params, st, mesh=make_mesh(cfg, tp, ep))
            runs[f"{tp}x{ep}"] = sharded_check.scenario(eng)
            if name == "qwen3_next_moe_fp8" and (tp, ep) == (2, 1):
                spec["2x1"] = sharded_check.speculative_agreement(eng)
        ref = runs["1x1"]
        logits[name] = {
            mesh: [
                {"max_abs": float(np.abs(x - r).max()), "argmax_equal": bool((x.argmax(-1) == r.argmax(-1)).all())}
                for x, r in zip(outs, ref)
            ]
            for mesh, outs in runs.items()
        }
    return logits, spec


def planned(tmp: str) -> dict:
    from metrale_jax.memory.activations import ActivationModel
    from metrale_jax.memory.source import resolve_model
    from metrale_jax.model.fp8_linear import Fp8BlockWeight

    def fp8_leaves(tree) -> int:
        leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, Fp8BlockWeight))
        return sum(isinstance(x, Fp8BlockWeight) for x in leaves)

    path = reblocked("qwen3_next_moe_fp8", os.path.join(tmp, "planned"), 4)
    source = resolve_model(path, Path("recipes"))
    model = ActivationModel(source.config, np.float32, quantization=source.quantization, programs=("decode",))
    st = sharded_check.settings(speculative=True, num_drafts=3, tensor_parallel_size=2)
    (decode,) = model.programs_at(st, pool_counts(st, source.config))
    return {"program_fp8_leaves": fp8_leaves(decode.build()), "loaded_fp8_leaves": fp8_leaves(load_checkpoint(path)[1])}


def refusal() -> dict:
    argv = ["generate", "--checkpoint", fixture_dir("qwen3_5_dense_fp8"), "--prompt", "ab", "--max-new-tokens", "2"]
    r = CliRunner().invoke(cli, [*argv, "--tensor-parallel-size", "2"])
    return {"exit_code": r.exit_code, "output": r.output}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        logits, spec = logits_and_speculative(tmp)
        plan = planned(tmp)
    print(json.dumps({"logits": logits, "speculative": spec, "refusal": refusal(), "planned": plan}))
