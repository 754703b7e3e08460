"""Continuous batching of generate requests into one FLyEngine (runs in the daemon's model thread).

The socket thread calls `submit`, `cancel`, `touch`, `client_gone`, `tokenize` and `drain` (all
thread-safe and quick). Once the models are loaded, a small pool of worker threads prepares each
queued request — the character limit, the chat template and tokenizer, the token limit and the
constraint (the model's tool format, `fly_llm.common.tool_formats`) and its grammar
(`FLyEngine.compile_constraint`) — and answers tokenize requests, so no request's
preparation holds up a running stream. The model thread runs `run()`: it loads the models, then
loops — drop what was cancelled, timed out or abandoned, join a bounded number of prepared
requests to the batch while it has room (in queue order), run one engine step, and hand each
request's new text to `emit` (which the server sends on; it is thread-safe).

A job is in exactly one place: queued, preparing, prepared or in the engine (`check()`). Each
client (a ZeroMQ socket, an HTTP connection) may have `max_requests_per_client` of them, weighing
`max_tokens_per_client` (`fly_daemon.request_weight`), all clients together `queue_size` outside the
engine. Each request's cache scope (prefix cache, compiled grammars) is its tenant (the credential it came with) unless `share_prefix_cache`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from bisect import insort
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import count
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from fly_llm.common.constraints import Constraint
from fly_llm.common.errors import (
    BadRequest, Busy, Cancelled, FLyError, Internal, NotReady, Timeout, TooLong, contained, error_from_code,
)
from fly_llm.common.protocol import (
    ErrorReply, GenerateRequest, GenerateResult, HealthState, TokenChunk, TokenizeReply, TokenizeRequest, TokenLogprob,
    TopLogprob, Usage,
)
from fly_llm.common.stats import PromptStats, RequestStats
from fly_llm.common.tool_formats import Constraints
from fly_llm.common.tools import ToolCall

from fly_daemon.call_text import CallText
from fly_daemon.metrics import Metrics
from fly_daemon.request_weight import check_admission, check_reply_size, weight

if TYPE_CHECKING:
    from fly_llm.decoding.engine import FLyEngine, RequestOutput

log = logging.getLogger("fly_daemon")

Envelope = tuple[bytes, ...]
"""The ROUTER routing frames of one client socket."""
LOCAL: Envelope = ()
"""The envelope of requests submitted from inside the process (fly_daemon.inproc): no routing frames, so it
is never a socket's, and no heartbeats (their owner cancels them when it stops waiting)."""
Emit = Callable[[Envelope, BaseModel], None]
Place = Literal["queued", "preparing", "prepared", "engine", "ended"]

PREPARE_WORKERS = 2
"""Threads that prepare requests and answer tokenize requests."""
ADMISSIONS_PER_TURN = 4
"""Prepared requests the model thread tries to add to the engine between two steps."""
CHARS_PER_TOKEN = 16
"""Characters a prompt may have per token of the token limit when `max_prompt_chars` is unset: far more
than any tokenizer averages over real text, so only prompts that cannot fit are refused unread."""


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
    max_tokens_per_client: int = Field(65_536, ge=1, description="Weight one client's queued and running "
                                       "requests may have: each max_tokens plus its echoed prompt tokens, so n "
                                       "choices weigh n × max_tokens (fly_daemon.request_weight); more get BUSY.")
    max_reply_units: int = Field(524_288, ge=1, description="Token entries one request's reply may carry: choices × "
                                 "(echoed prompt tokens + max_tokens) × (1 + top logprobs); more get TOO_LONG.")
    share_prefix_cache: bool = Field(False, description="Let every client reuse every other's cached prompts and "
                                     "compiled grammars (a single-tenant deployment); else each credential has "
                                     "its own.")
    heartbeat_timeout: float = Field(5.0, ge=0, description="Seconds without a client heartbeat before a "
                                                             "request is cancelled; 0 = never.")
    drain_timeout: float = Field(10.0, ge=0, description="Seconds running requests get to finish on stop.")


