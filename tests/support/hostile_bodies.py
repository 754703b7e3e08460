"""Bodies whose one long array holds items of the wrong type, one per door, and a probe of how long refusing one
holds the HTTP front (issue 65): tests/hostile/test_hostile_bodies.py and benchmarks/serving/body_stall.py."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

WRONG_ITEMS: dict[str, tuple[str, Callable[[int], dict[str, Any]]]] = {
    "/v1/embeddings input": ("/v1/embeddings", lambda n: {"model": "m", "input": [{}] * n}),
    "/v1/chat/completions messages": ("/v1/chat/completions", lambda n: {"model": "m", "messages": [{}] * n}),
    "/v1/responses input": ("/v1/responses", lambda n: {"model": "m", "input": [{}] * n}),
    "/v1/messages messages": ("/v1/messages", lambda n: {"model": "m", "max_tokens": 8, "messages": [{}] * n}),
    "/api/chat messages": ("/api/chat", lambda n: {"model": "m", "messages": [{}] * n}),
    "/api/embed input": ("/api/embed", lambda n: {"model": "m", "input": [{}] * n}),
    "/v1/completions prompt": ("/v1/completions", lambda n: {"model": "m", "prompt": [[{}]] * (n // 2)}),
}
"""Per door: its path, and a body whose array holds n wrong items (about n JSON values)."""


@dataclass
class Refusal:
    """One body's answer, and /health's longest answer time while the front worked on it."""

    status: int
    error: Any  # the body's "error": OpenAI's and Anthropic's an object, Ollama's a string
    seconds: float
    health_longest: float


def refused(client: httpx.Client, path: str, body: dict[str, Any]) -> Refusal:
    """Post `body` to `path` from a thread while this thread asks /health, on its own connection, every 5 ms."""
    content = json.dumps(body, separators=(",", ":")).encode()
    answer: dict[str, Any] = {}

    def post() -> None:
        start = time.perf_counter()
        reply = client.post(path, content=content, headers={"content-type": "application/json"})
        answer.update(status=reply.status_code, error=reply.json().get("error"), seconds=time.perf_counter() - start)

    with httpx.Client(base_url=str(client.base_url), timeout=300) as health:
        worker = threading.Thread(target=post)
        worker.start()
        longest = 0.0
        while worker.is_alive():
            start = time.perf_counter()
            health.get("/health")
            longest = max(longest, time.perf_counter() - start)
            time.sleep(0.005)
        worker.join()
    return Refusal(health_longest=longest, **answer)
