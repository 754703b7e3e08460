"""What the CPU can do, from /proc/cpuinfo (no compiler needed to ask)."""

from __future__ import annotations

import functools


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (e.g. 'avx2', 'avx512_vnni', 'avx512_bf16'); empty where unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return frozenset()
