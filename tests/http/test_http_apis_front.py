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
                            ({**RESPONSE, "tools": [{"type": "web_search"}],  # a hosted tool: served, not called
                              "tool_choice": {"type": "function", "name": "web_search"}}, "tool_choice"),
                            ({**RESPONSE, "bogus": 1}, "bogus")]:
            r = client.post("/v1/responses", json=body)
            error = r.json()["error"]
            assert (r.status_code, error["code"], error["type"]) == (400, "BAD_REQUEST", "invalid_request_error")
            assert words in error["message"], (words, error["message"])
        assert client.post("/v1/responses", json={**RESPONSE, "model": "gpt-5"}).status_code == 200  # any name
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
        assert client.post("/v1/messages", json={**MESSAGE, "model": "claude-x"}).status_code == 200  # any name
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


class RecordingEngine(CountingEngine):
    """The counting engine, keeping the max_tokens each request was added with."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[int] = []

    def add_request(self, request_id, prompt_ids, sampling, *args, **kwargs) -> None:
        self.asked.append(sampling.max_tokens)
        super().add_request(request_id, prompt_ids, sampling, *args, **kwargs)


# Claude Code's first request, in the fields issue 64 lists (`claude -p "say hi"` against a local server): a system
# turn after the first user turn, adaptive thinking, an effort, context management, 32,000 tokens asked for (its
# tools' 18,780-character descriptions: tests/client/test_tool_specs.py; this double's context holds 64 tokens).
CLAUDE_CODE_FIRST = {
    "model": MODEL, "max_tokens": 32000, "stream": True, "metadata": {"user_id": "user_abc"},
    "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
    "messages": [{"role": "user", "content": [{"type": "text", "text": "say hi"}]},
                 {"role": "system", "content": "reminder: be brief"},
                 {"role": "user", "content": "now"}],
    "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "tools": [{"name": "Bash", "description": "Runs a command.", "input_schema": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}],
}


def test_claude_codes_first_request_is_served_its_length_capped_at_the_daemons_limit(tmp_path):
    engine = RecordingEngine()
    with double_front(tmp_path, engine) as (server, client):
        limit = server.core.inproc.limits.max_tokens_limit
        with client.stream("POST", "/v1/messages?beta=true", json=CLAUDE_CODE_FIRST,
                           headers={"anthropic-beta": "claude-code-20250219"}) as r:
            assert r.status_code == 200, r.read()
            events = named_events(r)
        assert events[0][0] == "message_start" and events[-1][0] == "message_stop"
        assert engine.asked == [limit]
        for thinking, words in (({"type": "enabled", "budget_tokens": 1024}, "thinking"),):
            body = {**CLAUDE_CODE_FIRST, "stream": False, "thinking": thinking}
            assert words in client.post("/v1/messages", json=body).json()["error"]["message"]
        tool_in_system = {**CLAUDE_CODE_FIRST, "stream": False, "messages": [
            {"role": "system", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "y"}]},
            {"role": "user", "content": "hi"}]}
        refused = client.post("/v1/messages", json=tool_in_system)
        assert refused.status_code == 400 and "system turn carries text blocks only" in refused.text
        for role, block in (("user", {"type": "tool_use", "id": "t", "name": "Bash", "input": {}}),
                            ("assistant", {"type": "tool_result", "tool_use_id": "t", "content": "y"})):
            misplaced = {"model": MODEL, "max_tokens": 3, "messages": [{"role": role, "content": [block]},
                                                                      {"role": "user", "content": "hi"}]}
            for path in ("/v1/messages", "/v1/messages/count_tokens"):  # a client's mistake: 400, not 500
                r = client.post(path, json=misplaced)
                assert r.status_code == 400 and f"{role} turn cannot carry" in r.text, (path, r.text)


def test_a_responses_request_without_max_output_tokens_runs_to_the_limit_and_one_above_it_is_capped(tmp_path):
    engine = RecordingEngine()
    with double_front(tmp_path, engine) as (server, client):
        limit = server.core.inproc.limits.max_tokens_limit
        for asked in (None, 10, limit + 1000):
            body = {k: v for k, v in RESPONSE.items() if k != "max_output_tokens"}
            r = client.post("/v1/responses", json=body if asked is None else {**body, "max_output_tokens": asked})
            assert r.status_code == 200, r.text
        assert engine.asked == [limit, 10, limit]
