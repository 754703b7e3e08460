"""The one door every generation route of the HTTP front goes through: `serve` runs an API's `Answer`
(fly_daemon.http.common, the door contract) the same way whatever the API.

Its requests are submitted together for the tenant and client the front names; an error before the
first reply is a plain HTTP error (the other requests cancelled), in the route's own error shape; a
client that disconnects while waiting cancels them and is answered CLIENT_CLOSED (logged, never read).
Then the answer is whole (JSON), or a stream of the answer's framed events: every request's chunks as they
come, each one's end, the closing text; a failure after the stream began ends it with the answer's failure
events (an unexpected one as INTERNAL with a request id, never its text); a stream that ends early (the
client left) cancels its requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fly_llm.common.errors import FLyError
from fly_llm.common.protocol import GenerateRequest, GenerateResult, TokenChunk

from fly_daemon.client_identity import HttpClients
from fly_daemon.http.common import (CLIENT_CLOSED, Answer, ClientGone, Replies, http_status, internal,
                                    unless_disconnected)
from fly_daemon.inproc import InProcessClient


async def serve(client: InProcessClient, request: Request, clients: HttpClients,
                answer: Callable[[], Awaitable[Answer]]) -> Response:
    """Serve the `answer` (made once the request is about to be submitted: it may check the model, refuse the
    body) through `client`'s scheduler, for the tenant and client `clients` names for `request`."""
    async def begin() -> tuple[Answer, list[Replies], list[TokenChunk | GenerateResult]]:
        made = await answer()
        return made, *await _submitted(client, made.requests(), request, clients)

    try:
        made, streams, firsts = await unless_disconnected(request, begin())
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    if not (made.stream and streams):
        await _closed(streams)
        return JSONResponse(made.whole(firsts))  # a request without stream answers with its results
    return StreamingResponse(_events(made, firsts, streams), media_type=made.media_type)


async def _submitted(client: InProcessClient, requests: list[GenerateRequest], request: Request,
                     clients: HttpClients) -> tuple[list[Replies], list[TokenChunk | GenerateResult]]:
    """Submit `requests` as the tenant and client `clients` names for `request`; their reply streams and first
    replies. An error before the first reply is raised (the other requests are cancelled)."""
    identity = clients.identity(request)
    streams = [client.replies(r, tenant=clients.tenant, client=identity) for r in requests]
    firsts = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
    failed = [f for f in firsts if isinstance(f, BaseException)]
    if failed:
        await _closed(streams)
        raise failed[0]
    return streams, firsts


async def _closed(streams: list[Replies]) -> None:
    """Close every stream (cancelling a request that has not ended)."""
    await asyncio.gather(*(s.aclose() for s in streams))


async def _events(answer: Answer, firsts: list[TokenChunk | GenerateResult],
                  streams: list[Replies]) -> AsyncIterator[str]:
    """The stream's framed events, the requests' replies as they come; a failure ends it with the answer's
    failure events."""
    results: list[GenerateResult | None] = [None] * len(streams)
    try:
        for event in answer.opening():
            yield answer.frame(event)
        async for index, reply in _merged(firsts, streams):
            if isinstance(reply, TokenChunk):
                events = answer.chunk(index, reply)
            else:
                results[index] = reply
                events = answer.final(index, reply, None if None in results else results)
            for event in events:
                yield answer.frame(event)
        for text in answer.closing(results):
            yield text
    except FLyError as exc:
        for event in answer.failure(exc, http_status(exc)):
            yield answer.frame(event)
    except Exception as exc:  # noqa: BLE001  # any failure ends this stream only, and tells nothing of itself
        for event in answer.failure(internal(exc), 500):
            yield answer.frame(event)
    finally:
        await _closed(streams)  # cancels the requests if the stream ends early (the client disconnected)


async def _merged(firsts: list[TokenChunk | GenerateResult],
                  streams: list[Replies]) -> AsyncIterator[tuple[int, TokenChunk | GenerateResult]]:
    """(request index, reply) of all streams, in the order they arrive, until each has its result; an error is
    raised. One stream is read directly."""
    if len(streams) == 1:
        reply = firsts[0]
        yield 0, reply
        while isinstance(reply, TokenChunk):
            reply = await anext(streams[0])
            yield 0, reply
        return
    queue: asyncio.Queue[tuple[int, TokenChunk | GenerateResult | BaseException]] = asyncio.Queue()

    async def pump(index: int) -> None:
        reply: TokenChunk | GenerateResult | BaseException = firsts[index]
        queue.put_nowait((index, reply))
        try:
            while isinstance(reply, TokenChunk):
                reply = await anext(streams[index])
                queue.put_nowait((index, reply))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((index, exc))

    pumps = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
    try:
        for _ in streams:  # until each request has its result
            while True:
                index, reply = await queue.get()
                if isinstance(reply, BaseException):
                    raise reply
                yield index, reply
                if not isinstance(reply, TokenChunk):
                    break
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
