"""Accelerators the memory planner can plan for, and the budget a serve gets on one.

Owns: the device table (memory as the driver reports it, per device), the budget law:
`budget = floor(memory × gpu_memory_utilization)` and the runtime reserve charged inside it, and
`local_memory`: what the device this process computes on can still hold (for the up-front size
checks of the commands that allocate).

Invariants:
- `memory_bytes` is the total the CUDA driver reports (nvidia-smi's MiB × 2^20; the GB10's
  unified memory as `cuDeviceTotalMem` reports it), not the marketing figure.
- Lookups ignore case and punctuation: `h200`, `H-200` and `H200` are one device.
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax

from metrale_jax.memory.errors import PlanError

MIB = 1 << 20
GIB = 1 << 30
#: The runtime reserve: a fixed part (CUDA context, library handles) plus a per-mille share of
#: the budget (allocator bookkeeping and fragmentation).
RUNTIME_FIXED_BYTES = 1 * GIB
RUNTIME_BUDGET_PER_MILLE = 21


@dataclasses.dataclass(frozen=True)
class Device:
    """One accelerator: `id` (the `--device` name) and other accepted names, a readable name,
    the memory the driver reports, whether it is unified with the host, and the highest
    utilisation worth using (above it the host or the driver is starved)."""

    id: str
    name: str
    memory_bytes: int
    aliases: tuple[str, ...] = ()
    unified: bool = False
    util_ceiling: float = 0.95


DEVICES: tuple[Device, ...] = (
    Device("H100", "NVIDIA H100 80GB HBM3 (SXM)", 81559 * MIB, ("H100-80GB", "H100-SXM")),
    Device("H100-NVL", "NVIDIA H100 NVL 94GB", 95830 * MIB),
    Device("H200", "NVIDIA H200 141GB HBM3e", 143771 * MIB, ("H200-141GB",)),
    Device("B200", "NVIDIA B200 180GB HBM3e", 183359 * MIB),
    Device(
        "GB10",
        "NVIDIA GB10 (DGX Spark) 128GB unified",
        130_663_886_848,
        ("DGX-Spark",),
        unified=True,
        util_ceiling=0.85,
    ),
    Device("A100-80GB", "NVIDIA A100 80GB", 81920 * MIB, ("A100",)),
    Device("A100-40GB", "NVIDIA A100 40GB", 40960 * MIB),
    Device("L40S", "NVIDIA L40S 48GB", 46068 * MIB),
    Device("L4", "NVIDIA L4 24GB", 23034 * MIB),
    Device("RTX-4090", "NVIDIA GeForce RTX 4090 24GB", 24564 * MIB, ("4090",)),
    Device("RTX-5090", "NVIDIA GeForce RTX 5090 32GB", 32607 * MIB, ("5090",)),
    Device("RTX-6000-ADA", "NVIDIA RTX 6000 Ada 48GB", 49140 * MIB),
    Device("RTX-PRO-6000", "NVIDIA RTX PRO 6000 Blackwell 96GB", 97887 * MIB),
)


def _key(name: str) -> str:
    return re.sub(r"[^0-9a-z]", "", name.lower())


def find_device(name: str) -> Device:
    """The device called `name` (case and punctuation ignored). Raises PlanError listing the
    known ids."""
    wanted = _key(name)
    for d in DEVICES:
        if wanted in {_key(n) for n in (d.id, *d.aliases)}:
            return d
    raise PlanError(f"unknown device {name!r} (known: {', '.join(d.id for d in DEVICES)})")


def util_budget(device: Device, util: float) -> int:
    """`floor(memory_bytes × util)`: the bytes a serve at utilisation `util` may hold."""
    return int(device.memory_bytes * util)


def runtime_reserve(budget: int) -> int:
    """The runtime's own share of `budget`: `RUNTIME_FIXED_BYTES + budget // 1000 × 21`."""
    return RUNTIME_FIXED_BYTES + budget // 1000 * RUNTIME_BUDGET_PER_MILLE


def mib(n: int) -> str:
    """Bytes as MiB with one decimal."""
    return f"{n / MIB:.1f} MiB"


def local_memory() -> tuple[int, str]:
    """(bytes jax's default device can still allocate, what that device is): an accelerator's
    `bytes_limit − bytes_in_use`; the CPU backend's host memory available (`MemAvailable`)."""
    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)), f"{dev.device_kind} ({dev.platform})"
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024, "the host (cpu)"
    except (OSError, StopIteration, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "the host (cpu)"
