"""POST /v1/messages and /v1/messages/count_tokens with the official clients, unchanged, against a tiny daemon's
HTTP front: the anthropic SDK's `messages.create` / `messages.stream` / `messages.count_tokens` and LangChain's
`ChatAnthropic(base_url=...)`, a tool use round trip with each. The route is the chat route translated, so in
exact mode its answers equal /v1/chat/completions' for the same conversation, token for token.
"""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest

from support.daemon_process import serving_http

anthropic = pytest.importorskip("anthropic", reason="pip install anthropic (in [dev])")

SYSTEM, QUESTION = "Be brief.", "What is 2 + 3?"
EXACT = {"loose": False}
LOOKUP = {"type": "object", "properties": {"key": {"enum": ["fox", "dog"]}}, "required": ["key"],
          "additionalProperties": False}
TOOLS = [{"name": "lookup", "description": "Look an animal up.", "input_schema": LOOKUP}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look an animal up.",
                                                "parameters": LOOKUP}}]


@pytest.fixture(scope="module")
def root_url(tiny_pair_dirs, tmp_path_factory):
    with serving_http(*tiny_pair_dirs, tmp_path_factory.mktemp("messages"), "m") as (_, url):
        yield url


@pytest.fixture(scope="module")
def client(root_url):
    with anthropic.Anthropic(base_url=root_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def chat(root_url):
    """The OpenAI client on the same front: the chat route's answers to compare with."""
    with openai.OpenAI(base_url=f"{root_url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(chat) -> str:
    return chat.models.list().data[0].id


def prompt_tokens(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens


def test_create_equals_the_chat_answer(client, chat, model):
    same = chat.chat.completions.create(model=model, messages=[{"role": "system", "content": SYSTEM},
                                                               {"role": "user", "content": QUESTION}],
                                        max_tokens=24, extra_body=EXACT)
    for system in (SYSTEM, [{"type": "text", "text": SYSTEM}]):
        answer = client.messages.create(model=model, system=system, max_tokens=24, extra_body=EXACT,
                                        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}])
        assert answer.type == "message" and answer.role == "assistant" and answer.id.startswith("msg_")
        assert [block.type for block in answer.content] == ["text"]
        assert answer.content[0].text == same.choices[0].message.content
        assert answer.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[same.choices[0].finish_reason]
        assert (prompt_tokens(answer.usage), answer.usage.output_tokens) == (same.usage.prompt_tokens,
                                                                             same.usage.completion_tokens)


def test_stream_builds_the_whole_message(client, model):
    ask = {"model": model, "max_tokens": 20, "messages": [{"role": "user", "content": QUESTION}], "extra_body": EXACT}
    whole = client.messages.create(**ask)
    with client.messages.stream(**ask) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text and final.content[0].text == text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert prompt_tokens(final.usage) == prompt_tokens(whole.usage)  # from message_delta: message_start has 0
    kinds = [event.type for event in client.messages.create(**ask, stream=True)]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]


def test_count_tokens_is_the_prompt_a_request_gets(client, chat, model):
    messages = [{"role": "user", "content": QUESTION}]
    count = client.messages.count_tokens(model=model, system=SYSTEM, messages=messages, tools=TOOLS)
    same = chat.chat.completions.create(model=model, messages=[{"role": "system", "content": SYSTEM}, *messages],
                                        tools=CHAT_TOOLS, max_tokens=1)
    assert count.input_tokens == same.usage.prompt_tokens
    assert client.messages.count_tokens(model=model, messages=messages).input_tokens < count.input_tokens


def test_a_tool_use_round_trip(client, chat, model):
    """The grammar makes the tiny random model's call valid; its blocks, sent back with the result, continue the
    conversation exactly as the chat route continues the same turns."""
    ask = [{"role": "user", "content": "Which animal?"}]
    answer = client.messages.create(model=model, messages=ask, tools=TOOLS, tool_choice={"type": "any"},
                                    max_tokens=80)
    uses = [block for block in answer.content if block.type == "tool_use"]
    assert answer.stop_reason == "tool_use" and uses and uses[0].name == "lookup"
    assert uses[0].input["key"] in ("fox", "dog")
    named = client.messages.create(model=model, messages=ask, tools=TOOLS, max_tokens=80,
                                   tool_choice={"type": "tool", "name": "lookup", "disable_parallel_tool_use": True})
    assert [block.name for block in named.content if block.type == "tool_use"] == ["lookup"]
    follow = [*ask, {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in answer.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "fox"}]}]
    reply = client.messages.create(model=model, messages=follow, tools=TOOLS, max_tokens=6, extra_body=EXACT)
    calls = [{"id": u.id, "type": "function", "function": {"name": u.name, "arguments": json.dumps(u.input)}}
             for u in uses]
    turns = [*ask, {"role": "assistant", "content": None, "tool_calls": calls},
             {"role": "tool", "tool_call_id": uses[0].id, "content": "fox"}]
    same = chat.chat.completions.create(model=model, messages=turns, tools=CHAT_TOOLS, max_tokens=6, extra_body=EXACT)
    assert "".join(b.text for b in reply.content if b.type == "text") == (same.choices[0].message.content or "")
    with client.messages.stream(model=model, messages=ask, tools=TOOLS, tool_choice={"type": "any"},
                                max_tokens=80) as stream:
        final = stream.get_final_message()
    streamed = [block for block in final.content if block.type == "tool_use"]
    assert final.stop_reason == "tool_use" and streamed[0].name == "lookup"
    assert streamed[0].input["key"] in ("fox", "dog")


