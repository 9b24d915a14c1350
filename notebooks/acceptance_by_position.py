# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # How far into a draft chain does the MTP head stay right?
#
# The `small` preset (a byte-level Qwen3-Next-shaped model trained on the Python standard
# library, see `metrale_jax/presets_data/small/TRAINING.md`) drafts with its MTP head; every
# verify checks the drafts greedily. Draft *j* counts only if drafts 0..*j*-1 were accepted, so
# acceptance decays along the chain. This notebook measures, on held-out stdlib code:
#
# * acceptance by draft position (of the drafts verified there), and conditional on reaching it;
# * how many drafts a verify typically accepts;
# * that speculative output equals plain greedy output (the engine's invariant);
# * sampled, in both speculative sampling modes (gumbel: the drafter drafts with the target's
#   Gumbel noise; rejection: accept with min(1, p/q), resample the residual), acceptance by
#   position and tokens per verify against temperature; gumbel's measured match rate of a draft
#   with the target's draw against the coupling's bounds, (1 - TV)/(1 + TV) below and 1 - TV
#   above, and rejection's measured acceptance against 1 - TV, its expected value, TV computed
#   from the same logits (the drafter's and the target's filtered laws at each drafted position);
#   and the measured wall-clock speed-up of speculative over plain sampling in each mode, next to
#   greedy's.
#
# Fast mode (`METRALE_NOTEBOOK_FAST=1`, what CI runs) uses a handful of prompts; unset it for the
# full numbers. Figures go to `$METRALE_NOTEBOOK_OUT` (default `figures/`).

# %%
import os
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from metrale_jax import research
from metrale_jax.tokenizer import ByteTokenizer

FAST = os.environ.get("METRALE_NOTEBOOK_FAST", "0") == "1"
OUT = Path(os.environ.get("METRALE_NOTEBOOK_OUT", "figures"))
OUT.mkdir(parents=True, exist_ok=True)
N_PROMPTS, PROMPT_LEN, NEW_TOKENS, WIDTH = (8, 64, 24, 8) if FAST else (64, 64, 64, 16)
NUM_DRAFTS = 3 if FAST else 4

# Any checkpoint with an MTP head (a preset, a directory, a hub id in the local HF cache); its own
# tokenizer encodes the held-out prompts.
study = research.study_for(os.environ.get("METRALE_NOTEBOOK_CHECKPOINT", "small"))
prompts = research.heldout_prompts(N_PROMPTS, PROMPT_LEN, seed=0, tokenizer=study.tokenizer)

# %% [markdown]
# ## One run: a flat schedule (four drafts; three in fast mode)

# %%
run = study.run(prompts, NEW_TOKENS, research.flat_schedule(NUM_DRAFTS), width=WIDTH)
summary = run.summary()
for key in ("steps", "mean_accepted_length", "mean_drafted", "tokens_per_verify_row"):
    print(f"{key:>24}: {summary[key]:.3f}")
print(" acceptance by position:", np.round(summary["acceptance_by_position"], 3))
print("   conditional on reach:", np.round(summary["conditional_acceptance_by_position"], 3))

# %% [markdown]
# Greedy speculative decoding must emit exactly what plain greedy decoding emits.

# %%
greedy = study.greedy(prompts, NEW_TOKENS, width=WIDTH)
assert run.tokens == greedy, "speculative output differs from greedy output"
print("speculative == greedy for all", len(prompts), "prompts")

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
pos = np.arange(1, NUM_DRAFTS + 1)
ax1.bar(pos - 0.2, summary["acceptance_by_position"], 0.4, label="of drafts verified there")
ax1.bar(pos + 0.2, summary["conditional_acceptance_by_position"], 0.4, label="given the previous drafts accepted")
ax1.set(xlabel="draft position", ylabel="acceptance", ylim=(0, 1), xticks=pos, title="MTP draft acceptance by position")
ax1.legend(fontsize=8)
counts = np.bincount(run.accepted, minlength=NUM_DRAFTS + 1)
ax2.bar(np.arange(NUM_DRAFTS + 1), counts / counts.sum())
ax2.set(
    xlabel="drafts accepted in a verify",
    ylabel="fraction of verifies",
    title=f"mean accepted length {summary['mean_accepted_length']:.2f} tokens",
)
fig.suptitle(f"measured on {research.machine_label()}", fontsize=8)
fig.tight_layout()
fig.savefig(OUT / "acceptance_by_position.png", dpi=120)

