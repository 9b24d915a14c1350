"""The FP8 fixtures re-blocked: the same e4m3 values with each block scale repeated over smaller
blocks, so the dequantised weights are the fixture's exactly and a tensor-parallel shard boundary
(the fixtures' heads are 8-16 rows wide, their blocks 32) falls between blocks.

Used by `tests/test_fp8_sharding.py` and `tests/fp8_sharded_worker.py`."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
from conftest import FIXTURES

from metrale_jax.checkpoint import read_header, write_safetensors

FP8_FIXTURES = ("qwen3_5_dense_fp8", "qwen3_next_moe_fp8")


def fixture_dir(name: str) -> str:
    return os.path.join(FIXTURES, "hf", name)


def reblocked(name: str, out: str, block: int) -> str:
    """A copy of FP8 fixture `name` at `out` whose scales are per `block` x `block` (a divisor of
    the fixture's block): every scale repeated over the smaller blocks it covers; returns `out`."""
    shutil.copytree(fixture_dir(name), out)
    raw = json.loads(open(os.path.join(out, "config.json")).read())
    qc = raw["quantization_config"]
    rb, cb = qc["weight_block_size"]
    assert rb % block == 0 and cb % block == 0, (rb, cb, block)
    for file in (f for f in os.listdir(out) if f.endswith(".safetensors")):
        path = os.path.join(out, file)
        tensors = {n: np.array(r.read()) for n, r in read_header(path).items()}
        for n in [n for n in tensors if n.endswith("_scale_inv")]:
            *_, rows, cols = tensors[n.removesuffix("_scale_inv")].shape
            s = np.repeat(np.repeat(tensors[n], rb // block, axis=-2), cb // block, axis=-1)
            tensors[n] = np.ascontiguousarray(s[..., : -(-rows // block), : -(-cols // block)])
        write_safetensors(path, tensors)
    qc["weight_block_size"] = [block, block]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    return out
