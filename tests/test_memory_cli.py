"""`metrale-jax memory`: the planner end to end, its inverse queries, warnings and refusals.

Every bad input must give exit code 2 and one `error:` line per problem on stderr.
These runs skip the activations (`--no-activations`: compiling the step programs); they have
their own tests in test_memory_activations.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

from metrale_jax.checkpoint import read_header, write_safetensors
from metrale_jax.config import load_model_config
from metrale_jax.engine.capacity import pool_counts
from metrale_jax.engine.pool import allocate_pool, pool_buffers
from metrale_jax.engine.settings import resolve_settings
from metrale_jax.memory.devices import GIB, MIB, find_device, runtime_reserve, util_budget
from metrale_jax.memory.errors import PlanError
from metrale_jax.memory.plan import Planner, Term, Workload, largest_fitting
from metrale_jax.presets import PRESETS
from metrale_jax_cli.memory_cmd import memory
from metrale_jax_cli.recipes import REPO_RECIPES_DIR

MODELS = REPO_RECIPES_DIR / "models"


def run(*args: str):
    return CliRunner().invoke(memory, ["--no-activations", *args])


def tiny(*extra: str, isl="100", osl="50", c="4", recipe="metrale-jax/tiny-mtp"):
    base = ["--checkpoint", "tiny", "--device", "H200", "--isl", isl, "--osl", osl, "--concurrency", c]
    return run(*base, *(["--recipe", recipe] if recipe else []), *extra)


# ---- bisection, on fake evaluators ----


@pytest.mark.parametrize("limit", [1, 2, 7, 63, 64, 99, 100])
def test_largest_fitting_finds_a_monotone_threshold(limit):
    probes = []

    def fits(n):
        probes.append(n)
        return n <= limit

    assert largest_fitting(1, 100, fits) == limit
    assert len(probes) <= 2 + 7  # lo, hi, then a bisection of 1..100


def test_largest_fitting_edges():
    assert largest_fitting(1, 100, lambda n: False) is None
    assert largest_fitting(1, 100, lambda n: True) == 100
    assert largest_fitting(5, 4, lambda n: True) is None
    assert largest_fitting(3, 3, lambda n: True) == 3


def fake_planner(per_token_bytes: int | None = None, **kw) -> tuple[Planner, int]:
    """A planner whose only pool is `per_token_bytes × slots × tokens` and whose weights take
    half of an L4's room (default: 50 sequences of 200 tokens fill the other half); also
    returns the bytes left for the pool."""
    cfg = PRESETS["tiny"][0]
    s = resolve_settings(
        {"max_batch_size": "auto", "max_seq_len": 4096, "gpu_memory_utilization": 1.0}, None, auto_slots=8
    )
    dev = find_device("L4")
    budget = util_budget(dev, 1.0)
    room = budget - runtime_reserve(budget)

    per_token = per_token_bytes or room // 2 // (50 * 200)

    def pools(config, counts, settings, dtype):
        return (Term("kv", "kv cache", per_token * counts.real_slots * counts.kv_tokens),)

    return Planner(
        cfg, s, dev, jnp.float32, (Term("w", "weights", room // 2),), follow_auto=True, pools=pools, **kw
    ), room // 2


def test_inverse_queries_on_a_linear_fake():
    planner, free = fake_planner()
    per_token = free // (50 * 200)
    n = planner.max_concurrency(100, 100, 1)
    assert n == free // (per_token * 200) == 50
    assert planner.fits(Workload(n, 100, 100)) and not planner.fits(Workload(n + 1, 100, 100))
    isl = planner.max_isl(4, 100)
    assert isl == free // (per_token * 4) - 100 == 2400


def test_fixed_slots_search_stops_at_the_slots():
    planner, _ = fake_planner(1, slots=6)  # memory never binds
    assert planner.max_concurrency(10, 10, 3) == 6
    assert planner.refusal(Workload(7, 10, 10)) == "7 sequences need 7 slots; the serve has 6"


# ---- the command: text and JSON ----


def test_text_report_on_the_tiny_mtp_recipe():
    r = tiny()
    assert r.exit_code == 0, r.stderr
    out = r.stdout
    for needle in (
        "# metrale-jax memory plan",
        "checkpoint: metrale-jax/tiny",
        "recipe: metrale-jax/tiny-mtp",
        "## Settings (requested -> effective)",
        "MODEL.toml [behavior] default_num_drafts",
        "## Pools at this workload (MiB)",
        "GDN verify h rows",
        "## Totals (MiB)",
        "Headroom:",
        "(fits).",
        "Max concurrency at ISL=100 OSL=50: 12",
        "Max ISL at C=4 OSL=50: 462",
    ):
        assert needle in out, needle
    assert r.stderr == ""


def test_json_report_is_versioned_and_consistent():
    r = tiny("--json")
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["schema"] == "metrale-jax.memory/2"
    t = d["totals"]
    assert t["pools"] == {g: sum(p["bytes"] for p in d["pools"] if p["group"] == g) for g in t["pools"]}
    assert t["weights"] == sum(w["bytes"] for w in d["weights"])
    assert t["activations"] == 0 and d["activations"] is None
    assert t["device_total"] == t["weights"] + sum(t["pools"].values()) + t["runtime_reserve"]
    assert t["headroom"] == t["budget"] - t["device_total"] and t["fits"] is True
    assert t["budget"] == int(143771 * MIB * 0.9)
    assert d["counts"]["real_slots"] == 12 and d["counts"]["k"] == 4
    assert d["inverse"]["max_concurrency"]["concurrency"] == 12
    rows = {s["setting"]: s for s in d["settings"]}
    assert rows["--num-drafts"]["rule"] == "MODEL.toml [behavior] default_num_drafts"
    assert rows["--speculative"] == {"setting": "--speculative", "requested": "on", "effective": "on", "rule": "flag"}


@pytest.mark.parametrize("caching", [False, True])
def test_planned_bytes_equal_what_allocate_pool_really_allocates(caching):
    """Planned == allocated: the JSON's pools against a real allocation of the tiny model (with
    prefix caching: its snapshot slots, counted by `pool_counts`, as pool leaves)."""
    flags = ["--", "--enable-prefix-caching", "--ssm-cache-slots", "5"] if caching else []
    d = json.loads(tiny("--json", *flags).stdout)
    cfg = PRESETS["tiny"][0]
    raw = {
        **({"enable_prefix_caching": True, "ssm_cache_slots": 5} if caching else {}),
        "max_seq_len": 512,
        "max_batch_size": "12",
        "block_size": 16,
        "max_prefill_tokens": 256,
        "speculative": True,
        "num_drafts": 3,
        "mtp_max_seqs": 16,
        "kv_cache_dtype": "f32",
    }
    counts = pool_counts(resolve_settings(raw, None, auto_slots=12), cfg, tokens_per_seq=150)
    assert json.loads(json.dumps(counts.__dict__)) == d["counts"]
    real = allocate_pool(cfg, counts, resolve_settings(raw, None, auto_slots=12), dtype=jnp.float32)
    allocated = [(list(shape), nbytes) for _, shape, _, nbytes in pool_buffers(real)]
    assert allocated == [(p["shape"], p["bytes"]) for p in d["pools"]]
    assert sum(x.nbytes for x in jax.tree_util.tree_leaves(real)) == sum(d["totals"]["pools"].values())
    snapshots = [p["shape"] for p in d["pools"] if p["group"] == "prefix snapshots"]
    assert [s[0] if len(s) == 2 else s[1] for s in snapshots] == [5] * (5 if caching else 0)


def test_weights_are_the_parameter_shapes():
    d = json.loads(tiny("--json").stdout)
    from metrale_jax.params import init_params

    params = init_params(PRESETS["tiny"][0], 0, jnp.float32)
    assert d["totals"]["weights"] == sum(x.nbytes for x in jax.tree_util.tree_leaves(params))


def test_local_weights_come_from_the_headers_and_unloaded_tensors_are_outside(tmp_path):
    """A Qwen3-Next checkpoint whose config names no MTP layer but whose weights hold one, plus
    a vision tensor the engine never loads."""
    src = Path(__file__).parent / "fixtures" / "hf" / "qwen3_next_moe"
    shutil.copy(src / "config.json", tmp_path / "config.json")
    refs = read_header(str(src / "model.safetensors"))
    tensors = {name: np.asarray(ref.read()) for name, ref in refs.items()}
    tensors["model.visual.patch_embed.weight"] = np.zeros((4, 8), np.float32)
    write_safetensors(str(tmp_path / "model.safetensors"), tensors)
    r = run(
        "--checkpoint",
        str(tmp_path),
        "--device",
        "L4",
        "--isl",
        "10",
        "--osl",
        "10",
        "--concurrency",
        "1",
        "--json",
        "--",
        "--speculative",
    )
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["checkpoint"]["weights"] == f"{len(refs) + 1} tensors on disk"
    assert d["checkpoint"]["outside_bytes"] == 4 * 8 * 4
    assert d["totals"]["weights"] == sum(ref.end - ref.start for ref in refs.values())
    assert "mtp head" in {w["group"] for w in d["weights"]}
    assert any(p["pool"].startswith("MTP drafter KV") for p in d["pools"])


# ---- worked vectors (state units × the engine's bytes per unit) ----


def _h_bytes(planner: Planner, w: Workload, cfg) -> int:
    unit = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    return sum(t.bytes for t in planner.evaluate(w).pools if t.shape[-3:] == unit)


@pytest.mark.parametrize(
    "model, raw, slots, want_mib",
    [
        # dense 27B, one slot, K = 4: per layer h (2+6+2) x 3 MiB, x 48 layers
        ("Qwen/Qwen3.5-27B", {"speculative": True, "num_drafts": 3}, 1, 10 * 3 * 48),
        # MoE 35B-A3B, eight slots, K = 2: per layer h (9+9+9) x 2 MiB, x 30 layers
        ("Qwen/Qwen3.5-35B-A3B", {"speculative": True, "num_drafts": 1, "mtp_max_seqs": 128}, 8, 27 * 2 * 30),
    ],
)
def test_worked_vectors_recurrent_h_state(model, raw, slots, want_mib):
    cfg = load_model_config(MODELS / model)
    s = resolve_settings({**raw, "max_batch_size": str(slots)}, None, auto_slots=slots)
    planner = Planner(cfg, s, find_device("GB10"), jnp.bfloat16, ())
    assert _h_bytes(planner, Workload(1, 1, 1), cfg) == want_mib * MIB


def test_gb10_budget_and_runtime_reserve_match_the_committed_sample():
    gb10 = find_device("gb10")
    budget = util_budget(gb10, 0.85)
    assert round(budget / MIB, 1) == 105919.2
    assert (runtime_reserve(budget) - GIB) // MIB == 2224


# ---- inverse answers through the command ----


def test_max_concurrency_fits_and_one_more_does_not():
    args = [
        "--checkpoint",
        "Qwen/Qwen3.5-35B-A3B",
        "--device",
        "H100",
        "--isl",
        "30000",
        "--osl",
        "2000",
        "--recipe",
        "qwen3.5/qwen3.5-35b-a3b-mtp",
        "--slots",
        "auto",
        "--json",
    ]
    d = json.loads(run(*args, "--concurrency", "1").stdout)
    n = d["inverse"]["max_concurrency"]["concurrency"]
    assert 1 <= n < 128 and "binds: kv cache" in d["inverse"]["max_concurrency"]["note"]
    assert json.loads(run(*args, "--concurrency", str(n)).stdout)["totals"]["fits"] is True
    assert json.loads(run(*args, "--concurrency", str(n + 1)).stdout)["totals"]["fits"] is False


def test_an_over_budget_plan_still_answers_and_exits_0():
    r = run(
        "--checkpoint",
        "Qwen/Qwen3-Next-80B-A3B-Instruct",
        "--device",
        "H200",
        "--isl",
        "3000",
        "--osl",
        "1000",
        "--concurrency",
        "4",
    )
    assert r.exit_code == 0
    assert "(over budget)." in r.stdout
    assert "Max concurrency at ISL=3000 OSL=1000: none fits (one sequence needs" in r.stdout


# ---- warnings ----


def test_warnings_for_settings_that_do_nothing():
    r = tiny("--", "--block-size", "128", isl="100")
    assert r.exit_code == 0, r.stderr
    out = r.stdout
    assert "--block-size 128 exceeds the ISL 100" in out
    assert "the serve holds 12 slots for a concurrency of 4" in out
    r = tiny("--", "--ssm-cache-slots", "4", c="12")
    assert "--ssm-cache-slots 4 does nothing without --enable-prefix-caching" in r.stdout
    assert "the K ladder allows 1 draft(s) per verify, not the 3 asked for" in r.stdout
    assert "slots' pools sit idle" not in r.stdout
    r = tiny("--", "--num-drafts", "1", recipe="metrale-jax/tiny")
    assert "--num-drafts does nothing without --speculative" in r.stdout
    r = tiny("--", "--gpu-memory-utilization", "0.97")
    assert "above H200's ceiling 0.95" in r.stdout
    r = tiny("--", "--enable-prefix-caching", "--ssm-cache-slots", "0")
    assert "--ssm-cache-slots 0 keeps no recurrent-state snapshot" in r.stdout
    r = tiny("--", "--enable-prefix-caching", "--ssm-cache-slots", "4")
    assert "does nothing without --enable-prefix-caching" not in r.stdout and "no recurrent-state" not in r.stdout


def test_slots_what_if_appears_in_the_settings_table():
    d = json.loads(tiny("--slots", "6", "--json").stdout)
    assert d["counts"]["real_slots"] == 6
    assert {
        "setting": "--slots",
        "requested": "6",
        "effective": "6",
        "rule": "what-if: replaces --max-batch-size",
    } in d["settings"]


# ---- refusals: exit 2, one line each ----


@pytest.fixture
def bad_root(tmp_path: Path) -> Path:
    """A recipes dir with the tiny recipes and a malformed one (no MODEL.toml yet)."""
    shutil.copytree(REPO_RECIPES_DIR / "metrale-jax", tmp_path / "metrale-jax")
    (tmp_path / "metrale-jax" / "broken.yaml").write_text("recipe_version: '2'\nmodel: a: b\n")
    return tmp_path


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--recipe", "metrale-jax/nope"], "unknown recipe 'metrale-jax/nope'"),
        (
            ["--recipe", "qwen3.5/qwen3.5-27b"],
            "recipe qwen3.5/qwen3.5-27b serves Qwen/Qwen3.5-27B, not --checkpoint metrale-jax/tiny",
        ),
        (["--", "--foo", "1"], "serve flags: No such option '--foo'"),
        (["--", "--block-size", "x"], "'x' is not a valid integer"),
        (["--", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
        (["--", "--gpu-memory-utilization", "0"], "--gpu-memory-utilization must be in (0, 1]"),
        (["--", "--max-seq-len", "120"], "ISL + OSL = 150 tokens exceeds --max-seq-len 120"),
        (["--", "--max-batch-size", "2"], "4 sequences need 4 slots; the serve has 2"),
        (["--slots", "3"], "4 sequences need 4 slots; the serve has 3"),
        (["--slots", "many"], "--slots must be an integer in 1..=128 or auto"),
        (["--", "--mtp-k-ladder", "4:3,x"], "--mtp-k-ladder: K ladder step 'x'"),
    ],
)
def test_refusals_on_tiny(args, needle):
    r = tiny(*args)
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--device", "H300"], "unknown device 'H300' (known: H100"),
        (["--checkpoint", "nobody/nothing"], "unknown checkpoint 'nobody/nothing'"),
    ],
)
def test_refusals_of_device_and_checkpoint(args, needle):
    base = {"--checkpoint": "tiny", "--device": "H200", "--isl": "10", "--osl": "10", "--concurrency": "1"}
    base.update(dict(zip(args[::2], args[1::2])))
    r = run(*[x for kv in base.items() for x in kv])
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and needle in lines[0]


def test_refusals_from_files(bad_root):
    r = tiny("--root", str(bad_root), recipe="metrale-jax/broken")
    assert r.exit_code == 2
    assert r.stderr.strip().splitlines() == [
        "error: recipe metrale-jax/broken: malformed YAML at line 2: mapping values are not allowed here"
    ]
    toml = bad_root / "models" / "metrale-jax" / "tiny" / "MODEL.toml"
    toml.parent.mkdir(parents=True)
    toml.write_text('[behavior]\ndefault_num_drafts = "three"\n')
    r = tiny("--root", str(bad_root))
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "[behavior] default_num_drafts must be a non-negative integer" in lines[0]


def test_several_violations_give_one_line_each():
    r = tiny("--", "--gpu-memory-utilization", "2", "--mtp-max-seqs", "0", "--kv-cache-dtype", "int4")
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 3 and all(x.startswith("error: ") for x in lines)


def test_device_lookup_ignores_case_and_punctuation():
    assert find_device("rtx 5090").id == "RTX-5090" == find_device("5090").id
    assert find_device("h200-141gb").id == "H200"
    with pytest.raises(PlanError):
        find_device("TPU")


def test_rejection_sampling_plans_its_drafter_laws():
    """`--speculative-sampling rejection` plans the pool's `draft_probs`: slots x (k - 1) x V f32,
    as `pool_counts` counts them (the JSON's counts) and `allocate_pool` allocates them."""
    d = json.loads(tiny("--json", "--no-activations", "--", "--speculative-sampling", "rejection").stdout)
    (laws,) = [p for p in d["pools"] if p["group"] == "mtp drafter laws"]
    slots, rows = d["counts"]["slots"], d["counts"]["draft_prob_rows"]
    assert laws["shape"] == [slots, rows, PRESETS["tiny"][0].vocab_size] and rows == d["counts"]["k"] - 1
    assert laws["bytes"] == slots * rows * PRESETS["tiny"][0].vocab_size * 4
