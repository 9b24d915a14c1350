"""Probe `oracle-loop`: a speculative step against a greedy step, in the generation loop and alone, on a real
generation's arguments: the e2e section's oracle case (one prompt of 64 random tokens, 3 drafts each right with
probability 0.8, 48 new tokens).

    .venv/bin/python -m benchmarks oracle-loop [MODEL] [--rounds 4]

MODEL: a `benchmarks.models` name (default qwen3-next-h512). Per round, alternated in one process pinned to one core:
`greedy_generate` and `speculative_generate` (fused) timed step by step (the median interval between progress
reports), then each engine's program alone (`benchmarks.steps.DeviceStep`, captured on the first decode and the first
fused step of a generation: real tokens and routing). When the loop's step ratio is the programs' alone, the host adds
nothing and the ratio is the device's.
"""

import statistics

import click
import numpy as np

from benchmarks import models
from benchmarks.e2e import OracleDrafts
from benchmarks.steps import DeviceStep, max_seq_len_for
from metrale_jax.engine.engine import Engine
from metrale_jax.engine.speculative import DraftSchedule, greedy_generate, speculative_generate
from metrale_jax.engine.throughput import StepClock

NEW_TOKENS, PROMPT_LEN, DRAFTS, ACCEPT = 48, 64, 3, 0.8


def _median_step_ms(clock: StepClock) -> float:
    marks = clock.marks[1:]  # from the first step on (the first report follows the prefill)
    return 1e3 * statistics.median(b[0] - a[0] for a, b in zip(marks, marks[1:]))


@click.command("oracle-loop", help="A speculative step vs a greedy step, in the generation loop and alone (ms).")
@click.argument("model", default="qwen3-next-h512")
@click.option("--rounds", default=4, help="alternated rounds")
def command(model: str, rounds: int) -> None:
    cfg, params = models.model(model)
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(1, PROMPT_LEN)).tolist()
    base = dict(max_batch_size=1, max_seq_len=max_seq_len_for(PROMPT_LEN + NEW_TOKENS + DRAFTS + 2))
    greedy_engine = Engine(cfg, params, models.settings(**base))
    spec_engine = Engine(cfg, params, models.settings(**base, speculative=True, num_drafts=DRAFTS))
    continuation = greedy_generate(greedy_engine, prompts, NEW_TOKENS + DRAFTS + 1)
    source = OracleDrafts(prompts, continuation, ACCEPT, vocab=cfg.vocab_size, seed=0)
    schedule = DraftSchedule(DRAFTS, spec_engine.settings.k_ladder)

    def greedy() -> StepClock:
        clock = StepClock()
        greedy_generate(greedy_engine, prompts, NEW_TOKENS, progress=clock)
        return clock

    def speculative() -> tuple[StepClock, float]:
        clock = StepClock()
        res = speculative_generate(spec_engine, prompts, NEW_TOKENS, schedule, source, progress=clock)
        return clock, res.emitted / len(res.steps)

    speculative()  # compiles every program the timed calls run
    decode, _ = DeviceStep.capture(greedy_engine, greedy, "step_rows")
    fused, _ = DeviceStep.capture(spec_engine, speculative, "speculative_step")
    print(f"{model}, oracle drafts p={ACCEPT}, n = 1, {DRAFTS} drafts, {NEW_TOKENS} new tokens; ms, one core")
    for r in range(rounds):
        g = greedy()
        s, per_step = speculative()
        loop_g, loop_s = _median_step_ms(g), _median_step_ms(s)
        alone_g, alone_s = 1e3 * decode.time(10), 1e3 * fused.time(10)
        print(
            f"round {r}: loop greedy {loop_g:.2f} speculative {loop_s:.2f} ({loop_s / loop_g:.2f}x); alone decode "
            f"{alone_g:.2f} fused {alone_s:.2f} ({alone_s / alone_g:.2f}x); {per_step:.2f} tokens per step; tok/s "
            f"greedy {g.rate():.0f} speculative {s.rate():.0f} (x{s.rate() / g.rate():.2f})",
            flush=True,
        )
