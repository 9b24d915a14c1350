"""`metrale-jax generate` (the command object; `cli/main.py` wires it): text out, the same
continuation plain, fused and composed, acceptance statistics, compile time and steady state apart,
a clamped draft count said, and one-line user errors, oversized requests refused before anything
is allocated; `--chat` on an HF fixture against HF's greedy generate, stopping at EOS, and text
problems refused before the weights are read."""

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from metrale_jax.engine.speculative import Generation, SequenceParams
from metrale_jax.tokenizer import load_tokenizer
from metrale_jax_cli.generate_cmd import generate, prompt_ids

SPEC = ("--speculative", "--num-drafts", "3")

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
    assert "summed over them" in greedy.output and "steady state: " in greedy.output
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


# ---------------------------------------------------------------- --chat, EOS, the checkpoint's tokenizer

CHAT_MODEL = Path(__file__).parent / "fixtures" / "hf" / "qwen3_5_dense"
CHAT_GOLDEN = json.loads((CHAT_MODEL / "chat_golden.json").read_text())


def _chat(case: dict, *args: str):
    return CliRunner().invoke(
        generate,
        ["--checkpoint", str(CHAT_MODEL), "--chat", "--system", case["system"], "--prompt", case["user"], *args],
    )


@pytest.mark.parametrize("kind", ["stops_at_eos", "runs_to_max"])
def test_chat_prompt_ids_equal_transformers(kind):
    case = CHAT_GOLDEN["cases"][kind]
    tok, ids = prompt_ids(str(CHAT_MODEL), 256, case["user"], True, case["system"], None)
    assert ids == case["prompt_ids"]


@pytest.mark.parametrize("kind, args", [("stops_at_eos", ()), ("runs_to_max", ()), ("stops_at_eos", SPEC)])
def test_chat_generates_hf_greedy_tokens_and_stops_at_eos(kind, args):
    """HF's greedy `generate` (float32) from the same rendered chat prompt: the same text, the same
    count, ending at the EOS id where HF ended (plain and speculative)."""
    case, n = CHAT_GOLDEN["cases"][kind], CHAT_GOLDEN["max_new_tokens"]
    res = _chat(case, "--max-new-tokens", str(n), *args)
    assert res.exit_code == 0, res.output
    tok = load_tokenizer(str(CHAT_MODEL))
    want = case["generated"]
    ended = " (ended at EOS)" if want[-1] in CHAT_GOLDEN["eos_token_id"] else ""
    assert f"{len(case['prompt_ids'])} prompt tokens, {len(want)} generated{ended} (" in res.output
    assert (kind == "stops_at_eos") == bool(ended) and (len(want) < n) == bool(ended)
    assert tok.decode(case["prompt_ids"]) + tok.decode(want) + "\n" in res.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--system", "s"], "error: --system needs --chat"),
        (["--no-thinking"], "error: --thinking/--no-thinking needs --chat"),
        (["--chat"], "error: --chat needs a checkpoint directory with a chat template"),
    ],
)
def test_chat_flag_errors(args, message):
    res = CliRunner().invoke(generate, ["--checkpoint", "tiny", "--prompt", "x", *args])
    assert res.exit_code == 2 and res.output.startswith(message), res.output


@pytest.mark.parametrize(
    "edit, args, message",
    [
        (lambda d: (d / "tokenizer.json").write_text("{not json"), (), "tokenizer.json is not valid JSON"),
        (lambda d: (d / "tokenizer.json").write_text('{"a": 1}'), (), "neither a byte-level tokenizer"),
        (lambda d: None, ("--prompt", "café"), "cannot encode the text: character U+00E9"),
        (lambda d: (d / "chat_template.jinja").write_text("{{ raise_exception('no') }}"), ("--chat",), "render"),
        (lambda d: (d / "chat_template.jinja").write_text("{% if %}"), ("--chat",), "does not compile"),
    ],
)
def test_text_problems_are_refused_before_the_weights_are_read(tmp_path, edit, args, message):
    """The copy has no weights at all: each refusal comes before the loader would miss them."""
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(CHAT_MODEL / name, tmp_path)
    edit(tmp_path)
    res = CliRunner().invoke(generate, ["--checkpoint", str(tmp_path), "--prompt", "hi", *args])
    assert res.exit_code == 2 and res.output.startswith("error: ") and message in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1


def test_a_generation_ends_after_its_first_stop_id():
    g = Generation(SequenceParams(5, frozenset({7, 9})), None, [1, 2])  # type: ignore[arg-type]
    assert (g.limit, g.remaining, g.emitted) == (5, 3, 2)
    g.tokens += [7, 8, 9]  # a verify may accept drafts past the stop id: they are not emitted
    assert (g.limit, g.remaining, g.emitted) == (3, -2, 3)
    assert Generation(SequenceParams(2), None, [7, 7, 7]).limit == 2  # type: ignore[arg-type]


def test_a_hub_id_reads_its_snapshot_in_the_hf_cache(tmp_path, monkeypatch):
    snap = tmp_path / "models--org--chat" / "snapshots" / "r1"
    snap.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(CHAT_MODEL / name, snap)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    res = CliRunner().invoke(generate, ["--checkpoint", "org/chat", "--prompt", "naïve"])
    assert res.exit_code == 2 and f"the vocabulary of {snap}/tokenizer.json cannot encode" in res.output, res.output
    res = CliRunner().invoke(generate, ["--checkpoint", "org/absent", "--prompt", "x"])
    assert res.exit_code == 2 and f"nor a model in the Hugging Face cache ({tmp_path})" in res.output, res.output
