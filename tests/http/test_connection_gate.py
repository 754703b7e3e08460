"""The HTTP front's connection books (fly_daemon.http.connections.ConnectionGate) against a brute-force reference.

Random steps (connections from many peers, IPv4 and IPv6, some a trusted proxy, opening, completing a request's
head and answering it, closing, and the clock moving on) drive the gate and `Reference`, a list of every open
connection with its client and since when (clock and step) it is idle. After every step the gate's own
`check()` holds and its books are the reference's; every admission is what the rules (the module docstring)
allow: the per-client cap, counted per client (an IPv6 peer's /64, found here by brute force); then, when the
cap in all is full, the fair-share swap (in place of the longest idle connection of a client holding the most of
those with idle ones, if more than the newcomer would); else the stale one (the connection idle longest of all,
if idle for `http_idle_reclaim` at least); else refused. A partial head is no step for the gate (the connection
stays idle: tests/http/test_guarded_protocol.py holds the protocol to that). Hypothesis explores small caps; a
seeded long run exercises larger ones (and the ranking's rebuilds).
"""

from __future__ import annotations

import ipaddress
import random
from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from fly_llm.common.errors import Busy

from fly_daemon.http.connections import Admitted, ConnectionGate
from fly_daemon.settings import HttpLimits

PROXY = "10.0.0.9"
"""The trusted proxy: over the per-client cap, counted only in all."""
PROXY6 = "2001:db8:0:9::9"
"""A trusted IPv6 proxy: counted by its own address, not its /64."""
GRACE = 1.0
"""`http_idle_reclaim` of the gates here (the clock moves on by steps below and above it)."""


def client_of_peer(peer: str) -> str:
    """Brute force: the client a connection from `peer` counts as: an IPv4 address (an IPv4-mapped one as IPv4),
    ::1 and the trusted proxies as themselves, any other IPv6 address as its /64 network."""
    address = ipaddress.ip_address(peer)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    if address.version == 4 or peer in ("::1", PROXY6):
        return str(address)
    return ipaddress.ip_network(f"{peer}/64", strict=False).with_prefixlen


@dataclass
class Reference:
    """Every open connection's client, and since when (clock, step) the idle ones are idle."""

    per_client: int
    cap: int
    client_of: dict[int, str] = field(default_factory=dict)
    idle_since: dict[int, tuple[float, int]] = field(default_factory=dict)

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

    def stale(self, now: float) -> int | None:
        """The connection idle longest of all, if idle for GRACE at least."""
        oldest = min(self.idle_since, key=self.idle_since.__getitem__, default=None)
        return oldest if oldest is not None and now - self.idle_since[oldest][0] >= GRACE else None


class GateDriver:
    """One gate and its reference, stepped together; each step asserts the gate did what the rule allows."""

    def __init__(self, per_client: int, cap: int) -> None:
        self.clock = 0.0
        self.gate: ConnectionGate[int] = ConnectionGate(
            HttpLimits(http_max_connections_per_client=per_client, trusted_proxies=[PROXY, PROXY6],
                       http_idle_reclaim=GRACE), cap, now=lambda: self.clock)
        self.ref = Reference(per_client, cap)
        self.step = 0
        self.counts = {"admitted": 0, "swapped": 0, "stale": 0, "refused": 0}

    def connect(self, peer: str) -> None:
        self.step += 1
        client = client_of_peer(peer)
        conn, held = self.step, self.ref.held(client)
        result = self.gate.admit(peer, conn)
        if held >= self.ref.per_client and client not in (PROXY, PROXY6):
            assert isinstance(result, Busy) and "http_max_connections_per_client" in result.message
        elif len(self.ref.client_of) < self.ref.cap:
            assert result == Admitted()
        else:
            victims, longest = self.ref.reclaimable(held + 1)
            stale = self.ref.stale(self.clock)
            if victims:
                assert isinstance(result, Admitted) and result.reclaimed is not None
                assert self.ref.client_of[result.reclaimed] in victims
                assert result.reclaimed == longest[self.ref.client_of[result.reclaimed]]
                self.counts["swapped"] += 1
            elif stale is not None:
                assert result == Admitted(stale)
                self.counts["stale"] += 1
            else:
                assert isinstance(result, Busy) and "http_max_connections)" in result.message
            if isinstance(result, Admitted):
                self._forget(result.reclaimed)
        if isinstance(result, Busy):
            self.counts["refused"] += 1
            return
        self.counts["admitted"] += 1
        self.ref.client_of[conn] = client
        self.ref.idle_since[conn] = (self.clock, self.step)

    def complete_head(self, conn: int) -> None:
        """A request's head (or a pipelined one's) is complete on `conn`, idle or not."""
        self.gate.busy(conn)
        self.ref.idle_since.pop(conn, None)

    def end_request(self, conn: int) -> None:
        """`conn`, mid-request, answered everything it read."""
        self.step += 1
        self.gate.idle(conn)
        self.ref.idle_since[conn] = (self.clock, self.step)

    def advance(self, seconds: float) -> None:
        """The clock moves on (and never back)."""
        self.clock += seconds

    def close(self, conn: int) -> None:
        self.gate.release(conn)
        self._forget(conn)

    def agree(self) -> None:
        self.gate.check()
        assert self.gate.client_of == self.ref.client_of
        by_client: dict[str, list[int]] = {}
        in_order = sorted(self.ref.idle_since.items(), key=lambda item: item[1])
        for conn, _ in in_order:
            by_client.setdefault(self.ref.client_of[conn], []).append(conn)
        assert {client: list(idle) for client, idle in self.gate.idle_of.items()} == by_client
        assert list(self.gate.idle_since.items()) == [(conn, clock) for conn, (clock, _) in in_order]

    def busy_conns(self) -> list[int]:
        return sorted(set(self.ref.client_of) - set(self.ref.idle_since))

    def _forget(self, conn: int) -> None:
        del self.ref.client_of[conn]
        self.ref.idle_since.pop(conn, None)


