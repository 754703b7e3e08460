"""The `fly-serve` command: bad options fail before Ray starts; a real run serves until interrupted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")

from fly_daemon import serve_cli  # noqa: E402
from fly_daemon.replicas import REPLICA_HEADER  # noqa: E402

from support.daemon_process import free_port  # noqa: E402


@pytest.mark.parametrize("argv, message", [
    (["--http", "0.0.0.0:8000"], "not loopback"),
    (["--http", "nohost"], "HOST:PORT"),
    (["--min-replicas", "3", "--max-replicas", "1"], "min_replicas"),
    (["--replicas", "0"], "at least 1"),
    (["--window", "-1"], "window"),
])
def test_bad_options_fail_before_ray_starts(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("FLY_API_KEY", raising=False)
    assert serve_cli.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.timeout(600)
def test_fly_serve_serves_until_interrupted(tiny_pair_dirs, tmp_path):
    target, draft = tiny_pair_dirs
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "PYTHONUNBUFFERED": "1"}  # a local Ray
    log = (tmp_path / "fly-serve.log").open("w+")
    proc = subprocess.Popen([sys.executable, "-m", "fly_daemon.serve_cli", "--http", f"127.0.0.1:{port}",
                             "--replicas", "1", "--target", str(target), "--draft", str(draft), "--dtype", "float32",
                             "--target-quantization", "none", "--wait", "300"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while "fly-serve: serving" not in (tmp_path / "fly-serve.log").read_text():
            assert proc.poll() is None, (tmp_path / "fly-serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "fly-serve did not start"
            time.sleep(1)
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                           json={"model": str(target), "prompt": "Hello", "max_tokens": 4}, timeout=120)
        assert reply.status_code == 200 and reply.headers[REPLICA_HEADER]
        assert reply.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert code == 0, (tmp_path / "fly-serve.log").read_text()[-3000:]
