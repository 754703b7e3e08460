"""ChatFLy tool calling and structured output, FLyLLM's response_format, on the tiny random-weight daemon.

Random weights know nothing: whatever the model answers is valid only because the daemon decodes
it under a grammar of the offered tools or schema. So every call here must validate against its
tool's schema, and every structured answer against its schema. The schemas keep strings short
(maxLength, enums): a free-length string from random weights never ends within the context.
"""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from fly_llm.common.errors import BadRequest
from fly_llm.common.protocol import TokenChunk, ToolCall
from langchain_fly import ChatFLy, FLyLLM
from langchain_fly._messages import message_chunk, to_wire

ASK = "Add 2 and 3, then look up the fox."


@tool
def lookup(key: Literal["fox", "dog"]) -> str:
    """Look up what an animal is like."""
    return {"fox": "quick", "dog": "lazy"}[key]


class add(BaseModel):  # noqa: N801 - a tool's name is its class name
    """Add two small numbers."""

    a: int = Field(ge=0, le=9)
    b: int = Field(ge=0, le=9)


NEGATE = {"title": "negate", "description": "Negate a digit.", "type": "object",
          "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"]}
SHOUT = convert_to_openai_tool({"title": "shout", "description": "Shout a short word.", "type": "object",
                                "properties": {"word": {"type": "string", "maxLength": 6}}, "required": ["word"]})
TOOLS = [lookup, add, NEGATE, SHOUT]


class Pick(BaseModel):
    """A short pick."""

    word: str = Field(max_length=8)
    n: int = Field(ge=0, le=99)
    sure: bool


class PickDict(TypedDict):
    """A pick as a dict."""

    animal: Literal["fox", "dog"]
    sure: bool


