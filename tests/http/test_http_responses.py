"""POST /v1/responses with the official clients, unchanged, against a tiny daemon's HTTP front: the openai SDK's
`responses.create` / `responses.stream` / `responses.parse` and LangChain's `ChatOpenAI(use_responses_api=True)`,
a tool call round trip with each. The route is the chat route translated, so in exact mode its answers equal
/v1/chat/completions' for the same conversation, token for token.
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel

from support.daemon_process import serving_http

SYSTEM, QUESTION = "Be brief.", "What is 2 + 3?"
EXACT = {"loose": False}
LOOKUP = {"type": "object", "properties": {"key": {"enum": ["fox", "dog"]}}, "required": ["key"],
          "additionalProperties": False}
TOOLS = [{"type": "function", "name": "lookup", "description": "Look an animal up.", "parameters": LOOKUP}]


class Verdict(BaseModel):
    ok: bool


@pytest.fixture(scope="module")
def base_url(tiny_pair_dirs, tmp_path_factory):
    with serving_http(*tiny_pair_dirs, tmp_path_factory.mktemp("responses"), "r") as (_, url):
        yield f"{url}/v1"


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def chat_text(client, model, messages, max_tokens) -> str:
    """The chat route's answer to `messages` in exact mode."""
    return client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                          extra_body=EXACT).choices[0].message.content


def test_create_equals_the_chat_answer(client, model):
    chat = client.chat.completions.create(model=model, messages=[{"role": "system", "content": SYSTEM},
                                                                 {"role": "user", "content": QUESTION}],
                                          max_tokens=24, extra_body=EXACT)
    items = [{"role": "developer", "content": SYSTEM},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    for given in ({"instructions": SYSTEM, "input": QUESTION}, {"input": items}):
        answer = client.responses.create(model=model, max_output_tokens=24, extra_body=EXACT, **given)
        assert answer.object == "response" and answer.id.startswith("resp_") and answer.model == model
        assert answer.output_text == chat.choices[0].message.content
        assert answer.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
        assert (answer.usage.input_tokens, answer.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                          chat.usage.completion_tokens)
        assert answer.store is False and answer.model_extra["fly_stats"]["emitted"] == answer.usage.output_tokens


def test_stream_events_build_the_whole_response(client, model):
    whole = client.responses.create(model=model, input=QUESTION, max_output_tokens=20, extra_body=EXACT)
    with client.responses.stream(model=model, input=QUESTION, max_output_tokens=20, extra_body=EXACT) as stream:
        events = list(stream)
        kinds = [e.type for e in events]
        assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
        assert [e.sequence_number for e in events] == list(range(len(events)))
    usage = events[-1].response.usage
    assert kinds[-1] == f"response.{whole.status}" and usage.output_tokens == whole.usage.output_tokens
    assert usage.input_tokens == whole.usage.input_tokens and usage.input_tokens_details.cached_tokens > 0
    raw = client.responses.create(model=model, input=QUESTION, max_output_tokens=20, extra_body=EXACT, stream=True)
    assert "".join(getattr(e, "delta", "") for e in raw if e.type == "response.output_text.delta") == whole.output_text


def test_a_tool_call_round_trip(client, model):
    """The grammar makes the tiny random model's call valid; its items, sent back with the result, continue the
    conversation exactly as the chat route continues the same turns."""
    ask = [{"role": "user", "content": "Which animal?"}]
    answer = client.responses.create(model=model, input=ask, tools=TOOLS, tool_choice="required", max_output_tokens=80)
    calls = [item for item in answer.output if item.type == "function_call"]
    assert calls and answer.status == "completed"
    call = calls[0]
    assert call.name == "lookup" and json.loads(call.arguments)["key"] in ("fox", "dog") and call.id.startswith("fc_")
    named = client.responses.create(model=model, input=ask, tools=TOOLS, max_output_tokens=80,
                                    tool_choice={"type": "function", "name": "lookup"})
    assert [item.name for item in named.output if item.type == "function_call"][:1] == ["lookup"]
    follow = [*ask, *(item.model_dump(exclude_none=True) for item in answer.output),
              {"type": "function_call_output", "call_id": call.call_id, "output": "fox"}]
    reply = client.responses.create(model=model, input=follow, tools=TOOLS, max_output_tokens=6, extra_body=EXACT)
    turns = [*ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "fox"}]
    same = client.chat.completions.create(model=model, messages=turns, max_tokens=6, extra_body=EXACT,
                                          tools=[{"type": "function", "function": {"name": "lookup",
                                                  "description": "Look an animal up.", "parameters": LOOKUP}}])
    assert reply.output_text == (same.choices[0].message.content or "")
    with client.responses.stream(model=model, input=ask, tools=TOOLS, tool_choice="required",
                                 max_output_tokens=80) as stream:
        events = list(stream)
        final = stream.get_final_response()
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and done[0].name == "lookup" and json.loads(done[0].arguments)["key"] in ("fox", "dog")
    streamed = [item for item in final.output if item.type == "function_call"]
    assert [c.arguments for c in streamed] == [e.arguments for e in done]


