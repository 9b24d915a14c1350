"""The `hf`, `hf-45m`, `hf-300m` and `hf-0.8b` sections: the JAX engine against HF transformers on the CPU,
same config and weights, timed in one run, each decode/verify case with its CPU roofline (runner:
`benchmarks.vs_hf`; the HF side runs in the venv of `benchmarks.hf_env`).

`hf-0.8b` is the released size: the Qwen3.5-0.8B stand-in (`scripts/make_release_standin.sh`, the real
config in the released layout, random weights) in the checkpoint's own dtype (bfloat16) on both sides;
skipped, with the reason, where the stand-in has not been built.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import click

from benchmarks.report import Grid, Table, inverse_quartiles, log, median_range, quartiles
from benchmarks.settings import STEP_OPTIONS, Command, HFSizes, Options, Preset, Settings, ints

_HF_OPTIONS = (
    click.Option(
        ["--hf-impl"],
        type=click.Choice(["default", "eager"]),
        help="HF attention/experts implementations: from_pretrained's defaults (default) or eager",
    ),
    click.Option(["--no-hf-setup"], is_flag=True, default=None, help="never create the HF venv (skip if absent)"),
)
_WIDE_OPTIONS = (
    click.Option(["--wide-prefill-lens"], callback=ints, help="prefill lengths (default 128,1024,2048; hf-300m 128)"),
    click.Option(["--wide-ns"], callback=ints, help="sequences per decode/verify step, default 1,8"),
    click.Option(["--wide-ks"], callback=ints, help="verify rows per sequence, default 4"),
    click.Option(["--wide-repeats"], type=int, help="timed repeats per case (default 3)"),
    STEP_OPTIONS["warmup"],
    STEP_OPTIONS["block"],
    STEP_OPTIONS["ctx"],
)
#: Where `scripts/make_release_standin.sh` writes the Qwen3.5-0.8B stand-in by default.
STANDIN_DIR = os.path.join("~", ".cache", "metrale-jax", "standins", "qwen3.5-0.8b")
_STANDIN_OPTION = click.Option(
    ["--standin"], help=f"hf-0.8b: the Qwen3.5-0.8B stand-in's folder (default {STANDIN_DIR})"
)
_STEP = ("model", "prefill_lens", "ns", "ks", "ctx", "repeats", "warmup", "block")
_WIDE_HELP = "the hf comparison at realistic width: {} (prefill, decode and verify n in 1/8, K 4)"

COMMANDS: dict[str, Command] = {
    "hf": (
        "JAX engine vs HF transformers on the CPU (default model tiny): prefill, decode, verify, CPU roofline",
        (*(STEP_OPTIONS[k] for k in _STEP), *_HF_OPTIONS),
    ),
    "hf-45m": (_WIDE_HELP.format("the 45 M Qwen3-Next qwen3-next-h512"), (*_WIDE_OPTIONS, *_HF_OPTIONS)),
    "hf-300m": (_WIDE_HELP.format("the 304 M Qwen3.5-MoE qwen35-moe-h1024"), (*_WIDE_OPTIONS, *_HF_OPTIONS)),
    "hf-0.8b": (
        "the hf comparison at the released size: the Qwen3.5-0.8B stand-in in its own dtype (bf16), prefill 256, "
        "decode and verify n in 1/4, K 4",
        (*_WIDE_OPTIONS, *_HF_OPTIONS, _STANDIN_OPTION),
    ),
}


def resolve(a: Options, p: Preset) -> dict[str, Any]:
    """The hf sections' fields of `Settings` beyond the step shape: `wide` (the realistic-width sections'
    models and sizes; `--wide-*`, `--warmup` and `--block` override every one; with `--smoke` their
    stand-ins at tiny width and tiny sizes), `hf_create`, `hf_impl`."""
    if p.smoke:
        presets = {
            name: HFSizes(model, [16], [1], [2], 1, 0, 2, True)
            for name, model in (("hf-45m", "tiny-2L"), ("hf-300m", "qwen35-moe-2L"), ("hf-0.8b", "tiny-2L"))
        }
    else:
        standin = os.path.expanduser(a.get("standin") or STANDIN_DIR)
        presets = {
            "hf-45m": HFSizes("qwen3-next-h512", [128, 1024, 2048], [1, 8], [4], 3, 1, 2, False),
            "hf-300m": HFSizes("qwen35-moe-h1024", [128], [1, 8], [4], 3, 1, 2, False),
            "hf-0.8b": HFSizes(standin, [256], [1, 4], [4], 3, 1, 2, False, dtype="checkpoint"),
        }
    given = {
        "prefill_lens": a.get("wide_prefill_lens"),
        "ns": a.get("wide_ns"),
        "ks": a.get("wide_ks"),
        "repeats": a.get("wide_repeats"),
        "warmup": a.get("warmup"),
        "block": a.get("block"),
    }
    over = {k: v for k, v in given.items() if v is not None}
    return dict(
        wide={name: dataclasses.replace(w, **over) for name, w in presets.items()},
        hf_create=not (a.get("no_hf_setup") or p.smoke),
        hf_impl=a.get("hf_impl") or "default",
    )


def run(name: str, s: Settings) -> dict:
    """Section `name` (hf, hf-45m, hf-300m or hf-0.8b); skipped, with the reason, when the HF venv is not
    ready or (hf-0.8b) the stand-in has not been built."""
    from benchmarks import vs_hf
    from benchmarks.hf_env import ensure_hf_venv

    section = s.hf_section(name)
    if section.dtype == "checkpoint" and not os.path.isfile(os.path.join(section.model, "config.json")):
        why = f"no checkpoint at {section.model} (build it: bash scripts/make_release_standin.sh)"
        log(f"HF comparison skipped: {why}")
        return {"skipped": why}

    python, why = ensure_hf_venv(create=s.hf_create)
    if python is None:
        log(f"HF comparison skipped: {why}")
        return {"skipped": why}
    return vs_hf.run(section, python)


def _b2b(c: dict, key: str) -> str:
    """A back-to-back cell: the median in ms, or '-' where the case was timed call by call only."""
    return f"{1e3 * c[key]['median']:.3f}" if c[key]["n"] else "-"


def table(r: dict) -> Table:
    if r.get("skipped"):
        return Table(f"JAX engine vs HF transformers: SKIPPED: {r['skipped']}")
    hf = r["hf"]
    rows, roof_rows = [], []
    for c in r["cases"]:
        extra = f"tok/s JAX {c['jax_tok_s']:.0f}, HF {c['hf_tok_s']:.0f}" if c["kind"] == "prefill" else ""
        if 2 * c["rows_differ"] > c["logit_rows"]:
            extra = f"LOGITS DIFFER (not the same model?) {extra}"
        elif c["rows_differ"]:
            extra = f"{c['rows_differ']}/{c['logit_rows']} logit rows differ (a top-k routing near-tie?) {extra}"
        timed_b2b = c["jax_b2b"]["n"] > 0
        rows.append(
            (
                c["kind"],
                str(c["n"]),
                str(c["t"]),
                median_range(c["jax"]),
                f"{1e3 * c.get('jax_device_s', float('nan')):.3f}",
                median_range(c["hf"]),
                f"{c['ratio_of_medians']:.3f}",
                quartiles(c["ratio"]),
                f"{c['hf_over_jax']:.1f}x",
                _b2b(c, "jax_b2b"),
                _b2b(c, "hf_b2b"),
                f"{c['hf_over_jax_b2b']:.1f}x" if timed_b2b else "-",
                inverse_quartiles(c["ratio_b2b"]) if timed_b2b else "-",
                f"{c['max_abs_diff']:.1e}",
                extra,
            )
        )
        if c.get("roofline"):
            ro, by = c["roofline"], c["roofline"]["bytes"]
            roof_rows.append(
                (
                    c["kind"],
                    str(c["n"]),
                    str(c["t"]),
                    f"{by['weights_must'] / 1e6:.1f}",
                    f"{by['experts_hit_per_layer']:.2f}",
                    f"{(by['state'] + by['kv'] + by['logits']) / 1e6:.2f}",
                    f"{ro['bandwidth_weights_sized'] / 1e9:.1f}",
                    f"{ro['bandwidth_past_cache'] / 1e9:.1f}",
                    f"{1e3 * ro['floor_s']:.3f}",
                    f"{1e3 * ro['floor_past_cache_s']:.3f}",
                    f"{1e3 * c['jax_device_s']:.3f}",
                    f"{ro['floor_over_jax_device']:.2f}",
                    f"{ro['floor_over_jax_b2b']:.2f}",
                    f"{ro['floor_over_hf_b2b']:.2f}",
                )
            )
    headers = (
        "step",
        "n",
        "T/K",
        "JAX ms",
        "JAX dev",
        "HF ms",
        "JAX/HF",
        "per-round",
        "HF/JAX",
        "b2b JAX",
        "b2b HF",
        "HF/JAX b2b",
        "per-round",
        "|dlogit|",
        "extra",
    )
    roof_headers = (
        "step",
        "n",
        "T/K",
        "weights MB",
        "experts/layer",
        "state+KV+logits MB",
        "GB/s w-sized",
        "GB/s >L3",
        "floor ms",
        "floor >L3 ms",
        "JAX dev ms",
        "floor/JAX dev",
        "floor/JAX b2b",
        "floor/HF b2b",
    )
    grids = [Grid(headers, rows, left=(0, 14))]
    notes = [
        f"decode/verify context {r['context_tokens']} tokens; {r['repeats']} repeats "
        f"alternated JAX/HF after {r['warmup']} warm-up; times in ms: median (min-max); JAX/HF = ratio of "
        "medians (p25-p75 of per-round ratios)",
        "'JAX dev' = the engine's compiled program alone (the rest of 'JAX' is host work); "
        f"'b2b' = the same calls in {r['block']}-call blocks back to back (blocks alternated, the steady state "
        "of a serving loop; the call-by-call columns start every call after the other side's turn; '-': "
        "timed call by call only)",
    ]
    if roof_rows:
        grids.append(Grid(roof_headers, roof_rows))
        notes.append(
            "roofline (second table): bytes the engine's step must move (weights it touches: the routed experts "
            "its rows reach, exactly top-k per MoE layer for one row, the expectation under uniform routing for "
            "more ('experts/layer'); MTP drafter layer in verify; GDN state, KV and logits) over this core's "
            "streaming-read bandwidth measured in this run, of a buffer the size of the touched weights "
            "('w-sized', the floor) and of one past the L3; floor/measured: 1 = at the bandwidth bound, 0.5 = "
            "within 2x (HF's verify runs no MTP layer; its ratio is against the engine's bytes)"
        )
    params = (
        f" ({r['model_type']}, {r['parameters'] / 1e6:.1f} M parameters with the MTP layer)"
        if "parameters" in r
        else ""
    )
    return Table(
        f"{r['model']}{params}: JAX engine vs HF transformers {hf['transformers']} (torch {hf['torch']}, "
        f"{hf['attn_implementation']} attention, {hf['experts_implementation']} experts, {hf['threads']} thread(s)), "
        f"CPU {r.get('dtype', 'float32')}",
        notes=tuple(notes),
        grids=tuple(grids),
    )
