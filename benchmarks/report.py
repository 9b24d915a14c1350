"""Text tables of the benchmark results (the JSON dicts the sections return).

Every timing is shown as its median with the (min-max) of the repeats; every ratio as the ratio
of the medians with the quartiles (p25-p75) of the per-round ratios of the alternated runs.
"""

from __future__ import annotations

# |JAX - HF| logits above this (relative to the largest |logit|, at least 1) mark a case: the two
# sides did not run the same model (float32 parity is ~1e-5).
LOGIT_TOLERANCE = 1e-3


def _mm(s: dict, scale: float = 1e3, fmt: str = ".3f") -> str:
    return f"{s['median'] * scale:{fmt}} ({s['min'] * scale:{fmt}}-{s['max'] * scale:{fmt}})"


def _q(s: dict) -> str:
    return f"({s['p25']:.3f}-{s['p75']:.3f})"


def _inv_q(s: dict) -> str:
    """The quartiles of per-round JAX/HF ratios as HF/JAX (p25-p75)."""
    return f"({1 / s['p75']:.2f}-{1 / s['p25']:.2f})"


def machine_line(m: dict) -> str:
    load = m.get("load_average_1_5_15") or []
    return (
        f"machine: {m.get('cpu_count')} cores, load average {'/'.join(str(x) for x in load)} (1/5/15 min), "
        f"jax {m.get('jax')} on {m.get('backend')}, threads per side {m.get('threads', 'default')}"
        + (f", JAX on cpu {m['jax_cpus']} / HF on cpu {m['hf_cpu']}" if m.get("hf_cpu") is not None else "")
        + f", {m.get('time')}"
    )


def hf_table(r: dict) -> str:
    if r.get("skipped"):
        return f"== JAX engine vs HF transformers: SKIPPED: {r['skipped']}"
    hf = r["hf"]
    lines = [
        f"== JAX engine vs HF transformers {hf['transformers']} (torch {hf['torch']}, {hf['attn_implementation']} attention, "
        f"{hf['experts_implementation']} experts, {hf['threads']} thread(s)), CPU float32",
        f"   model {r['model']}, decode/verify context {r['context_tokens']} tokens; {r['repeats']} repeats alternated "
        f"JAX/HF after {r['warmup']} warm-up; times in ms: median (min-max); JAX/HF = ratio of medians (p25-p75 of per-round ratios)",
        "   'JAX dev' = the engine's compiled program alone (no host bookkeeping, no logits copy): the rest of 'JAX' is host work",
        f"   'b2b' = the same calls in {r['block']}-call blocks back to back (blocks alternated, the steady state of a "
        "serving loop; the call-by-call columns start every call after the other side's turn)",
        f"{'step':<8}{'n':>3}{'T/K':>6}  {'JAX ms':>26}  {'JAX dev':>8}  {'HF ms':>26}  {'JAX/HF':>7} {'per-round':>15}  {'HF/JAX':>7}  "
        f"{'b2b JAX':>8}  {'b2b HF':>8}  {'HF/JAX b2b':>10} {'per-round':>15}  {'|dlogit|':>8}  extra",
    ]
    for c in r["cases"]:
        extra = f"tok/s JAX {c['jax_tok_s']:.0f}, HF {c['hf_tok_s']:.0f}" if c["kind"] == "prefill" else ""
        if c["max_abs_diff"] > LOGIT_TOLERANCE * max(1.0, c["max_abs_logit"]):
            extra = f"LOGITS DIFFER (not the same model?) {extra}"
        lines.append(
            f"{c['kind']:<8}{c['n']:>3}{c['t']:>6}  {_mm(c['jax']):>26}  {1e3 * c.get('jax_device_s', float('nan')):>8.3f}  "
            f"{_mm(c['hf']):>26}  {c['ratio_of_medians']:>7.3f} "
            f"{_q(c['ratio']):>15}  {c['hf_over_jax']:>6.1f}x  {1e3 * c['jax_b2b']['median']:>8.3f}  {1e3 * c['hf_b2b']['median']:>8.3f}  "
            f"{c['hf_over_jax_b2b']:>9.1f}x {_inv_q(c['ratio_b2b']):>15}  {c['max_abs_diff']:>8.1e}  {extra}"
        )
    return "\n".join(lines)


