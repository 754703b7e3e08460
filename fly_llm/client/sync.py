"""`FLyClient`: the client of a fly-daemon for threaded code (a socket per thread, lazy connect)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import zmq
from pydantic import BaseModel

from fly_llm.client.base import ClientBase, Connection
from fly_llm.client.core import (
    GenerateReplies, Messages, Prompt, Resend, Tools, answer, make_infill, new_id, result_of, tokenize_request,
)
from fly_llm.client.sockets import send
from fly_llm.common.config import FLyOverrides, SamplingParams
from fly_llm.common.errors import FLyUnavailable, Timeout
from fly_llm.common.fim import InfillFile
from fly_llm.common.protocol import (
    GenerateResult, HealthReply, HealthRequest, InfoReply, InfoRequest, StatusReply, StatusRequest, TokenChunk,
    TokenizeReply,
)


class _Connection(Connection):
    """One thread's socket; the thread reads it (and its monitor) while it waits."""

    def next_reply(self, rid: str, since: float, deadline: float) -> BaseModel:
        """The next reply for request `rid`; Timeout at `deadline`, FLyUnavailable if the daemon went away or
        is silent."""
        while True:
            reply, wait = self.inbox.take(rid, since, deadline)
            if reply is not None:
                return reply
            if self.poller.poll(int(wait * 1000) + 1):
                self.pump()

    def ask(self, request: BaseModel, window: float) -> BaseModel:
        """Send a metadata request and wait up to `window` seconds for its reply."""
        with self.asking(request) as since:
            return self.next_reply(request.id, since, since + window)


class FLyClient(ClientBase):
    """Synchronous client of a fly-daemon; thread-safe (a socket per thread), connects lazily.

    `timeout` bounds each call (seconds); `max_retries` is how often a safe call is re-sent.
    """

    def __init__(self, endpoint: str | None = None, timeout: float = 120.0, max_retries: int = 2) -> None:
        super().__init__(endpoint, timeout, max_retries)
        self._local = threading.local()
        self._connections: list[_Connection] = []

    def generate(self, prompt: Prompt, sampling: SamplingParams | None = None, fly: FLyOverrides | None = None,
                 timeout: float | None = None, suffix: str | None = None, **structure: Any) -> GenerateResult:
        """Generate a completion for `prompt`; `structure`: the structure options (e.g. `response_format`).

        With `suffix` (OpenAI's), or an `Infill` as `prompt`, fill in the middle: the daemon builds the prompt
        from the target's FIM tokens (FimUnsupported, FIM_UNSUPPORTED, for a target without them).
        """
        return self.batch([prompt], sampling, fly, timeout, suffix, **structure)[0]

    def infill(self, prefix: str, suffix: str = "", *, files: Iterable[InfillFile | dict[str, str]] = (),
               filename: str = "", repo_name: str = "", sampling: SamplingParams | None = None,
               fly: FLyOverrides | None = None, timeout: float | None = None, **structure: Any) -> GenerateResult:
        """Fill in the code between `prefix` and `suffix` (what llama.cpp's /infill does): `files` are other files
        of the repository (`{"filename", "text"}`), put before the code in the model's repository format with
        `repo_name`, and `filename` names the file being edited. FimUnsupported for a target without FIM tokens.
        To stream it, give `stream` the same as an `Infill` (fly_llm.common.fim) as its prompt."""
        return self.generate(make_infill(prefix, suffix, files, filename, repo_name), sampling, fly, timeout,
                             **structure)

    def chat(self, messages: Messages, sampling: SamplingParams | None = None, fly: FLyOverrides | None = None,
             timeout: float | None = None, **structure: Any) -> GenerateResult:
        """Answer chat `messages` (rendered with the target's chat template on the daemon).

        `structure`: the structure options, keywords named as `fly_llm.common.tools.StructureOptions`' fields
        (another keyword is a TypeError). With `tools` the model may call them (`tool_choice`: "auto",
        "none", "required" or one named function; `parallel_tool_calls=False`: at most one call); the
        result's `tool_calls` lists the calls. `response_format` constrains the answer to JSON (a
        schema, or any object) or a regex.
        """
        return self.batch([messages], sampling, fly, timeout, **structure)[0]

    def stream(self, prompt: Prompt | None = None, *, messages: Messages | None = None,
               sampling: SamplingParams | None = None, fly: FLyOverrides | None = None,
               timeout: float | None = None, suffix: str | None = None,
               **structure: Any) -> Iterator[TokenChunk | GenerateResult]:
        """Yield TokenChunks as text (and whole tool calls) are generated, then the final GenerateResult.

        `prompt` and `suffix` as for `generate` (or chat `messages`); `structure` as for `chat`. Closing the
        iterator early cancels the request on the daemon.
        """
        request = self._request(prompt, messages, sampling, fly, timeout, stream=True, suffix=suffix, **structure)
        with self._open([request]) as (conn, (replies,)):
            yield from self._replies(conn, replies)

    def batch(self, prompts: list[Prompt] | list[Messages], sampling: SamplingParams | None = None,
              fly: FLyOverrides | None = None, timeout: float | None = None, suffix: str | None = None,
              **structure: Any) -> list[GenerateResult]:
        """Generate for many prompts (strings, Infills or message lists), all sent at once and batched by the
        daemon; `suffix` (each prompt a string) and `structure` as for `generate`, the same for every prompt."""
        requests = self._batch(prompts, sampling, fly, timeout, suffix, **structure)
        with self._open(requests) as (conn, routes):
            return [result_of(self._replies(conn, replies)) for replies in routes]

    def info(self) -> InfoReply:
        """Models, context window, limits and defaults of the daemon."""
        return self._rpc(InfoRequest(id=new_id()))

    def health(self) -> HealthReply:
        """The daemon's state: loading, ready, draining or failed."""
        return self._rpc(HealthRequest(id=new_id()))

    def status(self) -> StatusReply:
        """Load, throughput and acceptance counters of the daemon."""
        return self._rpc(StatusRequest(id=new_id()))

    def tokenize(self, text: str | None = None, messages: Messages | None = None,
                 tools: Tools | None = None) -> TokenizeReply:
        """Token ids of `text` (or of `messages` and the `tools` offered, through the chat template) with the
        daemon's tokenizer: as many as `chat(messages, tools=tools)` would have as its prompt."""
        return self._rpc(tokenize_request(text, messages, tools))

    def close(self) -> None:
        """Close every socket of this client (call when no thread uses it any more)."""
        self._heartbeat.close()
        with self._lock:
            for conn in self._connections:
                conn.close()
            self._connections.clear()
        self._local = threading.local()

    def __enter__(self) -> "FLyClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _conn(self) -> _Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = _Connection(zmq.Context.instance(), self.endpoint, self._heartbeat)
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
            conn.close()

    def _replies(self, conn: _Connection, replies: GenerateReplies) -> Iterator[TokenChunk | GenerateResult]:
        """Replies to one open generate request up to its result, re-sent when the daemon was BUSY."""
        while not replies.done:
            step = replies.route(conn.next_reply(replies.request.id, replies.since, replies.deadline))
            if isinstance(step, Resend):
                time.sleep(step.delay)
                send(conn.socket, replies.request)
            elif step is not None:
                yield step

    def _rpc(self, request: BaseModel) -> Any:
        """Send a metadata request and wait for its answer, re-sending on a fresh socket if none comes."""
        for window in self._rpc_windows():
            try:
                reply = self._conn().ask(request, window)
            except (FLyUnavailable, Timeout):
                self._drop_conn()
            else:
                return answer(reply)
