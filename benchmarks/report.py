"""The benchmark results as tables: one `Table` per section, rendered as text (stdout) or markdown
(the results section of BUILD_NOTES.md).

Owns: `Table` (a section's title, notes, column grids and footer), one `*_table(result)` per
section (from the JSON dict the section returns), `machine_line`, and `write_notes` (the
markdown between the two marker lines of a notes file).

Invariants:
- Every timing is shown as its median with the (min-max) of the repeats; every ratio as the
  ratio of the medians with the quartiles (p25-p75) of the per-round ratios of the alternated
  runs.
- Text and markdown render the same cells (`metrale_jax.text_table`); only the framing differs.
- `write_notes` replaces only what lies between `NOTES_BEGIN` and `NOTES_END`, atomically (a
  temporary file renamed over the original), and refuses a file without both markers.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Sequence

from metrale_jax.text_table import markdown_table, text_table

# |JAX - HF| logits above this (relative to the largest |logit|, at least 1) mark a logit row; most
# rows of a case over it: the two sides did not run the same model (float32 parity is far below it).
# A few rows over it: one sequence's top-k expert choice flipped where two router logits of a token
# are within float32 rounding of each other (random weights make such near-ties likely over many
# routing decisions); that sequence's rows then differ while the others agree.
LOGIT_TOLERANCE = 1e-3

NOTES_BEGIN = "<!-- bench:results:begin -->"
NOTES_END = "<!-- bench:results:end -->"


@dataclasses.dataclass(frozen=True)
class Grid:
    """Columns of cells; every column but those in `left` is right-aligned."""

    headers: Sequence[str]
    rows: Sequence[Sequence[str]]
    left: Sequence[int] = (0,)

    @property
    def right(self) -> list[int]:
        return [i for i in range(len(self.headers)) if i not in self.left]


@dataclasses.dataclass(frozen=True)
class Table:
    """One section's results: a one-line title, note lines, grids, footer lines."""

    title: str
    notes: Sequence[str] = ()
    grids: Sequence[Grid] = ()
    footer: Sequence[str] = ()

    def with_footer(self, *lines: str) -> Table:
        return dataclasses.replace(self, footer=(*self.footer, *lines))

    def text(self) -> str:
        out = [f"== {self.title}", *(f"   {n}" for n in self.notes)]
        for g in self.grids:
            out += text_table(g.headers, g.rows, right=g.right)
        return "\n".join(out + [f"   {f}" for f in self.footer])

    def markdown(self) -> str:
        """The title as a heading, the notes and the footer as one bullet, then the grids."""
        out = [f"#### {self.title}"]
        if self.notes or self.footer:
            out.append("- " + "; ".join([*self.notes, *self.footer]))
        out.append("")
        for g in self.grids:
            out += [*markdown_table(g.headers, g.rows, right=g.right), ""]
        return "\n".join(out).rstrip("\n")


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


def _b2b(c: dict, key: str) -> str:
    """A back-to-back cell: the median in ms, or '-' where the case was timed call by call only."""
    return f"{1e3 * c[key]['median']:.3f}" if c[key]["n"] else "-"


def hf_table(r: dict) -> Table:
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
                _mm(c["jax"]),
                f"{1e3 * c.get('jax_device_s', float('nan')):.3f}",
                _mm(c["hf"]),
                f"{c['ratio_of_medians']:.3f}",
                _q(c["ratio"]),
                f"{c['hf_over_jax']:.1f}x",
                _b2b(c, "jax_b2b"),
                _b2b(c, "hf_b2b"),
                f"{c['hf_over_jax_b2b']:.1f}x" if timed_b2b else "-",
                _inv_q(c["ratio_b2b"]) if timed_b2b else "-",
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
        "CPU float32",
        notes=tuple(notes),
        grids=tuple(grids),
    )


