"""Continuous batching of generate requests into one FLyEngine (runs in the daemon's model thread).

The scheduler has three rooms, as vLLM's v1 engine separates its core, input processing and output
processing:
- the queue and the loop (this module; its books in fly_daemon.scheduling.request_queue, the model thread's
  turns in fly_daemon.scheduling.engine_loop): admission, per-client caps, deadlines, heartbeats, cancels;
- preparation (fly_daemon.scheduling.preparation): chat template, tokenizer, limits, constraint and grammar, in a
  small pool of worker threads so no preparation holds up a running stream, taking the queued requests
  clients in turn with at most one grammar compile per client (fly_daemon.scheduling.request_queue); the tokenize
  and detokenize answers on a thread of their own, so no compile ever delays them, taking the clients' requests
  in turn (a client looping on /tokenize no longer queues everyone else's behind its own);
- delivery (fly_daemon.scheduling.delivery): one output state per request turning engine outputs into chunks and
  results (text, logprobs, tool calls, timings), the metrics, and the failures' replies.

The socket thread calls `submit`, `cancel`, `touch`, `client_gone`, `tokenize` and `drain` (all
thread-safe and quick). The model thread runs `run()`: it loads the models, then loops — drop what
was cancelled, timed out or abandoned, join a bounded number of prepared requests to the batch while
it has room (in queue order), run one engine step, and deliver each request's output.

A request is in exactly one place: queued, preparing, prepared or in the engine (`check()`). Each
client (a ZeroMQ socket, an HTTP connection) may have `max_requests_per_client` of them, all
clients together `queue_size` outside the engine. Each request's cache scope (prefix cache, compiled
grammars) is its tenant (the credential it came with) unless `share_prefix_cache`. The fronts see
the loaded model as `model` (fly_daemon.model_info), never the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from itertools import count
from typing import TYPE_CHECKING

from fly_llm.common.errors import Cancelled, FLyError, Internal, NotReady, contained
from fly_llm.common.protocol import ErrorReply, GenerateRequest, HealthState, TokenizeReply, TokenizeRequest
from fly_llm.common.stats import GrammarCacheStats
from fly_llm.common.tool_formats import Constraints

from fly_daemon.client_identity import LOCAL_TENANT
from fly_daemon.limits import Limits
from fly_daemon.metrics import Metrics
from fly_daemon.model_info import ModelInfo
from fly_daemon.scheduling.delivery import LOCAL, Delivery, Emit, Envelope
from fly_daemon.scheduling.engine_loop import ADMISSIONS_PER_TURN, EngineLoop, Lifecycle, error_of
from fly_daemon.scheduling.preparation import CHARS_PER_TOKEN, Preparation
from fly_daemon.scheduling.request_queue import GRAMMAR_COMPILES, Entry, RequestQueue

if TYPE_CHECKING:
    from fly_llm.decoding.engine import FLyEngine

__all__ = ["ADMISSIONS_PER_TURN", "CHARS_PER_TOKEN", "LOCAL", "PREPARE_WORKERS", "TOKENIZE_WORKERS", "Emit", "Envelope",
           "Limits", "Scheduler"]

log = logging.getLogger("fly_daemon")

PREPARE_WORKERS = GRAMMAR_COMPILES + 1
"""Threads that prepare requests: one more than the grammar compiles at once, so one is always free of them."""
TOKENIZE_WORKERS = 1
"""Threads that answer tokenize and detokenize requests (bounded work: the character and token limits)."""


class Scheduler:
    """Bounded admission queue, preparation off the model thread, and continuous batching into one
    engine, built by `load_engine`. `executor` runs the preparations (default: a pool of
    PREPARE_WORKERS threads), `tokenize_executor` the tokenize answers (default: TOKENIZE_WORKERS threads)."""

    def __init__(self, load_engine: Callable[[], "FLyEngine"], emit: Emit, limits: Limits = Limits(),
                 metrics: Metrics | None = None, executor: Executor | None = None,
                 tokenize_executor: Executor | None = None) -> None:
        self.limits = limits
        self.metrics = metrics or Metrics()
        self.model: ModelInfo | None = None
        """The served model, once loaded: what the fronts know of it (they never see the engine)."""
        self.started = time.time()
        self._load_engine = load_engine
        self._life = Lifecycle()
        self._loop: EngineLoop | None = None  # once the models are loaded, with the preparation
        self._preparation: Preparation | None = None
        self._delivery = Delivery(emit, self.metrics)
        self._executor = executor or ThreadPoolExecutor(PREPARE_WORKERS, thread_name_prefix="fly-prepare")
        self._tokenize_executor = tokenize_executor or ThreadPoolExecutor(TOKENIZE_WORKERS,
                                                                          thread_name_prefix="fly-tokenize")
        self._lock = threading.Lock()  # guards the books, the state and the engine's arrival
        self._wake = threading.Event()
        self._books = RequestQueue(limits)
        self._seqs = count()

    @property
    def state(self) -> HealthState:
        return self._life.state

    @property
    def detail(self) -> str:
        return self._life.detail

    @property
    def requests_total(self) -> int:
        return self._delivery.requests_total

    # ---- called from the socket thread ----

    def submit(self, envelope: Envelope, request: GenerateRequest, *, tenant: str = LOCAL_TENANT,
               client: str | None = None) -> None:
        """Queue a request (while models load too); raises NotReady, BadRequest (duplicate id) or Busy.
        A max_tokens above the daemon's limit is capped to it, as llama-server and Ollama do (every door: the
        HTTP APIs and the ZeroMQ socket).

        `tenant` names the credential it came with (its prefix cache scope); `client` what the
        per-client cap counts (default: the envelope, one ZeroMQ socket).
        """
        limit = self.limits.max_tokens_limit
        if request.sampling.max_tokens > limit:
            request = request.model_copy(update={"sampling": request.sampling.model_copy(update={"max_tokens": limit})})
        now = time.monotonic()
        with self._lock:
            self._life.check_open()
            self._books.add(Entry(envelope, request, next(self._seqs), tenant, client or _client_of(envelope),
                                  now, now))
            loaded = self._loop is not None
        if loaded:
            self._executor.submit(self._prepare_queued)

    def cancel(self, envelope: Envelope, request_id: str, error: FLyError | None = None) -> bool:
        """Cancel a client's request; False if it has none with that id."""
        with self._lock:
            entry = self._books.entries.get((envelope, request_id))
            if entry is None:
                return False
            entry.kill = error or Cancelled(f"request {request_id} cancelled by the client")
        self._wake.set()
        return True

    def client_gone(self, envelope: Envelope) -> None:
        """A client socket can no longer be reached: cancel all of its requests."""
        with self._lock:
            for entry in self._books.entries.values():
                if entry.envelope == envelope and entry.kill is None:
                    entry.kill = Cancelled("the client went away")
        self._wake.set()

    def touch(self, envelope: Envelope, request_ids: list[str], *, tenant: str = LOCAL_TENANT) -> None:
        """A heartbeat from `envelope` with credential `tenant`: its sender still waits for these requests.

        Only the sender's own are touched: those sent on this socket, and those of its credential
        (FLyClient heartbeats from a socket of its own, with the same credential).
        """
        wanted, now = set(request_ids), time.monotonic()
        with self._lock:
            for entry in self._books.entries.values():
                if entry.request.id in wanted and (entry.envelope == envelope or entry.tenant == tenant):
                    entry.last_seen = now

    def tokenize(self, envelope: Envelope, request: TokenizeRequest, client: str | None = None) -> None:
        """Queue a tokenize request in its client's lane (`client`, default: its socket); the lane's thread answers
        the clients' requests in turn, once the models have loaded."""
        with self._lock:
            self._life.check_open()
            self._books.add_tokenize(envelope, request, client or _client_of(envelope))
            loaded = self._loop is not None
        if loaded:
            self._tokenize_executor.submit(self._answer_tokenize)

    def expire_queued(self) -> None:
        """While models load, end queued requests that were cancelled, passed their deadline or lost their client.

        The socket thread calls this (the model thread is busy loading); once the engine exists it does nothing.
        Safe from any thread: nothing leaves the queue before the engine exists, and that is checked under the lock.
        """
        now = time.monotonic()
        with self._lock:
            if self._loop is not None:
                return
            ended = self._books.sweep(lambda e: e.verdict(now, self.limits.heartbeat_timeout), queued_only=True)
        for entry, _ in ended:
            self._delivery.fail(entry.envelope, entry.request.id, entry.kill)

    def abandon_queue(self, error: FLyError) -> None:
        """While no engine exists (loading, or loading failed), answer every queued request with `error`."""
        self._fail_all(error, only_without_engine=True)

    def drain(self, force: bool = False) -> None:
        """Stop admitting; finish running requests within the drain timeout (at once if `force`), cancel the rest."""
        self._life.drain(self.limits.drain_timeout, force)
        self._wake.set()

    def snapshot(self) -> dict:
        """Counters for the status reply."""
        with self._lock:
            waiting = self._books.outside_engine()
            active = len(self._books.entries) - waiting
        busy_s, largest = (self._loop.busy_s, self._loop.max_batch_size_seen) if self._loop else (0.0, 0)
        delivery = self._delivery
        grammars = self._loop.engine.grammars.stats() if self._loop else GrammarCacheStats()
        return dict(queue_depth=waiting, active=active, max_batch_size_seen=largest, grammars=grammars,
                    requests_total=delivery.requests_total, tokens_generated=delivery.tokens_generated,
                    tokens_per_s=delivery.tokens_generated / busy_s if busy_s else 0.0,
                    stats=delivery.stats, prompt=delivery.prompt_stats)

    def check(self) -> None:
        """Assert the bookkeeping (`RequestQueue.check`): every request in exactly one place, the caps kept."""
        with self._lock:
            self._books.check()

    # ---- the preparation pool ----

    def _prepare_queued(self) -> None:
        """Prepare queued requests while one may start (`RequestQueue.take_to_prepare` picks which).

        One such task is submitted per request; one finding nothing to start returns. Work becomes
        startable only by a submit (its own task) or a compile's end (in a task that then takes again)."""
        while True:
            with self._lock:
                entry = self._books.take_to_prepare()
            if entry is None:
                return  # nothing may start: taken by other tasks, or waiting for compile slots
            self._prepare(entry)

    def _prepare(self, entry: Entry) -> None:
        """Prepare a taken request: its prompt and checks (unless done before it waited), then its grammar's
        compile when new to its scope, holding its client's compile slot (or back to its lane to wait)."""
        scope = entry.cache_scope(self.limits.share_prefix_cache)
        try:
            prepared = entry.prepared  # set when it comes back from its lane to compile (the slot is taken)
            if prepared is None:
                prepared = self._preparation.prepare(entry.request, scope)
                if prepared.needs_compile:
                    with self._lock:
                        entry.prepared = prepared
                        if not self._books.begin_compile(entry):
                            return  # it waits in its lane for its client's compile slot (or it ended)
            if prepared.needs_compile:
                try:
                    prepared = self._preparation.compile(prepared, scope)
                finally:
                    with self._lock:
                        self._books.end_compile(entry)
        except BaseException as exc:  # a failed preparation (a grammar compiler's panic too) fails only its request
            if not contained(exc):
                raise
            self._loop.end(entry, error_of(exc, f"preparing request {entry.request.id} failed"))
            return
        with self._lock:
            entry.prepared, entry.prompt_tokens = prepared, len(prepared.prompt_ids)
            if not self._books.mark_prepared(entry):
                return  # it ended (cancelled, timed out) while it was prepared
        self._wake.set()

    def _answer_tokenize(self) -> None:
        """Answer the tokenize request next in turn (one job is submitted per request, so none is left over)."""
        with self._lock:
            taken = self._books.next_tokenize()
        if taken is None:  # answered already (every waiting request failed at once)
            return
        envelope, request = taken
        try:
            reply: TokenizeReply | ErrorReply = self._preparation.tokenize(request)
        except Exception as exc:  # noqa: BLE001 - a failed tokenize request fails only itself
            error = error_of(exc, f"tokenize request {request.id} failed")
            reply = ErrorReply(id=request.id, code=error.code, message=error.message)
        finally:
            with self._lock:
                self._books.tokenize_done()
        self._delivery.emit(envelope, reply)

    # ---- the model thread ----

    def run(self) -> None:
        """Load the engine, then serve until drained (the body of the model thread)."""
        try:
            engine = self._load_engine()
        except Exception as exc:  # noqa: BLE001 - any load failure ends the daemon with its message
            log.exception("loading models failed")
            with self._lock:
                self._life.fail(f"loading models failed: {exc}")
            self.abandon_queue(NotReady(self.detail))  # what was queued while loading gets the reason
            self._shutdown_pools()
            return
        self.start(engine)
        log.info("ready: target=%s draft=%s", engine.target_name, engine.draft_name)
        try:
            self._serve()
        except BaseException as exc:  # never die silently: fail everything, say so, let the daemon exit
            if not contained(exc):
                raise
            log.exception("the model thread failed")
            with self._lock:
                self._life.fail("the model thread failed (the daemon's log has the details)")
            self._fail_all(Internal(self.detail))
        finally:
            self._shutdown_pools()  # what they still hold ends quickly: no queued request is left

    def start(self, engine: "FLyEngine") -> None:
        """The models are loaded: serve with `engine`, and prepare what was queued while they loaded."""
        constraints = Constraints.of(engine)  # the tool format its chat template asks for
        self._delivery.start(engine, constraints.tool_format)
        preparation, model = Preparation(engine, self.limits, constraints), ModelInfo.of(engine)
        loop = EngineLoop(engine, self._books, self._lock, self._life, self._delivery, self.limits, self.metrics)
        with self._lock:
            self._preparation, self.model, self._loop = preparation, model, loop
            self._life.loaded()
            tokenize, queued = self._books.tokenize_waiting(), self._books.queued()
        for _ in range(tokenize):
            self._tokenize_executor.submit(self._answer_tokenize)
        for _ in range(queued):
            self._executor.submit(self._prepare_queued)

    def _shutdown_pools(self) -> None:
        self._executor.shutdown(wait=False)
        self._tokenize_executor.shutdown(wait=False)

    def _serve(self) -> None:
        """The model thread's loop: turn after turn until drained, waiting for work when there is none."""
        while not (self.state == "draining" and not self._books.entries and not self._books.tokenize_pending):
            self._wake.clear()  # a submit or preparation after this line makes the wait below return at once
            if not self.turn():
                self.metrics.active.set(0)
                self._wake.wait(0.05)

    def turn(self) -> bool:
        """One turn of the model thread (`EngineLoop.turn`); whether an engine step ran."""
        return self._loop.turn()

    def _fail_all(self, error: FLyError, only_without_engine: bool = False) -> None:
        """Answer every request the scheduler holds (queued, running, tokenize) with `error`.

        With `only_without_engine` nothing happens once the engine exists (checked under the lock), so
        the socket thread may call it while the model thread loads.
        """
        with self._lock:
            if only_without_engine and self._loop is not None:
                return
            ended = self._books.sweep(lambda _: error)
            tokenize = self._books.take_tokenize_waiting()
        for entry, _ in ended:
            self._delivery.fail(entry.envelope, entry.request.id, error)
        for envelope, request in tokenize:
            self._delivery.refuse(envelope, request.id, error)


def _client_of(envelope: Envelope) -> str:
    """The default client of a request: its socket (the ROUTER's routing frames)."""
    return "zmq:" + "/".join(frame.hex() for frame in envelope)