def compile_table(r: dict) -> str:
    lines = [
        f"== Compile cost: {r['steps']}-step ragged verify loop (propose, verify K in {{1..4}} ragged, stash, fold, commit), "
        f"{r['repeats']} run(s) each{', each in a fresh process' if r['isolated'] else ''}; seconds: median (min-max)",
        "   time to first step = the engine's first prefill + the loop's first step (engine construction apart: 'init')",
        f"{'model':<16}{'layers':>7}{'groups':>7}  {'layout':<10}{'init':>6}{'time to first step':>26}{'prefill 1st':>13}{'loop step 1':>13}"
        f"{'verify compile':>16}{'steady ms':>11}{'compiles':>10}{'after warm-up':>15}",
    ]
    for c in r["cases"]:
        layout = c["layout"] if c["groups"] > 1 else "one group"
        sr = c["program_compile_s"].get("step_rows", {"median": float("nan")})
        lines.append(
            f"{c['model']:<16}{c['layers']:>7}{c['groups']:>7}  {layout:<10}{c['engine_init_s']['median']:>6.1f}"
            f"{_mm(c['time_to_first_step_s'], 1, '.1f'):>26}"
            f"{c['prefill_first_s']['median']:>13.1f}{c['first_step_s']['median']:>13.1f}{sr['median']:>16.1f}"
            f"{c['steady_step_ms']:>11.1f}{'/'.join(str(x) for x in c['compilations']):>10}"
            f"{c['recompiles_after_warmup'] + c['backend_compiles_after_warmup']:>15}"
        )
    by = {(c["model"], c["layout"]): c for c in r["cases"]}
    for (m, layout), c in by.items():
        if layout == "scan" and (m, "unrolled") in by:
            u = by[(m, "unrolled")]
            lines.append(
                f"   {m}: unrolled/scan time to first step {u['time_to_first_step_s']['median'] / c['time_to_first_step_s']['median']:.2f}x; "
                + ", ".join(
                    f"{p} compile {u['program_compile_s'][p]['median']:.1f} s -> {c['program_compile_s'][p]['median']:.1f} s"
                    for p in ("prefill_chunk", "step_rows", "propose")
                    if p in c["program_compile_s"] and p in u["program_compile_s"]
                )
            )
    return "\n".join(lines)


def forwards_table(r: dict) -> str:
    lines = [
        f"== Forwards: pallas ({'interpreter' if r['interpret'] else 'compiled kernels'}) vs xla, model {r['model']}, context "
        f"{r['context_tokens']} tokens; ms: median (min-max); pallas/xla = ratio of medians (p25-p75 per round)",
        f"{'step':<8}{'n':>3}{'T/K':>6}  {'pallas ms':>26}  {'xla ms':>26}  {'pallas/xla':>10} {'per-round':>15}  "
        f"{'1st call s pallas/xla':>22}  {'|dlogit|':>8}",
    ]
    for c in r["cases"]:
        f = c["first_call_s"]
        lines.append(
            f"{c['step']:<8}{c['n']:>3}{c['t']:>6}  {_mm(c['pallas']):>26}  {_mm(c['xla']):>26}  {c['ratio_of_medians']:>10.2f} "
            f"{_q(c['ratio']):>15}  {f['pallas']:>10.1f} / {f['xla']:<9.1f}  {c['max_abs_diff']:>8.1e}"
        )
    if r["refusals"]:
        lines.append("   kernel refusals (ran the reference): " + "; ".join(r["refusals"]))
    return "\n".join(lines)


def gap_table(r: dict) -> str:
    base = r["gaps"][0]["best_median_s"]
    lines = [
        f"== Idle gap before a call: the engine's verify step (n={r['n']}, K={r['k']}, context {r['context_tokens']} tokens, "
        f"model {r['model']}), {r['calls']} calls per gap and round, best of {r['rounds']} round medians",
        f"{'gap ms':>7}{'ms':>9}{'x first':>9}  round medians ms",
    ]
    for g in r["gaps"]:
        rounds = " ".join(f"{1e3 * x:.3f}" for x in g["round_medians_s"])
        lines.append(
            f"{1e3 * g['gap_s']:>7.0f}{1e3 * g['best_median_s']:>9.3f}{g['best_median_s'] / base:>9.2f}  {rounds}"
        )
    return "\n".join(lines)