def test_output_config_format_is_decoded_under_the_grammar(client, model):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    answer = client.messages.create(model=model, max_tokens=40, messages=[{"role": "user", "content": "Is it?"}],
                                    output_config={"format": {"type": "json_schema", "schema": schema}})
    assert json.loads(answer.content[0].text)["ok"] in (True, False)


def test_refusals_are_anthropic_errors(client, model):
    ask = {"max_tokens": 4, "messages": [{"role": "user", "content": QUESTION}]}
    other = client.messages.create(model="claude-sonnet-4-5", **ask)  # Claude Code's default name: the target
    assert other.model == model and other.usage.output_tokens <= 4
    with pytest.raises(anthropic.BadRequestError) as too_long:
        client.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": "x " * 2000}])
    assert too_long.value.body["error"] == {"type": "invalid_request_error", "code": "TOO_LONG",
                                            "message": too_long.value.body["error"]["message"]}
    with pytest.raises(anthropic.BadRequestError, match="prefill"):
        client.messages.create(model=model, max_tokens=4, messages=[*ask["messages"], {"role": "assistant",
                                                                                       "content": "The answer is"}])
    with pytest.raises(anthropic.BadRequestError, match="top_k"):  # the SDK sends samplers as extra body fields now
        client.messages.create(model=model, extra_body={"top_k": -1}, **ask)
    assert client.messages.create(model=model, extra_body={"top_k": 40}, **ask).content  # served by the sampler
    with pytest.raises(anthropic.BadRequestError, match="unknown call"):
        client.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}])
    assert client.messages.create(model=model, **ask).usage.output_tokens >= 1


def test_langchain_chat_anthropic(root_url, client, model):
    langchain_anthropic = pytest.importorskip("langchain_anthropic", reason="pip install langchain-anthropic")
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool

    llm = langchain_anthropic.ChatAnthropic(base_url=root_url, api_key="unused", model=model, max_tokens=16,
                                            temperature=0, max_retries=0, model_kwargs={"extra_body": EXACT})
    conversation = [SystemMessage(SYSTEM), HumanMessage(QUESTION)]
    message = llm.invoke(conversation)
    expected = client.messages.create(model=model, system=SYSTEM, max_tokens=16, extra_body=EXACT,
                                      messages=[{"role": "user", "content": QUESTION}]).content[0].text
    assert message.text == expected and message.response_metadata["stop_reason"] in ("max_tokens", "end_turn")
    assert message.usage_metadata["output_tokens"] >= 1
    assert "".join(chunk.text for chunk in llm.stream(conversation)) == expected

    @tool
    def lookup(key: Literal["fox", "dog"]) -> str:  # an enum, closed (strict): the tiny model's free text runs long
        """Look an animal up."""
        return key

    ask, caller = [HumanMessage("Which animal?")], llm.model_copy(update={"max_tokens": 120})
    ai = caller.bind_tools([lookup], tool_choice="lookup", strict=True).invoke(ask)
    assert [call["name"] for call in ai.tool_calls] == ["lookup"] and ai.tool_calls[0]["args"]["key"] in ("fox", "dog")
    reply = llm.bind_tools([lookup]).invoke([*ask, ai, ToolMessage("fox", tool_call_id=ai.tool_calls[0]["id"])])
    assert reply.response_metadata["stop_reason"] in ("max_tokens", "end_turn", "tool_use")
    streamed = None
    for chunk in caller.bind_tools([lookup], tool_choice="any", strict=True).stream(ask):
        streamed = chunk if streamed is None else streamed + chunk
    assert [call["name"] for call in streamed.tool_calls][:1] == ["lookup"]