# %% [markdown]
# ## Sampled: speculative sampling against temperature, both modes
#
# Top-p 0.9, prompt *i* seeded 7 + *i*, the same prompts and drafts per verify as above, in the
# engine's two speculative sampling modes:
#
# * **gumbel** (the default): each verify draws the target's token at each position as
#   argmax(logits / T + g) over the top-p set, with g the Gumbel noise of (seed, position); the
#   drafter drafts with its own logits and the same g. A draft is accepted while it equals the
#   target's draw, so the output is plain sampling's whatever the drafter (checked below), and the
#   match probability at a drafted position is at least (1 - TV)/(1 + TV) of the two filtered laws
#   there (Daliri, Musco and Suresh 2024); no coupling does better than 1 - TV.
# * **rejection** (Leviathan et al. 2023, Chen et al. 2023): the drafter draws its drafts from its
#   own law q with its own keys; the verify accepts draft x with probability min(1, p(x)/q(x)),
#   resamples from the normalised residual max(0, p - q) at the first rejection, and draws a bonus
#   token from p after a full accept. The output follows plain sampling's *law*, not its tokens.
#   At a reached draft position the expected acceptance IS 1 - TV(p, q) there (the sum over x of
#   min(p(x), q(x))), so its measured acceptance over the reached positions is compared with the
#   mean 1 - TV over those same positions: TV computed on the rejection run's own positions, from
#   its own drafter and target logits (not the gumbel run's, which drafts a different sample of
#   positions). The table also gives gumbel's acceptance over its reached positions against the
#   bounds there, the same footing as rejection's.
#
# Both runs keep the two laws at every drafted position (`research.coupled_generate`: the composed
# step, one propose per draft count for the drafter's logits). The rejection run is checked to emit
# the tokens of the engine's fused step in the same mode (`Study.sampled`). Temperature 0 is greedy
# in both modes (both laws one-hot, TV 0 or 1, the bounds meet the match): one run serves both.

# %%
from metrale_jax.engine.sampling import Sampling  # noqa: E402
from metrale_jax.engine.speculative import greedy_generate  # noqa: E402

TEMPERATURES = (0.0, 0.7) if FAST else (0.0, 0.3, 0.7, 1.0)
MODES = ("gumbel", "rejection")
MACHINE = research.machine_label()
coupled: dict[tuple[str, float], research.CouplingRun] = {}
for mode in MODES:
    for t in TEMPERATURES:
        if t == 0 and mode != MODES[0]:
            coupled[mode, t] = coupled[MODES[0], t]  # greedy: the same run in either mode
            continue
        smp = Sampling(temperature=t, top_p=0.9, seed=7)
        coupled[mode, t] = study.coupling(prompts, NEW_TOKENS, NUM_DRAFTS, smp, width=WIDTH, speculative_sampling=mode)
print(MACHINE)
print(f"{NUM_DRAFTS} drafts, top-p 0.9, {len(prompts)} prompts x {NEW_TOKENS} tokens, width {WIDTH}")
print("    T  mode       tokens/verify  acceptance by position     measured vs bounds (pooled over positions)")
for t in TEMPERATURES:
    for mode in MODES:
        c = coupled[mode, t]
        sm, b, r = c.run.summary(), c.bounds(), c.reached_bounds()
        vs = f"{c.run.reached.sum()} reached: acceptance {r['pooled'][0]:.3f} vs 1-TV {r['pooled'][2]:.3f}"
        if mode == "gumbel":
            vs += (
                f", (1-TV)/(1+TV) {r['pooled'][1]:.3f}; {c.match.size} drafted: match {b['pooled'][0]:.3f} "
                f"vs (1-TV)/(1+TV) {b['pooled'][1]:.3f}, 1-TV {b['pooled'][2]:.3f}"
            )
        print(
            f"  {t:.1f}  {mode:<9}  {sm['mean_accepted_length']:13.3f}  "
            f"{np.array2string(sm['acceptance_by_position'], precision=3):<25}  {vs}"
        )

# %% [markdown]
# Gumbel speculative sampling must emit exactly what plain sampling emits with the same seeds; the
# rejection run's composed loop must emit what the engine's fused step emits in rejection mode.

# %%
t_check = TEMPERATURES[-1]
plain = []
for g in range(0, len(prompts), WIDTH):
    group = prompts[g : g + WIDTH]
    plain += greedy_generate(
        study.engine,
        group,
        NEW_TOKENS,
        sampling=[Sampling(temperature=t_check, top_p=0.9, seed=7 + g + i) for i in range(len(group))],
    )
assert coupled["gumbel", t_check].run.tokens == plain, "gumbel speculative sampling differs from plain sampling"
print(f"gumbel speculative == plain sampling at T {t_check} for all", len(prompts), "prompts")
fused = study.sampled(
    prompts, NEW_TOKENS, NUM_DRAFTS, Sampling(temperature=t_check, top_p=0.9, seed=7), "rejection", WIDTH
)
assert coupled["rejection", t_check].run.tokens == fused.tokens, "the rejection run differs from the fused step"
print(f"rejection: composed loop == fused step at T {t_check} for all", len(prompts), "prompts")

# %% [markdown]
# What it buys in time: the steady-state wall-clock speed-up of speculative sampling over plain
# sampling with the same seeds (`Study.throughput`: the fused step, runs alternated, medians), in
# each mode, at width 1 and at the width above; temperature 0 is greedy speculative over greedy
# decoding (one run for both modes).

