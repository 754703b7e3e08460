"""Continuous batching of generate requests into one FLyEngine (runs in the daemon's model thread).

The socket thread calls `submit`, `cancel`, `touch`, `client_gone`, `tokenize` and `drain` (all
thread-safe and quick); the model thread runs `run()`: it loads the models, then loops — drop
what was cancelled, timed out or abandoned, join waiting requests to the batch while it has room,
run one engine step, and hand each request's new text to `emit` (which the server sends on).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from fly_llm.errors import BadRequest, Busy, Cancelled, FLyError, Internal, NotReady, Timeout, TooLong
from fly_llm.protocol import (
    ErrorReply, GenerateRequest, GenerateResult, HealthState, TokenChunk, TokenizeReply, TokenizeRequest, Usage,
)
from fly_llm.stats import PromptStats, RequestStats
from fly_llm.tools import ToolCall, ToolCallStream

from fly_daemon.metrics import Metrics

if TYPE_CHECKING:
    from fly_llm.decoding.engine import FLyEngine, RequestOutput

log = logging.getLogger("fly_daemon")

Envelope = tuple[bytes, ...]
"""The ROUTER routing frames of one client socket."""
LOCAL: Envelope = ()
"""The envelope of requests submitted from inside the process (fly_daemon.inproc): no routing frames, so it
is never a socket's, and no heartbeats (their owner cancels them when it stops waiting)."""
Emit = Callable[[Envelope, BaseModel], None]


