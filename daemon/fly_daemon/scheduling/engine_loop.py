"""The model thread's turns over a loaded engine (the scheduler's first room, with fly_daemon.scheduling.scheduler):
reap what must end, admit prepared requests while the batch has room, run one engine step, and hand
each output to delivery (fly_daemon.scheduling.delivery).

`Lifecycle` is the scheduler's state (loading, ready, draining, failed) and drain deadline, which
both the socket thread (submit, drain) and the model thread (reap, admit) read.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fly_llm.common.errors import Cancelled, FLyError, Internal, NotReady, contained, error_from_code
from fly_llm.common.protocol import HealthState

from fly_daemon.limits import Limits
from fly_daemon.metrics import Metrics
from fly_daemon.scheduling.delivery import Delivery
from fly_daemon.scheduling.request_queue import Entry, RequestQueue

if TYPE_CHECKING:
    from fly_llm.decoding.engine import FLyEngine, RequestOutput

log = logging.getLogger("fly_daemon")

ADMISSIONS_PER_TURN = 4
"""Prepared requests the model thread tries to add to the engine between two steps."""


@dataclass
class Lifecycle:
    """The scheduler's state, what it says about it, and when running requests must be done draining."""

    state: HealthState = "loading"
    detail: str = "loading models"
    drain_deadline: float | None = None

    def check_open(self) -> None:
        """Raise NotReady unless new work is taken: while loading (it waits for the models) or ready."""
        if self.state == "failed":
            raise NotReady(self.detail)
        if self.state not in ("loading", "ready"):
            raise NotReady(f"the daemon is {self.state}")

    def drain(self, timeout: float, force: bool) -> None:
        """Stop admitting; running requests get `timeout` seconds (none if `force`)."""
        if self.state in ("loading", "ready"):
            self.state, self.detail = "draining", "stopping"
            self.drain_deadline = time.monotonic() + timeout
        if force and self.state == "draining":
            self.drain_deadline = time.monotonic()

    def loaded(self) -> None:
        """The models are loaded: ready, unless a stop came while they loaded."""
        if self.state == "loading":
            self.state, self.detail = "ready", ""

    def fail(self, detail: str) -> None:
        self.state, self.detail = "failed", detail


