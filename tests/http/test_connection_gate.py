"""The HTTP front's connection books (fly_daemon.http_connections.ConnectionGate) against a brute-force reference.

Random steps (connections from many clients, some a trusted proxy, opening, beginning and ending requests and
closing) drive the gate and `Reference`, a list of every open connection with its client and since when it is
idle. After every step the gate's own `check()` holds and its books are the reference's; every admission is
what the fair-share rule (the module docstring) allows: refused only when no client holding more than the
newcomer would has an idle connection, else admitted in place of the longest idle one of a client holding
the most of those with idle ones. Hypothesis explores small caps; a seeded long run exercises larger ones
(and the ranking's rebuilds).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from fly_llm.common.errors import Busy

from fly_daemon.http_connections import Admitted, ConnectionGate
from fly_daemon.settings import HttpLimits

PROXY = "10.0.0.9"
"""The trusted proxy: over the per-client cap, counted only in all."""


@dataclass
class Reference:
    """Every open connection's client, and since which step the idle ones are idle."""

    per_client: int
    cap: int
    client_of: dict[int, str] = field(default_factory=dict)
    idle_since: dict[int, int] = field(default_factory=dict)

    def held(self, client: str) -> int:
        return sum(c == client for c in self.client_of.values())

    def reclaimable(self, wanted: int) -> tuple[set[str], dict[str, int]]:
        """The clients a newcomer that would hold `wanted` may take an idle connection from (those holding
        the most of all with idle ones, if more than `wanted`), and each one's longest idle connection."""
        longest: dict[str, int] = {}
        for conn, since in sorted(self.idle_since.items(), key=lambda item: item[1]):
            longest.setdefault(self.client_of[conn], conn)
        most = max((self.held(client) for client in longest), default=0)
        return {client for client in longest if self.held(client) == most > wanted}, longest


class GateDriver:
    """One gate and its reference, stepped together; each step asserts the gate did what the rule allows."""

    def __init__(self, per_client: int, cap: int) -> None:
        self.gate: ConnectionGate[int] = ConnectionGate(
            HttpLimits(http_max_connections_per_client=per_client, trusted_proxies=PROXY), cap)
        self.ref = Reference(per_client, cap)
        self.step = 0
        self.counts = {"admitted": 0, "reclaimed": 0, "refused": 0}

    def connect(self, client: str) -> None:
        self.step += 1
        conn, held = self.step, self.ref.held(client)
        result = self.gate.admit(client, conn)
        if held >= self.ref.per_client and client != PROXY:
            assert isinstance(result, Busy) and "http_max_connections_per_client" in result.message
        elif len(self.ref.client_of) < self.ref.cap:
            assert result == Admitted()
        else:
            victims, longest = self.ref.reclaimable(held + 1)
            if not victims:
                assert isinstance(result, Busy) and "http_max_connections)" in result.message
            else:
                assert isinstance(result, Admitted) and result.reclaimed is not None
                assert self.ref.client_of[result.reclaimed] in victims
                assert result.reclaimed == longest[self.ref.client_of[result.reclaimed]]
                self._forget(result.reclaimed)
                self.counts["reclaimed"] += 1
        if isinstance(result, Busy):
            self.counts["refused"] += 1
            return
        self.counts["admitted"] += 1
        self.ref.client_of[conn] = client
        self.ref.idle_since[conn] = self.step

    def begin_request(self, conn: int) -> None:
        """Some of a request (or of a pipelined one) was read on `conn`, idle or not."""
        self.gate.busy(conn)
        self.ref.idle_since.pop(conn, None)

    def end_request(self, conn: int) -> None:
        """`conn`, mid-request, answered everything it read."""
        self.step += 1
        self.gate.idle(conn)
        self.ref.idle_since[conn] = self.step

    def close(self, conn: int) -> None:
        self.gate.release(conn)
        self._forget(conn)

    def agree(self) -> None:
        self.gate.check()
        assert self.gate.client_of == self.ref.client_of
        by_client: dict[str, list[int]] = {}
        for conn, _ in sorted(self.ref.idle_since.items(), key=lambda item: item[1]):
            by_client.setdefault(self.ref.client_of[conn], []).append(conn)
        assert {client: list(idle) for client, idle in self.gate.idle_of.items()} == by_client

    def busy_conns(self) -> list[int]:
        return sorted(set(self.ref.client_of) - set(self.ref.idle_since))

    def _forget(self, conn: int) -> None:
        del self.ref.client_of[conn]
        self.ref.idle_since.pop(conn, None)


CLIENTS = ("10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5", "10.0.0.6", PROXY, "::1")


class GateMachine(RuleBasedStateMachine):
    """Small caps (6 in all, 3 a client): the cap is full most of the time."""

    def __init__(self) -> None:
        super().__init__()
        self.driver = GateDriver(per_client=3, cap=6)

    @rule(client=st.sampled_from(CLIENTS))
    def connect(self, client: str) -> None:
        self.driver.connect(client)

    @precondition(lambda self: self.driver.ref.client_of)
    @rule(data=st.data())
    def begin_request(self, data: st.DataObject) -> None:
        self.driver.begin_request(data.draw(st.sampled_from(sorted(self.driver.ref.client_of))))

    @precondition(lambda self: self.driver.busy_conns())
    @rule(data=st.data())
    def end_request(self, data: st.DataObject) -> None:
        self.driver.end_request(data.draw(st.sampled_from(self.driver.busy_conns())))

    @precondition(lambda self: self.driver.ref.client_of)
    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        self.driver.close(data.draw(st.sampled_from(sorted(self.driver.ref.client_of))))

    @invariant()
    def books_agree(self) -> None:
        self.driver.agree()


TestGateMachine = GateMachine.TestCase
TestGateMachine.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)


@pytest.mark.parametrize("seed", range(4))
def test_a_long_random_run_keeps_the_books(seed):
    """3,000 steps, 40 connections in all, 8 a client, 30 clients (one a trusted proxy); the connects are weighted
    so that the cap is full and admissions reclaim, refuse and admit."""
    rng = random.Random(seed)
    clients = [f"10.1.0.{i}" for i in range(29)] + [PROXY]
    driver = GateDriver(per_client=8, cap=40)
    for _ in range(3000):
        open_conns, busy = sorted(driver.ref.client_of), driver.busy_conns()
        roll = rng.random()
        if roll < 0.45 or not open_conns:
            driver.connect(rng.choice(clients[:4]) if rng.random() < 0.5 else rng.choice(clients))
        elif roll < 0.65:
            driver.begin_request(rng.choice(open_conns))
        elif roll < 0.85 and busy:
            driver.end_request(rng.choice(busy))
        else:
            driver.close(rng.choice(open_conns))
        driver.agree()
    assert all(driver.counts.values()), driver.counts  # each outcome happened
