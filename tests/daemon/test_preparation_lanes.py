"""Fair preparation (issue 45, finding 4): lanes per client, one grammar compile per client, a tokenize lane.

- The books alone (`RequestQueue`): clients are taken in turn, so one client's backlog does not hold
  up another's next request; and a seeded random walk over add / take / compile / prepared / detach
  checks `RequestQueue.check()` after every step, that a client waiting with nothing being prepared
  is taken before any other client is taken twice, and that nothing is lost or duplicated.
- The scheduler on threads, with grammar compiles that block until the test releases their schema:
  a seeded random walk of plain, structured (new and already compiled) and tokenize requests, cancels
  and lost clients from three clients, asserting that everything that needs no compile (and every
  cancel) is answered while compiles are blocked, that no client ever has two compiles in flight nor
  all clients together more than one fewer than the preparation threads, and that at the end (every
  schema released) each request ended exactly once.
"""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
from support.engine_double import BlockingGrammars, running

from fly_llm.common.config import SamplingParams
from fly_llm.common.errors import FLyError
from fly_llm.common.protocol import GenerateRequest, TokenizeReply, TokenizeRequest

from fly_daemon.scheduling.preparation import PreparedInput
from fly_daemon.scheduling.request_queue import Entry, RequestQueue
from fly_daemon.scheduling.scheduler import PREPARE_WORKERS, Limits

LIMITS = Limits(heartbeat_timeout=0)


def _entry(seq: int, client: str) -> Entry:
    request = GenerateRequest(id=f"{client}{seq}", prompt="w", sampling=SamplingParams(max_tokens=1))
    return Entry((client.encode(),), request, seq, "local", client, 0.0, 0.0)


def test_a_clients_backlog_does_not_delay_another_clients_next_request():
    """One worker, A's three requests queued before B's one: B's is prepared second, not last."""
    books = RequestQueue(LIMITS)
    for seq, client in enumerate("AAAB"):
        books.add(_entry(seq, client))
    order = []
    while (entry := books.take_to_prepare()) is not None:
        entry.prepared = PreparedInput([1], None, None)
        assert books.mark_prepared(entry)
        order.append(entry.request.id)
    assert order == ["A0", "B3", "A1", "A2"]


@pytest.mark.parametrize("seed", range(8))
def test_random_walk_over_the_books_keeps_turns_and_compile_slots(seed):
    rng = random.Random(seed)
    books = RequestQueue(Limits(heartbeat_timeout=0, max_requests_per_client=6, queue_size=16))
    clients = ["A", "B", "C", "D"]
    preparing: list[Entry] = []  # taken, their first part not done
    compiling: list[Entry] = []  # their compile running (the entry may have ended meanwhile)
    added, ended = [], []
    waiting_since: dict[str, Counter] = {}  # a client waiting with a startable entry -> takes of others since

    def startable(client: str) -> bool:
        """`client` has a queued entry that needs no compile slot, and nothing being prepared."""
        queued = [e for e in books.entries.values() if e.client == client and e.place == "queued"]
        busy = any(e.client == client and e.place == "preparing" for e in books.entries.values())
        return not busy and any(not e.awaits_compile for e in queued)

    def add():
        entry = _entry(len(added), rng.choice(clients))
        try:
            books.add(entry)
        except FLyError:
            return
        added.append(entry)

    def take():
        entry = books.take_to_prepare()
        if entry is None:
            assert not any(startable(c) for c in clients)
            return
        for client, others in list(waiting_since.items()):
            if client == entry.client:
                del waiting_since[client]
            else:
                others[entry.client] += 1
                assert others[entry.client] <= 1, f"{entry.client} taken twice while {client} waited"
        (compiling if entry.awaits_compile else preparing).append(entry)

    def first_part_done():
        entry = preparing.pop(rng.randrange(len(preparing)))
        if rng.random() < 0.5:  # free output, or a grammar compiled before
            entry.prepared = PreparedInput([1], None, None)
            books.mark_prepared(entry)
            return
        entry.prepared = PreparedInput([1], None, None, needs_compile=True)
        if books.begin_compile(entry):
            compiling.append(entry)

    def compile_done():
        entry = compiling.pop(rng.randrange(len(compiling)))
        books.end_compile(entry)
        entry.prepared = PreparedInput([1], None, "matcher")
        books.mark_prepared(entry)

    def detach():
        live = [e for e in added if e.place != "ended"]
        if live:
            entry = rng.choice(live)
            books.detach(entry)
            ended.append(entry)

    def join():
        entry = books.take_joinable()
        if entry is not None:
            books.detach(entry)
            ended.append(entry)

    ops = {"add": add, "take": take, "first_part_done": lambda: preparing and first_part_done(),
           "compile_done": lambda: compiling and compile_done(), "detach": detach, "join": join}
    for _ in range(600):
        ops[rng.choices(list(ops), [6, 5, 4, 2, 1, 3])[0]]()
        books.check()
        for client in clients:
            if startable(client):
                waiting_since.setdefault(client, Counter())
            else:
                waiting_since.pop(client, None)
    for entry in books.in_engine():
        books.detach(entry)
        ended.append(entry)
    while books.entries or preparing or compiling:  # let everything finish
        take()
        if preparing:
            first_part_done()
        if compiling:
            compile_done()
        join()
        books.check()
    assert not books.entries and sorted(e.seq for e in ended) == sorted(e.seq for e in added)
    assert len({e.seq for e in ended}) == len(ended)


# ---- the scheduler, on threads, with compiles that block ----

