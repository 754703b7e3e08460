"""The server processes a serving benchmark measures: start one, wait until it answers, stop it."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from benchmarks.serving.webui_check import get_json


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 60 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_for_models(url: str, proc: subprocess.Popen, log: Path, timeout: float = 600) -> str:
    """The first model id the server at `url` lists, once it answers; SystemExit if it exits or never answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            return get_json(f"{url}/v1/models", timeout=5)["data"][0]["id"]
        except OSError:
            time.sleep(0.5)
    stop(proc)
    raise SystemExit(f"the server did not answer (exit {proc.poll()}); see {log}")


@contextmanager
def serve(cmd: list[str], port: int, log: Path) -> Iterator[tuple[str, str]]:
    """Run `cmd` (a server listening on 127.0.0.1:`port`), its output appended to `log`: (its URL, its first
    model id) once it answers, stopped on exit."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        yield url, wait_for_models(url, proc, log)
    finally:
        stop(proc)
