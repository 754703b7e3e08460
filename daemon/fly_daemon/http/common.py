"""What every API of the HTTP front shares, shape aside, and the door contract each generation route serves by.

Each error code's HTTP status and headers, an HTTP-level refusal as our error, the INTERNAL answer that
hides an unexpected failure behind a request id, OpenAI's error shape (the front's own), a body parsed
whatever its Content-Type, read as strictly as the ZeroMQ frames and bounded before it is validated
(`JsonBody`), and a client's disconnect cancelling its request. Each API writes errors in its own shape.

The door contract: an API answers a generation request as an `Answer` — the generate requests it submits,
then its reply whole or as its stream's events, and how they are framed (`data_event`, `named_event`,
`ndjson_line`); fly_daemon.http.door.serve runs every such route the same way. `Translated` and
`EventShaper` are what an API served as one chat request (the Responses API, fly_daemon.http.responses_api;
Anthropic's Messages API, fly_daemon.http.messages_api) gives: its wire request and its answer's shapes, which
`Translation` makes an Answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import traceback
import uuid
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine
from typing import Annotated, Any, ClassVar, Protocol, TypeVar

from fastapi import Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from fly_llm.common.errors import BadRequest, FLyError, Internal, TooLong
from fly_llm.common.json_text import MAX_BODY_VALUES, count_values, loads
from fly_llm.common.protocol import GenerateRequest, GenerateResult, TokenChunk, invalid
from fly_llm.common.tools import ToolCall

log = logging.getLogger("fly_daemon")
T = TypeVar("T")
B = TypeVar("B", bound=BaseModel)
Replies = AsyncGenerator[TokenChunk | GenerateResult, None]
"""One request's replies from the in-process client: chunks, then its result."""

STATUS = {"BAD_REQUEST": 400, "TOO_LONG": 400, "FIM_UNSUPPORTED": 400, "UNAUTHORIZED": 401, "BUSY": 503,
          "TIMEOUT": 504, "CANCELLED": 503, "NOT_READY": 503, "INTERNAL": 500, "UNAVAILABLE": 503, "MODEL_ERROR": 500}
"""The HTTP status of each error code; 503s may be retried (BUSY: nothing was admitted)."""
CLIENT_CLOSED = 499
"""The status logged for a request whose client left before its answer (nobody receives it)."""


class UnknownModel(BadRequest):
    """The request names a model this daemon does not serve (HTTP 404, code BAD_REQUEST, param `model`)."""

    def __init__(self, message: str = "") -> None:
        super().__init__(message, "model")


def http_status(error: FLyError) -> int:
    """The HTTP status answering `error` (STATUS by its code; 404 for an unknown model; else 500)."""
    return 404 if isinstance(error, UnknownModel) else STATUS.get(error.code, 500)


def error_headers(status: int) -> dict[str, str] | None:
    """The headers an error answer of `status` carries: the auth scheme on 401, a retry hint on 503."""
    return {"WWW-Authenticate": "Bearer"} if status == 401 else {"Retry-After": "1"} if status == 503 else None


def refusal(exc: HTTPException) -> FLyError:
    """Our error for an HTTP-level refusal (unknown route, wrong method, body size): TOO_LONG for 413, else
    BAD_REQUEST; the answer keeps `exc`'s status and headers."""
    return (TooLong if exc.status_code == 413 else BadRequest)(str(exc.detail))


TRACEBACK_EVERY = 60.0
"""Seconds between two tracebacks of one cause in the log (an unexpected failure's kind and the line it was raised
at); meanwhile each failure of that cause is one line. One client repeating a request that fails logged a
~12 KB traceback each time (1.4 GB an hour)."""
_CAUSES_KEPT = 1024
"""Causes whose last traceback time is remembered (the oldest forgotten first)."""
_tracebacks: OrderedDict[tuple[str, str, int], float] = OrderedDict()  # cause -> when its traceback was logged


def internal(exc: BaseException) -> Internal:
    """INTERNAL naming a new request id, never `exc`'s text (it may hold a prompt); the log gets the traceback, once
    per cause every TRACEBACK_EVERY seconds, else a line naming the cause."""
    request_id = uuid.uuid4().hex[:12]
    frames = traceback.extract_tb(exc.__traceback__)
    cause = (type(exc).__qualname__, *((frames[-1].filename, frames[-1].lineno or 0) if frames else ("?", 0)))
    now = time.monotonic()
    if now - _tracebacks.get(cause, -TRACEBACK_EVERY) >= TRACEBACK_EVERY:
        _tracebacks[cause] = now
        _tracebacks.move_to_end(cause)
        while len(_tracebacks) > _CAUSES_KEPT:
            _tracebacks.popitem(last=False)
        log.error("the HTTP front failed on a request (request id %s)", request_id, exc_info=exc)
    else:
        log.error("the HTTP front failed on a request (request id %s): %s at %s:%d again (its traceback is in the "
                  "log within the last %d s)", request_id, *cause, TRACEBACK_EVERY)
    return Internal(f"internal error (request id {request_id}); the server's log has the details")


