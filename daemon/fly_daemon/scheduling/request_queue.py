"""The scheduler's books: where each generate request is (queued, preparing, prepared, in the engine),
what each client holds, and the tokenize requests waiting — the first room's data, its invariants in `check()`.

Fair preparation: queued requests wait in a lane per client, and the preparation pool takes them
clients in turn (round-robin), so one client's backlog delays another client's next request by at
most one preparation per worker. Compiling a grammar new to its scope is the one slow part of a
preparation (fly_daemon.scheduling.preparation), so each client compiles at most one grammar at a time and all
clients together at most GRAMMAR_COMPILES: a request that finds its grammar must compile while its
client's compile slot is taken goes back to its lane (its prompt already tokenized) without holding a
thread, and the client's requests that need no compile (free output, a grammar already compiled in
its scope) are taken past it. With one preparation thread more than GRAMMAR_COMPILES, one is always
free of compiles.

Fair batch slots: a free slot goes to the prepared request of the client with the fewest rows in the
engine, then of the client whose last request joined longest ago (one never served first), then the
oldest; so one client's many rows (`n` choices, a burst of requests) keep another client's request out
of the batch only until a row ends, not until everything submitted before it ran. And while a client
below its fair share (`fair_share`: the batch over the clients with rows or requests) has a request on
its way (queued, preparing or prepared), no client at or above its share takes a slot: the slot waits
for that request, so one client's backlog cannot take every slot that frees while another's request is
still being prepared (its grammar compiling). Alone, a client may fill the batch; no row is preempted.

Not thread-safe on its own: the scheduler (fly_daemon.scheduling.scheduler) holds its lock around every call.
"""

from __future__ import annotations

from bisect import insort
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from fly_llm.common.errors import BadRequest, Busy, Cancelled, FLyError, Timeout
from fly_llm.common.protocol import GenerateRequest, TokenizeRequest

from fly_daemon.limits import Limits
from fly_daemon.scheduling.delivery import LOCAL, Envelope, OutputState
from fly_daemon.scheduling.preparation import PreparedInput
from fly_daemon.scheduling.request_weight import check_admission, weight

Place = Literal["queued", "preparing", "prepared", "engine", "ended"]

GRAMMAR_COMPILES = 2
"""Grammar compiles in flight at once, all clients together (one per client): as many as the grammar
sandbox's processes by default (`grammar_workers`), one fewer than the preparation threads."""


@dataclass(eq=False)
class Entry:
    """One generate request's place in the scheduler, from submission to its final reply."""

    envelope: Envelope
    request: GenerateRequest
    seq: int  # submission order
    tenant: str  # whose prefix cache it may use (a credential: "local", "curve:KEY", "http-key:HASH")
    client: str  # what the per-client cap counts (one socket, one HTTP connection)
    submitted: float
    last_seen: float
    place: Place = "queued"
    kill: FLyError | None = None  # why it must end, once something decided it must
    prepared: PreparedInput | None = None  # from preparation (its first part while it awaits a compile) to the engine
    prompt_tokens: int = 0  # once prepared
    output: OutputState | None = None  # once it is in the engine

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

    @property
    def awaits_compile(self) -> bool:
        """Prepared but for its grammar's compile (back in its lane while its client's compile slot is taken)."""
        return self.prepared is not None and self.prepared.needs_compile

    def cache_scope(self, shared: bool) -> str:
        """Whose caches (prefixes, compiled grammars) it reads and fills: its tenant's, unless `shared`."""
        return "" if shared else self.tenant

    def verdict(self, now: float, heartbeat_timeout: float) -> FLyError | None:
        """Why it must end now (its deadline passed, or its client stopped heartbeating), else None."""
        timeout = self.request.timeout_s
        if timeout is not None and now - self.submitted > timeout:
            return Timeout(f"request {self.request.id} passed its deadline of {timeout} s")
        if self.envelope != LOCAL and heartbeat_timeout and now - self.last_seen > heartbeat_timeout:
            return Cancelled(f"no heartbeat from the client for {heartbeat_timeout} s")
        return None


