"""ChatFLy beyond the standard suites: message conversion, options, metadata, batching, streaming.

Tests that take the `chat` or `tiny_daemon` fixture run against a real daemon on the tiny random
pair (behaviour, not wording); the rest need no daemon.
"""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from langchain_core.load import dumpd, load
from langchain_core.messages import (
    AIMessage, AIMessageChunk, ChatMessage as LCChatMessage, HumanMessage, SystemMessage, ToolMessage,
)

from langchain_fly import ChatFLy
from langchain_fly.chat_models import to_wire
from test_langchain_llm import LONG, TokenCounter, max_batch_seen, next_batch_size

OFFLINE = "tcp://127.0.0.1:5599"
QUESTIONS = ["hello", "def add(a, b):", "what is 2 + 3?", "tell me about dogs", "class Stack:",
             "for i in range(10):", "speculative decoding", "the quick brown fox", "retrieval"]


@pytest.fixture
def chat(tiny_daemon: str) -> ChatFLy:
    """Greedy and exact (loose=False), so equal requests give equal text."""
    return ChatFLy(endpoint=tiny_daemon, max_tokens=24, temperature=0, loose=False)


# ---- no daemon ----

def test_client_side_imports_no_torch() -> None:
    code = "import sys, langchain_fly; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_messages_become_chat_turns() -> None:
    messages = [SystemMessage("be brief"), HumanMessage("hi", name="example_user"), AIMessage("hello"),
                ToolMessage("42", tool_call_id="t1"), LCChatMessage(role="user", content="again"),
                HumanMessage(content=[{"type": "text", "text": "a"}, "b"])]
    assert [(m.role, m.content) for m in to_wire(messages)] == [
        ("system", "be brief"), ("user", "hi"), ("assistant", "hello"), ("tool", "42"), ("user", "again"),
        ("user", "ab")]
    with pytest.raises(ValueError, match="text only"):
        to_wire([HumanMessage(content=[{"type": "image_url", "image_url": {"url": "x"}}])])
    with pytest.raises(ValueError, match="cannot send"):
        to_wire([LCChatMessage(role="narrator", content="x")])


def test_tracing_params() -> None:
    chat = ChatFLy(endpoint=OFFLINE, model="qwen-coder", temperature=0.2, max_tokens=9, stop=["a"])
    params = chat._get_ls_params(stop=["b"])
    assert params["ls_provider"] == "fly" and params["ls_model_type"] == "chat"
    assert params["ls_model_name"] == "qwen-coder"
    assert params["ls_temperature"] == 0.2 and params["ls_max_tokens"] == 9
    assert params["ls_stop"] == ["b"]  # a call's stop replaces the instance's
    assert chat._get_ls_params()["ls_stop"] == ["a"]
    assert ChatFLy(endpoint=OFFLINE)._get_ls_params()["ls_model_name"] == "fly"


def test_bad_options_fail_before_any_request() -> None:
    chat = ChatFLy(endpoint=OFFLINE, model="qwen-coder")
    with pytest.raises(ValueError, match="cannot switch models"):
        chat.invoke("hi", model="llama")
    with pytest.raises(TypeError, match="unknown option"):
        chat.invoke("hi", max_new_tokens=4)


def test_serialisation_round_trip() -> None:
    chat = ChatFLy(endpoint=OFFLINE, max_tokens=7, window=4, loose=True)
    loaded = load(dumpd(chat), valid_namespaces=["langchain_fly"], allowed_objects=[ChatFLy])
    assert isinstance(loaded, ChatFLy)
    assert loaded.model_dump() == chat.model_dump()


def test_models_copy_and_pickle_with_the_right_endpoint() -> None:
    chat = ChatFLy(endpoint=OFFLINE, max_tokens=5)
    for copied in (copy.deepcopy(chat), pickle.loads(pickle.dumps(chat))):
        assert copied.max_tokens == 5 and copied._client.endpoint == OFFLINE
    moved = chat.model_copy(update={"endpoint": "tcp://127.0.0.1:6000"})
    assert moved._client.endpoint == "tcp://127.0.0.1:6000"
    assert moved._async_client.endpoint == "tcp://127.0.0.1:6000"


