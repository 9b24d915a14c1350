"""The training text: the Python standard library's own `.py` sources, as byte tokens.

Owns: which files are read (top-level `*.py` of a stdlib directory, default the running
interpreter's), the train/validation split, and the windows the loop and the evaluation read.

Invariants:
- The split is a pure function of file *names* (sha256 of the name, every n-th bucket is
  held out), so it is stable across machines and Python patch releases.
- Documents are joined as `bytes + <|endoftext|>`; a training window may cross a document
  boundary, as in GPT-style packing.
- `digest` identifies the exact bytes trained on (recorded in the training log).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
import sysconfig

import numpy as np

from metrale_jax.tokenizer import ByteTokenizer


def default_stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def is_validation_file(name: str, every_nth: int) -> bool:
    """Whether file `name` (a base name) is held out: its sha256 falls in bucket 0 of n."""
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % every_nth == 0


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Token arrays (uint16) of the two splits and the names of their files."""

    train: np.ndarray
    val: np.ndarray
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]
    digest: str

    def summary(self) -> dict:
        return {
            "train_files": len(self.train_files),
            "val_files": list(self.val_files),
            "train_tokens": int(self.train.size),
            "val_tokens": int(self.val.size),
            "sha256": self.digest,
        }


def load_corpus(directory: str, tokenizer: ByteTokenizer, every_nth: int) -> Corpus:
    """Read `directory/*.py` (sorted), split by name, encode each split. Raises FileNotFoundError
    when the directory holds no `.py` file."""
    paths = sorted(glob.glob(os.path.join(directory, "*.py")))
    if not paths:
        raise FileNotFoundError(f"no .py files in {directory}")
    h = hashlib.sha256()
    parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
    names: dict[bool, list[str]] = {False: [], True: []}
    for p in paths:
        with open(p, "rb") as f:
            data = f.read()
        name = os.path.basename(p)
        h.update(name.encode() + b"\0" + data)
        held = is_validation_file(name, every_nth)
        parts[held].append(np.frombuffer(data, np.uint8).astype(np.uint16))
        parts[held].append(np.array([tokenizer.eos_id], np.uint16))
        names[held].append(name)
    return Corpus(
        train=np.concatenate(parts[False]),
        val=np.concatenate(parts[True]),
        train_files=tuple(names[False]),
        val_files=tuple(names[True]),
        digest=h.hexdigest(),
    )


def random_windows(tokens: np.ndarray, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """`batch` windows of `length` tokens at uniform random offsets: int32 [batch, length]."""
    starts = rng.integers(0, tokens.size - length + 1, size=batch)
    return np.stack([tokens[s : s + length] for s in starts]).astype(np.int32)


def tiling_windows(tokens: np.ndarray, seq_len: int, limit: int | None = None) -> np.ndarray:
    """Windows of `seq_len + 2` tokens starting every `seq_len` tokens, so every token past the
    first is a next-token target exactly once: int32 [N, seq_len + 2]. `limit` keeps N of them,
    spread evenly over the text."""
    starts = np.arange(0, tokens.size - seq_len - 1, seq_len)
    if limit is not None and limit < starts.size:
        starts = starts[np.linspace(0, starts.size - 1, limit).round().astype(int)]
    return np.stack([tokens[s : s + seq_len + 2] for s in starts]).astype(np.int32)