def slots_table(r: dict) -> str:
    base = r["rows"][0]
    lines = [
        f"== Slots: one sequence's step (context {r['context_tokens']} tokens, verify K={r['k']}, model {r['model']}) "
        f"against the engine's slot count; compiled programs alone, median of {r['iters']}",
        f"{'slots':>6}{'GDN state MB':>14}{'decode ms':>11}{'x first':>9}{'verify ms':>11}{'x first':>9}  pool copies",
    ]
    for row in r["rows"]:
        copies = sum(row["pool_copies"].values())
        lines.append(
            f"{row['slots']:>6}{row['gdn_state_bytes'] / 1e6:>14.2f}{1e3 * row['decode_s']:>11.3f}"
            f"{row['decode_s'] / base['decode_s']:>9.2f}{1e3 * row['verify_s']:>11.3f}"
            f"{row['verify_s'] / base['verify_s']:>9.2f}  {copies}"
        )
    return "\n".join(lines)


def roofline_table(r: dict) -> str:
    cfg = r["config"]
    lines = [
        f"== Roofline{' (DRY RUN: tiny shapes, interpreter; numbers meaningless)' if r['dry_run'] else ''}: {r['device']} ({r['backend']}), "
        f"{r['layers']}-layer stack {''.join('A' if x == 'attn' else 'G' for x in r['layer_types'])} at hidden {cfg['hidden_size']}, "
        f"E={cfg['num_experts']} top-{cfg['num_experts_per_tok']}, vocab {cfg['vocab_size']}, bf16 weights and KV, forward {r['forward']}",
        f"   measured copy bandwidth {r['bandwidth_gb_s']:.0f} GB/s; floor = bytes / bandwidth; 'must' counts the routed experts "
        f"the rows hit, 'impl' every expert (the engine's MoE is dense)",
        f"{'step':<8}{'n':>4}{'t':>3}{'ctx':>6}{'device ms':>11}{'engine ms':>11}{'floor must':>12}{'floor impl':>12}"
        f"{'x must':>8}{'x impl':>8}{'MB weights':>12}{'MB state':>10}{'MB KV':>9}{'MB logits':>10}",
    ]
    for s in r["steps"]:
        b = s["bytes"]
        lines.append(
            f"{s['step']:<8}{s['n']:>4}{s['t']:>3}{s['ctx']:>6}{s['device_ms']:>11.3f}{s['engine_ms']:>11.3f}{s['floor_must_ms']:>12.3f}"
            f"{s['floor_impl_ms']:>12.3f}{s['x_floor_must']:>8.1f}{s['x_floor_impl']:>8.1f}{b['weights_must'] / 1e6:>12.1f}"
            f"{b['state'] / 1e6:>10.2f}{b['kv'] / 1e6:>9.2f}{b['logits'] / 1e6:>10.2f}"
        )
    lines.append(
        f"{'  kernel (per layer)':<28}{'shape':<44}{'ms':>9}{'floor ms':>10}{'x floor':>9}{'x layers':>9}{'ms/step':>9}  result"
    )
    for s in r["steps"]:
        for k in s["kernels"]:
            shape = ",".join(f"{a}={v}" for a, v in k["shape"].items())
            lines.append(
                f"  {s['step']} n={s['n']} {k['kernel']:<14}{shape:<44}{k['ms']:>9.3f}{k['floor_ms']:>10.4f}{k['x_floor']:>9.1f}"
                f"{k['layers_per_step']:>9}{k['per_step_ms']:>9.3f}  {'ok' if k['ok'] else 'FAIL'} {k['note']}"
            )
    if r["refusals"]:
        lines.append("   kernel refusals (ran the reference): " + "; ".join(r["refusals"]))
    return "\n".join(lines)
