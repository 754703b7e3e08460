"""The OpenAI-compatible HTTP front: FastAPI routes served by uvicorn, next to the ZeroMQ socket.

Requests go to the scheduler of a serving core (fly_daemon.core, which builds this front from the
settings) through its `InProcessClient` (the engine knows nothing of HTTP). Routes: POST
/v1/chat/completions, POST /v1/completions (server-sent events with `"stream": true`), GET
/v1/models, GET /health; POST /v1/embeddings (the core's embedding worker, fly_daemon.http.embeddings_routes);
POST /completion, /infill, /tokenize and /detokenize (llama.cpp's shapes), GET /metrics
(Prometheus); POST /v1/responses (OpenAI's Responses API, stateless: fly_daemon.http.responses_api) and POST
/v1/messages, /v1/messages/count_tokens (Anthropic's Messages API: fly_daemon.http.messages_api), each served as
one chat request; Ollama's API is mounted at /api (fly_daemon.http.ollama_routes; what they all share, shape aside,
is fly_daemon.http.common). Errors are OpenAI's error shape with our stable codes (fly_llm.common.errors) as
`code` (Anthropic's shape under /v1/messages); a client that disconnects, while waiting or mid-stream, cancels
its request. A non-loopback bind needs an API key (`Authorization: Bearer` or `x-api-key`), as a non-loopback
ZeroMQ bind needs CURVE. With a key, every route but /health needs it (/docs and /redoc are off,
/openapi.json needs the key). A front on loopback answers only requests whose Host header is a loopback
name, its bound host or an allowed host (a web page reaching it by DNS rebinding names its own host);
others get 421, in the error shape of the API asked for. An unexpected failure answers INTERNAL
with a request id that the log's traceback carries, never the exception's text. Connections are timed
out and capped by fly_daemon.http.connections (the `http_*` settings). GET /v1/models lists the target, and
the embedding model where embeddings are served (before it loads: clients pick it from the list). One model
generates, so a generation request's `model` may name any: it answers to every name, as llama-server does.
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import socket
import threading
from collections.abc import Awaitable, Callable, Collection, Iterable
from typing import Any

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import fly_llm
from fly_llm.common.errors import BadRequest, Unauthorized
from fly_llm.common.protocol import MAX_FRAME_BYTES

from fly_daemon.client_identity import LOCAL_TENANT, HttpClients, Network
from fly_daemon.embeddings import EmbeddingService
from fly_daemon.http.common import (JsonBody, Translated, Translation, add_error_handlers, openai_error,
                                    shaped_route)
from fly_daemon.http.connections import CloseWhenBodyUnread, HttpLimits, guarded_protocol
from fly_daemon.http.door import serve
from fly_daemon.http.embeddings_routes import openai_embeddings
from fly_daemon.http.llamacpp_api import CompletionBody, InfillBody, LlamaAnswer, LlamaBody
from fly_daemon.http.messages_api import CountTokensRequest, MessagesRequest
from fly_daemon.http.messages_stream import anthropic_error
from fly_daemon.http.ollama_api import ollama_error
from fly_daemon.http.ollama_routes import ollama_app
from fly_daemon.http.openai_api import (
    ChatCompletionRequest, Choices, CompletionRequest, DetokenizeBody, GenerationBody, TokenizeBody,
)
from fly_daemon.http.responses_api import ResponsesRequest
from fly_daemon.inproc import InProcessClient
from fly_daemon.runtime import host_port, is_loopback_host

log = logging.getLogger("fly_daemon")

OLLAMA_PREFIX = "/api"
"""Where Ollama's API (fly_daemon.http.ollama_routes) is mounted."""
MESSAGES_PREFIX = "/v1/messages"
"""Where Anthropic's Messages API is served (its routes answer errors in its shape)."""
MISDIRECTED = 421
"""The status of a request whose Host header names a host this front does not serve."""
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
"""The Host names a loopback front always answers."""
_HOST = re.compile(r"(?:\[(?P<v6>[0-9a-f:.]+)\]|(?P<name>[a-z0-9._-]+|[0-9a-f:]+))(?::\d{1,5})?")


