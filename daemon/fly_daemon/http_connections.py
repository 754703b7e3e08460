"""Connection limits of the HTTP front (issue 45): read timeouts and caps on open connections.

uvicorn alone times out only an idle keep-alive connection (`timeout_keep_alive`, used here as
`http_keep_alive_timeout`), and only after a first response; a connection that never sends a
complete head, or a body, stays open forever. Its `limit_concurrency` answers 503 to *every* new
request once that many connections are open, so a flood of idle connections would shut everyone
out. So `guarded_protocol(limits)` is uvicorn's own HTTP protocol class (httptools or h11, as
uvicorn picks) with:

- a header timeout: a request's head must be complete within `http_header_timeout` of the
  connection's start, or of the previous response on a kept-alive connection; else it is closed;
- a body timeout: its body must be complete within `http_body_timeout` of its head; else the
  connection is closed (the route sees a disconnect, and nothing was submitted);
- caps: at most `http_max_connections` open connections in all and `http_max_connections_per_client`
  from one client address (a trusted proxy's, `trusted_proxies`, count only in all: its connections
  carry many clients, fly_daemon.client_identity); one more is answered 503 BUSY naming the cap, at
  once, before anything is read, and closed, so a flood of connections holds its file descriptors for
  a moment only.

A head over `MAX_HEAD_BYTES` is answered 431 and closed (httptools, which uvicorn prefers, has no
such limit of its own); bodies are bounded by `max_frame_bytes` (`http._BodyLimit`). All of it runs on
the front's event loop thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from fly_llm.common.errors import Busy

from fly_daemon.client_identity import is_trusted
from fly_daemon.settings import HttpLimits

log = logging.getLogger("fly_daemon")

FD_RESERVE = 256
"""File descriptors kept for everything but HTTP connections (the ZeroMQ door, model files, the grammar
sandbox's pipes, logs): the connection cap is lowered to fit the process's descriptor limit less these."""
MAX_HEAD_BYTES = 64 * 1024
"""Bytes a request's head may have (h11 refuses more than 16 KiB itself; httptools has no such limit): a
connection that sends more before its head is complete is answered 431 and closed."""
MAX_LINGERING = 64
"""Refused connections that may linger at once (within FD_RESERVE); past it one is closed as soon as answered."""
REFUSED_LINGER_S = 1.0
"""How long a refused connection (503, 431) may stay to read its answer (until the client closes, at most this)."""


class ConnectionGate:
    """Counts the open connections, in all and per client address, against the caps."""

    def __init__(self, limits: HttpLimits, max_connections: int) -> None:
        self.limits = limits
        self.max_connections = max_connections
        self.open: dict[str, int] = {}
        self.total = 0
        self.lingering = 0  # refused connections still reading their answer

    def admit(self, client: str) -> Busy | None:
        """Count a new connection from `client`, or the reason it is refused (then it is not counted)."""
        if self.total >= self.max_connections:
            return Busy(f"the HTTP front has {self.max_connections} connections open (its http_max_connections); "
                        f"try again later")
        if (self.open.get(client, 0) >= self.limits.http_max_connections_per_client
                and not is_trusted(client, self.limits.trusted_proxies)):
            return Busy(f"this client has {self.limits.http_max_connections_per_client} HTTP connections open "
                        f"(the daemon's http_max_connections_per_client); close some or reuse them")
        self.open[client] = self.open.get(client, 0) + 1
        self.total += 1
        return None

    def release(self, client: str) -> None:
        """An admitted connection from `client` closed."""
        self.total -= 1
        left = self.open[client] - 1
        if left:
            self.open[client] = left
        else:
            del self.open[client]


def guarded_protocol(limits: HttpLimits) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class with `limits` (one gate per call: one per front)."""
    gate = ConnectionGate(limits, connection_budget(limits.http_max_connections))

    class GuardedProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]  # httptools' or h11's, as uvicorn picks
        _client_key = ""
        _admitted = False
        _refused = False
        _deadline: asyncio.TimerHandle | None = None
        _timed_cycle: object | None = None  # the last request whose head was complete
        _reading_body = False  # its body is still coming
        _awaiting_head = True  # no request's head is complete since the connection's start or the last response
        _head_bytes = 0  # bytes received while awaiting a head

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._client_key = self.client[0] if self.client else "unknown"
            refusal = gate.admit(self._client_key)
            if refusal is not None:
                self._refuse(refusal)
                return
            self._admitted = True
            self._arm(limits.http_header_timeout)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return  # what a refused client sends is read and dropped, so its close is clean
            if self._awaiting_head:
                self._head_bytes += len(data)
            super().data_received(data)
            self._follow()
            if self._awaiting_head and self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                self._disarm()
                self._answer_and_close(b"431 Request Header Fields Too Large", {})

        def on_response_complete(self) -> None:
            super().on_response_complete()  # may start a pipelined request already read
            if not self.transport.is_closing():
                self._arm(limits.http_header_timeout)  # for the next head (idle: the keep-alive timeout ends it first)
                self._awaiting_head, self._head_bytes = True, 0
                self._follow()

        def _follow(self) -> None:
            """Move the deadline on when a request's head, or its body, is complete."""
            cycle = self.cycle
            if cycle is not None and cycle is not self._timed_cycle:  # a new request's head is complete
                self._timed_cycle, self._reading_body, self._awaiting_head = cycle, cycle.more_body, False
                if cycle.more_body:
                    self._arm(limits.http_body_timeout)
                else:
                    self._disarm()
            elif self._reading_body and not cycle.more_body:  # its body is complete: the route has it
                self._reading_body = False
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._admitted:
                self._admitted = False
                gate.release(self._client_key)
            if self._refused:
                self._refused = False
                gate.lingering -= 1
            super().connection_lost(exc)

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

        def _refuse(self, error: Busy) -> None:
            """Answer 503 BUSY naming the cap, before reading anything, and close."""
            self._answer_and_close(b"503 Service Unavailable", {"error": {
                "message": error.message, "type": "server_error", "param": None, "code": error.code}},
                b"retry-after: 1\r\n")

        def _answer_and_close(self, status: bytes, body: dict, headers: bytes = b"") -> None:
            """Send one answer and close: half-close and drop what the client still sends until it closes
            (so the answer is not lost to a reset), at most REFUSED_LINGER_S; at once past MAX_LINGERING."""
            self._refused = True
            gate.lingering += 1
            content = json.dumps(body).encode() if body else b""
            self.transport.write(b"HTTP/1.1 %s\r\ncontent-type: application/json\r\n%sconnection: close\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (status, headers, len(content), content))
            if gate.lingering > MAX_LINGERING or not self.transport.can_write_eof():
                self.transport.close()
                return
            self.transport.write_eof()  # the client reads the answer, then closes (eof_received closes ours)
            self._deadline = self.loop.call_later(REFUSED_LINGER_S, self.transport.abort)

    return GuardedProtocol


def connection_budget(wanted: int) -> int:
    """`wanted` connections, or fewer if the process's file descriptor limit (its soft limit raised to
    the hard one first) less FD_RESERVE cannot hold them (logged)."""
    infinite = resource.RLIM_INFINITY
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != infinite and (hard == infinite or hard > soft):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # an infinite hard limit is more than the kernel allows as a soft one
            pass
    if soft == infinite or wanted + FD_RESERVE <= soft:
        return wanted
    budget = max(1, soft - FD_RESERVE)
    log.warning("http_max_connections %d lowered to %d: the file descriptor limit is %d and %d are kept for the "
                "rest of the daemon", wanted, budget, soft, FD_RESERVE)
    return budget
