"""Tools and structured output through the daemon (tiny random-weight pair: only the grammar makes output valid).

Every result validates; streams carry whole tool calls; tool results round-trip through the chat
template; every bad input is answered with its code while a concurrent stream keeps being served.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from pathlib import Path

import jsonschema
import pytest

from fly_llm.client import FLyClient, GenerateResult, SamplingParams, TokenChunk
from fly_llm.common.errors import BadRequest

ADD = {"type": "function", "function": {"name": "add", "description": "Add two small numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a", "b"], "additionalProperties": False}}}
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"key": {"enum": ["fox", "dog"]}}, "required": ["key"],
    "additionalProperties": False}}}
TOOLS = [ADD, LOOKUP]
ANSWER = {"type": "object", "properties": {"reasoning": {"type": "string", "maxLength": 20},
                                           "answer": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["reasoning", "answer"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def client(tiny_daemon):
    with FLyClient(tiny_daemon, timeout=120) as c:
        yield c


def _valid_call(call) -> None:
    spec = next(t["function"] for t in TOOLS if t["function"]["name"] == call.name)
    jsonschema.validate(call.arguments, spec["parameters"])


def test_response_format_json_schema_validates(client):
    results = client.batch([ASK, [{"role": "user", "content": "Name a fox."}]], SamplingParams(max_tokens=120),
                           response_format={"type": "json_schema", "schema": ANSWER})
    for result in results:
        assert result.finish_reason == "stop", result.text
        jsonschema.validate(json.loads(result.text), ANSWER)
        assert result.stats.forced > 0  # keys and separators are forced: drafted for free


def test_json_object_and_regex_formats(client):
    obj = client.generate("x", SamplingParams(max_tokens=60), response_format={"type": "json_object"})
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:  # the random model may run out of tokens inside the object: partial text, never claimed valid
        assert obj.finish_reason == "length" and obj.text.startswith("{")
    regex = client.generate("x", SamplingParams(max_tokens=30), response_format={"type": "regex", "pattern": "(yes|no)!"})
    assert regex.text in ("yes!", "no!") and regex.finish_reason == "stop"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "lookup"}}])
def test_forced_tool_choice_yields_valid_calls(client, choice):
    result = client.chat(ASK, SamplingParams(max_tokens=80), tools=TOOLS, tool_choice=choice)
    assert result.finish_reason == "tool_calls" and result.tool_calls, result
    assert result.text == ""
    for call in result.tool_calls:
        _valid_call(call)
        assert choice == "required" or call.name == "lookup"


def test_streamed_tool_calls_arrive_whole_and_match_the_result(client):
    chunks = list(client.stream(messages=ASK, sampling=SamplingParams(max_tokens=80), tools=TOOLS,
                                tool_choice="required"))
    result = chunks[-1]
    assert isinstance(result, GenerateResult)
    streamed = [c for chunk in chunks[:-1] if isinstance(chunk, TokenChunk) for c in chunk.tool_calls]
    assert streamed == result.tool_calls and streamed
    assert "<tool_call>" not in "".join(c.text for c in chunks[:-1] if isinstance(c, TokenChunk))


def test_tool_results_round_trip_through_the_chat_template(client):
    first = client.chat(ASK, SamplingParams(max_tokens=80), tools=TOOLS, tool_choice="required")
    call = first.tool_calls[0]
    turn = [*ASK, {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
            {"role": "tool", "content": "5", "tool_call_id": call.id}]
    plain = client.tokenize(messages=turn)
    assert plain.count > client.tokenize(messages=ASK).count
    second = client.chat(turn, SamplingParams(max_tokens=8), tools=TOOLS, tool_choice="none")
    assert not second.tool_calls and "<tool_call>" not in second.text


def test_auto_choice_parses_calls_it_makes(client):
    for prompt in ["Add 2 and 3.", "def add(a, b):", "Look up the fox."]:
        result = client.chat([{"role": "user", "content": prompt}], SamplingParams(max_tokens=60), tools=TOOLS)
        for call in result.tool_calls:
            _valid_call(call)
        assert (result.finish_reason == "tool_calls") == bool(result.tool_calls) or result.finish_reason == "length"


def test_a_grammar_it_cannot_finish_ends_with_length(client):
    result = client.chat(ASK, SamplingParams(max_tokens=3), response_format={"type": "json_schema", "schema": ANSWER})
    assert result.finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(result.text)


BAD = [
    ("unsupported schema", dict(response_format={"type": "json_schema", "schema": {"type": "frobnicate"}}), "grammar"),
    ("regex that does not compile", dict(response_format={"type": "regex", "pattern": "(unclosed"}), "grammar"),
    ("unknown tool choice", dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "nope"),
    ("duplicate tool names", dict(tools=[ADD, ADD]), "duplicate"),
    ("a tool whose schema does not compile", dict(tools=[ADD, {"type": "function", "function": {  # forced: under
        "name": "negate", "parameters": {"type": "object", "properties": {"x": {"not": {}}}}}}],  # auto it is loosened
        tool_choice="required"), "tool 'negate'"),
    ("tools and a response format", dict(tools=TOOLS, tool_choice="required",
                                         response_format={"type": "json_object"}), "either"),
]


@pytest.mark.parametrize("name, options, words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_bad_request_while_others_are_served(client, name, options, words):
    done = {}

    def stream_alongside():
        done["result"] = list(client.stream("def add(a, b):", sampling=SamplingParams(max_tokens=24)))[-1]

    worker = threading.Thread(target=stream_alongside)
    worker.start()
    with pytest.raises(BadRequest) as err:
        client.chat(ASK, SamplingParams(max_tokens=8), **options)
    worker.join(60)
    assert words in str(err.value).lower(), err.value
    assert done["result"].usage.completion_tokens == 24


def test_tool_result_for_an_unknown_call_is_a_bad_request(client):
    with pytest.raises(BadRequest, match="unknown call"):
        client.chat([*ASK, {"role": "tool", "content": "5", "tool_call_id": "call_nobody"}], tools=TOOLS)


def _sandbox_workers(daemon_pid: int) -> list[int]:
    """The daemon's grammar-sandbox worker processes (its children running fly_llm.decoding.grammar_sandbox)."""
    workers = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == daemon_pid and b"fly_llm.decoding.grammar_sandbox" in cmdline:
            workers.append(int(entry.name))
    return workers


