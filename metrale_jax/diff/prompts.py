"""The diff's prompts: fixed 64-bit LCG streams, so every report is comparable run to run.

Owns: the three generators (fixed seeds, lengths and token range):
`prompts` (decode, verify and swap modes), `batch_prompts` (batch and verify-batch modes) and
`prompt_of_len` (prefill mode).

Invariants:
- A generator's output is a pure function of its arguments (no global RNG, no platform).
- Tokens lie in `[64, 64 + max(vocab - 128, 1))`: clear of the special ids at both ends.
"""

from __future__ import annotations

_MASK = (1 << 64) - 1
_MUL = 6364136223846793005
_INC = 1442695040888963407
_GOLDEN = 0x9E3779B97F4A7C15


def _stream(seed: int, vocab: int):
    """Endless tokens of the LCG seeded with `seed` (state advanced before each token)."""
    span = max(vocab - 128, 1)
    x = seed & _MASK
    while True:
        x = (x * _MUL + _INC) & _MASK
        yield 64 + (x >> 33) % span


def _take(stream, lengths) -> list[list[int]]:
    return [[next(stream) for _ in range(n)] for n in lengths]


def prompts(n: int, vocab: int) -> list[list[int]]:
    """`n` prompts from one stream seeded 0x5eed0928; prompt i has 23 + 41 i tokens."""
    return _take(_stream(0x5EED0928, vocab), [23 + 41 * i for i in range(n)])


def batch_prompts(n: int, vocab: int) -> list[list[int]]:
    """The `n` prompts of a batch of width n, one stream seeded 0xba7c0928 ^ n; prompt i has
    12 + 7 (i mod 16) tokens, so the rows sit at different positions and block tables."""
    return _take(_stream(0xBA7C0928 ^ n, vocab), [12 + 7 * (i % 16) for i in range(n)])


def prompt_of_len(length: int, vocab: int) -> list[int]:
    """One prompt of `length` tokens, seeded 0x5eed1003 ^ (length * 0x9e3779b97f4a7c15 mod 2^64)."""
    return _take(_stream(0x5EED1003 ^ ((length * _GOLDEN) & _MASK), vocab), [length])[0]