@dataclass(eq=False)
class Job:
    """One generate request from submission to its final reply."""

    envelope: Envelope
    request: GenerateRequest
    seq: int  # submission order
    tenant: str  # whose prefix cache it may use (a credential: "local", "curve:KEY", "http-key:HASH")
    client: str  # what the per-client cap counts (one socket, one HTTP connection)
    submitted: float
    last_seen: float
    place: Place = "queued"
    prompt_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    constraint: Constraint | None = None  # what constrains its output, from preparation until it joins the engine
    matcher: object | None = None  # the compiled grammar, from preparation until it joins the engine
    token_ids: list[int] = field(default_factory=list)
    unsent_ids: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    last_token_at: float | None = None
    kill: FLyError | None = None
    tool_calls: CallText | None = None  # set when the request may call tools: splits calls from text
    calls: list[ToolCall] = field(default_factory=list)
    content: list[str] = field(default_factory=list)  # text outside tool calls
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of token_ids, when the request asks
    unsent_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def key(self) -> tuple[Envelope, str]:
        return self.envelope, self.request.id

    @property
    def engine_id(self) -> str:
        return f"r{self.seq}"

    @property
    def budget(self) -> int:
        """Tokens this request may occupy in the batch (prompt + max new tokens)."""
        return self.prompt_tokens + self.request.sampling.max_tokens


