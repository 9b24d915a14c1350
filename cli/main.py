"""The `metrale-jax` command group. Owns only the wiring of subcommands."""

from __future__ import annotations

import click

from metrale_jax_cli.diff_cmd import diff
from metrale_jax_cli.generate_cmd import generate
from metrale_jax_cli.logits_cmd import logits
from metrale_jax_cli.memory_cmd import memory


@click.group()
@click.version_option(package_name="metrale-jax")
def cli():
    """metrale-jax: a functional JAX core for hybrid GDN + attention models with MTP speculative decoding."""


cli.add_command(diff)
cli.add_command(generate)
cli.add_command(logits)
cli.add_command(memory)
