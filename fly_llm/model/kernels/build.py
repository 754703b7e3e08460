"""Compile a C++ source of this package as a torch extension once, and load it.

The build goes to `<model cache>/kernels/<name>-<key>` (fly_llm.model.cache_paths), keyed by
the source, torch and Python versions, so a change to any of them builds anew and an unchanged one
loads in a fraction of a second. It needs a C++ compiler (g++) and ninja; without them, or if the
build fails, `load_extension` logs one line and returns None, and the caller uses its fallback.

Builders of one directory take turns under an `fcntl` lock, which the kernel releases when a process
dies. torch's own guard is a `lock` file that a killed builder (an OOM kill, a Ctrl-C at the wrong
moment) leaves behind, and every later load then waits for it forever; holding our lock, a `lock`
file there can only be such a leftover, so it is removed first.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import sys
from pathlib import Path
from types import ModuleType

import torch

from fly_llm.model.cache_paths import cache_root

log = logging.getLogger(__name__)

_FLAGS = ["-O3", "-std=c++17", "-fopenmp"]  # OpenMP: at::parallel_for runs on torch's own thread pool
TORCH_BATON = "lock"
"""The file torch.utils.cpp_extension creates in a build directory while it builds (its FileBaton)."""


def build_directory(name: str, source: Path) -> Path:
    """Where `name` built from `source` lives: keyed by the source, torch and Python."""
    key = hashlib.sha256(source.read_bytes() + f"{torch.__version__}|{sys.version}|{_FLAGS}".encode())
    return cache_root() / "kernels" / f"{name}-{key.hexdigest()[:12]}"


def compile_extension(name: str, source: Path, directory: Path) -> ModuleType:
    """Build (or load, if built) the extension `name` from `source` in `directory`, with this package's
    flags; raises if it cannot be built."""
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "build.flock", "w") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX)  # released by the kernel if this process dies
        (directory / TORCH_BATON).unlink(missing_ok=True)  # a dead builder's; a live one would hold our lock
        return cpp_extension.load(name=name, sources=[str(source)], build_directory=str(directory),
                                  extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"], verbose=False)


@functools.cache
def load_extension(name: str) -> ModuleType | None:
    """The extension built from `<name>.cpp` beside this file, or None (logged) if it cannot be built."""
    source = Path(__file__).with_name(f"{name}.cpp")
    directory = build_directory(name, source)
    if not any(directory.glob(f"fly_{name}*.so")):  # the built module is named fly_<name>
        log.info("compiling the %s CPU kernel (once, about a minute) in %s", name, directory)
    try:
        return compile_extension(f"fly_{name}", source, directory)
    except Exception as exc:  # no compiler, no ninja, a failed build: every cause means "use the fallback"
        log.warning("the %s CPU kernel could not be built (%s: %s); using the fallback",
                    name, type(exc).__name__, str(exc).strip().splitlines()[-1] if str(exc).strip() else "")
        return None
