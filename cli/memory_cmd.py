"""`metrale-jax memory`: will this serve fit this device at this workload, and how far does it go?

Owns only argument handling and the order of the steps; the counts are the engine's
(`capacity`), the bytes the allocator's (`pool.allocate_pool`, traced abstractly), the
activations XLA's memory analysis of the engine's step programs compiled for this machine's
backend (cached on disk; `--no-activations` skips them), the settings the serve's own
(`recipes` + `serve_flags.parse_serve_argv` + MODEL.toml + `resolve_settings`).

Invariant: every user error prints one line per problem (`error: ...`) on stderr and exits 2.
"""

from __future__ import annotations

from pathlib import Path

import click

from metrale_jax.engine.capacity import AUTO_MAX_SLOTS
from metrale_jax.engine.settings import Provenance, resolve_settings
from metrale_jax.engine.sharding import check_fp8_blocks, check_mesh, param_divisors
from metrale_jax.memory.activations import ActivationModel, fp8_abstract_params, provide_host_devices
from metrale_jax.memory.advice import concurrency_answer, isl_answer, warnings_for
from metrale_jax.memory.devices import find_device
from metrale_jax.memory.errors import PlanError
from metrale_jax.memory.plan import Planner, Workload
from metrale_jax.memory.report import Report, render_json, render_text
from metrale_jax.memory.source import resolve_model
from metrale_jax.memory.weights import outside_bytes, weight_terms
from metrale_jax.presets import parse_dtype
from metrale_jax_cli.errors import user_errors
from metrale_jax_cli.model_toml import load_behavior
from metrale_jax_cli.recipes import REPO_RECIPES_DIR, load_recipe, serve_argv
from metrale_jax_cli.serve_flags import parse_serve_argv


def _parse_slots(text: str | None) -> int | str | None:
    """`--slots N|auto` → N, "auto" or None (absent)."""
    if text is None or text.strip() == "auto":
        return None if text is None else "auto"
    if text.strip().isdigit() and 1 <= int(text) <= AUTO_MAX_SLOTS:
        return int(text)
    raise PlanError(f"--slots must be an integer in 1..={AUTO_MAX_SLOTS} or auto, got {text!r}")


def plan(
    checkpoint: str,
    device: str,
    isl: int,
    osl: int,
    concurrency: int,
    recipe: str | None,
    slots: str | None,
    dtype: str | None,
    root: Path,
    engine_flags: tuple[str, ...],
    activations: bool = True,
) -> Report:
    """Resolve everything the command names and evaluate it. Raises `MetraleError` subclasses.
    `activations=False` skips compiling the step programs (no activation term is charged)."""
    dev = find_device(device)
    slots_arg = _parse_slots(slots)
    source = resolve_model(checkpoint, root, None if recipe is None else load_recipe(root, recipe).model)
    argv = serve_argv(root, source.id, recipe, engine_flags)
    _, raw = parse_serve_argv(argv)
    behavior = load_behavior(source.model_toml)
    settings = resolve_settings(raw, behavior, auto_slots=min(concurrency, AUTO_MAX_SLOTS))
    tp, ep = settings.tensor_parallel_size, settings.expert_parallel_size
    check_mesh(source.config, tp, ep, tp * ep)  # the plan is for a machine of tp x ep such devices
    if activations:
        provide_host_devices(tp * ep)  # a one-device machine plans the mesh's per-device programs
    check_fp8_blocks(fp8_abstract_params(source.config, source.quantization), source.config, tp)
    dtype_name = dtype or source.dtype
    served = parse_dtype(dtype_name)
    model = ActivationModel(source.config, served, quantization=source.quantization) if activations else None
    planner = Planner(
        config=source.config,
        settings=settings,
        device=dev,
        dtype=served,
        weights=weight_terms(source, served, param_divisors(source.config, tp, ep)),
        slots=slots_arg,
        follow_auto=str(raw.get("max_batch_size", "")).strip() == "auto",
        activations=model,
    )
    w = Workload(concurrency, isl, osl)
    ev = planner.evaluate(w)
    answers = concurrency_answer(planner, w), isl_answer(planner, w)
    table = settings.provenance
    if slots_arg is not None:
        table += (
            Provenance("--slots", str(slots_arg), str(ev.counts.real_slots), "what-if: replaces --max-batch-size"),
        )
    return Report(
        checkpoint=source.id,
        config_from=source.config_from,
        weights_from=(
            f"{len(source.tensors)} tensors on disk" if source.bindings else f"shapes of init_params, {dtype_name}"
        ),
        behavior_from=behavior.source,
        outside_bytes=outside_bytes(source),
        recipe=recipe,
        serve_flags=tuple(argv[1:]),
        device=dev,
        settings_table=table,
        evaluation=ev,
        max_concurrency=answers[0],
        max_isl=answers[1],
        warnings=warnings_for(planner, ev)
        + ((model.cache_warning,) if model and model.cache_warning else ())
        + (
            (f"{source.quantization.method} weights: planned, not loaded by this engine (loadable: fp8)",)
            if source.quantization and not source.quantization.loadable
            else ()
        ),
        activation_run=None
        if model is None
        else {
            "compiled": model.compiled,
            "compile_seconds": round(model.compile_seconds, 3),
            "compile_wall_seconds": round(model.compile_wall_seconds, 3),
            "cache_hits": model.cache_hits,
            "cache_dir": str(model.cache_dir),
        },
    )


