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
# * sampled (gumbel mode: the drafter drafts with the target's Gumbel noise), acceptance by
#   position and tokens per verify against temperature, and the measured match rate of a draft
#   with the target's draw against the coupling's bounds, (1 - TV)/(1 + TV) below and 1 - TV
#   above, TV computed from the same logits (the drafter's and the target's filtered laws at each
#   drafted position).
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
fig.tight_layout()
fig.savefig(OUT / "acceptance_by_position.png", dpi=120)

# %% [markdown]
# ## Sampled: gumbel speculative sampling against temperature
#
# Top-p 0.9, prompt *i* seeded 7 + *i*. Each verify draws the target's token at each position as
# argmax(logits / T + g) over the top-p set, with g the Gumbel noise of (seed, position); the
# drafter drafts with its own logits and the same g. A draft is accepted while it equals the
# target's draw, so the output is plain sampling's whatever the drafter (checked below), and the
# match probability at a drafted position is at least (1 - TV)/(1 + TV) of the two filtered laws
# there (Daliri, Musco and Suresh 2024); no coupling does better than 1 - TV. Temperature 0 is
# greedy: both laws are one-hot, TV is 0 or 1 and the bounds meet the match exactly.

# %%
from metrale_jax.engine.sampling import Sampling  # noqa: E402
from metrale_jax.engine.speculative import greedy_generate  # noqa: E402

TEMPERATURES = (0.0, 0.7) if FAST else (0.0, 0.3, 0.7, 1.0)
coupled = {
    t: study.coupling(prompts, NEW_TOKENS, NUM_DRAFTS, Sampling(temperature=t, top_p=0.9, seed=7), width=WIDTH)
    for t in TEMPERATURES
}
for t, c in coupled.items():
    b, sm = c.bounds(), c.run.summary()
    print(
        f"T {t:.1f}: tokens/verify/seq {sm['mean_accepted_length']:.3f}, acceptance by position "
        f"{np.round(sm['acceptance_by_position'], 3)}; match {b['pooled'][0]:.3f} vs (1-TV)/(1+TV) "
        f"{b['pooled'][1]:.3f} and 1-TV {b['pooled'][2]:.3f} over {c.match.size} drafted positions"
    )

# %% [markdown]
# Gumbel speculative sampling must emit exactly what plain sampling emits with the same seeds.

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
assert coupled[t_check].run.tokens == plain, "gumbel speculative sampling differs from plain sampling"
print(f"speculative == plain sampling at T {t_check} for all", len(prompts), "prompts")

# %%
fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(14, 3.8))
for t, c in coupled.items():
    ax1.plot(pos, c.run.acceptance_by_position(), marker="o", label=f"T {t:g}")
ax1.set(
    xlabel="draft position", ylabel="acceptance", ylim=(0, 1), xticks=pos, title="acceptance by position, top-p 0.9"
)
ax1.legend(fontsize=8)
ts = list(coupled)
ax2.plot(ts, [coupled[t].run.summary()["mean_accepted_length"] for t in ts], marker="o")
ax2.set(xlabel="temperature", ylabel="tokens per verify per sequence", title=f"tokens per step ({NUM_DRAFTS} drafts)")
pooled = np.array([coupled[t].bounds()["pooled"] for t in ts])
ax3.plot(ts, pooled[:, 0], marker="o", label="measured match rate")
ax3.plot(ts, pooled[:, 1], ls="--", label="(1 - TV)/(1 + TV), same logits")
ax3.plot(ts, pooled[:, 2], ls=":", label="1 - TV")
ax3.set(xlabel="temperature", ylabel="P(draft = target's draw)", ylim=(0, 1), title="match vs the coupling's bounds")
ax3.legend(fontsize=8)
fig.tight_layout()
fig.savefig(OUT / "acceptance_vs_temperature.png", dpi=120)

# %% [markdown]
# A sample continuation (prompt, then the greedy continuation), to see what the model writes.

# %%
tok = study.tokenizer or ByteTokenizer()
print(tok.decode(prompts[0]) + "⟨" + tok.decode(run.tokens[0]) + "⟩")
