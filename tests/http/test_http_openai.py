"""The official `openai` client (sync, async, streaming) and LangChain's ChatOpenAI against a tiny daemon's HTTP front.

The daemon is a subprocess serving the tiny pair on its ipc socket and on http://127.0.0.1:PORT/v1, so
the same requests can be compared across the two doors: exact mode must give the same tokens either way.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from support.daemon_process import serving_http
from fly_llm.client import FLyClient, build_options

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
PROMPTS = ["def add(a, b):", "The quick brown fox", "for i in range(10):", "Question: what is 2 + 3?"]
EXACT = {"loose": False}


@pytest.fixture(scope="module")
def http_daemon(tiny_pair_dirs, tmp_path_factory):
    """(ipc endpoint, base URL of the HTTP front) of a daemon serving the tiny pair in float32."""
    with serving_http(*tiny_pair_dirs, tmp_path_factory.mktemp("http_daemon"), "h") as (daemon, url):
        yield daemon.endpoint, f"{url}/v1"


@pytest.fixture(scope="module")
def client(http_daemon):
    with openai.OpenAI(base_url=http_daemon[1], api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def zmq_client(http_daemon):
    with FLyClient(http_daemon[0], timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(client, tiny_pair_dirs) -> str:
    models = client.models.list().data
    assert [m.id for m in models] == [tiny_pair_dirs[0].name, "all-MiniLM-L6-v2"]  # ids, not paths; the embedder unloaded
    return models[0].id


def test_chat_equals_the_zeromq_answer(client, zmq_client, model):
    answer = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=24, extra_body=EXACT)
    same = zmq_client.chat(MESSAGES, *build_options(max_tokens=24, **EXACT))
    choice = answer.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", same.text,
                                                                                   same.finish_reason)
    counts = {"prompt_tokens", "completion_tokens", "total_tokens"}
    assert answer.usage.model_dump(include=counts) == same.usage.model_dump(include=counts)
    assert answer.usage.prompt_tokens_details.cached_tokens <= answer.usage.prompt_tokens
    stats = answer.model_extra["fly_stats"]
    assert stats["emitted"] == same.usage.completion_tokens and stats["mat"] >= 1


def test_completion_with_stop_and_fly_options(client, zmq_client, model):
    for prompt in PROMPTS:
        plain = client.completions.create(model=model, prompt=prompt, max_tokens=24, extra_body=EXACT)
        stop = plain.choices[0].text[4:6]
        if not stop.strip():
            continue
        cut = client.completions.create(model=model, prompt=prompt, max_tokens=24, stop=stop,
                                        extra_body={**EXACT, "k": 3, "window": 2})
        assert cut.choices[0].text == plain.choices[0].text.split(stop)[0] and cut.choices[0].finish_reason == "stop"
        same = zmq_client.generate(prompt, *build_options(max_tokens=24, stop=[stop], **EXACT))
        assert cut.choices[0].text == same.text
        return
    pytest.fail("no prompt gave a usable stop string")


def test_streaming_concatenates_to_the_whole_answer(client, model):
    whole = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=24, extra_body=EXACT)
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=24, stream=True,
                                            stream_options={"include_usage": True}, extra_body=EXACT)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    text_stream = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=16, stream=True,
                                            extra_body=EXACT)
    pieces = list(text_stream)
    text = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=16, extra_body=EXACT)
    assert "".join(p.choices[0].text for p in pieces) == text.choices[0].text
    assert pieces[-1].usage == text.usage  # without include_usage it rides on the final chunk


def test_async_requests_run_together_and_equal_one_by_one(http_daemon, client, model):
    async def together() -> list[str]:
        async with openai.AsyncOpenAI(base_url=http_daemon[1], api_key="unused", max_retries=0, timeout=60) as a:
            answers = await asyncio.gather(*(a.completions.create(model=model, prompt=p, max_tokens=20,
                                                                   extra_body=EXACT) for p in PROMPTS))
            stream = await a.chat.completions.create(model=model, messages=MESSAGES, max_tokens=20, stream=True,
                                                     extra_body=EXACT)
            streamed = "".join([c.choices[0].delta.content or "" async for c in stream])
        return [r.choices[0].text for r in answers] + [streamed]

    alone = [client.completions.create(model=model, prompt=p, max_tokens=20, extra_body=EXACT).choices[0].text
             for p in PROMPTS]
    alone.append(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=20,
                                                extra_body=EXACT).choices[0].message.content)
    assert asyncio.run(together()) == alone


def test_errors_reach_the_client_as_openai_errors(client, model):
    other = client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)  # any name: the target
    assert other.model == model and other.usage.completion_tokens <= 2
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=model, prompt="x " * 2000, max_tokens=4)  # over the 512-token window
    assert too_long.value.code == "TOO_LONG"
    assert client.completions.create(model=model, prompt="a", max_tokens=2).usage.completion_tokens <= 2


def test_langchain_chat_openai(http_daemon, model):
    langchain_openai = pytest.importorskip("langchain_openai", reason="pip install langchain-openai (in [dev])")
    llm = langchain_openai.ChatOpenAI(base_url=http_daemon[1], api_key="unused", model=model, max_tokens=16,
                                      temperature=0, max_retries=0, extra_body=EXACT, stream_usage=True)
    message = llm.invoke(MESSAGES[1]["content"])
    assert message.usage_metadata["output_tokens"] == message.response_metadata["token_usage"]["completion_tokens"]
    chunks = list(llm.stream(MESSAGES[1]["content"]))
    assert "".join(c.content for c in chunks) == message.content
    streamed_tokens = sum((c.usage_metadata or {}).get("output_tokens", 0) for c in chunks)
    assert streamed_tokens == message.usage_metadata["output_tokens"]  # reported once, not per chunk


def test_llama_index_openai_like(http_daemon, zmq_client, model):
    """LlamaIndex's OpenAILike pointed at the front: chat, completion and a stream, exact mode = ZeroMQ's answer."""
    openai_like = pytest.importorskip("llama_index.llms.openai_like", reason="pip install llama-index-llms-openai-like")
    from llama_index.core.llms import ChatMessage

    llm = openai_like.OpenAILike(api_base=http_daemon[1], api_key="unused", model=model, max_tokens=16,
                                 temperature=0.0, is_chat_model=True, context_window=512, max_retries=0,
                                 additional_kwargs={"extra_body": EXACT})
    answer = llm.chat([ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES])
    expected = zmq_client.chat(MESSAGES, *build_options(max_tokens=16, **EXACT)).text
    assert answer.message.content == expected
    streamed = "".join(r.delta or "" for r in llm.stream_chat([ChatMessage(role="user", content=PROMPTS[1])]))
    assert streamed == llm.chat([ChatMessage(role="user", content=PROMPTS[1])]).message.content
    text = openai_like.OpenAILike(api_base=http_daemon[1], api_key="unused", model=model, max_tokens=8,
                                  temperature=0.0, is_chat_model=False, max_retries=0).complete(PROMPTS[0])
    assert text.text and text.raw.usage.completion_tokens >= 1


def test_tools_and_response_format_through_the_openai_client(client, model):
    """The grammar makes the tiny random model's calls and JSON valid; the OpenAI shapes carry them."""
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"key": {"enum": ["fox", "dog"]}}, "required": ["key"],
        "additionalProperties": False}}}]
    ask = [{"role": "user", "content": "Which animal?"}]
    answer = client.chat.completions.create(model=model, messages=ask, tools=tools, tool_choice="required",
                                            max_tokens=80)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name == "lookup" and json.loads(call.function.arguments)["key"] in ("fox", "dog")
    follow = [*ask, choice.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "fox"}]
    assert client.chat.completions.create(model=model, messages=follow, max_tokens=4).choices[0].message.content
    chunks = list(client.chat.completions.create(model=model, messages=ask, tools=tools, tool_choice="required",
                                                 max_tokens=80, stream=True))
    streamed = [c for chunk in chunks for choice in chunk.choices for c in choice.delta.tool_calls or ()]
    assert streamed and streamed[0].index == 0 and streamed[0].function.name == "lookup"
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    fmt = client.chat.completions.create(model=model, messages=ask, max_tokens=40, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert json.loads(fmt.choices[0].message.content)["ok"] in (True, False)