class RequestQueue:
    """Every request the scheduler holds, each in exactly one place, within `limits`' caps; at most
    `compiles` grammar compiles at once, one per client."""

    def __init__(self, limits: Limits, compiles: int = GRAMMAR_COMPILES) -> None:
        self.limits = limits
        self.compiles = compiles
        self.entries: dict[tuple[Envelope, str], Entry] = {}
        self._lanes: OrderedDict[str, list[Entry]] = OrderedDict()  # client -> its queued, by seq; next in turn first
        self._compiling: dict[str, Entry] = {}  # client -> whose grammar compiles (until the compile returns)
        self._preparing: set[Entry] = set()
        self._prepared: list[Entry] = []  # in submission order
        self._per_client: dict[str, int] = {}
        self._joins = 0  # requests that joined the engine
        self._last_joined: dict[str, int] = {}  # client (with entries) -> when its last request joined (`_joins`)
        self._tokenize: OrderedDict[str, deque[tuple[Envelope, TokenizeRequest]]] = OrderedDict()  # client ->
        # its tokenize requests not yet taken (waiting for the models or the lane's thread), next in turn first
        self.tokenize_pending = 0  # in a lane or being answered

    # ---- generate requests ----

    def add(self, entry: Entry) -> None:
        """Queue `entry`; BadRequest for an id its envelope has in flight, Busy over a cap."""
        if entry.key in self.entries:
            raise BadRequest(f"request id {entry.request.id!r} is already in flight")
        if self._per_client.get(entry.client, 0) >= self.limits.max_requests_per_client:
            raise Busy(f"this client already has {self.limits.max_requests_per_client} requests queued or "
                       f"running (the daemon's max_requests_per_client)")
        check_admission(entry.request, sum(weight(e.request, e.prompt_tokens) for e in self.entries.values()
                                           if e.client == entry.client), self.limits.max_tokens_per_client)
        if self.outside_engine() >= self.limits.queue_size:
            raise Busy(f"admission queue full ({self.limits.queue_size} waiting)")
        self.entries[entry.key] = entry
        self._enqueue(entry)
        self._per_client[entry.client] = self._per_client.get(entry.client, 0) + 1

    def queued(self) -> int:
        return sum(len(lane) for lane in self._lanes.values())

    def outside_engine(self) -> int:
        """Requests queued, preparing or prepared."""
        return self.queued() + len(self._preparing) + len(self._prepared)

    def in_engine(self) -> list[Entry]:
        return [e for e in self.entries.values() if e.place == "engine"]

    def take_to_prepare(self) -> Entry | None:
        """Move the next queued entry to preparing, clients in turn: the oldest that may start now of the
        next client in turn with nothing being prepared, else of the next client in turn (who then goes
        last); None if none may start. One that awaits its compile takes its client's compile slot."""
        busy = {e.client for e in self._preparing}
        startable = [e for lane in self._lanes.values() if (e := next(filter(self._may_start, lane), None))]
        entry = next((e for e in startable if e.client not in busy), startable[0] if startable else None)
        if entry is None:
            return None
        self._dequeue(entry)
        if entry.client in self._lanes:
            self._lanes.move_to_end(entry.client)
        self._preparing.add(entry)
        entry.place = "preparing"
        if entry.awaits_compile:
            self._compiling[entry.client] = entry
        return entry

    def begin_compile(self, entry: Entry) -> bool:
        """A preparing entry found its grammar must compile: take its client's compile slot (True), or go
        back to its lane to wait for one (False: its client compiles already, or all slots are taken);
        False too if it ended meanwhile."""
        if entry.place != "preparing":
            return False
        if self._may_compile(entry.client):
            self._compiling[entry.client] = entry
            return True
        self._preparing.remove(entry)
        self._enqueue(entry)
        return False

    def end_compile(self, entry: Entry) -> None:
        """Its compile returned (done, failed, or after the entry ended): free its client's compile slot."""
        del self._compiling[entry.client]

    def _may_start(self, entry: Entry) -> bool:
        return not entry.awaits_compile or self._may_compile(entry.client)

    def _may_compile(self, client: str) -> bool:
        return client not in self._compiling and len(self._compiling) < self.compiles

    def _enqueue(self, entry: Entry) -> None:
        """Into its client's lane, in submission order (a new client's lane has the last turn)."""
        insort(self._lanes.setdefault(entry.client, []), entry, key=lambda e: e.seq)
        entry.place = "queued"

    def _dequeue(self, entry: Entry) -> None:
        """Out of its client's lane (a lane left empty goes)."""
        lane = self._lanes[entry.client]
        lane.remove(entry)
        if not lane:
            del self._lanes[entry.client]

    def _queued_entries(self) -> Iterator[Entry]:
        return (entry for lane in self._lanes.values() for entry in lane)

    def mark_prepared(self, entry: Entry) -> bool:
        """Move a preparing entry to the prepared (in submission order); False if it ended meanwhile."""
        if entry.place != "preparing":
            return False
        self._preparing.remove(entry)
        entry.place = "prepared"
        insort(self._prepared, entry, key=lambda e: e.seq)
        return True

    def fair_share(self) -> int:
        """Batch slots per client with rows in the engine or requests on their way to it (rounded up)."""
        return -(-self.limits.max_batch_size // max(1, len(self._per_client)))

    def take_joinable(self) -> Entry | None:
        """Move the next prepared entry into the engine if the batch has room for it (always for one): the
        oldest of the client with the fewest rows in the engine, of those the one served longest ago; none
        of a client at or above its fair share while another client below it has a request on its way.

        A full batch still takes a client with no rows in it, up to `newcomer_rows` beyond max_batch_size
        (and max_batch_tokens by as many rows' share of it): its first request starts at once, not when one
        of another client's rows ends (issue 45)."""
        if not self._prepared:
            return None
        limits = self.limits
        active = self.in_engine()
        rows = Counter(e.client for e in active)
        if len(active) >= limits.max_batch_size:
            return self._join_newcomer(active, rows)
        share = self.fair_share()
        below = {e.client for e in self.entries.values() if e.place != "engine" and rows[e.client] < share}
        allowed = [e for e in self._prepared if rows[e.client] < share or not below - {e.client}]
        if not allowed:
            return None
        entry = min(allowed, key=lambda e: (rows[e.client], self._last_joined.get(e.client, -1), e.seq))
        if active and sum(e.budget for e in active) + entry.budget > limits.max_batch_tokens:
            return self._join_newcomer(active, rows)
        return self._join(entry)

    def _join_newcomer(self, active: list[Entry], rows: Counter[str]) -> Entry | None:
        """Into a batch full of rows or tokens: the oldest prepared entry of a client with no rows, served
        longest ago, if the newcomer rows have room for it."""
        limits = self.limits
        newcomers = [e for e in self._prepared if not rows[e.client]]
        if not newcomers or len(active) >= limits.max_batch_size + limits.newcomer_rows:
            return None
        entry = min(newcomers, key=lambda e: (self._last_joined.get(e.client, -1), e.seq))
        row_share = limits.max_batch_tokens // limits.max_batch_size
        if sum(e.budget for e in active) + entry.budget > limits.max_batch_tokens + limits.newcomer_rows * row_share:
            return None
        return self._join(entry)

    def _join(self, entry: Entry) -> Entry:
        """Move prepared `entry` into the engine; its client is now the one served last."""
        self._prepared.remove(entry)
        entry.place = "engine"
        self._joins += 1
        self._last_joined[entry.client] = self._joins
        return entry

    def sweep(self, reason: Callable[[Entry], FLyError | None], queued_only: bool = False) -> list[tuple[Entry, bool]]:
        """Detach every entry (every queued one with `queued_only`) that was cancelled or that `reason`
        gives an error for (set as its `kill`); each with whether it was in the engine."""
        ended = []
        for entry in list(self._queued_entries()) if queued_only else self.entries.values():
            if entry.kill is None:
                entry.kill = reason(entry)
            if entry.kill is not None:
                ended.append((entry, entry.place == "engine"))
        for entry, _ in ended:
            self.detach(entry)
        return ended

    def detach(self, entry: Entry) -> None:
        """Take an entry out of the table, its place and its client's count."""
        del self.entries[entry.key]
        if entry.place == "queued":
            self._dequeue(entry)
        elif entry.place == "preparing":
            self._preparing.discard(entry)
        elif entry.place == "prepared":
            self._prepared.remove(entry)
        left = self._per_client[entry.client] - 1
        if left:
            self._per_client[entry.client] = left
        else:
            del self._per_client[entry.client]
            self._last_joined.pop(entry.client, None)
        entry.place = "ended"

    # ---- tokenize requests ----

    def add_tokenize(self, envelope: Envelope, request: TokenizeRequest, client: str) -> None:
        """Queue a tokenize request in `client`'s lane; Busy over the queue's cap, or the client's."""
        if self.tokenize_pending >= self.limits.queue_size:
            raise Busy("too many tokenize requests waiting")
        lane = self._tokenize.get(client, ())
        if len(lane) >= self.limits.max_requests_per_client:
            raise Busy(f"this client has {len(lane)} tokenize requests waiting (at most "
                       f"{self.limits.max_requests_per_client})")
        self.tokenize_pending += 1
        self._tokenize.setdefault(client, deque()).append((envelope, request))

    def next_tokenize(self) -> tuple[Envelope, TokenizeRequest] | None:
        """The tokenize request to answer next: the head of the next client's lane in turn (None: none waits). It
        stays counted as pending until `tokenize_done`."""
        if not self._tokenize:
            return None
        client, lane = next(iter(self._tokenize.items()))
        taken = lane.popleft()
        if lane:
            self._tokenize.move_to_end(client)
        else:
            del self._tokenize[client]
        return taken

    def tokenize_done(self) -> None:
        """A tokenize request taken by `next_tokenize` was answered."""
        self.tokenize_pending -= 1

    def tokenize_waiting(self) -> int:
        """Tokenize requests not yet taken."""
        return sum(map(len, self._tokenize.values()))

    def take_tokenize_waiting(self) -> list[tuple[Envelope, TokenizeRequest]]:
        """Every tokenize request not yet taken (no longer pending: its caller answers it)."""
        waiting = [item for lane in self._tokenize.values() for item in lane]
        self._tokenize.clear()
        self.tokenize_pending -= len(waiting)
        return waiting

    def check(self) -> None:
        """Assert the books: every entry is in exactly one place (queued, preparing, prepared, engine)
        and that place says so; each lane is its client's, not empty, in submission order; a queued
        entry is prepared only when it awaits its compile; at most one compile per client and
        `compiles` in all, each of an entry preparing (or ended meanwhile); the prepared are in
        submission order; the per-client counts match the entries and stay within the cap; the queue
        and the batch within their bounds."""
        for client, lane in self._lanes.items():
            assert lane and all(e.client == client for e in lane), f"stale lane {client}"
            assert [e.seq for e in lane] == sorted(e.seq for e in lane), f"lane {client} out of order"
            assert all(e.prepared is None or e.awaits_compile for e in lane), f"a prepared entry in lane {client}"
        assert len(self._compiling) <= self.compiles, len(self._compiling)
        assert all(e.client == client and e.place in ("preparing", "ended") for client, e in self._compiling.items())
        places: dict[Place, list[Entry]] = {"queued": list(self._queued_entries()), "preparing": list(self._preparing),
                                            "prepared": list(self._prepared), "engine": self.in_engine()}
        held = [entry for entries in places.values() for entry in entries]
        assert len({id(e) for e in held}) == len(held) == len(self.entries), "an entry is in two places or none"
        for place, entries in places.items():
            assert all(e.place == place and self.entries.get(e.key) is e for e in entries), f"stale {place} entry"
        assert [e.seq for e in self._prepared] == sorted(e.seq for e in self._prepared), "prepared out of order"
        clients: dict[str, int] = {}
        for entry in self.entries.values():
            clients[entry.client] = clients.get(entry.client, 0) + 1
        assert clients == self._per_client, (clients, self._per_client)
        assert self._last_joined.keys() <= clients.keys(), "a client without entries keeps its turn"
        assert max(clients.values(), default=0) <= self.limits.max_requests_per_client
        assert len(held) - len(places["engine"]) <= self.limits.queue_size
        assert len(places["engine"]) <= self.limits.max_batch_size + self.limits.newcomer_rows
        assert self.tokenize_waiting() <= self.tokenize_pending <= self.limits.queue_size
        assert all(self._tokenize.values()), "an empty tokenize lane keeps its turn"
        assert max(map(len, self._tokenize.values()), default=0) <= self.limits.max_requests_per_client
