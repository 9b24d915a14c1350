#!/usr/bin/env python3
"""Build the tokenizer and chat-template fixtures, with Hugging Face's answers recorded.

Run it in the HF fixture venv (``scripts/make_hf_fixtures.sh`` makes it; `make_hf_fixtures.py`
calls `main` after the model fixtures). It needs `tokenizers` and transformers 5.x, and torch only
for `--chat-model` (HF's greedy generate on a model fixture); never the network.

Writes
* ``tests/fixtures/tokenizers/qwen_bpe/``: a Qwen-style byte-level BPE trained here (Qwen2's split
  regex, NFC, the byte-level alphabet, ~550 merges) with Qwen's 26 added tokens after the vocabulary
  (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, ... `<think>`, `</think>` in Qwen's order),
  ``tokenizer_config.json`` (`Qwen2Tokenizer`, eos `<|im_end|>`, a ChatML template with thinking),
  ``generation_config.json`` (eos = [end of turn, end of text]) and ``hf_reference.json``:
  AutoTokenizer's ids for >= 1,000 strings (unicode, whitespace runs, special tokens, code) and
  `apply_chat_template`'s text and ids for conversations with and without `enable_thinking`.
* the same files for a model fixture (`--chat-model`, default `tests/fixtures/hf/qwen3_5_dense`,
  vocabulary 256): a BPE over printable ASCII, tab and newline whose 26 added tokens end at the
  model's last id, and ``chat_golden.json``: HF's greedy `generate` (float32) from rendered chat
  prompts, one stopping at the end-of-turn token and one running to `max_new_tokens`.

Everything is seeded; BPE training on a fixed corpus is deterministic, so reruns give the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import numpy as np  # noqa: E402
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402

#: Qwen2's pre-tokenizer split (transformers' `Qwen2Tokenizer.PRETOKENIZE_REGEX`).
QWEN_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

#: Qwen's added tokens in id order (Qwen3.5: `<|endoftext|>` 248044 ... `<think>` 248068, `</think>` 248069);
#: the `<|...|>` ones are special, the tag-like ones ordinary added tokens.
QWEN_ADDED = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
    "</tool_response>", "<think>", "</think>",
]  # fmt: skip

#: A ChatML template with Qwen3.5-style thinking, written for these fixtures. Some blocks use no
#: whitespace control, so the output depends on trim_blocks / lstrip_blocks as transformers sets them;
#: `tojson` renders tools (non-ASCII kept), `raise_exception` refuses unknown roles.
CHAT_TEMPLATE = """{%- if not messages %}{{ raise_exception('the conversation is empty') }}{% endif %}
{% if tools %}
<|im_start|>system
# Tools
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
<|im_end|>
{% endif %}
{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' ~ message.role) }}
    {%- endif %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'assistant' %}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
        {%- if not reasoning and '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1] %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if loop.last or preserve_thinking %}
            {{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- content.strip('\\n') + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}
<think>

</think>

{% else %}
<think>
{% endif %}
{% endif %}
"""

WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an have not which but all "
    "model token state layer cache draft verify accept prefill decode greedy sample batch slot block prompt "
    "return def class import self value index length weight matrix vector tensor shape dtype float int "
    "hello world question answer think reason user system assistant tool call result error line file"
).split()
UNICODE = [
    "café", "naïve", "Ångström", "straße", "Ελληνικά", "русский", "日本語の文章", "中文分词测试", "한국어",
    "עברית", "العربية", "हिन्दी", "ไทย", "emoji 😀🎉👍🏽", "👨‍👩‍👧", "e\u0301", "A\u030a", "ﬁ", "½ ⅓",
    "\u00a0nbsp", "zero\u200bwidth", "tab\u3000ideographic", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "☃ ♥ ★", "Ⅻ ⑫", "ｆｕｌｌｗｉｄｔｈ",
]  # fmt: skip
CODE = [
    "def f(x):\n    return x + 1\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * 2; }",
    "if __name__ == '__main__':\n\tmain()\n",
    "SELECT id, name FROM users WHERE age >= 18;",
    "x = {'a': [1, 2, 3], \"b\": None}  # comment",
    "fn main() -> Result<(), Box<dyn Error>> {\n    Ok(())\n}",
    '<div class="x">&amp;</div>',
    "λx. x y → (x y)",
    'print(f"{value:>10.3f}")',
    "a && b || !c; x <<= 2; y >>= 3;",
    "#include <stdio.h>\r\nint main(void) { return 0; }\r\n",
    "    \n\n\t\t  x",
]
WHITESPACE = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "\t \t", "    ", "\n   \n", "\u3000", "\u00a0"]
CONTRACTIONS = ["it's", "I'M", "we've", "they'll", "you'd", "don't", "O'Reilly", "'s", "'LL"]


def training_corpus(rng: np.random.Generator, alphabet: str | None) -> list[str]:
    """A fixed mix of words, code, numbers and (unless `alphabet` restricts it) unicode."""
    lines = []
    for _ in range(3000):
        k = int(rng.integers(3, 14))
        words = [w if rng.random() < 0.7 else w.capitalize() + "ing" for w in rng.choice(WORDS, k)]
        lines.append(" ".join(words) + str(rng.choice([".", ",", "?", "!", ":", ""])))
    lines += CODE * 20 + [str(int(rng.integers(0, 100000))) for _ in range(200)]
    if alphabet is None:
        lines += UNICODE * 8
    else:
        lines = ["".join(c for c in line if c in alphabet) for line in lines]
    return lines


def build_bpe(corpus: list[str], vocab_size: int, alphabet: list[str], first_added_id: int | None = None) -> Tokenizer:
    """A Qwen2-style byte-level BPE over `corpus` (vocab ids 0..vocab_size-1), then Qwen's added
    tokens from `first_added_id` (default vocab_size; a released size such as Qwen3.5's 248044 fills
    the ids between with `pad_vocab`'s unreachable entries)."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    if first_added_id is not None and first_added_id > vocab_size:
        tok = pad_vocab(tok, first_added_id)
    tok.add_tokens([AddedToken(t, special=t.startswith("<|"), normalized=False) for t in QWEN_ADDED])
    return tok


def pad_vocab(tok: Tokenizer, size: int) -> Tokenizer:
    """`tok` (no added tokens yet) with its BPE vocabulary filled to `size` ids by entries no merge
    produces (`<reserved_i>`), so the added tokens get a released tokenizer's ids."""
    raw = json.loads(tok.to_str())
    vocab = raw["model"]["vocab"]
    vocab.update({f"<reserved_{i}>": i for i in range(len(vocab), size)})
    return Tokenizer.from_str(json.dumps(raw))


def tokenizer_config(tok: Tokenizer) -> dict:
    ids = {t: tok.token_to_id(t) for t in QWEN_ADDED}
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": {
            str(ids[t]): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": t.startswith("<|"),
            }
            for t in QWEN_ADDED
        },
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "model_max_length": 262144,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer(folder: Path, tok: Tokenizer) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    with open(folder / "tokenizer_config.json", "w") as f:
        json.dump(tokenizer_config(tok), f, indent=2, ensure_ascii=False)
        f.write("\n")
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    gen = {"bos_token_id": eos[1], "eos_token_id": eos, "pad_token_id": eos[1], "do_sample": False}
    with open(folder / "generation_config.json", "w") as f:
        json.dump(gen, f, indent=2)
        f.write("\n")


def test_strings(rng: np.random.Generator, n: int) -> list[str]:
    """n strings mixing words, unicode, whitespace runs, added tokens, code and contractions."""
    pools = [WORDS, UNICODE, WHITESPACE, QWEN_ADDED, CODE, CONTRACTIONS, [str(i) for i in (0, 7, 42, 1234, 99999)]]
    out = list(UNICODE + WHITESPACE + CODE + CONTRACTIONS + QWEN_ADDED)
    while len(out) < n:
        parts = []
        for _ in range(int(rng.integers(1, 9))):
            pool = pools[int(rng.integers(0, len(pools)))]
            parts.append(str(pool[int(rng.integers(0, len(pool)))]))
            parts.append(str(rng.choice(["", " ", " ", "  ", "\n", "\t", "   "])))
        out.append("".join(parts))
    return out


#: Conversations rendered with and without enable_thinking (and the other template variables).
CONVERSATIONS: list[dict] = [
    {"messages": [{"role": "user", "content": "Hello!"}], "kwargs": {"add_generation_prompt": True}},
    {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Why is the sky blue?"},
        ],
        "kwargs": {"add_generation_prompt": True, "enable_thinking": False},
    },
    {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Why is the sky blue?"},
        ],
        "kwargs": {"add_generation_prompt": True, "enable_thinking": True},
    },
    {
        "messages": [
            {"role": "system", "content": "Answer in one line."},
            {"role": "user", "content": "2 + 2?"},
            {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
            {"role": "user", "content": "Und 3 + 3? ☃"},
        ],
        "kwargs": {"add_generation_prompt": True, "enable_thinking": False},
    },
    {
        "messages": [
            {"role": "user", "content": "2 + 2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "add them"},
            {"role": "user", "content": "and 3 + 3?"},
            {"role": "assistant", "content": "6", "reasoning_content": "again"},
        ],
        "kwargs": {"add_generation_prompt": False, "preserve_thinking": True},
    },
    {
        "messages": [{"role": "user", "content": "weather in Zürich?"}],
        "kwargs": {
            "add_generation_prompt": True,
            "tools": [{"name": "weather", "description": "Wetter für eine Stadt", "parameters": {"city": "str"}}],
        },
    },
    {
        "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "  spaced\n\nlines  "}],
        "kwargs": {"add_generation_prompt": False},
    },
]


def hf_reference(folder: Path, n_strings: int, seed: int) -> dict:
    """AutoTokenizer's ids for the test strings and apply_chat_template's text and ids."""
    import transformers
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folder))
    strings = test_strings(np.random.default_rng(seed), n_strings)
    chats = []
    for conv in CONVERSATIONS:
        text = hf.apply_chat_template(conv["messages"], tokenize=False, **conv["kwargs"])
        ids = hf.apply_chat_template(conv["messages"], tokenize=True, return_dict=False, **conv["kwargs"])
        chats.append({**conv, "text": text, "ids": [int(i) for i in ids]})
    return {
        "transformers": transformers.__version__,
        "tokenizer_class": type(hf).__name__,
        "strings": strings,
        "ids": [hf.encode(s) for s in strings],
        "chats": chats,
    }


