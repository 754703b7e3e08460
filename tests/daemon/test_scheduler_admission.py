"""Admission on the engine double (issue 33, findings 6 and 7): prompts are prepared off the model
thread, the character limit comes before tokenizing, one client cannot fill the queue, a failing
queue cannot hold up a running stream, each tenant gets its own cache scope, a failure on one
request's output fails only it, and heartbeats touch only their sender's requests.

The last test is a seeded random walk over submit / cancel / touch / client_gone / tokenize /
preparation (some of it failing) / model-thread turns from several clients, with `Scheduler.check()`
after every step and exactly one final reply per accepted request at the end.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future

import pytest
from support.engine_double import MODEL_THREAD, CountingEngine, Replies, running

from fly_llm.common.config import SamplingParams
from fly_llm.common.errors import BadRequest, Busy, FLyError, TooLong
from fly_llm.common.protocol import ErrorReply, GenerateRequest, GenerateResult, TokenChunk, TokenizeRequest
from fly_llm.common.tool_formats.hermes import ToolCallStream

from fly_daemon.scheduling.scheduler import ADMISSIONS_PER_TURN, Limits, Scheduler

A, B, C = (b"a",), (b"b",), (b"c",)
NO_HEARTBEATS = Limits(heartbeat_timeout=0)
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


class Recording(CountingEngine):
    """The double, recording which thread encodes and compiles, and the add_request calls between steps.

    A prompt containing "BOOM" cannot be encoded (as a chat template may refuse odd input).
    """

    def __init__(self, step_s: float = 0.0) -> None:
        super().__init__(step_s)
        self.threads: list[tuple[str, str]] = []  # (what, thread name)
        self.encoded: list[str] = []
        self.adds_between_steps = [0]

    def encode(self, prompt=None, messages=None, tools=None, add_special=True, infill=None) -> list[int]:
        self.threads.append(("encode", threading.current_thread().name))
        text = prompt if prompt is not None else " ".join(m["content"] for m in messages)
        self.encoded.append(text)
        if "BOOM" in text:
            raise ValueError("the template refuses this")
        return super().encode(prompt, messages, tools)

    def compile_constraint(self, constraint, scope=""):
        self.threads.append(("compile", threading.current_thread().name))
        return super().compile_constraint(constraint, scope)

    def add_request(self, *args, **kwargs) -> None:
        self.adds_between_steps[-1] += 1
        super().add_request(*args, **kwargs)

    def step(self):
        self.adds_between_steps.append(0)
        return super().step()


def generate(rid: str, words: int = 3, max_tokens: int = 3, **extra) -> GenerateRequest:
    return GenerateRequest(id=rid, prompt=" ".join(["w"] * words), sampling=SamplingParams(max_tokens=max_tokens),
                           **extra)


def chat(rid: str, max_tokens: int = 3, **extra) -> GenerateRequest:
    return GenerateRequest(id=rid, messages=[{"role": "user", "content": "call it"}],
                           sampling=SamplingParams(max_tokens=max_tokens), **extra)


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_prompts_grammars_and_tokenize_requests_are_prepared_off_the_model_thread():
    engine = Recording()
    with running(engine) as (scheduler, replies):
        scheduler.submit(A, generate("plain"))
        scheduler.submit(A, chat("tools", tools=TOOLS, tool_choice="required"))
        scheduler.tokenize(A, TokenizeRequest(id="count", text="one two three"))
        assert isinstance(replies.final("plain"), GenerateResult)
        assert isinstance(replies.final("tools"), GenerateResult)
        assert replies.final("count").count == 3
    assert {what for what, _ in engine.threads} == {"encode", "compile"}
    assert all(thread != MODEL_THREAD for _, thread in engine.threads), engine.threads


@pytest.mark.parametrize("limits, chars", [(Limits(heartbeat_timeout=0, max_prompt_chars=100), 101),
                                           (NO_HEARTBEATS, 16 * 63 + 1)])  # the double's window is 64 tokens
def test_the_character_limit_refuses_a_prompt_before_it_is_tokenized(limits, chars):
    engine = Recording()
    with running(engine, limits) as (scheduler, replies):
        scheduler.submit(A, GenerateRequest(id="huge", prompt="x" * chars))
        scheduler.tokenize(A, TokenizeRequest(id="huge-count", text="x" * chars))
        scheduler.submit(A, GenerateRequest(id="fits", prompt="x" * (chars - 1)))
        for rid in ("huge", "huge-count"):
            refused = replies.final(rid)
            assert isinstance(refused, ErrorReply) and refused.code == TooLong.code
            assert f"{chars} characters" in refused.message
        assert isinstance(replies.final("fits"), GenerateResult)
    assert engine.encoded == ["x" * (chars - 1)]


def test_one_client_cannot_take_the_whole_queue():
    with running(CountingEngine(step_s=0.01), Limits(heartbeat_timeout=0, max_requests_per_client=2)) as (
            scheduler, replies):
        scheduler.submit(A, generate("a1", max_tokens=50))
        scheduler.submit(A, generate("a2", max_tokens=50))
        with pytest.raises(Busy, match="2 requests queued or running"):
            scheduler.submit(A, generate("a3"))
        scheduler.submit(B, generate("b1"))  # another socket
        scheduler.submit(A, generate("c1"), client="http:1.2.3.4:5")  # same envelope, another named client
        assert all(isinstance(replies.final(r), GenerateResult) for r in ("b1", "c1"))
        scheduler.cancel(A, "a1")
        replies.final("a1")
        scheduler.submit(A, generate("a3"))  # a slot is free again
        assert isinstance(replies.final("a3"), GenerateResult)


def test_admission_work_between_two_steps_is_bounded():
    """Twenty requests that the engine refuses at add_request (too long for its window) while a stream
    runs: at most ADMISSIONS_PER_TURN tries between two steps, not all of them back to back."""
    engine = Recording(step_s=0.002)
    with running(engine, Limits(heartbeat_timeout=0, max_prompt_tokens=1000)) as (scheduler, replies):
        scheduler.submit(A, generate("stream", max_tokens=4000, stream=True))
        wait_for(lambda: "stream" in replies.by_id)
        for i in range(20):
            scheduler.submit(B, generate(f"long{i}", words=100))
        for i in range(20):
            assert replies.final(f"long{i}").code == TooLong.code
        assert not isinstance(replies.by_id["stream"][-1], Replies.ENDS)  # still running
        scheduler.cancel(A, "stream")
    assert max(engine.adds_between_steps) <= ADMISSIONS_PER_TURN, engine.adds_between_steps


@pytest.mark.parametrize("share, expected", [(False, ["curve:abc", "local"]), (True, ["", ""])])
def test_each_tenant_gets_its_own_cache_scope_unless_shared(share, expected):
    engine = CountingEngine()
    with running(engine, Limits(heartbeat_timeout=0, share_prefix_cache=share)) as (scheduler, replies):
        scheduler.submit(A, generate("keyed"), tenant="curve:abc")
        replies.final("keyed")
        scheduler.submit(B, generate("local"))
        replies.final("local")
    assert list(engine.scopes.values()) == expected


def test_a_failing_output_parser_fails_only_its_request(monkeypatch):
    def explode(self, text):
        raise RecursionError("maximum recursion depth exceeded while parsing")

    monkeypatch.setattr(ToolCallStream, "feed", explode)
    engine = CountingEngine(step_s=0.005)
    with running(engine) as (scheduler, replies):
        scheduler.submit(A, generate("plain", max_tokens=20, stream=True))
        scheduler.submit(B, chat("tools", tools=TOOLS))
        failed = replies.final("tools")
        assert isinstance(failed, ErrorReply) and failed.code == "INTERNAL"
        assert "recursion" not in failed.message.lower() and "tools" in failed.message
        plain = replies.final("plain")
        assert isinstance(plain, GenerateResult) and plain.usage.completion_tokens == 20
        assert scheduler.state == "ready" and not engine.rows
        scheduler.submit(C, generate("after"))
        assert isinstance(replies.final("after"), GenerateResult)


def test_a_row_whose_grammar_failed_ends_with_bad_request_naming_it():
    engine = CountingEngine()
    engine.grammar_error = "the grammar allows no output"
    with running(engine) as (scheduler, replies):
        scheduler.submit(A, chat("tools", tools=TOOLS, tool_choice="required"))
        scheduler.submit(A, generate("plain"))
        failed = replies.final("tools")
        assert isinstance(failed, ErrorReply) and failed.code == BadRequest.code
        assert "the grammar allows no output" in failed.message
        assert isinstance(replies.final("plain"), GenerateResult)


def test_a_heartbeat_touches_only_its_senders_requests():
    """A heartbeat keeps the requests sent on its socket or with its credential (FLyClient's heartbeat
    socket is not its request socket), not another credential's that it names."""
    with running(CountingEngine(step_s=0.01), Limits(heartbeat_timeout=0.3)) as (scheduler, replies):
        scheduler.submit(A, generate("x", max_tokens=80), tenant="curve:a")  # A never heartbeats
        scheduler.submit(B, generate("y", max_tokens=80), tenant="curve:b")
        scheduler.submit(C, generate("z", max_tokens=80), tenant="curve:c")
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            scheduler.touch(B, ["x", "y"], tenant="curve:b")  # B names A's request too
            scheduler.touch((b"c-heartbeats",), ["z"], tenant="curve:c")  # C's own heartbeat socket
            time.sleep(0.05)
        lost = replies.final("x", timeout=1)
        assert isinstance(lost, ErrorReply) and lost.code == "CANCELLED"
        assert isinstance(replies.final("y"), GenerateResult)
        assert isinstance(replies.final("z"), GenerateResult)


# ---- the random walk ----

class ManualExecutor(Executor):
    """An executor whose tasks run only when the test says so (one at a time, in any order)."""

    def __init__(self) -> None:
        self.pending: list[tuple[Future, Callable, tuple]] = []

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        self.pending.append((future, fn, args))
        return future

    def run_one(self, rng: random.Random) -> None:
        future, fn, args = self.pending.pop(rng.randrange(len(self.pending)))
        future.set_result(fn(*args))


def _walk_request(rng: random.Random, rid: str) -> GenerateRequest:
    """A request that is served, or fails in preparation (cannot encode, too many tokens), or at add_request."""
    kind = rng.choice(["ok", "ok", "ok", "boom", "too_many_tokens", "engine_refuses", "tools"])
    words = {"too_many_tokens": 70, "engine_refuses": 64}.get(kind, rng.randint(1, 5))
    prompt = " ".join(["BOOM" if kind == "boom" else "w"] * words)
    sampling = SamplingParams(max_tokens=rng.randint(1, 4))
    if kind == "tools":
        return GenerateRequest(id=rid, messages=[{"role": "user", "content": prompt}], tools=TOOLS, sampling=sampling)
    return GenerateRequest(id=rid, prompt=prompt, sampling=sampling)


@pytest.mark.parametrize("seed", range(6))
def test_random_interleavings_keep_the_schedulers_books(seed):
    rng = random.Random(seed)
    engine = Recording()
    engine.context_window = 70  # prompts of 64..69 words pass the 64-token cap below, the engine refuses them
    executor, replies = ManualExecutor(), Replies()
    limits = Limits(heartbeat_timeout=0, queue_size=6, max_batch_size=3, max_requests_per_client=4,
                    max_prompt_tokens=68, max_batch_tokens=60)
    scheduler = Scheduler(lambda: engine, replies, limits, executor=executor, tokenize_executor=executor)
    clients = [A, B, C]
    accepted: list[tuple[tuple[bytes, ...], str]] = []
    counted: list[str] = []  # accepted tokenize requests
    loaded = False

    def submit():
        envelope, rid = rng.choice(clients), f"g{rng.randrange(12)}"
        try:
            scheduler.submit(envelope, _walk_request(rng, rid), tenant=rng.choice(["local", "curve:k"]))
        except FLyError as exc:
            assert exc.code in ("BUSY", "BAD_REQUEST", "NOT_READY")
            return
        accepted.append((envelope, rid))

    def tokenize():
        rid = f"t{len(counted)}"
        try:
            scheduler.tokenize(rng.choice(clients), TokenizeRequest(id=rid, text=rng.choice(["a b", "BOOM"])))
        except FLyError as exc:
            assert exc.code in ("BUSY", "NOT_READY")
            return
        counted.append(rid)

    def load():
        nonlocal loaded
        if not loaded:
            scheduler.start(scheduler._load_engine())
            loaded = True

    ops = {
        "submit": submit,
        "cancel": lambda: scheduler.cancel(rng.choice(clients), f"g{rng.randrange(12)}"),
        "gone": lambda: scheduler.client_gone(rng.choice(clients)),
        "touch": lambda: scheduler.touch(rng.choice(clients), [f"g{rng.randrange(12)}"],
                                         tenant=rng.choice(["local", "curve:k"])),
        "tokenize": tokenize,
        "prepare": lambda: executor.pending and executor.run_one(rng),
        "turn": lambda: loaded and scheduler.turn(),
        "load": load,
        "drain": lambda: rng.random() < 0.2 and scheduler.drain(),
    }
    weights = [30, 6, 2, 4, 4, 25, 25, 2, 1]
    for _ in range(400):
        ops[rng.choices(list(ops), weights)[0]]()
        scheduler.check()
    load()
    for _ in range(2000):  # let everything finish
        if not executor.pending and not scheduler.turn() and not engine.rows:
            break
        if executor.pending:
            executor.run_one(rng)
        scheduler.check()
    assert not scheduler.snapshot()["queue_depth"] and not scheduler.snapshot()["active"]
    finals = [(envelope, m.id) for envelope, m in replies.sent if isinstance(m, Replies.ENDS)]
    assert sorted(f for f in finals if f[1].startswith("g")) == sorted(accepted)  # each ended exactly once
    assert sorted(rid for _, rid in finals if rid.startswith("t")) == sorted(counted)
    assert all(isinstance(m, (*Replies.ENDS, TokenChunk)) for _, m in replies.sent)