# Codex CLI's request as its source (codex-rs, ResponsesApiRequest) builds it for a custom provider: instructions,
# function tools, a namespace of tools, the hosted web_search tool, reasoning (effort none too), text verbosity,
# include, prompt_cache_key and client_metadata on every request, no max_output_tokens.
CODEX_TOOLS = [{"type": "function", "name": "shell", "description": "Runs a shell command.", "strict": False,
                "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}},
                               "required": ["command"], "additionalProperties": False}},
               {"type": "namespace", "name": "collaboration", "description": "Agents.",
                "tools": [{"type": "function", "name": "spawn_agent", "description": "Spawns an agent.",
                           "parameters": {"type": "object", "properties": {"message": {"type": "string", "maxLength": 8}},
                                          "required": ["message"]}}]},  # short: the random model's string ends
               {"type": "web_search", "external_web_access": False}]


def codex_body(model, **changes):
    return {"model": model, "instructions": SYSTEM, "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
        "tools": CODEX_TOOLS, "tool_choice": "auto", "parallel_tool_calls": False,
        "reasoning": {"effort": "none"}, "store": False, "stream": True, "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "thread-1", "text": {"verbosity": "low"},
        "client_metadata": {"x-codex-installation-id": "i-1", "session_id": "s-1"}, **changes}


def codex(base_url, body) -> dict:
    """POST `body` to /v1/responses as Codex does (no SDK: its own client): the final response object (a stream's
    last event's)."""
    answer = httpx.post(f"{base_url}/responses", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    if not body["stream"]:
        return answer.json()
    events = [json.loads(line[len("data: "):]) for line in answer.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    return events[-1]["response"]


def test_codex_clis_request_is_served(base_url, model):
    for changes in ({}, {"reasoning": {"effort": "medium", "summary": "auto"}}, {"stream": False}):
        final = codex(base_url, codex_body(model, **changes))
        assert final["status"] in ("completed", "incomplete")
        assert [t["type"] for t in final["tools"]] == ["function", "namespace", "web_search"]


def test_a_namespaces_tool_is_called_by_its_own_name_in_its_namespace(base_url, client, model):
    """The model sees `collaboration.spawn_agent`; its call comes back as Codex names it (namespace apart), and that
    call sent back continues the conversation as the chat route continues the same turns."""
    forced = {"type": "function", "name": "collaboration.spawn_agent"}
    answer = codex(base_url, codex_body(model, stream=False, tool_choice=forced, max_output_tokens=200))
    calls = [item for item in answer["output"] if item["type"] == "function_call"]
    assert calls, answer
    call = calls[0]
    assert (call["namespace"], call["name"]) == ("collaboration", "spawn_agent")
    assert isinstance(json.loads(call["arguments"])["message"], str)
    follow = [*codex_body(model)["input"], call, {"type": "function_call_output", "call_id": call["call_id"],
                                                  "name": "spawn_agent", "namespace": "collaboration", "output": "ok"}]
    reply = codex(base_url, codex_body(model, stream=False, input=follow, max_output_tokens=6, **EXACT))
    turns = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION},
             {"role": "assistant", "content": None, "tool_calls": [{"id": call["call_id"], "type": "function",
              "function": {"name": "collaboration.spawn_agent", "arguments": call["arguments"]}}]},
             {"role": "tool", "tool_call_id": call["call_id"], "content": "ok"}]
    chat_tools = [{"type": "function", "function": {"name": "shell", "description": "Runs a shell command.",
                                                    "strict": False, "parameters": CODEX_TOOLS[0]["parameters"]}},
                  {"type": "function", "function": {"name": "collaboration.spawn_agent",
                                                    "description": "Spawns an agent.",
                                                    "parameters": CODEX_TOOLS[1]["tools"][0]["parameters"]}}]
    same = client.chat.completions.create(model=model, messages=turns, max_tokens=6, extra_body=EXACT,
                                          tools=chat_tools, parallel_tool_calls=False)
    texts = [part["text"] for item in reply["output"] if item["type"] == "message" for part in item["content"]]
    assert "".join(texts) == (same.choices[0].message.content or "")
    refused = httpx.post(f"{base_url}/responses", json=codex_body(model, stream=False, tool_choice={
        "type": "function", "name": "web_search"}), timeout=60)
    assert refused.status_code == 400 and "hosted tools such as web_search" in refused.json()["error"]["message"]


