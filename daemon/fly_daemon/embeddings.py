"""The daemon's embedding worker: sentence vectors computed beside generation, never inside its step loop.

One `EmbeddingService` per serving core. Nothing happens until the first embeddings request: then a
worker thread of its own (`fly-embed`) loads the embedding model (fly_llm.model.embedding, through the
loader the core hands in) and serves a bounded FIFO of requests. Inputs are tokenized off the event
loop (a chunk at a time, so an over-length input is refused before the rest are tokenized), then queued in
a lane of their client's (at most `embedding_queue_size` inputs wait, all requests together, and a client's
share of them, `CLIENT_SHARE`; more get BUSY); the worker runs the encoder on at most `embedding_batch_size`
sequences at a time, taken from the clients' lanes in turn, one input each (so one client's 2,048 long
inputs do not keep another's one waiting; a request's inputs longest-first), with its own `embedding_threads`
torch intra-op threads (torch's thread count is per thread: the model thread keeps its own) and a
niceness of `embedding_nice` (on Linux a thread's own), so that when both want the cores, the model
thread's get them. A request whose client leaves is dropped from the queue. The model is listed by its
name (`listed`) before it loads, and no longer once its load failed. The HTTP routes are fly_daemon.http.embeddings_routes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from fly_llm.common.errors import BadRequest, Busy, FLyError, ModelError, TooLong

log = logging.getLogger("fly_daemon")

MAX_INPUTS = 2048
"""Inputs one request may carry (OpenAI's limit)."""
CLIENT_SHARE = 4
"""A client's inputs may fill 1/CLIENT_SHARE of the queue (at least one request's MAX_INPUTS): four connections of
one client no longer fill it for everyone."""
TOKENIZE_CHUNK = 64
"""Inputs tokenized at a time: an over-length one is refused before the rest are tokenized."""


class EmbeddingSettings(BaseModel):
    """Whether and how the daemon serves embeddings; fly_daemon.settings.DaemonSettings extends this model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    embeddings: bool = Field(True, description="Serve /v1/embeddings, /api/embed and /api/embeddings (the model "
                             "loads on the first request: a daemon that never embeds loads nothing).")
    embedding_model: str | None = Field(None, description="Local directory or Hugging Face id (already in the "
                                        "local cache) of the embedding model; None = the embedded all-MiniLM-L6-v2.")
    embedding_batch_size: int = Field(32, ge=1, le=1024, description="Sequences per encoder forward (across "
                                      "requests); smaller holds the CPU for less at a time.")
    embedding_queue_size: int = Field(8192, ge=MAX_INPUTS, le=1_000_000, description="Inputs waiting to be "
                                      "embedded, all requests together; a request that does not fit gets BUSY.")
    embedding_threads: int = Field(1, ge=1, le=1024, description="Torch intra-op threads of the embedding worker "
                                   "(the model thread keeps its own; 1 leaves generation the other cores).")
    embedding_nice: int = Field(10, ge=0, le=19, description="Niceness of the embedding worker thread (Linux): "
                                "when both want the cores, generation's threads get most of them; 0 = equal share.")


class Embedder(Protocol):
    """What the worker needs of an embedding model (fly_llm.model.embedding.SentenceEmbedder)."""

    name: str
    aliases: tuple[str, ...]
    dimensions: int
    max_length: int
    vocab_size: int

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]: ...

    def sequence(self, ids: Sequence[int], truncate: bool) -> list[int]: ...

    def embed(self, sequences: Sequence[Sequence[int]]) -> Any: ...


@dataclass(frozen=True)
class Embedded:
    """One request's answer: a unit vector per input (float32 rows, in input order) and the tokens embedded."""

    vectors: list[np.ndarray]
    tokens: int


@dataclass(eq=False)
class _Job:
    """One request in the queue: its sequences, the order they are taken in, and its rows so far."""

    sequences: list[list[int]]
    done: Future = field(default_factory=Future)
    order: list[int] = field(default_factory=list)
    taken: int = 0
    filled: int = 0
    rows: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.order = sorted(range(len(self.sequences)), key=lambda i: -len(self.sequences[i]))
        self.rows = [None] * len(self.sequences)


class EmbeddingService:
    """Embeds inputs for the HTTP front in a worker thread of its own (started, and the model loaded, on first use)."""

    def __init__(self, load: Callable[[], Embedder] | None = None,
                 settings: EmbeddingSettings = EmbeddingSettings(), name: str | None = None) -> None:
        """`load` builds the model; the worker thread calls it, so thread-local torch settings made there stick.
        Without `load`, or with `settings.embeddings` off, every request is refused. `name`: the model's name
        (fly_llm.model.embedding_source.served_names), listed before it loads."""
        self.settings = settings if load is not None else EmbeddingSettings(embeddings=False)
        self._load = load
        self._name = name
        self._loaded: Future = Future()
        self._lock = threading.Condition()
        self._lanes: OrderedDict[str, deque[_Job]] = OrderedDict()  # per client, in turn order; never empty
        self._queued: Counter[str] = Counter()  # inputs waiting, per client
        self._worker: threading.Thread | None = None

    def listed(self) -> str | None:
        """The embedding model's name as the model lists show it (GET /v1/models, /api/tags): whether loaded
        yet or not, since clients pick a model from the list; None when embeddings are off, the name is not
        known before loading, or the model failed to load (its requests are refused)."""
        if not self.settings.embeddings:
            return None
        if not self._loaded.done():
            return self._name
        return None if self._loaded.exception() is not None else self._loaded.result().name

    async def embedder(self) -> Embedder:
        """The model, loading it (in the worker thread) on first use; BadRequest when embeddings are off,
        ModelError when it cannot be loaded."""
        if not self.settings.embeddings:
            raise BadRequest("this daemon serves no embeddings (it was started with --no-embeddings)")
        with self._lock:
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name="fly-embed", daemon=True)
                self._worker.start()
        return await asyncio.shield(asyncio.wrap_future(self._loaded))  # one caller leaving cancels no load

    async def embed(self, inputs: Sequence[str] | Sequence[Sequence[int]], *, truncate: bool,
                    client: str = "") -> Embedded:
        """Unit vectors of `inputs` (texts, or token-id lists in the model's vocabulary without special tokens),
        queued in `client`'s lane.

        An input over the model's max length is cut to it if `truncate`, else TooLong; TooLong for over
        MAX_INPUTS inputs; BadRequest for a token id outside the vocabulary; BUSY when the queue, or the
        client's share of it, has no room for them. Cancelling the caller drops them.
        """
        embedder = await self.embedder()
        if len(inputs) > MAX_INPUTS:
            raise TooLong(f"{len(inputs)} inputs in one request; at most {MAX_INPUTS}")
        if not inputs:
            return Embedded([], 0)
        self._room(client, len(inputs))
        sequences = await asyncio.get_running_loop().run_in_executor(None, _sequences, embedder, inputs, truncate)
        job = _Job(sequences)
        with self._lock:
            self._room(client, len(sequences))
            self._lanes.setdefault(client, deque()).append(job)
            self._queued[client] += len(sequences)
            self._lock.notify()
        await asyncio.wrap_future(job.done)
        return Embedded(job.rows, sum(map(len, sequences)))

    def check(self) -> None:
        """Raise AssertionError unless the queue is consistent: per client, the inputs counted as waiting are
        those its requests have not yet had taken, within its share; in all, within the bound; no lane is
        empty and every queued request still has some."""
        with self._lock:
            for client, lane in self._lanes.items():
                left = [len(job.order) - job.taken for job in lane]
                assert lane and all(left), (client, left)
                assert self._queued[client] == sum(left), (client, self._queued[client], left)
                assert self._queued[client] <= self._client_share(), (client, self._queued[client])
            assert all(client in self._lanes for client, n in self._queued.items() if n), self._queued
            assert sum(self._queued.values()) <= self.settings.embedding_queue_size

    def waiting(self) -> int:
        """Inputs waiting, all clients together."""
        with self._lock:
            return sum(self._queued.values())

    def _client_share(self) -> int:
        """The inputs one client may have waiting."""
        return max(MAX_INPUTS, self.settings.embedding_queue_size // CLIENT_SHARE)

    def _room(self, client: str, inputs: int) -> None:
        """BUSY unless `inputs` more fit in the queue and in `client`'s share of it."""
        total = sum(self._queued.values())
        if total + inputs > self.settings.embedding_queue_size:
            raise Busy(f"the embedding queue is full ({total} inputs waiting, "
                       f"room for {self.settings.embedding_queue_size}); retry later")
        if self._queued[client] + inputs > self._client_share():
            raise Busy(f"this client has {self._queued[client]} inputs waiting to be embedded, its share of the "
                       f"queue is {self._client_share()}; retry when they are done")

    # ---- the worker thread ----

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.settings.embedding_nice)  # this thread
        except (OSError, AttributeError) as exc:  # not Linux, or not allowed: equal share
            log.warning("the embedding worker keeps its priority: %s", exc)
        try:
            embedder = self._load()  # type: ignore[misc]  # set whenever embeddings are on
        except Exception as exc:  # noqa: BLE001  # told to every request: the daemon serves on without embeddings
            log.error("cannot load the embedding model: %s", exc, exc_info=not isinstance(exc, FLyError))
            self._loaded.set_exception(exc if isinstance(exc, FLyError) else ModelError(
                f"cannot load the embedding model: {type(exc).__name__}; the server's log has the details"))
            return
        log.info("embedding model %s loaded (%d dimensions, %d tokens)", embedder.name, embedder.dimensions,
                 embedder.max_length)
        self._loaded.set_result(embedder)
        while True:
            batch = self._take()
            try:
                vectors = np.asarray(embedder.embed([job.sequences[i] for job, i in batch]), dtype=np.float32)
            except Exception as exc:  # noqa: BLE001  # fails these requests only
                for job in {job for job, _ in batch}:
                    _settle(job.done, exc)
                continue
            for row, (job, i) in enumerate(batch):
                job.rows[i] = vectors[row]
                job.filled += 1
                if job.filled == len(job.sequences):
                    _settle(job.done, None)

    def _take(self) -> list[tuple[_Job, int]]:
        """The next batch, (job, input index) pairs: up to embedding_batch_size inputs, one from each client's lane
        in turn (the head request of each, skipping requests already settled: cancelled or failed); waits while
        there are none."""
        size = self.settings.embedding_batch_size
        with self._lock:
            batch: list[tuple[_Job, int]] = []
            while not batch:
                while not self._lanes:
                    self._lock.wait()
                while self._lanes and len(batch) < size:
                    client, lane = next(iter(self._lanes.items()))
                    job = lane[0]
                    if job.done.done():  # settled while queued: its inputs are dropped
                        self._queued[client] -= len(job.order) - job.taken
                        job.taken = len(job.order)
                    else:
                        batch.append((job, job.order[job.taken]))
                        job.taken += 1
                        self._queued[client] -= 1
                    if job.taken == len(job.order):
                        lane.popleft()
                    if lane:
                        self._lanes.move_to_end(client)
                    else:
                        del self._lanes[client], self._queued[client]
            return batch


