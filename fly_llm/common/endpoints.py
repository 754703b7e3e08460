"""Where a client finds the daemon: the private runtime directory and the default endpoint (no torch).

Shared by the clients and the daemon, so it belongs to neither.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def runtime_dir() -> Path:
    """The private (0700) directory for the daemon's socket, pidfile and log.

    $FLY_RUNTIME_DIR, else $XDG_RUNTIME_DIR/fly-llm, else <tmp>/fly-llm-<uid>. Created if missing;
    refused if it belongs to someone else, tightened to 0700 otherwise.
    """
    if os.environ.get("FLY_RUNTIME_DIR"):
        path = Path(os.environ["FLY_RUNTIME_DIR"])
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "fly-llm"
    else:
        path = Path(tempfile.gettempdir()) / f"fly-llm-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid():
        raise PermissionError(f"runtime directory {path} belongs to another user")
    if info.st_mode & 0o077:
        path.chmod(0o700)
    return path


def default_endpoint() -> str:
    """$FLY_ENDPOINT, else the ipc socket `daemon.sock` in the private runtime directory."""
    return os.environ.get("FLY_ENDPOINT") or f"ipc://{runtime_dir() / 'daemon.sock'}"