def write_hf_reference(folder: Path) -> dict:
    """`hf_reference` for the tokenizer in `folder` (1,200 strings), written as its `hf_reference.json`."""
    ref = hf_reference(folder, 1200, seed=1)
    with open(folder / "hf_reference.json", "w") as f:
        json.dump(ref, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    return ref


def chat_golden(folder: Path, max_new_tokens: int) -> dict:
    """HF's greedy generate (float32, eager) on the model fixture in `folder` from rendered chat
    prompts: the first system prompt of a fixed list whose output stops at an EOS id before
    max_new_tokens, and the first that runs to it."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen3_5ForCausalLM

    torch.set_num_threads(1)
    hf = AutoTokenizer.from_pretrained(str(folder))
    model = Qwen3_5ForCausalLM.from_pretrained(str(folder), attn_implementation="eager", dtype=torch.float32).eval()
    gen = GenerationConfig.from_pretrained(str(folder))
    cases: dict[str, dict] = {}
    for i in range(64):
        messages = [{"role": "system", "content": f"Be brief, case {i}."}, {"role": "user", "content": "Say hi."}]
        ids = hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), generation_config=gen, max_new_tokens=max_new_tokens, do_sample=False
            )
        new = [int(t) for t in out[0, len(ids) :]]
        kind = "stops_at_eos" if len(new) < max_new_tokens else "runs_to_max"
        if kind not in cases:
            cases[kind] = {"system": messages[0]["content"], "user": "Say hi.", "prompt_ids": ids, "generated": new}
        if len(cases) == 2:
            break
    return {"max_new_tokens": max_new_tokens, "eos_token_id": gen.eos_token_id, "cases": cases}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="tests/fixtures/tokenizers/qwen_bpe", type=Path)
    ap.add_argument("--chat-model", default="tests/fixtures/hf/qwen3_5_dense", type=Path)
    ap.add_argument("--no-chat-model", action="store_true")
    args = ap.parse_args(argv)

    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = build_bpe(training_corpus(np.random.default_rng(0), None), 800, byte_alphabet)
    write_tokenizer(args.out, tok)
    ref = write_hf_reference(args.out)
    print(f"{args.out}: {len(ref['strings'])} strings, {len(ref['chats'])} chats ({ref['tokenizer_class']})")

    if not args.no_chat_model:
        cfg = json.loads((args.chat_model / "config.json").read_text())
        vocab = cfg.get("text_config", cfg)["vocab_size"]
        ascii_text = "".join(chr(c) for c in range(32, 127)) + "\t\n"
        byte_map = {chr(c): a for c, a in zip(range(256), bytes_to_unicode_order())}
        alphabet = sorted({byte_map[c] for c in ascii_text})
        small = build_bpe(training_corpus(np.random.default_rng(0), ascii_text), vocab - len(QWEN_ADDED), alphabet)
        write_tokenizer(args.chat_model, small)
        golden = chat_golden(args.chat_model, max_new_tokens=24)
        with open(args.chat_model / "chat_golden.json", "w") as f:
            json.dump(golden, f, indent=1)
            f.write("\n")
        print(f"{args.chat_model}: chat cases {sorted(golden['cases'])}")
    return 0


def bytes_to_unicode_order() -> list[str]:
    """GPT-2's byte-to-character map, indexed by byte (the ByteLevel pre-tokenizer's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


if __name__ == "__main__":
    sys.exit(main())
