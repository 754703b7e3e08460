"""A test double of FLyEngine (no torch) and one whose grammar compiles block until released, an in-process
Server on a serving core running it, and a collector of a Scheduler's replies.

The double emits one token per step per request, so deadlines, heartbeats, cancellation, batch
limits, loading state, step failures and admission can be shown quickly and exactly
(tests/daemon/test_daemon_server.py, tests/daemon/test_scheduler*.py, tests/http/test_http_front.py).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from pydantic import BaseModel

from fly_llm.common.config import FLyConfig
from fly_llm.common.errors import FimUnsupported, TooLong
from fly_llm.common.protocol import ErrorReply, GenerateResult, TokenizeReply
from fly_llm.common.schema_limits import SchemaCaps
from fly_llm.common.stats import GrammarCacheStats, PromptStats, RequestStats

from fly_daemon.core import ServingCore
from fly_daemon.metrics import Metrics
from fly_daemon.scheduling.scheduler import Limits, Scheduler
from fly_daemon.server import Server


@dataclass
class _Output:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    stats: RequestStats = field(default_factory=RequestStats)
    cached_tokens: int = 0
    error: str | None = None
    error_code: str = "BAD_REQUEST"
    logprobs: list | None = None
    prompt_logprobs: list | None = None


class _NoGrammars:
    """The double's grammar compiler: the schema caps, and no special tokens (no tokenizer), no caches."""

    caps = SchemaCaps()
    texts_budget = 1 << 20

    @staticmethod
    def special_tokens(texts: tuple[str, ...]) -> frozenset[str]:
        return frozenset()

    @staticmethod
    def stats() -> GrammarCacheStats:
        return GrammarCacheStats()


class CountingEngine:
    """Test double of FLyEngine: each step gives every request its next number as one token.

    A request added with a constraint ends at its first step with `grammar_error` when that is set
    (as FLyEngine ends a row whose grammar failed).
    """

    context_window = 64
    target_name, draft_name, device, dtype = "counting", None, "cpu", "float32"
    target_quantization = draft_quantization = "none"
    tokenizer = None  # no chat template
    fim = None  # no fill-in-the-middle tokens
    prompt_stats = PromptStats()  # no prefix cache
    grammars = _NoGrammars()

    def __init__(self, step_s: float = 0.0) -> None:
        self.config = FLyConfig()
        self.stats = RequestStats()
        self.step_s = step_s
        self.fail_next_step = False
        self.grammar_error: str | None = None
        self.structured: set[str] = set()  # request ids added with a constraint
        self.rows: dict[str, list[int]] = {}
        self.scopes: dict[str, str] = {}  # request id -> the cache_scope it was added with

    def encode(self, prompt=None, messages=None, tools=None, add_special=True, infill=None) -> list[int]:
        if infill is not None:
            raise FimUnsupported(f"the model {self.target_name!r} has no fill-in-the-middle tokens")
        text = prompt if prompt is not None else " ".join(m["content"] for m in messages)
        return [1] * len(text.split())

    def compile_constraint(self, constraint, scope=""):
        """No grammars here: every constraint compiles to no matcher."""
        return None

    def compiled_matcher(self, constraint, scope=""):
        """Nothing is compiled ahead: every constraint compiles (to no matcher)."""
        return None

    def add_request(self, request_id, prompt_ids, sampling, fly=None, constraint=None, *, matcher=None,
                    cache_scope: str = "", logprobs=None, prompt_logprobs=False, min_indent: int = 0) -> None:
        if len(prompt_ids) >= self.context_window:
            raise TooLong("prompt does not fit")
        self.rows[request_id] = [sampling.max_tokens, 0, len(prompt_ids)]
        self.scopes[request_id] = cache_scope
        if constraint is not None:
            self.structured.add(request_id)

    def abort_request(self, request_id) -> bool:
        return self.rows.pop(request_id, None) is not None

    def has_unfinished(self) -> bool:
        return bool(self.rows)

    def step(self) -> list[_Output]:
        time.sleep(self.step_s)
        if self.fail_next_step:
            self.fail_next_step = False
            self.rows.clear()  # FLyEngine.step drops every request when it fails
            raise RuntimeError("boom")
        outputs = []
        for rid, row in list(self.rows.items()):
            if self.grammar_error is not None and rid in self.structured:
                del self.rows[rid]
                outputs.append(_Output(rid, [], "", True, "stop", row[2], error=self.grammar_error))
                continue
            row[1] += 1
            done = row[1] >= row[0]
            outputs.append(_Output(rid, [row[1]], f"{row[1]} ", done, "length" if done else None, row[2]))
            if done:
                del self.rows[rid]
        return outputs