def _sequences(embedder: Embedder, inputs: Sequence[str] | Sequence[Sequence[int]],
               truncate: bool) -> list[list[int]]:
    """Each input as a sequence the model takes (its special tokens added, cut or refused when too long), a chunk
    of TOKENIZE_CHUNK at a time: the first over-length input is refused before the rest are tokenized."""
    sequences: list[list[int]] = []
    for start in range(0, len(inputs), TOKENIZE_CHUNK):
        chunk = inputs[start:start + TOKENIZE_CHUNK]
        if isinstance(chunk[0], str):
            ids = embedder.tokenize(chunk)  # type: ignore[arg-type]
        else:
            ids = [list(s) for s in chunk]  # type: ignore[union-attr]
            bad = next((t for s in ids for t in s if not 0 <= t < embedder.vocab_size), None)
            if bad is not None:
                raise BadRequest(f"token id {bad} is outside the embedding model's vocabulary "
                                 f"(0..{embedder.vocab_size - 1}): ids of another tokenizer? LangChain's "
                                 "OpenAIEmbeddings sends OpenAI's (tiktoken) ids unless "
                                 "check_embedding_ctx_length=False; send text")
        sequences += [embedder.sequence(s, truncate) for s in ids]
    return sequences


def _settle(done: Future, error: BaseException | None) -> None:
    """Give a request its outcome, unless it already has one (its caller cancelled)."""
    try:
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)
    except Exception:  # noqa: BLE001  # InvalidStateError: cancelled meanwhile
        pass
