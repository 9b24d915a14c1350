"""The benchmark's resolved settings: every value a section reads, one frozen dataclass passed whole.

Owns: the names of the settings and what each means, `Preset` (which sizes an absent option takes:
default, `--smoke`, `--gpu`, `--gpu --dry-run`), the comma-list option types (`ints`, `strs`) and
`STEP_OPTIONS` (the step-shape options the hf, forwards, gap and slots sections share, with
`resolve_step`). `cli.resolve` fills every field: the shared fields here, each section's from its
own `resolve` (`benchmarks.sections`); each section's `run(settings)` reads the fields it needs and
nothing else. The JSON's "settings" is `dataclasses.asdict` of it, in field order.

Invariants: a section's sizes come from here alone (`step_shape` takes the largest of `ns` and of `ks`);
the dataclass holds no jax values, so building it loads nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import click


@dataclasses.dataclass(frozen=True)
class HFSizes:
    """A realistic-width hf section: its model and case sizes (the `Settings` fields of the same names)."""

    model: str
    prefill_lens: list[int]
    ns: list[int]
    ks: list[int]
    repeats: int
    warmup: int
    block: int
    prefill_b2b: bool
    dtype: str = "float32"  # both sides' weight/activation dtype: float32, or "checkpoint" (its own)


@dataclasses.dataclass(frozen=True)
class Settings:
    model: str  # hf, forwards, gap: a preset, tiny-2L, qwen3-next-<L>L[-i<n>] or a checkpoint directory
    forward_steps: list[str]  # forwards: which of prefill, decode, verify
    sections: list[str]
    repeats: int  # timed repeats per case
    warmup: int  # untimed calls per side first
    block: int  # hf: back-to-back calls per side and round
    prefill_lens: list[int]  # hf: prefill lengths; forwards: the first (at least 16)
    ns: list[int]  # hf: sequences per decode/verify step
    ks: list[int]  # hf: verify rows per sequence
    ctx: int  # context tokens before decode/verify
    prefill_b2b: bool  # hf: also time the prefills back to back (decode and verify always are)
    wide: dict[str, HFSizes]  # the realistic-width hf sections (hf-45m, hf-300m): their models and sizes
    compile_models: list[str]
    compile_steps: int  # compile: verify-loop steps
    compile_repeats: int  # compile: runs per case
    isolate: bool  # compile: each run in a fresh process
    roofline_dry: bool  # roofline: tiny width under the interpreter
    roofline_layers: int
    roofline_ctx: int  # roofline: cached tokens per sequence
    roofline_decode_ns: list[int]
    roofline_verify_ns: list[int]
    roofline_k: int  # roofline: verify rows per sequence
    roofline_iters: int  # roofline: timed runs per step
    gaps_ms: list[int]  # gap: idle gaps before each verify call
    gap_calls: int  # gap: timed calls per gap and round
    gap_rounds: int  # gap: rounds over the gaps
    slots_model: str
    slot_counts: list[int]  # slots: the engines' slot counts (max batch)
    slots_iters: int  # slots: timed runs per step
    multiturn_model: str  # multiturn: the model both engines serve
    multiturn_conversations: int  # multiturn: conversations sharing the system prompt
    multiturn_turns: int
    multiturn_system_len: int  # multiturn: system prompt tokens
    multiturn_user_len: int  # multiturn: tokens of each turn's user message
    multiturn_new_tokens: int  # multiturn: tokens generated per turn
    multiturn_block: int  # multiturn: --block-size
    multiturn_chunk: int  # multiturn: --max-prefill-tokens (the prefill chunk; its ends are snapshots)
    invariant_models: list[str]  # invariant: the models whose steps run in both modes
    invariant_prefill: int  # invariant: prefill tokens (one chunk)
    invariant_rounds: int  # invariant: alternated rounds of both modes
    invariant_calls: int  # invariant: calls of each step per round (median)
    e2e_ns: list[int]  # e2e: prompts generated together on `small` (its MTP head drafting)
    e2e_drafts: list[int]  # e2e: drafts per verify (one speculative engine each, under its default K ladder)
    e2e_new_tokens: int  # e2e: tokens generated per prompt
    e2e_prompt_len: int
    e2e_oracle_model: str  # e2e: the model run with oracle drafts
    e2e_oracle_ns: list[int]
    e2e_oracle_drafts: list[int]
    e2e_oracle_new_tokens: int
    e2e_accept: float  # e2e: the oracle's chance that a draft position is right
    e2e_rounds: int  # e2e: timed rounds, greedy and both speculative modes alternated in each
    e2e_sample_ns: list[int]  # e2e: prompts generated together on `small`, sampled (gumbel speculative sampling)
    e2e_temperature: float  # e2e: the sampled rows' temperature
    e2e_top_p: float  # e2e: the sampled rows' top-p
    anatomy_model: str  # anatomy: the model whose step programs are dissected
    anatomy_dot_model: str  # anatomy: the model whose largest projection the product sweep runs
    anatomy_drafts: list[int]  # anatomy: a speculative engine per draft count
    anatomy_iters: int  # anatomy: timed calls of each program
    anatomy_ms: list[int]  # anatomy: the row counts M of the product sweep
    anatomy_repeats: int  # anatomy: sweeps per M (median)
    hf_create: bool  # hf: create the HF venv when it is absent
    workdir: str  # checkpoint and driver logs
    threads: int  # threads per side; 0 = library defaults
    hf_impl: str  # hf: "default" or "eager" attention/experts implementations
    seed: int
    dtype: str = "float32"  # hf sections: both sides' dtype, float32 or "checkpoint" (the checkpoint's own)

    def hf_section(self, name: str) -> Settings:
        """The hf section `name`'s settings: `hf` itself, or a realistic-width section with its model and
        case sizes from `wide[name]`."""
        if name == "hf":
            return self
        w = self.wide[name]
        return dataclasses.replace(self, **dataclasses.asdict(w))

    @property
    def step_shape(self) -> tuple[int, int]:
        """(n, k) of the forwards, gap and slots sections' steps: n sequences, the largest of `ns`,
        of k rows each, the largest of `ks`."""
        return max(self.ns), max(self.ks)


#: The options a command was given, by parameter name (an option of another command is absent).
Options = Mapping[str, Any]
#: A section subcommand: its one-line help and its options.
Command = tuple[str, tuple[click.Option, ...]]


@dataclasses.dataclass(frozen=True)
class Preset:
    """The run's size preset: `smoke` (tiny sizes, 1 repeat, in-process), `gpu` (the roofline on an NVIDIA
    GPU) and `dry_run` (with `gpu`: tiny shapes under the interpreter)."""

    smoke: bool
    gpu: bool
    dry_run: bool

    def pick(self, given: Any, full: Any, smoke: Any) -> Any:
        """The option's value where one was given, else the preset's (`smoke`'s under --smoke)."""
        return given if given is not None else (smoke if self.smoke else full)

    @property
    def tiny_roofline(self) -> bool:
        """The roofline runs at tiny width under the interpreter (anything but a real `--gpu` run)."""
        return self.dry_run or self.smoke or not self.gpu


def _comma(kind: Callable[[str], Any]) -> Callable[[click.Context, click.Parameter, str | None], list | None]:
    """A Click callback: a comma list of `kind` values (None when the option is absent)."""

    def convert(ctx: click.Context, param: click.Parameter, value: str | None) -> list | None:
        if value is None:
            return None
        try:
            return [kind(x.strip()) for x in value.split(",") if x.strip()]
        except ValueError:
            raise click.BadParameter(f"expected a comma list, got {value!r}") from None

    return convert


ints, strs = _comma(int), _comma(str)

#: The step-shape options, by name; each section that reads one lists it (hf all, forwards, gap, slots some).
STEP_OPTIONS = {
    "model": click.Option(
        ["--model"],
        help="hf, forwards, gap: a preset, a `metrale_jax.model_registry` name (tiny-2L, qwen3-next-<L>L[-i<n>], ...) "
        "or a checkpoint directory (default tiny; smoke tiny-2L)",
    ),
    "prefill_lens": click.Option(["--prefill-lens"], callback=ints, help="hf: default 128,512,2048"),
    "ns": click.Option(
        ["--ns"],
        callback=ints,
        help="sequences per decode/verify step, default 1,4,8 (forwards, gap: the largest)",
    ),
    "ks": click.Option(
        ["--ks"], callback=ints, help="verify rows per sequence, default 2,3,4 (forwards, gap, slots: the largest)"
    ),
    "ctx": click.Option(["--ctx"], type=int, help="context tokens before decode/verify, default 128"),
    "repeats": click.Option(["--repeats"], type=int, help="timed repeats per case (default 7; smoke 1)"),
    "warmup": click.Option(
        ["--warmup"], type=int, help="untimed calls per side first (default 2, hf-45m and hf-300m 1; smoke 0)"
    ),
    "block": click.Option(
        ["--block"],
        type=int,
        help="hf sections: back-to-back calls per side and round (default 8, hf-45m and hf-300m 2; smoke 2)",
    ),
}


def resolve_step(a: Options, p: Preset) -> dict[str, Any]:
    """The step-shape fields of `Settings` (absent options take the preset's sizes)."""
    return dict(
        model=p.pick(a.get("model"), "tiny", "tiny-2L"),
        repeats=p.pick(a.get("repeats"), 7, 1),
        warmup=p.pick(a.get("warmup"), 2, 0),
        block=p.pick(a.get("block"), 8, 2),
        prefill_lens=p.pick(a.get("prefill_lens"), [128, 512, 2048], [16]),
        ns=p.pick(a.get("ns"), [1, 4, 8], [1]),
        ks=p.pick(a.get("ks"), [2, 3, 4], [2]),
        ctx=p.pick(a.get("ctx"), 128, 16),
        prefill_b2b=True,
    )
