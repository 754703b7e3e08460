"""The daemon's HTTP front in-process on the engine double (tests/support/engine_double.py): a Server on
CountingEngine and the front on a free loopback port, with an httpx client on it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from support.engine_double import CountingEngine, serving

from fly_daemon.embeddings import EmbeddingService
from fly_daemon.http.app import HttpFront, create_app
from fly_daemon.server import Server


@contextmanager
def double_front(tmp_path, engine: CountingEngine | None = None, *, api_key: str | None = None,
                 embeddings: EmbeddingService | None = None) -> Iterator[tuple[Server, httpx.Client]]:
    """(server, httpx client on the front's URL) serving `engine` (a fresh CountingEngine by default) and
    `embeddings` (default: none)."""
    with serving(f"ipc://{tmp_path}/s.sock", engine or CountingEngine()) as server:
        app = create_app(server.core.inproc, api_key=api_key, embeddings=embeddings or EmbeddingService())
        with started(HttpFront(app, "127.0.0.1:0", api_key=api_key)) as client:
            yield server, client


@contextmanager
def started(http: HttpFront, timeout: float = 30) -> Iterator[httpx.Client]:
    """An httpx client on `http` (`timeout` seconds a request), started for the block and stopped after it."""
    http.start()
    try:
        with httpx.Client(base_url=http.url, timeout=timeout) as client:
            yield client
    finally:
        http.stop()