def compile_table(r: dict) -> Table:
    rows = []
    for c in r["cases"]:
        sr = c["program_compile_s"].get("step_rows", {"median": float("nan")})
        rows.append(
            (
                c["model"],
                str(c["layers"]),
                str(c["groups"]),
                c["layout"] if c["groups"] > 1 else "one group",
                f"{c['engine_init_s']['median']:.1f}",
                _mm(c["time_to_first_step_s"], 1, ".1f"),
                f"{c['prefill_first_s']['median']:.1f}",
                f"{c['first_step_s']['median']:.1f}",
                f"{sr['median']:.1f}",
                f"{c['steady_step_ms']:.1f}",
                "/".join(str(x) for x in c["compilations"]),
                str(c["recompiles_after_warmup"] + c["backend_compiles_after_warmup"]),
            )
        )
    headers = (
        "model",
        "layers",
        "groups",
        "layout",
        "init",
        "time to first step",
        "prefill 1st",
        "loop step 1",
        "verify compile",
        "steady ms",
        "compiles",
        "after warm-up",
    )
    footer = []
    by = {(c["model"], c["layout"]): c for c in r["cases"]}
    for (m, layout), c in by.items():
        if layout == "scan" and (m, "unrolled") in by:
            u = by[(m, "unrolled")]
            first = u["time_to_first_step_s"]["median"] / c["time_to_first_step_s"]["median"]
            compiles = ", ".join(
                f"{p} compile {u['program_compile_s'][p]['median']:.1f} s -> "
                f"{c['program_compile_s'][p]['median']:.1f} s"
                for p in ("prefill_chunk", "step_rows", "propose")
                if p in c["program_compile_s"] and p in u["program_compile_s"]
            )
            footer.append(f"{m}: unrolled/scan time to first step {first:.2f}x; {compiles}")
    isolated = ", each in a fresh process" if r["isolated"] else ""
    return Table(
        f"Compile cost: {r['steps']}-step ragged verify loop (propose, verify K in {{1..4}} ragged, stash, fold, "
        f"commit), {r['repeats']} run(s) each{isolated}; seconds: median (min-max)",
        notes=(
            "time to first step = the engine's first prefill + the loop's first step (engine construction apart: "
            "'init')",
        ),
        grids=(Grid(headers, rows, left=(0, 3)),),
        footer=footer,
    )


def forwards_table(r: dict) -> Table:
    rows = [
        (
            c["step"],
            str(c["n"]),
            str(c["t"]),
            _mm(c["pallas"]),
            _mm(c["xla"]),
            f"{c['ratio_of_medians']:.2f}",
            _q(c["ratio"]),
            f"{c['first_call_s']['pallas']:.1f} / {c['first_call_s']['xla']:.1f}",
            f"{c['max_abs_diff']:.1e}",
        )
        for c in r["cases"]
    ]
    headers = (
        "step",
        "n",
        "T/K",
        "pallas ms",
        "xla ms",
        "pallas/xla",
        "per-round",
        "1st call s pallas/xla",
        "|dlogit|",
    )
    kernels = "interpreter" if r["interpret"] else "compiled kernels"
    footer = ["kernel refusals (ran the reference): " + "; ".join(r["refusals"])] if r["refusals"] else []
    return Table(
        f"Forwards: pallas ({kernels}) vs xla, model {r['model']}, context {r['context_tokens']} tokens; ms: "
        "median (min-max); pallas/xla = ratio of medians (p25-p75 per round)",
        grids=(Grid(headers, rows),),
        footer=footer,
    )


def gap_table(r: dict) -> Table:
    base = r["gaps"][0]["best_median_s"]
    rows = [
        (
            f"{1e3 * g['gap_s']:.0f}",
            f"{1e3 * g['best_median_s']:.3f}",
            f"{g['best_median_s'] / base:.2f}",
            " ".join(f"{1e3 * x:.3f}" for x in g["round_medians_s"]),
        )
        for g in r["gaps"]
    ]
    return Table(
        f"Idle gap before a call: the engine's verify step (n={r['n']}, K={r['k']}, context "
        f"{r['context_tokens']} tokens, model {r['model']}), {r['calls']} calls per gap and round, best of "
        f"{r['rounds']} round medians",
        grids=(Grid(("gap ms", "ms", "x first", "round medians ms"), rows, left=(3,)),),
    )


