"""Where fly-llm keeps what it builds once: the cache root, shared by converted models (fly_llm.model.cache),
compiled kernels (fly_llm.model.kernels.build) and timed policy costs (fly_llm.policy_costs). A leaf: it
imports nothing of fly_llm, so every one of them can use it."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def cache_root(cache_dir: Path | str | None = None) -> Path:
    """`cache_dir`, else `$FLY_CACHE_DIR`, else the user cache dir (`$XDG_CACHE_HOME/fly-llm`)."""
    root = cache_dir or os.environ.get("FLY_CACHE_DIR") or platformdirs.user_cache_dir("fly-llm")
    return Path(root).expanduser()
