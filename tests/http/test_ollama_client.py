"""The official `ollama` Python client (sync, async, streaming, tools, format) against a tiny daemon's /api routes.

The daemon is a subprocess serving the tiny pair on its ipc socket and on http://127.0.0.1:PORT, so the
same request can be compared across the doors: exact mode must give the same tokens either way.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import pytest

from support.daemon_process import free_port, start_daemon
from fly_llm.client import FLyClient, build_options

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
EXACT = {"loose": False, "temperature": 0}
LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "Look up what an animal is like.",
                                           "parameters": {"type": "object", "required": ["key"],
                                                          "properties": {"key": {"type": "string",
                                                                                 "enum": ["fox", "dog"]}}}}}
"""A tool whose arguments a random model can finish (the ollama client keeps only type, enum, items, description)."""
PICK = {"type": "object", "properties": {"animal": {"enum": ["fox", "dog"]}, "n": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 99}},
        "required": ["animal", "n"]}


@pytest.fixture(scope="module")
def ollama_daemon(tiny_pair_dirs, tmp_path_factory):
    """(ipc endpoint, base URL of the HTTP front) of a daemon serving the tiny pair in float32."""
    port = free_port()
    daemon = start_daemon(*tiny_pair_dirs, tmp_path_factory.mktemp("ollama_daemon"), "o", "--http",
                          f"127.0.0.1:{port}")
    yield daemon.endpoint, f"http://127.0.0.1:{port}"
    assert daemon.stop() == 0
    assert "Traceback" not in daemon.output()


@pytest.fixture(scope="module")
def client(ollama_daemon):
    return ollama.Client(host=ollama_daemon[1], timeout=60)


@pytest.fixture(scope="module")
def zmq_client(ollama_daemon):
    with FLyClient(ollama_daemon[0], timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(client, tiny_pair_dirs) -> str:
    models = client.list().models
    assert [m.model for m in models] == [tiny_pair_dirs[0].name, "all-MiniLM-L6-v2"]  # ids, not paths; the embedder unloaded
    return models[0].model


def test_chat_equals_the_zeromq_answer(client, zmq_client, model, ollama_daemon):
    answer = client.chat(model=model, messages=MESSAGES, options={"num_predict": 24, **EXACT}, stream=False)
    same = zmq_client.chat(MESSAGES, *build_options(max_tokens=24, loose=False))
    assert (answer.message.role, answer.message.content) == ("assistant", same.text)
    assert answer.done and answer.done_reason == ("length" if same.finish_reason == "length" else "stop")
    assert (answer.prompt_eval_count, answer.eval_count) == (same.usage.prompt_tokens, same.usage.completion_tokens)
    assert answer.total_duration >= answer.prompt_eval_duration + answer.eval_duration > 0
    body = {"model": model, "messages": MESSAGES, "stream": False, "options": {"num_predict": 24, **EXACT}}
    raw = httpx.post(f"{ollama_daemon[1]}/api/chat", json=body, timeout=60).json()
    assert answer.load_duration == 0 and raw["fly_stats"]["emitted"] == same.usage.completion_tokens


def test_streamed_chat_concatenates_to_the_whole_answer(client, model):
    whole = client.chat(model=model, messages=MESSAGES, options={"num_predict": 20, **EXACT}, stream=False)
    parts = list(client.chat(model=model, messages=MESSAGES, options={"num_predict": 20, **EXACT}, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].message.content == ""
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count and parts[-1].done_reason == whole.done_reason


def test_generate_renders_the_chat_template_unless_raw(client, zmq_client, model):
    templated = client.generate(model=model, prompt="What is 2 + 3?", system="Be brief.",
                                options={"num_predict": 16, **EXACT})
    assert templated.response == zmq_client.chat(MESSAGES, *build_options(max_tokens=16, loose=False)).text
    raw = client.generate(model=model, prompt="def add(a, b):", raw=True, options={"num_predict": 16, **EXACT})
    same = zmq_client.generate("def add(a, b):", *build_options(max_tokens=16, loose=False))
    assert raw.response == same.text and raw.prompt_eval_count == same.usage.prompt_tokens
    streamed = client.generate(model=model, prompt="def add(a, b):", raw=True, stream=True,
                               options={"num_predict": 16, **EXACT})
    assert "".join(p.response for p in streamed) == same.text


def test_stop_seed_and_fly_options(client, model):
    plain = client.generate(model=model, prompt="The quick brown fox", raw=True, options={"num_predict": 24, **EXACT})
    stop = next(plain.response[i:i + 2] for i in range(3, 20) if plain.response[i:i + 2].strip())
    cut = client.generate(model=model, prompt="The quick brown fox", raw=True,
                          options={"num_predict": 24, "stop": [stop], "k": 3, "window": 2, **EXACT})
    assert cut.response == plain.response.split(stop)[0] and cut.done_reason == "stop"
    sampled = [client.generate(model=model, prompt="The quick brown fox", raw=True,
                               options={"num_predict": 12, "temperature": 0.9, "top_p": 0.9, "seed": 7}).response
               for _ in range(2)]
    assert sampled[0] == sampled[1]


async def test_async_client_chat_and_stream(ollama_daemon, model):
    client = ollama.AsyncClient(host=ollama_daemon[1], timeout=60)
    whole = await client.chat(model=model, messages=MESSAGES, options={"num_predict": 12, **EXACT})
    parts = [p async for p in await client.chat(model=model, messages=MESSAGES, stream=True,
                                                options={"num_predict": 12, **EXACT})]
    assert "".join(p.message.content for p in parts) == whole.message.content and parts[-1].done


def test_format_json_and_schema(client, model):
    answer = client.chat(model=model, messages=[{"role": "user", "content": "JSON please"}], format="json",
                         options={"num_predict": 8, **EXACT}, stream=False)
    assert answer.message.content.startswith("{")  # a random model's object goes on past any short limit
    picked = client.chat(model=model, messages=[{"role": "user", "content": "Pick"}], format=PICK,
                         options={"num_predict": 200, **EXACT}, stream=False)
    jsonschema.validate(json.loads(picked.message.content), PICK)
    generated = client.generate(model=model, prompt="Pick", format=PICK, options={"num_predict": 200, **EXACT})
    jsonschema.validate(json.loads(generated.response), PICK)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_in_ollamas_shape_and_results_back_in(client, model, stream):
    """A tiny random model cannot choose to call: options.tool_choice (FLy's extension) forces the call."""
    ask = [{"role": "user", "content": "What is the fox like?"}]
    options = {"num_predict": 200, "tool_choice": "required", "parallel_tool_calls": False, **EXACT}
    if stream:
        parts = list(client.chat(model=model, messages=ask, tools=[LOOKUP], options=options, stream=True))
        calls = [c for p in parts for c in p.message.tool_calls or ()]
    else:
        calls = client.chat(model=model, messages=ask, tools=[LOOKUP], options=options, stream=False).message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "lookup"
    assert dict(calls[0].function.arguments) in ({"key": "fox"}, {"key": "dog"})
    history = [*ask, {"role": "assistant", "content": "", "tool_calls": [c.model_dump(exclude_none=True) for c in calls]},
               {"role": "tool", "content": "quick", "tool_name": "lookup"}]
    answer = client.chat(model=model, messages=history, tools=[LOOKUP], options={"num_predict": 8, **EXACT},
                         stream=False)
    assert answer.done and answer.message.role == "assistant"


def test_named_tool_over_raw_http_carries_ids_and_indexes(ollama_daemon, model):
    body = {"model": model, "messages": [{"role": "user", "content": "Fox?"}], "tools": [LOOKUP], "stream": False,
            "options": {"num_predict": 200, "tool_choice": {"type": "function", "function": {"name": "lookup"}}, **EXACT}}
    message = httpx.post(f"{ollama_daemon[1]}/api/chat", json=body, timeout=60).json()["message"]
    call = message["tool_calls"][0]
    assert call["id"] and call["function"]["index"] == 0 and isinstance(call["function"]["arguments"], dict)
    again = {**body, "messages": [*body["messages"], {**message, "content": ""},
                                  {"role": "tool", "content": "quick", "tool_call_id": call["id"]}],
             "options": {"num_predict": 4, **EXACT}}
    assert httpx.post(f"{ollama_daemon[1]}/api/chat", json=again, timeout=60).json()["done"]


def test_model_cards(client, model, tiny_pair_dirs):
    shown = client.show(model)
    assert shown.modelinfo["llama.context_length"] == 512 and shown.details.family == "llama"
    assert shown.capabilities == ["completion", "tools"] and shown.template
    running = client.ps().models
    assert [m.model for m in running] == [model] and running[0].context_length == 512 and running[0].size > 0
    assert client.show(f"{model}:latest").details.format == "safetensors"


def test_load_request_answers_at_once(client, model):
    loaded = client.chat(model=model, messages=[], keep_alive="5m")
    assert loaded.done and loaded.done_reason == "load" and loaded.message.content == ""
    assert client.generate(model=model, prompt="").done_reason == "load"


@pytest.mark.parametrize("call, status, says", [
    (lambda c, m: c.chat(model="llama3.2", messages=MESSAGES), 404, "not found"),
    (lambda c, m: c.chat(model=m, messages=MESSAGES, options={"num_ctx": 4096}), 400, "context window of 512"),
    (lambda c, m: c.chat(model=m, messages=MESSAGES, options={"mirostat": 2}), 400, "mirostat"),
    (lambda c, m: c.chat(model=m, messages=MESSAGES, options={"typical_p": True}), 400, "typical_p"),  # not 1.0
    (lambda c, m: c.chat(model=m, messages=MESSAGES, options={"lose": False}), 400, "unknown option 'lose'"),
    (lambda c, m: c.chat(model=m, messages=MESSAGES, options={"num_predict": 10**7}), 400, "max_tokens"),
    (lambda c, m: c.chat(model=m, messages=MESSAGES, think=True), 400, "does not think"),
    (lambda c, m: c.generate(model=m, prompt="x", suffix="y"), 400, "fill-in-the-middle"),
    (lambda c, m: c.chat(model=m, messages=[{"role": "user", "content": "x", "images": ["aGk="]}]), 400, "text only"),
    (lambda c, m: c.chat(model=m, messages=MESSAGES, format={"type": "object", "properties": {"a": {"$ref": "#/x"}}}),
     400, ""),
    (lambda c, m: c.pull(m), 400, "loaded from local files"),
    (lambda c, m: c.delete(m), 400, "loaded from local files"),
])
def test_bad_requests_get_ollamas_error_shape(client, model, call, status, says):
    with pytest.raises(ollama.ResponseError) as caught:
        call(client, model)
    assert caught.value.status_code == status and says in caught.value.error


def test_options_kept_and_ignored(client, model):
    """Load-time options and samplers set to off are accepted; keep_alive too."""
    answer = client.chat(model=model, messages=MESSAGES, keep_alive=0, stream=False, options={
        "num_predict": 4, "num_ctx": 512, "num_gpu": 1, "num_thread": 2, "typical_p": 1.0, "mirostat": 0,
        "mirostat_tau": 5.0, **EXACT})
    assert answer.eval_count == 4


def test_error_body_carries_the_stable_code(ollama_daemon, model):
    answer = httpx.post(f"{ollama_daemon[1]}/api/chat", content=b"{not json", timeout=10)
    assert answer.status_code == 400 and answer.json()["code"] == "BAD_REQUEST" and "JSON" in answer.json()["error"]
    answer = httpx.post(f"{ollama_daemon[1]}/api/chat", json={"model": model, "messages": [
        {"role": "user", "content": "x " * 2000}]}, timeout=10)  # over the 512-token window
    assert answer.status_code == 400 and answer.json()["code"] == "TOO_LONG"
    capped = httpx.post(f"{ollama_daemon[1]}/api/chat", json={"model": model, "messages": MESSAGES, "stream": False,
                                                              "options": {"num_predict": 5000}}, timeout=60)
    assert capped.status_code == 200 and capped.json()["eval_count"] < 512  # over the limit: capped, as Ollama does
    missing = httpx.get(f"{ollama_daemon[1]}/api/nothing", timeout=10)
    assert missing.status_code == 404 and set(missing.json()) == {"error", "code"}
    assert httpx.get(f"{ollama_daemon[1]}/api/version", timeout=10).json()["version"]
