"""The `metrale-jax` command group. Owns only the wiring of subcommands."""

from __future__ import annotations

import os

# NOTE: the xla forward's GDN chunk calls LAPACK's triangular solve, which runs on OpenBLAS's
# thread pool; on a loaded small machine that pool stalls prefill 10-20x (128 tokens: 134 ms vs
# 7.8 ms). One thread is what XLA's own CPU ops already use per op here. Set before jax loads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import click  # noqa: E402

from metrale_jax_cli.diff_cmd import diff  # noqa: E402
from metrale_jax_cli.generate_cmd import generate  # noqa: E402
from metrale_jax_cli.logits_cmd import logits  # noqa: E402
from metrale_jax_cli.memory_cmd import memory  # noqa: E402


@click.group()
@click.version_option(package_name="metrale-jax")
def cli():
    """metrale-jax: a functional JAX core for hybrid GDN + attention models with MTP speculative decoding."""


cli.add_command(diff)
cli.add_command(generate)
cli.add_command(logits)
cli.add_command(memory)
