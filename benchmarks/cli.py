"""The benchmark entry point: `python -m benchmarks COMMAND [options]`, a Click group.

Commands:
- one per section (`hf`, `hf-45m`, `hf-300m`, `hf-0.8b`, `e2e`, `anatomy`, `compile`, `forwards`, `gap`, `slots`,
  `multiturn`, `invariant`, `roofline`): that section alone, with its own options (`benchmarks.sections`);
- `all`: several sections in one run, with every section's options: by default hf, hf-45m, hf-300m, hf-0.8b,
  e2e, anatomy, compile, forwards, gap, slots, multiturn, invariant (`make bench`, which also passes `--notes
  benchmarks/RESULTS.md`); `--sections` picks; `--smoke`: every section at tiny sizes; `--gpu`: the roofline;
- the probes (`benchmarks.probes`: step-times, thunk-profile, layout-ab, oracle-loop, small-m-products,
  moe-forms): one measurement each, printed, for the figures BUILD_NOTES.md cites; each runs pinned to one
  core.

A section run prints one table per section after a machine line (cores, load average before and after
each section, versions) and writes everything to one JSON file (`--json`, default out/bench.json),
rewritten after every section; `all --notes FILE` also writes the tables as markdown between the results
markers of FILE.

Presets (`settings.Preset`; each section's sizes are in its module):
- default: hf on tiny: prefill 128/512/2048, decode and verify n in 1/4/8, K in 2/3/4, 7 alternated
  repeats after 2 warm-up, then 7 alternated blocks of 8 back-to-back calls; hf-45m
  (qwen3-next-h512): prefill 128/1024/2048, n in 1/8, K 4, 3 repeats after 1 warm-up, 2-call blocks
  (decode and verify); hf-300m (qwen35-moe-h1024): the same with prefill 128; hf-0.8b (the Qwen3.5-0.8B
  stand-in of scripts/make_release_standin.sh, bf16 as released; skipped where it is absent): prefill
  256, n in 1/4, K 4; e2e: `small` at n in
  1/4/8 with 1..3 drafts and the 45 M width with oracle drafts at n in 1/8, 3 rounds; 50-step
  compile loop on tiny and on the 48-layer Qwen3-Next pattern, scan vs unrolled, 2 runs each in
  fresh processes;
- `--smoke`: tiny sizes and 1 repeat, every section including a roofline dry run (hf-300m on
  qwen35-moe-2L, its two-layer stand-in at tiny width), in-process, and the HF side only if its
  venv already exists (never created). The tests run `all --smoke`.
- `--gpu`: the roofline at Qwen3.5-35B-A3B width on an NVIDIA GPU; `--gpu --dry-run` the same
  path at tiny width under the interpreter, on any machine.

Threads (`metrale_jax.runtime_env`, applied when a section command runs, before jax is loaded; a
process that has already loaded jax keeps its environment): `--threads 1` (default) runs both
sides on one core each (this process pinned to its first allowed CPU, which sizes XLA's thread
pool to one; the HF driver pinned to the last, with torch.set_num_threads(1)), and
OPENBLAS/OMP/MKL_NUM_THREADS=1 for the BLAS/LAPACK both call: on a small shared machine a pool of
one thread per core stalls when the load exceeds the cores. `--threads 0` leaves every library
at its default; N >= 2 gives torch and the BLAS pools N threads and XLA its default pool.

NOTE: jax and the runner modules (which import jax) are imported inside the functions, after the
thread environment is set: XLA and OpenBLAS size their pools once, when they start. The section
modules import neither (`benchmarks.sections`); a probe's module is imported only when its command
runs, after the pinning (`ProbeGroup`).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import shlex
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

import click

from benchmarks import report
from benchmarks.report import log
from benchmarks.sections import DEFAULT, SECTIONS, SMOKE
from benchmarks.settings import Preset, Settings, resolve_step, strs
from metrale_jax import runtime_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROG = "python -m benchmarks"
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 120}

#: The options of every section command and of `all`.
COMMON = (
    click.Option(["--smoke"], is_flag=True, help="tiny sizes, 1 repeat, in-process (what the tests run)"),
    click.Option(
        ["--gpu"], is_flag=True, help="on an NVIDIA GPU (the roofline at full width; --dry-run: tiny, any machine)"
    ),
    click.Option(["--dry-run"], is_flag=True, help="with --gpu: tiny shapes under the interpreter"),
    click.Option(["--json", "json_path"], default=os.path.join(ROOT, "out", "bench.json"), help="where the JSON goes"),
    click.Option(["--workdir"], default=os.path.join(ROOT, "out", "bench"), help="checkpoint and driver logs"),
    click.Option(["--threads"], type=int, default=1, help="threads per side: 1 (default), 0 = library defaults, N"),
    click.Option(["--seed"], type=int, default=0),
)
#: The options of `all` alone.
ALL_ONLY = (
    click.Option(["--sections"], callback=strs, help=f"comma list of {','.join(SECTIONS)}"),
    click.Option(
        ["--notes"],
        type=click.Path(exists=True, dir_okay=False),
        default=None,
        help=f"write the tables as markdown between the {report.NOTES_BEGIN} / {report.NOTES_END} lines of this "
        "file (make bench: benchmarks/RESULTS.md)",
    ),
)

#: Probe command -> (its module, its one-line help); the module's `command` is loaded when it runs.
PROBES = {
    "step-times": ("benchmarks.probes.step_times", "device times of a model's decode and verify programs"),
    "thunk-profile": ("benchmarks.probes.thunk_profile", "the device time of each top-level op of a step program"),
    "layout-ab": ("benchmarks.probes.layout_ab", "the CPU engine's weight layouts and rows kernel side by side"),
    "oracle-loop": ("benchmarks.probes.oracle_loop", "a speculative step vs a greedy step, in the loop and alone"),
    "small-m-products": ("benchmarks.probes.small_m_products", "XLA's products of a few rows vs the rows kernel"),
    "moe-forms": ("benchmarks.probes.moe_forms", "the routed MoE block's three forms at given row counts"),
}


def _unique(options: Sequence[click.Option]) -> list[click.Parameter]:
    """`options` without repeats (sections share the step-shape options), first occurrence kept."""
    seen: dict[str | None, click.Parameter] = {}
    for o in options:
        seen.setdefault(o.name, o)
    return list(seen.values())


def resolve(a: Mapping[str, Any]) -> Settings:
    """Every setting the sections read: the options given (`a`; an option of another command is absent), with
    the preset's value where one is absent."""
    p = Preset(smoke=bool(a.get("smoke")), gpu=bool(a.get("gpu")), dry_run=bool(a.get("dry_run")))
    fields: dict[str, Any] = {}
    for module in dict.fromkeys(SECTIONS.values()):
        fields.update(module.resolve(a, p))
    return Settings(
        sections=a.get("sections") or (["roofline"] if p.gpu else SMOKE if p.smoke else DEFAULT),
        **resolve_step(a, p),
        **fields,
        workdir=a.get("workdir") or os.path.join(ROOT, "out", "bench"),
        threads=1 if a.get("threads") is None else a["threads"],
        seed=a.get("seed") or 0,
    )