class Limits(BaseModel):
    """What the scheduler admits: queue and batch sizes, token caps, heartbeat and drain deadlines.

    The field names are the daemon's setting names (`--max-tokens-limit`, `FLY_HEARTBEAT_TIMEOUT`, …):
    fly_daemon.settings.DaemonSettings extends this model.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    queue_size: int = Field(256, ge=1, le=100_000, description="Requests waiting beyond the batch; more get BUSY.")
    max_batch_size: int = Field(16, ge=1, le=4096, description="Requests in one engine step.")
    max_batch_tokens: int = Field(65_536, ge=1, description="Cap on prompt + max_tokens over the running batch.")
    max_tokens_limit: int = Field(4096, ge=1, le=1_000_000, description="Largest max_tokens a request may ask for.")
    max_prompt_tokens: int | None = Field(None, ge=1, description="None = the context window - 1.")
    max_prompt_chars: int | None = Field(None, ge=1, description="Longest prompt in characters (messages and "
                                         "tools included), refused before tokenizing; None = 16 × the prompt "
                                         "token limit.")
    max_requests_per_client: int = Field(64, ge=1, description="Requests one client (a ZeroMQ socket, an HTTP "
                                         "connection) may have queued or running; more get BUSY.")
    share_prefix_cache: bool = Field(False, description="Let every client reuse every other's cached prompts "
                                     "(a single-tenant deployment); else each credential has its own.")
    heartbeat_timeout: float = Field(5.0, ge=0, description="Seconds without a client heartbeat before a "
                                                             "request is cancelled; 0 = never.")
    drain_timeout: float = Field(10.0, ge=0, description="Seconds running requests get to finish on stop.")


@dataclass(eq=False)
class Job:
    """One generate request from submission to its final reply."""

    envelope: Envelope
    request: GenerateRequest
    engine_id: str
    tenant: str  # whose prefix cache it may use (a credential: "local", "curve:KEY", "http-key:HASH")
    client: str  # what the per-client cap counts (one socket, one HTTP connection)
    submitted: float
    last_seen: float
    prompt_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    unsent_ids: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    last_token_at: float | None = None
    in_engine: bool = False
    kill: FLyError | None = None
    tool_calls: ToolCallStream | None = None  # set when the request may call tools: splits calls from text
    calls: list[ToolCall] = field(default_factory=list)
    content: list[str] = field(default_factory=list)  # text outside tool calls

    @property
    def key(self) -> tuple[Envelope, str]:
        return self.envelope, self.request.id

    @property
    def budget(self) -> int:
        """Tokens this request may occupy in the batch (prompt + max new tokens)."""
        return self.prompt_tokens + self.request.sampling.max_tokens


class Scheduler:
    """Bounded admission queue and continuous batching into one engine, built by `load_engine`."""

    def __init__(self, load_engine: Callable[[], "FLyEngine"], emit: Emit, limits: Limits = Limits(),
                 metrics: Metrics | None = None) -> None:
        self.limits = limits
        self.metrics = metrics or Metrics()
        self.engine: FLyEngine | None = None
        self.state: HealthState = "loading"
        self.detail = "loading models"
        self.started = time.time()
        self.requests_total = 0
        self.tokens_generated = 0
        self.max_batch_size_seen = 0
        self.stats = RequestStats()
        self.prompt_stats = PromptStats()
        self._busy_s = 0.0
        self._load_engine = load_engine
        self._emit = emit
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._jobs: dict[tuple[Envelope, str], Job] = {}
        self._waiting: deque[Job] = deque()
        self._tokenize: deque[tuple[Envelope, TokenizeRequest]] = deque()
        self._ids = count()
        self._drain_deadline: float | None = None

    # ---- called from the socket thread ----

    def submit(self, envelope: Envelope, request: GenerateRequest, *, tenant: str = "local",
               client: str | None = None) -> None:
        """Queue a request (while models load too); raises NotReady, TooLong, BadRequest (duplicate id) or Busy.

        `tenant` names the credential it came with (its prefix cache scope); `client` what the
        per-client cap counts (default: the envelope, one ZeroMQ socket).
        """
        if request.sampling.max_tokens > self.limits.max_tokens_limit:
            raise TooLong(f"max_tokens {request.sampling.max_tokens} exceeds the daemon's limit "
                          f"{self.limits.max_tokens_limit}")
        now = time.monotonic()
        with self._lock:
            self._check_open()
            if (envelope, request.id) in self._jobs:
                raise BadRequest(f"request id {request.id!r} is already in flight")
            if len(self._waiting) >= self.limits.queue_size:
                raise Busy(f"admission queue full ({self.limits.queue_size} waiting)")
            job = Job(envelope, request, f"r{next(self._ids)}", tenant, client or _client_of(envelope), now, now)
            structure = request.structure
            if structure is not None and structure.calls_tools:
                job.tool_calls = ToolCallStream(frozenset(t.function.name for t in structure.tools)
                                                if structure.tool_choice in (None, "auto") else frozenset())
            self._jobs[job.key] = job
            self._waiting.append(job)
        self._wake.set()

    def cancel(self, envelope: Envelope, request_id: str, error: FLyError | None = None) -> bool:
        """Cancel a client's request; False if it has none with that id."""
        with self._lock:
            job = self._jobs.get((envelope, request_id))
            if job is None:
                return False
            job.kill = error or Cancelled(f"request {request_id} cancelled by the client")
        self._wake.set()
        return True

    def client_gone(self, envelope: Envelope) -> None:
        """A client socket can no longer be reached: cancel all of its requests."""
        with self._lock:
            for job in self._jobs.values():
                if job.envelope == envelope and job.kill is None:
                    job.kill = Cancelled("the client went away")
        self._wake.set()

    def touch(self, envelope: Envelope, request_ids: list[str]) -> None:
        """A heartbeat: the client at `envelope` still waits for these of its requests."""
        now = time.monotonic()
        with self._lock:
            for rid in request_ids:
                job = self._jobs.get((envelope, rid))
                if job is not None:
                    job.last_seen = now

    def tokenize(self, envelope: Envelope, request: TokenizeRequest) -> None:
        """Queue a tokenize request (answered between engine steps, by the model thread; waits while models load)."""
        with self._lock:
            self._check_open()
            if len(self._tokenize) >= self.limits.queue_size:
                raise Busy("too many tokenize requests waiting")
            self._tokenize.append((envelope, request))
        self._wake.set()

    def expire_queued(self) -> None:
        """While models load, end queued requests that were cancelled, passed their deadline or lost their client.

        The socket thread calls this (the model thread is busy loading); once the engine exists it does nothing.
        """
        now = time.monotonic()
        self._end_queued(lambda job: self._verdict(job, now))

    def abandon_queue(self, error: FLyError) -> None:
        """While no engine exists (loading, or loading failed), answer every queued request with `error`."""
        self._fail_all(error, only_without_engine=True)

    def drain(self, force: bool = False) -> None:
        """Stop admitting; finish running requests within the drain timeout (at once if `force`), cancel the rest."""
        if self.state in ("loading", "ready"):
            self.state, self.detail = "draining", "stopping"
            self._drain_deadline = time.monotonic() + self.limits.drain_timeout
        if force and self.state == "draining":
            self._drain_deadline = time.monotonic()
        self._wake.set()

    def snapshot(self) -> dict:
        """Counters for the status reply."""
        with self._lock:
            waiting, active = len(self._waiting), len(self._jobs) - len(self._waiting)
        return dict(queue_depth=waiting, active=active, max_batch_size_seen=self.max_batch_size_seen,
                    requests_total=self.requests_total, tokens_generated=self.tokens_generated,
                    tokens_per_s=self.tokens_generated / self._busy_s if self._busy_s else 0.0,
                    stats=self.stats, prompt=self.prompt_stats)

    def _check_open(self) -> None:
        """Raise NotReady unless new work is taken: while loading (it waits for the models) or ready."""
        if self.state == "failed":
            raise NotReady(self.detail)
        if self.state not in ("loading", "ready"):
            raise NotReady(f"the daemon is {self.state}")

    def _end_queued(self, verdict: Callable[[Job], FLyError | None]) -> None:
        """If no engine exists yet, fail the queued jobs that were cancelled or that `verdict` gives an error for.

        Safe from any thread: the model thread takes jobs from the queue only once the engine exists,
        and that is checked under the lock.
        """
        with self._lock:
            if self.engine is not None:
                return
            ended = []
            for job in self._waiting:
                job.kill = job.kill or verdict(job)
                if job.kill is not None:
                    ended.append(job)
            for job in ended:
                del self._jobs[job.key]
                self._waiting.remove(job)
        for job in ended:
            self._fail(job, job.kill)

    # ---- the model thread ----

    def run(self) -> None:
        """Load the engine, then serve until drained (the body of the model thread)."""
        try:
            self.engine = self._load_engine()
        except Exception as exc:  # noqa: BLE001 - any load failure ends the daemon with its message
            log.exception("loading models failed")
            with self._lock:
                self.state, self.detail = "failed", f"loading models failed: {exc}"
            self.abandon_queue(NotReady(self.detail))  # what was queued while loading gets the reason
            return
        if self.state == "loading":
            self.state, self.detail = "ready", ""
        log.info("ready: target=%s draft=%s", self.engine.target_name, self.engine.draft_name)
        try:
            self._serve()
        except Exception as exc:  # noqa: BLE001 - never die silently: fail everything, say why, let the daemon exit
            log.exception("the model thread failed")
            with self._lock:
                self.state, self.detail = "failed", f"the model thread failed: {exc}"
            self._fail_all(Internal(self.detail))

    def _serve(self) -> None:
        """The model thread's loop: reap, admit, step, until drained."""
        while True:
            self._wake.clear()  # a submit after this line makes the wait below return at once
            self._answer_tokenize()
            self._reap()
            self._admit()
            self.metrics.queue_depth.set(len(self._waiting))
            if self.engine.has_unfinished():
                self._step()
            elif self.state == "draining" and not self._jobs:
                return
            else:
                self.metrics.active.set(0)
                self._wake.wait(0.05)

    def _reap(self) -> None:
        """End jobs that were cancelled, passed their deadline, lost their client, or must drain."""
        now = time.monotonic()
        draining = self.state == "draining"
        drain_over = draining and self._drain_deadline is not None and now > self._drain_deadline
        ended: list[Job] = []
        with self._lock:
            for job in self._jobs.values():
                if job.kill is None:
                    job.kill = self._verdict(job, now)
                if job.kill is None and (drain_over or (draining and not job.in_engine)):
                    job.kill = Cancelled("the daemon is stopping")
                if job.kill is not None:
                    ended.append(job)
            for job in ended:
                del self._jobs[job.key]
                if not job.in_engine:
                    self._waiting.remove(job)
        for job in ended:
            if job.in_engine:
                self.engine.abort_request(job.engine_id)
            self._fail(job, job.kill)

    def _verdict(self, job: Job, now: float) -> FLyError | None:
        """Why a job must end now (its deadline passed, or its client stopped heartbeating), else None."""
        timeout = job.request.timeout_s
        if timeout is not None and now - job.submitted > timeout:
            return Timeout(f"request {job.request.id} passed its deadline of {timeout} s")
        silent = now - job.last_seen
        if job.envelope != LOCAL and self.limits.heartbeat_timeout and silent > self.limits.heartbeat_timeout:
            return Cancelled(f"no heartbeat from the client for {self.limits.heartbeat_timeout} s")
        return None

    def _admit(self) -> None:
        """Join waiting requests to the batch while it has room (always at least one)."""
        while True:
            with self._lock:
                if not self._waiting or self.state != "ready":
                    return
                active = [j for j in self._jobs.values() if j.in_engine]
                if len(active) >= self.limits.max_batch_size:
                    return
                job = self._waiting[0]
            try:
                if not job.prompt_tokens:
                    self._encode(job)
                if active and sum(j.budget for j in active) + job.budget > self.limits.max_batch_tokens:
                    return
                self.engine.add_request(job.engine_id, job.prompt_ids, job.request.sampling,
                                        job.request.fly.apply(self.engine.config), job.request.structure)
            except Exception as exc:  # noqa: BLE001 - one bad request must not stop the model thread
                if not isinstance(exc, FLyError):
                    log.exception("admitting request %s failed", job.request.id)
                self._forget(job)
                self._fail(job, exc if isinstance(exc, FLyError) else Internal(f"admitting the request failed: {exc}"))
                continue
            with self._lock:
                self._waiting.popleft()
                job.in_engine = True
            job.prompt_ids = []

    def _encode(self, job: Job) -> None:
        request = job.request
        try:
            job.prompt_ids = self.engine.encode(request.prompt, *_template_inputs(request))
        except FLyError:
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. a chat template that rejects these messages
            raise BadRequest(f"cannot encode the prompt: {exc}") from None
        job.prompt_tokens = len(job.prompt_ids)
        if not job.prompt_ids:
            raise BadRequest("the prompt encodes to no tokens")
        cap = self.limits.max_prompt_tokens or self.engine.context_window - 1
        if job.prompt_tokens > cap:
            raise TooLong(f"prompt of {job.prompt_tokens} tokens exceeds the limit of {cap}")

    def _forget(self, job: Job) -> None:
        """Remove a job that ended (finished or failed) from the table and the queue."""
        with self._lock:
            self._jobs.pop(job.key, None)
            if job in self._waiting:
                self._waiting.remove(job)

    def _step(self) -> None:
        with self._lock:
            by_engine_id = {j.engine_id: j for j in self._jobs.values() if j.in_engine}
        batch = len(by_engine_id)
        self.max_batch_size_seen = max(self.max_batch_size_seen, batch)
        self.metrics.batch_size.observe(batch)
        self.metrics.active.set(batch)
        start = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - a failed step fails its batch, the daemon keeps serving
            log.exception("engine step failed")
            for job in by_engine_id.values():  # the engine dropped them all (FLyEngine.step resets on failure)
                self._forget(job)
                self._fail(job, Internal(f"engine step failed: {exc}"))
            return
        now = time.monotonic()
        self._busy_s += now - start
        for out in outputs:
            job = by_engine_id.get(out.request_id)
            if job is not None:
                self._deliver(job, out, now)
        self.stats = self.engine.stats.model_copy(deep=True)
        self.metrics.mat.set(self.stats.mat)
        self.prompt_stats = self.engine.prompt_stats
        self.metrics.prompt_work(self.prompt_stats)

    def _deliver(self, job: Job, out: "RequestOutput", now: float) -> None:
        if out.new_token_ids:
            if job.first_token_at is None:
                job.first_token_at = now
                self.metrics.ttft.observe(now - job.submitted)
            elif job.last_token_at is not None:
                self.metrics.itl.observe((now - job.last_token_at) / len(out.new_token_ids))
            job.last_token_at = now
            self.tokens_generated += len(out.new_token_ids)
            self.metrics.completion_tokens.inc(len(out.new_token_ids))
        job.token_ids += out.new_token_ids
        job.unsent_ids += out.new_token_ids
        text, calls = out.new_text, []
        if job.tool_calls is not None:
            text, calls = job.tool_calls.feed(text)
            if out.finished:
                rest, last = job.tool_calls.finish()
                text, calls = text + rest, calls + last
            job.calls += calls
        job.content.append(text)
        rid = job.request.id
        if job.request.stream and (text or calls):
            self._emit(job.envelope, TokenChunk(id=rid, text=text, token_ids=job.unsent_ids, tool_calls=calls))
            job.unsent_ids = []
        if not out.finished:
            return
        self._forget(job)
        self.requests_total += 1
        self.metrics.finished("ok", out.prompt_tokens, out.stats)
        content = "".join(job.content)
        reason = out.finish_reason or "stop"
        if job.calls:
            content, reason = content.strip(), ("tool_calls" if reason == "stop" else reason)
        self._emit(job.envelope, GenerateResult(
            id=rid, text=content, token_ids=job.token_ids, finish_reason=reason, tool_calls=job.calls,
            usage=Usage(prompt_tokens=out.prompt_tokens, completion_tokens=len(job.token_ids),
                        total_tokens=out.prompt_tokens + len(job.token_ids), cached_tokens=out.cached_tokens),
            stats=out.stats, model=self.engine.target_name,
            time_to_first_token_s=None if job.first_token_at is None else job.first_token_at - job.submitted,
            elapsed_s=now - job.submitted))

    def _fail_all(self, error: FLyError, only_without_engine: bool = False) -> None:
        """Answer every request the scheduler holds (queued, running, tokenize) with `error`.

        With `only_without_engine` nothing happens once the engine exists (checked under the lock), so
        the socket thread may call it while the model thread loads.
        """
        with self._lock:
            if only_without_engine and self.engine is not None:
                return
            jobs, tokenize = list(self._jobs.values()), list(self._tokenize)
            self._jobs.clear()
            self._waiting.clear()
            self._tokenize.clear()
        for job in jobs:
            self._fail(job, error)
        for envelope, request in tokenize:
            self._emit(envelope, ErrorReply(id=request.id, code=error.code, message=error.message))

    def _fail(self, job: Job, error: FLyError) -> None:
        self.requests_total += 1
        self.metrics.finished(error.code)
        self._emit(job.envelope, ErrorReply(id=job.request.id, code=error.code, message=error.message))

    def _answer_tokenize(self) -> None:
        while True:
            with self._lock:
                if not self._tokenize:
                    return
                envelope, request = self._tokenize.popleft()
            try:
                ids = self.engine.encode(request.text, *_template_inputs(request))
            except FLyError as exc:
                self._emit(envelope, ErrorReply(id=request.id, code=exc.code, message=exc.message))
                continue
            except Exception as exc:  # noqa: BLE001 - e.g. a chat template error on odd input
                self._emit(envelope, ErrorReply(id=request.id, code=BadRequest.code, message=str(exc)))
                continue
            self._emit(envelope, TokenizeReply(id=request.id, token_ids=ids, count=len(ids)))


def _client_of(envelope: Envelope) -> str:
    """The default client of a request: its socket (the ROUTER's routing frames)."""
    return "zmq:" + "/".join(frame.hex() for frame in envelope)


def _template_inputs(request: GenerateRequest | TokenizeRequest) -> tuple[list[dict] | None, list[dict] | None]:
    """A request's chat messages and tools as the chat template takes them (generate and tokenize alike)."""
    messages = [m.for_template() for m in request.messages] if request.messages is not None else None
    tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
    return messages, tools