def slots_table(r: dict) -> Table:
    base = r["rows"][0]
    rows = [
        (
            str(row["slots"]),
            f"{row['gdn_state_bytes'] / 1e6:.2f}",
            f"{1e3 * row['decode_s']:.3f}",
            f"{row['decode_s'] / base['decode_s']:.2f}",
            f"{1e3 * row['verify_s']:.3f}",
            f"{row['verify_s'] / base['verify_s']:.2f}",
            str(sum(row["pool_copies"].values())),
        )
        for row in r["rows"]
    ]
    headers = ("slots", "GDN state MB", "decode ms", "x first", "verify ms", "x first", "pool copies")
    return Table(
        f"Slots: one sequence's step (context {r['context_tokens']} tokens, verify K={r['k']}, model "
        f"{r['model']}) against the engine's slot count; compiled programs alone, median of {r['iters']}",
        grids=(Grid(headers, rows, left=()),),
    )


def roofline_table(r: dict) -> Table:
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


#: The table of each section, by section name.
def e2e_table(r: dict) -> Table:
    rows = []
    for c in r["rows"]:
        drafter = f"oracle p={c['accept']:g}" if c["drafter"] == "oracle" else c["drafter"]
        rows.append(
            (
                c["model"],
                drafter,
                str(c["n"]),
                str(c["new_tokens"]),
                str(c["drafts"]),
                c["mode"],
                _mm(c["greedy_tok_s"], 1, ".0f"),
                _mm(c["spec_tok_s"], 1, ".0f"),
                f"{c['ratio']['median']:.2f}x",
                _q(c["ratio"]),
                f"{c['tokens_per_verify_per_seq']:.2f}",
                str(c["verify_steps"]),
                "yes" if c["same_tokens"] else "NO",
                f"{c['greedy_first_s']:.1f} / {c['spec_first_s']:.1f}",
            )
        )
    headers = (
        "model",
        "drafts from",
        "n",
        "new",
        "drafts",
        "mode",
        "greedy tok/s",
        "speculative tok/s",
        "spec/greedy",
        "per-round",
        "tokens/verify/seq",
        "verifies",
        "same tokens",
        "1st call s greedy/spec",
    )
    return Table(
        f"End to end: speculative vs plain greedy generation, steady-state tokens/s, {r['rounds']} rounds "
        f"alternated after a warm-up call each; prompts of {r['prompt_len']} tokens",
        notes=(
            "tok/s: median (min-max) over the rounds, from a call's progress report after the prefill to its last "
            "(prefill and compilation excluded; '1st call': the warm-up call, compilation included)",
            "spec/greedy: median (p25-p75) of the per-round ratios; greedy on a non-speculative engine, each draft "
            "count on its own speculative engine (num_drafts = drafts, default K ladder); fused = one program per "
            "scheduler step, composed = verify, stash, fold, commit, propose one by one; oracle = the greedy "
            "continuation replayed, each draft position right with probability p (seeded)",
        ),
        grids=(Grid(headers, rows, left=(0, 1, 5, 12)),),
    )


def anatomy_table(r: dict) -> Table:
    programs = [
        (
            p["engine"],
            p["step"],
            p["program"],
            str(p["launches"]),
            f"{1e3 * p['device_s']:.3f}",
            f"{p['us_per_launch']:.2f}",
        )
        for p in r["programs"]
    ]
    dots = [
        (
            d["layout"],
            str(d["m"]),
            f"{1e3 * d['cold_s']:.3f}",
            f"{d['cold_gb_s']:.1f}",
            f"{1e3 * d['warm_s']:.3f}",
            f"{d['warm_gb_s']:.1f}",
        )
        for d in r["dots"]
    ]
    out_dim, in_dim = r["dot_shape"]
    return Table(
        f"Anatomy of a step: the programs a generation step runs on {r['model']}, and this core's matrix products "
        f"at a step's row counts ({r['dot_model']}'s expert gate/up rows, [{out_dim}, {in_dim}] float32)",
        notes=(
            "launches: top-level kernels of the program's entry computation (ProgramInfo.launches); device ms: the "
            "compiled program alone on its captured arguments, median (pool donated and fed back); us/launch = the two",
            "products: linear(x [M, in], w), w in the checkpoint's [out, in] layout and input-major [in, out] "
            "(linear.TransposedWeight, what the single-device CPU engine runs); 'from memory': a different weight each "
            "call (their total past any cache, as in a real step), 'in cache': one weight re-read; GB/s of weight read "
            "per call",
        ),
        grids=(
            Grid(("engine", "step", "program", "launches", "device ms", "us/launch"), programs, left=(0, 1, 2)),
            Grid(("weight", "M", "from memory ms", "GB/s", "in cache ms", "GB/s "), dots),
        ),
    )


