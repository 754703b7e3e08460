"""LlamaIndex's Ollama LLM, unchanged, against a tiny daemon's /api routes: chat, stream, structured_predict
and a FunctionAgent tool call.

The LLM's `additional_kwargs` become Ollama `options`, so FLy's options reach the daemon that way:
`loose` (exact mode) and, for the agent, `tool_choice` (a tiny random model never chooses to call a
tool by itself; LlamaIndex's Ollama drops the agent's own tool choice, Ollama having no such field).
The tool returns directly, so the forced choice is needed for one turn only.
"""

# No `from __future__ import annotations`: LlamaIndex builds the tool's schema from `lookup`'s annotations
# later, in its own module, where a string annotation naming Literal cannot be resolved.
from typing import Literal

import pytest
from llama_index.core.agent.workflow import FunctionAgent, ToolCallResult
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from llama_index.llms.ollama import Ollama
from pydantic import BaseModel, Field

from support.daemon_process import serving_http
from fly_llm.client import FLyClient, build_options

CHAT = [ChatMessage(role="user", content="What is 2 + 3?")]


def lookup(key: Literal["fox", "dog"]) -> str:
    """Look up what an animal is like."""
    return {"fox": "quick", "dog": "lazy"}[key]


LOOKUP = FunctionTool.from_defaults(lookup, return_direct=True)


class Pick(BaseModel):
    """A pick a random model can finish."""

    animal: Literal["fox", "dog"]
    n: int = Field(ge=0, le=9)


@pytest.fixture(scope="module")
def served(tiny_pair_dirs, tmp_path_factory):
    """(ipc endpoint, base URL, model name) of a daemon serving the tiny pair in float32."""
    with serving_http(*tiny_pair_dirs, tmp_path_factory.mktemp("ollama_li"), "i") as (daemon, url):
        yield daemon.endpoint, url, str(tiny_pair_dirs[0])


def ollama(served, **options) -> Ollama:
    """LlamaIndex's Ollama on the daemon: greedy, exact mode, `options` as further Ollama options."""
    return Ollama(model=served[2], base_url=served[1], temperature=0, request_timeout=60,
                  additional_kwargs={"num_predict": 24, "loose": False, **options})


def test_context_window_comes_from_show(served):
    assert Ollama(model=served[2], base_url=served[1]).metadata.context_window == 512


def test_chat_equals_the_zeromq_answer_and_streams_it(served):
    llm = ollama(served)
    answer = llm.chat(CHAT)
    with FLyClient(served[0], timeout=60) as zmq:
        same = zmq.chat([{"role": "user", "content": "What is 2 + 3?"}], *build_options(max_tokens=24, loose=False))
    assert answer.message.content == same.text
    assert answer.raw["eval_count"] == same.usage.completion_tokens
    assert "".join(r.delta for r in llm.stream_chat(CHAT)) == same.text
    assert llm.complete("What is 2 + 3?").text == same.text


async def test_async_chat_and_stream(served):
    llm = ollama(served)
    whole = await llm.achat(CHAT)
    deltas = [r.delta async for r in await llm.astream_chat(CHAT)]
    assert "".join(deltas) == whole.message.content


def test_structured_predict(served):
    pick = ollama(served, num_predict=128).structured_predict(Pick, PromptTemplate("Pick an animal for {topic}."),
                                                              topic="a story")
    assert isinstance(pick, Pick)


async def test_function_agent_calls_a_tool(served):
    agent = FunctionAgent(tools=[LOOKUP], llm=ollama(served, num_predict=128, tool_choice="required"), streaming=False)
    handler = agent.run(user_msg="What is the fox like?")
    calls = [event async for event in handler.stream_events() if isinstance(event, ToolCallResult)]
    result = await handler
    assert [c.tool_name for c in calls] == ["lookup"] and calls[0].tool_kwargs["key"] in ("fox", "dog")
    assert calls[0].tool_output.content in ("quick", "lazy") and not calls[0].tool_output.is_error
    assert str(result.response.content) == calls[0].tool_output.content
