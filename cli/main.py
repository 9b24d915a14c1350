"""The `metrale-jax` command group. Owns only the wiring of subcommands.

Invariant: the thread environment (`metrale_jax.runtime_env.prepare`) is set before any
subcommand module, and so jax, is imported.
"""

from __future__ import annotations

from metrale_jax import runtime_env

runtime_env.prepare()

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
