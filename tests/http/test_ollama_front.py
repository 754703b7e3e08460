"""The /api routes in-process, on the engine double (one token per step, no chat template): NDJSON lines,
the front's API key and body limit in Ollama's error shape, and a stream its client leaves is cancelled."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager


from support.engine_double import CountingEngine, serving
from support.http_double import started

from fly_daemon.http.app import HttpFront, create_app

GENERATE = {"model": CountingEngine.target_name, "prompt": "a b c", "options": {"num_predict": 3}}


@contextmanager
def front(tmp_path, engine: CountingEngine | None = None, *, api_key: str | None = None,
          max_body_bytes: int = 64 * 1024):
    """(server, httpx client on the front's URL) serving the double."""
    with serving(f"ipc://{tmp_path}/s.sock", engine or CountingEngine()) as server:
        http = HttpFront(create_app(server.core.inproc, api_key=api_key, max_body_bytes=max_body_bytes),
                         "127.0.0.1:0", api_key=api_key)
        with started(http) as client:
            yield server, client


def test_generate_streams_ndjson_lines_then_one_done_line(tmp_path):
    with front(tmp_path) as (_, client):
        answer = client.post("/api/generate", json=GENERATE)
        assert answer.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in answer.text.splitlines()]
        assert [line["response"] for line in lines] == ["1 ", "2 ", "3 ", ""]
        assert [line["done"] for line in lines] == [False, False, False, True]
        assert lines[-1]["done_reason"] == "length" and lines[-1]["eval_count"] == 3
        whole = client.post("/api/generate", json={**GENERATE, "stream": False}).json()
        assert whole["response"] == "1 2 3 " and whole["prompt_eval_count"] == 3


def test_api_key_and_body_limit_answer_in_ollamas_shape(tmp_path):
    with front(tmp_path, api_key="sekrit", max_body_bytes=2048) as (_, client):
        refused = client.post("/api/generate", json=GENERATE)
        assert refused.status_code == 401 and refused.json()["code"] == "UNAUTHORIZED"
        assert refused.headers["www-authenticate"] == "Bearer" and "API key" in refused.json()["error"]
        assert client.get("/api/version").status_code == 401
        key = {"Authorization": "Bearer sekrit"}
        assert client.get("/api/version", headers=key).status_code == 200
        assert client.get("/api/openapi.json", headers=key).status_code == 404  # no docs under /api
        big = client.post("/api/generate", json={**GENERATE, "prompt": "x" * 4096}, headers=key)
        assert big.status_code == 413 and big.json()["code"] == "TOO_LONG"


def test_a_stream_its_client_leaves_is_cancelled(tmp_path):
    engine = CountingEngine(step_s=0.05)
    with front(tmp_path, engine) as (server, client):
        with client.stream("POST", "/api/generate", json={**GENERATE, "options": {"num_predict": 1000}}) as answer:
            assert json.loads(next(answer.iter_lines()))["done"] is False
        deadline = time.monotonic() + 10
        while server.scheduler.snapshot()["active"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.scheduler.snapshot()["active"] == 0