POOL = 2
"""The daemon's sandbox processes (`grammar_workers`' default)."""


def _started_pool(endpoint: str, daemon_pid: int) -> list[int]:
    """The pool's worker pids once all POOL have started: workers start on demand, so two clients send new
    schemas at once until every worker has judged one (which ones ran before depends on the tests before)."""
    for attempt in range(20):
        workers = _sandbox_workers(daemon_pid)
        if len(workers) == POOL:
            return workers
        schemas = [{"type": "object", "properties": {f"warm_{attempt}_{i}": {"type": "integer"}}} for i in range(POOL)]

        def send(schema: dict) -> None:
            with FLyClient(endpoint) as own:
                own.generate("x", SamplingParams(max_tokens=2), response_format={"type": "json_schema", "schema": schema})

        threads = [threading.Thread(target=send, args=(schema,)) for schema in schemas]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    raise AssertionError(f"the sandbox pool never had {POOL} workers: {_sandbox_workers(daemon_pid)}")


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the sandbox worker in /proc")
def test_a_stopped_sandbox_worker_is_replaced_and_the_schema_accepted(tiny_daemon, client):
    """Issue 45 finding 5: a SIGSTOPped worker made a valid schema's timeout its cached verdict, refused for
    every tenant from then on. Now the worker is replaced and the schema tried again: served, then and later.
    Every worker of the sandbox's pool (`grammar_workers`) is stopped, so the one the schema goes to is."""
    daemon_pid = int(Path(tiny_daemon.removeprefix("ipc://") + ".pid").read_text().split()[0])
    workers = _started_pool(tiny_daemon, daemon_pid)
    schema = {"type": "object", "properties": {"stopped_worker": {"type": "boolean"}}, "required": ["stopped_worker"],
              "additionalProperties": False}  # a schema no other test sends: its verdict is not cached yet
    for worker in workers:
        os.kill(worker, signal.SIGSTOP)
    try:
        for _ in range(2):
            result = client.generate("x", SamplingParams(max_tokens=40),
                                     response_format={"type": "json_schema", "schema": schema})
            if result.finish_reason == "stop":
                jsonschema.validate(json.loads(result.text), schema)
        assert set(workers) - set(_sandbox_workers(daemon_pid))  # the stopped one it went to was killed, replaced
    finally:
        for worker in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGCONT)
