"""The memory plan as the operator reads it: a text report and a versioned JSON document.

Owns: `Report` (everything one `metrale-jax memory` run found) and its two renderings.

Invariants:
- Both renderings show the same facts; the JSON carries exact bytes, the text MiB with one
  decimal (2^20) and GiB with two (2^30).
- `JSON_SCHEMA` changes whenever a JSON key is renamed, removed or changes meaning.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from metrale_jax.engine.settings import Provenance
from metrale_jax.memory.advice import Answer
from metrale_jax.memory.devices import GIB, MIB, Device
from metrale_jax.memory.plan import Evaluation
from metrale_jax.text_table import text_table

#: /2: activations (XLA memory analysis of the step programs) added and charged in
#: `totals.device_total`.
JSON_SCHEMA = "metrale-jax.memory/2"


@dataclasses.dataclass(frozen=True)
class Report:
    """One plan: what was asked (checkpoint, recipe, flags, device, workload), the settings
    table, the evaluation at the workload, the two inverse answers and the warnings.
    `activation_run`: how the activations were obtained (programs compiled, seconds, cache hits,
    cache directory), or None when skipped (`--no-activations`)."""

    checkpoint: str
    config_from: str
    weights_from: str
    behavior_from: str
    outside_bytes: int
    recipe: str | None
    serve_flags: tuple[str, ...]
    device: Device
    settings_table: tuple[Provenance, ...]
    evaluation: Evaluation
    max_concurrency: Answer
    max_isl: Answer
    warnings: tuple[str, ...]
    activation_run: dict[str, Any] | None = None


def _mib(n: int) -> str:
    return f"{n / MIB:.1f}"


def _answer_text(value: int | None) -> str:
    return "none fits" if value is None else str(value)


def _total_rows(r: Report) -> list[tuple[str, str]]:
    ev = r.evaluation
    rows = [("weights", _mib(ev.weight_bytes))]
    if r.outside_bytes:
        rows.append(("  checkpoint tensors never loaded (not charged)", _mib(r.outside_bytes)))
    rows += [(f"pools: {g}", _mib(b)) for g, b in ev.groups().items()]
    if ev.activations is None:
        rows.append(("activations (not computed: --no-activations)", _mib(0)))
    else:
        rows.append((f"activations (peak program: {ev.activations.peak.name})", _mib(ev.activation_bytes)))
    rows += [
        ("runtime reserve", _mib(ev.runtime)),
        ("device total", _mib(ev.device_total)),
        ("budget", _mib(ev.budget)),
    ]
    return rows


def _activation_lines(r: Report) -> list[str]:
    act = r.evaluation.activations
    if act is None:
        return ["## Activations: not computed (--no-activations); not charged"]
    run = r.activation_run or {}
    lines = [
        f"## Activations (XLA memory analysis of the step programs; backend {act.label}, "
        f"forward {act.forward}, jax {act.jax_version}) (MiB)",
        *text_table(
            ("program", "transition", "shape", "scratch", "fresh outputs", "MiB", "source"),
            [
                (p.name, p.transition, p.shape, _mib(p.temp), _mib(p.outputs), _mib(p.bytes), p.how)
                for p in act.programs
            ],
            right=(3, 4, 5),
            rule=True,
        ),
    ]
    lines.append(
        f"Charged: the peak program, {act.peak.name}, {_mib(act.bytes)} MiB"
        + (f" ({act.note})" if act.note else "")
        + "."
    )
    if run and run["compiled"]:
        lines.append(
            f"Compiled {run['compiled']} program(s) in {run['compile_wall_seconds']:.1f} s "
            f"({run['compile_seconds']:.1f} s of compiling summed over the programs, side by side), "
            f"{run['cache_hits']} from the cache ({run['cache_dir']})."
        )
    elif run:
        lines.append(f"Compiled nothing: {run['cache_hits']} program(s) from the cache ({run['cache_dir']}).")
    return lines


def _mesh_lines(s) -> list[str]:
    """The mesh line of a sharded serve (none for one device)."""
    tp, ep = s.tensor_parallel_size, s.expert_parallel_size
    if tp * ep == 1:
        return []
    return [f"mesh: {tp * ep} devices (tensor parallel {tp} x expert parallel {ep}); every figure below is per device"]


def render_text(r: Report) -> str:
    """The human-readable report."""
    ev = r.evaluation
    s, c, w = ev.settings, ev.counts, ev.workload
    util = s.gpu_memory_utilization
    spec = (
        f"speculation on, K = {c.k}; MTP verify slots {c.verify_slots} (dummy included)"
        if c.speculative
        else "speculation off"
    )
    out = [
        "# metrale-jax memory plan",
        f"checkpoint: {r.checkpoint} (config {r.config_from}; weights {r.weights_from})",
        f"recipe: {r.recipe or 'none (engine defaults)'}",
        f"serve flags: {' '.join(r.serve_flags) or 'none'}",
        f"device: {r.device.id} ({r.device.name}): {r.device.memory_bytes / GIB:.2f} GiB x util "
        f"{util} = budget {ev.budget / GIB:.2f} GiB" + (" (unified memory)" if r.device.unified else ""),
        *_mesh_lines(s),
        f"workload: ISL {w.isl} + OSL {w.osl} tokens, concurrency {w.concurrency}",
        f"slots: {c.real_slots} (+1 dummy); {spec}; KV {c.kv_blocks} blocks of {c.block_size}"
        " tokens"
        f" ({c.kv_tokens} tokens per slot, +1 null block)",
        f"MODEL.toml: {r.behavior_from}",
        "",
        "## Settings (requested -> effective)",
        *text_table(
            ("setting", "requested", "effective", "rule"),
            [(p.setting, p.requested or "-", p.effective, p.rule) for p in r.settings_table],
            rule=True,
        ),
        "",
        "## Weights (MiB)",
        *text_table(
            ("group", "tensors", "dtype", "MiB"),
            [(t.name, str(t.count), t.dtype, _mib(t.bytes)) for t in ev.weights],
            right=(1, 3),
            rule=True,
        ),
        "",
        "## Pools at this workload (MiB)",
        *text_table(
            ("pool", "group", "shape", "dtype", "MiB"),
            [(t.name, t.group, "x".join(map(str, t.shape)) or "-", t.dtype, _mib(t.bytes)) for t in ev.pools],
            right=(4,),
            rule=True,
        ),
        "",
        *_activation_lines(r),
        "",
        "## Totals (MiB)",
        *text_table(("term", "MiB"), _total_rows(r), right=(1,), rule=True),
        "",
        f"Headroom: {_mib(ev.headroom)} MiB ({'fits' if ev.fits else 'over budget'}).",
    ]
    groups = ev.groups()
    if groups:
        group, size = next(iter(groups.items()))
        out.append(f"Largest pool: {group}, {_mib(size)} MiB.")
    out += [
        f"Max concurrency at ISL={w.isl} OSL={w.osl}: {_answer_text(r.max_concurrency.value)}"
        f" ({r.max_concurrency.note}).",
        f"Max ISL at C={w.concurrency} OSL={w.osl}: {_answer_text(r.max_isl.value)} ({r.max_isl.note}).",
    ]
    if r.warnings:
        out += ["", "## Warnings", *(f"- {x}" for x in r.warnings)]
    return "\n".join(out) + "\n"


def _activations_json(r: Report) -> dict[str, Any] | None:
    act = r.evaluation.activations
    if act is None:
        return None
    return {
        "backend": act.backend,
        "device_kind": act.device_kind,
        "forward": act.forward,
        "jax": act.jax_version,
        "programs": [
            {
                "program": p.name,
                "transition": p.transition,
                "shape": p.shape,
                "temp_bytes": p.temp,
                "output_bytes": p.outputs,
                "bytes": p.bytes,
                "source": p.how,
            }
            for p in act.programs
        ],
        "peak_program": act.peak.name,
        "bytes": act.bytes,
        "note": act.note,
        "run": r.activation_run,
    }


def render_json(r: Report) -> str:
    """The report as JSON (schema `JSON_SCHEMA`; all sizes in bytes)."""
    ev = r.evaluation
    w = ev.workload
    groups = ev.groups()
    doc: dict[str, Any] = {
        "schema": JSON_SCHEMA,
        "checkpoint": {
            "id": r.checkpoint,
            "config": r.config_from,
            "weights": r.weights_from,
            "model_toml": r.behavior_from,
            "outside_bytes": r.outside_bytes,
        },
        "recipe": r.recipe,
        "serve_flags": list(r.serve_flags),
        "device": {
            "id": r.device.id,
            "name": r.device.name,
            "memory_bytes": r.device.memory_bytes,
            "unified": r.device.unified,
            "gpu_memory_utilization": ev.settings.gpu_memory_utilization,
            "budget_bytes": ev.budget,
            "tensor_parallel_size": ev.settings.tensor_parallel_size,
            "expert_parallel_size": ev.settings.expert_parallel_size,
        },
        "workload": {"isl": w.isl, "osl": w.osl, "concurrency": w.concurrency},
        "settings": [dataclasses.asdict(p) for p in r.settings_table],
        "counts": dataclasses.asdict(ev.counts),
        "weights": [{"group": t.name, "tensors": t.count, "dtype": t.dtype, "bytes": t.bytes} for t in ev.weights],
        "pools": [
            {"pool": t.name, "group": t.group, "shape": list(t.shape), "dtype": t.dtype, "bytes": t.bytes}
            for t in ev.pools
        ],
        "activations": _activations_json(r),
        "totals": {
            "weights": ev.weight_bytes,
            "pools": groups,
            "activations": ev.activation_bytes,
            "runtime_reserve": ev.runtime,
            "device_total": ev.device_total,
            "budget": ev.budget,
            "headroom": ev.headroom,
            "fits": ev.fits,
        },
        "largest_pool": ({"group": next(iter(groups)), "bytes": next(iter(groups.values()))} if groups else None),
        "inverse": {
            "max_concurrency": {
                "isl": w.isl,
                "osl": w.osl,
                "concurrency": r.max_concurrency.value,
                "note": r.max_concurrency.note,
            },
            "max_isl": {"concurrency": w.concurrency, "osl": w.osl, "isl": r.max_isl.value, "note": r.max_isl.note},
        },
        "warnings": list(r.warnings),
    }
    return json.dumps(doc, indent=2) + "\n"
