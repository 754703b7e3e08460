"""What the sync and asyncio clients share: settings, heartbeats, request building and open requests.

A subclass says only how it keeps its sockets (`_conn`, `_drop_conn`) and how it waits for a
reply (its connection's `next_reply`, blocking or awaited).
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import zmq
from pydantic import BaseModel

from fly_llm.client.core import (
    GenerateReplies, Inbox, Messages, Prompt, batch_requests, completion_source, generate_request, rpc_windows,
)
from fly_llm.client.heartbeat import Heartbeat
from fly_llm.client.sockets import arrived, cancel, close, dropped, new_socket, readable, send, watch
from fly_llm.common.config import FLyOverrides, SamplingParams
from fly_llm.common.endpoints import default_endpoint
from fly_llm.common.errors import FLyUnavailable
from fly_llm.common.protocol import GenerateRequest


class Connection:
    """One DEALER socket, its monitor, and the replies that arrived on it for each open request.

    A subclass waits on `poller` until the socket or the monitor is readable, then `pump`s: a connection that
    dropped (the daemon went away) loses the requests open on it, so they end with FLyUnavailable
    at once instead of at their deadline.
    """

    def __init__(self, context: zmq.Context, endpoint: str, heartbeat: Heartbeat) -> None:
        self.socket = new_socket(context, endpoint)
        self.monitor = watch(self.socket)
        self.poller = readable(self.socket, self.monitor)
        self.inbox = Inbox(heartbeat)

    def pump(self) -> None:
        """Route every frame that arrived; if the connection dropped meanwhile, lose the requests open now
        (after the frames the daemon sent before it went, which arrived first)."""
        gone = dropped(self.monitor)
        for frame in arrived(self.socket):
            self.inbox.deliver(frame)
        if gone:
            self.inbox.lose()

    def open(self, ids: list[str]) -> None:
        """Start collecting replies for `ids` (a drop seen before they are sent is not theirs)."""
        self.pump()
        self.inbox.open(ids)

    def close(self) -> None:
        """Close the socket and its monitor."""
        close(self.socket, self.monitor)

    @contextmanager
    def asking(self, request: BaseModel) -> Iterator[float]:
        """Send one metadata request and collect its reply while open; yields when it was sent."""
        self.open([request.id])
        try:
            since = time.monotonic()
            send(self.socket, request)
            yield since
        finally:
            self.inbox.close([request.id])


class ClientBase(ABC):
    """A client of a fly-daemon at `endpoint`: `timeout` bounds each call (seconds), `max_retries` is
    how often a safe call is re-sent."""

    def __init__(self, endpoint: str | None = None, timeout: float = 120.0, max_retries: int = 2) -> None:
        self.endpoint = endpoint or default_endpoint()
        self.timeout = timeout
        self.max_retries = max_retries
        self._lock = threading.Lock()
        self._heartbeat = Heartbeat(self.endpoint)

    @abstractmethod
    def _conn(self) -> Connection:
        """This client's connection, opened on first use."""

    @abstractmethod
    def _drop_conn(self) -> None:
        """Close the connection (a later call opens a new one)."""

    def _request(self, prompt: Prompt | None, messages: Messages | None, sampling: SamplingParams | None,
                 fly: FLyOverrides | None, timeout: float | None, stream: bool = False, suffix: str | None = None,
                 **structure: Any) -> GenerateRequest:
        return generate_request(completion_source(prompt, suffix), messages, sampling, fly, self._timeout(timeout),
                                stream, **structure)

    def _batch(self, prompts: list[Prompt] | list[Messages], sampling: SamplingParams | None,
               fly: FLyOverrides | None, timeout: float | None, suffix: str | None = None,
               **structure: Any) -> list[GenerateRequest]:
        return batch_requests(prompts, sampling, fly, self._timeout(timeout), suffix, **structure)

    def _timeout(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    def _rpc_windows(self) -> Iterator[float]:
        return rpc_windows(self.endpoint, self.timeout, self.max_retries)

    @contextmanager
    def _open(self, requests: list[GenerateRequest]) -> Iterator[tuple[Connection, list[GenerateReplies]]]:
        """Send `requests`, heartbeat them while open, cancel whichever did not finish on the way out.

        Yields the connection and, per request, the routing of its replies.
        """
        conn = self._conn()
        ids = [r.id for r in requests]
        conn.open(ids)
        self._heartbeat.add(ids)
        finished = True
        try:
            for r in requests:
                send(conn.socket, r)
            finished = False
            deadline = time.monotonic() + requests[0].timeout_s
            yield conn, [GenerateReplies(r, deadline, self.max_retries) for r in requests]
            finished = True
        except FLyUnavailable:
            self._drop_conn()
            raise
        finally:
            self._heartbeat.discard(ids)
            conn.inbox.close(ids)
            if not finished and not conn.socket.closed:
                cancel(conn.socket, ids)
