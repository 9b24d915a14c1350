"""The benchmark entry point: `python -m benchmarks [options]` (`make bench`), a Click command.

Runs the sections (default: hf, hf-45m, hf-300m, e2e, compile, forwards, gap, slots; `--gpu`: the
roofline), prints one
table per section after a machine line (cores, load average before and after each section,
versions), writes everything to one JSON file (`--json`, default out/bench.json) and, with
`--notes FILE`, the tables as markdown between the results markers of FILE (`make bench`:
BUILD_NOTES.md).

Presets:
- default: hf on tiny: prefill 128/512/2048, decode and verify n in 1/4/8, K in 2/3/4, 7 alternated
  repeats after 2 warm-up, then 7 alternated blocks of 8 back-to-back calls; hf-45m
  (qwen3-next-h512): prefill 128/1024/2048, n in 1/8, K 4, 3 repeats after 1 warm-up, 2-call blocks
  (decode and verify); hf-300m (qwen35-moe-h1024): the same with prefill 128; e2e: `small` at n in
  1/4/8 with 1..3 drafts and the 45 M width with oracle drafts at n in 1/8, 3 rounds; 50-step
  compile loop on tiny and on the 48-layer Qwen3-Next pattern, scan vs unrolled, 2 runs each in
  fresh processes;
- `--smoke`: tiny sizes and 1 repeat, every section including a roofline dry run (hf-300m on
  qwen35-moe-2L, its two-layer stand-in at tiny width), in-process, and the HF side only if its
  venv already exists (never created). The tests run this.
- `--gpu`: the roofline at Qwen3.5-35B-A3B width on an NVIDIA GPU; `--gpu --dry-run` the same
  path at tiny width under the interpreter, on any machine.

Threads (`metrale_jax.runtime_env`, applied when the options are parsed, before jax is loaded;
a process that has already loaded jax keeps its environment): `--threads 1` (default) runs both
sides on one core each (this process pinned to its first allowed CPU, which sizes XLA's thread
pool to one; the HF driver pinned to the last, with torch.set_num_threads(1)), and
OPENBLAS/OMP/MKL_NUM_THREADS=1 for the BLAS/LAPACK both call: on a small shared machine a pool of
one thread per core stalls when the load exceeds the cores. `--threads 0` leaves every library
at its default; N >= 2 gives torch and the BLAS pools N threads and XLA its default pool.

NOTE: jax and the section modules (which import jax) are imported inside the functions, after
the thread environment is set: XLA and OpenBLAS size their pools once, when they start.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import click

from benchmarks import report
from benchmarks.settings import HFSizes, Settings
from metrale_jax import runtime_env

SECTIONS = ("hf", "hf-45m", "hf-300m", "e2e", "anatomy", "compile", "forwards", "gap", "slots", "multiturn", "roofline")
HF_SECTIONS = ("hf", "hf-45m", "hf-300m")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROG = "python -m benchmarks"


def _comma(kind: Callable[[str], Any]) -> Callable[[click.Context, click.Parameter, str | None], list | None]:
    """A Click callback: a comma list of `kind` values (None when the option is absent)."""

    def convert(ctx: click.Context, param: click.Parameter, value: str | None) -> list | None:
        if value is None:
            return None
        try:
            return [kind(x.strip()) for x in value.split(",") if x.strip()]
        except ValueError:
            raise click.BadParameter(f"expected a comma list, got {value!r}") from None

    return convert


_ints, _strs = _comma(int), _comma(str)


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


@click.command(name=PROG, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 120})
@click.option("--sections", callback=_strs, help=f"comma list of {','.join(SECTIONS)}")
@click.option("--smoke", is_flag=True, help="tiny sizes, 1 repeat, in-process (what the tests run)")
@click.option("--gpu", is_flag=True, help="the roofline on an NVIDIA GPU (with --dry-run: tiny, any machine)")
@click.option("--dry-run", is_flag=True, help="with --gpu: tiny shapes under the interpreter")
@click.option("--json", "json_path", default=os.path.join(ROOT, "out", "bench.json"), help="where the JSON goes")
@click.option(
    "--notes",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help=f"write the tables as markdown between the {report.NOTES_BEGIN} / {report.NOTES_END} lines of this file",
)
@click.option("--workdir", default=os.path.join(ROOT, "out", "bench"), help="checkpoint and driver logs")
@click.option("--threads", type=int, default=1, help="threads per side: 1 (default), 0 = library defaults, N")
@click.option("--repeats", type=int, help="timed repeats per case (default 7; smoke 1)")
@click.option("--warmup", type=int, help="untimed calls per side first (default 2, hf-45m and hf-300m 1; smoke 0)")
@click.option(
    "--block",
    type=int,
    help="hf sections: back-to-back calls per side and round (default 8, hf-45m and hf-300m 2; smoke 2)",
)
@click.option("--seed", type=int, default=0)
@click.option(
    "--model",
    help="hf, forwards, gap: a preset, tiny-2L, qwen3-next-<L>L[-i<n>] or a checkpoint directory "
    "(default tiny; smoke tiny-2L)",
)
@click.option("--prefill-lens", callback=_ints, help="hf: default 128,512,2048")
@click.option("--ns", callback=_ints, help="hf: sequences per decode/verify step, default 1,4,8")
@click.option("--ks", callback=_ints, help="hf: verify rows per sequence, default 2,3,4")
@click.option("--ctx", type=int, help="hf: context tokens before decode/verify, default 128")
@click.option(
    "--hf-impl",
    type=click.Choice(["default", "eager"]),
    default="default",
    help="hf: HF attention/experts implementations: from_pretrained's defaults or eager",
)
@click.option(
    "--wide-prefill-lens", callback=_ints, help="hf-45m, hf-300m: prefill lengths (default 128,1024,2048; 128)"
)
@click.option("--wide-ns", callback=_ints, help="hf-45m, hf-300m: sequences per decode/verify step, default 1,8")
@click.option("--wide-ks", callback=_ints, help="hf-45m, hf-300m: verify rows per sequence, default 4")
@click.option("--wide-repeats", type=int, help="hf-45m, hf-300m: timed repeats per case (default 3)")
@click.option("--multiturn-model", help="multiturn: the model (default qwen3-next-h512; smoke tiny-2L)")
@click.option("--multiturn-conversations", type=int, help="multiturn: conversations (default 4; smoke 2)")
@click.option("--multiturn-turns", type=int, help="multiturn: turns per conversation (default 4; smoke 2)")
@click.option("--e2e-ns", callback=_ints, help="e2e: prompts generated together on small, default 1,4,8 ('': none)")
@click.option("--e2e-drafts", callback=_ints, help="e2e: drafts per verify on small, default 1,2,3")
@click.option("--e2e-new-tokens", type=int, help="e2e: tokens per prompt on small, default 96")
@click.option("--e2e-oracle-model", help="e2e: the model run with oracle drafts, default qwen3-next-h512")
@click.option(
    "--e2e-oracle-ns", callback=_ints, help="e2e: prompts generated together with oracle drafts, default 1,8 ('': none)"
)
@click.option("--e2e-oracle-new-tokens", type=int, help="e2e: tokens per prompt with oracle drafts, default 48")
@click.option("--e2e-accept", type=float, default=0.8, help="e2e: the oracle's chance a draft position is right")
@click.option("--e2e-rounds", type=int, help="e2e: timed rounds, default 3")
@click.option("--no-hf-setup", is_flag=True, help="hf: never create the HF venv (skip the section if absent)")
@click.option("--forward-steps", callback=_strs, help="forwards: steps, default prefill,decode,verify")
@click.option("--compile-models", callback=_strs, help="compile: default tiny,qwen3-next-48L (smoke: qwen3-next-4L-i2)")
@click.option("--compile-steps", type=int, help="compile: verify-loop steps, default 50")
@click.option("--compile-repeats", type=int, help="compile: runs per case, default 2")
@click.option("--no-isolate", is_flag=True, help="compile: measure the cases in this process")
@click.option("--gaps-ms", callback=_ints, help="gap: idle gaps before each verify call, default 0,2,8 (smoke 0,1)")
@click.option("--gap-calls", type=int, help="gap: timed calls per gap and round, default 40 (smoke 2)")
@click.option("--gap-rounds", type=int, help="gap: rounds over the gaps, default 3 (smoke 1)")
@click.option("--slots-model", help="slots: default qwen3-next-48L (smoke qwen3-next-4L-i2)")
@click.option("--slot-counts", callback=_ints, help="slots: engines' slot counts (max batch), default 8,64 (smoke 2,8)")
@click.option("--slots-iters", type=int, help="slots: timed runs per step, default 50 (smoke 2)")
@click.option("--roofline-layers", type=int, help="roofline: default 8 (two 3:1 groups); dry run 4")
@click.option("--roofline-ctx", type=int, help="roofline: cached tokens per sequence, default 2048")
@click.option("--roofline-decode-ns", callback=_ints, help="roofline: default 1,8,32")
@click.option("--roofline-verify-ns", callback=_ints, help="roofline: default 8,32")
@click.option("--roofline-k", type=int, help="roofline: verify rows per sequence, default 4")
@click.option("--roofline-iters", type=int, help="roofline: timed runs per step, default 20")
@click.pass_context
def command(context: click.Context, **opts: Any) -> dict:
    """Speed and compile cost of the engine, side by side with HF transformers and the HBM roofline."""
    real_gpu = opts["gpu"] and not opts["dry_run"]
    if "jax" not in sys.modules:
        if opts["threads"] == 1 and not real_gpu:
            runtime_env.pin_to_one_core()
        if not real_gpu:
            runtime_env.prepare(
                threads=opts["threads"], pools=runtime_env.BLAS_POOLS, cpu_only=True, compilation_cache=False
            )
    import jax

    if real_gpu and jax.default_backend() != "gpu":
        raise click.UsageError(
            f"--gpu needs an NVIDIA GPU (default backend {jax.default_backend()!r}); "
            "`--gpu --dry-run` checks the same path with tiny shapes on any machine"
        )
    cfg = _resolve(opts)
    unknown = set(cfg.sections) - set(SECTIONS)
    if unknown:
        raise click.UsageError(f"unknown section(s) {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    if opts["notes"]:
        try:
            report.check_notes(opts["notes"])
        except ValueError as e:
            raise click.ClickException(str(e)) from None
    return _run(cfg, opts, list(context.meta.get("argv", sys.argv[1:])))


def parse(argv: Sequence[str]) -> dict[str, Any]:
    """The options of `argv` with Click's conversions and defaults, without running anything."""
    with command.make_context(PROG, list(argv)) as ctx:
        return dict(ctx.params)


