"""The serving core: a scheduler running the engine in a model thread, and an in-process client of it.

Every way of serving holds one: `fly-daemon` (its ZeroMQ socket loop, fly_daemon.server, and its HTTP
front) and each `fly-serve` replica (fly_daemon.replicas). `build_core` makes it from the settings; a
front only adds how requests come in. Replies to requests from inside the process (the LOCAL envelope:
the HTTP front's) go to the in-process client; any other reply goes to `remote`, the socket loop's
outbox (a core without a socket loop has no other clients, and drops them).
"""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import FastAPI
from pydantic import BaseModel

from fly_llm.common.config import FLyConfig, ModelSpec
from fly_llm.model.embedding_source import served_names

from fly_daemon.embeddings import Embedder, EmbeddingService, EmbeddingSettings
from fly_daemon.http.app import HttpFront, create_app, require_key_off_loopback, trusted_hosts
from fly_daemon.inproc import InProcessClient
from fly_daemon.metrics import Metrics
from fly_daemon.runtime import host_port
from fly_daemon.scheduling.scheduler import LOCAL, Envelope, Limits, Scheduler
from fly_daemon.settings import DaemonSettings

if TYPE_CHECKING:
    from fly_llm.decoding.engine import FLyEngine

log = logging.getLogger("fly_daemon")


class ServingCore:
    """A Scheduler on `load_engine`, the model thread that runs it, the in-process client of it, and the
    embedding worker beside it (none unless given)."""

    def __init__(self, load_engine: Callable[[], "FLyEngine"], limits: Limits = Limits(), *,
                 metrics: Metrics | None = None, embeddings: EmbeddingService | None = None) -> None:
        self.scheduler = Scheduler(load_engine, self.emit, limits, metrics)
        self.inproc = InProcessClient(self.scheduler)
        """Submits to the scheduler from inside this process (the HTTP front uses it)."""
        self.embeddings = embeddings or EmbeddingService()
        """Embeds for the HTTP front in a thread of its own (fly_daemon.embeddings), outside the model thread."""
        self.remote: Callable[[Envelope, BaseModel], None] | None = None
        """Sends replies to clients outside this process (the socket loop serving this core sets it)."""
        self._model_thread: threading.Thread | None = None

    def emit(self, envelope: Envelope, message: BaseModel) -> None:
        """Route a reply of the scheduler (from any thread) to the client whose request it answers."""
        if envelope != LOCAL and self.remote is not None:
            self.remote(envelope, message)
        else:
            self.inproc.deliver(envelope, message)

    def start(self, on_exit: Callable[[], None] | None = None) -> None:
        """Start the model thread: it loads the engine, serves until drained, then calls `on_exit` there."""

        def run() -> None:
            try:
                self.scheduler.run()
            finally:
                if on_exit is not None:
                    on_exit()

        self._model_thread = threading.Thread(target=run, name="fly-model", daemon=True)
        self._model_thread.start()

    def running(self) -> bool:
        """Whether the model thread runs (it ends once drained, or when the models failed to load)."""
        return self._model_thread is not None and self._model_thread.is_alive()

    def http_app(self, settings: DaemonSettings, host: str | None) -> FastAPI:
        """The OpenAI-compatible routes over this core, answering the Host names `host` trusts (None: any)."""
        hosts = trusted_hosts(host, settings.allowed_hosts) if host else None
        return create_app(self.inproc, api_key=settings.api_key_value(), max_body_bytes=settings.max_frame_bytes,
                          allowed_hosts=hosts, embeddings=self.embeddings, trusted_proxies=settings.trusted_proxies)

    def http_front(self, settings: DaemonSettings) -> HttpFront | None:
        """The HTTP front on `settings.http` (bound, not yet serving), or None; ValueError for a
        non-loopback address without an API key or a bad allowed host, OSError if the port is taken."""
        if settings.http is None:
            return None
        api_key = settings.api_key_value()
        host, _ = host_port(settings.http)
        require_key_off_loopback(host, api_key)
        return HttpFront(self.http_app(settings, host), settings.http, api_key=api_key, limits=settings)


def build_core(spec: ModelSpec, fly: FLyConfig, settings: DaemonSettings) -> ServingCore:
    """The core the settings describe: `spec`'s models with `fly`'s defaults, under the daemon's limits, and
    the embedding model (listed by its name at once, loaded on the first embeddings request)."""
    return ServingCore(_engine_loader(spec, fly, settings), settings,
                       embeddings=EmbeddingService(_embedding_loader(settings), settings,
                                                   name=served_names(settings.embedding_model)[0]))


def _engine_loader(spec: ModelSpec, fly: FLyConfig, settings: DaemonSettings) -> Callable[[], "FLyEngine"]:
    """What the model thread calls to load the engine."""

    def load_engine() -> "FLyEngine":
        from fly_llm.loading import load_engine

        log.info("loading models: target=%s draft=%s (%s, %s)", spec.target or "embedded default",
                 spec.draft or "default", spec.dtype, spec.device)
        engine = load_engine(spec, fly, prefix_cache_mb=settings.prefix_cache_mb,
                             prefill_chunk=settings.prefill_chunk, grammar_cache_mb=settings.grammar_cache_mb,
                             max_grammar_mb=settings.max_grammar_mb, grammar_workers=settings.grammar_workers)
        freeze_loaded()
        return engine

    return load_engine


def freeze_loaded() -> None:
    """Keep what is alive once the models are loaded (the libraries, the models, the settings: the daemon's
    lifetime) out of the garbage collector's full collections (`gc.freeze`, as vLLM does after its startup).
    A full collection walks every tracked object; with those in it, one took 0.4 s of the model thread on
    the tiny pair while replies with many log-probabilities were built (benchmarks/results/attacks/amplification)."""
    gc.collect()
    gc.freeze()


def _embedding_loader(settings: EmbeddingSettings) -> Callable[[], Embedder]:
    """What the embedding worker thread calls to load its model, with its own torch thread count."""

    def load_embedder() -> Embedder:
        import torch

        from fly_llm.model.embedding import SentenceEmbedder

        torch.set_num_threads(settings.embedding_threads)  # this thread's only: the model thread keeps its own
        log.info("loading the embedding model: %s", settings.embedding_model or "embedded default")
        return SentenceEmbedder.load(settings.embedding_model)

    return load_embedder
