"""A diff report as JSON, and as the short human summary the command prints.

Owns: the verdict's reason lines (`describe` locates a difference, `failure_line` words a
comparison that broke its contract), `to_json` (strict JSON: numpy scalars become Python
numbers, non-finite floats the strings "nan", "inf", "-inf") and `render_summary` (one table
per prompt / width / shape / length: variant, contract, prefill, mismatched steps, first
mismatch (a failing row: its first violation), max |Δ|; the control; the accept histogram;
then the verdict and its reasons).

Invariant: the summary is derived from the report alone, so `--json` and the summary never
disagree.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from metrale_jax.diff.compare import Comparison
from metrale_jax.text_table import text_table


def _step(loc: dict) -> str:
    s = loc.get("step")
    return "the prefill" if s == "prefill" else s if isinstance(s, str) else f"step {s}"


def describe(loc: dict | None) -> str:
    """One line locating a difference: step, part, row, index, both values (hex), ULP, |Δ|."""
    if loc is None:
        return "nowhere"
    step = _step(loc)
    if "note" in loc:
        return f"{step}: {loc['part'] + ': ' if 'part' in loc else ''}{loc['note']}"
    text = (
        f"{step}, {loc['part']} row {loc['row']} index {loc['index']}: {loc['reference']!r} "
        f"({loc['reference_hex']}) vs {loc['replay']!r} ({loc['replay_hex']})"
    )
    if loc.get("ulp") is not None:
        text += f", {loc['ulp']} ULP"
    text += f", |Δ| {loc['abs_diff']:.3g} (max {loc['max_abs_diff']:.3g})"
    if "argmax_equal" in loc:
        text += ", argmax " + (
            "agrees" if loc["argmax_equal"] else f"differs ({loc['argmax_reference']} vs {loc['argmax_replay']})"
        )
    return f"{text} [{loc['why']}]"


def failure_line(where: str, c: Comparison) -> str:
    """The verdict's reason for a comparison that broke its contract."""
    steps = [s for s in c.violating_steps if s != "prefill"]
    return (
        f"{where}, {c.variant} ({c.contract.split(':')[0]}): prefill "
        f"{'ok' if 'prefill' not in c.violating_steps else 'differs'}, {len(steps)} of {c.steps} "
        f"steps differ; first at {describe(c.first_violation)}"
    )


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def to_json(report: dict) -> str:
    return json.dumps(_plain(report), indent=2, allow_nan=False) + "\n"


def _where(loc: dict | None) -> str:
    """A table cell locating a difference: step, part, row and index."""
    if loc is None:
        return "-"
    step = _step(loc)
    if "row" not in loc:
        return f"{step}: {loc.get('note', '')}"
    return f"{step} {loc['part']} [{loc['row']}, {loc['index']}]"


def _contract(text: str) -> str:
    if text.startswith("bounded"):
        return "bounded " + text.split("max(")[1].split(",")[0]
    return text


def _table(comparisons: list[dict]) -> list[str]:
    head = ("variant", "contract", "prefill", "mismatched", "first mismatch", "max |Δ|", "")
    rows = []
    for c in comparisons:
        rows.append(
            (
                c["variant"],
                _contract(c["contract"]),
                "equal" if c["prefill_equal"] else ("within" if "prefill" not in c["violating_steps"] else "DIFFERS"),
                f"{c['mismatched_steps']}/{c['steps']}" if c["steps"] else "-",
                _where(c["first_diff"] if c["ok"] else c["first_violation"]),
                f"{c['max_abs_diff']:.3g}",
                "ok" if c["ok"] else "FAIL",
            )
        )
    return text_table(head, rows, indent="  ")


def _excused(comparisons: list[dict]) -> list[str]:
    """A line per comparison that judged draft chains only up to a near-tie flip (`compare.draft_chain_cuts`)."""
    return [
        f"  {c['variant']}: {c['excused_draft_flips']} draft chain(s) judged up to a greedy draft that flipped on a "
        "near-tie (the drafts after it follow another token; max |Δ| counts them)"
        for c in comparisons
        if c.get("excused_draft_flips")
    ]


