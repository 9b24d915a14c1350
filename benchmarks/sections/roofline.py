"""The `roofline` section: bytes each step must move over the measured HBM bandwidth against the measured step
time, per step and per kernel, for a Qwen3.5-35B-A3B-width stack on an NVIDIA GPU (`--gpu`); a dry run with tiny
shapes under the interpreter anywhere else (runner: `benchmarks.roofline`).
"""

from __future__ import annotations

from typing import Any

import click

from benchmarks.report import Grid, Table
from benchmarks.settings import Command, Options, Preset, Settings, ints

COMMANDS: dict[str, Command] = {
    "roofline": (
        "steps and kernels against the HBM bandwidth floor (--gpu; a tiny dry run elsewhere)",
        (
            click.Option(["--roofline-layers"], type=int, help="default 8 (two 3:1 groups); dry run 4"),
            click.Option(["--roofline-ctx"], type=int, help="cached tokens per sequence, default 2048"),
            click.Option(["--roofline-decode-ns"], callback=ints, help="default 1,8,32"),
            click.Option(["--roofline-verify-ns"], callback=ints, help="default 8,32"),
            click.Option(["--roofline-k"], type=int, help="verify rows per sequence, default 4"),
            click.Option(["--roofline-iters"], type=int, help="timed runs per step, default 20"),
        ),
    )
}


def resolve(a: Options, p: Preset) -> dict[str, Any]:
    """The roofline fields of `Settings`: the GPU sizes, or tiny ones for a dry run (and the smoke run, which
    times no decode)."""
    tiny = p.tiny_roofline
    decode_ns = a.get("roofline_decode_ns")
    return dict(
        roofline_dry=tiny,
        roofline_layers=a.get("roofline_layers") or (4 if tiny else 8),
        roofline_ctx=a.get("roofline_ctx") or (24 if tiny else 2048),
        roofline_decode_ns=decode_ns if decode_ns is not None else ([] if p.smoke else [1] if tiny else [1, 8, 32]),
        roofline_verify_ns=a.get("roofline_verify_ns") or ([2] if tiny else [8, 32]),
        roofline_k=a.get("roofline_k") or (2 if tiny else 4),
        roofline_iters=a.get("roofline_iters") or (1 if tiny else 20),
    )


def run(name: str, s: Settings) -> dict:
    from benchmarks import roofline

    return roofline.run(s)


def table(r: dict) -> Table:
    cfg = r["config"]
    steps = []
    for s in r["steps"]:
        b = s["bytes"]
        steps.append(
            (
                s["step"],
                str(s["n"]),
                str(s["t"]),
                str(s["ctx"]),
                f"{s['device_ms']:.3f}",
                f"{s['engine_ms']:.3f}",
                f"{s['floor_must_ms']:.3f}",
                f"{s['floor_all_experts_ms']:.3f}",
                f"{s['x_floor_must']:.1f}",
                f"{s['x_floor_all_experts']:.1f}",
                f"{b['weights_must'] / 1e6:.1f}",
                f"{b['state'] / 1e6:.2f}",
                f"{b['kv'] / 1e6:.2f}",
                f"{b['logits'] / 1e6:.2f}",
            )
        )
    step_headers = (
        "step",
        "n",
        "t",
        "ctx",
        "device ms",
        "engine ms",
        "floor must",
        "floor all experts",
        "x must",
        "x all experts",
        "MB weights",
        "MB state",
        "MB KV",
        "MB logits",
    )
    kernels = [
        (
            f"{s['step']} n={s['n']}",
            k["kernel"],
            ",".join(f"{a}={v}" for a, v in k["shape"].items()),
            f"{k['ms']:.3f}",
            f"{k['floor_ms']:.4f}",
            f"{k['x_floor']:.1f}",
            str(k["layers_per_step"]),
            f"{k['per_step_ms']:.3f}",
            f"{'ok' if k['ok'] else 'FAIL'} {k['note']}".rstrip(),
        )
        for s in r["steps"]
        for k in s["kernels"]
    ]
    kernel_headers = (
        "step",
        "kernel (per layer)",
        "shape",
        "ms",
        "floor ms",
        "x floor",
        "x layers",
        "ms/step",
        "result",
    )
    dry = " (DRY RUN: tiny shapes, interpreter; numbers meaningless)" if r["dry_run"] else ""
    stack = "".join("A" if x == "attn" else "G" for x in r["layer_types"])
    footer = ["kernel refusals (ran the reference): " + "; ".join(r["refusals"])] if r["refusals"] else []
    return Table(
        f"Roofline{dry}: {r['device']} ({r['backend']}), {r['layers']}-layer stack {stack} at hidden "
        f"{cfg['hidden_size']}, E={cfg['num_experts']} top-{cfg['num_experts_per_tok']}, vocab {cfg['vocab_size']}, "
        f"bf16 weights and KV, forward {r['forward']}",
        notes=(
            f"measured copy bandwidth {r['bandwidth_gb_s']:.0f} GB/s; floor = bytes / bandwidth; 'must' counts the "
            "routed experts the rows hit, 'all experts' every expert (an MoE that runs every expert on every row)",
        ),
        grids=(Grid(step_headers, steps), Grid(kernel_headers, kernels, left=(0, 1, 2, 8))),
        footer=footer,
    )
