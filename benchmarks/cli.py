"""The benchmark entry point: `python -m benchmarks [options]` (`make bench`).

Runs the sections (default: hf, compile, forwards, gap, slots; `--gpu`: the roofline), prints one table per
section after a machine line (cores, load average before and after each section, versions) and
writes everything to one JSON file (`--json`, default out/bench.json).

Presets:
- default: the issue's sizes (prefill 128/512/2048, decode and verify n in 1/4/8, K in 2/3/4,
  7 alternated repeats after 2 warm-up, then 7 alternated blocks of 8 back-to-back calls;
  50-step compile loop on tiny and on the 48-layer Qwen3-Next pattern, scan vs unrolled, 2 runs
  each in fresh processes);
- `--smoke`: tiny sizes and 1 repeat, every section including a roofline dry run, in-process,
  and the HF side only if its venv already exists (never created). The tests run this.
- `--gpu`: the roofline at Qwen3.5-35B-A3B width on an NVIDIA GPU; `--gpu --dry-run` the same
  path at tiny width under the interpreter, on any machine.

Threads: `--threads 1` (default) runs both sides on one core each (the engine's process pinned
to the first allowed CPU, which sizes XLA's thread pool to one; the HF driver pinned to the last,
with torch.set_num_threads(1)), and OPENBLAS/OMP/MKL_NUM_THREADS=1 for the BLAS/LAPACK both call: on
a shared 2-core machine a 2-thread pool (torch's OpenMP, the OpenBLAS under jaxlib's LAPACK
calls) stalls 10-1000x when the load exceeds the cores. `--threads 0` leaves every library at its
default; N >= 2 gives torch and the BLAS pools N threads and XLA its default pool. Applied in
`benchmarks/__main__.py`, before jax starts (so only through `python -m benchmarks`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import jax

from benchmarks import report
from benchmarks.timing import load_average, machine_info

SECTIONS = ("hf", "compile", "forwards", "gap", "slots", "roofline")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _strs(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    ap.add_argument("--sections", type=_strs, default=None, help=f"comma list of {','.join(SECTIONS)}")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 1 repeat, in-process (what the tests run)")
    ap.add_argument(
        "--gpu", action="store_true", help="the roofline on an NVIDIA GPU (with --dry-run: tiny, any machine)"
    )
    ap.add_argument("--dry-run", action="store_true", help="with --gpu: tiny shapes under the interpreter")
    ap.add_argument("--json", default=os.path.join(ROOT, "out", "bench.json"), help="where the JSON goes")
    ap.add_argument("--workdir", default=os.path.join(ROOT, "out", "bench"), help="checkpoint and driver logs")
    ap.add_argument("--threads", type=int, default=1, help="threads per side: 1 (default), 0 = library defaults, N")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per case (default 7; smoke 1)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls per side first (default 2; smoke 0)")
    ap.add_argument(
        "--block", type=int, default=None, help="hf: back-to-back calls per side and round (default 8; smoke 2)"
    )
    ap.add_argument("--seed", type=int, default=0)
    g = ap.add_argument_group("hf")
    g.add_argument(
        "--model",
        default=None,
        help="model of the hf and forwards sections: a preset, tiny-2L, qwen3-next-<L>L[-i<n>] or a checkpoint "
        "directory (default tiny; smoke tiny-2L)",
    )
    g.add_argument("--prefill-lens", type=_ints, default=None, help="default 128,512,2048")
    g.add_argument("--ns", type=_ints, default=None, help="sequences per decode/verify step, default 1,4,8")
    g.add_argument("--ks", type=_ints, default=None, help="verify rows per sequence, default 2,3,4")
    g.add_argument("--ctx", type=int, default=None, help="context tokens before decode/verify, default 128")
    g.add_argument(
        "--hf-impl",
        default="default",
        choices=("default", "eager"),
        help="HF attention/experts implementations: from_pretrained's defaults or eager",
    )
    g.add_argument("--no-hf-setup", action="store_true", help="never create the HF venv (skip the section if absent)")
    g.add_argument(
        "--forward-steps", type=_strs, default=None, help="forwards section steps, default prefill,decode,verify"
    )
    g = ap.add_argument_group("compile")
    g.add_argument(
        "--compile-models",
        type=_strs,
        default=None,
        help="default tiny,qwen3-next-48L (smoke: qwen3-next-4L-i2, two groups of 2 layers)",
    )
    g.add_argument("--compile-steps", type=int, default=None, help="verify-loop steps, default 50")
    g.add_argument("--compile-repeats", type=int, default=None, help="runs per case, default 2")
    g.add_argument("--no-isolate", action="store_true", help="measure compile cases in this process")
    g = ap.add_argument_group("gap")
    g.add_argument(
        "--gaps-ms", type=_ints, default=None, help="idle gaps before each verify call, default 0,2,8 (smoke 0,1)"
    )
    g.add_argument("--gap-calls", type=int, default=None, help="timed calls per gap and round, default 40 (smoke 2)")
    g.add_argument("--gap-rounds", type=int, default=None, help="rounds over the gaps, default 3 (smoke 1)")
    g = ap.add_argument_group("slots")
    g.add_argument("--slots-model", default=None, help="default qwen3-next-48L (smoke qwen3-next-4L-i2)")
    g.add_argument(
        "--slot-counts", type=_ints, default=None, help="engines' slot counts (max batch), default 8,64 (smoke 2,8)"
    )
    g.add_argument("--slots-iters", type=int, default=None, help="timed runs per step, default 50 (smoke 2)")
    g = ap.add_argument_group("roofline")
    g.add_argument("--roofline-layers", type=int, default=None, help="default 8 (two 3:1 groups); dry run 4")
    g.add_argument("--roofline-ctx", type=int, default=None, help="cached tokens per sequence, default 2048")
    g.add_argument("--roofline-decode-ns", type=_ints, default=None, help="default 1,8,32")
    g.add_argument("--roofline-verify-ns", type=_ints, default=None, help="default 8,32")
    g.add_argument("--roofline-k", type=int, default=None, help="verify rows per sequence, default 4")
    g.add_argument("--roofline-iters", type=int, default=None, help="timed runs per step, default 20")
    return ap


def _resolve(a) -> dict:
    smoke = a.smoke
    dry = a.dry_run or smoke
    d = lambda v, full, small: v if v is not None else (small if smoke else full)  # noqa: E731
    return dict(
        model=d(a.model, "tiny", "tiny-2L"),
        forward_steps=d(a.forward_steps, ["prefill", "decode", "verify"], ["verify"]),
        sections=a.sections
        or (
            ["roofline"]
            if a.gpu
            else (
                ["hf", "compile", "forwards", "gap", "slots", "roofline"]
                if smoke
                else ["hf", "compile", "forwards", "gap", "slots"]
            )
        ),
        repeats=d(a.repeats, 7, 1),
        warmup=d(a.warmup, 2, 0),
        block=d(a.block, 8, 2),
        prefill_lens=d(a.prefill_lens, [128, 512, 2048], [16]),
        ns=d(a.ns, [1, 4, 8], [1]),
        ks=d(a.ks, [2, 3, 4], [2]),
        ctx=d(a.ctx, 128, 16),
        compile_models=d(a.compile_models, ["tiny", "qwen3-next-48L"], ["qwen3-next-4L-i2"]),
        compile_steps=d(a.compile_steps, 50, 5),
        compile_repeats=d(a.compile_repeats, 2, 1),
        isolate=not (a.no_isolate or smoke),
        roofline_dry=dry or not a.gpu,
        roofline_layers=a.roofline_layers or (4 if dry or not a.gpu else 8),
        roofline_ctx=a.roofline_ctx or (24 if dry or not a.gpu else 2048),
        roofline_decode_ns=a.roofline_decode_ns
        if a.roofline_decode_ns is not None
        else ([] if smoke else [1] if dry or not a.gpu else [1, 8, 32]),
        roofline_verify_ns=a.roofline_verify_ns or ([2] if dry or not a.gpu else [8, 32]),
        roofline_k=a.roofline_k or (2 if dry or not a.gpu else 4),
        roofline_iters=a.roofline_iters or (1 if dry or not a.gpu else 20),
        gaps_ms=d(a.gaps_ms, [0, 2, 8], [0, 1]),
        gap_calls=d(a.gap_calls, 40, 2),
        gap_rounds=d(a.gap_rounds, 3, 1),
        slots_model=d(a.slots_model, "qwen3-next-48L", "qwen3-next-4L-i2"),
        slot_counts=d(a.slot_counts, [8, 64], [2, 8]),
        slots_iters=d(a.slots_iters, 50, 2),
        hf_create=not (a.no_hf_setup or smoke),
    )


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def run(argv=None) -> dict:
    """Parse, run the sections, print the tables, write the JSON; returns the results dict."""
    ap = parser()
    a = ap.parse_args(argv)
    if a.gpu and not a.dry_run and jax.default_backend() != "gpu":
        ap.error(
            f"--gpu needs an NVIDIA GPU (default backend {jax.default_backend()!r}); "
            "`--gpu --dry-run` checks the same path with tiny shapes on any machine"
        )
    cfg = _resolve(a)
    unknown = set(cfg["sections"]) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown section(s) {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    os.makedirs(a.workdir, exist_ok=True)
    info = machine_info()
    info.update(
        threads=a.threads,
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        argv=list(argv if argv is not None else sys.argv[1:]),
        **{v.lower(): os.environ.get(v) for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")},
    )
    results: dict = {"machine": info, "settings": {k: v for k, v in cfg.items()}, "sections": {}, "load": {}}
    tables, failed = [], []

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1, default=float)

    for name in cfg["sections"]:
        before = load_average()
        t0, c0 = time.perf_counter(), time.process_time()
        _log(f"section {name} (load {before})")
        try:
            res = _section(name, cfg, a)
        except Exception as e:  # one broken section must not lose the others' numbers
            traceback.print_exc()
            res = {"error": f"{type(e).__name__}: {e}"}
            failed.append(name)
        res["wall_s"], res["cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
        results["sections"][name] = res
        results["load"][name] = {"before": before, "after": load_average()}
        save()  # after every section: a later failure keeps what was measured
        if "error" in res:
            table = f"== {name}: FAILED: {res['error']}"
        else:
            table = {
                "hf": report.hf_table,
                "compile": report.compile_table,
                "forwards": report.forwards_table,
                "gap": report.gap_table,
                "slots": report.slots_table,
                "roofline": report.roofline_table,
            }[name](res)
        tables.append(
            f"{table}\n   (load average before/after: {before} / {results['load'][name]['after']}; "
            f"{res['wall_s']:.0f} s wall, {res['cpu_s']:.0f} s CPU in this process)"
        )
    results["failed"] = failed
    save()
    out = "\n\n".join([report.machine_line(info), *tables])
    print(out, flush=True)
    _log(f"wrote {a.json}")
    results["table"] = out
    return results


def _section(name: str, cfg: dict, a) -> dict:
    if name == "hf":
        from benchmarks import vs_hf
        from benchmarks.hf_env import ensure_hf_venv

        python, why = ensure_hf_venv(create=cfg["hf_create"])
        if python is None:
            _log(f"HF comparison skipped: {why}")
            return {"skipped": why}
        return vs_hf.run(
            cfg["model"],
            python,
            workdir=a.workdir,
            prefill_lens=cfg["prefill_lens"],
            ns=cfg["ns"],
            ks=cfg["ks"],
            ctx=cfg["ctx"],
            repeats=cfg["repeats"],
            warmup=cfg["warmup"],
            block=cfg["block"],
            threads=a.threads or None,
            impl=a.hf_impl,
            seed=a.seed,
        )
    if name == "compile":
        from benchmarks import compile_cost

        return compile_cost.run(
            cfg["compile_models"],
            cfg["compile_steps"],
            cfg["compile_repeats"],
            isolate=cfg["isolate"],
            log=lambda m: _log(m),
        )
    if name == "forwards":
        from benchmarks import forwards

        return forwards.run(
            cfg["model"],
            prefill_len=max(cfg["prefill_lens"][0], 16),
            n=max(cfg["ns"]),
            k=max(cfg["ks"]),
            ctx=cfg["ctx"],
            repeats=cfg["repeats"],
            warmup=cfg["warmup"],
            seed=a.seed,
            steps=cfg["forward_steps"],
        )
    if name == "gap":
        from benchmarks import idle_gap

        return idle_gap.run(
            cfg["model"],
            n=max(cfg["ns"]),
            k=max(cfg["ks"]),
            ctx=cfg["ctx"],
            gaps=[ms / 1e3 for ms in cfg["gaps_ms"]],
            calls=cfg["gap_calls"],
            rounds=cfg["gap_rounds"],
            warmup=cfg["warmup"],
            seed=a.seed,
        )
    if name == "slots":
        from benchmarks import slot_scaling

        return slot_scaling.run(
            cfg["slots_model"],
            slot_counts=cfg["slot_counts"],
            ctx=cfg["ctx"],
            k=max(cfg["ks"]),
            iters=cfg["slots_iters"],
            seed=a.seed,
        )
    from benchmarks import roofline

    return roofline.run(
        dry_run=cfg["roofline_dry"],
        layers=cfg["roofline_layers"],
        ctx=cfg["roofline_ctx"],
        decode_ns=cfg["roofline_decode_ns"],
        verify_ns=cfg["roofline_verify_ns"],
        k=cfg["roofline_k"],
        iters=cfg["roofline_iters"],
        seed=a.seed,
    )


def main(argv=None) -> int:
    """Exit status 1 when a section failed (its error is in the table and the JSON)."""
    return 1 if run(argv)["failed"] else 0
