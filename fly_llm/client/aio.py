"""`AsyncFLyClient`: the client of a fly-daemon for asyncio code (a socket per event loop, lazy connect)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from contextlib import suppress
from typing import Any

import zmq.asyncio
from pydantic import BaseModel

from fly_llm.client.base import ClientBase, Connection
from fly_llm.client.core import (
    POLL_S, GenerateReplies, Messages, Prompt, Resend, Tools, answer, make_infill, new_id, tokenize_request,
)
from fly_llm.client.heartbeat import Heartbeat
from fly_llm.client.sockets import send
from fly_llm.common.config import FLyOverrides, SamplingParams
from fly_llm.common.errors import FLyUnavailable, Timeout
from fly_llm.common.fim import InfillFile
from fly_llm.common.protocol import (
    GenerateResult, HealthReply, HealthRequest, InfoReply, InfoRequest, StatusReply, StatusRequest, TokenChunk,
    TokenizeReply,
)

_CONTEXT: zmq.asyncio.Context | None = None


def _context() -> zmq.asyncio.Context:
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = zmq.asyncio.Context()
    return _CONTEXT


class _AsyncConnection(Connection):
    """One event loop's socket; a reader task delivers replies (and notes a dropped connection) while any
    request is open."""

    def __init__(self, endpoint: str, heartbeat: Heartbeat) -> None:
        super().__init__(_context(), endpoint, heartbeat)
        self._reader: asyncio.Task | None = None
        self._arrived = asyncio.Event()

    async def next_reply(self, rid: str, since: float, deadline: float) -> BaseModel:
        """The next reply for request `rid`; Timeout at `deadline`, FLyUnavailable if the daemon went away or
        is silent."""
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read())
        while True:
            reply, wait = self.inbox.take(rid, since, deadline)
            if reply is not None:
                return reply
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), wait)

    async def ask(self, request: BaseModel, window: float) -> BaseModel:
        """Send a metadata request and wait up to `window` seconds for its reply."""
        with self.asking(request) as since:
            return await self.next_reply(request.id, since, since + window)

    async def _read(self) -> None:
        while self.inbox and not self.socket.closed:
            if await self.poller.poll(int(POLL_S * 1000)):
                self.pump()
                arrived, self._arrived = self._arrived, asyncio.Event()
                arrived.set()  # wakes whoever waits now; later waiters wait for the next frame


class AsyncFLyClient(ClientBase):
    """Asyncio client of a fly-daemon (zmq.asyncio); a socket per event loop, connects lazily.

    Same methods as FLyClient, as coroutines; `stream` is an async iterator.
    """

    def __init__(self, endpoint: str | None = None, timeout: float = 120.0, max_retries: int = 2) -> None:
        super().__init__(endpoint, timeout, max_retries)
        self._connections: dict[asyncio.AbstractEventLoop, _AsyncConnection] = {}

    async def generate(self, prompt: Prompt, sampling: SamplingParams | None = None,
                       fly: FLyOverrides | None = None, timeout: float | None = None, suffix: str | None = None,
                       **structure: Any) -> GenerateResult:
        """Generate a completion for `prompt` (with `suffix`, or an Infill, fill in the middle: see
        `FLyClient.generate`); `structure`: the structure options (e.g. `response_format`)."""
        return (await self.batch([prompt], sampling, fly, timeout, suffix, **structure))[0]

    async def infill(self, prefix: str, suffix: str = "", *, files: Iterable[InfillFile | dict[str, str]] = (),
                     filename: str = "", repo_name: str = "", sampling: SamplingParams | None = None,
                     fly: FLyOverrides | None = None, timeout: float | None = None,
                     **structure: Any) -> GenerateResult:
        """Fill in the code between `prefix` and `suffix`, other `files` of the repository first
        (`FLyClient.infill`)."""
        return await self.generate(make_infill(prefix, suffix, files, filename, repo_name), sampling, fly, timeout,
                                   **structure)

    async def chat(self, messages: Messages, sampling: SamplingParams | None = None,
                   fly: FLyOverrides | None = None, timeout: float | None = None, **structure: Any) -> GenerateResult:
        """Answer chat `messages` (rendered with the target's chat template on the daemon).

        `structure`: the structure options, keywords named as `fly_llm.common.tools.StructureOptions`' fields
        (another keyword is a TypeError). With `tools` the model may call them (`tool_choice`: "auto",
        "none", "required" or one named function; `parallel_tool_calls=False`: at most one call); the
        result's `tool_calls` lists the calls. `response_format` constrains the answer to JSON (a
        schema, or any object) or a regex.
        """
        return (await self.batch([messages], sampling, fly, timeout, **structure))[0]

    async def stream(self, prompt: Prompt | None = None, *, messages: Messages | None = None,
                     sampling: SamplingParams | None = None, fly: FLyOverrides | None = None,
                     timeout: float | None = None, suffix: str | None = None,
                     **structure: Any) -> AsyncIterator[TokenChunk | GenerateResult]:
        """Yield TokenChunks as text (and whole tool calls) are generated, then the final GenerateResult;
        `prompt` and `suffix` as for `generate`, `structure` as for `chat`; leaving early cancels."""
        request = self._request(prompt, messages, sampling, fly, timeout, stream=True, suffix=suffix, **structure)
        with self._open([request]) as (conn, (replies,)):
            async for reply in self._replies(conn, replies):
                yield reply

    async def batch(self, prompts: list[Prompt] | list[Messages], sampling: SamplingParams | None = None,
                    fly: FLyOverrides | None = None, timeout: float | None = None, suffix: str | None = None,
                    **structure: Any) -> list[GenerateResult]:
        """Generate for many prompts (strings, Infills or message lists), all sent at once and batched by the
        daemon; `suffix` and `structure` as for `generate`, the same for every prompt."""
        requests = self._batch(prompts, sampling, fly, timeout, suffix, **structure)
        with self._open(requests) as (conn, routes):
            return [[r async for r in self._replies(conn, replies)][-1] for replies in routes]

    async def info(self) -> InfoReply:
        """Models, context window, limits and defaults of the daemon."""
        return await self._rpc(InfoRequest(id=new_id()))

    async def health(self) -> HealthReply:
        """The daemon's state: loading, ready, draining or failed."""
        return await self._rpc(HealthRequest(id=new_id()))

    async def status(self) -> StatusReply:
        """Load, throughput and acceptance counters of the daemon."""
        return await self._rpc(StatusRequest(id=new_id()))

    async def tokenize(self, text: str | None = None, messages: Messages | None = None,
                       tools: Tools | None = None) -> TokenizeReply:
        """Token ids of `text` (or of `messages` and the `tools` offered, through the chat template) with the
        daemon's tokenizer: as many as `chat(messages, tools=tools)` would have as its prompt."""
        return await self._rpc(tokenize_request(text, messages, tools))

    def close(self) -> None:
        """Close every socket of this client."""
        self._heartbeat.close()
        with self._lock:
            for conn in self._connections.values():
                conn.close()
            self._connections.clear()

    async def __aenter__(self) -> "AsyncFLyClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def _conn(self) -> _AsyncConnection:
        loop = asyncio.get_running_loop()
        with self._lock:
            for old in [lp for lp in self._connections if lp.is_closed()]:
                self._connections.pop(old).close()
            if loop not in self._connections:
                self._connections[loop] = _AsyncConnection(self.endpoint, self._heartbeat)
            return self._connections[loop]

    def _drop_conn(self) -> None:
        with self._lock:
            conn = self._connections.pop(asyncio.get_running_loop(), None)
        if conn is not None:
            conn.close()

    async def _replies(self, conn: _AsyncConnection,
                       replies: GenerateReplies) -> AsyncIterator[TokenChunk | GenerateResult]:
        """Replies to one open generate request up to its result, re-sent when the daemon was BUSY."""
        while not replies.done:
            step = replies.route(await conn.next_reply(replies.request.id, replies.since, replies.deadline))
            if isinstance(step, Resend):
                await asyncio.sleep(step.delay)
                send(conn.socket, replies.request)
            elif step is not None:
                yield step

    async def _rpc(self, request: BaseModel) -> Any:
        """Send a metadata request and wait for its answer, re-sending on a fresh socket if none comes."""
        for window in self._rpc_windows():
            try:
                reply = await self._conn().ask(request, window)
            except (FLyUnavailable, Timeout):
                self._drop_conn()
            else:
                return answer(reply)