class EngineLoop:
    """Turns of one loaded `engine` over the scheduler's `books` (guarded by `lock`)."""

    def __init__(self, engine: "FLyEngine", books: RequestQueue, lock: threading.Lock, life: Lifecycle,
                 delivery: Delivery, limits: Limits, metrics: Metrics) -> None:
        self.engine = engine
        self.busy_s = 0.0
        self.max_batch_size_seen = 0
        self._books, self._lock, self._life = books, lock, life
        self._delivery, self._limits, self._metrics = delivery, limits, metrics

    def turn(self) -> bool:
        """Reap, admit, and run one engine step if any request is in the engine; whether a step ran."""
        self._reap()
        self._admit()
        with self._lock:
            self._metrics.queue_depth.set(self._books.outside_engine())
        if not self.engine.has_unfinished():
            return False
        self._step()
        return True

    def end(self, entry: Entry, error: FLyError) -> None:
        """Fail a request unless it has already ended (any thread)."""
        with self._lock:
            if entry.place == "ended":
                return
            self._books.detach(entry)
        self._delivery.fail(entry.envelope, entry.request.id, error)

    def _reap(self) -> None:
        """End requests that were cancelled, passed their deadline, lost their client, or must drain."""
        now = time.monotonic()
        draining = self._life.state == "draining"
        drain_over = draining and self._life.drain_deadline is not None and now > self._life.drain_deadline

        def reason(entry: Entry) -> FLyError | None:
            verdict = entry.verdict(now, self._limits.heartbeat_timeout)
            if verdict is None and (drain_over or (draining and entry.place != "engine")):
                return Cancelled("the daemon is stopping")
            return verdict

        with self._lock:
            ended = self._books.sweep(reason)
        for entry, in_engine in ended:
            if in_engine:
                self.engine.abort_request(entry.engine_id)
            self._delivery.fail(entry.envelope, entry.request.id, entry.kill)

    def _admit(self) -> None:
        """Join prepared requests to the batch in queue order while it has room (always at least one):
        at most ADMISSIONS_PER_TURN tries, failed ones included, so the running streams wait for
        no more than that before their next step."""
        for _ in range(ADMISSIONS_PER_TURN):
            with self._lock:
                entry = self._books.take_joinable() if self._life.state == "ready" else None
            if entry is None:
                return
            prepared, request = entry.prepared, entry.request
            try:
                entry.output = self._delivery.open(entry.envelope, request, entry.submitted, prepared.prompt_ids)
                self.engine.add_request(entry.engine_id, prepared.prompt_ids, request.sampling,
                                        request.fly.apply(self.engine.config), prepared.constraint,
                                        matcher=prepared.matcher,
                                        cache_scope=entry.cache_scope(self._limits.share_prefix_cache),
                                        logprobs=request.logprobs, prompt_logprobs=request.prompt_logprobs,
                                        min_indent=request.infill.min_indent if request.infill else 0)
            except Exception as exc:  # noqa: BLE001 - one bad request must not stop the model thread
                self.end(entry, error_of(exc, f"admitting request {request.id} failed"))
                continue
            entry.prepared = None  # its prompt ids (kept by its output state only for prompt_logprobs), its grammar

    def _step(self) -> None:
        """Run one engine step and deliver its outputs; a failed step fails its batch."""
        with self._lock:
            by_engine_id = {e.engine_id: e for e in self._books.in_engine()}
        batch = len(by_engine_id)
        self.max_batch_size_seen = max(self.max_batch_size_seen, batch)
        self._metrics.batch_size.observe(batch)
        self._metrics.active.set(batch)
        start = time.monotonic()
        try:
            outputs = self.engine.step()
        except BaseException as exc:  # a failed step (a model forward: row faults end their row alone in the
            if not contained(exc):  # engine) fails its batch; the daemon keeps serving
                raise
            log.exception("engine step failed")
            for entry in by_engine_id.values():  # the engine dropped them all (FLyEngine.step resets on failure)
                self.end(entry, Internal("the engine step failed (an internal error; the daemon's log has the details)"))
            return
        now = time.monotonic()
        self.busy_s += now - start
        for out in outputs:
            entry = by_engine_id.get(out.request_id)
            if entry is not None:
                self._deliver(entry, out, now)
        self._delivery.record_step()

    def _deliver(self, entry: Entry, out: "RequestOutput", now: float) -> None:
        """Deliver one step's output to its request; any failure (a grammar that failed in the engine, an
        exception while reading the output) ends that request only, and its row."""
        if out.error is not None:  # its grammar failed, or a per-row stage raised (fly_llm.decoding.row_faults)
            self.end(entry, error_from_code(out.error_code, out.error))
            return
        try:
            result = self._delivery.update(entry.output, out, now)
        except Exception:  # noqa: BLE001 - e.g. the tool-call parser on hostile output: fail this request only
            log.exception("handling the output of request %s failed", entry.request.id)
            self.engine.abort_request(entry.engine_id)
            self.end(entry, Internal(f"handling the model's output for request {entry.request.id} failed"))
            return
        if result is not None:
            with self._lock:
                self._books.detach(entry)  # before the result is sent: its id may be reused at once
            self._delivery.finish(entry.output, result)


def error_of(exc: BaseException, what: str) -> FLyError:
    """The reply to a request whose handling raised `exc`: its own FLyError, else INTERNAL saying `what`
    (the exception's text stays in the log)."""
    if isinstance(exc, FLyError):
        return exc
    log.error("%s", what, exc_info=exc)
    return Internal(what)
