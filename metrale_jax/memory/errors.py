"""The memory planner's user errors: one clear line each, exit code 2 at the command line."""

from __future__ import annotations

from metrale_jax.errors import MetraleError


class PlanError(MetraleError, ValueError):
    """A planning request that cannot be answered (unknown device or checkpoint, bad --slots,
    a workload the serve cannot run)."""
