"""Run a fly-daemon in a subprocess for tests (tiny models, float32, TEST_DEVICE, an ipc socket)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from support.device import TEST_DEVICE
from fly_llm.client import FLyClient
from fly_llm.common.errors import FLyUnavailable


class DaemonProcess:
    """A `fly-daemon start --foreground` subprocess; its output goes to `log`."""

    def __init__(self, target: Path | None, draft: Path | None, endpoint: str, log: Path, *extra: str) -> None:
        """Start it; target None serves the embedded default pair (then `extra` sets dtype and device)."""
        self.endpoint = endpoint
        self.log = log
        env = dict(os.environ, FLY_RUNTIME_DIR=str(log.parent), PYTHONUNBUFFERED="1",
                   OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        models = [] if target is None else ["--target", str(target), "--draft", str(draft), "--dtype", "float32",
                                            "--device", TEST_DEVICE, "--target-quantization", "none",
                                            "--draft-quantization", "none"]
        cmd = [sys.executable, "-m", "fly_daemon.cli", "start", "--foreground", "--endpoint", endpoint, *models,
               *extra]
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Wait until the daemon reports 'ready'; raise with its log if it exits or never gets there."""
        deadline = time.monotonic() + timeout
        with FLyClient(self.endpoint, timeout=2.0, max_retries=0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.output()}")
                try:
                    if client.health().state == "ready":
                        return
                except FLyUnavailable:
                    pass
                time.sleep(0.2)
        raise RuntimeError(f"daemon not ready after {timeout} s:\n{self.output()}")

    def output(self) -> str:
        """Everything the daemon logged so far."""
        return self.log.read_text(errors="replace")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait; SIGKILL if it does not exit in time. Returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL (a crash)."""
        self.proc.kill()
        self.proc.wait()


def start_daemon(target: Path | None, draft: Path | None, workdir: Path, name: str = "d", *extra: str,
                 ready_timeout: float = 180.0) -> DaemonProcess:
    """Start a daemon on an ipc socket under `workdir` and wait for it to be ready."""
    workdir.mkdir(parents=True, exist_ok=True)
    daemon = DaemonProcess(target, draft, f"ipc://{workdir / (name + '.sock')}", workdir / f"{name}.log", *extra)
    try:
        daemon.wait_ready(ready_timeout)
    except BaseException:
        daemon.kill()
        raise
    return daemon


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (for a daemon's --http or --metrics-port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving_http(target: Path | None, draft: Path | None, workdir: Path, name: str = "d",
                *extra: str) -> Iterator[tuple[DaemonProcess, str]]:
    """A daemon (`start_daemon`) with its HTTP front on a free loopback port: (the process, the front's root
    URL); afterwards it must stop cleanly, with no traceback in its log."""
    port = free_port()
    daemon = start_daemon(target, draft, workdir, name, "--http", f"127.0.0.1:{port}", *extra)
    yield daemon, f"http://127.0.0.1:{port}"
    assert daemon.stop() == 0
    assert "Traceback" not in daemon.output()
