"""An asyncio client of the scheduler inside the daemon's process: no socket, no serialisation.

The HTTP front (fly_daemon.http.app, fly_daemon.http.ollama_routes) submits through it, and it is all the front
sees of the scheduler: its state, limits, metrics and the served model's `ModelInfo`
(fly_daemon.model_info), never the engine. Requests go to `Scheduler.submit` (tokenize
requests to `Scheduler.tokenize`) with the LOCAL envelope; the model thread's replies come back
through `deliver` (the serving core's emit, fly_daemon.core, routes LOCAL replies here), which
hands each to the event loop of the coroutine waiting for it. A request whose consumer stops
waiting (an exception, a cancelled task, a closed generator) is cancelled in the scheduler, so its
batch slot is freed.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry
from pydantic import BaseModel

from fly_llm.common.options import checked
from fly_llm.common.errors import BadRequest, NotReady, error_from_code
from fly_llm.common.protocol import (
    ErrorReply, GenerateRequest, GenerateResult, HealthState, TokenChunk, TokenizeReply, TokenizeRequest,
)

from fly_daemon.client_identity import LOCAL_TENANT
from fly_daemon.limits import Limits
from fly_daemon.model_info import ModelInfo
from fly_daemon.scheduling.scheduler import LOCAL, Envelope, Scheduler

_LOAD_POLL_S = 0.1


class InProcessClient:
    """Submit generate requests to a Scheduler in this process and await their replies (asyncio)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self._waiting: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}

    @property
    def state(self) -> HealthState:
        return self._scheduler.state

    @property
    def detail(self) -> str:
        return self._scheduler.detail

    @property
    def limits(self) -> Limits:
        return self._scheduler.limits

    @property
    def started(self) -> float:
        """When the scheduler started (a Unix time)."""
        return self._scheduler.started

    @property
    def metrics_registry(self) -> CollectorRegistry:
        """The scheduler's Prometheus metrics."""
        return self._scheduler.metrics.registry

    def model_info(self) -> ModelInfo:
        """The served model; NotReady until the models are loaded."""
        model = self._scheduler.model
        if model is None:
            raise NotReady(self.detail if self.state == "failed" else f"the daemon is {self.state}")
        return model

    async def loaded_model_info(self) -> ModelInfo:
        """The served model, once the models are loaded (waits while they load); NotReady if loading failed."""
        while self.state == "loading":
            await asyncio.sleep(_LOAD_POLL_S)
        return self.model_info()

    def served_model(self) -> str:
        """The target's name; NotReady until the models are loaded."""
        return self.model_info().name

    async def loaded_model(self) -> str:
        """The target's name, once the models are loaded (waits while they load); NotReady if loading failed."""
        return (await self.loaded_model_info()).name

    def deliver(self, envelope: Envelope, message: BaseModel) -> None:
        """Hand a reply to the coroutine waiting for it (called from the model thread; others are dropped)."""
        waiting = self._waiting.get(getattr(message, "id", ""))
        if envelope != LOCAL or waiting is None:
            return
        loop, queue = waiting
        try:
            loop.call_soon_threadsafe(queue.put_nowait, message)
        except RuntimeError:  # the loop has closed: nobody waits any more
            pass

    async def tokenize(self, client: str | None = None, **fields: object) -> TokenizeReply:
        """A tokenize request of `fields` (fly_llm.common.protocol.TokenizeRequest's: text or token_ids, ...),
        answered in `client`'s lane of the scheduler's tokenize lanes (default: the in-process one); its error
        (BAD_REQUEST, TOO_LONG, BUSY, ...) is raised."""
        with checked():
            request = TokenizeRequest(id=f"tokenize-{uuid.uuid4().hex}", **fields)
        queue: asyncio.Queue = asyncio.Queue()
        self._waiting[request.id] = (asyncio.get_running_loop(), queue)
        try:
            self._scheduler.tokenize(LOCAL, request, client)
            reply = await queue.get()
        finally:
            del self._waiting[request.id]
        if isinstance(reply, ErrorReply):
            raise error_from_code(reply.code, reply.message)
        return reply

    async def replies(self, request: GenerateRequest, *, tenant: str = LOCAL_TENANT,
                      client: str | None = None) -> AsyncIterator[TokenChunk | GenerateResult]:
        """Submit `request` for `tenant` and `client` (see `Scheduler.submit`); yield its chunks (if it
        streams), then its result.

        Raises the request's error (BUSY, TOO_LONG, NOT_READY, …) as its FLyError. Leaving the
        iteration early cancels the request.
        """
        if request.id in self._waiting:
            raise BadRequest(f"request id {request.id!r} is already in flight")
        queue: asyncio.Queue = asyncio.Queue()
        self._waiting[request.id] = (asyncio.get_running_loop(), queue)
        finished = False
        try:
            self._scheduler.submit(LOCAL, request, tenant=tenant, client=client)
            while not finished:
                reply = await queue.get()
                finished = not isinstance(reply, TokenChunk)
                if isinstance(reply, ErrorReply):
                    raise error_from_code(reply.code, reply.message)
                yield reply
        finally:
            del self._waiting[request.id]
            if not finished:
                self._scheduler.cancel(LOCAL, request.id)
