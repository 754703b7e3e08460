"""The HTTP front's edges (issue 33): Host allow-list, docs behind the key, no exception text in errors,
deep JSON in a tool call's arguments, empty keys, and the tenant / client each request is submitted under.

The front is built as `fly-daemon start --http` builds it (ServingCore.http_front, fly_daemon.core) over
a Server on the engine double, so the settings' wiring is tested too.
"""

from __future__ import annotations

import hashlib
import logging
import re
from contextlib import contextmanager

import httpx
import hypothesis
import pytest

from support.engine_double import CountingEngine, serving
from support.http_double import started
from support.forwarded_headers import forwarded_headers

from fly_daemon.core import ServingCore
from fly_daemon.limits import Limits
from fly_daemon.settings import DaemonSettings, load_settings

MODEL = CountingEngine.target_name
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "a b c"}], "max_tokens": 2}
KEY = "s3cret"


@contextmanager
def front(tmp_path, engine: CountingEngine | None = None, limits: Limits = Limits(), **settings):
    """(server, httpx client) of a daemon's HTTP front on a free port, built from DaemonSettings(**settings), over
    a Server on `engine` (a fresh CountingEngine by default) under `limits`."""
    with serving(f"ipc://{tmp_path}/s.sock", engine or CountingEngine(), limits) as server:
        with started(server.core.http_front(DaemonSettings(**{"http": "127.0.0.1:0", **settings}))) as client:
            yield server, client


def _error(response: httpx.Response, status: int, code: str) -> dict:
    error = response.json()["error"]
    assert (response.status_code, error["code"]) == (status, code), response.text
    return error


