"""llama_index.llms.fly.FLyLLM as a FunctionCallingLLM and a structured LLM, on the tiny random-weight daemon.

Random weights know nothing: a call or a structured answer is valid only because the daemon
decodes it under a grammar. So every call must validate against its tool's schema and every
structured answer must be its class. Schemas keep strings short (enums, max_length): a
free-length string from random weights never ends within the context.
(No `from __future__ import annotations`: FunctionTool reads the tools' annotations at run time.)
"""

from typing import Literal

import jsonschema
import pytest
from llama_index.core.agent.workflow import FunctionAgent, ToolCallResult
from llama_index.core.base.llms.types import ChatMessage, ToolCallBlock
from llama_index.core.program import FunctionCallingProgram
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel, Field

from fly_llm.common.errors import BadRequest
from llama_index.llms.fly import FLyLLM
from llama_index.llms.fly._messages import to_wire

ASK = "Add 2 and 3, then look up the fox."


def add(a: int = Field(ge=0, le=9), b: int = Field(ge=0, le=9)) -> int:
    """Add two small numbers."""
    return a + b


def lookup(key: Literal["fox", "dog"]) -> str:
    """Look up what an animal is like."""
    return {"fox": "quick", "dog": "lazy"}[key]


TOOLS = [FunctionTool.from_defaults(add), FunctionTool.from_defaults(lookup)]
SCHEMAS = {t.metadata.name: t.metadata.get_parameters_dict() for t in TOOLS}


class Pick(BaseModel):
    """A short pick."""

    word: str = Field(max_length=8)
    n: int = Field(ge=0, le=99)
    animal: Literal["fox", "dog"]


PICK = PromptTemplate("Pick a word, a number and an animal for {topic}.")


@pytest.fixture(scope="module")
def llm(tiny_daemon: str) -> FLyLLM:
    return FLyLLM(endpoint=tiny_daemon, max_tokens=160, timeout=120)


def assert_valid(selections) -> None:
    assert selections
    for call in selections:
        assert call.tool_id and call.tool_name in SCHEMAS
        jsonschema.validate(call.tool_kwargs, SCHEMAS[call.tool_name])


def test_it_is_a_function_calling_model(llm):
    assert llm.metadata.is_function_calling_model and llm.metadata.is_chat_model


def test_chat_with_tools_required_gives_valid_calls(llm):
    response = llm.chat_with_tools(TOOLS, ASK, tool_required=True, allow_parallel_tool_calls=True)
    assert_valid(llm.get_tool_calls_from_response(response))
    assert response.raw["finish_reason"] == "tool_calls"
    assert all(isinstance(b, ToolCallBlock) for b in response.message.blocks)


@pytest.mark.parametrize("choice", ["add", {"type": "function", "function": {"name": "add"}}])
def test_a_named_tool_choice_calls_that_tool(llm, choice):
    response = llm.chat_with_tools(TOOLS, ASK, tool_choice=choice)
    calls = llm.get_tool_calls_from_response(response)
    assert_valid(calls)
    assert [c.tool_name for c in calls] == ["add"]


def test_without_parallel_calls_the_grammar_allows_one_call(llm, monkeypatch):
    """LlamaIndex's allow_parallel_tool_calls=False (its default) is sent as parallel_tool_calls=False,
    which the grammar enforces (test_grammar); allowed, nothing is sent."""
    sent = []
    real_chat = llm.client.chat
    monkeypatch.setattr(llm.client, "chat", lambda *a, **kw: sent.append(kw) or real_chat(*a, **kw))
    response = llm.chat_with_tools(TOOLS, ASK, tool_required=True)
    llm.chat_with_tools(TOOLS, ASK, tool_required=True, allow_parallel_tool_calls=True)
    assert sent[0]["parallel_tool_calls"] is False and "parallel_tool_calls" not in sent[1]
    assert len(llm.get_tool_calls_from_response(response)) == 1


def test_no_tool_call_is_an_error_only_when_asked(llm):
    response = llm.chat_with_tools(TOOLS, ASK, tool_choice="none", max_tokens=16)
    assert llm.get_tool_calls_from_response(response, error_on_no_tool_call=False) == []
    with pytest.raises(ValueError, match="expected at least one tool call.*finish_reason"):
        llm.get_tool_calls_from_response(response)


def test_streamed_calls_arrive_whole(llm):
    responses = list(llm.stream_chat_with_tools(TOOLS, ASK, tool_required=True))
    final = llm.get_tool_calls_from_response(responses[-1])
    assert_valid(final)
    assert responses[-1].delta == "" and responses[-1].raw["usage"]["completion_tokens"] > 0
    counts = [len(llm.get_tool_calls_from_response(r, error_on_no_tool_call=False)) for r in responses]
    assert counts == sorted(counts)  # calls accumulate, each arriving whole


