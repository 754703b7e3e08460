"""A daemon that vanishes under a waiting client (killed, crashed) is FLyUnavailable, never a Timeout.

A fake daemon (a ROUTER on the client's endpoint, in its own ZeroMQ context) answers heartbeats,
streams a few chunks and then vanishes at a seeded moment: its sockets close as a killed process's
would. Whatever the moment, and well within a request timeout too short for the heartbeats to
tell (under 3 heartbeat intervals), a request still open ends with FLyUnavailable (code
UNAVAILABLE) from every call of both clients; a reply sent before the end is still delivered; the
same client then works with the daemon that comes next. A daemon that is there but does not answer
a request still ends it with Timeout.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import zmq

from fly_llm.client import AsyncFLyClient, FLyClient
from fly_llm.common.errors import FLyUnavailable, Timeout
from fly_llm.common.protocol import (
    GenerateRequest, GenerateResult, HealthReply, HeartbeatRequest, TokenChunk, Usage, decode_request, encode,
)

TIMEOUT_S = 2.5
"""Each call's timeout: under 3 heartbeat intervals (fly_llm.client.heartbeat), so unanswered heartbeats alone
cannot tell a vanished daemon from a slow one."""
SEEDS = 30


@dataclass(frozen=True)
class Moment:
    """When the fake daemon vanishes: after `requests` generate requests came, `chunks` chunks went out for each
    (streams only), a result too if `finish`, and `beats` heartbeats were answered; never if not `vanish`."""

    requests: int
    chunks: int
    beats: int
    finish: bool
    vanish: bool = True


class FakeDaemon:
    """A ROUTER at `endpoint` that plays a daemon until the `moment` it vanishes (its context terminated)."""

    def __init__(self, endpoint: str, moment: Moment) -> None:
        self.moment = moment
        self._context = zmq.Context()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._accepted = self._router.get_monitor_socket(zmq.EVENT_ACCEPTED)
        self._router.bind(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def wait_accepted(self) -> None:
        """Wait until a client socket connected (a client that was connected before has seen its old peer go)."""
        assert self._accepted.poll(30_000), "no client connected"

    def close(self) -> None:
        """Vanish now (if the moment has not come)."""
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive()

    def _serve(self) -> None:
        requests = beats = 0
        try:
            while not self._stop.is_set():
                if self.moment.vanish and requests >= self.moment.requests and beats >= self.moment.beats:
                    return
                if not self._router.poll(20):
                    continue
                peer, frame = self._router.recv_multipart()
                request = decode_request(frame)
                if isinstance(request, HeartbeatRequest):
                    beats += requests > 0
                    self._router.send_multipart([peer, encode(HealthReply(id=request.id, state="ready"))])
                elif isinstance(request, GenerateRequest):
                    requests += 1
                    for reply in self._replies(request):
                        self._router.send_multipart([peer, encode(reply)])
                else:
                    self._router.send_multipart([peer, encode(HealthReply(id=request.id, state="ready"))])
        finally:
            self._accepted.close(0)
            self._router.close(0)
            self._context.term()  # every connection closed, as when the process dies

    def _replies(self, request: GenerateRequest) -> list[TokenChunk | GenerateResult]:
        chunks = [TokenChunk(id=request.id, text=f"{i} ", token_ids=[i]) for i in range(self.moment.chunks)]
        result = GenerateResult(id=request.id, text="0 1 ", token_ids=[0, 1], finish_reason="length",
                                usage=Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3))
        return (chunks if request.stream else []) + ([result] if self.moment.finish else [])


def _sync_calls(client: FLyClient) -> dict[str, tuple[int, Callable[[], object]]]:
    """Each call of the sync client: (how many generate requests it sends, the call)."""
    return {"generate": (1, lambda: client.generate("hi")),
            "chat": (1, lambda: client.chat([{"role": "user", "content": "hi"}])),
            "batch": (2, lambda: client.batch(["a", "b"])),
            "stream": (1, lambda: list(client.stream("hi")))}


def _async_calls(client: AsyncFLyClient) -> dict[str, tuple[int, Callable[[], object]]]:
    """Each call of the asyncio client, run in its own event loop."""
    async def stream() -> list:
        return [r async for r in client.stream("hi")]

    return {"async generate": (1, lambda: asyncio.run(client.generate("hi"))),
            "async batch": (2, lambda: asyncio.run(client.batch(["a", "b"]))),
            "async stream": (1, lambda: asyncio.run(stream()))}


def _moment(rng: random.Random, requests: int) -> Moment:
    return Moment(requests=requests, chunks=rng.randrange(4), beats=rng.choice([0, 0, 1]),
                  finish=rng.random() < 0.25)


def test_a_daemon_vanishing_at_random_moments_is_unavailable(tmp_path):
    """Seeded: a call, and the moment its daemon vanishes; the same two clients throughout."""
    endpoint = f"ipc://{tmp_path}/fake.sock"
    rng = random.Random(20261206)
    with FLyClient(endpoint, timeout=TIMEOUT_S, max_retries=0) as sync_client:
        async_client = AsyncFLyClient(endpoint, timeout=TIMEOUT_S, max_retries=0)
        calls = _sync_calls(sync_client) | _async_calls(async_client)
        outcomes: dict[str, int] = {}
        for seed in range(SEEDS):
            name = rng.choice(sorted(calls))
            requests, call = calls[name]
            moment = _moment(rng, requests)
            daemon = FakeDaemon(endpoint, moment)
            try:
                if seed:
                    daemon.wait_accepted()  # the sync client's sockets saw the last daemon go
                if moment.finish:
                    assert call(), f"seed {seed}: {name} at {moment}"
                else:
                    with pytest.raises(FLyUnavailable) as caught:
                        call()
                    assert caught.value.code == "UNAVAILABLE", f"seed {seed}: {name} at {moment}"
                outcomes[name] = outcomes.get(name, 0) + 1
            finally:
                daemon.close()
        async_client.close()
    assert len(outcomes) >= 5  # most calls drawn


@pytest.mark.parametrize("call", ["generate", "stream", "async generate", "async stream"])
def test_a_daemon_that_is_there_but_silent_is_a_timeout(tmp_path, call):
    """It answers heartbeats but never the request: a Timeout (code TIMEOUT), not FLyUnavailable."""
    endpoint = f"ipc://{tmp_path}/fake.sock"
    daemon = FakeDaemon(endpoint, Moment(requests=1, chunks=1, beats=0, finish=False, vanish=False))
    client, async_client = FLyClient(endpoint, timeout=2.0, max_retries=0), AsyncFLyClient(endpoint, 2.0, 0)
    try:
        with pytest.raises(Timeout) as caught:
            (_sync_calls(client) | _async_calls(async_client))[call][1]()
        assert caught.value.code == "TIMEOUT"
    finally:
        daemon.close()
        client.close()
        async_client.close()

