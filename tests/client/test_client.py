"""The client library without a daemon: endpoints, options, and FLyUnavailable instead of a hang."""

from __future__ import annotations

import stat
import time

import pytest

from fly_llm.client import AsyncFLyClient, FLyClient, build_options, default_endpoint, runtime_dir
from fly_llm.common.config import FLyOverrides, SamplingParams
from fly_llm.common.errors import BadRequest, FLyUnavailable


def test_default_endpoint_and_private_runtime_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("FLY_ENDPOINT", raising=False)
    monkeypatch.setenv("FLY_RUNTIME_DIR", str(tmp_path / "rt"))
    assert default_endpoint() == f"ipc://{tmp_path / 'rt' / 'daemon.sock'}"
    assert stat.S_IMODE(runtime_dir().stat().st_mode) == 0o700
    (tmp_path / "rt").chmod(0o755)
    assert stat.S_IMODE(runtime_dir().stat().st_mode) == 0o700
    monkeypatch.setenv("FLY_ENDPOINT", "tcp://127.0.0.1:7000")
    assert default_endpoint() == "tcp://127.0.0.1:7000"


def test_build_options_keeps_unset_values_unset():
    sampling, fly = build_options(max_tokens=5, loose=False)
    assert sampling == SamplingParams(max_tokens=5) and fly == FLyOverrides(loose=False)
    assert fly.model_dump(exclude_none=True) == {"loose": False}
    with pytest.raises(BadRequest, match="max_tokens"):
        build_options(max_tokens=-1)
    with pytest.raises(BadRequest, match="window"):
        build_options(window=-2)


def test_bad_arguments_raise_bad_request_before_sending(tmp_path):
    with FLyClient(f"ipc://{tmp_path}/none.sock", timeout=1) as client:
        with pytest.raises(BadRequest):
            client.generate("")
        with pytest.raises(BadRequest):
            client.chat([{"role": "robot", "content": "x"}])
        with pytest.raises(BadRequest):
            client.tokenize()


@pytest.mark.parametrize("call", ["health", "generate", "stream", "batch"])
def test_no_daemon_means_unavailable_within_the_timeout(tmp_path, call):
    client = FLyClient(f"ipc://{tmp_path}/none.sock", timeout=1.5, max_retries=1)
    actions = {"health": client.health, "generate": lambda: client.generate("hi"),
               "stream": lambda: list(client.stream("hi")), "batch": lambda: client.batch(["a", "b"])}
    started = time.monotonic()
    with pytest.raises(FLyUnavailable):
        actions[call]()
    assert time.monotonic() - started < 10
    client.close()


async def test_async_no_daemon_means_unavailable(tmp_path):
    async with AsyncFLyClient(f"ipc://{tmp_path}/none.sock", timeout=1.5, max_retries=0) as client:
        with pytest.raises(FLyUnavailable):
            await client.health()
        with pytest.raises(FLyUnavailable):
            await client.generate("hi")
        with pytest.raises(FLyUnavailable):
            async for _ in client.stream("hi"):
                pass