PICK_SCHEMA = {"title": "Pick", "type": "object", "properties": {
    "word": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["word", "n"]}


@pytest.fixture(scope="module")
def chat(tiny_daemon: str) -> ChatFLy:
    return ChatFLy(endpoint=tiny_daemon, max_tokens=160, timeout=120)


def schemas(bound) -> dict[str, dict]:
    """name → parameters schema of the tools a bound model offers."""
    return {t["function"]["name"]: t["function"]["parameters"] for t in bound.kwargs["tools"]}


def assert_valid_calls(message: AIMessage, offered: dict[str, dict]) -> None:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call["name"] in offered and call["id"] and call["type"] == "tool_call"
        jsonschema.validate(call["args"], offered[call["name"]])


def test_bind_tools_takes_every_kind_of_tool_and_calls_are_valid(chat):
    bound = chat.bind_tools(TOOLS, tool_choice="any")
    offered = schemas(bound)
    assert list(offered) == ["lookup", "add", "negate", "shout"]
    assert offered["add"]["additionalProperties"] is False  # closed, so random keys cannot wander off
    message = bound.invoke(ASK)
    assert_valid_calls(message, offered)
    assert message.content == "" and message.response_metadata["finish_reason"] == "tool_calls"
    assert not message.invalid_tool_calls and message.usage_metadata["output_tokens"] > 0


@pytest.mark.parametrize("choice", ["negate", {"type": "function", "function": {"name": "negate"}}])
def test_a_named_choice_calls_that_tool_once(chat, choice):
    bound = chat.bind_tools(TOOLS, tool_choice=choice)
    message = bound.invoke(ASK)
    assert_valid_calls(message, schemas(bound))
    assert [c["name"] for c in message.tool_calls] == ["negate"]


def test_parallel_tool_calls_false_reaches_the_daemon_and_one_call_comes_back(chat, monkeypatch):
    """As for ChatOpenAI: bind_tools(parallel_tool_calls=False) is sent with the request, where the
    grammar allows one call (test_grammar: a second call is refused); unset, nothing is sent."""
    sent = []
    real_chat = chat._client.chat
    monkeypatch.setattr(chat._client, "chat", lambda *a, **kw: sent.append(kw) or real_chat(*a, **kw))
    single = chat.bind_tools(TOOLS, tool_choice="required", parallel_tool_calls=False).invoke(ASK)
    chat.bind_tools(TOOLS, tool_choice="required").invoke(ASK)
    assert sent[0]["parallel_tool_calls"] is False and "parallel_tool_calls" not in sent[1]
    assert len(single.tool_calls) == 1
    assert_valid_calls(single, schemas(chat.bind_tools(TOOLS)))


def test_choice_none_never_calls(chat):
    message = chat.bind_tools(TOOLS, tool_choice="none").invoke(ASK, max_tokens=40)
    assert not message.tool_calls and not message.invalid_tool_calls and "<tool_call>" not in message.content


def test_streamed_calls_arrive_as_tool_call_chunks(chat):
    bound = chat.bind_tools(TOOLS, tool_choice="required")
    chunks = list(bound.stream(ASK))
    call_chunks = [c for chunk in chunks for c in chunk.tool_call_chunks]
    assert call_chunks and [c["index"] for c in call_chunks] == list(range(len(call_chunks)))
    full = chunks[0]
    for chunk in chunks[1:]:
        full += chunk
    assert_valid_calls(full, schemas(bound))
    assert len(full.tool_calls) == len(call_chunks)
    assert full.response_metadata["finish_reason"] == "tool_calls"


async def test_async_invoke_and_stream_call_tools(chat):
    bound = chat.bind_tools(TOOLS, tool_choice="any")
    message = await bound.ainvoke(ASK)
    assert_valid_calls(message, schemas(bound))
    full = None
    async for chunk in bound.astream(ASK):
        full = chunk if full is None else full + chunk
    assert isinstance(full, AIMessageChunk)
    assert_valid_calls(full, schemas(bound))
    assert [(c["name"], c["args"]) for c in full.tool_calls] == [(c["name"], c["args"]) for c in message.tool_calls]


def test_stream_chunks_index_calls_across_the_stream():
    calls = [ToolCall(id="call_a", name="add", arguments={"a": 1, "b": 2}), ToolCall(id="call_b", name="lookup")]
    chunk = message_chunk(TokenChunk(id="r", text="", tool_calls=calls), first_index=3)
    assert [(c["index"], c["id"], json.loads(c["args"])) for c in chunk.tool_call_chunks] == [
        (3, "call_a", {"a": 1, "b": 2}), (4, "call_b", {})]
    assert message_chunk(TokenChunk(id="r", text=""), first_index=0) is None


def test_tool_calls_and_results_go_back_to_the_daemon(chat):
    bound = chat.bind_tools(TOOLS, tool_choice="any")
    first = bound.invoke(ASK)
    results = [ToolMessage(json.dumps({"ok": True}), tool_call_id=c["id"]) for c in first.tool_calls]
    wire = to_wire([HumanMessage(ASK), first, *results])
    assert [c.function.name for c in wire[1].tool_calls] == [c["name"] for c in first.tool_calls]
    assert [m.tool_call_id for m in wire[2:]] == [c["id"] for c in first.tool_calls]
    answer = chat.bind_tools(TOOLS, tool_choice="none").invoke([HumanMessage(ASK), first, *results], max_tokens=8)
    assert isinstance(answer, AIMessage) and not answer.tool_calls
    longer = chat.get_num_tokens_from_messages([HumanMessage(ASK), first, *results])
    assert longer > chat.get_num_tokens_from_messages([HumanMessage(ASK)])  # the calls are in the template


def test_token_counts_with_tools_are_the_prompt_the_daemon_decodes(chat):
    """get_num_tokens_from_messages(tools=...) counts the tools' schemas as the chat template renders
    them: exactly the prompt tokens of the same call with those tools bound."""
    messages = [HumanMessage(ASK)]
    with_tools = chat.get_num_tokens_from_messages(messages, tools=TOOLS)
    answer = chat.bind_tools(TOOLS).invoke(messages, max_tokens=1)
    assert with_tools == answer.usage_metadata["input_tokens"]
    assert with_tools > chat.get_num_tokens_from_messages(messages)  # the schemas are in the prompt


def test_answers_with_call_blocks_in_their_content_go_back_as_calls():
    call = {"name": "add", "args": {"a": 1, "b": 2}, "id": "abc", "type": "tool_call"}
    answer = AIMessage([{"type": "text", "text": "let me add"}, {"type": "thinking", "thinking": "hm"},
                        {"type": "tool_use", "id": "abc", "name": "add", "input": {"a": 1, "b": 2}}],
                       tool_calls=[call])
    wire = to_wire([HumanMessage("1 + 2?"), answer, ToolMessage("3", tool_call_id="abc")])
    assert wire[1].content == "let me add" and wire[1].tool_calls[0].function.arguments == {"a": 1, "b": 2}
    with pytest.raises(ValueError, match="'thinking' content block"):  # only answers carry reasoning
        to_wire([HumanMessage([{"type": "thinking", "thinking": "hm"}])])


def test_a_call_cut_off_by_max_tokens_is_an_invalid_tool_call(chat):
    message = chat.bind_tools(TOOLS, tool_choice="required").invoke(ASK, max_tokens=12)
    assert message.response_metadata["finish_reason"] == "length" and not message.tool_calls
    [invalid] = message.invalid_tool_calls
    assert "cut off" in invalid["error"] and invalid["args"] and "<tool_call>" in message.content


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_pydantic(chat, method):
    pick = chat.with_structured_output(Pick, method=method).invoke("Pick a word and a number.")
    assert isinstance(pick, Pick)


def test_structured_output_typeddict_and_json_schema(chat):
    picked = chat.with_structured_output(PickDict).invoke("Which animal?")
    jsonschema.validate(picked, {"type": "object", "properties": {"animal": {"enum": ["fox", "dog"]},
                                                                  "sure": {"type": "boolean"}},
                                 "required": ["animal", "sure"], "additionalProperties": False})
    for method in ["json_schema", "function_calling"]:
        jsonschema.validate(chat.with_structured_output(PICK_SCHEMA, method=method).invoke("Pick."), PICK_SCHEMA)
    untitled = {key: value for key, value in PICK_SCHEMA.items() if key != "title"}
    jsonschema.validate(chat.with_structured_output(untitled).invoke("Pick."), untitled)


def test_json_mode_answers_a_json_object(chat):
    result = chat.with_structured_output(None, method="json_mode", include_raw=True).invoke("JSON please.")
    raw = result["raw"]
    assert raw.content.startswith("{")  # the grammar's; random weights start with "{" 1 time in 320
    if raw.response_metadata["finish_reason"] == "stop":
        assert isinstance(result["parsed"], dict) and result["parsing_error"] is None
    else:  # free-length keys: random weights may not finish the object within max_tokens
        assert raw.response_metadata["finish_reason"] == "length"


def test_include_raw_gives_the_message_and_the_parsing_error(chat):
    good = chat.with_structured_output(Pick, include_raw=True).invoke("Pick.")
    assert isinstance(good["raw"], AIMessage) and isinstance(good["parsed"], Pick) and good["parsing_error"] is None
    short = chat.model_copy(update={"max_tokens": 3})
    cut = short.with_structured_output(Pick, include_raw=True).invoke("Pick.")
    assert cut["parsed"] is None and cut["parsing_error"] is not None
    assert cut["raw"].response_metadata["finish_reason"] == "length"


async def test_structured_output_streams_and_runs_async(chat):
    structured = chat.with_structured_output(Pick)
    streamed = list(structured.stream("Pick."))
    assert streamed and all(isinstance(p, Pick) for p in streamed)
    assert streamed[-1] == await structured.ainvoke("Pick.")


def test_structured_output_traces_its_schema(chat):
    from langchain_core.callbacks import BaseCallbackHandler

    seen = []

    class Options(BaseCallbackHandler):
        def on_chat_model_start(self, serialized, messages, *, options=None, **kwargs):
            seen.append(options)

    chat.with_structured_output(Pick).invoke("Pick.", config={"callbacks": [Options()]})
    assert seen[0]["ls_structured_output_format"]["kwargs"] == {"method": "json_schema"}


def test_flyllm_takes_response_format(tiny_daemon):
    llm = FLyLLM(endpoint=tiny_daemon, max_tokens=60)
    assert llm.invoke("x", response_format={"type": "regex", "pattern": "(yes|no)!"}) in ("yes!", "no!")
    constrained = FLyLLM(endpoint=tiny_daemon, max_tokens=60,
                         response_format={"type": "json_schema", "schema": PICK_SCHEMA | {"additionalProperties": False}})
    jsonschema.validate(json.loads(constrained.invoke("x")), PICK_SCHEMA)
    chunks = list(constrained.stream("x"))
    jsonschema.validate(json.loads("".join(chunks)), PICK_SCHEMA)
    assert constrained.invoke("x", response_format=None) != ""  # a call's value replaces the field's


def test_bad_tools_fail_at_bind_time_naming_the_tool(chat):
    with pytest.raises(ValueError, match=r"unknown tool_choice 'sometimes'.*\(lookup, add"):
        chat.bind_tools(TOOLS, tool_choice="sometimes")
    with pytest.raises(ValueError, match="unknown tool 'subtract'"):
        chat.bind_tools(TOOLS, tool_choice={"type": "function", "function": {"name": "subtract"}})
    with pytest.raises(ValueError, match="tool 'bad name!'"):
        chat.bind_tools([{"type": "function", "function": {"name": "bad name!", "parameters": {}}}])
    with pytest.raises(ValueError, match="tool .*object.* cannot be offered"):
        chat.bind_tools([object()])
    with pytest.raises(ValueError, match="unknown method"):
        chat.with_structured_output(Pick, method="xml")


def test_bad_tools_fail_at_call_time_naming_the_tool(chat):
    with pytest.raises(BadRequest, match="duplicate tool names: add"):
        chat.bind_tools([add, add]).invoke("x")
    negate = {"title": "negate", "type": "object", "properties": {"x": {"not": {"type": "string"}}}}
    with pytest.raises(BadRequest, match="tool 'negate'.*not"):
        chat.bind_tools([add, negate], tool_choice="any").invoke("x")
