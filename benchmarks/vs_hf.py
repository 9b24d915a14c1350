"""Section `hf`: the JAX engine against Hugging Face transformers on the CPU, in one run.

Same config and the same weights: the benchmark model is written once as an HF checkpoint
(`models.write_checkpoint`), the engine runs those params and HF `from_pretrained`s the folder in
its own Python 3.11 venv (`hf_driver.py`, a subprocess that stays up for the whole section).

Cases (each: the first call on each side is compared, then warm-up, then two timings that both
alternate the sides so they share the machine's conditions: call by call (`paired`: each call
starts after the other side's, i.e. after an idle gap) and in blocks of consecutive calls
(`back_to_back`: the steady state of a serving loop); medians and the per-round ratio's spread):
- prefill of T tokens (one sequence, one chunk, last-row logits only on both sides): tok/s;
- one decode step of n sequences over a `ctx`-token context;
- one verify step: K tokens per sequence of n sequences over the context (HF: the forward of
  those K tokens over a copy of its cache, every row's logits; engine: `verify_batched`, then
  `rollback_verify` so every repeat starts from the same state).
With `prefill_b2b` off, prefills are timed call by call only (a step of seconds gains nothing from
running back to back). Every decode and verify case also gets its CPU roofline (`cpu_roofline`):
the bytes the engine's step must move over the bandwidths measured in this section.

Difference in the work done, against the engine: its verify also runs the MTP drafter's catch-up
layer (one extra attention or GDN + MoE layer) that HF does not have (HF: the verify-shaped step of
the trunk alone).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys

import numpy as np

from benchmarks import cpu_roofline, models
from benchmarks.hf_env import HFClient
from benchmarks.settings import Settings
from benchmarks.steps import DeviceStep, StepBench, max_seq_len_for
from benchmarks.timing import Stats, back_to_back, paired

# |JAX - HF| logits above this (relative to the largest |logit|, at least 1) mark a logit row; most
# rows of a case over it: the two sides did not run the same model (float32 parity is far below it).
# A few rows over it: one sequence's top-k expert choice flipped where two router logits of a token
# are within float32 rounding of each other (random weights make such near-ties likely over many
# routing decisions); that sequence's rows then differ while the others agree.
LOGIT_TOLERANCE = 1e-3


@dataclasses.dataclass
class HFCase:
    kind: str  # prefill | decode | verify
    n: int
    t: int  # tokens per sequence in the timed step (prefill T, decode 1, verify K)
    jax: Stats
    hf: Stats
    ratio: Stats  # per-round JAX/HF
    jax_b2b: Stats  # calls in blocks of `block` back to back
    hf_b2b: Stats
    ratio_b2b: Stats  # per-round JAX/HF of the block medians
    jax_first_s: float  # the engine's first call (compiles its programs)
    jax_device_s: float  # the step's compiled program alone, median (no host work, no logits copy)
    max_abs_diff: float  # |JAX - HF| logits of the first call
    max_abs_logit: float
    rows_differ: int  # logit rows of the first call over the tolerance (`LOGIT_TOLERANCE`)
    logit_rows: int
    roofline: dict | None  # decode / verify: `cpu_roofline.step_roofline` of the engine's step

    @property
    def ratio_of_medians(self) -> float:
        return self.jax.median / self.hf.median

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["ratio_of_medians"] = self.ratio_of_medians
        d["hf_over_jax"] = 1.0 / self.ratio_of_medians
        d["hf_over_jax_b2b"] = self.hf_b2b.median / self.jax_b2b.median if self.hf_b2b.n else None
        if self.roofline is not None:
            floor = self.roofline["floor_s"]
            d["roofline"] = dict(
                self.roofline,
                floor_over_jax_device=floor / self.jax_device_s,
                floor_over_jax_b2b=floor / self.jax_b2b.median,
                floor_over_hf_b2b=floor / self.hf_b2b.median,
            )
        if self.kind == "prefill":
            d["jax_tok_s"] = self.t / self.jax.median
            d["hf_tok_s"] = self.t / self.hf.median
        return d


def _log(msg: str) -> None:
    print(f"[bench hf] {msg}", file=sys.stderr, flush=True)


def _diff(a, b) -> tuple[float, float, int, int]:
    """(max |a - b|, max |b|, rows whose max |a - b| exceeds `LOGIT_TOLERANCE` x max(1, max |b|),
    rows) of two logit arrays [..., V]."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    per_row, scale = np.abs(a - b).max(-1), float(np.abs(b).max())
    over = int((per_row > LOGIT_TOLERANCE * max(1.0, scale)).sum())
    return float(per_row.max()), scale, over, len(per_row)


