"""Section `roofline` (`--gpu`): bytes each step must move over the measured HBM bandwidth, against
the measured step time, per step and per kernel, for a Qwen3.5-35B-A3B-size layer stack.

Run where an NVIDIA GPU is present (`python -m benchmarks roofline --gpu`, jax with CUDA); elsewhere
`--gpu --dry-run` runs the identical code path at tiny width under the Pallas interpreter, so the
script stays checked on CPU (its numbers then mean nothing).

Per step (decode of n sequences, verify of n x K, over `ctx` cached tokens, the `pallas` forward):
- bytes (`step_bytes`, from the config, the serve settings and the engine's pool layout):
  weights: every layer's mixer, norms, router and shared expert, the routed experts, the final
  norm and lm_head, the MTP drafter's fc + layer (its catch-up runs in every trunk step);
  "must move" counts the distinct routed experts the rows can hit (E (1 - (1 - k/E)^rows),
  uniform routing), "all experts" every expert (what an MoE that runs every expert on every row reads);
  state: GDN h (f32) and conv window read + written per sequence, plus for verify the pre-verify
  checkpoint copy and the write-on-accept rows (K-1 h rows, K conv rows);
  KV: every live key of every attention layer (and the drafter's) read, the new rows written;
  logits: the f32 rows written.
- floor = bytes / bandwidth, the bandwidth measured in the same run (`gpu_check.measure_bandwidth`,
  a large device copy);
- measured: the compiled step program alone (`steps.DeviceStep`, median) and the whole engine call
  (host bookkeeping and the logits' copy to the host included).
Per kernel: `gpu_check.run_case` at this step's shapes (GDN rows kernel, paged attention), each
against its own bytes floor, times the layers that call it per step.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import gpu_check
from benchmarks.settings import Settings
from benchmarks.steps import DeviceStep, StepBench, max_seq_len_for
from metrale_jax.config import FULL
from metrale_jax.engine.pool import H_DTYPES, KV_DTYPES
from metrale_jax.model_registry import qwen35_stack
from metrale_jax.params import init_params, is_spec, param_specs


def _elements(tree) -> int:
    return int(sum(math.prod(s.shape) for s in jax.tree_util.tree_leaves(tree, is_leaf=is_spec)))


def expected_experts(num_experts: int, top_k: int, rows: int) -> float:
    """Distinct experts `rows` tokens hit under uniform top-k routing."""
    if num_experts == 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** rows)


def step_bytes(cfg, settings, *, n: int, t: int, ctx: int, verify: bool, drafter: bool, weight_bytes: int) -> dict:
    """Bytes one step of n sequences x t rows over ctx cached tokens must move (see module doc)."""
    specs = param_specs(cfg)
    rows = n * t
    hd = cfg.hidden_size

    def layer_weights(spec, moe: bool) -> tuple[float, float]:
        if not moe:
            e = _elements(spec)
            return e, e
        mlp = spec["mlp"]
        per_expert = (_elements(mlp["gate_up"]) + _elements(mlp["down"])) / cfg.num_experts
        rest = _elements(spec) - per_expert * cfg.num_experts
        hit = expected_experts(cfg.num_experts, cfg.num_experts_per_tok, rows)
        return rest + hit * per_expert, rest + cfg.num_experts * per_expert

    ideal = every = 0.0
    for i, spec in enumerate(specs["layers"]):
        a, b = layer_weights(spec, cfg.is_moe_layer(i))
        ideal, every = ideal + a, every + b
    head = _elements(specs["final_norm"]) + cfg.vocab_size * hd  # final norm + lm_head (or the tied embedding)
    ideal, every = ideal + head + rows * hd, every + head + rows * hd  # + the embedding rows gathered
    if drafter and "mtp" in specs:
        mtp = specs["mtp"]
        base = _elements({k: v for k, v in mtp.items() if k != "layers"})
        a, b = layer_weights(mtp["layers"][0], cfg.mtp_is_moe)
        ideal, every = ideal + base + a, every + base + b
    w_ideal, w_every = ideal * weight_bytes, every * weight_bytes

    hb = jnp.dtype(H_DTYPES[settings.ssm_h_dtype]).itemsize
    kvb = jnp.dtype(KV_DTYPES[settings.kv_cache_dtype]).itemsize
    h_unit = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * hb
    conv_unit = cfg.conv_dim * cfg.linear_conv_kernel_dim * weight_bytes
    per_seq = 2 * h_unit + 2 * conv_unit  # live h and window: read + write
    if verify:
        per_seq += 2 * h_unit + 2 * conv_unit  # pre-verify checkpoint: read + write
        per_seq += (t - 1) * h_unit + t * conv_unit  # write-on-accept rows
    state = cfg.num_linear_layers * n * per_seq

    kv_row = cfg.num_key_value_heads * cfg.head_dim * 2 * kvb  # K and V of one token
    kv_layers = cfg.num_full_layers + (cfg.num_mtp_layers if drafter else 0)
    kv = kv_layers * n * ((ctx + t) * kv_row + t * kv_row)
    logits = rows * cfg.vocab_size * 4
    total_ideal = w_ideal + state + kv + logits
    total_all_experts = w_every + state + kv + logits
    return {
        "weights_must": w_ideal,
        "weights_all_experts": w_every,
        "state": state,
        "kv": kv,
        "logits": logits,
        "total_must": total_ideal,
        "total_all_experts": total_all_experts,
        "experts_hit_per_layer": expected_experts(cfg.num_experts, cfg.num_experts_per_tok, rows),
    }


def _kernel_rows(
    cfg, *, n: int, t: int, ctx: int, block_size: int, run_case: Callable[[gpu_check.Case], gpu_check.Row]
):
    """`run_case` rows (`gpu_check.run_case` with the run's options bound) for this step's
    GDN-rows and attention kernels (shapes of one layer)."""
    d = cfg.linear_key_head_dim
    span = block_size * (-(-(ctx + t) // block_size) + 1)
    gdn = dict(b=n, t=t, hk=cfg.linear_num_key_heads, h=cfg.linear_num_value_heads, d=d)
    att = dict(
        b=n, t=t, h=cfg.num_attention_heads, kvh=cfg.num_key_value_heads, d=cfg.head_dim, bs=block_size, ctx=span
    )
    out = []
    for name, kernel, shape, per_step in (
        ("gdn_rows", "gdn_rows", gdn, cfg.num_linear_layers),
        ("attention", "attention", att, cfg.num_full_layers),
    ):
        case = gpu_check.Case(f"{name} n{n} t{t}", kernel, shape, shape)
        row = run_case(case)
        out.append(
            {
                "kernel": name,
                "layers_per_step": per_step,
                "shape": shape,
                "ms": row.ms,
                "ref_ms": row.ref_ms,
                "floor_ms": row.floor_ms,
                "x_floor": row.ms / row.floor_ms if row.floor_ms else float("nan"),
                "per_step_ms": row.ms * per_step,
                "ok": row.ok,
                "err": row.err,
                "note": row.note,
            }
        )
    return out


def run(s: Settings, *, forward: str = "pallas", log=None) -> dict:
    """The section from the `roofline_*` fields of `s`: `s.roofline_layers` layers (tiny width when
    `s.roofline_dry`), decode of each n of `s.roofline_decode_ns` and verify of each n of
    `s.roofline_verify_ns` x `s.roofline_k` rows over `s.roofline_ctx` cached tokens, each timed
    over `s.roofline_iters` runs."""
    dry_run, layers, ctx = s.roofline_dry, s.roofline_layers, s.roofline_ctx
    k, iters, seed = s.roofline_k, s.roofline_iters, s.seed
    decode_ns, verify_ns = s.roofline_decode_ns, s.roofline_verify_ns
    log = log or (lambda m: print(f"[bench roofline] {m}", file=sys.stderr, flush=True))
    cfg = qwen35_stack(layers, tiny=dry_run)
    dtype = jnp.bfloat16
    params = init_params(cfg, seed, dtype)
    block_size = 16
    max_batch = max([*decode_ns, *verify_ns])
    max_seq_len = max_seq_len_for(ctx + k + 1, block_size)
    bench = StepBench.verifying(
        cfg,
        params,
        max_batch=max_batch,
        max_seq_len=max_seq_len,
        k=k,
        forward=forward,
        kv_cache_dtype="bf16",
        block_size=block_size,
        max_prefill_tokens=min(ctx, 2048),
    )
    eng = bench.engine
    bandwidth = gpu_check.measure_bandwidth(2**20 if dry_run else 2**31, max(iters, 3))
    width = "tiny width (dry run)" if dry_run else "Qwen3.5-35B-A3B width"
    log(f"bandwidth {bandwidth / 1e9:.1f} GB/s; model {layers} layers, {width}")
    rng = np.random.default_rng(seed)
    run_case = functools.partial(gpu_check.run_case, dry_run=dry_run, iters=iters, bandwidth=bandwidth, seed=seed)

    def rand(*shape: int) -> list:
        return rng.integers(0, cfg.vocab_size, size=shape).tolist()

    steps = []
    for kind, ns, t in (("decode", decode_ns, 1), ("verify", verify_ns, k)):
        for n in ns:
            bench.context("c", rand(n, ctx))
            toks = rand(n) if kind == "decode" else rand(n, t)
            call = functools.partial(bench.decode if kind == "decode" else bench.verify, "c", toks)
            dev, _ = DeviceStep.capture(eng, call)  # compiles; captures the step program
            engine_ms = 1e3 * float(np.median([call()[0] for _ in range(iters)]))
            device_ms = 1e3 * dev.time(iters)
            by = step_bytes(
                cfg,
                eng.settings,
                n=n,
                t=t,
                ctx=ctx,
                verify=kind == "verify",
                drafter=eng.drafter,
                weight_bytes=jnp.dtype(dtype).itemsize,
            )
            floor_must = 1e3 * by["total_must"] / bandwidth
            floor_all = 1e3 * by["total_all_experts"] / bandwidth
            kernels = _kernel_rows(cfg, n=n, t=t, ctx=ctx, block_size=block_size, run_case=run_case)
            row = {
                "step": kind,
                "n": n,
                "t": t,
                "ctx": ctx,
                "device_ms": device_ms,
                "engine_ms": engine_ms,
                "floor_must_ms": floor_must,
                "floor_all_experts_ms": floor_all,
                "x_floor_must": device_ms / floor_must,
                "x_floor_all_experts": device_ms / floor_all,
                "bytes": by,
                "kernels": kernels,
                "kernels_ms": sum(r["per_step_ms"] for r in kernels),
            }
            log(
                f"{kind} n={n} t={t}: device {device_ms:.3f} ms, floor {floor_must:.3f} ms "
                f"(all experts {floor_all:.3f}), x{row['x_floor_must']:.1f}"
            )
            steps.append(row)
            bench.free_context("c")
    return {
        "dry_run": dry_run,
        "device": str(jax.devices()[0].device_kind),
        "backend": jax.default_backend(),
        "forward": forward,
        "layers": layers,
        "config": {
            k_: getattr(cfg, k_)
            for k_ in (
                "hidden_size",
                "vocab_size",
                "num_experts",
                "num_experts_per_tok",
                "moe_intermediate_size",
                "linear_num_key_heads",
                "linear_num_value_heads",
                "linear_key_head_dim",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
            )
        },
        "layer_types": [("attn" if x == FULL else "gdn") for x in cfg.layer_types],
        "weights_dtype": "bfloat16",
        "kv_dtype": "bf16",
        "bandwidth_gb_s": bandwidth / 1e9,
        "refusals": eng.disclosure(forward)["refusals"],
        "steps": steps,
    }