# %%
SPEED_WIDTHS, SPEED_REPEATS = ((1,), 1) if FAST else ((1, WIDTH), 5)
schedule = {f"flat {NUM_DRAFTS}": research.flat_schedule(NUM_DRAFTS)}
speed: dict[tuple[str, float], list[research.Throughput]] = {(mode, t): [] for mode in MODES for t in TEMPERATURES}
for w in SPEED_WIDTHS:  # widths outermost: the study keeps one width's serves live
    for mode in MODES:
        for t in TEMPERATURES:
            if t == 0 and mode != MODES[0]:
                continue  # greedy: the same run in either mode
            plain_law = None if t == 0 else Sampling(temperature=t, top_p=0.9, seed=7)
            speed[mode, t] += study.throughput(
                prompts,
                NEW_TOKENS,
                schedule,
                (w,),
                repeats=SPEED_REPEATS,
                sampling=plain_law,
                speculative_sampling=mode,
            )
for mode in MODES[1:]:
    speed[mode, 0.0] = speed[MODES[0], 0.0]
print(f"speculative / plain tokens/s, {NUM_DRAFTS} drafts, fused, median of {SPEED_REPEATS} alternated runs")
for t in TEMPERATURES:
    for mode in MODES:
        cells = ", ".join(
            f"width {x.width}: {x.speculative_tokens_per_second:.0f} / {x.plain_tokens_per_second:.0f} = "
            f"{x.speedup:.2f}x"
            for x in speed[mode, t]
        )
        print(f"  T {t:.1f}  {mode:<9}  {cells}")

# %%
STYLE = {"gumbel": "-", "rejection": "--"}
fig, (ax1, ax2, ax3, ax4) = plt.subplots(1, 4, figsize=(20, 4.4))
colors = {t: f"C{i}" for i, t in enumerate(TEMPERATURES)}
for (mode, t), c in coupled.items():
    if t == 0 and mode != MODES[0]:
        continue
    label = f"T {t:g}" + (" (greedy, both modes)" if t == 0 else f", {mode}")
    ax1.plot(pos, c.run.acceptance_by_position(), STYLE[mode], color=colors[t], marker="o", label=label)
ax1.set(
    xlabel="draft position", ylabel="acceptance", ylim=(0, 1), xticks=pos, title="acceptance by position, top-p 0.9"
)
ax1.legend(fontsize=7, title="solid: gumbel, dashed: rejection", title_fontsize=7)
ts = list(TEMPERATURES)
for mode in MODES:
    ax2.plot(
        ts, [coupled[mode, t].run.summary()["mean_accepted_length"] for t in ts], STYLE[mode], marker="o", label=mode
    )
ax2.set(xlabel="temperature", ylabel="tokens per verify per sequence", title=f"tokens per step ({NUM_DRAFTS} drafts)")
ax2.legend(fontsize=8, title="solid: gumbel, dashed: rejection", title_fontsize=7)
gb = np.array([coupled["gumbel", t].bounds()["pooled"] for t in ts])
rb = np.array([coupled["rejection", t].reached_bounds()["pooled"] for t in ts])
ax3.plot(ts, gb[:, 0], "-", color="C0", marker="o", label="gumbel: match rate, all drafted positions")
ax3.fill_between(ts, gb[:, 1], gb[:, 2], color="C0", alpha=0.2, label="gumbel: [(1-TV)/(1+TV), 1-TV] there")
ax3.plot(ts, rb[:, 0], "--", color="C1", marker="s", label="rejection: acceptance, reached positions")
ax3.plot(ts, rb[:, 2], ":", color="C1", label="rejection: 1-TV there (its expected acceptance)")
ax3.set(xlabel="temperature", ylabel="P(draft accepted)", ylim=(0, 1), title="measured vs bounds, same logits")
ax3.legend(fontsize=7)
for mode in MODES:
    for i, w in enumerate(SPEED_WIDTHS):
        ax4.plot(
            ts,
            [speed[mode, t][i].speedup for t in ts],
            STYLE[mode],
            color=f"C{i}",
            marker="o",
            label=f"{mode}, width {w}",
        )
ax4.axhline(1.0, color="grey", lw=0.8)
ax4.set(
    xlabel="temperature (0: greedy)",
    ylabel="speculative / plain tokens per second",
    title=f"measured speed-up over plain sampling, fused, median of {SPEED_REPEATS}",
)
ax4.legend(fontsize=7)
fig.suptitle(f"measured on {MACHINE}\n{len(prompts)} held-out prompts x {NEW_TOKENS} tokens, width {WIDTH}", fontsize=8)
fig.tight_layout()
fig.savefig(OUT / "acceptance_vs_temperature.png", dpi=120)

# %% [markdown]
# A sample continuation (prompt, then the greedy continuation), to see what the model writes.

# %%
tok = study.tokenizer or ByteTokenizer()
print(tok.decode(prompts[0]) + "⟨" + tok.decode(run.tokens[0]) + "⟩")
