"""Hostile input, command by command: every bad checkpoint, config, flag, file and size is one
`error:` line naming the problem, exit code 2, no traceback, and nothing left on disk.

Each case builds its inputs in its own temporary directory (tiny checkpoints, a few hundred KB),
runs the command in-process through the `metrale-jax` group, and checks:
- exit code 2 and no "Traceback" anywhere in the output;
- exactly one line on stderr starting with `error:` (Click's own usage errors included), and it
  contains the case's needle;
- the directory holds the same files with the same bytes afterwards (no partial `--out`, no
  temporary file, an earlier report untouched).
The cases that already behaved well before the hostile-input work are here too, so they stay so.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from metrale_jax.checkpoint import save_checkpoint
from metrale_jax.model_registry import TINY
from metrale_jax.params import init_params
from metrale_jax_cli.main import cli

NO_MTP = TINY.replace(num_mtp_layers=0)
Q35 = TINY.replace(
    model_type="qwen3_5_moe_text", trunk_prefix="model.language_model", weight_layout="qwen3_5", mlp_only_layers=()
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Callable[[str], Path]:
    """`saved(name)`: a directory holding checkpoint `name` (tiny, tiny without MTP, Qwen3.5
    wrapper), written once per module; cases copy it before changing it."""
    root = tmp_path_factory.mktemp("checkpoints")
    for name, cfg in (("tiny", TINY), ("no_mtp", NO_MTP), ("q35", Q35)):
        save_checkpoint(str(root / name), cfg, init_params(cfg, 0))

    return lambda name: root / name


# ---------------------------------------------------------------- building bad inputs


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write_header(path: Path, header: dict, data: bytes) -> None:
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def edit_header(d: Path, edit: Callable[[dict], object]) -> None:
    """Rewrite `d/model.safetensors` with `edit` applied to its header (data bytes unchanged)."""
    header, data = _header(d / "model.safetensors")
    edit(header)
    _write_header(d / "model.safetensors", header, data)


def edit_config(d: Path, edit: Callable[[dict], object]) -> None:
    """Rewrite `d/config.json` with `edit` applied to it."""
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def _as_list(d: Path) -> None:
    (d / "config.json").write_text(json.dumps([json.loads((d / "config.json").read_text())]))


NORM = "model.norm.weight"
EMPTY = {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
OTHER_NORM = "model.layers.0.input_layernorm.weight"


def _set(table: dict, **kw) -> None:
    table.update(kw)


def _pop(table: dict, *keys: str) -> None:
    for k in keys:
        table.pop(k, None)


def _without_layer_types(table: dict, **kw) -> None:
    """The layer pattern from `full_attention_interval` instead (with `kw` set)."""
    table.pop("layer_types")
    table.update(kw)


def _index(d: Path, weight_map: object) -> None:
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _shard_dir(d: Path) -> None:
    (d / "model.safetensors").rename(d / "part-1.safetensors")
    _index(d, {NORM: "part-2.safetensors", OTHER_NORM: "part-1.safetensors"})
    (d / "part-2.safetensors").mkdir()


def _replace_by_dir(d: Path, name: str) -> None:
    (d / name).unlink()
    (d / name).mkdir()


def _config_only(d: Path, cfg: object) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))


def _bad_tiny_config(d: Path, **fields) -> None:
    _config_only(d, {**TINY.to_hf_dict(), **fields})


def _with_model_toml(d: Path, text: bytes) -> None:
    _bad_tiny_config(d)
    _write(d / "MODEL.toml", text)


# ---------------------------------------------------------------- the table


@dataclass(frozen=True)
class Case:
    """One hostile input: `build(tmp)` prepares the files and returns the argv after
    `metrale-jax`; the single `error:` line must contain `needle`."""

    id: str
    build: Callable[[Path, Callable[[str], Path]], list[str]]
    needle: str


def ckpt(tmp: Path, saved, name: str = "tiny", edit: Callable[[Path], object] | None = None) -> Path:
    d = tmp / "ckpt"
    shutil.copytree(saved(name), d)
    if edit is not None:
        edit(d)
    return d


def logits_on(edit: Callable[[Path], object], name: str = "tiny", extra: tuple[str, ...] = ()):
    return lambda tmp, saved: ["logits", "--checkpoint", str(ckpt(tmp, saved, name, edit)), "--tokens", "1,2,3", *extra]


def memory_on(build: Callable[[Path], object], *flags: str):
    def argv(tmp: Path, saved) -> list[str]:
        d = tmp / "model"
        build(d)
        base = ["memory", "--no-activations", "--checkpoint", str(d), "--device", "H200"]
        return [*base, "--isl", "64", "--osl", "32", "--concurrency", "2", *flags]

    return argv


def memory_tiny(*serve_flags: str):
    def argv(tmp: Path, saved) -> list[str]:
        d = ckpt(tmp, saved, "no_mtp")
        base = ["memory", "--no-activations", "--checkpoint", str(d), "--device", "H200"]
        return [*base, "--isl", "64", "--osl", "32", "--concurrency", "2", "--", *serve_flags]

    return argv


def _device(argv: list[str], device: str) -> list[str]:
    return [device if a == "H200" else a for a in argv]


def diff_tiny(*flags: str):
    return lambda tmp, saved: ["diff", "--checkpoint", "tiny", "--out", str(tmp / "r.json"), *flags]


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _with_old_report(tmp: Path, name: str) -> Path:
    return _write(tmp / name, b"an earlier report\n")


CHECKPOINT_CASES = [
    # the header's own fields
    Case(
        "header-negative-offsets",
        logits_on(lambda d: edit_header(d, lambda h: _set(h[NORM], data_offsets=[-256, 0]))),
        "data_offsets",
    ),
    Case(
        "header-overlapping-tensors",
        logits_on(lambda d: edit_header(d, lambda h: _set(h[NORM], data_offsets=h[OTHER_NORM]["data_offsets"]))),
        "overlap",
    ),
    Case("header-shape-strings", logits_on(lambda d: edit_header(d, lambda h: _set(h[NORM], shape=["64"]))), "shape"),
    Case("header-shape-negative", logits_on(lambda d: edit_header(d, lambda h: _set(h[NORM], shape=[-64]))), "shape"),
    Case("header-shape-bool", logits_on(lambda d: edit_header(d, lambda h: _set(h[NORM], shape=[True]))), "shape"),
    Case(
        "header-offsets-strings",
        logits_on(lambda d: edit_header(d, lambda h: _set(h[NORM], data_offsets=["0", "256"]))),
        "data_offsets",
    ),
    Case(
        "header-offsets-three",
        logits_on(lambda d: edit_header(d, lambda h: _set(h[NORM], data_offsets=[0, 128, 256]))),
        "data_offsets",
    ),
    Case(
        "header-offsets-past-file",
        logits_on(lambda d: edit_header(d, lambda h: _set(h[NORM], data_offsets=[10**9, 10**9 + 256]))),
        "data_offsets",
    ),
    Case("header-dtype-unknown", logits_on(lambda d: edit_header(d, lambda h: _set(h[NORM], dtype="F9"))), "dtype"),
    Case("header-dtype-not-text", logits_on(lambda d: edit_header(d, lambda h: _set(h[NORM], dtype=5))), "dtype"),
    Case("header-entry-not-object", logits_on(lambda d: edit_header(d, lambda h: _set(h, **{NORM: 5}))), NORM),
    Case("header-entry-missing-key", logits_on(lambda d: edit_header(d, lambda h: _pop(h[NORM], "shape"))), "shape"),
    Case(
        "header-length-past-file",
        logits_on(lambda d: _write(d / "model.safetensors", struct.pack("<Q", 10**6) + b"{}")),
        "corrupt safetensors header",
    ),
    Case(
        "header-not-json",
        logits_on(lambda d: _write(d / "model.safetensors", struct.pack("<Q", 8) + b"not json")),
        "corrupt safetensors header",
    ),
    Case(
        "header-not-utf8",
        logits_on(lambda d: _write(d / "model.safetensors", struct.pack("<Q", 8) + b"\xff\xfe{}    ")),
        "corrupt safetensors header",
    ),
    Case(
        "header-a-list",
        logits_on(lambda d: _write(d / "model.safetensors", struct.pack("<Q", 8) + b"[1, 2]  ")),
        "not a JSON object",
    ),
    Case(
        "header-metadata-not-strings",
        logits_on(lambda d: edit_header(d, lambda h: _set(h, __metadata__={"format": 1}))),
        "__metadata__",
    ),
    Case("file-too-short", logits_on(lambda d: _write(d / "model.safetensors", b"abc")), "shorter than 8 bytes"),
    Case(
        "data-truncated",
        logits_on(lambda d: _write(d / "model.safetensors", (d / "model.safetensors").read_bytes()[:-100])),
        "data_offsets",
    ),
    Case("weights-a-directory", logits_on(lambda d: _replace_by_dir(d, "model.safetensors")), "model.safetensors"),
    # tensors against the config (already one error listing them all)
    Case("tensor-missing", logits_on(lambda d: edit_header(d, lambda h: _pop(h, NORM))), f"missing tensor {NORM}"),
    Case(
        "tensor-wrong-shape",
        logits_on(lambda d: edit_header(d, lambda h: _set(h[NORM], shape=[32, 2]))),
        f"tensor {NORM} has shape [32, 2]",
    ),
    Case(
        "tensor-int-dtype",
        logits_on(lambda d: edit_header(d, lambda h: _set(h[NORM], dtype="I32"))),
        "expected a float dtype",
    ),
    Case(
        "tensor-unexpected",
        logits_on(lambda d: edit_header(d, lambda h: _set(h, **{"model.extra.weight": EMPTY}))),
        "unexpected tensor model.extra.weight",
    ),
    # index files
    Case(
        "index-weight-map-a-list",
        logits_on(lambda d: _index(d, [NORM, "model.safetensors"])),
        "weight_map",
    ),
    Case("index-weight-map-values", logits_on(lambda d: _index(d, {NORM: 5})), "weight_map"),
    Case(
        "index-not-json",
        logits_on(lambda d: _write(d / "model.safetensors.index.json", b"{nope")),
        "not a valid safetensors index",
    ),
    Case("index-missing-shard", logits_on(lambda d: _index(d, {NORM: "gone.safetensors"})), "missing shard"),
    Case("index-shard-a-directory", logits_on(_shard_dir), "part-2.safetensors"),
    Case(
        "index-shard-outside",
        logits_on(lambda d: _index(d, {NORM: "../ckpt/model.safetensors"})),
        "weight_map",
    ),
]

CONFIG_CASES = [
    Case("config-a-directory", logits_on(lambda d: _replace_by_dir(d, "config.json")), "config.json"),
    Case("config-a-list", logits_on(_as_list), "JSON object"),
    Case("config-not-json", logits_on(lambda d: _write(d / "config.json", b"{")), "not valid JSON"),
    Case("config-not-utf8", logits_on(lambda d: _write(d / "config.json", b'{"a": "\xff"}')), "config.json"),
    Case("config-missing", logits_on(lambda d: (d / "config.json").unlink()), "no config.json"),
    Case("vocab-a-word", logits_on(lambda d: edit_config(d, lambda c: _set(c, vocab_size="many"))), "vocab_size"),
    Case("vocab-null", logits_on(lambda d: edit_config(d, lambda c: _set(c, vocab_size=None))), "vocab_size"),
    Case("vocab-float", logits_on(lambda d: edit_config(d, lambda c: _set(c, vocab_size=256.5))), "vocab_size"),
    Case("vocab-bool", logits_on(lambda d: edit_config(d, lambda c: _set(c, vocab_size=True))), "vocab_size"),
    Case("hidden-negative", logits_on(lambda d: edit_config(d, lambda c: _set(c, hidden_size=-64))), "hidden_size"),
    Case(
        "heads-zero",
        logits_on(lambda d: edit_config(d, lambda c: _set(c, num_key_value_heads=0))),
        "num_key_value_heads",
    ),
    Case("head-dim-zero", logits_on(lambda d: edit_config(d, lambda c: _set(c, head_dim=0))), "head_dim"),
    Case(
        "heads-not-divisible",
        logits_on(lambda d: edit_config(d, lambda c: _set(c, num_attention_heads=3))),
        "multiple of num_key_value_heads",
    ),
    Case(
        "interval-zero",
        logits_on(lambda d: edit_config(d, lambda c: _without_layer_types(c, full_attention_interval=0))),
        "full_attention_interval",
    ),
    Case(
        "layers-huge",
        logits_on(lambda d: edit_config(d, lambda c: _without_layer_types(c, num_hidden_layers=10**9))),
        "num_hidden_layers",
    ),
    Case("experts-huge", logits_on(lambda d: edit_config(d, lambda c: _set(c, num_experts=10**9))), "num_experts"),
    Case(
        "rotary-factor-over-one",
        logits_on(lambda d: edit_config(d, lambda c: c["rope_parameters"].update(partial_rotary_factor=1.5))),
        "partial_rotary_factor",
    ),
    Case(
        "layer-types-unknown",
        logits_on(lambda d: edit_config(d, lambda c: _set(c, layer_types=["linear_attention", "mamba"] * 2))),
        "unknown layer types",
    ),
    Case(
        "layer-types-a-string",
        logits_on(lambda d: edit_config(d, lambda c: _set(c, layer_types="linear_attention"))),
        "layer_types",
    ),
    Case(
        "experts-per-token-over-experts",
        logits_on(lambda d: edit_config(d, lambda c: _set(c, num_experts_per_tok=9))),
        "num_experts_per_tok",
    ),
    Case(
        "mlp-only-layers-a-string",
        logits_on(lambda d: edit_config(d, lambda c: _set(c, mlp_only_layers="1"))),
        "mlp_only_layers",
    ),
    Case(
        "mlp-only-layers-out-of-range",
        logits_on(lambda d: edit_config(d, lambda c: _set(c, mlp_only_layers=[7]))),
        "mlp_only_layers",
    ),
    Case(
        "rope-parameters-a-list",
        logits_on(lambda d: edit_config(d, lambda c: _set(c, rope_parameters=[1, 2]))),
        "rope_parameters",
    ),
    Case(
        "rope-theta-negative",
        logits_on(lambda d: edit_config(d, lambda c: c["rope_parameters"].update(rope_theta=-1.0))),
        "rope_theta",
    ),
    Case("eps-a-word", logits_on(lambda d: edit_config(d, lambda c: _set(c, rms_norm_eps="small"))), "rms_norm_eps"),
    Case(
        "tie-a-word",
        logits_on(lambda d: edit_config(d, lambda c: _set(c, tie_word_embeddings="yes"))),
        "tie_word_embeddings",
    ),
    Case(
        "text-config-a-string",
        logits_on(lambda d: edit_config(d, lambda c: _set(c, text_config="big")), name="q35"),
        "text_config",
    ),
    Case(
        "model-type-unknown",
        logits_on(lambda d: edit_config(d, lambda c: _set(c, model_type="llama"))),
        "unsupported model_type",
    ),
    Case(
        "required-field-missing",
        logits_on(lambda d: edit_config(d, lambda c: _pop(c, "vocab_size"))),
        "lacks required field(s): vocab_size",
    ),
    Case(
        "model-toml-not-utf8",
        memory_on(lambda d: _with_model_toml(d, b"[behavior]\n\xff = 1\n")),
        "MODEL.toml",
    ),
    Case(
        "model-toml-bad-value",
        memory_on(lambda d: _with_model_toml(d, b"[behavior]\nmtp_max_seqs = -1\n")),
        "mtp_max_seqs",
    ),
    # the planner sees the same config checks as the loader
    Case("memory-hidden-negative", memory_on(lambda d: _bad_tiny_config(d, hidden_size=-64)), "hidden_size"),
    Case("memory-vocab-zero", memory_on(lambda d: _bad_tiny_config(d, vocab_size=0)), "vocab_size"),
    Case("memory-config-a-list", memory_on(lambda d: _config_only(d, [TINY.to_hf_dict()])), "JSON object"),
    Case(
        "memory-text-config-a-string",
        memory_on(lambda d: _config_only(d, {"model_type": "qwen3_5", "text_config": "big"})),
        "text_config",
    ),
]

SERVE_CASES = [
    # one set of refusals: the planner refuses what the engine refuses
    Case("memory-speculative-without-mtp", memory_tiny("--speculative"), "no MTP layer"),
    Case("memory-decode-ring", memory_tiny("--ssm-decode-ring-slots", "4"), "--ssm-decode-ring-slots"),
    Case("memory-serve-flag-twice", memory_tiny("--max-seq-len", "100", "--max-seq-len", "200"), "--max-seq-len"),
    Case("memory-serve-flag-unknown", memory_tiny("--max-seq-lenn", "100"), "--max-seq-lenn"),
    Case("memory-unknown-device", lambda tmp, saved: _device(memory_tiny()(tmp, saved), "x"), "unknown device"),
    Case(
        "memory-bad-slots",
        lambda tmp, saved: memory_tiny()(tmp, saved)[:-1] + ["--slots", "0"],
        "--slots must be an integer",
    ),
    Case(
        "diff-serve-flag-twice", diff_tiny("--steps", "4", "--block-size", "16", "--block-size", "32"), "--block-size"
    ),
    Case("diff-flag-pair-twice", diff_tiny("--steps", "4", "--speculative", "--no-speculative"), "--speculative"),
    Case("diff-verify-k-range", diff_tiny("--steps", "4", "--verify", "5", "--speculative"), "K must be in 2..4"),
    Case("diff-two-modes", diff_tiny("--steps", "4", "--verify", "2", "--swap"), "give one mode"),
    Case("diff-steps-not-int", diff_tiny("--steps", "many"), "--steps"),
    Case("diff-bad-forward", diff_tiny("--steps", "4", "--forwards", "nope"), "unknown nope"),
    Case("diff-bad-ladder", diff_tiny("--steps", "4", "--speculative", "--mtp-k-ladder", "4:0"), "K ladder"),
    Case(
        "generate-serve-flag-twice",
        lambda tmp, saved: [
            "generate",
            "--checkpoint",
            "tiny",
            "--prompt",
            "hi",
            "--max-seq-len",
            "64",
            "--max-seq-len",
            "128",
        ],
        "--max-seq-len",
    ),
    Case(
        "recipe-not-utf8",
        lambda tmp, saved: [
            "memory",
            "--no-activations",
            "--checkpoint",
            "tiny",
            "--device",
            "H200",
            "--isl",
            "8",
            "--osl",
            "8",
            "--concurrency",
            "1",
            "--root",
            str(_write(tmp / "recipes" / "fam" / "bin.yaml", b"\x00\xff\xfe binary").parents[1]),
            "--recipe",
            "fam/bin",
        ],
        "fam/bin",
    ),
    Case(
        "recipe-unknown",
        lambda tmp, saved: memory_tiny()(tmp, saved)[:-1] + ["--recipe", "fam/none"],
        "unknown recipe",
    ),
]

SIZE_CASES = [
    Case("diff-steps-huge", diff_tiny("--steps", str(10**9)), "needs"),
    Case("diff-max-seq-len-huge", diff_tiny("--steps", "4", "--max-seq-len", str(10**10)), "needs"),
    Case(
        "logits-decode-huge",
        lambda tmp, saved: ["logits", "--checkpoint", "tiny", "--tokens", "1", "--decode", str(10**9)],
        "needs",
    ),
    Case(
        "logits-decode-huge-keeps-old-out",
        lambda tmp, saved: [
            "logits",
            "--checkpoint",
            "tiny",
            "--tokens",
            "1",
            "--decode",
            str(10**9),
            "--out",
            str(_with_old_report(tmp, "l.npy")),
        ],
        "needs",
    ),
]

OUTPUT_CASES = [
    Case(
        "logits-out-under-a-file",
        lambda tmp, saved: [
            "logits",
            "--checkpoint",
            "tiny",
            "--tokens",
            "1",
            "--out",
            str(_write(tmp / "plain", b"x") / "l.npy"),
        ],
        "--out",
    ),
    Case(
        "logits-out-in-proc",
        lambda tmp, saved: ["logits", "--checkpoint", "tiny", "--tokens", "1", "--out", "/proc/metrale-l.npy"],
        "--out",
    ),
    Case(
        "logits-out-a-directory",
        lambda tmp, saved: ["logits", "--checkpoint", "tiny", "--tokens", "1", "--out", str(tmp)],
        "directory",
    ),
    Case(
        "diff-out-under-a-file",
        lambda tmp, saved: [
            "diff",
            "--checkpoint",
            "tiny",
            "--steps",
            "2",
            "--out",
            str(_write(tmp / "plain", b"x") / "r.json"),
        ],
        "--out",
    ),
    Case(
        "diff-out-in-proc",
        lambda tmp, saved: ["diff", "--checkpoint", "tiny", "--steps", "2", "--out", "/proc/metrale-r.json"],
        "--out",
    ),
    Case(
        "diff-bad-request-keeps-old-out",
        lambda tmp, saved: [
            "diff",
            "--checkpoint",
            "tiny",
            "--steps",
            "1",
            "--out",
            str(_with_old_report(tmp, "r.json")),
        ],
        "--steps must be at least 2",
    ),
]

TEXT_CASES = [
    Case(
        "tokens-file-not-utf8",
        lambda tmp, saved: [
            "logits",
            "--checkpoint",
            "tiny",
            "--tokens-file",
            str(_write(tmp / "t.txt", b"1 2 \xff 3")),
        ],
        "byte 0xff at byte offset 4",
    ),
    Case(
        "tokens-file-not-integers",
        lambda tmp, saved: ["logits", "--checkpoint", "tiny", "--tokens-file", str(_write(tmp / "t.txt", b"1 x"))],
        "must be integers",
    ),
    Case(
        "tokens-outside-vocab",
        lambda tmp, saved: ["logits", "--checkpoint", "tiny", "--tokens", "1,999"],
        "outside the vocabulary",
    ),
    Case(
        "tokens-negative-via-file",
        lambda tmp, saved: ["logits", "--checkpoint", "tiny", "--tokens-file", str(_write(tmp / "t.txt", b"-1"))],
        "outside the vocabulary",
    ),
    Case(
        "tokens-both-sources",
        lambda tmp, saved: ["logits", "--checkpoint", "tiny", "--tokens", "1", "--tokens-file", "/nonexistent"],
        "--tokens-file",
    ),
    Case(
        "prompt-undecodable",
        lambda tmp, saved: ["generate", "--checkpoint", "tiny", "--prompt", "ab\udcffc", "--max-new-tokens", "1"],
        "offset 2",
    ),
    Case(
        "tokenizer-not-utf8",
        lambda tmp, saved: [
            "generate",
            "--checkpoint",
            str(ckpt(tmp, saved, edit=lambda d: _write(d / "tokenizer.json", b'{"type": "\xff"}'))),
            "--prompt",
            "hi",
        ],
        "tokenizer.json: not UTF-8 text",
    ),
    Case("checkpoint-unknown", lambda tmp, saved: ["logits", "--checkpoint", "nope", "--tokens", "1"], "nope"),
]

ALL = CHECKPOINT_CASES + CONFIG_CASES + SERVE_CASES + SIZE_CASES + OUTPUT_CASES + TEXT_CASES


def _snapshot(root: Path) -> dict[str, str]:
    """Every path under `root` (hidden ones included) → a digest of its bytes ("dir" for a folder)."""
    return {
        str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
    }


@pytest.mark.parametrize("case", ALL, ids=[c.id for c in ALL])
def test_bad_input_is_one_error_line_exit_2_and_leaves_nothing(case, saved, tmp_path):
    argv = case.build(tmp_path, saved)
    before = _snapshot(tmp_path)
    r = CliRunner().invoke(cli, argv)
    assert "Traceback" not in r.output, r.output
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    errors = [line for line in r.stderr.splitlines() if line.lower().startswith("error:")]
    assert len(errors) == 1, r.stderr
    assert case.needle in errors[0], errors[0]
    assert _snapshot(tmp_path) == before
    assert not Path("/proc/metrale-l.npy").exists()
