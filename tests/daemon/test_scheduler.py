"""The scheduler in-process on a real tiny engine: the loading queue, batch limits, failed steps.

The scheduler runs in its own thread as in the daemon; its `load_engine` blocks on an Event, so a
test decides when loading ends (or fails). Replies are collected from `emit`. The socket-level
version (a real Server and FLyClient) is test_loading_state_then_ready in test_daemon_server.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
from support.engine_double import Replies

from fly_llm.common.config import FLyConfig, SamplingParams
from fly_llm.common.errors import Busy, NotReady
from fly_llm.common.protocol import ErrorReply, GenerateRequest, GenerateResult, TokenizeReply, TokenizeRequest

from fly_daemon.scheduling.scheduler import Limits, Scheduler

CLIENT = (b"client",)
NO_HEARTBEATS = Limits(heartbeat_timeout=0)  # these tests send none


@pytest.fixture(scope="module")
def engine():
    from support.tiny_models import make_pair

    from fly_llm.decoding.engine import FLyEngine

    target, draft, tokenizer = make_pair("llama")
    return FLyEngine(target, tokenizer, draft, FLyConfig(loose=False))


@pytest.fixture
def loading(engine) -> Iterator[Callable[..., tuple[Scheduler, Replies, threading.Event]]]:
    """Start a scheduler whose load waits for the returned Event (then returns `engine` or raises `error`)."""
    started: list[tuple[Scheduler, threading.Event, threading.Thread]] = []

    def start(limits: Limits = NO_HEARTBEATS, error: Exception | None = None):
        go = threading.Event()

        def load():
            assert go.wait(30)
            if error is not None:
                raise error
            return engine

        replies = Replies()
        scheduler = Scheduler(load, replies, limits)
        thread = threading.Thread(target=scheduler.run, daemon=True)
        thread.start()
        started.append((scheduler, go, thread))
        return scheduler, replies, go

    yield start
    for scheduler, go, thread in started:
        go.set()
        scheduler.drain(force=True)
        thread.join(30)
        assert not thread.is_alive()


def _generate(rid: str, max_tokens: int = 4, **extra) -> GenerateRequest:
    return GenerateRequest(id=rid, prompt="def add(a, b):", sampling=SamplingParams(max_tokens=max_tokens), **extra)


def test_requests_sent_while_loading_are_served_after_load(loading, engine):
    scheduler, replies, go = loading()
    scheduler.submit(CLIENT, _generate("g1"))
    scheduler.tokenize(CLIENT, TokenizeRequest(id="t1", text="hello world"))
    time.sleep(0.3)
    assert scheduler.state == "loading" and replies.by_id == {}
    assert scheduler.snapshot()["queue_depth"] == 1
    go.set()
    result = replies.final("g1")
    assert isinstance(result, GenerateResult) and result.usage.completion_tokens == 4
    tokens = replies.final("t1")
    assert isinstance(tokens, TokenizeReply) and tokens.token_ids == engine.encode(prompt="hello world")
    assert scheduler.state == "ready"


def test_deadline_counts_while_loading(loading):
    scheduler, replies, go = loading()
    scheduler.submit(CLIENT, _generate("short", timeout_s=0.2))
    scheduler.submit(CLIENT, _generate("patient", timeout_s=60))
    time.sleep(0.4)
    scheduler.expire_queued()  # what the server's socket loop does on every poll while models load
    timed_out = replies.final("short", timeout=1)
    assert isinstance(timed_out, ErrorReply) and timed_out.code == "TIMEOUT"
    assert "patient" not in replies.by_id and scheduler.state == "loading"
    go.set()
    assert isinstance(replies.final("patient"), GenerateResult)


def test_queue_bound_applies_while_loading(loading):
    scheduler, replies, go = loading(Limits(queue_size=2, heartbeat_timeout=0))
    scheduler.submit(CLIENT, _generate("a"))
    scheduler.submit(CLIENT, _generate("b"))
    with pytest.raises(Busy):
        scheduler.submit(CLIENT, _generate("c"))
    go.set()
    assert all(isinstance(replies.final(r), GenerateResult) for r in ("a", "b"))


def test_failed_load_answers_every_queued_request(loading):
    scheduler, replies, go = loading(error=RuntimeError("weights are corrupt"))
    scheduler.submit(CLIENT, _generate("g1"))
    scheduler.submit((b"other",), _generate("g2", stream=True))
    scheduler.tokenize(CLIENT, TokenizeRequest(id="t1", text="hi"))
    go.set()
    for rid in ("g1", "g2", "t1"):
        reply = replies.final(rid, timeout=10)
        assert isinstance(reply, ErrorReply) and reply.code == NotReady.code
        assert "weights are corrupt" in reply.message
    assert scheduler.state == "failed"
    with pytest.raises(NotReady, match="weights are corrupt"):
        scheduler.submit(CLIENT, _generate("late"))
    with pytest.raises(NotReady, match="weights are corrupt"):
        scheduler.tokenize(CLIENT, TokenizeRequest(id="t2", text="hi"))


def test_draining_still_refuses_new_work(loading):
    scheduler, replies, go = loading()
    go.set()
    scheduler.submit(CLIENT, _generate("warm"))
    assert isinstance(replies.final("warm"), GenerateResult)
    scheduler.drain()
    with pytest.raises(NotReady, match="draining"):
        scheduler.submit(CLIENT, _generate("late"))
    with pytest.raises(NotReady, match="draining"):
        scheduler.tokenize(CLIENT, TokenizeRequest(id="t", text="hi"))


def test_batch_limit_holds_and_a_failed_step_fails_only_its_batch(engine):
    """Five requests, at most two in the engine: the first step fails (its one or two get INTERNAL,
    the engine resets), the rest are then served, each with the target's greedy answer."""
    from fly_llm.decoding.engine import FLyEngine

    class FailsOnce(FLyEngine):
        failed, widest = False, 0

        def _round(self):
            self.widest = max(self.widest, self.num_active)
            if not self.failed:
                self.failed = True
                raise RuntimeError("injected")
            return super()._round()

    failing = FailsOnce(engine.target, engine.tokenizer, engine.draft, FLyConfig(loose=False))
    replies = Replies()
    scheduler = Scheduler(lambda: failing, replies, Limits(max_batch_size=2, heartbeat_timeout=0))
    for i in range(5):
        scheduler.submit(CLIENT, _generate(f"r{i}", max_tokens=6))
    thread = threading.Thread(target=scheduler.run, daemon=True)
    thread.start()
    try:
        finals = [replies.final(f"r{i}") for i in range(5)]
    finally:
        scheduler.drain(force=True)
        thread.join(30)
    errors = [f for f in finals if isinstance(f, ErrorReply)]  # the first step's batch: 1 or 2 (whichever
    assert len(errors) in (1, 2)                               # were prepared first; preparation runs in parallel)
    assert all(f.code == "INTERNAL" and "engine step failed" in f.message and "injected" not in f.message
               for f in errors)  # our message: the exception's text stays in the log
    expected = engine.generate("def add(a, b):", SamplingParams(max_tokens=6), FLyConfig(loose=False))[0].token_ids
    assert all(f.token_ids == expected for f in finals if not isinstance(f, ErrorReply))
    assert failing.widest <= 2 and scheduler.state in ("ready", "draining")


def test_a_repeated_prompt_reports_cached_tokens_in_usage_status_and_metrics():
    from support.tiny_models import make_pair

    from fly_llm.decoding.engine import FLyEngine

    from fly_daemon.metrics import Metrics

    target, draft, tokenizer = make_pair("llama")
    cached = FLyEngine(target, tokenizer, draft, FLyConfig(loose=False), prefix_cache_bytes=1 << 20, prefix_block=4)
    replies, metrics = Replies(), Metrics()
    scheduler = Scheduler(lambda: cached, replies, NO_HEARTBEATS, metrics)
    thread = threading.Thread(target=scheduler.run, daemon=True)
    thread.start()
    try:
        scheduler.submit(CLIENT, _generate("first", 6))
        first = replies.final("first")
        scheduler.submit(CLIENT, _generate("again", 6))
        again = replies.final("again")
    finally:
        scheduler.drain(force=True)
        thread.join(30)
    n = first.usage.prompt_tokens
    assert (first.usage.cached_tokens, again.usage.cached_tokens) == (0, n - 1)
    assert again.token_ids == first.token_ids
    prompt = scheduler.snapshot()["prompt"]
    assert (prompt.prompt_tokens, prompt.cached_tokens, prompt.prefilled_tokens) == (2 * n, n - 1, n - 1)
    assert prompt.hit_rate == pytest.approx((n - 1) / (2 * n)) and prompt.cache_bytes > 0
    sample = metrics.registry.get_sample_value
    assert sample("fly_prefix_cache_hit_tokens_total") == n - 1 and sample("fly_prefill_tokens_total") == n - 1
    assert sample("fly_prefix_cache_bytes") == prompt.cache_bytes
    assert sample("fly_prefix_cache_evictions_total") == 0


@pytest.mark.parametrize("share", [False, True])
def test_tenants_do_not_see_each_others_cached_prompts_unless_shared(share):
    """Issue 33 finding 7: a prompt another tenant sent was a cache hit (cached_tokens told it token by
    token). Per tenant by default: a stranger's repeat of it is prefilled in full, the sender's own
    repeat hits; with share_prefix_cache every client hits."""
    from support.tiny_models import make_pair

    from fly_llm.decoding.engine import FLyEngine

    target, draft, tokenizer = make_pair("llama")
    cached = FLyEngine(target, tokenizer, draft, FLyConfig(loose=False), prefix_cache_bytes=1 << 20, prefix_block=4)
    replies = Replies()
    scheduler = Scheduler(lambda: cached, replies, Limits(heartbeat_timeout=0, share_prefix_cache=share))
    thread = threading.Thread(target=scheduler.run, daemon=True)
    thread.start()
    try:
        hits = {}
        for rid, envelope, tenant in [("alice", CLIENT, "curve:alice"), ("bob", (b"bob",), "curve:bob"),
                                      ("alice-again", (b"alice-2",), "curve:alice")]:
            scheduler.submit(envelope, _generate(rid, 6), tenant=tenant)
            hits[rid] = replies.final(rid).usage.cached_tokens
    finally:
        scheduler.drain(force=True)
        thread.join(30)
    assert hits["alice"] == 0 and hits["alice-again"] > 0
    assert hits["bob"] == (hits["alice-again"] if share else 0)
