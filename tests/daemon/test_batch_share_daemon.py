"""A newcomer's request joins beside one client's `n=16` request, not after its rows all end (issue 45, through
the daemon: its HTTP front, scheduler, preparation pool and model thread on the engine double).

One connection asks for 16 long choices while another's request waits for its grammar to compile (a compile
that blocks until the test releases it). Before the fair share (fly_daemon.scheduling.request_queue), the 16 choices took
every slot of the 16-row batch while the newcomer's request was still being prepared, so it joined only when
they had all ended; now the n=16 client stops at its share (half the batch, two clients) while the other's
request is on its way, and the newcomer joins at once when its compile returns.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx
from support.engine_double import BlockingGrammars
from support.http_double import double_front

CHOICES, LONG = 16, 4000  # 16 rows of 4000 steps each: they cannot end while the test watches
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}}


class RecordingGrammars(BlockingGrammars):
    """BlockingGrammars that also counts steps, keeps the schemas asked for, and notes, for each request that
    joins, how many rows were running then."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0
        self.asked: set[str] = set()
        self.joined_beside: dict[str, int] = {}  # engine id -> rows running when it joined

    def compile_constraint(self, constraint, scope=""):
        with self.cond:
            self.asked.add(constraint.text)
            self.cond.notify_all()
        return super().compile_constraint(constraint, scope)

    def add_request(self, request_id, prompt_ids, sampling, *args, **kwargs) -> None:
        with self.cond:
            self.joined_beside[request_id] = len(self.rows)
        super().add_request(request_id, prompt_ids, sampling, *args, **kwargs)

    def step(self):
        outputs = super().step()
        with self.cond:
            self.steps += 1
            self.cond.notify_all()
        return outputs

    def wait_for(self, predicate: Callable[[], bool]) -> None:
        with self.cond:
            assert self.cond.wait_for(predicate, 30)


def test_a_newcomer_joins_beside_an_n16_request_not_after_its_rows_all_end(tmp_path):
    engine = RecordingGrammars()
    replies: dict[str, httpx.Response | Exception] = {}

    def post(name: str, url: str, path: str, body: dict) -> threading.Thread:
        def run() -> None:
            with httpx.Client(base_url=url, timeout=60) as http:  # a connection of its own: a client of its own
                try:
                    replies[name] = http.post(path, json=body)
                except httpx.HTTPError as exc:
                    replies[name] = exc
        thread = threading.Thread(target=run)
        thread.start()
        return thread

    with double_front(tmp_path, engine) as (_, http):
        url = str(http.base_url)
        newcomer = post("newcomer", url, "/v1/chat/completions", {
            "model": "counting", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}})
        engine.wait_for(lambda: engine.asked)  # its compile runs (and blocks)
        amplifier = post("n16", url, "/v1/completions", {"model": "counting", "prompt": "w w", "n": CHOICES,
                                                         "max_tokens": LONG})
        engine.wait_for(lambda: len(engine.rows) >= 8)
        seen = engine.steps
        engine.wait_for(lambda: engine.steps >= seen + 20)  # time for every prepared choice to take a free slot
        held = len(engine.rows)  # all of them the n=16 client's
        engine.release(set(engine.asked))
        newcomer.join(30)
        assert isinstance(replies["newcomer"], httpx.Response) and replies["newcomer"].status_code == 200, \
            replies["newcomer"]
        [newcomer_id] = engine.structured
        beside = engine.joined_beside[newcomer_id]
    amplifier.join(30)
    assert held == CHOICES // 2, held  # its fair share of the 16 slots while the newcomer's request was on its way
    assert beside == held, beside  # the newcomer joined while all of them still ran