class ShortAnswers(CountingEngine):
    """The double with a long context whose every answer ends (finish reason stop) after `words` tokens, as a
    model's short reply does: what an agent CLI's first request meets (tests/http/test_agent_clis.py)."""

    context_window = 1 << 17

    def __init__(self, words: int = 6) -> None:
        super().__init__()
        self.words = words
        self.prompts: list[int] = []  # each request's prompt length, in the order they came

    def add_request(self, request_id, prompt_ids, sampling, *args, **kwargs) -> None:
        super().add_request(request_id, prompt_ids, sampling, *args, **kwargs)
        self.rows[request_id][0] = min(self.rows[request_id][0], self.words)
        self.prompts.append(len(prompt_ids))

    def step(self) -> list[_Output]:
        outputs = super().step()
        for output in outputs:
            if output.finished and output.finish_reason == "length":
                output.finish_reason = "stop"
        return outputs


class Replies:
    """The `emit` of a test Scheduler: every reply, by request id (and every (envelope, reply) in order)."""

    ENDS = (GenerateResult, ErrorReply, TokenizeReply)

    def __init__(self) -> None:
        self.by_id: dict[str, list[BaseModel]] = {}
        self.sent: list[tuple[tuple[bytes, ...], BaseModel]] = []
        self._cond = threading.Condition()

    def __call__(self, envelope: tuple[bytes, ...], message: BaseModel) -> None:
        with self._cond:
            self.by_id.setdefault(message.id, []).append(message)
            self.sent.append((envelope, message))
            self._cond.notify_all()

    def final(self, rid: str, timeout: float = 30.0) -> BaseModel:
        """The last reply to `rid` once one that ends the request has come."""
        with self._cond:
            assert self._cond.wait_for(lambda: any(isinstance(m, self.ENDS) for m in self.by_id.get(rid, ())),
                                       timeout), f"no final reply to {rid}"
            return self.by_id[rid][-1]


class BlockingGrammars(CountingEngine):
    """A compile blocks until the test releases its schema; compiles in flight are counted per scope
    (each client its own tenant here) and in all, their peaks kept. Decoding is the ids as text."""

    def __init__(self) -> None:
        super().__init__()
        self.cond = threading.Condition()
        self.released: set[str] = set()  # schema texts
        self.done: set[tuple[str, str]] = set()  # (scope, schema text) compiled
        self.in_flight: Counter[str] = Counter()
        self.peak_per_client = self.peak = 0

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))

    def compiled_matcher(self, constraint, scope=""):
        with self.cond:
            return "matcher" if (scope, constraint.text) in self.done else None

    def compile_constraint(self, constraint, scope=""):
        with self.cond:
            self.in_flight[scope] += 1
            self.peak_per_client = max(self.peak_per_client, self.in_flight[scope])
            self.peak = max(self.peak, sum(self.in_flight.values()))
            self.cond.wait_for(lambda: constraint.text in self.released)
            self.in_flight[scope] -= 1
            self.done.add((scope, constraint.text))
        return "matcher"

    def release(self, texts: set[str]) -> None:
        with self.cond:
            self.released |= texts
            self.cond.notify_all()


MODEL_THREAD = "fly-model-under-test"
"""The name of `running`'s model thread."""


@contextmanager
def running(engine: CountingEngine,
            limits: Limits = Limits(heartbeat_timeout=0)) -> Iterator[tuple[Scheduler, Replies]]:
    """A scheduler on `engine`, its model thread running (named MODEL_THREAD); drained at the end."""
    replies = Replies()
    scheduler = Scheduler(lambda: engine, replies, limits)
    thread = threading.Thread(target=scheduler.run, name=MODEL_THREAD, daemon=True)
    thread.start()
    try:
        yield scheduler, replies
    finally:
        scheduler.drain(force=True)
        thread.join(30)
        assert not thread.is_alive()


@contextmanager
def serving(endpoint: str, engine: CountingEngine, limits: Limits = Limits(), load=None,
            metrics: Metrics | None = None, **kwargs):
    """A Server (Server's keyword arguments) on a core running `engine` (or what `load` returns), serving."""
    server = Server(endpoint, ServingCore(load or (lambda: engine), limits, metrics=metrics), **kwargs)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.request_stop()
        thread.join(15)
        assert not thread.is_alive()