def create_app(client: InProcessClient, *, api_key: str | None = None, max_body_bytes: int = MAX_FRAME_BYTES,
               allowed_hosts: Collection[str] | None = None,
               embeddings: EmbeddingService = EmbeddingService(), trusted_proxies: Iterable[Network] = ()) -> FastAPI:
    """The FastAPI app serving `client`'s scheduler, and `embeddings` (default: none) on the embedding routes.

    With `api_key`, every route but /health needs `Authorization: Bearer <api_key>` or `x-api-key: <api_key>`
    (/docs and /redoc are off). With `allowed_hosts` (see `trusted_hosts`), a request whose Host header names
    another host is refused (421). Each request counts against the per-client caps as the client that
    fly_daemon.client_identity names (the address `trusted_proxies` forward, if its peer is one of them).
    """
    guard = [Depends(_bearer(api_key))] if api_key else []
    docs: dict[str, Any] = {"docs_url": None, "redoc_url": None, "openapi_url": None} if api_key else {}
    app = FastAPI(title="fly-llm", version=fly_llm.__version__,
                  description="OpenAI-compatible HTTP front of fly-daemon (FLy speculative decoding).", **docs)
    app.add_middleware(_BodyLimit, max_bytes=max_body_bytes)
    if allowed_hosts is not None:
        app.add_middleware(_TrustedHosts, hosts=allowed_hosts)
    app.add_middleware(CloseWhenBodyUnread)  # outermost: it sees every answer
    v1 = APIRouter(prefix="/v1", dependencies=guard)
    clients = HttpClients(request_tenant(api_key), tuple(trusted_proxies))

    @v1.post("/chat/completions")
    async def chat_completions(body: JsonBody[ChatCompletionRequest], request: Request) -> Response:
        return await serve(client, request, clients, lambda: _choices(client, body))

    @v1.post("/completions")
    async def completions(body: JsonBody[CompletionRequest], request: Request) -> Response:
        return await serve(client, request, clients, lambda: _choices(client, body))

    @v1.post("/responses")
    async def responses(body: JsonBody[ResponsesRequest], request: Request) -> Response:
        return await serve(client, request, clients, lambda: _translation(client, body))

    anthropic = APIRouter(prefix="/messages", dependencies=guard, route_class=shaped_route(anthropic_error))

    @anthropic.post("")
    async def messages(body: JsonBody[MessagesRequest], request: Request) -> Response:
        return await serve(client, request, clients, lambda: _translation(client, body))

    @anthropic.post("/count_tokens")
    async def count_tokens(body: JsonBody[CountTokensRequest], request: Request) -> dict[str, Any]:
        await client.loaded_model()
        reply = await client.tokenize(clients.identity(request), messages=body.chat_messages(), tools=body.tool_specs())
        return {"input_tokens": reply.count}

    @anthropic.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    async def anthropic_unknown(rest: str) -> Response:
        """Another path under /v1/messages (its batches, say): 404 in Anthropic's shape."""
        raise HTTPException(404, f"/v1/messages/{rest[:100]} is not served "
                                 "(POST /v1/messages, /v1/messages/count_tokens)")

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        """The target, then the embedding model where embeddings are served (fly_daemon.embeddings: listed)."""
        names = [client.served_model(), *filter(None, [embeddings.listed()])]
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(client.started),
                                            "owned_by": "fly-llm"} for name in names]}

    @app.post("/infill", dependencies=guard)
    async def infill(body: JsonBody[InfillBody], request: Request) -> Response:
        """llama.cpp's fill-in-the-middle (fly_daemon.http.llamacpp_api)."""
        return await serve(client, request, clients, lambda: _llama(client, body))

    @app.post("/completion", dependencies=guard)
    async def completion(body: JsonBody[CompletionBody], request: Request) -> Response:
        """llama.cpp's raw-text completion (fly_daemon.http.llamacpp_api)."""
        return await serve(client, request, clients, lambda: _llama(client, body))

    @app.post("/tokenize", dependencies=guard)
    async def tokenize(body: JsonBody[TokenizeBody], request: Request) -> dict[str, Any]:
        reply = await client.tokenize(clients.identity(request), text=body.content, add_special=body.add_special)
        return {"tokens": reply.token_ids}

    @app.post("/detokenize", dependencies=guard)
    async def detokenize(body: JsonBody[DetokenizeBody], request: Request) -> dict[str, Any]:
        return {"content": (await client.tokenize(clients.identity(request), token_ids=body.tokens)).text}

    @app.get("/metrics", dependencies=guard)
    async def metrics() -> Response:
        """The daemon's Prometheus metrics (fly_daemon.metrics), as on --metrics-port."""
        return Response(generate_latest(client.metrics_registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 when ready; 503 while loading, draining or failed."""
        return JSONResponse({"state": client.state, "detail": client.detail},
                            status_code=200 if client.state == "ready" else 503)

    if api_key:
        @app.get("/openapi.json", dependencies=guard, include_in_schema=False)
        async def openapi() -> dict[str, Any]:
            return app.openapi()

    v1.include_router(openai_embeddings(embeddings, clients))
    v1.include_router(anthropic)
    app.include_router(v1)
    app.mount(OLLAMA_PREFIX, ollama_app(client, guard, clients, embeddings))  # docs/daemon.md, "Ollama API"
    add_error_handlers(app, openai_error)  # Anthropic's routes answer their own (shaped_route), Ollama's app its own
    return app


def request_tenant(api_key: str | None) -> str:
    """The tenant a front's requests are submitted under: 'http-key:' + a short sha256 of its key, else
    LOCAL_TENANT."""
    return f"http-key:{hashlib.sha256(api_key.encode()).hexdigest()[:16]}" if api_key else LOCAL_TENANT


def require_key_off_loopback(host: str, api_key: str | None) -> None:
    """ValueError when `host` is not loopback and there is no API key (an empty key is none)."""
    if not is_loopback_host(host) and not (api_key and api_key.strip()):
        raise ValueError(f"refusing to serve HTTP on {host} (not loopback) without an API key "
                         "(--api-key or FLY_API_KEY)")


def trusted_hosts(host: str, extra: Iterable[str] = ()) -> frozenset[str] | None:
    """The Host names a front bound on `host` answers (for `create_app`); None = any.

    The loopback names, `host` and `extra`; but beyond loopback, where the key guards every route, any
    host unless `extra` names some. '*' in `extra` allows any host. ValueError for an entry that is not
    a host name.
    """
    extra = list(extra)
    if "*" in extra or not (extra or is_loopback_host(host)):
        return None
    return frozenset({*LOOPBACK_NAMES, host.lower(), *(_host_name(h) or _bad_host(h) for h in extra)})


def _host_name(value: str) -> str | None:
    """The host name of a Host header ('name', 'name:port', '[v6]:port'), lowercased; None if it is not one."""
    match = _HOST.fullmatch(value.strip().lower())
    return match and (match["v6"] or match["name"])


def _bad_host(value: str) -> str:
    raise ValueError(f"not a host name: {value!r} (allowed hosts are names or addresses, e.g. fly.example)")


def _bearer(api_key: str) -> Callable[..., Awaitable[None]]:
    """A dependency that refuses requests without `Authorization: Bearer <api_key>` or `x-api-key: <api_key>`
    (Anthropic's header) (UNAUTHORIZED, 401)."""
    bearer, header = HTTPBearer(auto_error=False), APIKeyHeader(name="x-api-key", auto_error=False)

    async def check(credentials: HTTPAuthorizationCredentials | None = Depends(bearer),
                    key: str | None = Depends(header)) -> None:
        given = credentials.credentials if credentials is not None else key
        if given is None or not secrets.compare_digest(given.encode(), api_key.encode()):
            raise Unauthorized("a valid API key is required (Authorization: Bearer <key>, or x-api-key: <key>)")

    return check


# ---- generation ----

async def _choices(client: InProcessClient, body: GenerationBody) -> Choices:
    """A chat or text completion's answer by the served model (once loaded), whatever model the body names: one
    model generates here, so every name answers to it, as llama-server's do."""
    return Choices(body, await client.loaded_model(), client.limits.max_tokens_limit)


async def _translation(client: InProcessClient, body: Translated) -> Translation:
    """A request of another API (the Responses or Messages API) as one chat request's answer, by the served model
    whatever the body names (Claude Code and Codex send their own default model names)."""
    shaper = body.shaper(await client.loaded_model())
    limit = client.limits.max_tokens_limit  # the engine clips it to what fits the context window
    return Translation(shaper, body.to_generate(shaper.id, limit), body.stream)


async def _llama(client: InProcessClient, body: LlamaBody) -> LlamaAnswer:
    """A llama.cpp request's answer (/completion, /infill; the model unnamed: the served one)."""
    return LlamaAnswer(body, await client.loaded_model(), client.limits.max_tokens_limit)


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


class _BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is refused (413, TOO_LONG), unread when Content-Length
    says so, else as soon as the bytes read pass the cap. (FastAPI's own max_body_size answers in plain text.)"""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length", "")
        declared = int(length) if length.isdigit() else 0
        read = 0

        async def limited() -> Message:
            nonlocal read
            if declared > self.max_bytes:
                raise HTTPException(413, f"request body of {declared} bytes, over the limit of {self.max_bytes}")
            message = await receive()
            read += len(message.get("body", b""))
            if read > self.max_bytes:
                raise HTTPException(413, f"request body over the limit of {self.max_bytes} bytes")
            return message

        await self.app(scope, limited, send)


class _TrustedHosts:
    """ASGI middleware: a request whose Host header names none of `hosts` is refused (421, BAD_REQUEST), before
    routing, in Ollama's error shape under OLLAMA_PREFIX, Anthropic's under MESSAGES_PREFIX, OpenAI's elsewhere."""

    def __init__(self, app: ASGIApp, hosts: Collection[str]) -> None:
        self.app = app
        self.hosts = frozenset(hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        host = Headers(scope=scope).get("host", "") if scope["type"] == "http" else None  # lifespan: no headers
        if host is None or _host_name(host) in self.hosts:
            await self.app(scope, receive, send)
            return
        error = BadRequest(f"Host {host[:100]!r} is not served here (allowed: {', '.join(sorted(self.hosts))}; "
                           "add one with --allowed-host or FLY_ALLOWED_HOSTS)")
        path = scope["path"]  # before routing: the shape of the API the path names
        shape = ollama_error if _under(path, OLLAMA_PREFIX) else anthropic_error if _under(path, MESSAGES_PREFIX) \
            else openai_error
        await JSONResponse(shape(error, MISDIRECTED), status_code=MISDIRECTED)(scope, receive, send)


# ---- serving ----

class HttpFront:
    """uvicorn serving an app on HOST:PORT in a background thread; the port is bound at construction.
    Connections are timed out and capped by `limits` (fly_daemon.http.connections)."""

    def __init__(self, app: FastAPI, address: str, *, api_key: str | None = None,
                 limits: HttpLimits = HttpLimits()) -> None:
        """Bind `address` ('HOST:PORT'); ValueError for a non-loopback host without an API key, OSError if taken."""
        host, port = host_port(address)
        require_key_off_loopback(host, api_key)
        try:
            self._socket = _listen(host, port)
        except OSError as exc:
            raise OSError(f"cannot serve HTTP on {address}: {exc.strerror or exc}") from None
        bound_host, self.port = self._socket.getsockname()[:2]
        self.url = f"http://{f'[{bound_host}]' if ':' in bound_host else bound_host}:{self.port}"
        # proxy_headers off: the peer stays the peer (uvicorn would take X-Forwarded-For from any 127.0.0.1 peer);
        # forwarded headers are read by fly_daemon.client_identity, from trusted proxies only
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", proxy_headers=False,
                                timeout_graceful_shutdown=5, http=guarded_protocol(limits),
                                timeout_keep_alive=limits.http_keep_alive_timeout)  # type: ignore[arg-type]
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="fly-http", daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("OpenAI-compatible HTTP on %s/v1", self.url)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving (open streams get uvicorn's graceful shutdown) and close the socket."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._socket.close()


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port.

    Its protocol is IPPROTO_TCP, not 0 as `socket.create_server` leaves it: asyncio sets TCP_NODELAY only on
    connections of such sockets, and without it every response waited ~40 ms for a delayed ACK (Nagle).
    """
    family, kind, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock

