"""FLyLLM against a real daemon on the tiny random pair (`tiny_daemon`): behaviour, not wording."""

from __future__ import annotations

import threading

import pytest
import zmq
from langchain_core.callbacks import AsyncCallbackHandler, BaseCallbackHandler

from fly_llm.client import FLyClient
from fly_llm.common.errors import Busy, FLyUnavailable
from fly_llm.common.protocol import ErrorReply, GenerateRequest, HealthReply, decode_request, encode
from langchain_fly import FLyLLM

PROMPTS = ["def add(a, b):", "The quick brown fox", "for i in range(10):", "class Stack:",
           "Question: what is 2 + 3?", "Speculative decoding drafts", "The dog sleeps",
           "Retrieval augmented generation", "def fibonacci(n):"]


class TokenCounter(BaseCallbackHandler):
    """Collects the tokens LangChain reports through on_llm_new_token."""

    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs) -> None:
        self.tokens.append(token)


class AsyncTokenCounter(AsyncCallbackHandler):
    """The async twin of TokenCounter, for astream/ainvoke."""

    def __init__(self) -> None:
        self.tokens: list[str] = []

    async def on_llm_new_token(self, token: str, **kwargs) -> None:
        self.tokens.append(token)


@pytest.fixture
def llm(tiny_daemon: str) -> FLyLLM:
    """Greedy and exact (loose=False), so equal requests give equal text."""
    return FLyLLM(endpoint=tiny_daemon, max_tokens=24, temperature=0, loose=False)


def next_batch_size(endpoint: str, limit: int = 32) -> int:
    """A batch bigger than any the daemon ran so far: seeing it afterwards proves one batch."""
    with FLyClient(endpoint) as client:
        seen = client.status().max_batch_size_seen
    assert seen < limit, "the daemon already ran a full batch; this test needs a fresh daemon"
    return max(seen + 1, 3)


LONG = 200
"""Tokens per answer in the one-batch tests: every request is still running when the last one is admitted
(preparation runs on several threads, and a 24-token answer ended first once in the full suite on a busy machine)."""


def max_batch_seen(endpoint: str) -> int:
    with FLyClient(endpoint) as client:
        return client.status().max_batch_size_seen


def test_invoke_returns_text_with_usage_and_fly_stats(llm: FLyLLM) -> None:
    result = llm.generate(["def add(a, b):"])
    generation = result.generations[0][0]
    assert isinstance(generation.text, str) and generation.text
    info = generation.generation_info
    usage = info["usage"]
    assert usage["input_tokens"] == llm.get_num_tokens("def add(a, b):")
    assert len(llm.get_token_ids("def add(a, b):")) == usage["input_tokens"]
    assert 1 <= usage["output_tokens"] <= 24
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert info["finish_reason"] in ("stop", "length")
    assert info["model_name"]
    assert info["fly_stats"]["mat"] > 0
    assert info["fly_stats"]["accepted_loose"] == 0  # loose=False: exact decoding accepts nothing loosely
    assert result.llm_output["token_usage"]["total_tokens"] == usage["total_tokens"]
    assert llm.invoke("def add(a, b):") == generation.text


def test_max_tokens_per_call_overrides_the_field(llm: FLyLLM) -> None:
    generation = llm.generate(["The quick brown fox"], max_tokens=3).generations[0][0]
    assert generation.generation_info["usage"]["output_tokens"] <= 3
    with pytest.raises(TypeError, match="unknown option"):
        llm.invoke("x", max_new_tokens=3)


def test_batch_is_one_daemon_batch(llm: FLyLLM, batch_daemon: str) -> None:
    llm = llm.model_copy(update={"endpoint": batch_daemon, "max_tokens": LONG})
    n = next_batch_size(batch_daemon)
    prompts = PROMPTS[:n]
    outputs = llm.batch(prompts)
    assert max_batch_seen(batch_daemon) >= n
    assert len(outputs) == n and all(isinstance(o, str) for o in outputs)
    assert outputs == [llm.invoke(p) for p in prompts]  # batched output equals each request alone


async def test_abatch_is_one_daemon_batch(llm: FLyLLM, batch_daemon: str) -> None:
    llm = llm.model_copy(update={"endpoint": batch_daemon, "max_tokens": LONG})
    n = next_batch_size(batch_daemon)
    prompts = PROMPTS[:n]
    outputs = await llm.abatch(prompts)
    assert max_batch_seen(batch_daemon) >= n
    assert outputs == llm.batch(prompts)