def _resolve(a: dict[str, Any]) -> Settings:
    """Every setting the sections read: the options, with the preset's value where one is absent."""
    smoke, gpu = a["smoke"], a["gpu"]
    dry = a["dry_run"] or smoke
    tiny_roofline = dry or not gpu

    def d(v, full, small):
        return v if v is not None else (small if smoke else full)

    default_sections = (
        ["hf", "hf-300m", "e2e", "anatomy", "compile", "forwards", "gap", "slots", "multiturn", "roofline"]
        if smoke
        else ["hf", "hf-45m", "hf-300m", "e2e", "anatomy", "compile", "forwards", "gap", "slots", "multiturn"]
    )
    return Settings(
        model=d(a["model"], "tiny", "tiny-2L"),
        forward_steps=d(a["forward_steps"], ["prefill", "decode", "verify"], ["verify"]),
        sections=a["sections"] or (["roofline"] if gpu else default_sections),
        repeats=d(a["repeats"], 7, 1),
        warmup=d(a["warmup"], 2, 0),
        block=d(a["block"], 8, 2),
        prefill_lens=d(a["prefill_lens"], [128, 512, 2048], [16]),
        ns=d(a["ns"], [1, 4, 8], [1]),
        ks=d(a["ks"], [2, 3, 4], [2]),
        ctx=d(a["ctx"], 128, 16),
        prefill_b2b=True,
        wide=_wide(a),
        compile_models=d(a["compile_models"], ["tiny", "qwen3-next-48L"], ["qwen3-next-4L-i2"]),
        compile_steps=d(a["compile_steps"], 50, 5),
        compile_repeats=d(a["compile_repeats"], 2, 1),
        isolate=not (a["no_isolate"] or smoke),
        roofline_dry=tiny_roofline,
        roofline_layers=a["roofline_layers"] or (4 if tiny_roofline else 8),
        roofline_ctx=a["roofline_ctx"] or (24 if tiny_roofline else 2048),
        roofline_decode_ns=a["roofline_decode_ns"]
        if a["roofline_decode_ns"] is not None
        else ([] if smoke else [1] if tiny_roofline else [1, 8, 32]),
        roofline_verify_ns=a["roofline_verify_ns"] or ([2] if tiny_roofline else [8, 32]),
        roofline_k=a["roofline_k"] or (2 if tiny_roofline else 4),
        roofline_iters=a["roofline_iters"] or (1 if tiny_roofline else 20),
        gaps_ms=d(a["gaps_ms"], [0, 2, 8], [0, 1]),
        gap_calls=d(a["gap_calls"], 40, 2),
        gap_rounds=d(a["gap_rounds"], 3, 1),
        slots_model=d(a["slots_model"], "qwen3-next-48L", "qwen3-next-4L-i2"),
        slot_counts=d(a["slot_counts"], [8, 64], [2, 8]),
        slots_iters=d(a["slots_iters"], 50, 2),
        multiturn_model=d(a["multiturn_model"], "qwen3-next-h512", "tiny-2L"),
        multiturn_conversations=d(a["multiturn_conversations"], 4, 2),
        multiturn_turns=d(a["multiturn_turns"], 4, 2),
        multiturn_system_len=384 if not smoke else 40,
        multiturn_user_len=48 if not smoke else 9,
        multiturn_new_tokens=16 if not smoke else 4,
        multiturn_block=16,
        multiturn_chunk=256 if not smoke else 32,
        e2e_ns=d(a["e2e_ns"], [1, 4, 8], [1]),
        e2e_drafts=d(a["e2e_drafts"], [1, 2, 3], [1]),
        e2e_new_tokens=d(a["e2e_new_tokens"], 96, 8),
        e2e_prompt_len=64 if not smoke else 16,
        e2e_oracle_model=d(a["e2e_oracle_model"], "qwen3-next-h512", "tiny-2L"),
        e2e_oracle_ns=d(a["e2e_oracle_ns"], [1, 8], [2]),
        e2e_oracle_drafts=[3] if not smoke else [2],
        e2e_oracle_new_tokens=d(a["e2e_oracle_new_tokens"], 48, 8),
        e2e_accept=a["e2e_accept"],
        e2e_rounds=d(a["e2e_rounds"], 3, 1),
        anatomy_model=d(None, "small", "tiny"),
        anatomy_dot_model=d(None, "qwen3-next-h512", "tiny"),
        anatomy_drafts=d(None, [1, 2, 3], [1]),
        anatomy_iters=d(None, 50, 2),
        anatomy_ms=d(None, [1, 2, 4, 8, 16, 32], [1, 8]),
        anatomy_repeats=d(None, 3, 1),
        hf_create=not (a["no_hf_setup"] or smoke),
        workdir=a["workdir"],
        threads=a["threads"],
        hf_impl=a["hf_impl"],
        seed=a["seed"],
    )


