"""The byte-level tokenizer of the shipped small model (and of any byte-vocabulary checkpoint).

Owns: `ByteTokenizer` (UTF-8 bytes are ids 0..255; special tokens follow from 256), its
`tokenizer.json` form, and `tokenizer_for`, which finds the tokenizer of a `--checkpoint` value.

Invariants:
- `decode(encode(text)) == text` for every str UTF-8 can hold (no normalisation, no unknown
  token); any other str is refused by `encode` with the byte offset of its first bad character.
- Special ids are never produced by `encode`; `decode` renders them by name, and bytes that do
  not form valid UTF-8 (a continuation cut mid-character) as U+FFFD.
- The file format is self-contained JSON (`{"type": "bytes", "special_tokens": {...}}`): no
  vocabulary file, no download.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence

from metrale_jax.errors import MetraleError, read_text

TOKENIZER_FILE = "tokenizer.json"
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


def load_tokenizer(directory: str) -> ByteTokenizer:
    """Read `directory/tokenizer.json`. Raises TokenizerError when absent or malformed."""
    path = os.path.join(directory, TOKENIZER_FILE)
    if not os.path.exists(path):
        raise TokenizerError(f"no {TOKENIZER_FILE} in {directory}")
    try:
        raw = json.loads(read_text(path, TokenizerError))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict) or raw.get("type") != "bytes":
        raise TokenizerError(f'{path}: only byte-level tokenizers (type "bytes") are supported')
    specials = raw.get("special_tokens", {})
    if not isinstance(specials, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in specials.values()
    ):
        raise TokenizerError(f"{path}: special_tokens must map names to integer ids")
    return ByteTokenizer(specials)


def tokenizer_for(checkpoint_dir: str | None, vocab_size: int) -> ByteTokenizer:
    """The tokenizer of a checkpoint: its tokenizer.json when `checkpoint_dir` has one, else (a
    seeded preset, or a directory without one) plain bytes when the vocabulary covers them.
    Raises TokenizerError when neither applies or the file disagrees with `vocab_size`."""
    if checkpoint_dir is not None and os.path.isfile(os.path.join(checkpoint_dir, TOKENIZER_FILE)):
        tok = load_tokenizer(checkpoint_dir)
        if tok.vocab_size > vocab_size:
            raise TokenizerError(f"{checkpoint_dir}: tokenizer has {tok.vocab_size} ids, the model only {vocab_size}")
        return tok
    if vocab_size >= 256:
        return ByteTokenizer({})
    raise TokenizerError(f"no tokenizer.json and a vocabulary of {vocab_size} < 256 ids: cannot encode text")