def _control(c: dict | None) -> list[str]:
    if c is None:
        return []
    seen = c["mismatched_steps"] > 0 if c["steps"] else not c["prefill_equal"]
    if "fired" in c:  # the oracle's: it breaks its contract at a step where the clean run keeps it
        seen = bool(c["fired"])
    elif c["contract"].startswith("bounded"):  # a bounded control fires when it breaks its contract
        seen = not c["ok"]
    if c["steps"]:
        what = f"{c['mismatched_steps']}/{c['steps']} steps differ"
    else:
        what = "the prefill differs" if seen else "the prefill is equal"
    return [f"  control: {c['variant']}: {what}, first at {_where(c['first_diff'])} -> {'fired' if seen else 'BLIND'}"]


def _sections(report: dict) -> list[tuple[str, list[dict], dict | None, list[str]]]:
    """(title, comparisons, control, extra lines) per table."""
    mode = report["mode"]
    out: list[tuple[str, list[dict], dict | None, list[str]]] = []
    if mode == "default":
        out = [
            (f"prompt {i} ({p['tokens']} tokens)", p["comparisons"], None, []) for i, p in enumerate(report["prompts"])
        ]
    elif mode == "batch":
        out = [
            (
                f"batch n={w['rows']}",
                w["comparisons"],
                w["detection_control"],
                [f"  left out (prefill differs): {w['prefill_rows_differ']}"] if any(w["prefill_rows_differ"]) else [],
            )
            for w in report["widths"]
        ]
    elif mode in ("verify", "verify-batch"):
        for s in report["verify" if mode == "verify" else "shapes"]:
            hist = " ".join(f"{a}:{n}" for a, n in s["accept_histogram"].items())
            counts = f"({s['full_accepts']} full, {s['partial_accepts']} partial)"
            out.append(
                (
                    f"{mode} n={s['rows']} ks={s['ks']}",
                    s["comparisons"],
                    s["detection_control"],
                    _control(s.get("fused_detection_control"))
                    + _control(s.get("oracle_detection_control"))
                    + _plain_sampling(s)
                    + [f"  accepted drafts histogram: {hist} {counts}"]
                    + _coverage(s),
                )
            )
    elif mode == "prefill":
        out = [
            (
                f"prefill L={s['tokens']}",
                s["comparisons"],
                None,
                [
                    f"  first differing state: {c['variant']}: {c['state_diff']}"
                    for c in s["comparisons"]
                    if c["state_diff"]
                ],
            )
            for s in report["lengths"]
        ]
        cached = [c for e in report.get("cached", []) for c in e["comparisons"]]
        if cached:
            title = "prefill cached leg: prime L, then L + the tail in its namespace: restored vs computed"
            extra = [f"  first differing state: {c['variant']}: {c['state_diff']}" for c in cached if c["state_diff"]]
            extra += [
                f"  under pressure L={e['tokens']}: evictions per step {e['evictions_per_step']}, held state "
                f"{'equal' if e['held_state_equal'] else 'CHANGED'}, other namespace {e['other_namespace']}"
                for e in report.get("pressure", [])
                if "error" not in e
            ]
            extra += [
                f"  under pressure L={e['tokens']}: {e['error']}" for e in report.get("pressure", []) if "error" in e
            ]
            out.append((title, cached, None, extra))
        if "cached_skipped" in report:
            out[-1][3].append(f"  cached leg skipped: {report['cached_skipped']}")
    elif mode == "generate":
        g = report["generate"]
        control = g["detection_control"]["first_difference"]
        extra = [
            f"  {p}: {g['verify_steps'][p]} verify steps, {g['emitted_per_step'][p]} tokens per step, tokens "
            f"{'equal' if g['tokens_equal_greedy'][p] else 'DIFFER'} to greedy"
            for p in g["verify_steps"]
        ]
        extra += [
            f"  composed vs fused step records (drafts exactly, confidences within {g['confidence_bound_ulp']} ulp): "
            + (
                f"equal (confidences {g['confidence_max_ulp']} ulp apart at most)"
                if g["first_difference"] is None
                else f"DIFFER at {g['first_difference']}"
            ),
            "  control: one draft changed: " + ("BLIND" if control is None else f"fired at step {control['step']}"),
        ]
        title = f"generate: {g['prompts']} prompts x {g['new_tokens']} tokens, stop {g['confidence_stop']}"
        out = [(title, [], None, extra)]
    else:
        moves = "; ".join(f"slot {m['slot'][0]}->{m['slot'][1]}" for m in report["moves"])
        record = {(True, True): "equal", (False, True): "within", (False, False): "DIFFERS"}
        extra = [f"  {c['variant']}: record {record[c['record_equal'], c['record_ok']]}" for c in report["comparisons"]]
        extra += [
            f"  control {c['variant']}: {'fired' if c['saw_difference_after'] else 'BLIND'}" for c in report["controls"]
        ]
        oracle = [report["oracle"]] if "oracle" in report else []
        out = [
            (
                f"swap before step {report['spill_before_step']} ({moves})",
                [c["comparison"] for c in report["comparisons"]] + oracle,
                None,
                extra + _control(report.get("oracle_detection_control")),
            )
        ]
    if out and "detection_control" in report and mode in ("default", "prefill"):
        title, comps, _, extra = out[-1]
        out[-1] = (title, comps, report["detection_control"], extra)
    return out


