"""The suite's tiers: which tests carry which marker (`slow`, `subprocess`, `sharded`).

The markers are registered in pyproject.toml's [tool.pytest.ini_options] and pytest runs with
`--strict-markers`; `tests/conftest.py` applies `RULES` to every collected test. `make test-fast`
runs `-m "not slow"`: every layer's cheap tests (host logic, kernels at small shapes, one tiny
engine, a diff's request checks). `make test` runs every test, whatever its markers.

The table is central, not a `pytestmark` in each file: a tier is a statement about cost, read and
revised in one place from `--durations` output, and test files stay free of it.

Invariants:
- a test is fast unless a rule marks it `slow`; a new test module joins the fast tier until a
  rule says otherwise (CI's `--durations=20` names the tests that cost the most);
- every rule names a test module that exists and only test functions and fixtures it defines, so a
  renamed or moved test fails collection instead of drifting silently into the fast tier;
- a marker name not registered in pyproject.toml fails collection (`--strict-markers`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

TESTS = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Rule:
    """`marks` on tests of `module` (a file name in tests/): when `only` or `uses` is given, on the
    test functions named in `only` and those requesting a fixture named in `uses` (a module-scoped
    engine, a CLI run: where the cost is); else on every test function except those in `but`."""

    module: str
    marks: tuple[str, ...]
    only: tuple[str, ...] = ()
    uses: tuple[str, ...] = ()
    but: tuple[str, ...] = ()

    def applies_to(self, module: str, function: str, fixtures: Iterable[str]) -> bool:
        if module != self.module:
            return False
        if self.only or self.uses:
            return function in self.only or not set(self.uses).isdisjoint(fixtures)
        return function not in self.but


SLOW, SUBPROCESS, SHARDED = ("slow",), ("subprocess",), ("sharded",)

# What is slow (per-test times from `--junitxml`): a test that compiles an engine's programs, a
# model forward beyond kernel-test shapes, or a whole CLI run, notebook or worker; in a module with
# a costly module fixture, the tests that request it. The fast tier keeps in each layer a few tests
# that do compile: a tiny engine's refusals and swap, one end-to-end diff, the planner's reports,
# kernels at small shapes.
RULES: tuple[Rule, ...] = (
    Rule("test_batch_invariant.py", SLOW + SUBPROCESS, uses=("contract", "mutants", "einsum_bits", "softmax_bits")),
    # kernels
    Rule("test_kernels_gdn.py", SLOW, only=("test_chunk_bit_identical", "test_rows_bit_identical")),
    Rule(
        "test_kernels_paged_attention.py",
        SLOW,
        only=(
            "test_bit_identical",
            "test_tiled_reference_as_accurate_as_whole_span",
            "test_other_tilings_within_bound",
            "test_stacked_cache_reads_the_layer",
        ),
    ),
    Rule("test_kernels_ops.py", SLOW, only=("test_tiny_model_forward_agrees",)),
    Rule("test_kernels_cpu_rows.py", SLOW, only=("test_kernel_computes_the_product_and_each_row_alone",)),
    Rule(
        "test_kernels_cpu_rows.py",
        SUBPROCESS,
        only=(
            "test_a_build_into_an_empty_cache_loads_and_is_reused",
            "test_a_failed_build_is_a_reason_and_leaves_no_file",
        ),
    ),
    Rule("test_kernels_gpu_check.py", SLOW, only=("test_dry_run_passes",)),
    Rule("test_memory_mesh.py", SLOW + SUBPROCESS),
    Rule("test_fp8.py", SLOW, only=("test_speculative_equals_greedy_on_the_fp8_moe_fixture",)),
    Rule(
        "test_kernels_gpu_check.py", SUBPROCESS, only=("test_session_stops_each_stage_at_its_limit_and_runs_the_next",)
    ),
    # model
    Rule(
        "test_moe.py",
        SLOW,
        only=(
            "test_pairs_per_expert_leaves_are_the_stacked_pairs_bit_for_bit",
            "test_every_form_is_the_eager_expert_loop",
            "test_rows_are_isolated_nan_included",
        ),
    ),
    Rule(
        "test_transposed_weights.py",
        SLOW,
        only=(
            "test_the_cpu_engine_holds_its_projections_input_major_and_reshards_them_in_checkpoint_order",
            "test_the_cpu_engine_holds_experts_one_leaf_each_where_one_row_runs_pairs",
        ),
    ),
    Rule(
        "test_layer_groups.py",
        SLOW,
        only=("test_stacked_params_have_a_group_axis", "test_engine_layouts_match_the_cached_forward"),
    ),
    Rule("test_hf_parity.py", SLOW),
    Rule("test_hostile_config_parity.py", SLOW),
    Rule("test_program_copies.py", SLOW, uses=("params",)),
    # engine
    Rule("test_engine.py", SLOW, only=("test_speculative_equals_greedy_on_a_loaded_checkpoint",), uses=("eng",)),
    Rule("test_program_inputs.py", SLOW, uses=("served",)),
    Rule(
        "test_prefix_cache.py",
        SLOW,
        but=(
            "test_snapshot_exhaustion_falls_back_to_computing",
            "test_block_cache_references_and_namespaces",
            "test_block_accounting_holds_through_random_sharing_and_eviction",
        ),
    ),
    Rule("test_forward_select.py", SLOW),
    Rule("test_speculative.py", SLOW),
    Rule(
        "test_sampling.py",
        SLOW,
        only=(
            "test_generate_samples_by_seed_and_speculative_prints_the_same_text",
            "test_a_verify_reading_the_previous_positions_noise_fails_the_sampled_diff",
        ),
        uses=("eng", "rejection_eng", "law_eng"),
    ),
    Rule(
        "test_sampling_paths.py",
        SLOW,
        only=("test_plain_sampling_is_the_same_in_another_process",),
        uses=("cached", "uncached", "small_cached", "wide"),
    ),
    Rule("test_sampling_paths.py", SUBPROCESS, only=("test_plain_sampling_is_the_same_in_another_process",)),
    Rule("test_sharding_lowering.py", SLOW),
    Rule(
        "test_sharding.py",
        SLOW + SUBPROCESS + SHARDED,
        only=("test_the_diff_passes_its_tp2_variant", "test_the_pallas_kernels_run_on_each_devices_heads"),
        uses=("worker",),
    ),
    Rule("test_sharding.py", SLOW, only=("test_bad_mesh_flags_are_one_error_line_exit_2",)),
    Rule("test_fp8_sharding.py", SLOW + SUBPROCESS + SHARDED, uses=("worker",)),
    Rule("test_oracle_bound.py", SLOW, uses=("bf16_engine",)),
    Rule(
        "test_fp8_sharding.py",
        SLOW,
        only=("test_the_planner_refuses_an_fp8_mesh_that_cuts_a_block_and_plans_the_80b_at_tp2",),
    ),
    # diff
    Rule(
        "test_diff.py",
        SLOW,
        only=("test_each_k_is_capped_by_its_slots_verify_capacity", "test_each_mode_passes_with_a_control_that_fires"),
        uses=("tiny_engine", "moe_engine"),
    ),
    Rule("test_sampling.py", SUBPROCESS, only=("test_generate_samples_by_seed_and_speculative_prints_the_same_text",)),
    Rule("test_diff_controls.py", SLOW, only=("test_swap_passes_with_every_control_firing",)),
    Rule("test_mutants.py", SLOW),
    Rule("test_mutants_coverage.py", SLOW),
    Rule("test_diff_generate.py", SLOW, but=("test_confidences_differ_only_past_the_bound_and_drafts_always",)),
    # memory
    Rule(
        "test_memory_activations.py",
        SLOW,
        but=("test_no_activations_skips_them", "test_cache_key_covers_the_reference_kernels"),
    ),
    Rule(
        "test_hostile_runs.py",
        SLOW,
        only=("test_out_is_the_path_given", "test_a_full_disk_keeps_the_earlier_out_and_leaves_no_temporary"),
        uses=("decode_cache",),
    ),
    Rule(
        "test_hostile_runs.py",
        SUBPROCESS,
        only=(
            "test_a_full_disk_keeps_the_earlier_out_and_leaves_no_temporary",
            "test_ctrl_c_during_start_up_is_one_line_and_exit_130",
            "test_ctrl_c_that_python_discards_in_a_gc_callback_still_ends_the_run",
        ),
    ),
    # tools and the CLI
    Rule("test_cli_logits.py", SLOW),
    Rule(
        "test_generate_cli.py", SLOW, only=("test_chat_generates_hf_greedy_tokens_and_stops_at_eos",), uses=("greedy",)
    ),
    Rule("test_layering.py", SUBPROCESS),
    Rule(
        "test_research.py",
        SLOW,
        only=(
            "test_a_study_of_an_hf_checkpoint_runs_its_own_tokens",
            "test_rejection_coupling_run_is_the_engines_step_and_accepts_at_one_minus_tv",
        ),
        uses=("run", "study"),
    ),
    Rule(
        "test_small_model.py",
        SLOW,
        only=(
            "test_greedy_continuation_is_python_like",
            "test_objective_gradient_lowers_both_losses",
            "test_the_chained_fine_tune_sees_the_engines_propose",
            "test_the_chained_fine_tune_moves_only_the_drafter_and_lowers_its_chained_loss",
        ),
        uses=("heldout_run",),
    ),
    Rule("test_notebooks.py", SLOW, only=("test_notebook_runs_in_fast_mode_and_writes_figures",)),
    Rule("test_benchmarks.py", SLOW, only=("test_benchmark_checkpoint_is_rewritten_when_the_weights_change",)),
    Rule("test_benchmarks.py", SLOW + SUBPROCESS, uses=("smoke",)),
)


def marks_for(rules: Iterable[Rule], module: str, function: str, fixtures: Iterable[str]) -> list[str]:
    """The markers the rules give to `function` of `module` requesting `fixtures`, each once, in
    rule order."""
    names: dict[str, None] = {}
    for rule in rules:
        if rule.applies_to(module, function, fixtures):
            names.update(dict.fromkeys(rule.marks))
    return list(names)


def stale(rules: Iterable[Rule], modules: dict[str, ModuleType]) -> list[str]:
    """One line per rule naming a test module missing from tests/, or a test function or fixture
    that a collected module (`modules`, by file name) does not define."""
    lines = []
    for rule in rules:
        if not (TESTS / rule.module).is_file():
            lines.append(f"tests/tiers.py: {rule.module} is not a file in tests/")
        elif rule.module in modules:
            lines += [
                f"tests/tiers.py: {rule.module} defines no {name}"
                for name in (*rule.only, *rule.uses, *rule.but)
                if not hasattr(modules[rule.module], name)
            ]
    return lines


def registered(config: pytest.Config) -> set[str]:
    """The marker names registered (pytest's, its plugins' and the ini file's `markers`)."""
    return {line.split(":")[0].split("(")[0].strip() for line in config.getini("markers")}


def mark(config: pytest.Config, items: Sequence[pytest.Item], rules: Sequence[Rule] = RULES) -> None:
    """Add each rule's markers to the collected `items`; a stale rule or a marker name not
    registered in the ini file's `markers` is a usage error, raised before any item changes."""
    unknown = sorted({m for rule in rules for m in rule.marks} - registered(config))
    modules = {item.path.name: item.module for item in items if isinstance(item, pytest.Function)}
    errors = [f"tests/tiers.py: marker {m!r} is not registered in pyproject.toml" for m in unknown]
    errors += stale(rules, modules)
    if errors:
        raise pytest.UsageError("\n".join(errors))
    for item in items:
        if isinstance(item, pytest.Function):
            for name in marks_for(rules, item.path.name, item.originalname, item.fixturenames):
                item.add_marker(name)
