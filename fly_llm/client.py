"""Clients of the fly-daemon: `FLyClient` (threads) and `AsyncFLyClient` (asyncio). No torch here.

Both speak the wire protocol of fly_llm.protocol over a ZeroMQ DEALER socket:
- lazy connect, one socket per thread (sync) or per event loop (async); one socket carries many
  concurrent requests, replies are routed to their request by id;
- while requests are open, a small background thread sends `HeartbeatRequest`s (once a second) so
  the daemon keeps them; the daemon answers each heartbeat, which is how a client notices a dead
  daemon: no answer at all for `min(timeout, LIVENESS_S)` seconds raises `FLyUnavailable`;
- retries only where they are safe: info/health/status/tokenize are re-sent on a fresh socket, and
  a generate request is re-sent only when the daemon answered BUSY before admitting it.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import zmq
import zmq.asyncio
import zmq.auth
from pydantic import ValidationError

from fly_llm.config import REQUEST_OPTIONS, FLyOverrides, SamplingParams
from fly_llm.endpoints import default_endpoint, runtime_dir  # noqa: F401  (public API)
from fly_llm.errors import BadRequest, Busy, FLyUnavailable, Timeout, error_from_code
from fly_llm.protocol import (
    CancelRequest, ChatMessage, ErrorReply, GenerateRequest, GenerateResult, HealthReply, HealthRequest,
    HeartbeatRequest, InfoReply, InfoRequest, StatusReply, StatusRequest, TokenChunk, TokenizeReply,
    TokenizeRequest, decode_reply, encode, invalid,
)

HEARTBEAT_INTERVAL_S = 1.0
"""How often a client tells the daemon which requests it still waits for."""
LIVENESS_S = 10.0
"""No answer at all from the daemon for this long → FLyUnavailable (at a call's deadline: sooner, see check)."""
RPC_ATTEMPT_S = 3.0
"""How long one attempt of info/health/status/tokenize waits before it is re-sent."""
BUSY_BACKOFF_S = 0.25
"""First wait before re-sending a generate request the daemon refused as BUSY (doubles each retry)."""
_POLL_MS = 100
_MAX_TIMEOUT_S = 86_400.0  # the protocol's cap on a request deadline

Messages = list[ChatMessage | dict[str, Any]]


# ---- endpoint and options ----

def build_options(**options: Any) -> tuple[SamplingParams, FLyOverrides]:
    """Sampling parameters and FLy overrides from REQUEST_OPTIONS values; None keeps the daemon's default."""
    if unknown := set(options) - set(REQUEST_OPTIONS):
        raise TypeError(f"unknown option(s) {sorted(unknown)}; accepted: {', '.join(REQUEST_OPTIONS)}")
    given = {name: value for name, value in options.items() if value is not None}
    with _checked():
        return (SamplingParams(**{n: v for n, v in given.items() if n in SamplingParams.model_fields}),
                FLyOverrides(**{n: v for n, v in given.items() if n in FLyOverrides.model_fields}))


@contextmanager
def _checked() -> Iterator[None]:
    """Turn pydantic's ValidationError into BadRequest (TooLong for a size cap), as the daemon does."""
    try:
        yield
    except ValidationError as exc:
        raise invalid(exc) from None


def _messages(messages: Messages | None) -> list[ChatMessage] | None:
    if messages is None:
        return None
    return [m if isinstance(m, ChatMessage) else ChatMessage.model_validate(m) for m in messages]


def _generate_request(prompt: str | None, messages: Messages | None, sampling: SamplingParams | None,
                      fly: FLyOverrides | None, stream: bool, timeout: float) -> GenerateRequest:
    with _checked():
        return GenerateRequest(
            id=uuid.uuid4().hex, prompt=prompt, messages=_messages(messages), sampling=sampling or SamplingParams(),
            fly=fly or FLyOverrides(), stream=stream, timeout_s=min(timeout, _MAX_TIMEOUT_S))


def _new_socket(context: zmq.Context, endpoint: str) -> zmq.Socket:
    """A DEALER socket connected to `endpoint`, with CURVE keys from the environment when set.

    $FLY_CURVE_SERVER_KEY: the daemon's public certificate file; $FLY_CURVE_CLIENT_CERT: this
    client's secret certificate file (both made with zmq.auth.create_certificates).
    """
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    server_key = os.environ.get("FLY_CURVE_SERVER_KEY")
    if server_key:
        public, secret = zmq.auth.load_certificate(os.environ["FLY_CURVE_CLIENT_CERT"])
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_serverkey = zmq.auth.load_certificate(server_key)[0]
    sock.connect(endpoint)
    return sock


def _send(sock: zmq.Socket, message: Any) -> None:
    """Queue one frame without ever blocking; a full queue means nobody is reading it."""
    try:
        sock.send(encode(message), zmq.NOBLOCK)
    except zmq.Again:
        raise FLyUnavailable(f"cannot queue a request to {sock.getsockopt_string(zmq.LAST_ENDPOINT)}") from None


def _raise_error(reply: ErrorReply) -> None:
    raise error_from_code(reply.code, reply.message)


class _Heartbeat:
    """Tells the daemon once a second which requests this client still waits for, and notes when it answered.

    Runs in its own daemon thread with its own socket while requests are open (so a consumer that
    is slow to read a stream does not lose it); the thread ends after a while with nothing open,
    or on `close`, and a later `add` starts a fresh one.
    """

    def __init__(self, endpoint: str) -> None:
        self._endpoint = endpoint
        self._ids: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop: threading.Event | None = None
        self._kick = threading.Event()
        self.last_heard = 0.0

    def add(self, ids: Iterable[str]) -> None:
        """Start heartbeating for `ids`."""
        with self._lock:
            for rid in ids:
                self._ids[rid] = self._ids.get(rid, 0) + 1
            if self._stop is None:
                self._stop = threading.Event()
                threading.Thread(target=self._run, args=(self._stop,), name="fly-heartbeat", daemon=True).start()
        self._kick.set()  # beat now: the daemon's answer shows it is there

    def discard(self, ids: Iterable[str]) -> None:
        """Stop heartbeating for `ids`."""
        with self._lock:
            for rid in ids:
                left = self._ids.pop(rid, 1) - 1
                if left > 0:
                    self._ids[rid] = left

    def heard(self) -> None:
        """The daemon answered something just now."""
        self.last_heard = time.monotonic()

    def check(self, since: float, deadline: float) -> None:
        """Raise FLyUnavailable when the daemon, asked at `since`, has been silent for LIVENESS_S, or at
        the `deadline` when it never answered or its heartbeats went unanswered (gone, not slow)."""
        now = time.monotonic()
        silent = now - max(self.last_heard, since)
        gone_at_deadline = now >= deadline and (self.last_heard < since or silent > 3 * HEARTBEAT_INTERVAL_S)
        if silent > LIVENESS_S or gone_at_deadline:
            raise FLyUnavailable(f"no answer from a fly-daemon at {self._endpoint} for {silent:.1f} s")

    def close(self) -> None:
        """Stop the thread."""
        with self._lock:
            if self._stop is not None:
                self._stop.set()
                self._stop = None

    def _run(self, stop: threading.Event) -> None:
        sock = _new_socket(zmq.Context.instance(), self._endpoint)
        idle = 0
        try:
            while not stop.is_set():
                with self._lock:
                    ids = list(self._ids)
                    idle = 0 if ids else idle + 1
                    if idle > 30 and self._stop is stop:
                        self._stop = None
                        return
                for start in range(0, len(ids), 4096):
                    beat = HeartbeatRequest(id=f"hb-{uuid.uuid4().hex}", ids=ids[start:start + 4096])
                    try:
                        sock.send(encode(beat), zmq.NOBLOCK)
                    except zmq.Again:
                        pass
                self._kick.clear()
                deadline = time.monotonic() + HEARTBEAT_INTERVAL_S
                while (left := deadline - time.monotonic()) > 0 and not stop.is_set() and not self._kick.is_set():
                    if sock.poll(min(_POLL_MS, int(left * 1000) + 1)):
                        sock.recv()
                        self.heard()
        finally:
            sock.close(0)


# ---- sync client ----

class _Connection:
    """One DEALER socket of one thread, and the replies that arrived for each open request."""

    def __init__(self, endpoint: str, heartbeat: _Heartbeat) -> None:
        self.socket = _new_socket(zmq.Context.instance(), endpoint)
        self.inbox: dict[str, deque] = {}
        self._heartbeat = heartbeat

    def next_reply(self, rid: str, deadline: float, since: float):
        """The next reply for request `rid`; Timeout at `deadline`, FLyUnavailable if the daemon is silent."""
        queue = self.inbox[rid]
        while not queue:
            self._heartbeat.check(since, deadline)
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout(f"request {rid} did not finish within its timeout")
            if self.socket.poll(min(_POLL_MS, int(left * 1000) + 1)):
                try:
                    reply = decode_reply(self.socket.recv())
                except BadRequest:
                    continue
                self._heartbeat.heard()
                if reply.id in self.inbox:
                    self.inbox[reply.id].append(reply)
        return queue.popleft()


class FLyClient:
    """Synchronous client of a fly-daemon; thread-safe (a socket per thread), connects lazily.

    `timeout` bounds each call (seconds); `max_retries` is how often a safe call is re-sent.
    """

    def __init__(self, endpoint: str | None = None, timeout: float = 120.0, max_retries: int = 2) -> None:
        self.endpoint = endpoint or default_endpoint()
        self.timeout = timeout
        self.max_retries = max_retries
        self._local = threading.local()
        self._connections: list[_Connection] = []
        self._lock = threading.Lock()
        self._heartbeat = _Heartbeat(self.endpoint)

    # -- generation --

    def generate(self, prompt: str, sampling: SamplingParams | None = None, fly: FLyOverrides | None = None,
                 timeout: float | None = None) -> GenerateResult:
        """Generate a completion for `prompt`."""
        return self._one(_generate_request(prompt, None, sampling, fly, False, self._timeout(timeout)))

    def chat(self, messages: Messages, sampling: SamplingParams | None = None, fly: FLyOverrides | None = None,
             timeout: float | None = None) -> GenerateResult:
        """Answer chat `messages` (rendered with the target's chat template on the daemon)."""
        return self._one(_generate_request(None, messages, sampling, fly, False, self._timeout(timeout)))

    def stream(self, prompt: str | None = None, *, messages: Messages | None = None,
               sampling: SamplingParams | None = None, fly: FLyOverrides | None = None,
               timeout: float | None = None) -> Iterator[TokenChunk | GenerateResult]:
        """Yield TokenChunks as text is generated, then the final GenerateResult.

        Closing the iterator early cancels the request on the daemon.
        """
        request = _generate_request(prompt, messages, sampling, fly, True, self._timeout(timeout))
        with self._open([request]) as (conn, deadline):
            yield from self._replies(conn, request, deadline)

    def batch(self, prompts: list[str] | list[Messages], sampling: SamplingParams | None = None,
              fly: FLyOverrides | None = None, timeout: float | None = None) -> list[GenerateResult]:
        """Generate for many prompts (strings or message lists), all sent at once and batched by the daemon."""
        t = self._timeout(timeout)
        requests = [_generate_request(p, None, sampling, fly, False, t) if isinstance(p, str)
                    else _generate_request(None, p, sampling, fly, False, t) for p in prompts]
        with self._open(requests) as (conn, deadline):
            return [_last(self._replies(conn, r, deadline)) for r in requests]

    # -- metadata --

    def info(self) -> InfoReply:
        """Models, context window, limits and defaults of the daemon."""
        return self._rpc(InfoRequest(id=uuid.uuid4().hex))

    def health(self) -> HealthReply:
        """The daemon's state: loading, ready, draining or failed."""
        return self._rpc(HealthRequest(id=uuid.uuid4().hex))

    def status(self) -> StatusReply:
        """Load, throughput and acceptance counters of the daemon."""
        return self._rpc(StatusRequest(id=uuid.uuid4().hex))

    def tokenize(self, text: str | None = None, messages: Messages | None = None) -> TokenizeReply:
        """Token ids of `text` (or of `messages` through the chat template) with the daemon's tokenizer."""
        with _checked():
            request = TokenizeRequest(id=uuid.uuid4().hex, text=text, messages=_messages(messages))
        return self._rpc(request)

    def close(self) -> None:
        """Close every socket of this client (call when no thread uses it any more)."""
        self._heartbeat.close()
        with self._lock:
            for conn in self._connections:
                conn.socket.close(0)
            self._connections.clear()
        self._local = threading.local()

    def __enter__(self) -> "FLyClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- machinery --

    def _timeout(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    def _conn(self) -> _Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = _Connection(self.endpoint, self._heartbeat)
            self._local.conn = conn
            with self._lock:
                self._connections.append(conn)
        return conn

    def _drop_conn(self) -> None:
        """Forget this thread's socket (and anything still queued on it)."""
        conn = self._local.__dict__.pop("conn", None)
        if conn is not None:
            with self._lock:
                if conn in self._connections:
                    self._connections.remove(conn)
            conn.socket.close(0)

    @contextmanager
    def _open(self, requests: list[GenerateRequest]) -> Iterator[tuple[_Connection, float]]:
        """Send `requests`, heartbeat them while open, cancel whichever did not finish on the way out."""
        conn = self._conn()
        ids = [r.id for r in requests]
        for rid in ids:
            conn.inbox[rid] = deque()
        self._heartbeat.add(ids)
        finished = True
        try:
            for r in requests:
                _send(conn.socket, r)
            finished = False
            yield conn, time.monotonic() + requests[0].timeout_s
            finished = True
        except FLyUnavailable:
            self._drop_conn()
            raise
        finally:
            self._heartbeat.discard(ids)
            for rid in ids:
                conn.inbox.pop(rid, None)
            if not finished and not conn.socket.closed:
                for rid in ids:
                    try:
                        conn.socket.send(encode(CancelRequest(id=rid)), zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass

    def _one(self, request: GenerateRequest) -> GenerateResult:
        with self._open([request]) as (conn, deadline):
            return _last(self._replies(conn, request, deadline))

    def _replies(self, conn: _Connection, request: GenerateRequest,
                 deadline: float) -> Iterator[TokenChunk | GenerateResult]:
        """Replies to one open generate request up to its result; re-sends it on BUSY before admission."""
        since, attempt = time.monotonic(), 0
        while True:
            reply = conn.next_reply(request.id, deadline, since)
            if isinstance(reply, ErrorReply):
                if reply.code == Busy.code and attempt < self.max_retries:
                    time.sleep(BUSY_BACKOFF_S * 2 ** attempt)
                    attempt += 1
                    since = time.monotonic()
                    _send(conn.socket, request)
                    continue
                _raise_error(reply)
            if isinstance(reply, (TokenChunk, GenerateResult)):
                yield reply
                if isinstance(reply, GenerateResult):
                    return

    def _rpc(self, request: Any) -> Any:
        """Send a metadata request and wait for its answer, re-sending on a fresh socket if none comes."""
        window = min(RPC_ATTEMPT_S, self.timeout)
        for _ in range(self.max_retries + 1):
            conn = self._conn()
            conn.inbox[request.id] = deque()
            try:
                since = time.monotonic()
                _send(conn.socket, request)
                reply = conn.next_reply(request.id, since + window, since)
            except (FLyUnavailable, Timeout):
                self._drop_conn()
                continue
            finally:
                conn.inbox.pop(request.id, None)
            if isinstance(reply, ErrorReply):
                _raise_error(reply)
            return reply
        raise FLyUnavailable(f"no fly-daemon answered at {self.endpoint} "
                             f"({self.max_retries + 1} tries, {window:.1f} s each)")


def _last(replies: Iterator[TokenChunk | GenerateResult]) -> GenerateResult:
    result = None
    for result in replies:
        pass
    assert isinstance(result, GenerateResult)
    return result


# ---- async client ----

_ASYNC_CONTEXT: zmq.asyncio.Context | None = None


def _async_context() -> zmq.asyncio.Context:
    global _ASYNC_CONTEXT
    if _ASYNC_CONTEXT is None:
        _ASYNC_CONTEXT = zmq.asyncio.Context()
    return _ASYNC_CONTEXT


class _AsyncConnection:
    """One DEALER socket of one event loop; a reader task routes replies to per-request queues."""

    def __init__(self, endpoint: str, heartbeat: _Heartbeat) -> None:
        self.socket = _new_socket(_async_context(), endpoint)
        self.inbox: dict[str, asyncio.Queue] = {}
        self._heartbeat = heartbeat
        self._reader: asyncio.Task | None = None

    def open(self, ids: Iterable[str]) -> None:
        """Make queues for `ids` and make sure the reader runs."""
        for rid in ids:
            self.inbox[rid] = asyncio.Queue()
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        while self.inbox and not self.socket.closed:
            if not await self.socket.poll(_POLL_MS):
                continue
            try:
                reply = decode_reply(await self.socket.recv())
            except BadRequest:
                continue
            self._heartbeat.heard()
            if reply.id in self.inbox:
                self.inbox[reply.id].put_nowait(reply)

    async def next_reply(self, rid: str, deadline: float, since: float):
        """The next reply for request `rid`; Timeout at `deadline`, FLyUnavailable if the daemon is silent."""
        queue = self.inbox[rid]
        while True:
            if not queue.empty():
                return queue.get_nowait()
            self._heartbeat.check(since, deadline)
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout(f"request {rid} did not finish within its timeout")
            try:
                return await asyncio.wait_for(queue.get(), min(_POLL_MS / 1000, left))
            except asyncio.TimeoutError:
                continue

    async def send(self, message: Any) -> None:
        """Queue one frame without blocking."""
        try:
            await self.socket.send(encode(message), zmq.NOBLOCK)
        except zmq.Again:
            raise FLyUnavailable("cannot queue a request to the fly-daemon") from None


class AsyncFLyClient:
    """Asyncio client of a fly-daemon (zmq.asyncio); a socket per event loop, connects lazily.

    Same methods as FLyClient, as coroutines; `stream` is an async iterator.
    """

    def __init__(self, endpoint: str | None = None, timeout: float = 120.0, max_retries: int = 2) -> None:
        self.endpoint = endpoint or default_endpoint()
        self.timeout = timeout
        self.max_retries = max_retries
        self._connections: dict[asyncio.AbstractEventLoop, _AsyncConnection] = {}
        self._lock = threading.Lock()
        self._heartbeat = _Heartbeat(self.endpoint)

    async def generate(self, prompt: str, sampling: SamplingParams | None = None,
                       fly: FLyOverrides | None = None, timeout: float | None = None) -> GenerateResult:
        """Generate a completion for `prompt`."""
        return (await self._gather([_generate_request(prompt, None, sampling, fly, False,
                                                      self._timeout(timeout))]))[0]

    async def chat(self, messages: Messages, sampling: SamplingParams | None = None,
                   fly: FLyOverrides | None = None, timeout: float | None = None) -> GenerateResult:
        """Answer chat `messages` (rendered with the target's chat template on the daemon)."""
        return (await self._gather([_generate_request(None, messages, sampling, fly, False,
                                                      self._timeout(timeout))]))[0]

    async def stream(self, prompt: str | None = None, *, messages: Messages | None = None,
                     sampling: SamplingParams | None = None, fly: FLyOverrides | None = None,
                     timeout: float | None = None) -> AsyncIterator[TokenChunk | GenerateResult]:
        """Yield TokenChunks as text is generated, then the final GenerateResult; leaving early cancels."""
        request = _generate_request(prompt, messages, sampling, fly, True, self._timeout(timeout))
        conn, deadline = await self._open([request])
        finished = False
        try:
            async for reply in self._replies(conn, request, deadline):
                yield reply
            finished = True
        except FLyUnavailable:
            self._drop_conn()
            raise
        finally:
            await self._close_requests(conn, [request], finished)

    async def batch(self, prompts: list[str] | list[Messages], sampling: SamplingParams | None = None,
                    fly: FLyOverrides | None = None, timeout: float | None = None) -> list[GenerateResult]:
        """Generate for many prompts (strings or message lists), all sent at once and batched by the daemon."""
        t = self._timeout(timeout)
        return await self._gather([_generate_request(p, None, sampling, fly, False, t) if isinstance(p, str)
                                   else _generate_request(None, p, sampling, fly, False, t) for p in prompts])

    async def info(self) -> InfoReply:
        """Models, context window, limits and defaults of the daemon."""
        return await self._rpc(InfoRequest(id=uuid.uuid4().hex))

    async def health(self) -> HealthReply:
        """The daemon's state: loading, ready, draining or failed."""
        return await self._rpc(HealthRequest(id=uuid.uuid4().hex))

    async def status(self) -> StatusReply:
        """Load, throughput and acceptance counters of the daemon."""
        return await self._rpc(StatusRequest(id=uuid.uuid4().hex))

    async def tokenize(self, text: str | None = None, messages: Messages | None = None) -> TokenizeReply:
        """Token ids of `text` (or of `messages` through the chat template) with the daemon's tokenizer."""
        with _checked():
            request = TokenizeRequest(id=uuid.uuid4().hex, text=text, messages=_messages(messages))
        return await self._rpc(request)

    def close(self) -> None:
        """Close every socket of this client."""
        self._heartbeat.close()
        with self._lock:
            for conn in self._connections.values():
                conn.socket.close(0)
            self._connections.clear()

    async def __aenter__(self) -> "AsyncFLyClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    # -- machinery --

    def _timeout(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    def _conn(self) -> _AsyncConnection:
        loop = asyncio.get_running_loop()
        with self._lock:
            for old in [lp for lp in self._connections if lp.is_closed()]:
                self._connections.pop(old).socket.close(0)
            if loop not in self._connections:
                self._connections[loop] = _AsyncConnection(self.endpoint, self._heartbeat)
            return self._connections[loop]

    def _drop_conn(self) -> None:
        with self._lock:
            conn = self._connections.pop(asyncio.get_running_loop(), None)
        if conn is not None:
            conn.socket.close(0)

    async def _open(self, requests: list[GenerateRequest]) -> tuple[_AsyncConnection, float]:
        conn = self._conn()
        ids = [r.id for r in requests]
        conn.open(ids)
        self._heartbeat.add(ids)
        try:
            for r in requests:
                await conn.send(r)
        except FLyUnavailable:
            await self._close_requests(conn, requests, True)
            self._drop_conn()
            raise
        return conn, time.monotonic() + requests[0].timeout_s

    async def _close_requests(self, conn: _AsyncConnection, requests: list[GenerateRequest],
                              finished: bool) -> None:
        ids = [r.id for r in requests]
        self._heartbeat.discard(ids)
        for rid in ids:
            conn.inbox.pop(rid, None)
        if not finished and not conn.socket.closed:
            for rid in ids:
                try:
                    await conn.socket.send(encode(CancelRequest(id=rid)), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass

    async def _gather(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        conn, deadline = await self._open(requests)
        finished = False
        try:
            results = [await _alast(self._replies(conn, r, deadline)) for r in requests]
            finished = True
            return results
        except FLyUnavailable:
            self._drop_conn()
            raise
        finally:
            await self._close_requests(conn, requests, finished)

    async def _replies(self, conn: _AsyncConnection, request: GenerateRequest,
                       deadline: float) -> AsyncIterator[TokenChunk | GenerateResult]:
        since, attempt = time.monotonic(), 0
        while True:
            reply = await conn.next_reply(request.id, deadline, since)
            if isinstance(reply, ErrorReply):
                if reply.code == Busy.code and attempt < self.max_retries:
                    await asyncio.sleep(BUSY_BACKOFF_S * 2 ** attempt)
                    attempt += 1
                    since = time.monotonic()
                    await conn.send(request)
                    continue
                _raise_error(reply)
            if isinstance(reply, (TokenChunk, GenerateResult)):
                yield reply
                if isinstance(reply, GenerateResult):
                    return

    async def _rpc(self, request: Any) -> Any:
        window = min(RPC_ATTEMPT_S, self.timeout)
        for _ in range(self.max_retries + 1):
            conn = self._conn()
            conn.open([request.id])
            try:
                since = time.monotonic()
                await conn.send(request)
                reply = await conn.next_reply(request.id, since + window, since)
            except (FLyUnavailable, Timeout):
                self._drop_conn()
                continue
            finally:
                conn.inbox.pop(request.id, None)
            if isinstance(reply, ErrorReply):
                _raise_error(reply)
            return reply
        raise FLyUnavailable(f"no fly-daemon answered at {self.endpoint} "
                             f"({self.max_retries + 1} tries, {window:.1f} s each)")


async def _alast(replies: AsyncIterator[TokenChunk | GenerateResult]) -> GenerateResult:
    result = None
    async for result in replies:
        pass
    assert isinstance(result, GenerateResult)
    return result
