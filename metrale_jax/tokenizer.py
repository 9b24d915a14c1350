"""The tokenizers of checkpoints: the byte-level one of the presets and `tokenizer.json` as the
ecosystem ships it (the `tokenizers` library), and the end-of-sequence ids a generation stops at.

Owns: `ByteTokenizer` (UTF-8 bytes are ids 0..255; special tokens follow from 256) and its
`tokenizer.json` form; `HFTokenizer` (a `tokenizers` tokenizer.json: BPE or any other model,
added and special tokens, byte fallback, with `tokenizer_config.json`'s special-token names);
`load_tokenizer` / `tokenizer_for`, which find the tokenizer of a `--checkpoint` value; and
`stop_ids`, the ids a generation ends at (`generation_config.json`, else `config.json`).

Invariants:
- `ByteTokenizer`: `decode(encode(text)) == text` for every str UTF-8 can hold (no normalisation,
  no unknown token); any other str is refused by `encode` with the byte offset of its first bad
  character. Special ids are never produced by `encode`; `decode` renders them by name, and bytes
  that do not form valid UTF-8 (a continuation cut mid-character) as U+FFFD. The file format is
  self-contained JSON (`{"type": "bytes", "special_tokens": {...}}`).
- `HFTokenizer.encode` gives the ids transformers' `AutoTokenizer(...).encode` gives (the same
  tokenizer.json through the same library; tests/test_tokenizers.py checks 1,200 strings), and
  refuses text its vocabulary cannot hold: `decode(encode(text))` must give back the text or its
  normalised form, so a character the model drops or maps to an unknown token is named, never lost
  silently.
- A file that is not JSON or not a tokenizer is one `TokenizerError` line; every check here reads
  only the small text files, never the weights, so commands run them before loading.
- Nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from metrale_jax.errors import MetraleError, read_text

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
#: The end-of-text token separating documents in training data.
END_OF_TEXT = "<|endoftext|>"


class TokenizerError(MetraleError, ValueError):
    """A tokenizer file that cannot be read, or a checkpoint without a usable tokenizer."""


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then `special_tokens` (name -> id, ids 256, 257, ...)."""

    special_tokens: Mapping[str, int] = dataclasses.field(default_factory=lambda: {END_OF_TEXT: 256})

    def __post_init__(self):
        ids = sorted(self.special_tokens.values())
        if ids != list(range(256, 256 + len(ids))):
            raise TokenizerError(f"special token ids must be 256, 257, ... in some order, got {ids}")

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.special_tokens)

    @property
    def eos_id(self) -> int | None:
        return self.special_tokens.get(END_OF_TEXT)

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text` as ids. Raises TokenizerError naming the byte offset of the
        first character UTF-8 cannot hold (a byte that did not decode, kept by the OS as a lone
        surrogate, as in a command-line argument)."""
        try:
            return list(text.encode("utf-8"))
        except UnicodeEncodeError as e:
            c = ord(text[e.start])
            what = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"character U+{c:04X}"
            at = len(text[: e.start].encode("utf-8"))
            raise TokenizerError(f"text is not valid UTF-8: {what} at byte offset {at}") from None

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`: bytes decoded as UTF-8 (invalid runs -> U+FFFD), specials by name."""
        names = {v: k for k, v in self.special_tokens.items()}
        out: list[str] = []
        run = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            if i not in names:
                raise TokenizerError(f"id {i} is outside the vocabulary 0..{self.vocab_size - 1}")
            out.append(names[i])
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def to_json(self) -> dict:
        return {"type": "bytes", "special_tokens": dict(self.special_tokens)}

    def save(self, directory: str) -> None:
        with open(os.path.join(directory, TOKENIZER_FILE), "w") as f:
            json.dump(self.to_json(), f, indent=2)


def _token_name(value: object) -> str | None:
    """A special-token entry of tokenizer_config.json: a string, or an AddedToken dict's content."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


