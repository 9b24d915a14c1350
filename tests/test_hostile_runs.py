"""Hostile input that does not end in a plain exit 2, and the pieces the CLI table relies on.

- `--out` is written at exactly the path given, atomically: a full disk (here: a file-size limit)
  is one `error:` line, exit 2, no temporary file, and the earlier file intact.
- Ctrl-C in the first second (start-up) exits 130 with one line; an unexpected exception exits
  `INTERNAL_EXIT` (not diff's FAIL code 1) with one line pointing at a log that holds its traceback.
- A serve flag given twice is refused, never resolved to the last value.
- `diff` says which asked-for Ks the engine's slots cut (`DiffRequest.clamped`).
- The activation cache is untrusted input: malformed or foreign entries are ignored and
  rewritten; an unwritable cache directory is no cache, with a warning.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import click
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import settings

from metrale_jax.diff.request import DiffRequest
from metrale_jax.engine.capacity import pool_counts
from metrale_jax.engine.settings import SettingsError, resolve_settings
from metrale_jax.memory.activations import ActivationModel
from metrale_jax.model_registry import TINY
from metrale_jax_cli import logits_cmd
from metrale_jax_cli.errors import INTERNAL_EXIT, LOG_DIR_ENV, user_errors
from metrale_jax_cli.main import cli
from metrale_jax_cli.serve_flags import parse_serve_argv, pop_serve_raw, serve_options

REPO = Path(__file__).resolve().parents[1]
LOGITS = ["logits", "--checkpoint", "tiny", "--tokens", "1,2,3"]


#: Before the CLI starts, in the child: a write past 4 kB fails (EFBIG) instead of killing it.
SMALL_FILES = (
    "import resource, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
    "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)); "
)


def _metrale(args, setup: str = "") -> subprocess.Popen:
    """`metrale-jax ARGS` in a fresh interpreter on the CPU backend, after `setup` (Python)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    code = setup + "from metrale_jax_cli.main import cli; cli()"
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def test_out_is_the_path_given(tmp_path):
    out = tmp_path / "l.bin"
    r = CliRunner().invoke(cli, [*LOGITS, "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert f"wrote {out}" in r.output and sorted(os.listdir(tmp_path)) == ["l.bin"]
    assert np.load(out).shape == (3, 256)


def test_a_full_disk_keeps_the_earlier_out_and_leaves_no_temporary(tmp_path):
    out = tmp_path / "l.npy"
    out.write_bytes(b"an earlier run\n")
    p = _metrale([*LOGITS, "--decode", "4", "--out", str(out)], SMALL_FILES)  # 7 rows of 1 kB
    _, err = (s.decode() for s in p.communicate(timeout=300))
    assert p.returncode == 2, err
    assert "Traceback" not in err and len(_error_lines(err)) == 1 and "writing failed" in err
    assert out.read_bytes() == b"an earlier run\n" and sorted(os.listdir(tmp_path)) == ["l.npy"]


def test_ctrl_c_during_start_up_is_one_line_and_exit_130(tmp_path):
    out = tmp_path / "l.npy"
    out.write_bytes(b"an earlier run\n")
    p = _metrale([*LOGITS, "--out", str(out)])
    time.sleep(0.5)  # the interpreter is up, jax is not yet imported
    p.send_signal(signal.SIGINT)
    _, err = (s.decode() for s in p.communicate(timeout=300))
    assert p.returncode == 130, err
    assert err.strip() == "error: interrupted"
    assert out.read_bytes() == b"an earlier run\n" and sorted(os.listdir(tmp_path)) == ["l.npy"]


def test_an_internal_error_has_its_own_exit_code_and_a_log(tmp_path, monkeypatch):
    def boom(*_a, **_k):
        raise RuntimeError("boom")

    monkeypatch.setattr(logits_cmd, "prefill_and_decode", boom)
    monkeypatch.setenv(LOG_DIR_ENV, str(tmp_path))
    r = CliRunner().invoke(cli, LOGITS)
    assert r.exit_code == INTERNAL_EXIT != 1
    (line,) = _error_lines(r.stderr)
    (log,) = tmp_path.glob("metrale-jax-*.log")
    assert "internal error (RuntimeError: boom)" in line and str(log) in line and "Traceback" not in r.output
    assert "Traceback" in log.read_text() and "boom" in log.read_text()


# ---------------------------------------------------------------- serve flags given twice


@click.command()
@serve_options
@click.pass_context
@user_errors
def _probe(ctx, **kwargs):
    click.echo(sorted(pop_serve_raw(ctx, kwargs).items()))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--speculative", "--no-speculative"], "--speculative given 2 times (--speculative, --no-speculative)"),
        (["--max-seq-len", "64", "--max-seq-len", "64"], "--max-seq-len given 2 times"),
        (["--enable-prefix-caching", "--disable-prefix-caching"], "--enable-prefix-caching given 2 times"),
    ],
)
def test_a_serve_flag_given_twice_is_refused(argv, message):
    r = CliRunner().invoke(_probe, argv)
    (line,) = _error_lines(r.stderr)
    assert r.exit_code == 2 and line.startswith(f"error: {message}") and line.endswith(": give it once")


