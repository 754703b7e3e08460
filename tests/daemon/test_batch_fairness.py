"""A client's many rows do not keep another client's request out of the batch (issue 45, measured).

benchmarks/serving/attack_measure.py found it: while four connections sent `n=16` completions back to back, a
victim's new stream waited 10 s for its first token (40 ms without them), because prepared requests joined
the batch in submission order, so a victim waited for every row submitted before it. Now a free batch slot
goes to the client with the fewest rows in the engine, then the one served longest ago. Seeded random
batches and backlogs of one to three clients: a newcomer's prepared request joins before any other client
is served twice (at the first slot that frees, beside one client's backlog).
"""

from __future__ import annotations

import random

import pytest

from fly_llm.common.config import SamplingParams
from fly_llm.common.protocol import GenerateRequest

from fly_daemon.preparation import PreparedInput
from fly_daemon.request_queue import Entry, RequestQueue
from fly_daemon.scheduler import Limits


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
                                queue_size=512))
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
