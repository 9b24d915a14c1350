"""`metrale-jax logits`: the user's parity tool."""

import numpy as np
from click.testing import CliRunner

from metrale_jax.model.cache import prefill_and_decode
from metrale_jax.presets import resolve_checkpoint
from metrale_jax_cli.main import cli


def test_logits_writes_prompt_and_decode_rows(tmp_path):
    out = tmp_path / "l.npy"
    r = CliRunner().invoke(
        cli, ["logits", "--checkpoint", "tiny", "--tokens", "5,6,7", "--decode", "2", "--out", str(out)]
    )
    assert r.exit_code == 0, r.output
    lg = np.load(out)
    assert lg.shape == (5, 256) and lg.dtype == np.float32
    cfg, params = resolve_checkpoint("tiny")
    ref, fed = prefill_and_decode(params, cfg, [5, 6, 7], 2)
    np.testing.assert_array_equal(lg, np.asarray(ref))
    assert f"greedy continuation: {fed[0]},{fed[1]}" in r.output


def test_logits_tokens_file_and_errors(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("1 2\n3")
    r = CliRunner().invoke(cli, ["logits", "--checkpoint", "tiny", "--tokens-file", str(f)])
    assert r.exit_code == 0 and "3 rows (3 prompt + 0 decode)" in r.output
    for args, msg in (
        (["--tokens", "1,999"], "outside the vocabulary"),
        (["--tokens", "a,b"], "must be integers"),
        ([], "exactly one of --tokens and --tokens-file"),
    ):
        r = CliRunner().invoke(cli, ["logits", "--checkpoint", "tiny", *args])
        assert r.exit_code == 2 and msg in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(cli, ["logits", "--checkpoint", str(tmp_path), "--tokens", "1"])
    assert r.exit_code == 2 and "no config.json" in r.output