def bounded_json(body: bytes) -> Any:
    """The JSON value of a request body; BadRequest if it is not JSON, TooLong if it holds more than MAX_BODY_VALUES
    values: validating it would hold the interpreter, and every other client of the front, for seconds."""
    try:
        value = loads(body)
    except ValueError as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None
    if count_values(value, MAX_BODY_VALUES) > MAX_BODY_VALUES:
        raise TooLong(f"the body holds more than {MAX_BODY_VALUES} JSON values (arrays, objects, strings, numbers): "
                      "more than any request the model's context can take")
    return value


async def parsed_body(request: Request, model: type[B]) -> B:
    """The body as `model`, whatever its Content-Type says (curl -d sends a form's), read by `bounded_json`;
    BadRequest (TooLong for a size cap) naming the first problems' fields if it is not valid."""
    try:
        return model.model_validate(bounded_json(await request.body()))
    except ValidationError as exc:
        raise invalid(exc) from None


class JsonBody:
    """`body: JsonBody[Model]` in a route: the body as `Model`, read by `parsed_body`, so that every door's bodies are
    read and validated one way, bounded, and a refusal builds its first few problems only (FastAPI's own validation
    rebuilt every error of a long array twice: a second for 60,000 wrong items, the event loop held throughout)."""

    def __class_getitem__(cls, model: type[B]) -> Any:
        async def body(request: Request) -> B:
            return await parsed_body(request, model)

        return Annotated[model, Depends(body)]


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready (answer CLIENT_CLOSED; nobody reads it)."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, unless the client disconnects first: then cancel it (cancelling its request) and raise
    ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        task.cancel()  # a no-op once it is done
    if task in done:
        return task.result()
    await asyncio.wait({task})  # let it clean up (cancel its request)
    raise ClientGone


async def _disconnect(request: Request) -> None:
    """Return when the client disconnects (the body has been read, so the next message says so)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


Event = dict[str, Any]
"""One event of a stream: a server-sent event's data (its `type` the event's name, where events are named) or
one NDJSON line."""


def data_event(data: Event) -> str:
    """A server-sent event of `data` (OpenAI's and llama.cpp's streams)."""
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def named_event(data: Event) -> str:
    """A server-sent event named by its data's `type` (as the Responses and Messages APIs send them)."""
    return f"event: {data['type']}\n{data_event(data)}"


def ndjson_line(data: Event) -> str:
    """One line of a newline-delimited JSON stream (Ollama's)."""
    return json.dumps(data, separators=(",", ":")) + "\n"


def openai_error(error: FLyError, status: int) -> dict[str, Any]:
    """OpenAI's error shape for an error answered with `status`, our stable code (fly_llm.common.errors) as `code`."""
    kind = "authentication_error" if status == 401 else "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.code}}


ErrorShape = Callable[[FLyError, int], dict[str, Any]]
"""An API's error body for an error answered with an HTTP status (`openai_error`, Anthropic's, Ollama's)."""


def error_answer(exc: Exception, shape: ErrorShape) -> Response:
    """The answer to a request that failed before its answer began, in an API's error `shape`: our errors with
    their status (and headers), an HTTP-level refusal (unknown route, wrong method, body size) with its own, a
    parameter FastAPI refused as BAD_REQUEST, anything else as INTERNAL (`internal`); a client that left while
    its body was read gets CLIENT_CLOSED and no body (nobody reads it)."""
    headers = None
    if isinstance(exc, ClientDisconnect | ClientGone):
        return Response(status_code=CLIENT_CLOSED)
    if isinstance(exc, HTTPException):
        error, status, headers = refusal(exc), exc.status_code, exc.headers
    elif isinstance(exc, RequestValidationError):  # a parameter of the route's (bodies are read by JsonBody)
        first = exc.errors()[:5]
        fields = [".".join(map(str, e["loc"][1:])) for e in first]  # loc[0] is where: "query", "path", ...
        problems = "; ".join(f"{field or e['loc'][0]}: {e['msg']}" for field, e in zip(fields, first))
        error, status = BadRequest(problems, fields[0] or None), 400
    elif isinstance(exc, FLyError):
        error, status = exc, http_status(exc)
        headers = error_headers(status)
    else:
        error, status = internal(exc), 500
    return JSONResponse(shape(error, status), status_code=status, headers=headers)


def shaped_route(shape: ErrorShape) -> type[APIRoute]:
    """A route class whose routes answer their errors in `shape`: each API's router is built with its own, so the
    shape follows the route, not the path."""

    class ShapedRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def shaped(request: Request) -> Response:
                try:
                    return await handler(request)
                except Exception as exc:  # noqa: BLE001 - every failure gets an answer in the API's shape
                    return error_answer(exc, shape)

            return shaped

    return ShapedRoute