class Scheduler:
    """Bounded admission queue, preparation off the model thread, and continuous batching into one
    engine, built by `load_engine`. `executor` runs the preparations (default: a pool of
    PREPARE_WORKERS threads)."""

    def __init__(self, load_engine: Callable[[], "FLyEngine"], emit: Emit, limits: Limits = Limits(),
                 metrics: Metrics | None = None, executor: Executor | None = None) -> None:
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
        self._constraints: Constraints | None = None  # the model's, once it is loaded
        self._emit = emit
        self._executor = executor or ThreadPoolExecutor(PREPARE_WORKERS, thread_name_prefix="fly-prepare")
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._jobs: dict[tuple[Envelope, str], Job] = {}
        self._queued: deque[Job] = deque()
        self._preparing: set[Job] = set()
        self._prepared: list[Job] = []  # in submission order
        self._per_client: dict[str, int] = {}
        self._tokenize: deque[tuple[Envelope, TokenizeRequest]] = deque()  # while loading
        self._tokenize_pending = 0  # waiting for the models or the pool
        self._seqs = count()
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
        client = client or _client_of(envelope)
        with self._lock:
            self._check_open()
            if (envelope, request.id) in self._jobs:
                raise BadRequest(f"request id {request.id!r} is already in flight")
            if self._per_client.get(client, 0) >= self.limits.max_requests_per_client:
                raise Busy(f"this client already has {self.limits.max_requests_per_client} requests queued or "
                           f"running (the daemon's max_requests_per_client)")
            check_admission(request, sum(weight(j.request, j.prompt_tokens) for j in self._jobs.values()
                                         if j.client == client), self.limits.max_tokens_per_client)
            if self._outside_engine() >= self.limits.queue_size:
                raise Busy(f"admission queue full ({self.limits.queue_size} waiting)")
            job = Job(envelope, request, next(self._seqs), tenant, client, now, now)
            self._jobs[job.key] = job
            self._queued.append(job)
            self._per_client[client] = self._per_client.get(client, 0) + 1
            loaded = self.engine is not None
        if loaded:
            self._executor.submit(self._prepare_next)

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

    def touch(self, envelope: Envelope, request_ids: list[str], *, tenant: str = "local") -> None:
        """A heartbeat from `envelope` with credential `tenant`: its sender still waits for these requests.

        Only the sender's own are touched: those sent on this socket, and those of its credential
        (FLyClient heartbeats from a socket of its own, with the same credential).
        """
        wanted, now = set(request_ids), time.monotonic()
        with self._lock:
            for job in self._jobs.values():
                if job.request.id in wanted and (job.envelope == envelope or job.tenant == tenant):
                    job.last_seen = now

    def tokenize(self, envelope: Envelope, request: TokenizeRequest) -> None:
        """Queue a tokenize request (answered by the preparation pool; waits while models load)."""
        with self._lock:
            self._check_open()
            if self._tokenize_pending >= self.limits.queue_size:
                raise Busy("too many tokenize requests waiting")
            self._tokenize_pending += 1
            loaded = self.engine is not None
            if not loaded:
                self._tokenize.append((envelope, request))
        if loaded:
            self._executor.submit(self._answer_tokenize, envelope, request)

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
            waiting = self._outside_engine()
            active = len(self._jobs) - waiting
        return dict(queue_depth=waiting, active=active, max_batch_size_seen=self.max_batch_size_seen,
                    requests_total=self.requests_total, tokens_generated=self.tokens_generated,
                    tokens_per_s=self.tokens_generated / self._busy_s if self._busy_s else 0.0,
                    stats=self.stats, prompt=self.prompt_stats)

    def check(self) -> None:
        """Assert the bookkeeping: every job is in exactly one place (queued, preparing, prepared, engine)
        and that place says so; the prepared are in submission order; the per-client counts match the
        jobs and stay within the cap; the queue and the batch within their bounds."""
        with self._lock:
            places: dict[Place, list[Job]] = {"queued": list(self._queued), "preparing": list(self._preparing),
                                              "prepared": list(self._prepared),
                                              "engine": [j for j in self._jobs.values() if j.place == "engine"]}
            held = [job for jobs in places.values() for job in jobs]
            assert len({id(j) for j in held}) == len(held) == len(self._jobs), "a job is in two places or none"
            for place, jobs in places.items():
                assert all(j.place == place and self._jobs.get(j.key) is j for j in jobs), f"stale {place} job"
            assert [j.seq for j in self._prepared] == sorted(j.seq for j in self._prepared), "prepared out of order"
            clients: dict[str, int] = {}
            for job in self._jobs.values():
                clients[job.client] = clients.get(job.client, 0) + 1
            assert clients == self._per_client, (clients, self._per_client)
            assert max(clients.values(), default=0) <= self.limits.max_requests_per_client
            assert len(held) - len(places["engine"]) <= self.limits.queue_size
            assert len(places["engine"]) <= self.limits.max_batch_size
            assert len(self._tokenize) <= self._tokenize_pending <= self.limits.queue_size

    def _check_open(self) -> None:
        """Raise NotReady unless new work is taken: while loading (it waits for the models) or ready."""
        if self.state == "failed":
            raise NotReady(self.detail)
        if self.state not in ("loading", "ready"):
            raise NotReady(f"the daemon is {self.state}")

    def _outside_engine(self) -> int:
        """Jobs queued, preparing or prepared (the lock is held)."""
        return len(self._queued) + len(self._preparing) + len(self._prepared)

    def _end_queued(self, verdict: Callable[[Job], FLyError | None]) -> None:
        """If no engine exists yet, fail the queued jobs that were cancelled or that `verdict` gives an error for.

        Safe from any thread: nothing leaves the queue before the engine exists, and that is checked under the lock.
        """
        with self._lock:
            if self.engine is not None:
                return
            ended = []
            for job in self._queued:
                job.kill = job.kill or verdict(job)
                if job.kill is not None:
                    ended.append(job)
            for job in ended:
                self._detach(job)
        for job in ended:
            self._fail(job, job.kill)

    def _detach(self, job: Job) -> None:
        """Take a job out of the table, its place and its client's count (the lock is held)."""
        del self._jobs[job.key]
        if job.place == "queued":
            self._queued.remove(job)
        elif job.place == "preparing":
            self._preparing.discard(job)
        elif job.place == "prepared":
            self._prepared.remove(job)
        left = self._per_client[job.client] - 1
        if left:
            self._per_client[job.client] = left
        else:
            del self._per_client[job.client]
        job.place = "ended"

    def _end(self, job: Job, error: FLyError) -> None:
        """Fail a job unless it has already ended (any thread)."""
        with self._lock:
            if job.place == "ended":
                return
            self._detach(job)
        self._fail(job, error)

    # ---- the preparation pool ----

    def _prepare_next(self) -> None:
        """Prepare one queued job: the oldest of a client with nothing being prepared, else the oldest."""
        with self._lock:
            busy = {j.client for j in self._preparing}
            job = next((j for j in self._queued if j.client not in busy), self._queued[0] if self._queued else None)
            if job is None:
                return  # its job was cancelled or taken by another task
            self._queued.remove(job)
            self._preparing.add(job)
            job.place = "preparing"
        try:
            self._prepare(job)
        except BaseException as exc:  # a failed preparation (a grammar compiler's panic too) fails only its request
            if not contained(exc):
                raise
            self._end(job, _error_of(exc, f"preparing request {job.request.id} failed"))
            return
        with self._lock:
            if job.place != "preparing":
                return  # it ended (cancelled, timed out) while it was prepared
            self._preparing.remove(job)
            job.place = "prepared"
            insort(self._prepared, job, key=lambda j: j.seq)
        self._wake.set()

    def _prepare(self, job: Job) -> None:
        """Tokenize the prompt (within the limits), compile the request's constraint and set its call parser."""
        request = job.request
        job.prompt_ids = self._tokens_of(request)
        job.prompt_tokens = len(job.prompt_ids)
        if not job.prompt_ids:
            raise BadRequest("the prompt encodes to no tokens")
        cap = self._token_cap()
        if job.prompt_tokens > cap:
            raise TooLong(f"prompt of {job.prompt_tokens} tokens exceeds the limit of {cap}")
        check_reply_size(request, job.prompt_tokens, self.limits.max_reply_units)
        job.constraint = self._constraints.constraint(request.structure)
        job.matcher = self.engine.compile_constraint(job.constraint, self._scope(job))
        parser = self._constraints.parser(request.structure)
        job.tool_calls = None if parser is None else CallText(parser)

    def _scope(self, job: Job) -> str:
        """Whose caches (prefixes, compiled grammars) a job reads and fills: its tenant's, unless shared."""
        return "" if self.limits.share_prefix_cache else job.tenant

    def _token_cap(self) -> int:
        return self.limits.max_prompt_tokens or self.engine.context_window - 1

    def _tokens_of(self, request: GenerateRequest | TokenizeRequest) -> list[int]:
        """The prompt's token ids (chat template applied), once it is within the character limit."""
        chars = _prompt_chars(request)
        cap = self.limits.max_prompt_chars or CHARS_PER_TOKEN * self._token_cap()
        if chars > cap:
            raise TooLong(f"prompt of {chars} characters exceeds the limit of {cap}")
        text = request.prompt if isinstance(request, GenerateRequest) else request.text
        special = isinstance(request, GenerateRequest) or request.add_special
        try:
            return self.engine.encode(text, *_template_inputs(request), add_special=special)
        except FLyError:
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. a chat template that rejects these messages
            raise BadRequest(f"cannot encode the prompt: {exc}") from None

    def _answer_tokenize(self, envelope: Envelope, request: TokenizeRequest) -> None:
        try:
            if request.token_ids is not None:
                reply: BaseModel = self._decode(request)
            else:
                ids = self._tokens_of(request)
                reply = TokenizeReply(id=request.id, token_ids=ids, count=len(ids))
        except Exception as exc:  # noqa: BLE001 - a failed tokenize request fails only itself
            error = _error_of(exc, f"tokenize request {request.id} failed")
            reply = ErrorReply(id=request.id, code=error.code, message=error.message)
        finally:
            with self._lock:
                self._tokenize_pending -= 1
        self._emit(envelope, reply)

    def _decode(self, request: TokenizeRequest) -> TokenizeReply:
        """The text of a tokenize request's token ids (no more of them than a prompt may have)."""
        ids, cap = request.token_ids, self._token_cap()
        if len(ids) > cap:
            raise TooLong(f"{len(ids)} token ids exceed the limit of {cap}")
        return TokenizeReply(id=request.id, token_ids=ids, count=len(ids), text=self.engine.decode(ids))

    # ---- the model thread ----

    def run(self) -> None:
        """Load the engine, then serve until drained (the body of the model thread)."""
        try:
            engine = self._load_engine()
        except Exception as exc:  # noqa: BLE001 - any load failure ends the daemon with its message
            log.exception("loading models failed")
            with self._lock:
                self.state, self.detail = "failed", f"loading models failed: {exc}"
            self.abandon_queue(NotReady(self.detail))  # what was queued while loading gets the reason
            self._executor.shutdown(wait=False)
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
                self.state, self.detail = "failed", "the model thread failed (the daemon's log has the details)"
            self._fail_all(Internal(self.detail))
        finally:
            self._executor.shutdown(wait=False)  # what it still holds ends quickly: no queued job is left

    def start(self, engine: "FLyEngine") -> None:
        """The models are loaded: serve with `engine`, and prepare what was queued while they loaded."""
        with self._lock:
            self.engine = engine
            self._constraints = Constraints.of(engine)
            if self.state == "loading":
                self.state, self.detail = "ready", ""
            tokenize, queued = list(self._tokenize), len(self._queued)
            self._tokenize.clear()
        for envelope, request in tokenize:
            self._executor.submit(self._answer_tokenize, envelope, request)
        for _ in range(queued):
            self._executor.submit(self._prepare_next)

    def _serve(self) -> None:
        """The model thread's loop: turn after turn until drained, waiting for work when there is none."""
        while not (self.state == "draining" and not self._jobs and not self._tokenize_pending):
            self._wake.clear()  # a submit or preparation after this line makes the wait below return at once
            if not self.turn():
                self.metrics.active.set(0)
                self._wake.wait(0.05)

    def turn(self) -> bool:
        """Reap, admit, and run one engine step if any request is in the engine; whether a step ran."""
        self._reap()
        self._admit()
        with self._lock:
            self.metrics.queue_depth.set(self._outside_engine())
        if not self.engine.has_unfinished():
            return False
        self._step()
        return True

    def _reap(self) -> None:
        """End jobs that were cancelled, passed their deadline, lost their client, or must drain."""
        now = time.monotonic()
        draining = self.state == "draining"
        drain_over = draining and self._drain_deadline is not None and now > self._drain_deadline
        ended: list[tuple[Job, bool]] = []
        with self._lock:
            for job in self._jobs.values():
                if job.kill is None:
                    job.kill = self._verdict(job, now)
                if job.kill is None and (drain_over or (draining and job.place != "engine")):
                    job.kill = Cancelled("the daemon is stopping")
                if job.kill is not None:
                    ended.append((job, job.place == "engine"))
            for job, _ in ended:
                self._detach(job)
        for job, in_engine in ended:
            if in_engine:
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
        """Join prepared requests to the batch in queue order while it has room (always at least one):
        at most ADMISSIONS_PER_TURN tries, failed ones included, so the running streams wait for
        no more than that before their next step."""
        for _ in range(ADMISSIONS_PER_TURN):
            with self._lock:
                job = self._joinable()
                if job is None:
                    return
                self._prepared.pop(0)
                job.place = "engine"
            try:
                self.engine.add_request(job.engine_id, job.prompt_ids, job.request.sampling,
                                        job.request.fly.apply(self.engine.config), job.constraint,
                                        matcher=job.matcher,
                                        cache_scope=self._scope(job),
                                        logprobs=job.request.logprobs, prompt_logprobs=job.request.prompt_logprobs)
            except Exception as exc:  # noqa: BLE001 - one bad request must not stop the model thread
                self._end(job, _error_of(exc, f"admitting request {job.request.id} failed"))
                continue
            job.constraint, job.matcher = None, None
            if not job.request.prompt_logprobs:  # else kept: its prompt's log-probabilities name them
                job.prompt_ids = []

    def _joinable(self) -> Job | None:
        """The first prepared job if the batch has room for it (the lock is held)."""
        if self.state != "ready" or not self._prepared:
            return None
        active = [j for j in self._jobs.values() if j.place == "engine"]
        if len(active) >= self.limits.max_batch_size:
            return None
        job = self._prepared[0]
        if active and sum(j.budget for j in active) + job.budget > self.limits.max_batch_tokens:
            return None
        return job

    def _step(self) -> None:
        with self._lock:
            by_engine_id = {j.engine_id: j for j in self._jobs.values() if j.place == "engine"}
        batch = len(by_engine_id)
        self.max_batch_size_seen = max(self.max_batch_size_seen, batch)
        self.metrics.batch_size.observe(batch)
        self.metrics.active.set(batch)
        start = time.monotonic()
        try:
            outputs = self.engine.step()
        except BaseException as exc:  # a failed step (a model forward: row faults end their row alone in the
            if not contained(exc):  # engine) fails its batch; the daemon keeps serving
                raise
            log.exception("engine step failed")
            for job in by_engine_id.values():  # the engine dropped them all (FLyEngine.step resets on failure)
                self._end(job, Internal("the engine step failed (an internal error; the daemon's log has the details)"))
            return
        now = time.monotonic()
        self._busy_s += now - start
        for out in outputs:
            job = by_engine_id.get(out.request_id)
            if job is not None:
                self._deliver_one(job, out, now)
        self.stats = self.engine.stats.model_copy(deep=True)
        self.metrics.mat.set(self.stats.mat)
        self.prompt_stats = self.engine.prompt_stats
        self.metrics.prompt_work(self.prompt_stats)

    def _deliver_one(self, job: Job, out: "RequestOutput", now: float) -> None:
        """Deliver one step's output to its job; any failure (a grammar that failed in the engine, an
        exception while parsing the output) ends that job only, and its row."""
        if out.error is not None:  # its grammar failed, or a per-row stage raised (fly_llm.decoding.row_faults)
            self._end(job, error_from_code(out.error_code, out.error))
            return
        try:
            self._deliver(job, out, now)
        except Exception:  # noqa: BLE001 - e.g. the tool-call parser on hostile output: fail this request only
            log.exception("handling the output of request %s failed", job.request.id)
            self.engine.abort_request(job.engine_id)
            self._end(job, Internal(f"handling the model's output for request {job.request.id} failed"))

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
        if out.logprobs is not None:
            logprobs = self._named(out.new_token_ids, out.logprobs)
            job.logprobs += logprobs
            job.unsent_logprobs += logprobs
        if out.prompt_logprobs is not None:
            first = TokenLogprob(token_id=job.prompt_ids[0], token=self.engine.decode(job.prompt_ids[:1]), logprob=None)
            job.prompt_logprobs = [first, *self._named(job.prompt_ids[1:], out.prompt_logprobs)]
        text, calls = out.new_text, []
        if job.tool_calls is not None:
            text, calls = job.tool_calls.feed(text, out.finished)
            job.calls += calls
        job.content.append(text)
        rid = job.request.id
        if job.request.stream and (text or calls):
            asked = job.request.logprobs is not None
            self._emit(job.envelope, TokenChunk(id=rid, text=text, token_ids=job.unsent_ids, tool_calls=calls,
                                                logprobs=job.unsent_logprobs if asked else None))
            job.unsent_ids, job.unsent_logprobs = [], []
        if not out.finished:
            return
        content = "".join(job.content)
        reason = out.finish_reason or "stop"
        if job.calls and reason == "stop":
            reason = "tool_calls"
        result = GenerateResult(
            id=rid, text=content, token_ids=job.token_ids, finish_reason=reason, tool_calls=job.calls,
            usage=Usage(prompt_tokens=out.prompt_tokens, completion_tokens=len(job.token_ids),
                        total_tokens=out.prompt_tokens + len(job.token_ids), cached_tokens=out.cached_tokens),
            stats=out.stats, model=self.engine.target_name,
            time_to_first_token_s=None if job.first_token_at is None else job.first_token_at - job.submitted,
            elapsed_s=now - job.submitted, logprobs=job.logprobs if job.request.logprobs is not None else None,
            prompt_logprobs=job.prompt_logprobs)
        with self._lock:
            self._detach(job)
            self.requests_total += 1
        self.metrics.finished("ok", out.prompt_tokens, out.stats)
        self._emit(job.envelope, result)

    def _named(self, token_ids: list[int], logprobs: list) -> list[TokenLogprob]:
        """The engine's log-probabilities of `token_ids` (fly_llm.decoding.logprobs) with each token's text."""
        def top(token_id: int, logprob: float) -> TopLogprob:
            return TopLogprob(token_id=token_id, token=self.engine.decode([token_id]), logprob=logprob)

        return [TokenLogprob(**top(t, lp).model_dump(), top=[top(i, v) for i, v in alternatives])
                for t, (lp, alternatives) in zip(token_ids, logprobs)]

    def _fail_all(self, error: FLyError, only_without_engine: bool = False) -> None:
        """Answer every request the scheduler holds (queued, running, tokenize) with `error`.

        With `only_without_engine` nothing happens once the engine exists (checked under the lock), so
        the socket thread may call it while the model thread loads.
        """
        with self._lock:
            if only_without_engine and self.engine is not None:
                return
            jobs, tokenize = list(self._jobs.values()), list(self._tokenize)
            for job in jobs:
                self._detach(job)
            self._tokenize.clear()
            self._tokenize_pending -= len(tokenize)
        for job in jobs:
            self._fail(job, error)
        for envelope, request in tokenize:
            self._emit(envelope, ErrorReply(id=request.id, code=error.code, message=error.message))

    def _fail(self, job: Job, error: FLyError) -> None:
        with self._lock:
            self.requests_total += 1
        self.metrics.finished(error.code)
        self._emit(job.envelope, ErrorReply(id=job.request.id, code=error.code, message=error.message))


def _error_of(exc: BaseException, what: str) -> FLyError:
    """The reply to a request whose handling raised `exc`: its own FLyError, else INTERNAL saying `what`
    (the exception's text stays in the log)."""
    if isinstance(exc, FLyError):
        return exc
    log.error("%s", what, exc_info=exc)
    return Internal(what)


def _prompt_chars(request: GenerateRequest | TokenizeRequest) -> int:
    """Characters of a request's prompt: its text, or its messages and tools as JSON."""
    text = request.prompt if isinstance(request, GenerateRequest) else request.text
    if text is not None:
        return len(text)
    return len(json.dumps(_template_inputs(request), ensure_ascii=False))


def _client_of(envelope: Envelope) -> str:
    """The default client of a request: its socket (the ROUTER's routing frames)."""
    return "zmq:" + "/".join(frame.hex() for frame in envelope)


def _template_inputs(request: GenerateRequest | TokenizeRequest) -> tuple[list[dict] | None, list[dict] | None]:
    """A request's chat messages and tools as the chat template takes them (generate and tokenize alike)."""
    messages = [m.for_template() for m in request.messages] if request.messages is not None else None
    tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
    return messages, tools