@click.command("memory", context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--checkpoint",
    required=True,
    help="Preset (tiny), checkpoint directory, or model id with recipes/models/<id>/config.json.",
)
@click.option("--device", required=True, help="Accelerator, e.g. H100, H200, B200, GB10, L40S, RTX-5090.")
@click.option("--isl", type=click.IntRange(min=1), required=True, help="Prompt tokens per sequence.")
@click.option("--osl", type=click.IntRange(min=1), required=True, help="Output tokens per sequence.")
@click.option("--concurrency", type=click.IntRange(min=1), required=True, help="Sequences decoding together.")
@click.option("--recipe", help="Serve recipe FAMILY/STEM (recipes/FAMILY/STEM.yaml); its model must be the checkpoint.")
@click.option("--slots", help="What-if sequence slots: N or auto (= the concurrency); replaces --max-batch-size.")
@click.option(
    "--dtype",
    type=click.Choice(["bfloat16", "float32"]),
    help="Served weight/activation dtype [config.json's; presets float32].",
)
@click.option(
    "--root",
    "root",
    type=click.Path(file_okay=False, path_type=Path),
    default=REPO_RECIPES_DIR,
    show_default=True,
    help="Recipes directory.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option(
    "--no-activations",
    "no_activations",
    is_flag=True,
    help="Skip the activation term (compiling the step programs; cached on disk under "
    "$METRALE_JAX_ACTIVATIONS_CACHE or ~/.cache/metrale-jax/activations).",
)
@click.argument("engine_flags", nargs=-1, type=click.UNPROCESSED)
@user_errors
def memory(
    checkpoint, device, isl, osl, concurrency, recipe, slots, dtype, root, as_json, no_activations, engine_flags
):
    """Plan a serve's device memory without a device: weights, every engine pool at ISL+OSL and
    CONCURRENCY, the step programs' activations (XLA's memory analysis, compiled for this
    machine's backend), the verdict against DEVICE's budget, and the largest concurrency and ISL
    that fit. Serve flags after `--` override the recipe's (e.g. `-- --speculative --num-drafts 3`)."""
    report = plan(
        checkpoint,
        device,
        isl,
        osl,
        concurrency,
        recipe,
        slots,
        dtype,
        root,
        engine_flags,
        activations=not no_activations,
    )
    click.echo(render_json(report) if as_json else render_text(report), nl=False)