def _plain_sampling(section: dict) -> list[str]:
    """A sampled verify shape's plain-sampling check and its control, one line each (none unsampled)."""
    if "plain_sampling" not in section:
        return []
    check, control = section["plain_sampling"], section["plain_sampling_control"]
    at = check["first_mismatch"]
    return [
        f"  plain sampling: {check['tokens']} committed tokens "
        + ("equal" if check["ok"] else f"DIFFER from (sequence, token) {at}"),
        f"  control {control['label']}: {'BLIND' if control['ok'] else 'fired'}",
    ]


def _warm_up(report: dict) -> str:
    """The verdict line's warm-up clause: its seconds and the programs compiled after it."""
    if "warmup_s" not in report:
        return ""
    return f", {report['warmup_s']:.1f} s of it warm-up, then {report['compiled_after_warmup']} programs compiled"


def _coverage(section: dict) -> list[str]:
    """A verify section's `--tier-slots` slots and `--vocab-stress` edge hits, when it has them."""
    out = [f"  slots (--tier-slots): {section['slots']}"] if "slots" in section else []
    if "edge_hits" in section:
        hits = section["edge_hits"]
        out.append(
            f"  edge ids (--vocab-stress): {hits['committed_0']} committed 0, {hits['committed_last_id']} the last id, "
            f"{hits['full_accepts_below_k_max_then_0']} full accepts below K_max then 0"
        )
    return out


def render_summary(report: dict) -> str:
    """The human summary of `report` (see the module docstring)."""
    variants = ", ".join(v["name"] + ("" if v.get("available", True) else " (unavailable)") for v in report["variants"])
    how = report["graphs"] + (f", sampled ({report['sampling']})" if "sampling" in report else "")
    lines = [f"metrale-jax diff: {report['mode']}, {report['steps']} steps, {how}; variants: {variants}"]
    lines += [f"  unavailable: {v['name']}: {v['reason']}" for v in report["variants"] if not v.get("available", True)]
    for w in report.get("drafter_warmup", []):
        if w["discarded_run"]:
            lines.append(f"  drafter: the first two proposes of n={w['rows']} differed; one run was discarded")
    for title, comparisons, control, extra in _sections(report):
        lines += ["", title] + _table(comparisons) + _excused(comparisons) + _control(control) + extra
    lines += ["", f"verdict: {report['verdict']} ({report['wall_s']:.1f} s{_warm_up(report)})"]
    lines += [f"  - {r}" for r in report["reasons"]]
    return "\n".join(lines) + "\n"
