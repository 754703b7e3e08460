"""The HTTP front in-process, on the engine double (one token per step): shapes, streams, errors, cancellation.

Each test runs a Server on CountingEngine (tests/support/engine_double.py) and the HTTP front on a free
loopback port, so what the front does with the scheduler (disconnects, loading, BUSY, heartbeats) is
shown exactly and in seconds. The official clients against a real daemon: test_http_openai.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

from support.engine_double import CountingEngine, serving
from support.http_double import started
from fly_llm.common.protocol import MAX_PROMPT_CHARS

from fly_daemon.http.app import HttpFront, create_app
from fly_daemon.scheduling.scheduler import Limits
from fly_daemon.settings import DaemonSettings, SettingsError, load_settings

MODEL = CountingEngine.target_name
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "a b c"}]}
JSON = {"content-type": "application/json"}


@contextmanager
def front(tmp_path, engine: CountingEngine | None = None, limits: Limits = Limits(), *, load=None,
          api_key: str | None = None, max_body_bytes: int = 64 * 1024):
    """(server, httpx client on the front's URL): the daemon's Server on the double, its HTTP front on a free port."""
    with serving(f"ipc://{tmp_path}/s.sock", engine or CountingEngine(), limits, load=load) as server:
        app = create_app(server.core.inproc, api_key=api_key, max_body_bytes=max_body_bytes)
        with started(HttpFront(app, "127.0.0.1:0", api_key=api_key)) as client:
            yield server, client


def _events(response: httpx.Response) -> list[dict | str]:
    """The data of each server-sent event ('[DONE]' stays a string)."""
    data = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def _outcomes(server, outcome: str) -> float:
    return server.scheduler.metrics.registry.get_sample_value("fly_requests_total", {"outcome": outcome}) or 0.0


def _wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_chat_and_completion_answers_in_openai_shape(tmp_path):
    with front(tmp_path) as (_, client):
        chat = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3}).json()
        assert chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-") and chat["model"] == MODEL
        assert chat["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "1 2 3 "},
                                    "finish_reason": "length", "logprobs": None}]
        assert chat["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
        assert {"rounds", "mat", "loose_rate", "accepted_loose"} <= set(chat["fly_stats"])
        text = client.post("/v1/completions", json={"model": MODEL, "prompt": ["a b"], "max_completion_tokens": 2,
                                                     "k": 4, "loose": False, "user": "u1"}).json()
        assert text["object"] == "text_completion" and text["choices"][0]["text"] == "1 2 "
        assert text["usage"]["prompt_tokens"] == 2 and "fly_stats" in text
        models = client.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        assert client.get("/health").json() == {"state": "ready", "detail": ""}


def test_streams_are_server_sent_events_with_usage_once(tmp_path):
    with front(tmp_path) as (_, client):
        with client.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 3, "stream": True}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = _events(r)
        assert events[-1] == "[DONE]"
        opening, *texts, final = events[:-1]
        assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert [e["choices"][0]["delta"]["content"] for e in texts] == ["1 ", "2 ", "3 "]
        assert final["choices"][0]["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 3
        assert "fly_stats" in final and all("usage" not in e for e in events[:-2])

        body = {"model": MODEL, "prompt": "a", "max_tokens": 2, "stream": True,
                "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/completions", json=body) as r:
            events = _events(r)
        *texts, final, usage, done = events
        assert [e["choices"][0]["text"] for e in texts] == ["1 ", "2 "] and all(e["usage"] is None for e in texts)
        assert final["choices"][0]["finish_reason"] == "length" and "usage" not in final
        assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 3 and done == "[DONE]"


def test_bad_input_gets_4xx_in_openai_shape_while_others_are_served(tmp_path):
    with front(tmp_path, CountingEngine(step_s=0.01), Limits(max_tokens_limit=300)) as (server, client):
        long = {}
        runner = threading.Thread(target=lambda: long.update(r=client.post(
            "/v1/chat/completions", json={**CHAT, "max_tokens": 200, "stream": True})))
        runner.start()
        assert _wait_for(lambda: server.scheduler.snapshot()["active"] == 1)
        post = "/v1/chat/completions"
        cases = [
            (client.post(post, content=b'{"model": "counting", "messages": [', headers=JSON),
             400, "BAD_REQUEST", None, "not valid JSON"),
            (client.post(post, content=b'{"model": "counting", "messages": [{"role": "user", "content": "a\\ud83d"}]}',
                         headers=JSON), 400, "BAD_REQUEST", None, "not valid JSON"),  # a lone surrogate
            (client.post(post, json={**CHAT, "max_tokens": "many"}), 400, "BAD_REQUEST", "max_tokens", "integer"),
            (client.post(post, json={**CHAT, "max_tokens": True}), 400, "BAD_REQUEST", "max_tokens", "integer"),
            (client.post(post, json={**CHAT, "max_tokens": "8"}), 400, "BAD_REQUEST", "max_tokens", "integer"),
            (client.post(post, json={"model": MODEL, "messages": "hi"}), 400, "BAD_REQUEST", "messages", "list"),
            (client.post(post, json={**CHAT, "logprobs": True, "top_logprobs": 21}), 400, "BAD_REQUEST",
             "top_logprobs", "20"),
            (client.post(post, json={**CHAT, "n": 17}), 400, "BAD_REQUEST", "n", "16"),
            (client.post(post, json={**CHAT, "temperature": -1}), 400, "BAD_REQUEST", None, "temperature"),
            (client.post(post, json={**CHAT, "k": 0}), 400, "BAD_REQUEST", None, "k"),
            (client.post(post, json={**CHAT, "stop": ["x"] * 17}), 400, "TOO_LONG", None, "stop"),
            (client.post(post, json={**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
             400, "BAD_REQUEST", "messages.0.content.str", None),
            (client.post(post, content=b"x" * 70_000, headers=JSON),
             413, "TOO_LONG", None, "over the limit"),
            (client.post(post, content=iter([b"x" * 40_000] * 2), headers=JSON),
             413, "TOO_LONG", None, "over the limit"),
            (client.get("/v1/nowhere"), 404, "BAD_REQUEST", None, "Not Found"),
            (client.get(post), 405, "BAD_REQUEST", None, "Method Not Allowed"),
        ]
        for response, status, code, param, words in cases:
            error = response.json()["error"]
            assert (response.status_code, error["code"]) == (status, code), error
            assert error["type"] == "invalid_request_error" and (param is None or error["param"] == param), error
            assert words is None or words in error["message"], error
        for served in (client.post(post, json={**CHAT, "model": "gpt-4o"}),  # any name: the one served model
                       client.post(post, json={**CHAT, "max_tokens": 10**6})):  # over the limit: capped
            assert served.status_code == 200 and served.json()["model"] == MODEL, served.text
            assert served.json()["usage"]["completion_tokens"] <= 300
        runner.join(30)
        events = _events(long["r"])
        assert events[-2]["usage"]["completion_tokens"] == 200 and events[-1] == "[DONE]"


def test_prompt_over_the_character_cap_is_too_long(tmp_path):
    with front(tmp_path, max_body_bytes=4 * MAX_PROMPT_CHARS) as (_, client):
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "a" * (MAX_PROMPT_CHARS + 1)})
        assert (r.status_code, r.json()["error"]["code"]) == (400, "TOO_LONG")


def test_a_client_that_disconnects_mid_stream_cancels_its_request(tmp_path):
    with front(tmp_path, CountingEngine(step_s=0.01)) as (server, client):
        body = {**CHAT, "max_tokens": 4000, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            events = (line for line in r.iter_lines() if line.startswith("data: "))
            assert [next(events) for _ in range(3)]
        # leaving the block closed the connection mid-stream (40 s of tokens were left)
        assert _wait_for(lambda: _outcomes(server, "CANCELLED") == 1, 5)
        assert server.scheduler.snapshot()["active"] == 0


def test_a_client_that_disconnects_while_waiting_cancels_its_request(tmp_path):
    with front(tmp_path, CountingEngine(step_s=0.01)) as (server, client):
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 4000}, timeout=0.5)
        assert _wait_for(lambda: _outcomes(server, "CANCELLED") == 1, 5)
        assert server.scheduler.snapshot()["active"] == 0 and _outcomes(server, "ok") == 0


def test_http_requests_need_no_heartbeats(tmp_path):
    """The scheduler cancels socket requests without heartbeats; in-process ones end only with their caller."""
    with front(tmp_path, CountingEngine(step_s=0.01), Limits(heartbeat_timeout=0.5)) as (_, client):
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 150})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 150


def test_requests_wait_while_the_models_load(tmp_path):
    loaded = threading.Event()

    def slow_load():
        loaded.wait(30)
        return CountingEngine()

    with front(tmp_path, load=slow_load) as (_, client):
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["state"] == "loading"
        assert client.get("/v1/models").json()["error"]["code"] == "NOT_READY"
        answer = {}
        waiter = threading.Thread(target=lambda: answer.update(r=client.post(
            "/v1/chat/completions", json={**CHAT, "max_tokens": 2})))
        waiter.start()
        time.sleep(0.3)
        assert "r" not in answer
        loaded.set()
        waiter.join(10)
        assert answer["r"].json()["choices"][0]["message"]["content"] == "1 2 "


def test_a_full_queue_is_503_busy_with_retry_after(tmp_path):
    limits = Limits(queue_size=1, max_batch_size=1, newcomer_rows=0)  # each connection is a client: no newcomer rows

    async def three(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as aclient:
            body = {"model": MODEL, "prompt": "a", "max_tokens": 40}
            first = asyncio.create_task(aclient.post("/v1/completions", json=body))
            await asyncio.sleep(0.2)  # running
            second = asyncio.create_task(aclient.post("/v1/completions", json=body))
            await asyncio.sleep(0.1)  # queued
            return [await aclient.post("/v1/completions", json=body), await first, await second]

    with front(tmp_path, CountingEngine(step_s=0.02), limits) as (_, client):
        busy, first, second = asyncio.run(three(str(client.base_url)))
    assert (busy.status_code, busy.json()["error"]["code"], busy.headers["retry-after"]) == (503, "BUSY", "1")
    assert busy.json()["error"]["type"] == "server_error"
    assert first.status_code == second.status_code == 200


def test_a_newcomer_joins_a_full_batch_at_once(tmp_path):
    """Newcomer rows (issue 45): with a batch of one running another client's long request, a new client's
    request runs beside it at once instead of waiting for it to end; a third client's is the second newcomer."""
    with front(tmp_path, CountingEngine(step_s=0.02), Limits(max_batch_size=1)) as (server, client):
        body = {"model": MODEL, "prompt": "a", "max_tokens": 400}
        runners = [threading.Thread(target=lambda: client.post("/v1/completions", json=body)) for _ in range(3)]
        for count, runner in enumerate(runners, start=1):
            runner.start()  # each request on its own connection: over loopback without a key, its own client
            assert _wait_for(lambda: server.scheduler.snapshot()["active"] == count), server.scheduler.snapshot()
        for runner in runners:
            runner.join(60)


def test_api_key(tmp_path):
    with front(tmp_path, api_key="s3cret") as (_, client):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            r = client.get("/v1/models", headers=headers)
            assert (r.status_code, r.json()["error"]["code"]) == (401, "UNAUTHORIZED")
            assert r.json()["error"]["type"] == "authentication_error" and r.headers["www-authenticate"] == "Bearer"
        ok = client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1},
                         headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert client.get("/health").status_code == 200  # probes need no key