def _command(opts: dict[str, Any], sections: list[str] | None) -> dict:
    """Set the thread environment, check the platform and the options, then run `sections` (None: `all`'s
    choice); returns the results."""
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
    cfg = resolve({**opts, "sections": sections or opts.get("sections")})
    unknown = set(cfg.sections) - set(SECTIONS)
    if unknown:
        raise click.UsageError(f"unknown section(s) {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    if opts.get("notes"):
        try:
            report.check_notes(opts["notes"])
        except ValueError as e:
            raise click.ClickException(str(e)) from None
    return _run(cfg, opts, list(click.get_current_context().meta.get("argv", sys.argv[1:])))


def _section_command(name: str) -> click.Command:
    help_line, options = SECTIONS[name].COMMANDS[name]
    return click.Command(
        name,
        params=_unique([*COMMON, *options]),
        callback=lambda **opts: _command(opts, [name]),
        help=f"The `{name}` section: {help_line}.",
        context_settings=CONTEXT,
    )


ALL = click.Command(
    "all",
    params=_unique([*COMMON, *ALL_ONLY, *(o for name, m in SECTIONS.items() for o in m.COMMANDS[name][1])]),
    callback=lambda **opts: _command(opts, None),
    help="Several sections in one run (default: every section but the roofline; `make bench`), with every "
    "section's options.",
    context_settings=CONTEXT,
)


class ProbeGroup(click.Group):
    """The group, with the probes' commands loaded when one runs: this process is pinned to one core first,
    then the probe's module (which loads jax) is imported."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [*super().list_commands(ctx), *PROBES]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in PROBES:
            return super().get_command(ctx, cmd_name)
        runtime_env.pin_to_one_core()
        return importlib.import_module(PROBES[cmd_name][0]).command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(n, c.get_short_help_str(90)) for n, c in self.commands.items()]
        with formatter.section("Commands"):
            formatter.write_dl([*rows, *((n, f"probe: {h}") for n, (_, h) in PROBES.items())])


group = ProbeGroup(
    PROG,
    commands=[ALL, *(_section_command(name) for name in SECTIONS)],
    help="Speed and compile cost of the engine, side by side with HF transformers and the HBM roofline.",
    context_settings=CONTEXT,
)


def parse(argv: Sequence[str]) -> dict[str, Any]:
    """The options of `all` with `argv`, with Click's conversions and defaults, without running anything."""
    with ALL.make_context("all", list(argv)) as ctx:
        return dict(ctx.params)


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
        log(f"section {name} (load {before})")
        try:
            res = run_section(name, cfg)
        except Exception as e:  # one broken section must not lose the others' numbers
            traceback.print_exc()
            res = {"error": f"{type(e).__name__}: {e}"}
            failed.append(name)
        res["wall_s"], res["cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
        results["sections"][name] = res
        results["load"][name] = {"before": before, "after": load_average()}
        save()  # after every section: a later failure keeps what was measured
        table = report.Table(f"{name}: FAILED: {res['error']}") if "error" in res else SECTIONS[name].table(res)
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
    log(f"wrote {json_path}")
    if opts.get("notes"):
        report.write_notes(opts["notes"], report.notes_markdown(shlex.join([*PROG.split(), *argv]), machine, tables))
        log(f"wrote the results section of {opts['notes']}")
    results["table"] = out
    return results


def run_section(name: str, cfg: Settings) -> dict:
    """Run one section with the settings `cfg` (`resolve`); returns its JSON dict."""
    return SECTIONS[name].run(name, cfg)


def run(argv: Sequence[str] | None = None) -> dict | None:
    """Parse `argv` (default: the process's arguments) and run its command; returns a section run's results
    (None for a probe). A usage error prints Click's message on stderr and exits (SystemExit), as a command
    line does."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        with group.make_context(PROG, list(args)) as ctx:  # Click consumes the list it parses
            ctx.meta["argv"] = args
            out = group.invoke(ctx)
    except click.exceptions.Exit as e:  # --help
        raise SystemExit(e.exit_code) from None
    except click.ClickException as e:
        e.show()
        raise SystemExit(e.exit_code) from None
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status 1 when a section failed (its error is in the table and the JSON)."""
    out = run(argv)
    return 1 if out and out["failed"] else 0
