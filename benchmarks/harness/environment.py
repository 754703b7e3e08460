"""What a run ran on, for its report: the CPU (model name and widest matmul instruction set) and the code's commit."""

from __future__ import annotations

import subprocess
from pathlib import Path

from fly_llm.model.kernels.cpu import cpu_flags, cpu_model


def cpu_name() -> str:
    """The CPU's model name and its widest matmul instruction set (AVX-512 VNNI or AVX2)."""
    flags = cpu_flags()
    isa = "AVX-512 VNNI" if "avx512_vnni" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{cpu_model()} ({isa})"


def git_commit() -> str | None:
    """The checkout's short commit, with '+dirty' when tracked files differ from it; None outside git."""
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("+dirty" if dirty else "")