def test_a_loopback_front_answers_only_loopback_host_names(tmp_path):
    """DNS rebinding: a web page at evil.example resolving to 127.0.0.1 sends `Host: evil.example`."""
    with front(tmp_path, allowed_hosts=["fly.internal"]) as (_, client):
        port = client.base_url.port
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "", "[::2]"):
            error = _error(client.get("/v1/models", headers={"Host": host}), 421, "BAD_REQUEST")
            assert error["type"] == "invalid_request_error" and "Host" in error["message"]
        _error(client.post("/v1/chat/completions", json=CHAT, headers={"Host": "evil.example"}), 421, "BAD_REQUEST")
        for host in ("localhost", f"LOCALHOST:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "fly.internal:80"):
            assert client.get("/v1/models", headers={"Host": host}).status_code == 200, host
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_a_wildcard_allows_any_host_and_a_bad_entry_is_refused(tmp_path):
    with front(tmp_path, allowed_hosts=["*"]) as (_, client):
        assert client.get("/health", headers={"Host": "anything.example"}).status_code == 200
    with pytest.raises(ValueError, match="not a host name"):
        ServingCore(CountingEngine).http_front(DaemonSettings(http="127.0.0.1:0", allowed_hosts=["a b"]))


def test_docs_and_schema_need_the_key(tmp_path):
    with front(tmp_path, api_key=KEY) as (_, client):
        for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
            assert client.get(path).status_code in (401, 404), path
        _error(client.get("/openapi.json"), 401, "UNAUTHORIZED")
        schema = client.get("/openapi.json", headers={"Authorization": f"Bearer {KEY}"})
        assert schema.status_code == 200 and "/v1/chat/completions" in schema.json()["paths"]
    with front(tmp_path) as (_, client):  # no key: loopback only, the docs are open
        assert client.get("/docs").status_code == client.get("/openapi.json").status_code == 200


def test_unexpected_errors_answer_a_request_id_never_the_exception_text(tmp_path, monkeypatch, caplog):
    with front(tmp_path) as (server, client):
        async def broken() -> str:
            raise RuntimeError("the other client's prompt")

        monkeypatch.setattr(server.core.inproc, "loaded_model", broken)
        with caplog.at_level(logging.ERROR, logger="fly_daemon"):
            error = _error(client.post("/v1/chat/completions", json=CHAT), 500, "INTERNAL")
        assert error["type"] == "server_error" and "prompt" not in error["message"]
        request_id = error["message"].split("request id ")[1].split(")")[0]
        logged = [r for r in caplog.records if request_id in r.getMessage()]
        assert logged and "the other client's prompt" in logged[0].exc_text


def test_an_exception_mid_stream_ends_it_with_a_generic_error_event(tmp_path, monkeypatch, caplog):
    with front(tmp_path) as (server, client):
        replies = server.core.inproc.replies

        async def one_then_broken(request, **identity):
            stream = replies(request, **identity)
            yield await anext(stream)
            await stream.aclose()
            raise RuntimeError("the other client's answer")

        monkeypatch.setattr(server.core.inproc, "replies", one_then_broken)
        with caplog.at_level(logging.ERROR, logger="fly_daemon"):
            r = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert r.status_code == 200 and '"code":"INTERNAL"' in events[-1] and "answer" not in r.text
        assert any("the other client's answer" in (rec.exc_text or "") for rec in caplog.records)


def test_deeply_nested_tool_call_arguments_are_a_400(tmp_path):
    deep = "[" * 1200 + "]" * 1200
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                      "function": {"name": "f", "arguments": deep}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    with front(tmp_path) as (_, client):
        error = _error(client.post("/v1/chat/completions", json={**CHAT, "messages": messages}), 400, "BAD_REQUEST")
        assert error["type"] == "invalid_request_error" and error["param"].startswith("messages.1")
        assert "maximum recursion depth" not in error["message"]  # Python's RecursionError, once answered 500
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


@pytest.mark.parametrize("api_key, tenant", [
    (None, "local"),
    (KEY, "http-key:" + hashlib.sha256(KEY.encode()).hexdigest()[:16]),
])
def test_requests_carry_their_tenant_and_client(tmp_path, monkeypatch, api_key, tenant):
    with front(tmp_path, api_key=api_key) as (server, client):
        seen, replies = [], server.core.inproc.replies

        def spy(request, **identity):
            seen.append(identity)
            return replies(request, **identity)

        monkeypatch.setattr(server.core.inproc, "replies", spy)
        headers = {"Authorization": f"Bearer {KEY}"}
        assert client.post("/v1/chat/completions", json=CHAT, headers=headers).status_code == 200
        assert client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1, "stream": True},
                           headers=headers).status_code == 200
    assert [s["tenant"] for s in seen] == [tenant] * 2 and seen[0] == seen[1]  # httpx kept one connection open
    # without a key, a loopback client is its connection (fly_daemon.client_identity)
    assert re.fullmatch(rf"{tenant}@127\.0\.0\.1{'' if api_key else ':[0-9]+'}", seen[0]["client"]), seen


def test_no_forwarded_header_names_the_client_of_an_untrusted_peer(tmp_path, monkeypatch):
    """Without --trusted-proxies a client's own X-Forwarded-For / Forwarded lines change nothing: the client is
    the key's holders at the peer's address. (uvicorn's proxy-header handling, on by default for 127.0.0.1,
    once rewrote the peer from X-Forwarded-For, so any local process could pass as any address it made up,
    each with caps of its own.)"""
    with front(tmp_path, api_key=KEY) as (server, client):
        seen, replies = [], server.core.inproc.replies

        def spy(request, **identity):
            seen.append(identity["client"])
            return replies(request, **identity)

        monkeypatch.setattr(server.core.inproc, "replies", spy)
        tenant = "http-key:" + hashlib.sha256(KEY.encode()).hexdigest()[:16]

        @hypothesis.settings(max_examples=30, deadline=None, derandomize=True, database=None)
        @hypothesis.given(lines=forwarded_headers(min_lines=1))
        def spoofed(lines):
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1},
                            headers=[("Authorization", f"Bearer {KEY}"), *lines])
            assert r.status_code == 200, r.text
            assert seen[-1] == f"{tenant}@127.0.0.1", lines

        spoofed()