PEERS = ("10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4", "::ffff:10.0.0.4", PROXY, "::ffff:10.0.0.9", "::1",
         "2001:db8:0:1::1", "2001:db8:0:1::2", "2001:db8:0:1:ffff::3", "2001:db8:0:2::1", PROXY6, "2001:db8:0:9::1")
"""Peers: IPv4 ones, one also IPv4-mapped; two IPv6 /64s of several addresses each; the trusted proxies, and an
untrusted neighbour in the IPv6 proxy's /64."""
STEPS_S = (0.25, 0.5, 1.0, 3.0)
"""How far the clock moves on in a step: below, at and above GRACE."""


class GateMachine(RuleBasedStateMachine):
    """Small caps (6 in all, 3 a client): the cap is full most of the time."""

    def __init__(self) -> None:
        super().__init__()
        self.driver = GateDriver(per_client=3, cap=6)

    @rule(peer=st.sampled_from(PEERS))
    def connect(self, peer: str) -> None:
        self.driver.connect(peer)

    @precondition(lambda self: self.driver.ref.client_of)
    @rule(data=st.data())
    def complete_head(self, data: st.DataObject) -> None:
        self.driver.complete_head(data.draw(st.sampled_from(sorted(self.driver.ref.client_of))))

    @precondition(lambda self: self.driver.busy_conns())
    @rule(data=st.data())
    def end_request(self, data: st.DataObject) -> None:
        self.driver.end_request(data.draw(st.sampled_from(self.driver.busy_conns())))

    @precondition(lambda self: self.driver.ref.client_of)
    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        self.driver.close(data.draw(st.sampled_from(sorted(self.driver.ref.client_of))))

    @rule(seconds=st.sampled_from(STEPS_S))
    def advance(self, seconds: float) -> None:
        self.driver.advance(seconds)

    @invariant()
    def books_agree(self) -> None:
        self.driver.agree()


TestGateMachine = GateMachine.TestCase
TestGateMachine.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)


@pytest.mark.parametrize("seed", range(4))
def test_a_long_random_run_keeps_the_books(seed):
    """3,000 steps, 40 connections in all, 8 a client, 30 IPv4 addresses and 20 IPv6 ones in 10 /64s (a trusted
    proxy each); the connects are weighted so that the cap is full and admissions swap, take stale connections,
    refuse and admit."""
    rng = random.Random(seed)
    peers = [f"10.1.0.{i}" for i in range(29)] + [PROXY, PROXY6] + [f"2001:db8:0:{i % 10}::{i}" for i in range(19)]
    driver = GateDriver(per_client=8, cap=40)
    for _ in range(3000):
        open_conns, busy = sorted(driver.ref.client_of), driver.busy_conns()
        roll = rng.random()
        if roll < 0.45 or not open_conns:
            driver.connect(rng.choice(peers[:4]) if rng.random() < 0.5 else rng.choice(peers))
        elif roll < 0.6:
            driver.complete_head(rng.choice(open_conns))
        elif roll < 0.75 and busy:
            driver.end_request(rng.choice(busy))
        elif roll < 0.85:
            driver.advance(rng.choice(STEPS_S) / 4)
        else:
            driver.close(rng.choice(open_conns))
        driver.agree()
    assert all(driver.counts.values()), driver.counts  # each outcome happened
