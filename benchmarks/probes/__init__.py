"""The benchmark's probes: one measurement each, printed (no JSON, no table file), for the figures
BUILD_NOTES.md cites. Each module's `command` is a `python -m benchmarks` subcommand (`cli.PROBES`),
loaded only when it runs, after the CLI has pinned the process to one core (the modules load jax).
"""
