"""A client's many rows do not keep another client's request out of the batch (issue 45, measured).

benchmarks/serving/attack_measure.py found it: while four connections sent `n=16` completions back to back, a
victim's new stream waited 10 s for its first token (40 ms without them), because prepared requests joined
the batch in submission order, so a victim waited for every row submitted before it. Now a free batch slot
goes to the client with the fewest rows in the engine, then the one served longest ago. Seeded random
batches and backlogs of one to three clients: a newcomer's prepared request joins before any other client
is served twice (at the first slot that frees, beside one client's backlog).

Fair share (fly_daemon.scheduling.request_queue, `RequestQueue.fair_share`): while a client below its share of the batch
has a request on its way (queued, preparing or prepared), a client at or above its share takes no slot, so
one client's backlog cannot take every slot that frees while another client's request is still being prepared.
A seeded random walk over submit, preparation, joins, ended rows and cancels checks each join against a
reference written from that rule, and the rule's promise (no client over its share while another below it
waits; no slot left free unless such a client's request is still on its way).
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from fly_llm.common.config import SamplingParams
from fly_llm.common.protocol import GenerateRequest

from fly_daemon.scheduling.preparation import PreparedInput
from fly_daemon.scheduling.request_queue import Entry, RequestQueue
from fly_daemon.scheduling.scheduler import Limits


def _entry(seq: int, client: str) -> Entry:
    request = GenerateRequest(id=f"{client}-{seq}", prompt="w", sampling=SamplingParams(max_tokens=1))
    return Entry((client.encode(),), request, seq, "local", client, 0.0, 0.0)


def _prepare_all(books: RequestQueue) -> None:
    while (entry := books.take_to_prepare()) is not None:
        entry.prepared = PreparedInput([1], None, None)
        assert books.mark_prepared(entry)


@pytest.mark.parametrize("seed", range(12))
def test_a_newcomer_joins_before_any_client_is_served_twice_whatever_the_backlog_before_it(seed):
    rng = random.Random(seed)
    batch = rng.randint(1, 8)
    books = RequestQueue(Limits(heartbeat_timeout=0, max_batch_size=batch, max_requests_per_client=64,
                                queue_size=512, newcomer_rows=0))  # the order at row ends (newcomer rows: below)
    attackers = [f"attacker{i}" for i in range(rng.randint(1, 3))]
    seq = 0
    for client in attackers:  # each with a backlog (n choices, a burst): more than the batch holds, all together
        for _ in range(rng.randint(batch + 1, 3 * batch + 4)):
            books.add(_entry(seq, client))
            seq += 1
    _prepare_all(books)
    while books.take_joinable() is not None:
        pass
    assert len(books.in_engine()) == batch
    books.add(_entry(seq, "victim"))
    _prepare_all(books)
    books.check()
    joined = []  # the clients whose requests take the slots that free, until the victim's does
    while not joined or joined[-1] != "victim":
        books.detach(rng.choice(books.in_engine()))  # a row ends
        entry = books.take_joinable()
        assert entry is not None
        joined.append(entry.client)
        books.check()
    assert len(set(joined)) == len(joined), joined  # no client is served twice while the victim waits
    if len(attackers) == 1:
        assert joined == ["victim"]


def _reference_join(books: RequestQueue) -> Entry | None:
    """The entry the rule lets join next, from the books' entries alone (None: the slot stays free)."""
    limits = books.limits
    entries = list(books.entries.values())
    in_engine = [e for e in entries if e.place == "engine"]
    prepared = [e for e in entries if e.place == "prepared"]
    rows = Counter(e.client for e in in_engine)
    turn = {client: books._last_joined.get(client, -1) for client in rows | Counter(e.client for e in entries)}
    if not prepared:
        return None
    held = sum(e.budget for e in in_engine)
    newcomers = sorted((e for e in prepared if not rows[e.client]), key=lambda e: (turn[e.client], e.seq))
    newcomer = next(iter(newcomers), None)  # may join a batch full of rows or tokens, within the newcomer rows
    if newcomer is not None and (len(in_engine) >= limits.max_batch_size + limits.newcomer_rows or held + newcomer.budget
                                 > limits.max_batch_tokens + limits.newcomer_rows * (limits.max_batch_tokens // limits.max_batch_size)):
        newcomer = None
    if len(in_engine) >= limits.max_batch_size:
        return newcomer
    share = math.ceil(limits.max_batch_size / len({e.client for e in entries}))
    waiting_below = {e.client for e in entries if e.place != "engine" and rows[e.client] < share}

    def may_join(entry: Entry) -> bool:
        return rows[entry.client] < share or waiting_below <= {entry.client}

    ranked = sorted(filter(may_join, prepared), key=lambda e: (rows[e.client], turn[e.client], e.seq))
    if ranked and in_engine and held + ranked[0].budget > limits.max_batch_tokens:
        return newcomer
    return ranked[0] if ranked else None


@pytest.mark.parametrize("seed", range(16))
def test_random_walk_joins_as_the_fair_share_reference_and_keeps_its_promise(seed):
    rng = random.Random(seed)
    batch = rng.randint(1, 8)
    books = RequestQueue(Limits(heartbeat_timeout=0, max_batch_size=batch, max_requests_per_client=3 * batch,
                                queue_size=256, newcomer_rows=rng.randint(0, 2)))
    clients = ["A", "B", "C", "D"][:rng.randint(2, 4)]
    preparing: list[Entry] = []
    seq = 0
    for _ in range(400):
        op = rng.choice(["add", "add", "prepare", "prepared", "join", "join", "end", "cancel"])
        if op == "add":
            client = rng.choice(clients)
            if books._per_client.get(client, 0) < books.limits.max_requests_per_client:
                books.add(_entry(seq, client))
                seq += 1
        elif op == "prepare" and (entry := books.take_to_prepare()) is not None:
            preparing.append(entry)
        elif op == "prepared" and preparing:
            entry = preparing.pop(rng.randrange(len(preparing)))
            entry.prepared = PreparedInput([1], None, None)
            books.mark_prepared(entry)
        elif op == "join":
            rows = Counter(e.client for e in books.in_engine())
            share = math.ceil(batch / len({e.client for e in books.entries.values()} or {None}))
            waiting_below = {e.client for e in books.entries.values() if e.place != "engine" and rows[e.client] < share}
            expected = _reference_join(books)
            entry = books.take_joinable()
            assert entry is expected, (entry and entry.request.id, expected and expected.request.id)
            if len(books.in_engine()) - (entry is not None) < batch + books.limits.newcomer_rows:
                newcomer = any(e.place == "prepared" and not rows[e.client] for e in books.entries.values())
                assert entry is not None or not newcomer, "a client with no rows waited beside a free newcomer row"
            if entry is not None and waiting_below - {entry.client}:  # someone below its share waited
                assert rows[entry.client] + 1 <= share, (entry.client, rows, share)
            room = len(books.in_engine()) < batch
            if entry is None and room and any(e.place == "prepared" for e in books.entries.values()):
                unprepared_below = {e.client for e in books.entries.values()
                                    if e.place in ("queued", "preparing") and rows[e.client] < share}
                assert unprepared_below, "a slot left free with no request on its way to claim it"
        elif op == "end" and (running := books.in_engine()):
            books.detach(rng.choice(running))
        elif op == "cancel" and (waiting := [e for e in books.entries.values() if e.place in ("queued", "prepared")]):
            books.detach(rng.choice(waiting))
        preparing = [e for e in preparing if e.place == "preparing"]
        books.check()


@pytest.mark.parametrize("seed", range(8))
def test_a_client_with_no_rows_starts_at_once_however_full_the_batch(seed):
    """Issue 45: while one client's n=16 rows filled the batch, another client's first request waited for one
    of them to end (0.6–0.9 s on the tiny pair, minutes on a real model). Now clients with no rows join a
    full batch at once, up to `newcomer_rows` beyond max_batch_size; the next one takes the first row that
    ends, before the client that fills the batch."""
    rng = random.Random(seed)
    batch, newcomer_rows = rng.randint(1, 8), rng.randint(1, 3)
    books = RequestQueue(Limits(heartbeat_timeout=0, max_batch_size=batch, max_requests_per_client=64,
                                queue_size=512, newcomer_rows=newcomer_rows))
    for seq in range(3 * batch):
        books.add(_entry(seq, "attacker"))
    _prepare_all(books)
    while books.take_joinable() is not None:
        pass
    assert len(books.in_engine()) == batch  # alone, a client fills the batch, no more
    victims = [f"victim{i}" for i in range(newcomer_rows + 1)]
    for i, victim in enumerate(victims):
        books.add(_entry(1000 + i, victim))
    _prepare_all(books)
    joined = []
    while (entry := books.take_joinable()) is not None:
        joined.append(entry.client)
        books.check()
    assert joined == victims[:-1] and len(books.in_engine()) == batch + newcomer_rows
    books.detach(rng.choice([e for e in books.in_engine() if e.client == "attacker"]))  # a row ends
    assert books.take_joinable().client == victims[-1]  # the last newcomer takes its place, not the attacker
    assert books.take_joinable() is None and len(books.in_engine()) == batch + newcomer_rows
    books.check()