# ---- against the tiny daemon ----

def test_metadata_usage_and_token_count(chat: ChatFLy) -> None:
    messages = [SystemMessage("be brief"), HumanMessage("hello")]
    message = chat.invoke(messages)
    assert isinstance(message, AIMessage) and message.content
    usage = message.usage_metadata
    assert usage["input_tokens"] == chat.get_num_tokens_from_messages(messages)
    assert 1 <= usage["output_tokens"] <= 24
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    meta = message.response_metadata
    assert meta["model_name"] and meta["finish_reason"] in ("stop", "length")
    assert set(meta["fly_stats"]) >= {"mat", "accepted_loose", "accepted_native", "rounds", "drafted"}
    assert meta["fly_stats"]["accepted_loose"] == 0  # loose=False: exact decoding


def test_a_repeated_prompt_reads_the_prefix_cache(chat: ChatFLy) -> None:
    """The tiny daemon runs with the default prefix cache: the second identical call reuses the first's prompt."""
    messages = [SystemMessage("be brief"), HumanMessage("what is 2 + 3?")]
    first, again = (chat.invoke(messages).usage_metadata for _ in range(2))
    assert 0 < again["input_token_details"]["cache_read"] < again["input_tokens"] == first["input_tokens"]


def test_fly_options_pass_through(chat: ChatFLy) -> None:
    loose = chat.bind(loose=True, window=0, entropy_threshold=0.0, k=4)
    meta = loose.invoke("def add(a, b):").response_metadata
    assert meta["fly_stats"]["rounds"] >= 1
    short = chat.bind(max_tokens=2).invoke("hello")
    assert short.usage_metadata["output_tokens"] <= 2


def test_stream_ends_with_usage_and_fires_callbacks(chat: ChatFLy) -> None:
    counter = TokenCounter()
    chunks = list(chat.stream("tell me about dogs", config={"callbacks": [counter]}))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    last = chunks[-1]
    assert last.chunk_position == "last"
    assert last.usage_metadata["output_tokens"] >= 1
    assert last.response_metadata["fly_stats"]["rounds"] >= 1
    text = "".join(c.content for c in chunks)
    assert text == chat.invoke("tell me about dogs").content
    assert "".join(counter.tokens) == text


def test_batch_is_one_daemon_batch(chat: ChatFLy, batch_daemon: str) -> None:
    chat = chat.model_copy(update={"endpoint": batch_daemon, "max_tokens": LONG})  # all still running at the last
    n = next_batch_size(batch_daemon)
    outputs = chat.batch(QUESTIONS[:n])
    assert max_batch_seen(batch_daemon) >= n
    assert [o.content for o in outputs] == [chat.invoke(q).content for q in QUESTIONS[:n]]


async def test_abatch_is_one_daemon_batch(chat: ChatFLy, batch_daemon: str) -> None:
    chat = chat.model_copy(update={"endpoint": batch_daemon, "max_tokens": LONG})  # all still running at the last
    n = next_batch_size(batch_daemon)
    outputs = await chat.abatch(QUESTIONS[:n])
    assert max_batch_seen(batch_daemon) >= n
    assert [o.content for o in outputs] == [o.content for o in chat.batch(QUESTIONS[:n])]


def test_streaming_field_streams_invoke(chat: ChatFLy, tiny_daemon: str) -> None:
    streaming = ChatFLy(endpoint=tiny_daemon, max_tokens=24, temperature=0, loose=False, streaming=True)
    counter = TokenCounter()
    message = streaming.invoke("hello", config={"callbacks": [counter]})
    assert message.content == chat.invoke("hello").content
    assert "".join(counter.tokens) == message.content
    assert message.usage_metadata["output_tokens"] >= 1


def test_example_chain_runs(tiny_daemon: str) -> None:
    example = Path(__file__).parents[2] / "examples" / "langchain_chain.py"
    run = subprocess.run([sys.executable, str(example), "--endpoint", tiny_daemon, "--max-tokens", "8", "hello"],
                         capture_output=True, text=True, timeout=120, check=True)
    assert run.stdout.strip()
    assert "tokens per pass" in run.stderr
