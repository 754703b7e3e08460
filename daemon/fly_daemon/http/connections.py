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
  from one client (its address, an IPv6 one's /64 network: fly_daemon.client_identity.connection_client;
  a trusted proxy's, `trusted_proxies`, count only in all: its connections carry many clients); one more
  is answered 503 BUSY naming the cap, at once, before anything is read, and closed, so a flood of
  connections holds its file descriptors for a moment only;
- a fair share of the cap in all: when it is full, a new connection is admitted in place of an *idle*
  one of the client holding the most connections, if that client holds more than the newcomer would
  after admission (so each swap moves the counts towards equal and none undoes another);
- else, stale idle connections: in place of the connection idle longest of all, if it has been idle for
  `http_idle_reclaim` at least. A client sends its head within milliseconds of connecting, and one whose
  kept-alive connection was closed opens another; so many addresses holding one or two idle connections
  each (where no swap is fair) cannot refuse the front to others until their timeouts (seconds) end them.
  Only when neither rule finds a connection is the newcomer answered 503.

Idle: from admission, or from a response's end on a kept-alive connection, until a request's head is
complete: a head that is slow or partial (one byte of it) leaves the connection idle, since its idle start,
so an attacker cannot make its connections unreclaimable with a byte each. A connection in the middle of a
request (from its head's end to its response's end) is never closed for another. The connection that goes
(of the client's, or of all, the one idle longest) is closed without an answer, as a timeout closes one.

An answer begun before its request's body was read whole (a 413 on the Content-Length, a refusal before the
route reads) ends its connection: `CloseWhenBodyUnread` marks it `connection: close`, so a kept-alive client
does not send its next request there, and the protocol closes it lingering (what still comes is that body,
read and dropped), never taking the rest of the body for a next request's head.

A head over `MAX_HEAD_BYTES` is answered 431 and closed (httptools, which uvicorn prefers, has no
such limit of its own); bodies are bounded by `max_frame_bytes` (`http._BodyLimit`). All of it runs on
the front's event loop thread.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import logging
import resource
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from fly_llm.common.errors import Busy

from fly_daemon.client_identity import connection_client, is_trusted
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
REBUILD_SLACK = 64
"""Stale entries ConnectionGate's ranking may hold beyond one per live one before it is rebuilt."""


C = TypeVar("C", bound=Hashable)


@dataclass(frozen=True)
class Admitted(Generic[C]):
    """A connection was admitted; `reclaimed`: the idle one it replaces (no longer counted), to close now."""

    reclaimed: C | None = None


class ConnectionGate(Generic[C]):
    """The admitted open connections (any hashable handle `C`) in all and per client against the caps,
    which of them are idle and since when (by `now`, a monotonic clock in seconds), and which one a full
    front reclaims for a newcomer (the module docstring).

    O(log clients) a step: the clients holding idle connections are in a max-heap by connections held; an
    entry goes stale when its client's count changes or it has no idle connection left, is dropped when it
    surfaces, and the heap is rebuilt when the stale ones outnumber the live ones. Every idle connection is
    in one ordered map by idle start too (the clock never goes back, so an idle one joins at its end)."""

    def __init__(self, limits: HttpLimits, max_connections: int, now: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.max_connections = max_connections
        self.now = now
        self.client_of: dict[C, str] = {}  # every admitted open connection's client
        self.open: dict[str, int] = {}  # connections held per client (clients holding none are absent)
        self.idle_of: dict[str, OrderedDict[C, None]] = {}  # the idle ones, longest idle first (none: absent)
        self.idle_since: OrderedDict[C, float] = OrderedDict()  # every idle one's idle start, longest idle first
        self._ranked: list[tuple[int, int, str]] = []  # (-connections held, push order, client)
        self._pushes = itertools.count()
        self.lingering = 0  # refused connections still reading their answer

    @property
    def total(self) -> int:
        """Admitted connections open."""
        return len(self.client_of)

    def admit(self, peer: str, conn: C) -> Busy | Admitted[C]:
        """Count `conn`, a new connection from the address `peer` (as the server gives it), as open and idle,
        or the reason it is refused (then it is not counted)."""
        client = connection_client(peer, self.limits.trusted_proxies)
        held = self.open.get(client, 0)
        if (held >= self.limits.http_max_connections_per_client
                and not is_trusted(client, self.limits.trusted_proxies)):
            return Busy(f"this client has {self.limits.http_max_connections_per_client} HTTP connections open "
                        f"(the daemon's http_max_connections_per_client); close some or reuse them")
        reclaimed = None
        if self.total >= self.max_connections:
            reclaimed = self._fair_swap(held + 1)
            if reclaimed is None:
                reclaimed = self._stale()
            if reclaimed is None:
                return Busy(f"the HTTP front has {self.max_connections} connections open (its "
                            f"http_max_connections); try again later")
            self.release(reclaimed)  # perhaps the newcomer's client's own (a stale one)
        self.client_of[conn] = client
        self.open[client] = self.open.get(client, 0) + 1
        self.idle_of.setdefault(client, OrderedDict())[conn] = None
        self.idle_since[conn] = self.now()
        self._rank(client)
        return Admitted(reclaimed)

    def idle(self, conn: C) -> None:
        """`conn` waits for a request whose head is not complete (again: after a response); idle already, it
        stays idle since when it became so."""
        client = self.client_of[conn]
        first = client not in self.idle_of
        self.idle_of.setdefault(client, OrderedDict())[conn] = None
        self.idle_since.setdefault(conn, self.now())
        if first:
            self._rank(client)

    def busy(self, conn: C) -> None:
        """A request's head is complete on `conn`: it is not reclaimed until idle again."""
        client = self.client_of[conn]
        idle = self.idle_of.get(client)
        if idle is not None and conn in idle:
            del idle[conn]
            del self.idle_since[conn]
            if not idle:
                del self.idle_of[client]
                self._bound()

    def release(self, conn: C) -> None:
        """An admitted connection closed (or was reclaimed)."""
        self.busy(conn)
        client = self.client_of.pop(conn)
        if self.open[client] == 1:
            del self.open[client]
        else:
            self.open[client] -= 1
            self._rank(client)

    def check(self) -> None:
        """AssertionError unless the books agree: the per-client counts are the open connections' and sum to
        the total, which is within the cap; no client is over its cap (but a trusted proxy); the idle
        connections are open ones of their client, and all of them are in `idle_since`, longest idle first;
        every client with idle ones is ranked by its count now; the stale ranks are bounded."""
        assert self.total <= self.max_connections
        assert self.open == dict(Counter(self.client_of.values())) and sum(self.open.values()) == self.total
        cap = self.limits.http_max_connections_per_client
        assert all(n <= cap or is_trusted(c, self.limits.trusted_proxies) for c, n in self.open.items())
        for client, idle in self.idle_of.items():
            assert idle and all(self.client_of.get(conn) == client for conn in idle)
        assert set(self.idle_since) == {conn for idle in self.idle_of.values() for conn in idle}
        since = list(self.idle_since.values())
        assert since == sorted(since) and all(s <= self.now() for s in since)
        assert {client for negative, _, client in self._ranked if self._live(negative, client)} == set(self.idle_of)
        assert len(self._ranked) <= 2 * len(self.idle_of) + REBUILD_SLACK
        assert self.lingering >= 0

    def _fair_swap(self, wanted: int) -> C | None:
        """The longest idle connection of the client holding the most connections of those with idle ones,
        if it holds more than `wanted` (what the newcomer would hold); else None."""
        while self._ranked and not self._live(self._ranked[0][0], self._ranked[0][2]):
            heapq.heappop(self._ranked)
        if not self._ranked or -self._ranked[0][0] <= wanted:
            return None
        return next(iter(self.idle_of[self._ranked[0][2]]))

    def _stale(self) -> C | None:
        """The connection idle longest of all, if idle for `http_idle_reclaim` at least; else None."""
        oldest = next(iter(self.idle_since.items()), None)
        if oldest is not None and self.now() - oldest[1] >= self.limits.http_idle_reclaim:
            return oldest[0]
        return None

    def _rank(self, client: str) -> None:
        """Rank `client` by its count now, if it has idle connections (its entries before go stale)."""
        if client in self.idle_of:
            heapq.heappush(self._ranked, (-self.open[client], next(self._pushes), client))
            self._bound()

    def _bound(self) -> None:
        """Rebuild the ranking from the live clients once stale entries outnumber them (amortized O(1))."""
        if len(self._ranked) > 2 * len(self.idle_of) + REBUILD_SLACK:
            self._ranked = [(-self.open[c], next(self._pushes), c) for c in self.idle_of]
            heapq.heapify(self._ranked)

    def _live(self, negative_held: int, client: str) -> bool:
        """Whether a ranking entry is current: its client has idle connections and holds -`negative_held`."""
        return client in self.idle_of and self.open[client] == -negative_held


def guarded_protocol(limits: HttpLimits, books: ConnectionGate[Any] | None = None) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class with `limits`, counting its connections in `books` (by default a new gate
    for `http_max_connections`, as the descriptor limit allows: one per front)."""
    gate = books if books is not None else ConnectionGate(limits, connection_budget(limits.http_max_connections))

    class GuardedProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]  # httptools' or h11's, as uvicorn picks
        _admitted = False
        _refused = False
        _deadline: asyncio.TimerHandle | None = None
        _timed_cycle: object | None = None  # the last request whose head was complete
        _reading_body = False  # its body is still coming
        _awaiting_head = True  # no request's head is complete since the connection's start or the last response
        _head_bytes = 0  # bytes received since the last complete head that were not its body (the next head's)

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.transport = _LingeringClose(transport, self._body_left_behind, self._linger)  # what uvicorn closes
            admission = gate.admit(self.client[0] if self.client else "unknown", self)
            if isinstance(admission, Busy):
                self._refuse(admission)
                return
            self._admitted = True
            if admission.reclaimed is not None:
                admission.reclaimed.reclaim()
            self._arm(limits.http_header_timeout)

        def reclaim(self) -> None:
            """Close this idle connection, which the gate no longer counts, for another client's."""
            self._admitted = False
            self._disarm()
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return  # what a refused client sends is read and dropped, so its close is clean
            if self._awaiting_head or not self._reading_body:  # a pipelined head comes while a request runs
                self._head_bytes += len(data)
            super().data_received(data)
            self._follow()
            if self._awaiting_head and self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                self._disarm()
                self._answer_and_close(b"431 Request Header Fields Too Large", {"error": {
                    "message": f"request head over the limit of {MAX_HEAD_BYTES} bytes",
                    "type": "invalid_request_error", "param": None, "code": "TOO_LONG"}})

        def on_response_complete(self) -> None:
            super().on_response_complete()  # may start a pipelined request already read
            if self._body_left_behind():  # its answer said connection: close (CloseWhenBodyUnread)
                self._linger()
            elif not self.transport.is_closing():
                self._arm(limits.http_header_timeout)  # for the next head (idle: the keep-alive timeout ends it first)
                self._awaiting_head = True
                self._follow()
                if self._between_requests():
                    gate.idle(self)

        def _body_left_behind(self) -> bool:
            """Whether the request's answer is complete and its body is not: what comes is the rest of the body."""
            return self._reading_body and self.cycle is not None and self.cycle.response_complete

        def _between_requests(self) -> bool:
            """Whether every request read is answered, the next one's head not complete (reclaimable)."""
            answered = self.cycle.response_complete  # a pipelined request already read is the cycle (httptools, h11)
            return answered and not self._reading_body

        def _follow(self) -> None:
            """Move the deadline on when a request's head, or its body, is complete (a complete head: busy)."""
            cycle = self.cycle
            if cycle is not None and cycle is not self._timed_cycle:  # a new request's head is complete
                self._timed_cycle, self._reading_body, self._awaiting_head = cycle, cycle.more_body, False
                self._head_bytes = 0
                gate.busy(self)
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
                gate.release(self)
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
            """Send one answer and close (`_linger`)."""
            content = json.dumps(body).encode()
            self.transport.write(b"HTTP/1.1 %s\r\ncontent-type: application/json\r\n%sconnection: close\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (status, headers, len(content), content))
            self._linger()

        def _linger(self) -> None:
            """Close after the answer written: half-close and drop what the client still sends until it closes
            (so the answer is not lost to a reset), at most REFUSED_LINGER_S; at once past MAX_LINGERING."""
            if self._refused:
                return
            self._disarm()
            self._refused = True
            gate.lingering += 1
            if gate.lingering > MAX_LINGERING or not self.transport.can_write_eof():
                self.transport.close()
                return
            self.transport.write_eof()  # the client reads the answer, then closes (eof_received closes ours)
            self._deadline = self.loop.call_later(REFUSED_LINGER_S, self.transport.abort)

    return GuardedProtocol


class _LingeringClose:
    """A connection's transport as uvicorn holds it: its close() lingers (`linger`) while `body_left_behind()`
    (a closing answer sent before its request's body was read: closing at once would reset the connection,
    and the client could lose the answer); everything else is the transport's own."""

    def __init__(self, transport: asyncio.Transport, body_left_behind: Callable[[], bool],
                 linger: Callable[[], None]) -> None:
        self._transport = transport
        self._body_left_behind = body_left_behind
        self._linger = linger

    def close(self) -> None:
        if self._body_left_behind():
            self._linger()
        else:
            self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CloseWhenBodyUnread:
    """ASGI middleware: an answer begun before its request's body was read whole says `connection: close`, so a
    kept-alive client sends its next request on a new connection (guarded_protocol then closes this one
    lingering); an answer to a request without a body, or after reading it, is left as it is."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        body_read = headers.get("content-length", "0") == "0" and "transfer-encoding" not in headers

        async def reading() -> Message:
            nonlocal body_read
            message = await receive()
            body_read = body_read or not message.get("more_body", False)
            return message

        async def answering(message: Message) -> None:
            if message["type"] == "http.response.start" and not body_read:
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, reading, answering)


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
