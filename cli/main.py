"""The `metrale-jax` command group. Owns only the wiring of subcommands.

Invariants:
- The thread environment (`metrale_jax.runtime_env.prepare`) is set before any subcommand
  module, and so jax, is imported.
- A subcommand's module is imported only when the command line names it, inside the group's
  run, so everything after the first few standard-library imports, start-up included, ends as
  `metrale_jax_cli.errors.guarded` says (Ctrl-C: exit 130 with one line, never a traceback);
  SIGINT is handled by `metrale_jax_cli.interrupts` from the first import on, so none is lost.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

try:
    from metrale_jax_cli import interrupts

    interrupts.install()

    import importlib

    from metrale_jax import runtime_env

    runtime_env.prepare()
    if "--batch-invariant" in sys.argv[1:]:  # before jax: the flag pins XLA CPU's FMA contraction
        runtime_env.pin_fma_contraction()

    import click

    from metrale_jax_cli.errors import guarded

    interrupts.raise_if_interrupted()
except KeyboardInterrupt:  # NOTE: before Click and `guarded` are loaded, so their exit, by hand
    sys.stderr.write("error: interrupted\n")
    sys.exit(130)

#: Subcommand name -> the module defining it (an attribute of that name).
COMMANDS = {
    "diff": "metrale_jax_cli.diff_cmd",
    "generate": "metrale_jax_cli.generate_cmd",
    "logits": "metrale_jax_cli.logits_cmd",
    "memory": "metrale_jax_cli.memory_cmd",
}


class _Group(click.Group):
    """A group whose subcommands load on first use, within the group's failure handling."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        with guarded():
            command = getattr(importlib.import_module(COMMANDS[cmd_name]), cmd_name)
        return command

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        """Click's `main`, but Click's own interrupt handling (exit 1, "Aborted!") replaced by
        `guarded`'s: parsing, loading and running all end the same way."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        with guarded():
            try:
                code = super().main(args, prog_name, complete_var, False, **extra)
            except click.Abort:
                raise KeyboardInterrupt from None
            except click.ClickException as e:
                e.show()
                sys.exit(e.exit_code)
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=_Group)
@click.version_option(package_name="metrale-jax")
def cli():
    """metrale-jax: a functional JAX core for hybrid GDN + attention models with MTP speculative decoding."""
