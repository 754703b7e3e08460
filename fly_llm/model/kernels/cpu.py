"""What the CPU is and can do, from /proc/cpuinfo (no compiler needed to ask)."""

from __future__ import annotations

import functools
import platform


def _cpuinfo_line(key: str) -> str:
    """The first /proc/cpuinfo line that starts with `key`; "" where there is none or the file is unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(key)), "")
    except OSError:
        return ""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (e.g. 'avx2', 'avx512_vnni', 'avx512_bf16'); empty where unreadable."""
    return frozenset(_cpuinfo_line("flags").split())


@functools.cache
def cpu_model() -> str:
    """The CPU's model name ('model name' in /proc/cpuinfo), else what `platform` says, else 'unknown CPU'."""
    return _cpuinfo_line("model name").partition(":")[2].strip() or platform.processor() or "unknown CPU"