def _wide(a: dict[str, Any]) -> dict[str, HFSizes]:
    """The realistic-width hf sections' models and sizes (`--wide-*` override every one); with `--smoke`
    their stand-ins at tiny width and tiny sizes."""
    if a["smoke"]:
        presets = {
            name: HFSizes(model, [16], [1], [2], 1, 0, 2, True)
            for name, model in (("hf-45m", "tiny-2L"), ("hf-300m", "qwen35-moe-2L"))
        }
    else:
        presets = {
            "hf-45m": HFSizes("qwen3-next-h512", [128, 1024, 2048], [1, 8], [4], 3, 1, 2, False),
            "hf-300m": HFSizes("qwen35-moe-h1024", [128], [1, 8], [4], 3, 1, 2, False),
        }
    given = {
        "prefill_lens": a["wide_prefill_lens"],
        "ns": a["wide_ns"],
        "ks": a["wide_ks"],
        "repeats": a["wide_repeats"],
        "warmup": a["warmup"],
        "block": a["block"],
    }
    over = {k: v for k, v in given.items() if v is not None}
    return {name: dataclasses.replace(w, **over) for name, w in presets.items()}


def _run(cfg: Settings, opts: dict[str, Any], argv: list[str]) -> dict:
    """Run the sections, print the tables, write the JSON (and the notes); returns the results."""
    from benchmarks.timing import load_average, machine_info

    json_path = opts["json_path"]
    os.makedirs(cfg.workdir, exist_ok=True)
    info = machine_info()
    info.update(
        threads=cfg.threads,
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        argv=argv,
        **{v.lower(): os.environ.get(v) for v in runtime_env.BLAS_POOLS},
    )
    results: dict = {"machine": info, "settings": dataclasses.asdict(cfg), "sections": {}, "load": {}}
    tables: list[report.Table] = []
    failed: list[str] = []

    def save() -> None:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1, default=float)

    for name in cfg.sections:
        before = load_average()
        t0, c0 = time.perf_counter(), time.process_time()
        _log(f"section {name} (load {before})")
        try:
            res = _section(name, cfg)
        except Exception as e:  # one broken section must not lose the others' numbers
            traceback.print_exc()
            res = {"error": f"{type(e).__name__}: {e}"}
            failed.append(name)
        res["wall_s"], res["cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
        results["sections"][name] = res
        results["load"][name] = {"before": before, "after": load_average()}
        save()  # after every section: a later failure keeps what was measured
        table = report.Table(f"{name}: FAILED: {res['error']}") if "error" in res else report.TABLES[name](res)
        tables.append(
            table.with_footer(
                f"(load average before/after: {before} / {results['load'][name]['after']}; "
                f"{res['wall_s']:.0f} s wall, {res['cpu_s']:.0f} s CPU in this process)"
            )
        )
    results["failed"] = failed
    save()
    machine = report.machine_line(info)
    out = "\n\n".join([machine, *(t.text() for t in tables)])
    print(out, flush=True)
    _log(f"wrote {json_path}")
    if opts["notes"]:
        report.write_notes(opts["notes"], report.notes_markdown(shlex.join([*PROG.split(), *argv]), machine, tables))
        _log(f"wrote the results section of {opts['notes']}")
    results["table"] = out
    return results


def _section(name: str, cfg: Settings) -> dict:
    """Run one section with the settings `cfg` (`_resolve`); returns its JSON dict."""
    from benchmarks import anatomy, compile_cost, e2e, forwards, idle_gap, multiturn, roofline, slot_scaling, vs_hf
    from benchmarks.hf_env import ensure_hf_venv

    if name in HF_SECTIONS:
        python, why = ensure_hf_venv(create=cfg.hf_create)
        if python is None:
            _log(f"HF comparison skipped: {why}")
            return {"skipped": why}
        return vs_hf.run(cfg.hf_section(name), python)
    if name == "compile":
        return compile_cost.run(cfg, log=_log)
    runs: dict[str, Callable[[Settings], dict]] = {
        "e2e": e2e.run,
        "anatomy": anatomy.run,
        "forwards": forwards.run,
        "gap": idle_gap.run,
        "slots": slot_scaling.run,
        "multiturn": multiturn.run,
        "roofline": roofline.run,
    }
    return runs[name](cfg)


def run(argv: Sequence[str] | None = None) -> dict:
    """Parse `argv` (default: the process's arguments) and run; returns the results dict. A usage
    error prints Click's message on stderr and exits (SystemExit), as a command line does."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        with command.make_context(PROG, list(args)) as ctx:  # Click consumes the list it parses
            ctx.meta["argv"] = args
            out = command.invoke(ctx)
    except click.exceptions.Exit as e:  # --help
        raise SystemExit(e.exit_code) from None
    except click.ClickException as e:
        e.show()
        raise SystemExit(e.exit_code) from None
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status 1 when a section failed (its error is in the table and the JSON)."""
    return 1 if run(argv)["failed"] else 0
