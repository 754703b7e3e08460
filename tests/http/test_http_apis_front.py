"""/v1/responses and /v1/messages in-process, on the engine double (one token "n " per step, no chat template,
no grammar): the exact event sequences, Anthropic's error shape, `x-api-key`, the stateless refusals, a failure
mid-stream and a client that leaves. The official SDKs against a tiny daemon: test_http_responses.py,
test_http_messages.py."""

from __future__ import annotations

import json
import time

import httpx

from support.engine_double import CountingEngine
from support.http_double import double_front

MODEL = CountingEngine.target_name
RESPONSE = {"model": MODEL, "input": "a b c", "max_output_tokens": 3}
MESSAGE = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "a b c"}]}


def named_events(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            events.append((name, json.loads(line.removeprefix("data: "))))
    return events


def test_responses_whole_and_streamed(tmp_path):
    with double_front(tmp_path) as (_, client):
        whole = client.post("/v1/responses", json=RESPONSE).json()
        assert whole["object"] == "response" and whole["id"].startswith("resp_") and whole["status"] == "incomplete"
        assert whole["incomplete_details"] == {"reason": "max_output_tokens"} and whole["store"] is False
        [item] = whole["output"]
        assert item["type"] == "message" and item["content"][0]["text"] == "1 2 3 "
        assert whole["usage"]["input_tokens"] == 3 and whole["usage"]["output_tokens"] == 3
        with client.stream("POST", "/v1/responses", json={**RESPONSE, "stream": True}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = named_events(r)
        assert [name for name, _ in events] == [
            "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
            *["response.output_text.delta"] * 3, "response.output_text.done", "response.content_part.done",
            "response.output_item.done", "response.incomplete"]
        assert all(name == data["type"] for name, data in events)
        assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
        assert "".join(d["delta"] for n, d in events if n == "response.output_text.delta") == "1 2 3 "
        final = events[-1][1]["response"]
        assert final["output"][0]["id"] == events[2][1]["item"]["id"] and final["usage"]["output_tokens"] == 3


def test_messages_whole_and_streamed(tmp_path):
    with double_front(tmp_path) as (_, client):
        whole = client.post("/v1/messages", json=MESSAGE).json()
        assert whole["type"] == "message" and whole["id"].startswith("msg_") and whole["role"] == "assistant"
        assert whole["content"] == [{"type": "text", "text": "1 2 3 "}] and whole["stop_reason"] == "max_tokens"
        assert whole["usage"] == {"input_tokens": 3, "output_tokens": 3, "cache_read_input_tokens": 0,
                                  "cache_creation_input_tokens": 0}
        with client.stream("POST", "/v1/messages", json={**MESSAGE, "stream": True}) as r:
            events = named_events(r)
        assert [name for name, _ in events] == ["message_start", "content_block_start", *["content_block_delta"] * 3,
                                                "content_block_stop", "message_delta", "message_stop"]
        assert [d["delta"]["text"] for n, d in events if n == "content_block_delta"] == ["1 ", "2 ", "3 "]
        assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
        assert events[-2][1]["usage"]["output_tokens"] == 3 and events[0][1]["message"]["content"] == []
        count = client.post("/v1/messages/count_tokens", json={k: v for k, v in MESSAGE.items() if k != "max_tokens"})
        assert count.json() == {"input_tokens": 3}


def test_refusals_name_the_field_in_each_api_shape(tmp_path):
    with double_front(tmp_path) as (_, client):
        for body, words in [({**RESPONSE, "store": True}, "store: true is not supported"),
                            ({**RESPONSE, "previous_response_id": "resp_1"}, "previous_response_id is not supported"),
                            ({**RESPONSE, "conversation": "conv_1"}, "conversation is not supported"),
                            ({**RESPONSE, "input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
                            ({**RESPONSE, "tools": [{"type": "web_search"}]}, "tools.0"),
                            ({**RESPONSE, "bogus": 1}, "bogus")]:
            r = client.post("/v1/responses", json=body)
            error = r.json()["error"]
            assert (r.status_code, error["code"], error["type"]) == (400, "BAD_REQUEST", "invalid_request_error")
            assert words in error["message"], (words, error["message"])
        assert client.post("/v1/responses", json={**RESPONSE, "model": "gpt-5"}).status_code == 404
        for body, words in [({k: v for k, v in MESSAGE.items() if k != "max_tokens"}, "max_tokens"),
                            ({**MESSAGE, "top_k": -1}, "top_k"),
                            ({**MESSAGE, "messages": [{"role": "assistant", "content": "Sure"}]}, "prefill"),
                            ({**MESSAGE, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
                            ({**MESSAGE, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, "image")]:
            r = client.post("/v1/messages", json=body)
            assert r.status_code == 400 and r.json()["type"] == "error", r.text
            error = r.json()["error"]
            assert (error["type"], error["code"]) == ("invalid_request_error", "BAD_REQUEST")
            assert words in error["message"], (words, error["message"])
        unknown = client.post("/v1/messages", json={**MESSAGE, "model": "claude-x"})
        assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
        broken = client.post("/v1/messages", content=b"{", headers={"content-type": "application/json"})
        assert broken.status_code == 400 and broken.json()["error"]["type"] == "invalid_request_error"
        assert client.post("/v1/messages/nothing", json={}).json()["error"]["type"] == "not_found_error"
        chat = client.post("/v1/chat/completions", json={**MESSAGE, "system": "x"}).json()  # OpenAI's shape there
        assert chat["error"]["code"] == "BAD_REQUEST" and chat["error"]["param"] == "system"


def test_api_key_as_bearer_or_x_api_key(tmp_path):
    with double_front(tmp_path, api_key="s3cret") as (_, client):
        for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
            r = client.post("/v1/messages", json=MESSAGE, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert r.json()["error"]["code"] == "UNAUTHORIZED"
            refused = client.post("/v1/responses", json=RESPONSE, headers=headers).json()
            assert refused["error"]["code"] == "UNAUTHORIZED"
        for headers in ({"x-api-key": "s3cret"}, {"Authorization": "Bearer s3cret"}):
            assert client.post("/v1/messages", json=MESSAGE, headers=headers).status_code == 200
            assert client.post("/v1/responses", json=RESPONSE, headers=headers).status_code == 200
            assert client.get("/v1/models", headers=headers).status_code == 200


def test_a_failure_mid_stream_is_an_error_event(tmp_path):
    engine = CountingEngine(step_s=0.05)
    with double_front(tmp_path, engine) as (_, client):
        for path, body in (("/v1/responses", {**RESPONSE, "max_output_tokens": 50}),
                           ("/v1/messages", {**MESSAGE, "max_tokens": 50})):
            with client.stream("POST", path, json={**body, "stream": True}) as r:
                engine.fail_next_step = True  # the first reply came before the answer began
                events = named_events(r)
            last = events[-1][1]
            if path == "/v1/responses":
                assert events[-2][1]["type"] == "error" and events[-2][1]["code"] == "INTERNAL"
                assert last["type"] == "response.failed" and last["response"]["error"]["code"] == "INTERNAL"
            else:
                assert last == {"type": "error", "error": {"type": "api_error", "message": last["error"]["message"],
                                                           "code": "INTERNAL"}}
                assert "boom" not in last["error"]["message"]
        assert client.post("/v1/messages", json=MESSAGE).status_code == 200  # and the front goes on


def test_a_client_that_leaves_mid_stream_cancels_its_request(tmp_path):
    with double_front(tmp_path, CountingEngine(step_s=0.05)) as (server, client):
        def cancelled() -> float:
            return server.scheduler.metrics.registry.get_sample_value(
                "fly_requests_total", {"outcome": "CANCELLED"}) or 0.0

        for n, (path, body) in enumerate((("/v1/responses", {**RESPONSE, "max_output_tokens": 50}),
                                          ("/v1/messages", {**MESSAGE, "max_tokens": 50})), 1):
            with client.stream("POST", path, json={**body, "stream": True}) as r:
                next(r.iter_lines())
            deadline = time.monotonic() + 10
            while cancelled() < n and time.monotonic() < deadline:
                time.sleep(0.02)
            assert cancelled() == n