def add_error_handlers(app: FastAPI, shape: ErrorShape) -> None:
    """Answer in `shape` what fails outside any route (an unknown route, a wrong method) on `app`."""

    async def handle(_: Request, exc: Exception) -> Response:
        return error_answer(exc, shape)

    for kind in (FLyError, HTTPException, RequestValidationError, ClientDisconnect, ClientGone, Exception):
        app.add_exception_handler(kind, handle)


class Answer(ABC):
    """One generation request's answer in its API's shape (the door contract, run by fly_daemon.http.door.serve):
    the generate requests it submits (one per choice), then the reply whole, or as the events of a stream —
    opening events, each choice's chunks and its end, closing text, or the events of a failure after the stream
    began — each framed by `frame` and sent as `media_type`."""

    stream: bool
    """Whether the client asked for a stream."""
    media_type: ClassVar[str] = "text/event-stream"

    @abstractmethod
    def requests(self) -> list[GenerateRequest]:
        """The generate requests to submit; none: the answer is `whole([])` at once."""

    @abstractmethod
    def whole(self, results: list[GenerateResult]) -> dict[str, Any]:
        """The whole (non-streamed) answer, from each request's result."""

    def opening(self) -> list[Event]:
        """The events a stream opens with."""
        return []

    @abstractmethod
    def chunk(self, index: int, chunk: TokenChunk) -> list[Event]:
        """The events of request `index`'s new text and completed tool calls."""

    @abstractmethod
    def final(self, index: int, result: GenerateResult, results: list[GenerateResult] | None) -> list[Event]:
        """The events that end request `index`; `results`: every request's, once this one was the last to end."""

    def closing(self, results: list[GenerateResult]) -> list[str]:
        """The framed text that ends a stream whose requests all ended."""
        return []

    @abstractmethod
    def failure(self, error: FLyError, status: int) -> list[Event]:
        """The events that end a stream that failed after it began (`status`: the error's HTTP status)."""

    @abstractmethod
    def frame(self, event: Event) -> str:
        """One event as the stream's wire text."""


class EventShaper(ABC):
    """One request's answer in another API's shape: whole, or as the events of its stream (each with a `type`)."""

    id: str
    """The answer's id (also its wire request's)."""

    @abstractmethod
    def opening(self) -> list[Event]:
        """The events a stream opens with."""

    def chunk(self, chunk: TokenChunk) -> list[Event]:
        """The events of a chunk's new text and completed tool calls."""
        events = self.text_events(chunk.text) if chunk.text else []
        for call in chunk.tool_calls:
            events += self.call_events(call)
        return events

    @abstractmethod
    def text_events(self, delta: str) -> list[Event]:
        """The events of new answer text (`whole` builds its answer through them too)."""

    @abstractmethod
    def call_events(self, call: ToolCall) -> list[Event]:
        """The events of one completed tool call."""

    @abstractmethod
    def final(self, result: GenerateResult) -> list[Event]:
        """The events that end a stream with its result."""

    @abstractmethod
    def failure(self, error: FLyError, status: int) -> list[Event]:
        """The events that end a stream that failed after it began (`status`: the error's HTTP status)."""

    @abstractmethod
    def whole(self, result: GenerateResult) -> dict[str, Any]:
        """The whole (non-streamed) answer."""


class Translation(Answer):
    """A request of another API served as one chat request: its wire request and its shaper as an Answer."""

    def __init__(self, shaper: EventShaper, request: GenerateRequest, stream: bool) -> None:
        self.shaper, self.request, self.stream = shaper, request, stream

    def requests(self) -> list[GenerateRequest]:
        return [self.request]

    def whole(self, results: list[GenerateResult]) -> dict[str, Any]:
        return self.shaper.whole(results[0])

    def opening(self) -> list[Event]:
        return self.shaper.opening()

    def chunk(self, index: int, chunk: TokenChunk) -> list[Event]:
        return self.shaper.chunk(chunk)

    def final(self, index: int, result: GenerateResult, results: list[GenerateResult] | None) -> list[Event]:
        return self.shaper.final(result)

    def failure(self, error: FLyError, status: int) -> list[Event]:
        return self.shaper.failure(error, status)

    def frame(self, event: Event) -> str:
        return named_event(event)


class Translated(Protocol):
    """A request of another API served as one chat request (see `EventShaper`)."""

    model: str
    stream: bool

    def to_generate(self, request_id: str, max_tokens_limit: int) -> GenerateRequest:
        """The wire request, its length capped at the daemon's `max_tokens_limit` (and asking for it where the body
        names none), as llama-server and Ollama do; BadRequest (naming the field) if it is not valid."""

    def shaper(self, model: str) -> EventShaper:
        """A new answer of `model` to this request."""
