"""`metrale-jax diff`: forward parity of the engine, step by step, byte for byte.

A reference run (`xla`) fixes every input; each variant (`xla-repeat`, every other forward, or
a forward a test injects) replays those inputs and is compared with it under its declared
contract; a detection control proves a difference would be seen. The command is
`metrale_jax_cli.diff_cmd`; the library entry point is `run_diff(engine, request, variants)`.
"""

from metrale_jax.diff.compare import BIT_IDENTICAL, Contract, bounded
from metrale_jax.diff.driver import run_diff
from metrale_jax.diff.progress import Bar, Progress
from metrale_jax.diff.report import render_summary, to_json
from metrale_jax.diff.request import DiffRequest, DiffRequestError
from metrale_jax.diff.variants import REFERENCE, Variant, default_variants

__all__ = [
    "BIT_IDENTICAL",
    "Bar",
    "Contract",
    "DiffRequest",
    "DiffRequestError",
    "Progress",
    "REFERENCE",
    "Variant",
    "bounded",
    "default_variants",
    "render_summary",
    "run_diff",
    "to_json",
]
