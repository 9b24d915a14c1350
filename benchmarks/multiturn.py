"""Section `multiturn`: multi-turn conversations with and without the prefix cache.

Why it exists: without prefix caching every turn of a conversation prefills its whole history
again; with it, a turn restores the longest cached block-aligned prefix (recurrent-state snapshot
plus shared KV blocks) and prefills only the rest. This section shows what that saves.

`conversations` conversations share one system prompt; each turn's prompt is the conversation's
whole history (system prompt, earlier user messages and generated tokens) plus a new user message
of `user_len` tokens; each turn generates `new_tokens` tokens greedily (decode steps) from a
fresh sequence, freed when the turn ends. The turns run conversation by conversation within a
turn index. Two engines with the same settings but `--enable-prefix-caching` run the same
conversations, after an untimed warm-up pass over conversations of the same lengths (another
namespace, other tokens), so no compilation is timed. Per engine: the prompt tokens, the tokens
the prefills computed, the hit rate (turns that restored), time to first token (the prefill of a
turn, the first token its argmax) per turn index, and whether both engines generated the same
tokens.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from benchmarks import models
from benchmarks.settings import Settings
from metrale_jax.engine.engine import Engine


def _conversations(eng: Engine, s: Settings, seed: int, namespace: str | None) -> dict:
    """Run the conversations of `seed` on `eng` (namespace None: uncached); per turn its prompt
    length, restored position, time to first token and generated tokens."""
    rng = np.random.default_rng(seed)
    vocab = eng.cfg.vocab_size
    system = rng.integers(0, vocab, size=s.multiturn_system_len).tolist()
    history = [list(system) for _ in range(s.multiturn_conversations)]
    turns = []
    for t in range(s.multiturn_turns):
        for c in range(s.multiturn_conversations):
            prompt = history[c] + rng.integers(0, vocab, size=s.multiturn_user_len).tolist()
            seq = eng.alloc_sequence(namespace)
            try:
                t0 = time.perf_counter()
                out = [int(eng.prefill(seq, prompt).argmax())]
                ttft = time.perf_counter() - t0
                while len(out) < s.multiturn_new_tokens:
                    out.append(int(eng.decode(seq, out[-1]).argmax()))
            finally:
                eng.free_sequence(seq)
            turns.append(
                {
                    "turn": t,
                    "conversation": c,
                    "prompt": len(prompt),
                    "restored": seq.restored_at,
                    "ttft_s": ttft,
                    "tokens": out,
                }
            )
            history[c] = prompt + out
    return {"turns": turns}


def _summary(turns: list[dict]) -> dict:
    prompt = sum(t["prompt"] for t in turns)
    computed = sum(t["prompt"] - t["restored"] for t in turns)
    per_turn = sorted({t["turn"] for t in turns})
    return {
        "prompt_tokens": prompt,
        "prefill_tokens": computed,
        "saved": 1 - computed / prompt,
        "hit_rate": sum(t["restored"] > 0 for t in turns) / len(turns),
        "ttft_median_s": [statistics.median(x["ttft_s"] for x in turns if x["turn"] == i) for i in per_turn],
        "ttft_total_s": sum(t["ttft_s"] for t in turns),
    }


def run(s: Settings) -> dict:
    """The section at `s.multiturn_model` (sizes: the `multiturn_*` settings)."""
    cfg, params = models.model(s.multiturn_model)
    total = s.multiturn_system_len + s.multiturn_turns * (s.multiturn_user_len + s.multiturn_new_tokens) + 1
    flags = dict(
        max_batch_size=2,
        max_seq_len=-(-total // 64) * 64,
        block_size=s.multiturn_block,
        max_prefill_tokens=s.multiturn_chunk,
    )
    modes = {}
    for name, cached in (("uncached", False), ("cached", True)):
        eng = Engine(cfg, params, models.settings(**flags, enable_prefix_caching=cached, ssm_cache_slots=64))
        _conversations(eng, s, s.seed + 1, "warm-up" if cached else None)
        modes[name] = _conversations(eng, s, s.seed, "timed" if cached else None)
    tokens = [[t["tokens"] for t in m["turns"]] for m in modes.values()]
    return {
        "model": s.multiturn_model,
        "conversations": s.multiturn_conversations,
        "turns": s.multiturn_turns,
        "system_len": s.multiturn_system_len,
        "user_len": s.multiturn_user_len,
        "new_tokens": s.multiturn_new_tokens,
        "block_size": s.multiturn_block,
        "prefill_chunk": s.multiturn_chunk,
        "same_tokens": tokens[0] == tokens[1],
        "modes": {name: {**_summary(m["turns"]), "turns": m["turns"]} for name, m in modes.items()},
    }