def _schema(n: int) -> dict:
    return {"type": "object", "properties": {f"field{n}": {"type": "integer"}}}


@pytest.mark.parametrize("seed", range(4))
def test_blocked_compiles_never_hold_up_tokenize_plain_or_compiled_requests(seed):
    rng = random.Random(seed)
    engine = BlockingGrammars()
    clients = {name: (name.encode(),) for name in "ABC"}
    accepted: dict[str, str] = {}  # request id -> its client
    must_end: set[str] = set()  # answered soon, whatever the compiles do
    schemas: dict[str, str] = {}  # request id -> the schema text it waits to compile
    counter = iter(range(10_000))
    try:
        with running(engine, Limits(heartbeat_timeout=0)) as (scheduler, replies):
            def submit(name: str, kind: str) -> None:
                rid, extra = f"{name}{next(counter)}", {}
                if kind != "plain":
                    compiled = sorted(text for scope, text in engine.done if scope == name)
                    text = json.dumps(_schema(next(counter))) if kind == "new" or not compiled else rng.choice(compiled)
                    extra = dict(response_format={"type": "json_schema", "schema": json.loads(text)})
                request = GenerateRequest(id=rid, prompt="w w", sampling=SamplingParams(max_tokens=2), **extra)
                scheduler.submit(clients[name], request, tenant=name, client=name)
                accepted[rid] = name
                if extra and (name, text) not in engine.done:
                    schemas[rid] = text
                else:
                    must_end.add(rid)

            def tokenize(name: str) -> None:
                rid = f"{name}{next(counter)}"
                ids = rng.choice([None, [1, 2, 3]])  # tokenize, or detokenize
                scheduler.tokenize(clients[name], TokenizeRequest(id=rid, text=None if ids else "a b", token_ids=ids))
                must_end.add(rid)

            def cancel(name: str) -> None:
                mine = [rid for rid, owner in accepted.items() if owner == name and rid not in must_end]
                if mine and scheduler.cancel(clients[name], rid := rng.choice(mine)):
                    must_end.add(rid)

            def gone(name: str) -> None:
                scheduler.client_gone(clients[name])
                must_end.update(rid for rid, owner in accepted.items() if owner == name)

            def release() -> None:
                waiting = sorted(set(schemas.values()) - engine.released)
                if waiting:
                    engine.release({rng.choice(waiting)})

            ops = [lambda: submit(rng.choice("ABC"), "new"), lambda: submit(rng.choice("ABC"), "plain"),
                   lambda: submit(rng.choice("ABC"), "compiled"), lambda: tokenize(rng.choice("ABC")),
                   lambda: cancel(rng.choice("ABC")), lambda: gone(rng.choice("ABC")), release]
            for _ in range(50):
                rng.choices(ops, [6, 4, 3, 4, 1, 0.3, 1])[0]()
                for rid in sorted(must_end):  # these progress while any compile is blocked
                    replies.final(rid, timeout=20)
                scheduler.check()
                assert engine.peak_per_client <= 1, "a client had two grammars compiling at once"
                assert engine.peak <= PREPARE_WORKERS - 1, "compiles took every preparation thread"
            engine.release(set(schemas.values()))
            for rid in accepted:
                replies.final(rid)
            for rid in must_end - set(accepted):
                assert isinstance(replies.final(rid), TokenizeReply)
            finals = Counter(m.id for _, m in replies.sent if isinstance(m, replies.ENDS))
            assert set(finals) == set(accepted) | must_end and set(finals.values()) == {1}
    finally:
        engine.release(set(schemas.values()))  # no preparation thread stays blocked after a failure


# ---- the tokenize lanes ----

@pytest.mark.parametrize("seed", range(6))
def test_tokenize_requests_are_answered_in_turn_per_client(seed):
    """Seeded adds (one client sometimes sending dozens at once) and takes against the books: a client with a
    request waiting is served before any other client is served twice — it is never owed more turns than there are
    clients (one lane for all made it wait behind every request ahead of it) — and nothing is lost or answered
    twice; the per-client and total caps answer BUSY."""
    rng = random.Random(seed)
    limits = Limits(heartbeat_timeout=0, max_requests_per_client=40, queue_size=120)
    books = RequestQueue(limits)
    names = [f"c{i}" for i in range(rng.randint(2, 6))]
    waiting: Counter[str] = Counter()
    owed: Counter[str] = Counter()  # takes of other clients since this one was last served while it waited
    sent, answered, counter = set(), [], iter(range(100_000))
    for _ in range(400):
        if rng.random() < 0.55:
            name = rng.choice(names)
            for _ in range(rng.choice([1, 1, 1, 30])):
                rid = f"{name}-{next(counter)}"
                try:
                    books.add_tokenize((name.encode(),), TokenizeRequest(id=rid, text="a"), name)
                except FLyError as exc:
                    assert exc.code == "BUSY" and (waiting[name] >= 40 or books.tokenize_pending >= 120)
                    break
                sent.add(rid)
                waiting[name] += 1
        else:
            taken = books.next_tokenize()
            assert (taken is None) == (not +waiting)
            if taken is not None:
                envelope, request = taken
                name = envelope[0].decode()
                books.tokenize_done()
                answered.append(request.id)
                waiting[name] -= 1
                owed[name] = 0
                for other in names:
                    if other != name and waiting[other]:
                        owed[other] += 1
                        assert owed[other] < len(names), (other, owed)
        books.check()
    rest = books.take_tokenize_waiting()
    assert sorted(answered + [r.id for _, r in rest]) == sorted(sent) and books.tokenize_pending == 0
