"""metrale-jax benchmarks: speed and compile cost, side by side with Hugging Face transformers
and with the HBM roofline. One entry point: `python -m benchmarks COMMAND` (a Click group; `make
bench` runs `all` and writes the tables to benchmarks/RESULTS.md).

Sections (each a subcommand, printed as a table and written to one JSON file):
- `hf`       JAX engine vs HF transformers on the CPU, same config and weights, timed in one run,
             alternating the two sides: prefill tok/s, one decode step, one verify step (n, K),
             and per decode/verify step its CPU roofline (bytes it must move / this core's
             measured streaming-read bandwidth, against the measured time).
- `hf-45m`, `hf-300m`  the same at realistic widths: a 45 M Qwen3-Next and a 304 M
             Qwen3.5-MoE-shaped model, each with one MTP layer.
- `e2e`      steady-state tokens/s of speculative vs plain greedy generation (fused and
             composed steps): `small` with its MTP head, the 45 M width with oracle drafts.
- `compile`  time to first step and compilations of a 50-step ragged verify loop: the tiny
             model and the 48-layer Qwen3-Next pattern at tiny width, scan layout vs unrolled.
- `forwards` the `pallas` forward (interpreter on CPU) vs `xla` on the same step.
- `gap`      the engine's verify step after idle gaps of 0/2/8 ms: what the call-by-call
             timing of `hf` charges the faster side.
- `slots`    a one-sequence step against the engine's slot count (a pool copied instead of
             updated in place grows with the slots).
- `multiturn` conversations sharing a system prompt and their own history, with and without the
             prefix cache: prompt tokens, tokens prefilled, hit rate, time to first token per turn.
- `roofline` (`--gpu`) bytes each step must move / measured HBM bandwidth vs the measured step
             time, per kernel and per step, for a Qwen3.5-35B-A3B-size layer stack; a dry run
             with tiny shapes under the interpreter where no GPU is present.

Modules: `cli` (the Click group: the section commands, `all`, the probes; JSON and notes),
`sections` (one module per section: its options, settings, `run` and table; loads no jax), `settings`
(the resolved settings, passed whole to every section's runner; the presets), `report` (the table
framing, text and markdown), `timing` (statistics, machine facts, compile listener), `models` (weights,
engine settings, checkpoints; the configs are `metrale_jax.model_registry`'s), `steps` (engine step
runners), `hf_env` (the HF venv and the driver client), `hf_driver` (runs under the HF venv's Python
3.11; imports neither jax nor this package), the runners `vs_hf`, `cpu_roofline` (bandwidth and the hf
sections' roofline columns), `e2e`, `compile_cost`, `forwards`, `idle_gap`, `slot_scaling`, `multiturn`,
`roofline`, and `probes` (one-off measurements, one subcommand each).
`gpu_check.py` / `gpu_check.sh` are the kernel device check, which `roofline` reuses;
`roofline_gpu.sh` is the roofline as one prepared command for a GPU machine. README.md says how
to run and read it all.
"""
