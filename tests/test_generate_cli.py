"""`metrale-jax generate` (the command object; `cli/main.py` wires it): text out, the same
continuation with and without the drafter, acceptance statistics, one-line user errors."""

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


def test_greedy_prints_text(greedy):
    assert greedy.exit_code == 0, greedy.output
    assert "small: 47 prompt tokens, 24 generated (plain greedy" in greedy.output
    assert "decode steps: 23 after the prefill" in greedy.output


def test_speculative_prints_the_same_text_and_acceptance(greedy):
    res = _run("--max-new-tokens", "24", "--speculative", "--num-drafts", "3")
    assert res.exit_code == 0, res.output
    assert _continuation(res.output) == _continuation(greedy.output)
    assert "up to 3 MTP draft(s) per verify" in res.output
    assert "acceptance by draft position: 1: " in res.output and "tokens per verify row" in res.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num-drafts", "3"], "error: --num-drafts 3 needs --speculative"),
        (["--confidence-stop", "-1"], "error: --confidence-stop needs --speculative"),
        (["--speculative", "--max-seq-len", "32"], "error: sequence 0 would reach"),
    ],
)
def test_user_errors_are_one_line(args, message):
    res = _run(*args)
    assert res.exit_code == 2 and res.output.startswith(message), res.output


def test_bad_checkpoint_and_empty_prompt():
    res = CliRunner().invoke(generate, ["--checkpoint", "nope", "--prompt", "x"])
    assert res.exit_code == 2 and "error: --checkpoint 'nope'" in res.output
    res = CliRunner().invoke(generate, ["--checkpoint", "small", "--prompt", ""])
    assert res.exit_code == 2 and "error: --prompt is empty" in res.output