def test_binding_rules_and_settings(tmp_path, monkeypatch):
    app = create_app(None)  # type: ignore[arg-type]  # nothing is served here
    with pytest.raises(ValueError, match="without an API key"):
        HttpFront(app, "0.0.0.0:8000")
    taken = HttpFront(app, "127.0.0.1:0")
    with pytest.raises(OSError, match="cannot serve HTTP"):
        HttpFront(app, f"127.0.0.1:{taken.port}")
    taken.stop()
    config = tmp_path / "config.toml"
    config.write_text('[daemon]\nhttp = "127.0.0.1:9000"\napi_key = "from-file"\n')
    settings = load_settings(DaemonSettings, config)
    assert settings.http == "127.0.0.1:9000" and settings.api_key.get_secret_value() == "from-file"
    assert "from-file" not in repr(settings)
    monkeypatch.setenv("FLY_HTTP", "[::1]:8001")
    assert load_settings(DaemonSettings, config).http == "[::1]:8001"
    assert load_settings(DaemonSettings, config, {"http": "localhost:1"}).http == "localhost:1"
    with pytest.raises(SettingsError, match="HOST:PORT"):
        load_settings(DaemonSettings, config, {"http": "localhost"})


def test_answers_are_not_held_back_by_nagle(tmp_path):
    """Each response went out ~40 ms late (delayed ACK) before the front's sockets had TCP_NODELAY."""
    with front(tmp_path) as (_, client):
        times = []
        for _ in range(11):
            began = time.perf_counter()
            assert client.get("/health").status_code == 200
            times.append(time.perf_counter() - began)
    assert sorted(times)[5] < 0.03, times


def test_parallel_tool_calls_reaches_the_request_structure():
    """OpenAI's parallel_tool_calls=False becomes the request's (the grammar allows one call: test_grammar)."""
    from fly_daemon.http.openai_api import ChatCompletionRequest

    tools = [{"type": "function", "function": {"name": "f"}}]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    assert ChatCompletionRequest.model_validate(body).to_generate("a", 4096).structure.parallel_tool_calls is None
    single = ChatCompletionRequest.model_validate({**body, "parallel_tool_calls": False}).to_generate("b", 4096)
    assert single.structure.parallel_tool_calls is False