def run(s: Settings, hf_python: str) -> dict:
    """Every case of the section at `s.model` against HF under `hf_python`; returns {"hf": driver
    facts, "cases": [...], "model": ...}. `s.block`: consecutive calls per side in each of the
    `s.repeats` rounds of the back-to-back timing; `s.threads` 0: HF's torch gets every core."""
    model_name, workdir, prefill_lens, ns, ks, ctx = s.model, s.workdir, s.prefill_lens, s.ns, s.ks, s.ctx
    repeats, warmup, block, threads, impl, seed = s.repeats, s.warmup, s.block, s.threads, s.hf_impl, s.seed
    if s.dtype == "checkpoint":  # the checkpoint's own dtype (a release: bfloat16) on both sides
        cfg, params = models.resolve_checkpoint(model_name, None)
    else:
        cfg, params = models.model(model_name)
    dtype = str(np.dtype(params["embed"].dtype))
    if os.path.isdir(model_name):  # a checkpoint directory: HF reads it as it is
        ckpt = os.path.abspath(model_name)
    else:
        ckpt = models.write_checkpoint(os.path.join(workdir, f"ckpt_{model_name}"), cfg, params)
    rng = np.random.default_rng(seed)
    vocab = cfg.vocab_size
    longest = max([*prefill_lens, ctx + max(ks) + 2])
    max_seq_len = max_seq_len_for(longest)
    weight_bytes = int(np.dtype(params["embed"].dtype).itemsize)
    bandwidths = cpu_roofline.Bandwidths.measure()
    _log(f"streaming read past the cache: {bandwidths.past_cache / 1e9:.1f} GB/s")
    cases: list[HFCase] = []

    def rand(*shape):
        return rng.integers(0, vocab, size=shape).tolist()

    with HFClient(hf_python, os.path.join(workdir, "hf_driver.stderr")) as hf:
        info = hf.call("load", dir=ckpt, threads=threads or os.cpu_count(), impl=impl, dtype=dtype)
        info.pop("ok")
        _log(f"HF loaded: {info}")

        def pair(kind, n, t, bench, jax_call, hf_req):
            dev, (jax_first, jax_logits) = DeviceStep.capture(
                bench.engine, jax_call, "prefill_chunk" if kind == "prefill" else "step_rows"
            )
            hf_logits = hf.call(**hf_req, logits=True)["logits"]
            diff, scale, over, logit_rows = _diff(jax_logits, hf_logits)
            js, hs, rs = paired(lambda: jax_call()[0], lambda: hf.call(**hf_req)["seconds"], repeats, warmup)
            if kind != "prefill" or s.prefill_b2b:
                jb, hb, rb = back_to_back(
                    lambda: [jax_call()[0] for _ in range(block)],
                    lambda: hf.call(**hf_req, repeat=block)["seconds_each"],
                    repeats,
                )
            else:
                jb = hb = rb = Stats.of([])
            device_s = dev.time(max(repeats, 1))
            roof = None
            if kind != "prefill":
                eng = bench.engine
                roof = cpu_roofline.step_roofline(
                    bandwidths,
                    cfg,
                    eng.settings,
                    n=n,
                    t=t,
                    ctx=ctx,
                    verify=kind == "verify",
                    drafter=eng.drafter,
                    weight_bytes=weight_bytes,
                )
            case = HFCase(kind, n, t, js, hs, rs, jb, hb, rb, jax_first, device_s, diff, scale, over, logit_rows, roof)
            b2b = f"; back to back jax {jb.ms()} ms, hf {hb.ms()} ms" if jb.n else ""
            floor = f"; floor {1e3 * roof['floor_s']:.3f} ms" if roof else ""
            _log(
                f"{kind} n={n} t={t}: jax {js.ms()} ms (dev {1e3 * device_s:.3f}), hf {hs.ms()} ms, "
                f"ratio {case.ratio_of_medians:.3f}{b2b}; |dlogit| {diff:.1e} ({over}/{logit_rows} rows over){floor}"
            )
            cases.append(case)

        # NOTE: HF keeps its cache in the model's dtype: a bf16 model's KV is bf16 on both sides.
        kv = "bf16" if dtype == "bfloat16" else "f32"
        base = StepBench(cfg, params, max_batch=max(ns), max_seq_len=max_seq_len, kv_cache_dtype=kv)
        for t in prefill_lens:
            toks = rand(t)
            pair("prefill", 1, t, base, functools.partial(base.prefill, toks), dict(op="prefill", tokens=toks))

        prompts = {n: rand(n, ctx) for n in ns}
        for n in ns:
            hf.call("context", name=f"n{n}", tokens=prompts[n])
            base.context(f"n{n}", prompts[n])
            step = rand(n)
            pair(
                "decode",
                n,
                1,
                base,
                functools.partial(base.decode, f"n{n}", step),
                dict(op="step", context=f"n{n}", tokens=[[x] for x in step]),
            )
            base.free_context(f"n{n}")
        del base

        for k in ks:
            spec = StepBench.verifying(cfg, params, max_batch=max(ns), max_seq_len=max_seq_len, k=k, kv_cache_dtype=kv)
            for n in ns:
                spec.context(f"n{n}", prompts[n])
                rows = rand(n, k)
                pair(
                    "verify",
                    n,
                    k,
                    spec,
                    functools.partial(spec.verify, f"n{n}", rows),
                    dict(op="step", context=f"n{n}", tokens=rows),
                )
                spec.free_context(f"n{n}")
            del spec
    return {
        "model": model_name,
        "checkpoint": ckpt,
        "context_tokens": ctx,
        "repeats": repeats,
        "warmup": warmup,
        "block": block,
        "model_type": cfg.model_type,
        "dtype": dtype,
        "parameters": models.parameter_count(cfg),
        "bandwidth_past_cache": bandwidths.past_cache,
        "bandwidths_sized": bandwidths.sized,
        "hf": info,
        "cases": [c.to_json() for c in cases],
    }
