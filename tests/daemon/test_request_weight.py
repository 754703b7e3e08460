"""Issue 45 findings 4 and 6: `n`, `echo` and `logprobs` multiply a request's work and reply size.

A request weighs its max_tokens plus its echoed prompt tokens, so `n` choices weigh `n × max_tokens` against
the client's `max_tokens_per_client` (BUSY beyond it, another client unaffected); all choices' replies
together carry at most `max_reply_units` token entries (TOO_LONG, HTTP 400, before any work). On the
engine double: through the scheduler, and through the OpenAI door where `n` is set.
"""

from __future__ import annotations

import time

import httpx
import pytest
from support.engine_double import CountingEngine, running, serving

from fly_llm.common.config import SamplingParams
from fly_llm.common.errors import Busy, TooLong
from fly_llm.common.protocol import ErrorReply, GenerateRequest, GenerateResult

from fly_daemon.limits import Limits
from fly_daemon.scheduling.request_weight import check_reply_size, reply_units, weight
from fly_daemon.settings import DaemonSettings

A, B = (b"a",), (b"b",)
MODEL = CountingEngine.target_name


def generate(rid: str, words: int = 3, max_tokens: int = 3, **extra) -> GenerateRequest:
    return GenerateRequest(id=rid, prompt=" ".join(["w"] * words), sampling=SamplingParams(max_tokens=max_tokens),
                           **extra)


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_weight_and_reply_units_count_choices_echo_and_alternatives():
    plain = generate("p", max_tokens=100)
    assert (weight(plain, 50), reply_units(plain, 50)) == (100, 100)
    echoed = generate("e", max_tokens=100, logprobs=4, prompt_logprobs=True, choices=16)
    assert weight(echoed) == 100 and weight(echoed, 50) == 150  # the echoed prompt counts once it is tokenized
    assert reply_units(echoed, 50) == 16 * 150 * 5
    check_reply_size(echoed, 50, 16 * 150 * 5)
    with pytest.raises(TooLong, match=r"choices 16 × \(echoed prompt tokens 50 \+ max_tokens 100\) × "
                                      r"\(1 \+ top logprobs 4\)\), more than the daemon's max_reply_units 11999"):
        check_reply_size(echoed, 50, 16 * 150 * 5 - 1)


def test_a_clients_requests_weigh_their_tokens_not_their_count():
    """Four choices of 250 tokens fill a client's 1,000; a fifth is BUSY while another client is served; a
    request heavier than the cap alone is TOO_LONG; once the client's requests end, it is admitted again."""
    limits = Limits(heartbeat_timeout=0, max_tokens_per_client=1000)
    with running(CountingEngine(step_s=0.01), limits) as (scheduler, replies):
        for i in range(4):
            scheduler.submit(A, generate(f"a{i}", max_tokens=250, choices=4))
        with pytest.raises(Busy, match="already weigh 1000 tokens; 1 more exceed the daemon's max_tokens_per_client"):
            scheduler.submit(A, generate("a4", max_tokens=1))
        scheduler.submit(B, generate("b", max_tokens=250))
        with pytest.raises(TooLong, match="max_tokens_per_client 1000"):
            scheduler.submit(B, generate("huge", max_tokens=1001))
        assert isinstance(replies.final("b"), GenerateResult)
        for i in range(4):
            assert isinstance(replies.final(f"a{i}"), GenerateResult)
        scheduler.submit(A, generate("a5", max_tokens=250))
        assert isinstance(replies.final("a5"), GenerateResult)
        scheduler.check()


def test_echoed_prompt_tokens_weigh_once_tokenized():
    """A request's echoed prompt adds to its client's weight once tokenized: 30 + 60 + 20 > 100, where
    max_tokens alone (30 + 20) would fit."""
    limits = Limits(heartbeat_timeout=0, max_tokens_per_client=100)
    with running(CountingEngine(step_s=0.05), limits) as (scheduler, replies):
        scheduler.submit(A, generate("echo", words=60, max_tokens=30, logprobs=0, prompt_logprobs=True, stream=True))
        wait_for(lambda: "echo" in replies.by_id)  # running: its 60 prompt tokens weigh too
        with pytest.raises(Busy, match="already weigh 90 tokens"):
            scheduler.submit(A, generate("more", max_tokens=20))
        scheduler.cancel(A, "echo")


def test_too_many_reply_units_are_too_long_before_any_work():
    engine = CountingEngine()
    limits = Limits(heartbeat_timeout=0, max_reply_units=400)
    with running(engine, limits) as (scheduler, replies):
        scheduler.submit(A, generate("big", words=40, max_tokens=10, logprobs=4, prompt_logprobs=True, choices=2))  # 500
        reply = replies.final("big")
        assert isinstance(reply, ErrorReply) and reply.code == TooLong.code and "max_reply_units 400" in reply.message
        scheduler.submit(A, generate("fits", words=40, max_tokens=10, logprobs=4, choices=2))  # 2 × 10 × 5
        assert isinstance(replies.final("fits"), GenerateResult)
        assert "big" not in engine.scopes  # never added to the engine


def test_n_echo_and_logprobs_over_http_are_a_400_naming_the_budget(tmp_path):
    """Through the OpenAI door `n` reaches the daemon: 16 choices of 50 tokens fit the budget, with echo and 20
    alternatives per token (16 × (8 + 50) × 21 = 19,488 entries) they do not."""
    limits = Limits(heartbeat_timeout=0, max_reply_units=10_000)
    with serving(f"ipc://{tmp_path}/s.sock", CountingEngine(), limits) as server:
        http = server.core.http_front(DaemonSettings(http="127.0.0.1:0"))
        http.start()
        try:
            with httpx.Client(base_url=http.url, timeout=30) as client:
                body = {"model": MODEL, "prompt": "a b c d e f g h", "max_tokens": 50, "n": 16}
                plain = client.post("/v1/completions", json=body)
                assert plain.status_code == 200 and len(plain.json()["choices"]) == 16, plain.text
                echoed = client.post("/v1/completions", json={**body, "echo": True, "logprobs": 20})
                assert echoed.status_code == 400, echoed.text
                error = echoed.json()["error"]
                assert error["code"] == TooLong.code and error["message"].startswith("the reply would carry 19488 ")
                assert "choices 16" in error["message"] and "max_reply_units 10000" in error["message"]
        finally:
            http.stop()
