"""The checkpoint tokenizers: `tokenizer.json` through the `tokenizers` library against the ids
transformers' AutoTokenizer gave (recorded by scripts/make_tokenizer_fixtures.py in the HF venv;
no torch here), refusals of bad files and unencodable text, and the stop ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tokenizer_references import QWEN_BPE, reference, reference_folders

from metrale_jax.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    TokenizerError,
    load_tokenizer,
    stop_ids,
    tokenizer_for,
)

CHAT_MODEL = Path(__file__).parent / "fixtures" / "hf" / "qwen3_5_dense"


@pytest.mark.parametrize("folder", reference_folders())
def test_ids_equal_autotokenizer_on_1200_strings(folder):
    ref = reference(folder)
    tok = load_tokenizer(str(folder))
    assert isinstance(tok, HFTokenizer) and ref["tokenizer_class"] in ("Qwen2Tokenizer", "Qwen3_5Tokenizer")
    assert len(ref["strings"]) >= 1000
    kinds = "".join(ref["strings"])
    assert all(s in kinds for s in ("<|im_start|>", "</think>", "\t", "\r\n", "   ", "日本", "😀", "def "))
    wrong = [(s, ids) for s, ids in zip(ref["strings"], ref["ids"]) if tok.encode(s) != ids]
    assert not wrong, wrong[:3]
    for s in ref["strings"]:
        assert tok.decode(tok.encode(s)) == tok._normalised(s)


def test_qwen_specials_and_eos():
    tok = load_tokenizer(str(QWEN_BPE))
    first = tok.token_id("<|endoftext|>")
    # Qwen's order: <|endoftext|>, <|im_start|>, <|im_end|>, ..., <think> +24, </think> +25.
    assert [tok.token_id(t) for t in ("<|im_start|>", "<|im_end|>", "<think>", "</think>")] == [
        first + 1,
        first + 2,
        first + 24,
        first + 25,
    ]
    assert tok.eos_id == first + 2 and tok.vocab_size == first + 26
    assert tok.encode("<|im_start|>user\n")[0] == first + 1
    assert stop_ids(str(QWEN_BPE)) == {first + 2, first}


def test_stop_ids_fall_back_to_config_and_presets_have_none(tmp_path):
    assert stop_ids(None) == frozenset()
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": 7}}))
    assert stop_ids(str(tmp_path)) == {7}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    assert stop_ids(str(tmp_path)) == {3, 4}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(TokenizerError, match="eos_token_id must be"):
        stop_ids(str(tmp_path))
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(TokenizerError, match="not valid JSON"):
        stop_ids(str(tmp_path))


def test_text_the_vocabulary_cannot_hold_is_refused():
    tok = load_tokenizer(str(CHAT_MODEL))  # printable ASCII, tab and newline only
    assert tok.decode(tok.encode("Say hi.\n\tok")) == "Say hi.\n\tok"
    with pytest.raises(TokenizerError, match=r"U\+00E9 \('é'\) at offset 3"):
        tok.encode("café")
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([256])


@pytest.mark.parametrize(
    "content, match",
    [
        ("{", "not valid JSON"),
        ('{"model": {"type": "NoSuchModel"}}', "not a tokenizer the tokenizers library reads"),
        ('{"version": "1.0"}', "neither a byte-level tokenizer"),
        ("[1, 2]", "neither a byte-level tokenizer"),
    ],
)
def test_bad_tokenizer_files_are_one_line(tmp_path, content, match):
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(TokenizerError, match=match) as e:
        load_tokenizer(str(tmp_path))
    assert len(e.value.messages) == 1 and "\n" not in e.value.messages[0]


def test_config_special_token_must_exist_and_model_must_cover_ids(tmp_path):
    shutil.copy(QWEN_BPE / "tokenizer.json", tmp_path)
    cfg = json.loads((QWEN_BPE / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "eos_token": "<|nope|>"}))
    with pytest.raises(TokenizerError, match="eos_token '<\\|nope\\|>' is not a token"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match="826 ids, the model only 512"):
        tokenizer_for(str(tmp_path), 512)
    assert isinstance(tokenizer_for(str(tmp_path), 1024), HFTokenizer)
    assert isinstance(tokenizer_for(None, 300), ByteTokenizer)


def test_byte_fallback_encodes_characters_outside_the_vocabulary(tmp_path):
    """A sentencepiece-style BPE (Metaspace, `byte_fallback`): a character without a token goes in
    as its UTF-8 bytes (`<0xE2>`...), so nothing is refused and the text comes back whole."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in ("▁", "h", "i", "▁h", "▁hi"):
        vocab[piece] = len(vocab)
    bpe = models.BPE(vocab, [("▁", "h"), ("▁h", "i")], unk_token="<unk>", byte_fallback=True)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(str(tmp_path))
    ids = loaded.encode("hi ☃")
    assert ids[0] == vocab["▁hi"] and [vocab[f"<0x{b:02X}>"] for b in "☃".encode()] == ids[-3:]
    assert loaded.decode(ids) == "hi ☃"
