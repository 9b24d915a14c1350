"""`metrale-jax generate` (the command object; `cli/main.py` wires it): text out, the same
continuation plain, fused and composed, acceptance statistics, compile time and steady state apart,
a clamped draft count said, and one-line user errors, oversized requests refused before anything
is allocated."""

import pytest
from click.testing import CliRunner

from metrale_jax_cli.generate_cmd import generate

PROMPT = "class Stack:\n    def push(self, item):\n        "


def _run(*args):
    return CliRunner().invoke(generate, ["--checkpoint", "small", "--prompt", PROMPT, *args])


def _continuation(output: str) -> str:
    return output.split(PROMPT, 1)[1].split("\n\n", 1)[0]


@pytest.fixture(scope="module")
def greedy():
    return _run("--max-new-tokens", "24")


def test_greedy_prints_text_and_times(greedy):
    assert greedy.exit_code == 0, greedy.output
    assert "small: 47 prompt tokens, 24 generated (plain greedy" in greedy.output
    assert "decode steps: 23 after the prefill" in greedy.output
    assert "s of it compiling" in greedy.output and "steady state: " in greedy.output
    assert "tokens/s" in greedy.output.split("steady state: ", 1)[1]


def test_speculative_fused_prints_the_same_text_and_acceptance(greedy):
    res = _run("--max-new-tokens", "24", "--speculative", "--num-drafts", "3")
    assert res.exit_code == 0, res.output
    assert _continuation(res.output) == _continuation(greedy.output)
    assert "speculative, fused step, up to 3 MTP draft(s) per verify" in res.output
    assert "acceptance by draft position: 1: " in res.output and "tokens per verify row" in res.output
    assert "note:" not in res.output


def test_composed_step_and_clamped_drafts_say_so(greedy):
    res = _run("--max-new-tokens", "24", "--speculative", "--num-drafts", "64", "--step", "composed")
    assert res.exit_code == 0, res.output
    assert _continuation(res.output) == _continuation(greedy.output)
    assert "speculative, composed step, up to 3 MTP draft(s) per verify" in res.output
    assert "note: --num-drafts 64 clamped to 3: the K ladder 4:3,8:3,16:1,32:1" in res.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num-drafts", "3"], "error: --num-drafts 3 needs --speculative"),
        (["--confidence-stop", "-1"], "error: --confidence-stop needs --speculative"),
        (["--step", "composed"], "error: --step composed needs --speculative"),
        (
            ["--speculative", "--step", "fused", "--ssm-rollback-mode", "replay"],
            "error: --step fused needs --ssm-rollback-mode snapshot",
        ),
        (
            ["--speculative", "--max-seq-len", "32"],
            "error: --max-seq-len 32 is under the 113 tokens this request reaches (47 prompt + 64 new + 2 x 1: a "
            "verify's and the next propose's drafts)",
        ),
        (
            ["--max-new-tokens", "1000000000"],
            "error: the engine pool for 47 prompt + 1000000000 new tokens (max_seq_len 1000000048) needs ",
        ),
        (
            ["--speculative", "--num-drafts", "10000000", "--mtp-k-ladder", "1:10000000", "--max-new-tokens", "4"],
            "error: the engine pool for 47 prompt + 4 new tokens with 10000000 drafts (max_seq_len 20000064) needs ",
        ),
    ],
)
def test_user_errors_are_one_line(args, message):
    res = _run(*args)
    assert res.exit_code == 2 and res.output.startswith(message), res.output
    assert len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output


def test_bad_checkpoint_and_empty_prompt():
    res = CliRunner().invoke(generate, ["--checkpoint", "nope", "--prompt", "x"])
    assert res.exit_code == 2 and "error: --checkpoint 'nope'" in res.output
    res = CliRunner().invoke(generate, ["--checkpoint", "small", "--prompt", ""])
    assert res.exit_code == 2 and "error: --prompt is empty" in res.output
