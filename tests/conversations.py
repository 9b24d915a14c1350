"""Token inputs shared by the prefix-cache and sampling-path tests (`test_prefix_cache`,
`test_sampling_paths`).

Owns: `random_tokens` (a reproducible byte-vocabulary prompt) and `conversations` (multi-turn
chats that share a system prompt, the workload that exercises prefix-cache misses, partial hits
and hits). Both are deterministic in their arguments."""

from __future__ import annotations

import numpy as np


def random_tokens(seed: int, n: int) -> list[int]:
    """`n` token ids in [0, 256), drawn from `seed`."""
    return [int(x) for x in np.random.default_rng(seed).integers(0, 256, size=n)]


def conversations(eng, turns, generate):
    """Two conversations sharing a system prompt, each turn's prompt its whole history plus a new
    user message, run concurrently through `generate(engine, prompts)`. Returns every turn's
    tokens."""
    system = random_tokens(1, 40)
    history = [system + random_tokens(10 + c, 5 + 3 * c) for c in range(2)]
    out = []
    for t in range(turns):
        got = generate(eng, history)
        out.append(got)
        history = [h + g + random_tokens(100 * t + c, 7 + 4 * c) for c, (h, g) in enumerate(zip(history, got))]
    return out
