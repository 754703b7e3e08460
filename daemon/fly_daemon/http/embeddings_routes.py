"""The embedding routes of the HTTP front: OpenAI's POST /v1/embeddings, Ollama's POST /api/embed and its
older POST /api/embeddings, all served by the core's EmbeddingService (fly_daemon.embeddings).

fly_daemon.http.app includes `openai_embeddings` in its /v1 router and fly_daemon.http.ollama_routes includes
`ollama_embeddings` in the /api app, so the front's API key, Host check, body limit, connection caps
and each API's error shape apply as on its other routes. A request names the embedding model (its
name or an alias, case-insensitive, Ollama's ':latest' tag allowed); another name is 404. Over-long
inputs: /v1/embeddings refuses them (TOO_LONG, as OpenAI does), /api/embed cuts them to the model's
max length unless `truncate` is false, /api/embeddings cuts them. `dimensions` other than the
model's is refused (its vectors are not Matryoshka-trained). A client that leaves drops its inputs.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field, StrictBool, StrictInt, StrictStr

from fly_llm.common.errors import BadRequest

from fly_daemon.client_identity import HttpClients
from fly_daemon.embeddings import Embedded, Embedder, EmbeddingService
from fly_daemon.http.common import (CLIENT_CLOSED, ClientGone, JsonBody, UnknownModel, parsed_body,
                                    unless_disconnected)
from fly_daemon.http.shared_fields import Strict

TokenIds = Annotated[list[StrictInt], Field(max_length=1 << 16)]
"""One input as token ids of the embedding model's vocabulary (no special tokens: they are added)."""


class OpenAIEmbeddingBody(Strict):
    """POST /v1/embeddings: OpenAI's fields (`user` is accepted and not used)."""

    model: StrictStr
    input: (StrictStr | Annotated[list[StrictStr], Field(min_length=1)]
            | Annotated[list[TokenIds], Field(min_length=1)] | TokenIds)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: StrictStr | None = None

    def inputs(self) -> Sequence[str] | Sequence[Sequence[int]]:
        """The inputs as a list: of texts, or of token-id lists."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and isinstance(self.input[0], int):
            return [self.input]  # type: ignore[list-item]
        if not self.input:
            raise BadRequest("input: give a string, a list of strings or token ids (not an empty list)")
        return self.input


class OllamaEmbedBody(Strict):
    """POST /api/embed: Ollama's fields (`options` and `keep_alive` are accepted and not used); without `input`
    (or with an empty list) it loads the model and embeds nothing, as Ollama answers."""

    model: StrictStr
    input: StrictStr | list[StrictStr] = Field(default_factory=list)
    truncate: StrictBool = True
    dimensions: StrictInt | None = None
    options: dict[str, Any] | None = None
    keep_alive: StrictStr | float | None = None


class OllamaEmbeddingsBody(Strict):
    """POST /api/embeddings (Ollama's older route): one `prompt`; `options` and `keep_alive` are not used."""

    model: StrictStr
    prompt: StrictStr = ""
    options: dict[str, Any] | None = None
    keep_alive: StrictStr | float | None = None


def openai_embeddings(service: EmbeddingService, clients: HttpClients) -> APIRouter:
    """POST /embeddings in OpenAI's shape, for the /v1 router; each request in its client's lane (`clients`)."""
    router = APIRouter()

    @router.post("/embeddings")
    async def embeddings(body: JsonBody[OpenAIEmbeddingBody], request: Request) -> Any:
        async def work() -> tuple[Embedder, Embedded]:
            embedder = await _served(service, body.model, body.dimensions)
            return embedder, await service.embed(body.inputs(), truncate=False, client=clients.identity(request))

        try:
            embedder, done = await unless_disconnected(request, work())
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        encode = _base64 if body.encoding_format == "base64" else _floats
        data = [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(done.vectors)]
        return {"object": "list", "model": embedder.name, "data": data,
                "usage": {"prompt_tokens": done.tokens, "total_tokens": done.tokens}}

    return router


def ollama_embeddings(service: EmbeddingService, clients: HttpClients) -> APIRouter:
    """POST /embed and /embeddings in Ollama's shape, for the /api app; each request in its client's lane."""
    router = APIRouter()

    @router.post("/embed")
    async def embed(request: Request) -> Any:
        started = time.perf_counter_ns()
        body = await parsed_body(request, OllamaEmbedBody)
        inputs = ([body.input] if body.input else []) if isinstance(body.input, str) else body.input
        if not inputs:  # Ollama's load request (no input, "" or []): the model named, nothing embedded
            await _served(service, body.model, body.dimensions)
            return {"model": body.model, "embeddings": [], "total_duration": time.perf_counter_ns() - started,
                    "load_duration": 0, "prompt_eval_count": 0}
        try:
            _, done = await unless_disconnected(request, _embedded(service, body.model, inputs, body.truncate,
                                                                    body.dimensions, clients.identity(request)))
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        return {"model": body.model, "embeddings": [_floats(v) for v in done.vectors],
                "total_duration": time.perf_counter_ns() - started, "load_duration": 0,
                "prompt_eval_count": done.tokens}

    @router.post("/embeddings")
    async def embeddings(request: Request) -> Any:
        body = await parsed_body(request, OllamaEmbeddingsBody)
        try:
            _, done = await unless_disconnected(request, _embedded(service, body.model, [body.prompt], True, None,
                                                                    clients.identity(request)))
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        return {"embedding": _floats(done.vectors[0])}

    return router


async def _embedded(service: EmbeddingService, model: str, inputs: Sequence[str], truncate: bool,
                    dimensions: int | None, client: str) -> tuple[Embedder, Embedded]:
    embedder = await _served(service, model, dimensions)
    return embedder, await service.embed(inputs, truncate=truncate, client=client)


async def _served(service: EmbeddingService, asked: str, dimensions: int | None) -> Embedder:
    """The embedding model, if `asked` names it and `dimensions` (if given) is its own; else UnknownModel (404)
    or BadRequest."""
    embedder = await service.embedder()
    names = {n.lower() for n in (embedder.name, *embedder.aliases)}
    if asked.lower().removesuffix(":latest") not in names:
        raise UnknownModel(f"model {asked!r} is not served here; the embedding model is {embedder.name!r}")
    if dimensions is not None and dimensions != embedder.dimensions:
        raise BadRequest(f"dimensions: {embedder.name} gives {embedder.dimensions}-dimensional vectors and "
                         f"cannot shorten them; ask for {embedder.dimensions} or leave dimensions out")
    return embedder


def _floats(vector: Any) -> list[float]:
    return vector.tolist()


def _base64(vector: Any) -> str:
    """The vector as base64 of little-endian float32 (what OpenAI's clients decode)."""
    return base64.b64encode(vector.astype("<f4").tobytes()).decode()