def test_a_serve_flag_given_once_parses():
    r = CliRunner().invoke(_probe, ["--no-speculative", "--max-seq-len", "64"])
    assert r.exit_code == 0 and r.output.strip() == "[('max_seq_len', 64), ('speculative', False)]"
    with pytest.raises(SettingsError, match="--block-size given 2 times"):
        parse_serve_argv(["m", "--block-size", "16", "--block-size", "32"])


# ---------------------------------------------------------------- clamped verify widths


def test_diff_names_the_ks_its_slots_cut(tiny):
    counts = pool_counts(settings(max_batch_size=12, speculative=True, num_drafts=3), tiny[0])  # slots 8.. hold 1
    assert DiffRequest(steps=2, verify=(4,)).clamped(counts) == []
    (line,) = DiffRequest(steps=2, verify_batch=(10,), verify_batch_ks=(4, 2)).clamped(counts)
    assert line.startswith("--verify-batch-ks 4: sequence(s) [8, 9] of --verify-batch 10 sit on slots that verify")
    narrow = pool_counts(settings(speculative=True, num_drafts=3, mtp_k_ladder="4:1"), tiny[0])
    assert DiffRequest(steps=2, verify=(4, 2)).clamped(narrow) == [
        "--verify 4: sequence(s) [0] sit on slots that verify at most K=2 (the K ladder and --num-drafts): "
        "they ran at their slot's K"
    ]


# ---------------------------------------------------------------- the activation cache


@pytest.fixture(scope="module")
def decode_cache(tmp_path_factory):
    """(model factory, settings, counts, the decode entry's path, the entry) of the tiny serve's
    decode program, compiled once into a module cache directory."""
    root = tmp_path_factory.mktemp("activations")
    s = resolve_settings({"max_batch_size": "1", "max_seq_len": 64}, None, auto_slots=1)
    counts = pool_counts(s, TINY)

    def model(cache_dir=root):
        return ActivationModel(TINY, jnp.float32, cache_dir=cache_dir, programs=("decode",))

    first = model()
    first.exact(s, counts)
    (p,) = first.programs_at(s, counts)
    path = root / f"{first._key(p)}.json"
    return model, s, counts, path, json.loads(path.read_text())


@pytest.mark.parametrize(
    "bad",
    [
        {},
        [1],
        "not json",
        {"temp_size_in_bytes": -1, "output_size_in_bytes": 0, "alias_size_in_bytes": 0},
        {"temp_size_in_bytes": True, "output_size_in_bytes": 0, "alias_size_in_bytes": 0},
        {"temp_size_in_bytes": 0, "output_size_in_bytes": 1, "alias_size_in_bytes": 2},
        "foreign",
    ],
    ids=["empty", "list", "text", "negative", "bool", "alias-over-output", "foreign"],
)
def test_a_malformed_or_foreign_cache_entry_is_not_read(decode_cache, bad):
    model, _, _, path, good = decode_cache
    text = bad if bad == "not json" else json.dumps({**good, "backend": "gpu"} if bad == "foreign" else bad)
    m = model()
    key = path.stem
    assert m._read(key) == good
    path.write_text(text)
    try:
        assert m._read(key) is None
    finally:
        path.write_text(json.dumps(good))


def test_a_malformed_cache_entry_is_recompiled_and_rewritten(decode_cache, tmp_path):
    model, s, counts, path, good = decode_cache
    (tmp_path / path.name).write_text("[1]")
    m = model(tmp_path)
    (row,) = m.exact(s, counts).values()
    assert (m.compiled, m.cache_hits, row.how) == (1, 0, "compiled")
    rewritten = json.loads((tmp_path / path.name).read_text())
    assert rewritten == {**good, "compile_seconds": rewritten["compile_seconds"]}
    assert sorted(x.name for x in tmp_path.iterdir()) == [path.name]


def test_an_unwritable_cache_is_no_cache_with_a_warning(decode_cache, tmp_path):
    model, s, counts, _, good = decode_cache
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    m = model(blocked / "cache")
    (row,) = m.exact(s, counts).values()
    assert row.how == "compiled" and row.temp == good["temp_size_in_bytes"]
    assert m.cache_warning is not None and "is not writable" in m.cache_warning
    assert sorted(x.name for x in tmp_path.iterdir()) == ["a-file"]


def test_ctrl_c_that_python_discards_in_a_gc_callback_still_ends_the_run(tmp_path):
    """SIGINT delivered while a garbage-collection callback runs (as JAX's does during start-up):
    Python discards the KeyboardInterrupt raised there, the command goes on, and still exits 130
    with one line and the earlier output untouched."""
    out = tmp_path / "l.npy"
    out.write_bytes(b"an earlier run\n")
    setup = (
        "import gc, os, signal\n"
        "def _in_gc(phase, info):\n"
        "    if not _in_gc.sent and signal.getsignal(signal.SIGINT) is not signal.default_int_handler:\n"
        "        _in_gc.sent = True\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "_in_gc.sent = False\n"
        "gc.callbacks.append(_in_gc)\n"
    )
    p = _metrale([*LOGITS, "--out", str(out)], setup)
    _, err = (s.decode() for s in p.communicate(timeout=300))
    assert p.returncode == 130, err
    assert err.strip() == "error: interrupted"
    assert out.read_bytes() == b"an earlier run\n" and sorted(os.listdir(tmp_path)) == ["l.npy"]