async def test_async_chat_and_stream_with_tools(llm):
    response = await llm.achat_with_tools(TOOLS, ASK, tool_required=True)
    assert_valid(llm.get_tool_calls_from_response(response))
    last = None
    async for last in await llm.astream_chat_with_tools(TOOLS, ASK, tool_required=True):
        pass
    assert_valid(llm.get_tool_calls_from_response(last))


def test_predict_and_call_runs_the_tool(llm):
    result = llm.predict_and_call(TOOLS, ASK, tool_required=True)
    [source] = result.sources
    assert not source.is_error and source.tool_name in SCHEMAS
    assert result.response == source.content


def test_calls_and_results_go_back_to_the_daemon(llm):
    first = llm.chat_with_tools(TOOLS, ASK, tool_required=True)
    [call] = llm.get_tool_calls_from_response(first)
    result = ChatMessage(role="tool", content="quick", additional_kwargs={"tool_call_id": call.tool_id})
    history = [ChatMessage(role="user", content=ASK), first.message, result]
    wire = to_wire(history)
    assert wire[1]["tool_calls"] == [{"id": call.tool_id, "name": call.tool_name, "arguments": call.tool_kwargs}]
    assert wire[2] == {"role": "tool", "content": "quick", "tool_call_id": call.tool_id}
    answer = llm.chat_with_tools(TOOLS, chat_history=history, tool_choice="none", max_tokens=8)
    assert llm.get_tool_calls_from_response(answer, error_on_no_tool_call=False) == []


def test_bad_tools_are_errors_naming_the_tool(llm):
    with pytest.raises(ValueError, match=r"unknown tool_choice 'sometimes'.*\(add, lookup\)"):
        llm.chat_with_tools(TOOLS, ASK, tool_choice="sometimes")
    with pytest.raises(ValueError, match="unknown tool 'subtract'"):
        llm.chat_with_tools(TOOLS, ASK, tool_choice={"type": "function", "function": {"name": "subtract"}})
    with pytest.raises(BadRequest, match="duplicate tool names: add"):
        llm.chat_with_tools([TOOLS[0], TOOLS[0]], ASK)

    def negate(x: object) -> int:
        """Negate."""
        return 0

    bad = FunctionTool.from_defaults(negate)
    bad.metadata.fn_schema.model_json_schema = lambda: {"type": "object", "properties": {"x": {"not": {}}}}
    with pytest.raises(BadRequest, match="tool 'negate'"):
        llm.chat_with_tools([TOOLS[0], bad], ASK, tool_required=True)


def test_structured_predict_decodes_the_class(llm):
    pick = llm.structured_predict(Pick, PICK, topic="cats")
    assert isinstance(pick, Pick)


async def test_astructured_predict_and_streams(llm):
    assert isinstance(await llm.astructured_predict(Pick, PICK, topic="cats"), Pick)
    partials = list(llm.stream_structured_predict(Pick, PICK, topic="cats"))
    assert partials and isinstance(partials[-1], Pick)
    apartials = [p async for p in await llm.astream_structured_predict(Pick, PICK, topic="cats")]
    assert apartials[-1] == partials[-1]


def test_a_structured_answer_cut_off_says_why(llm):
    with pytest.raises(ValueError, match="not a valid Pick.*'length'"):
        llm.structured_predict(Pick, PICK, llm_kwargs={"max_tokens": 4}, topic="cats")


def test_as_structured_llm_and_pydantic_programs(llm):
    structured = llm.as_structured_llm(Pick)
    response = structured.chat([ChatMessage(role="user", content="Pick.")])
    assert isinstance(response.raw, Pick)
    program = FunctionCallingProgram.from_defaults(Pick, "Pick for {topic}.", llm=llm)
    assert isinstance(program(topic="dogs"), Pick)


def test_response_format_is_a_field_and_a_call_option(tiny_daemon):
    llm = FLyLLM(endpoint=tiny_daemon, max_tokens=20, response_format={"type": "regex", "pattern": "(yes|no)!"})
    assert llm.complete("x").text in ("yes!", "no!")
    assert llm.chat([ChatMessage(role="user", content="x")]).message.content in ("yes!", "no!")
    assert llm.complete("x", response_format={"type": "regex", "pattern": "ok"}).text == "ok"


async def test_function_agent_calls_a_tool_and_answers(llm):
    agent = FunctionAgent(tools=TOOLS, llm=llm, initial_tool_choice="lookup", streaming=False)
    handler = agent.run(user_msg="What is the fox like?")
    calls = [event async for event in handler.stream_events() if isinstance(event, ToolCallResult)]
    result = await handler
    assert calls and calls[0].tool_name == "lookup" and calls[0].tool_kwargs["key"] in ("fox", "dog")
    assert calls[0].tool_output.content in ("quick", "lazy") and not calls[0].tool_output.is_error
    assert result.response is not None