def test_stream_reports_every_chunk_to_callbacks(llm: FLyLLM) -> None:
    counter = TokenCounter()
    chunks = list(llm.stream("def fibonacci(n):", config={"callbacks": [counter]}))
    assert "".join(chunks) == llm.invoke("def fibonacci(n):")
    assert [t for t in counter.tokens if t] == [c for c in chunks if c]
    assert len([c for c in chunks if c]) >= 1


def test_streaming_field_streams_invoke(tiny_daemon: str, llm: FLyLLM) -> None:
    streaming = FLyLLM(endpoint=tiny_daemon, max_tokens=24, temperature=0, loose=False, streaming=True)
    counter = TokenCounter()
    text = streaming.invoke("class Stack:", config={"callbacks": [counter]})
    assert text == llm.invoke("class Stack:")
    assert "".join(counter.tokens) == text and counter.tokens


async def test_async_invoke_and_stream(llm: FLyLLM) -> None:
    expected = llm.invoke("for i in range(10):")
    assert await llm.ainvoke("for i in range(10):") == expected
    counter = AsyncTokenCounter()
    chunks = [c async for c in llm.astream("for i in range(10):", config={"callbacks": [counter]})]
    assert "".join(chunks) == expected
    assert "".join(counter.tokens) == expected


def test_stop_strings_cut_and_a_call_replaces_the_instance_stops(tiny_daemon: str, llm: FLyLLM) -> None:
    full = llm.invoke("The dog sleeps", max_tokens=48)
    assert len(full) >= 12, "the tiny model should say something to cut"
    first, second = full[8:10], full[4:6]
    cut = full[:full.find(first)]
    assert llm.invoke("The dog sleeps", max_tokens=48, stop=[first]) == cut
    with_instance_stop = FLyLLM(endpoint=tiny_daemon, temperature=0, loose=False, max_tokens=48, stop=[first])
    assert with_instance_stop.invoke("The dog sleeps") == cut
    assert full.find(second) < full.find(first)
    assert with_instance_stop.invoke("The dog sleeps", stop=[second]) == full[:full.find(second)]
    later = next(full[i:i + 2] for i in range(full.find(first) + 2, len(full) - 1)
                 if full.find(full[i:i + 2]) > full.find(first))
    assert with_instance_stop.invoke("The dog sleeps", stop=[later]) == full[:full.find(later)]  # first not kept
    assert with_instance_stop.invoke("The dog sleeps", stop=[]) == full  # stop=[] means none


def test_model_cannot_be_switched_per_call(llm: FLyLLM) -> None:
    with pytest.raises(ValueError, match="cannot switch models"):
        llm.invoke("x", model="some-other-model")


def test_unavailable_daemon_is_a_clear_error(tmp_path) -> None:
    llm = FLyLLM(endpoint=f"ipc://{tmp_path}/nobody.sock", timeout=1.0, max_retries=0)
    with pytest.raises(FLyUnavailable, match="no answer"):
        llm.invoke("hello")
    with pytest.raises(FLyUnavailable):
        llm.get_num_tokens("hello")


async def test_unavailable_daemon_is_a_clear_error_async(tmp_path) -> None:
    llm = FLyLLM(endpoint=f"ipc://{tmp_path}/nobody.sock", timeout=1.0, max_retries=0)
    with pytest.raises(FLyUnavailable):
        await llm.ainvoke("hello")


class BusyDaemon:
    """A ROUTER socket that refuses every generate request with BUSY and counts them."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.generate_requests = 0
        self._socket = zmq.Context.instance().socket(zmq.ROUTER)
        self._socket.bind(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._socket.poll(50):
                continue
            peer, frame = self._socket.recv_multipart()
            request = decode_request(frame)
            if isinstance(request, GenerateRequest):
                self.generate_requests += 1
                reply = ErrorReply(id=request.id, code="BUSY", message="admission queue full")
            else:
                reply = HealthReply(id=request.id, state="ready")
            self._socket.send_multipart([peer, encode(reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close(0)


@pytest.mark.parametrize("retries", [0, 2])
def test_busy_is_distinguishable_and_retried(tmp_path, retries: int) -> None:
    daemon = BusyDaemon(f"ipc://{tmp_path}/busy.sock")
    try:
        llm = FLyLLM(endpoint=daemon.endpoint, timeout=10.0, max_retries=retries)
        with pytest.raises(Busy) as caught:
            llm.invoke("hello")
        assert not isinstance(caught.value, FLyUnavailable)
        assert daemon.generate_requests == retries + 1
    finally:
        daemon.close()
