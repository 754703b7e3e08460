"""The HTTP front's protocol tells its connection gate when a connection is idle (fly_daemon.http.connections):
from its start, or from a response's end, until a request's head is complete; a partial head (one byte of it)
leaves it idle since its idle start, so an attacker cannot make its connections unreclaimable with a byte each.

`guarded_protocol`'s own class on an in-memory transport and an ASGI app that answers a request only when the
test says so: random requests (with and without bodies, pipelined too) go in as random slices of their bytes,
answers come between them, and after every step the gate counts the connection idle exactly when every request
whose head is complete is answered, idle since the admission or the last answer.
"""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from uvicorn.config import Config
from uvicorn.server import ServerState

from fly_daemon.http.connections import ConnectionGate, guarded_protocol
from fly_daemon.settings import HttpLimits

LIMITS = HttpLimits(http_header_timeout=3600, http_body_timeout=3600, http_keep_alive_timeout=3600)


class Transport(asyncio.Transport):
    """A connection from 10.0.0.1 held in memory: what the server writes is kept, a close only marked."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("10.0.0.1", 40000), "sockname": ("10.0.0.2", 8000)}.get(name, default)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class HeldApp:
    """An ASGI app that reads each request's body, then answers 200 once `release()` lets it (in order)."""

    def __init__(self) -> None:
        self.releases = 0
        self.answered = 0
        self.allowed = asyncio.Condition()

    async def release(self) -> None:
        async with self.allowed:
            self.releases += 1
            self.allowed.notify_all()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        while (await receive()).get("more_body", False):
            pass
        async with self.allowed:
            await self.allowed.wait_for(lambda: self.releases > self.answered)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})
        self.answered += 1


def request_bytes(body: int) -> tuple[bytes, int]:
    """One request (a GET without a body, a POST with `body` bytes) and where its head ends in it."""
    head = b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n" if not body else \
        b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n" % body
    return head + b"b" * body, len(head)


steps = st.lists(st.one_of(st.integers(1, 40).map(lambda n: ("send", n)), st.just(("answer", 0))), max_size=40)


@settings(max_examples=200, deadline=None)
@given(bodies=st.lists(st.sampled_from([0, 0, 1, 30]), min_size=1, max_size=5), steps=steps)
def test_a_connection_is_idle_until_a_head_is_complete_and_again_once_all_is_answered(bodies, steps):
    asyncio.run(_drive(bodies, steps))


async def _drive(bodies: list[int], steps: list[tuple[str, int]]) -> None:
    clock = [0.0]
    gate: ConnectionGate[Any] = ConnectionGate(LIMITS, 8, now=lambda: clock[0])
    app = HeldApp()
    config = Config(app, lifespan="off", log_level="warning", http=guarded_protocol(LIMITS, gate))
    config.load()
    protocol = config.http_protocol_class(config=config, server_state=ServerState(), app_state={})
    stream, head_ends = b"", []
    for body in bodies:
        data, head = request_bytes(body)
        head_ends.append(len(stream) + head)
        stream += data
    transport, sent, idle_since = Transport(), 0, 0.0
    protocol.connection_made(transport)
    for step, (kind, n) in enumerate(steps, 1):
        clock[0] = float(step)
        answered = app.answered
        if kind == "send" and sent < len(stream):
            protocol.data_received(stream[sent:sent + n])
            sent = min(len(stream), sent + n)
        elif kind == "answer":
            await app.release()
        for _ in range(20):  # the app's tasks run to their next wait
            await asyncio.sleep(0)
        heads = sum(end <= sent for end in head_ends)
        if app.answered > answered and app.answered == heads:
            idle_since = clock[0]  # its last answer ended in this step
        gate.check()
        assert not transport.closed
        assert (protocol in gate.idle_since) == (app.answered == heads), (sent, heads, app.answered)
        if app.answered == heads:
            assert gate.idle_since[protocol] == idle_since
    protocol.connection_lost(None)
    assert gate.total == 0