#: The special-token names transformers passes to a chat template (its `special_tokens_map`).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclasses.dataclass(frozen=True)
class HFTokenizer:
    """A `tokenizers` tokenizer.json (`tokenizer`: a `tokenizers.Tokenizer`) with the special-token
    names of tokenizer_config.json (`special_tokens`: e.g. {"eos_token": "<|im_end|>"}); `path`
    names the file in errors."""

    tokenizer: Any
    special_tokens: Mapping[str, str]
    path: str

    @property
    def vocab_size(self) -> int:
        """One past the largest id the tokenizer can produce (ids may be sparse)."""
        ids = self.tokenizer.get_vocab(with_added_tokens=True).values()
        return max(ids, default=-1) + 1

    @property
    def eos_id(self) -> int | None:
        name = self.special_tokens.get("eos_token")
        return None if name is None else self.tokenizer.token_to_id(name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`, with the tokenizer's own post-processing (a BOS, say) unless
        `add_special_tokens` is False, as `AutoTokenizer.encode` (a rendered chat template is
        encoded without it). Raises TokenizerError naming the first character the vocabulary
        cannot hold."""
        return list(self._encoding(text, add_special_tokens).ids)

    def encode_with_starts(self, text: str) -> tuple[list[int], list[int]]:
        """`encode(text)` and, per id, the character offset in `text` where its token starts
        (ids the post-processor adds start where the text does)."""
        enc = self._encoding(text, True)
        return list(enc.ids), [start for start, _ in enc.offsets]

    def _encoding(self, text: str, add_special_tokens: bool):
        try:
            enc = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception as e:  # the Rust side raises plain Exceptions (e.g. a lone surrogate)
            raise TokenizerError(f"text cannot be encoded by {self.path}: {str(e).splitlines()[0]}") from None
        back = self.tokenizer.decode(enc.ids, skip_special_tokens=False)
        want = text if back == text else self._normalised(text)
        if back != want:
            at = next((i for i, (a, b) in enumerate(zip(want, back)) if a != b), min(len(want), len(back)))
            what = f"character U+{ord(want[at]):04X} ({want[at]!r})" if at < len(want) else "its end"
            raise TokenizerError(
                f"the vocabulary of {self.path} cannot encode the text: {what} at offset {at} does not survive "
                "encoding (no token or byte fallback for it)"
            )
        return enc

    def _normalised(self, text: str) -> str:
        norm = self.tokenizer.normalizer
        if norm is None:
            return text
        # NOTE: added tokens are matched before normalisation; normalising them too is harmless for
        # the NFC/NFKC normalisers of causal LMs (their contents are ASCII).
        return norm.normalize_str(text)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens rendered by name. Raises TokenizerError for an id the
        tokenizer does not have."""
        for i in ids:
            if self.tokenizer.id_to_token(int(i)) is None:
                raise TokenizerError(f"id {int(i)} is outside the vocabulary of {self.path}")
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)


Tokenizer = ByteTokenizer | HFTokenizer


def _read_json(path: str) -> Any:
    try:
        return json.loads(read_text(path, TokenizerError))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from None


def special_token_names(directory: str) -> dict[str, str]:
    """tokenizer_config.json's special-token names (`SPECIAL_TOKEN_NAMES` that are set), {} when
    the file is absent. Raises TokenizerError when it is not a JSON object."""
    path = os.path.join(directory, TOKENIZER_CONFIG_FILE)
    if not os.path.isfile(path):
        return {}
    raw = _read_json(path)
    if not isinstance(raw, dict):
        raise TokenizerError(f"{path}: not a JSON object")
    names = {k: _token_name(raw.get(k)) for k in SPECIAL_TOKEN_NAMES}
    return {k: v for k, v in names.items() if v is not None}


def load_tokenizer(directory: str) -> Tokenizer:
    """Read `directory/tokenizer.json`: the byte-level form (`"type": "bytes"`) or a `tokenizers`
    tokenizer.json (with tokenizer_config.json's special-token names). Raises TokenizerError when
    absent, not JSON, or neither form."""
    path = os.path.join(directory, TOKENIZER_FILE)
    if not os.path.exists(path):
        raise TokenizerError(f"no {TOKENIZER_FILE} in {directory}")
    text = read_text(path, TokenizerError)
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from None
    if isinstance(raw, dict) and "model" in raw and raw.get("type") != "bytes":
        return _load_hf(path, text, directory)
    if not isinstance(raw, dict) or raw.get("type") != "bytes":
        raise TokenizerError(
            f'{path}: neither a byte-level tokenizer (type "bytes") nor a tokenizers-library tokenizer '
            '(no "model" entry)'
        )
    specials = raw.get("special_tokens", {})
    if not isinstance(specials, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in specials.values()
    ):
        raise TokenizerError(f"{path}: special_tokens must map names to integer ids")
    return ByteTokenizer(specials)


def _load_hf(path: str, text: str, directory: str) -> HFTokenizer:
    from tokenizers import Tokenizer as RustTokenizer

    try:
        tok = RustTokenizer.from_str(text)
    except Exception as e:  # the library raises plain Exceptions for a malformed file
        raise TokenizerError(
            f"{path}: not a tokenizer the tokenizers library reads: {str(e).splitlines()[0]}"
        ) from None
    names = special_token_names(directory)
    for key, name in names.items():
        if tok.token_to_id(name) is None:
            raise TokenizerError(f"{os.path.join(directory, TOKENIZER_CONFIG_FILE)}: {key} {name!r} is not a token")
    return HFTokenizer(tok, names, path)


def tokenizer_for(checkpoint_dir: str | None, vocab_size: int) -> Tokenizer:
    """The tokenizer of a checkpoint: its tokenizer.json when `checkpoint_dir` has one, else (a
    seeded preset, or a directory without one) plain bytes when the vocabulary covers them.
    Raises TokenizerError when neither applies or the file has ids past `vocab_size`."""
    if checkpoint_dir is not None and os.path.isfile(os.path.join(checkpoint_dir, TOKENIZER_FILE)):
        tok = load_tokenizer(checkpoint_dir)
        if tok.vocab_size > vocab_size:
            raise TokenizerError(f"{checkpoint_dir}: tokenizer has {tok.vocab_size} ids, the model only {vocab_size}")
        return tok
    if vocab_size >= 256:
        return ByteTokenizer({})
    raise TokenizerError(f"no tokenizer.json and a vocabulary of {vocab_size} < 256 ids: cannot encode text")


def _ids(value: object) -> list[int] | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    return None


def stop_ids(checkpoint_dir: str | None) -> frozenset[int]:
    """The ids a generation ends at, as HF's `generate` takes them: generation_config.json's
    `eos_token_id` (an id or a list), else config.json's (its `text_config`'s for a multimodal
    wrapper); empty for a preset or a directory that declares none. Raises TokenizerError for a
    generation_config.json that is not JSON or whose eos_token_id is not ids."""
    if checkpoint_dir is None:
        return frozenset()
    path = os.path.join(checkpoint_dir, GENERATION_CONFIG_FILE)
    if os.path.isfile(path):
        raw = _read_json(path)
        value = raw.get("eos_token_id") if isinstance(raw, dict) else None
        if value is None:
            return frozenset()
        ids = _ids(value)
        if ids is None:
            raise TokenizerError(f"{path}: eos_token_id must be an id or a list of ids, got {value!r}")
        return frozenset(ids)
    config = os.path.join(checkpoint_dir, "config.json")
    if not os.path.isfile(config):
        return frozenset()
    try:
        raw = json.loads(read_text(config, TokenizerError))
    except json.JSONDecodeError:
        return frozenset()  # the config loader reports a malformed config.json
    if not isinstance(raw, dict):
        return frozenset()
    text = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
    return frozenset(_ids(text.get("eos_token_id", raw.get("eos_token_id"))) or [])
