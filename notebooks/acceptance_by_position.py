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
# * that speculative output equals plain greedy output (the engine's invariant).
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
# A sample continuation (prompt, then the greedy continuation), to see what the model writes.

# %%
tok = study.tokenizer or ByteTokenizer()
print(tok.decode(prompts[0]) + "⟨" + tok.decode(run.tokens[0]) + "⟩")
