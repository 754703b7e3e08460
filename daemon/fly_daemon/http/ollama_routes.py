"""Ollama's API on the HTTP front: the /api routes, a FastAPI app that `fly_daemon.http.app.create_app` mounts
at /api, so `fly-daemon start --http 127.0.0.1:11434` (and fly-serve) answer Ollama's clients unchanged.

POST /api/chat and /api/generate stream newline-delimited JSON (one object with `"stream": false`)
through the same scheduler as /v1 (fly_daemon.inproc); GET /api/tags, /api/ps, /api/version and
POST /api/show describe the served target; POST /api/embed and /api/embeddings embed
(fly_daemon.http.embeddings_routes); the model-management routes (pull, push, create, copy, delete) are
refused. The front's API key, Host check and body limit apply as on /v1 (a misdirected Host gets the
front's 421 in this shape), and so do the clients the per-client caps count (fly_daemon.client_identity).
What both APIs share: fly_daemon.http.common.
Errors are Ollama's shape, `{"error": message}`, with our stable code (fly_llm.common.errors) as `code`; a
failure after a stream began is its last line. Shapes and translation: fly_daemon.http.ollama_api.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.params import Depends
from fastapi.responses import Response

from fly_llm.common.errors import BadRequest

from fly_daemon.client_identity import HttpClients
from fly_daemon.embeddings import EmbeddingService
from fly_daemon.http.common import UnknownModel, add_error_handlers, parsed_body
from fly_daemon.http.door import serve
from fly_daemon.http.embeddings_routes import ollama_embeddings
from fly_daemon.http.ollama_api import (OLLAMA_VERSION, ChatBody, GenerateBody, OllamaAnswer, OllamaBody, Served, ShowBody,
                                        capabilities, embedding_card, model_card, ollama_error, same_model, show_template)
from fly_daemon.inproc import InProcessClient
from fly_daemon.model_info import ModelInfo

MANAGEMENT = ("/pull", "/push", "/create", "/copy", "/delete")
"""Ollama routes fly-daemon refuses: it serves the models it loaded from local files at start."""
NEVER = "2262-04-11T23:47:16Z"
"""/api/ps's `expires_at` of a model that stays loaded (the latest time Go's time.Time in ns can hold)."""


def ollama_app(client: InProcessClient, guard: list[Depends], clients: HttpClients,
               embeddings: EmbeddingService = EmbeddingService()) -> FastAPI:
    """The /api app serving `client`'s scheduler, each request for the tenant and client `clients` names, and
    `embeddings`; `guard`: the front's API-key dependency, if any."""
    app = FastAPI(dependencies=guard, docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(ollama_embeddings(embeddings, clients))

    @app.post("/chat")
    async def chat(request: Request) -> Response:
        body = await parsed_body(request, ChatBody)
        return await serve(client, request, clients, lambda: _answer(client, body))

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await parsed_body(request, GenerateBody)
        return await serve(client, request, clients, lambda: _answer(client, body))

    @app.get("/tags")
    async def tags() -> dict[str, Any]:
        """The target, then the embedding model where embeddings are served (fly_daemon.embeddings: listed)."""
        embedder = embeddings.listed()
        return {"models": [model_card(await client.loaded_model_info(), client.started),
                           *([embedding_card(embedder, client.started)] if embedder else [])]}

    @app.get("/ps")
    async def ps() -> dict[str, Any]:
        model = await client.loaded_model_info()
        card = model_card(model, client.started)
        vram = card["size"] if model.on_gpu else 0
        return {"models": [{**card, "expires_at": NEVER, "size_vram": vram, "context_length": model.context_window}]}

    @app.post("/show")
    async def show(request: Request) -> dict[str, Any]:
        asked = (await parsed_body(request, ShowBody)).asked
        embedder = embeddings.listed()
        if embedder is not None and same_model(asked, embedder):  # the other model /api/tags lists
            card = embedding_card(embedder, client.started)
            return {"modelfile": f"# fly-daemon serves this embedding model\nFROM {embedder}\n", "parameters": "",
                    "template": "", "details": card["details"], "modified_at": card["modified_at"],
                    "model_info": {}, "capabilities": ["embedding"]}
        model = await _served(client, asked)
        card, arch, template = model_card(model, client.started), model.architecture, model.chat_template
        return {"modelfile": f"# fly-daemon serves this model from local files loaded at start\nFROM {card['name']}\n",
                "parameters": "", "template": show_template(template, model.fim),
                "details": card["details"], "modified_at": card["modified_at"],
                "model_info": {"general.architecture": arch, "general.parameter_count": model.parameter_count,
                               f"{arch}.context_length": model.context_window},
                "capabilities": capabilities(template, model.fim)}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": OLLAMA_VERSION}

    async def managed(request: Request) -> Response:
        raise BadRequest(f"{request.url.path} is not served: fly-daemon serves the models it loaded from local "
                         "files at start (--target, --draft, --embedding-model)")

    for path in MANAGEMENT:
        app.add_api_route(path, managed, methods=["POST", "DELETE"], include_in_schema=False)
    add_error_handlers(app, ollama_error)
    return app


async def _served(client: InProcessClient, asked: str) -> ModelInfo:
    """The served model once loaded (NotReady if loading failed), if `asked` names it; else UnknownModel (404)."""
    model = await client.loaded_model_info()
    if not same_model(asked, model.name):
        raise UnknownModel(f"model {asked!r} not found: fly-daemon serves {model.name!r} (GET /api/tags)")
    return model


async def _answer(client: InProcessClient, body: OllamaBody) -> OllamaAnswer:
    """`body`'s answer, once the model it names is known to be served."""
    model = await _served(client, body.model)
    return OllamaAnswer(body, Served(context_window=model.context_window,
                                     no_limit_tokens=min(client.limits.max_tokens_limit, model.context_window),
                                     chat_template=bool(model.chat_template)))

