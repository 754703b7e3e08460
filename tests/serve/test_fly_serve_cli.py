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


@pytest.fixture
def no_ray_auth_mode(monkeypatch):
    """RAY_AUTH_MODE unset for the test, and restored after it (fly-serve may set it)."""
    monkeypatch.setenv("RAY_AUTH_MODE", "placeholder")
    monkeypatch.delenv("RAY_AUTH_MODE")


@pytest.mark.parametrize("env, argv, message", [
    ({"FLY_API_KEY": ""}, [], "without an API key"),
    ({"FLY_API_KEY": " \n"}, [], "without an API key"),
    ({}, ["--api-key", ""], "without an API key"),
    ({"FLY_API_KEY": "k", "RAY_AUTH_MODE": "disabled"}, [], "token authentication off (RAY_AUTH_MODE=disabled)"),
])
def test_no_unauthenticated_serving_beyond_loopback(env, argv, message, capsys, monkeypatch, no_ray_auth_mode):
    """Issue 33 finding 8: FLY_API_KEY="" passed the check and served 0.0.0.0 without a key."""
    import ray

    monkeypatch.delenv("FLY_API_KEY", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started"))
    assert serve_cli.main(["--http", "0.0.0.0:8000", *argv]) == 2
    assert message in capsys.readouterr().err


def test_beyond_loopback_ray_starts_with_token_authentication(capsys, monkeypatch, no_ray_auth_mode):
    import ray

    def init(*_, **__):
        raise ValueError(f"ray.init under RAY_AUTH_MODE={os.environ.get('RAY_AUTH_MODE')}")

    monkeypatch.setenv("FLY_API_KEY", "k")
    monkeypatch.setattr(ray, "init", init)
    assert serve_cli.main(["--http", "0.0.0.0:8000"]) == 2
    assert "ray.init under RAY_AUTH_MODE=token" in capsys.readouterr().err


def test_the_builder_refuses_what_fly_serve_refuses(monkeypatch, no_ray_auth_mode):
    """`serve run fly_daemon.replicas:build` checked nothing; the replicas check the same (with Serve's real host)."""
    import ray

    from fly_daemon import replicas

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(replicas, "serve_http_host", lambda: "0.0.0.0")
    monkeypatch.setenv("FLY_API_KEY", "")
    with pytest.raises(ValueError, match="without an API key"):
        replicas.build({"target": "some/dir"})
    with pytest.raises(ValueError, match="without an API key"):
        replicas.build({"target": "some/dir", "api_key": "  "})
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.raises(ValueError, match="token authentication off"):
        replicas.build({"target": "some/dir", "api_key": "k"})
    monkeypatch.delenv("RAY_AUTH_MODE")
    assert replicas.build({"target": "some/dir", "api_key": "k"}) and os.environ["RAY_AUTH_MODE"] == "token"
    monkeypatch.setattr(replicas, "serve_http_host", lambda: "127.0.0.1")
    assert replicas.build({"target": "some/dir"})


def test_the_daemons_keep_alive_timeout_reaches_rays_proxy():
    from fly_daemon.settings import DaemonSettings

    options = serve_cli.http_options("127.0.0.1", 8123, DaemonSettings(http_keep_alive_timeout=7.5))
    assert options == {"host": "127.0.0.1", "port": 8123, "keep_alive_timeout_s": 8}  # Ray takes whole seconds
    from ray.serve.config import HTTPOptions

    assert HTTPOptions(**options).keep_alive_timeout_s == 8  # a field Ray's proxy takes
