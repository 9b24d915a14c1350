"""The sharded engine against the single-device engine, on whatever devices are present.

Owns: the scenario (`scenario`: two prefills, a batched decode, a ragged verify K = 4/2 with its
verdict, a decode after it), the model it runs on (`wide_tiny`: `model_registry.SHARDED_TINY`,
seed 1), the meshes the devices allow
(`meshes`) and the two checks: `logits_agreement` (each mesh's logits against tp 1 x ep 1 on the
same forward: max |delta|, argmax agreement; the `pallas` forward's kernels run in a shard_map on
each device's heads) and `speculative_agreement` (greedy speculative generation, composed and
fused, emits plain greedy's tokens on a mesh; pool copies of its programs).
`tests/sharded_worker.py` runs both on 8 forced host devices; `benchmarks/gpu_check.sh` on every
GPU it finds (`python -m metrale_jax.sharded_check`: both forwards' logits, the `xla` forward's
speculative check; exit 1 when a mesh breaks the contract).

Contract (float32): max |delta| <= `LOGITS_ATOL` and every argmax equal; speculative == greedy.
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np

from metrale_jax.config import ModelConfig
from metrale_jax.engine.engine import FORWARDS, Engine
from metrale_jax.engine.settings import EngineSettings, resolve_settings
from metrale_jax.engine.sharding import check_mesh, make_mesh
from metrale_jax.engine.speculative import DraftSchedule, greedy_generate, speculative_generate
from metrale_jax.errors import MetraleError
from metrale_jax.model_registry import SHARDED_TINY
from metrale_jax.params import init_params
from metrale_jax.presets import resolve_checkpoint

#: Largest |logit delta| a mesh may show against one device (float32; measured <= 2e-5 on CPU).
LOGITS_ATOL = 1e-4
#: (tp, ep) meshes tried, in order, where the devices allow.
CANDIDATES = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)]


def settings(**flags) -> EngineSettings:
    """Settings for the checks: f32 KV (fp8 would round the deltas up to its own step)."""
    raw = {"max_batch_size": "4", "max_seq_len": 128, "kv_cache_dtype": "f32", **flags}
    return resolve_settings(raw, None, auto_slots=4)


def wide_tiny() -> tuple[ModelConfig, dict]:
    return SHARDED_TINY, init_params(SHARDED_TINY, seed=1)


def meshes(cfg: ModelConfig, devices: int) -> list[tuple[int, int]]:
    """The candidate meshes `cfg` and `devices` allow."""
    out = []
    for tp, ep in CANDIDATES:
        try:
            check_mesh(cfg, tp, ep, devices)
        except MetraleError:
            continue
        out.append((tp, ep))
    return out


def scenario(eng: Engine) -> list[np.ndarray]:
    """The logits of every call of the scenario (float32, host); prompt ids below min(256, vocabulary)."""
    rng = np.random.default_rng(5)
    high = min(256, eng.cfg.vocab_size)
    a, b = eng.alloc_sequence(), eng.alloc_sequence()
    out = [eng.prefill(a, [int(x) for x in rng.integers(0, high, 21)])]
    out.append(eng.prefill(b, [int(x) for x in rng.integers(0, high, 9)]))
    out.append(eng.decode_batch([a, b], [int(out[0].argmax()), int(out[1].argmax())]))
    last = [int(x) for x in out[2].reshape(2, -1).argmax(-1)]
    logits, _ = eng.verify_batched([a, b], [last[0], 3, 4, 5, last[1], 7], [4, 2])
    out.append(logits)
    eng.accept([a, b], [2, 0])
    out.append(eng.decode_batch([a, b], [8, 9]))
    eng.free_sequence(b)
    eng.free_sequence(a)
    return [np.asarray(x, np.float32) for x in out]


def logits_agreement(devices: int, forward: str = "xla") -> dict:
    """{"tp x ep": per scenario call {max_abs, argmax_equal} against 1 x 1}, on `forward`."""
    cfg, params = wide_tiny()
    st = settings(speculative=True, num_drafts=3)
    runs = {
        f"{tp}x{ep}": scenario(Engine(cfg, params, st, mesh=make_mesh(cfg, tp, ep), forward=forward))
        for tp, ep in meshes(cfg, devices)
    }
    ref = runs["1x1"]
    return {
        name: [
            {"max_abs": float(np.abs(x - r).max()), "argmax_equal": bool((x.argmax(-1) == r.argmax(-1)).all())}
            for x, r in zip(outs, ref)
        ]
        for name, outs in runs.items()
    }


def speculative_agreement(eng: Engine) -> dict:
    """{composed, fused: speculative == greedy token for token; pool_copies of every program}."""
    rng = np.random.default_rng(3)
    high = min(256, eng.cfg.vocab_size)
    prompts = [[int(x) for x in rng.integers(0, high, size=n)] for n in (9, 17, 30)]
    ref = greedy_generate(eng, prompts, 24)
    same = [speculative_generate(eng, prompts, 24, DraftSchedule(3), fused=f).tokens == ref for f in (False, True)]
    copies = sum(i.pool_copies for i in eng.programs.info.values())
    return {"composed": same[0], "fused": same[1], "pool_copies": copies}


def main() -> int:
    devices = len(jax.devices())
    if devices < 2:
        print(f"sharded check: {devices} device, nothing to shard")
        return 0
    cfg, params = resolve_checkpoint("tiny")
    st = settings(speculative=True, num_drafts=3)
    logits = {forward: logits_agreement(devices, forward) for forward in FORWARDS}
    spec = {
        f"{tp}x{ep}": speculative_agreement(Engine(cfg, params, st, mesh=make_mesh(cfg, tp, ep)))
        for tp, ep in meshes(cfg, devices)
        if tp * ep > 1
    }
    ok = all(
        c["max_abs"] <= LOGITS_ATOL and c["argmax_equal"]
        for runs in logits.values()
        for calls in runs.values()
        for c in calls
    )
    ok = ok and all(s == {"composed": True, "fused": True, "pool_copies": 0} for s in spec.values())
    print(json.dumps({"devices": devices, "logits": logits, "speculative": spec, "ok": ok}, indent=1))
    print(f"sharded check on {devices} x {jax.devices()[0].device_kind}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
