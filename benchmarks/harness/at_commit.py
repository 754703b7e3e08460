"""A source file of this repository as committed at another revision, loaded beside the working tree's
(an in-process A/B: both versions on the same loaded models, taking turns)."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository's root (a git checkout: the A/B scripts read its history)."""


def module_at(rev: str, path: str) -> types.ModuleType:
    """The Python file `path` (relative to the repository root) as committed at `rev`, as a module of its own
    (its imports are the working tree's)."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], capture_output=True, text=True,
                            check=True).stdout
    module = types.ModuleType(f"{path.removesuffix('.py').replace('/', '_')}_at_{rev}")
    module.__file__ = f"{rev}:{path}"
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module