def multiturn_table(r: dict) -> Table:
    modes = r["modes"]
    turns = len(modes["cached"]["ttft_median_s"])
    rows = [
        (
            name,
            str(m["prompt_tokens"]),
            str(m["prefill_tokens"]),
            f"{100 * m['saved']:.0f}%",
            f"{100 * m['hit_rate']:.0f}%",
            " ".join(f"{1e3 * x:.1f}" for x in m["ttft_median_s"]),
            f"{m['ttft_total_s']:.2f}",
        )
        for name, m in modes.items()
    ]
    headers = (
        "prefix cache",
        "prompt tok",
        "prefilled tok",
        "saved",
        "hit rate",
        f"TTFT ms, turns 1..{turns}",
        "TTFT s",
    )
    return Table(
        f"Multi-turn: {r['conversations']} conversations x {r['turns']} turns (system prompt {r['system_len']}, "
        f"user {r['user_len']}, {r['new_tokens']} generated per turn; block {r['block_size']}, prefill chunk "
        f"{r['prefill_chunk']}), model {r['model']}; TTFT = a turn's prefill, median per turn index; same tokens "
        f"with and without the cache: {'yes' if r['same_tokens'] else 'NO'}",
        grids=(Grid(headers, rows, left=(0,)),),
    )


TABLES = {
    "hf": hf_table,
    "hf-45m": hf_table,
    "hf-300m": hf_table,
    "e2e": e2e_table,
    "anatomy": anatomy_table,
    "compile": compile_table,
    "forwards": forwards_table,
    "gap": gap_table,
    "slots": slots_table,
    "multiturn": multiturn_table,
    "roofline": roofline_table,
}


def notes_markdown(command: str, machine: str, tables: Sequence[Table]) -> str:
    """The results section's body: how it was made, the machine line, then every table."""
    head = f"Written by `{command}` (`make bench`; not edited by hand). {machine}"
    return "\n\n".join([head, *(t.markdown() for t in tables)])


def _split_notes(text: str, path: str) -> tuple[str, str]:
    """(everything up to and including the begin marker's line, the end marker's line onwards)."""
    lines = text.splitlines(keepends=True)
    begin = [i for i, x in enumerate(lines) if x.strip() == NOTES_BEGIN]
    end = [i for i, x in enumerate(lines) if x.strip() == NOTES_END]
    if len(begin) != 1 or len(end) != 1 or begin[0] > end[0]:
        raise ValueError(f"{path} needs one line {NOTES_BEGIN} followed by one line {NOTES_END}; not written")
    return "".join(lines[: begin[0] + 1]), "".join(lines[end[0] :])


def check_notes(path: str) -> None:
    """Raise ValueError (one line) unless `path` holds both marker lines, in order."""
    with open(path) as f:
        _split_notes(f.read(), path)


def write_notes(path: str, body: str) -> None:
    """Replace what lies between the markers of `path` with `body` (see the module invariants)."""
    with open(path) as f:
        before, after = _split_notes(f.read(), path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".bench-notes-", suffix=".md")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(before + body.rstrip("\n") + "\n" + after)
        os.chmod(tmp, os.stat(path).st_mode & 0o777)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