def test_text_format_is_decoded_under_the_grammar(client, model):
    schema = Verdict.model_json_schema() | {"additionalProperties": False}
    answer = client.responses.create(model=model, input="Is it?", max_output_tokens=40, text={
        "format": {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}})
    assert json.loads(answer.output_text)["ok"] in (True, False)
    assert answer.text.format.type == "json_schema"
    parsed = client.responses.parse(model=model, input="Is it?", max_output_tokens=40, text_format=Verdict)
    assert isinstance(parsed.output_parsed, Verdict)
    anything = client.responses.create(model=model, input="Is it?", max_output_tokens=40,
                                       text={"format": {"type": "json_object"}})
    assert anything.status == "incomplete" or isinstance(json.loads(anything.output_text), dict)


def test_refusals_are_openai_errors(client, model):
    with pytest.raises(openai.BadRequestError) as stored:
        client.responses.create(model=model, input=QUESTION, store=True)
    assert stored.value.code == "BAD_REQUEST" and stored.value.param == "store"
    assert "not supported" in stored.value.message
    with pytest.raises(openai.BadRequestError, match="previous_response_id is not supported"):
        client.responses.create(model=model, input=QUESTION, previous_response_id="resp_123")
    assert client.responses.create(model="gpt-5-codex", input=QUESTION, max_output_tokens=2).model == model
    with pytest.raises(openai.BadRequestError) as too_long:
        client.responses.create(model=model, input="x " * 2000, max_output_tokens=4)  # over the 512-token window
    assert too_long.value.code == "TOO_LONG"
    with pytest.raises(openai.BadRequestError, match="tool_choice needs tools"):
        client.responses.create(model=model, input=QUESTION, tool_choice="required")


def test_langchain_chat_openai_with_the_responses_api(base_url, client, model):
    langchain_openai = pytest.importorskip("langchain_openai", reason="pip install langchain-openai (in [dev])")
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool

    llm = langchain_openai.ChatOpenAI(base_url=base_url, api_key="unused", model=model, max_tokens=16, temperature=0,
                                      max_retries=0, extra_body=EXACT, use_responses_api=True)
    conversation = [SystemMessage(SYSTEM), HumanMessage(QUESTION)]
    message = llm.invoke(conversation)
    turns = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    expected = chat_text(client, model, turns, 16)
    assert message.text == expected and message.response_metadata["id"].startswith("resp_")
    assert message.usage_metadata["output_tokens"] >= 1
    assert "".join(chunk.text for chunk in llm.stream(conversation)) == expected

    @tool
    def lookup(key: Literal["fox", "dog"]) -> str:  # an enum, closed (strict): the tiny model's free text runs long
        """Look an animal up."""
        return key

    ask, caller = [HumanMessage("Which animal?")], llm.model_copy(update={"max_tokens": 120})
    ai = caller.bind_tools([lookup], tool_choice="lookup", strict=True).invoke(ask)
    assert [call["name"] for call in ai.tool_calls][:1] == ["lookup"] and isinstance(ai.tool_calls[0]["args"], dict)
    follow = [*ask, ai, ToolMessage("fox", tool_call_id=ai.tool_calls[0]["id"])]
    reply = llm.bind_tools([lookup]).invoke(follow)
    assert reply.response_metadata["status"] in ("completed", "incomplete")
    streamed = None
    for chunk in caller.bind_tools([lookup], tool_choice="lookup", strict=True).stream(ask):
        streamed = chunk if streamed is None else streamed + chunk
    assert [call["name"] for call in streamed.tool_calls][:1] == ["lookup"]