@pytest.mark.parametrize("settings, forwarded, statuses", [
    ({"api_key": KEY, "trusted_proxies": "127.0.0.1"}, ("203.0.113.1", "203.0.113.2"), (200, 503)),
    ({"api_key": KEY}, ("203.0.113.1", "203.0.113.2"), (503, 503)),
    ({}, (None, None), (200, 200)),
], ids=["trusted proxy", "untrusted peer", "loopback without a key"])
def test_each_client_has_its_own_request_cap(tmp_path, settings, forwarded, statuses):
    """max_requests_per_client = 1 and one client's stream running; then a request of another client and one of
    the same client, on another connection than the stream's. Behind a trusted proxy, another forwarded address
    is another client; an untrusted peer's forwarded addresses change nothing (all one client, the key's
    holders at 127.0.0.1); without a key, each loopback connection is a client."""
    first, second = forwarded
    auth = {"Authorization": f"Bearer {KEY}"} if settings.get("api_key") else {}

    def headers(address: str | None) -> dict[str, str]:  # the proxy appends `address`; the rest the client wrote
        return auth | ({"X-Forwarded-For": f"198.51.100.77, {address}"} if address else {})

    body = {"model": MODEL, "prompt": "a", "max_tokens": 1}
    with front(tmp_path, CountingEngine(step_s=0.01), Limits(max_requests_per_client=1), **settings) as (_, client):
        with client.stream("POST", "/v1/completions", json=body | {"max_tokens": 4000, "stream": True},
                           headers=headers(first)) as held:
            lines = held.iter_lines()  # kept: a dropped iterator closes the stream (and cancels its request)
            assert next(line for line in lines if line.startswith("data: "))  # it runs
            other = client.post("/v1/completions", json=body, headers=headers(second))  # the stream holds its own
            same = client.post("/v1/completions", json=body, headers=headers(first))
    assert (other.status_code, same.status_code) == statuses, (other.text, same.text)
    for refused in (r for r in (other, same) if r.status_code == 503):
        assert _error(refused, 503, "BUSY")["message"].startswith("this client already has 1 requests")


def test_an_empty_key_is_no_key(monkeypatch):
    for blank in ("", "  ", "\n"):
        monkeypatch.setenv("FLY_API_KEY", blank)
        assert load_settings(DaemonSettings).api_key is None
        assert load_settings(DaemonSettings, cli={"api_key": blank}).api_key is None
    monkeypatch.setenv("FLY_API_KEY", " k \n")
    assert load_settings(DaemonSettings).api_key.get_secret_value() == "k"
    monkeypatch.setenv("FLY_ALLOWED_HOSTS", "a.example, b.example")
    assert load_settings(DaemonSettings).allowed_hosts == ["a.example", "b.example"]
    assert load_settings(DaemonSettings, cli={"allowed_hosts": ["c"]}).allowed_hosts == ["c"]
    with pytest.raises(ValueError, match="without an API key"):
        ServingCore(CountingEngine).http_front(DaemonSettings(http="0.0.0.0:0", api_key=" "))


def test_beyond_loopback_the_key_guards_any_host_unless_hosts_are_listed(tmp_path):
    with front(tmp_path, http="0.0.0.0:0", api_key=KEY) as (_, client):
        assert client.get("/health", headers={"Host": "fly.example"}).status_code == 200
        _error(client.get("/v1/models", headers={"Host": "fly.example"}), 401, "UNAUTHORIZED")
    with front(tmp_path, http="0.0.0.0:0", api_key=KEY, allowed_hosts=["fly.example"]) as (_, client):
        assert client.get("/health", headers={"Host": "fly.example"}).status_code == 200
        _error(client.get("/health", headers={"Host": "other.example"}), 421, "BAD_REQUEST")
