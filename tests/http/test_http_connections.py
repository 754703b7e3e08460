"""Connections have limits (issue 45 finding 3): timeouts for heads, bodies and idle connections, and
caps on open connections overall and per client, while other clients and the ZeroMQ door are served.

In-process: a Server on the engine double and its HTTP front on a free loopback port, with short
timeouts and small caps (fly_daemon.http.connections). A flood comes from another loopback address
(127.0.0.2 is this machine too), so it is another client. Every wait is bounded.
"""

from __future__ import annotations

import resource
import socket
import time
from contextlib import ExitStack, contextmanager

import httpx
import pytest

from fly_llm.client import FLyClient, build_options
from support.daemon_process import free_port, start_daemon
from support.engine_double import CountingEngine, serving

from fly_daemon.http.app import HttpFront, create_app
from fly_daemon.http.connections import Admitted, ConnectionGate
from fly_daemon.settings import HttpLimits

SHORT = HttpLimits(http_header_timeout=0.5, http_body_timeout=0.5, http_keep_alive_timeout=0.5)
WAIT_S = 10.0
"""The longest any check waits for the server to act (its timeouts here are 0.5 s)."""


@contextmanager
def front(tmp_path, limits: HttpLimits, **app_options):
    """(server, the front's host and port) on the engine double, once its models are loaded; `app_options`
    go to create_app."""
    with serving(f"ipc://{tmp_path}/c.sock", CountingEngine()) as server:
        deadline = time.monotonic() + WAIT_S
        while server.scheduler.state != "ready" and time.monotonic() < deadline:  # /health answers 200 from now on
            time.sleep(0.01)
        http = HttpFront(create_app(server.core.inproc, **app_options), "127.0.0.1:0", limits=limits)
        http.start()
        try:
            yield server, ("127.0.0.1", http.port)
        finally:
            http.stop()


def _connect(address: tuple[str, int], source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(address, timeout=WAIT_S, source_address=(source, 0))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # close: no TIME_WAIT
    return sock


def _read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a socket timeout fails the test: it never closed)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _still_open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True
    finally:
        sock.setblocking(True)
        sock.settimeout(WAIT_S)


def test_an_idle_connection_is_closed_after_the_header_timeout(tmp_path):
    with front(tmp_path, SHORT) as (_, address), _connect(address) as sock:
        assert _read_to_close(sock) == b""


def test_a_head_sent_slowly_is_closed_at_its_deadline(tmp_path):
    """A header line every 0.1 s (slowloris): each byte does not restart the clock; the head's deadline closes it."""
    with front(tmp_path, SHORT) as (_, address), _connect(address) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        for i in range(int(WAIT_S / 0.1)):
            try:
                sock.sendall(b"X-Slow-%d: x\r\n" % i)
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.1)
            if not _still_open(sock):
                break
        else:
            pytest.fail("a head that never ends kept its connection open")


def test_a_head_too_large_is_refused(tmp_path):
    with front(tmp_path, HttpLimits()) as (_, address), _connect(address) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        try:
            for _ in range(40):  # 80 KiB of headers, more than MAX_HEAD_BYTES
                sock.sendall(b"X-Big: " + b"x" * 2040 + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = _read_to_close(sock)
        assert answer.startswith(b"HTTP/1.1 431") and b"TOO_LONG" in answer


def test_a_body_that_stops_coming_is_closed_and_never_submitted(tmp_path):
    with front(tmp_path, SHORT) as (server, address), _connect(address) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": ")
        assert _read_to_close(sock) == b""
        assert server.scheduler.requests_total == 0


def test_an_idle_kept_alive_connection_is_closed(tmp_path):
    with front(tmp_path, SHORT) as (_, address), _connect(address) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        answer = _read_to_close(sock)  # the answer, then the close once the connection idles
        assert answer.startswith(b"HTTP/1.1 200") and b'"state":"ready"' in answer


def _answer(sock: socket.socket) -> bytes:
    """One answer read from `sock` (its head and its content-length's bytes of body)."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < int(
            data.lower().partition(b"content-length: ")[2].partition(b"\r\n")[0] or 0):
        chunk = sock.recv(65536)
        assert chunk, f"closed before a whole answer: {data!r}"
        data += chunk
    return data


def test_an_answer_sent_before_its_body_is_read_is_the_connections_last(tmp_path):
    """A body refused unread (413 on its Content-Length; the same for any route answering before it reads a
    body): what the client still sends is that body, not a next request's head. It was counted as a head,
    and past MAX_HEAD_BYTES a stray empty 431 followed the 413 on the connection, which a kept-alive client
    then read as the answer to its next request (the CI failure of test_http_front's bad-input test). Now
    the connection ends after that answer: nothing follows it, and the rest of the body is read and dropped."""
    with front(tmp_path, HttpLimits(), max_body_bytes=1024) as (_, address), _connect(address) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 200000\r\n\r\n")
        answer = _answer(sock)
        assert answer.startswith(b"HTTP/1.1 413") and b"TOO_LONG" in answer
        try:
            sock.sendall(b"x" * 200_000)
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert _read_to_close(sock) == b""


def test_a_kept_alive_client_is_answered_right_after_a_body_refused_unread(tmp_path):
    """httpx, keeping its connection: each request after a 413 gets its own answer."""
    with front(tmp_path, HttpLimits(), max_body_bytes=1024) as (_, (host, port)), \
            httpx.Client(base_url=f"http://{host}:{port}", timeout=WAIT_S) as client:
        for _ in range(10):
            refused = client.post("/v1/completions", content=b"x" * 70_000, headers={"content-type": "application/json"})
            assert (refused.status_code, refused.json()["error"]["code"]) == (413, "TOO_LONG")
            assert client.get("/health").json()["state"] == "ready"


def test_a_trusted_proxy_counts_only_against_the_overall_cap():
    """A trusted proxy's connections carry many clients (fly_daemon.client_identity): the per-client cap is not
    for it, the overall one is."""
    gate = ConnectionGate(HttpLimits(http_max_connections_per_client=2, trusted_proxies="10.0.0.1"), 8)
    conns = iter(range(100))
    assert [gate.admit("10.0.0.1", next(conns)) for _ in range(4)] == [Admitted()] * 4
    assert [gate.admit("10.0.0.2", next(conns)) for _ in range(2)] == [Admitted()] * 2
    assert "http_max_connections_per_client" in gate.admit("10.0.0.2", next(conns)).message
    assert [gate.admit("10.0.0.1", next(conns)) for _ in range(2)] == [Admitted()] * 2
    assert "http_max_connections)" in gate.admit("10.0.0.1", next(conns)).message  # 10.0.0.2 holds fewer
    gate.release(0)
    assert gate.admit("::ffff:10.0.0.1", next(conns)) == Admitted()  # as an IPv4-mapped peer too
    gate.check()


def test_an_ipv6_client_is_its_64():
    """One host owns a whole IPv6 /64: its addresses are one client to the per-client cap (and the fair share);
    another /64 is another client, and a trusted IPv6 proxy is counted by its own address, only in all."""
    gate = ConnectionGate(HttpLimits(http_max_connections_per_client=2, trusted_proxies="2001:db8:0:9::9"), 8)
    conns = iter(range(100))
    assert [gate.admit(peer, next(conns)) for peer in ("2001:db8:0:1::1", "2001:db8:0:1:ffff::2")] == [Admitted()] * 2
    assert "http_max_connections_per_client" in gate.admit("2001:db8:0:1::3", next(conns)).message
    assert gate.admit("2001:db8:0:2::1", next(conns)) == Admitted()
    assert [gate.admit("2001:db8:0:9::9", next(conns)) for _ in range(3)] == [Admitted()] * 3
    assert set(gate.open.items()) == {("2001:db8:0:1::/64", 2), ("2001:db8:0:2::/64", 1), ("2001:db8:0:9::9", 3)}
    gate.check()


def test_a_connection_flood_past_the_caps_is_refused_while_others_are_served(tmp_path):
    limits = HttpLimits(http_max_connections=8, http_max_connections_per_client=4, http_header_timeout=60)
    with front(tmp_path, limits) as (server, address), ExitStack() as flood:
        url = f"http://{address[0]}:{address[1]}"
        held = [flood.enter_context(_connect(address, "127.0.0.2")) for _ in range(4)]
        refused = [flood.enter_context(_connect(address, "127.0.0.2")) for _ in range(2)]
        for sock in refused:  # answered at once, without being read, then closed
            answer = _read_to_close(sock)
            assert answer.startswith(b"HTTP/1.1 503") and b'"code": "BUSY"' in answer
            assert b"http_max_connections_per_client" in answer
        assert all(_still_open(sock) for sock in held)

        assert httpx.get(f"{url}/health", timeout=WAIT_S).status_code == 200  # another client is served
        with FLyClient(server.endpoint, timeout=WAIT_S) as client:  # and the ZeroMQ door
            assert client.generate("a b c", *build_options(max_tokens=3)).usage.completion_tokens == 3

        held += [flood.enter_context(_connect(address, "127.0.0.3")) for _ in range(4)]  # 8 open: the cap
        for sock in held:  # each mid-request (its body awaited), so none is closed for another client
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\nExpect: 100-continue\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 100")  # the route reads its body
        refused_all = httpx.get(f"{url}/health", timeout=WAIT_S)
        assert refused_all.status_code == 503 and refused_all.headers["retry-after"] == "1"
        assert refused_all.json()["error"]["code"] == "BUSY" and "http_max_connections" in refused_all.text
        for sock in held:
            sock.close()
        deadline = time.monotonic() + WAIT_S  # the front counts them closed as soon as it reads their close
        while (status := httpx.get(f"{url}/health", timeout=WAIT_S).status_code) == 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status == 200


def _client_from(source: str) -> httpx.Client:
    """An httpx client whose connections come from `source` (another client to the front)."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=WAIT_S)


def test_idle_connections_from_many_addresses_cannot_shut_the_front_for_others(tmp_path):
    """Issue 45 (benchmarks/results/attacks): idle connections from many addresses, each under the per-client cap,
    fill the cap in all, and a client on another address was refused until they timed out. Now a newcomer is
    admitted in place of the longest idle connection of a client holding more than it would: one per flood
    address here (2 each; a newcomer would hold 1), down to a fair share, when the next one is refused."""
    limits = HttpLimits(http_max_connections=8, http_max_connections_per_client=4, http_header_timeout=60,
                        http_keep_alive_timeout=60)
    with front(tmp_path, limits) as (_, address), ExitStack() as stack:
        url = f"http://{address[0]}:{address[1]}/health"
        held = [stack.enter_context(_connect(address, f"127.0.1.{1 + i % 4}")) for i in range(8)]  # the cap
        clients = [stack.enter_context(_client_from(f"127.0.0.{2 + i}")) for i in range(5)]
        assert [client.get(url).status_code for client in clients] == [200] * 4 + [503]  # kept alive, idle
        assert clients[0].get(url).status_code == 200  # again on its connection
        deadline = time.monotonic() + WAIT_S  # the front closed them before answering; their close is on its way
        while sum(not _still_open(sock) for sock in held) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [_still_open(sock) for sock in held] == [False] * 4 + [True] * 4  # each address's older one


@pytest.mark.parametrize("sent", [b"", b"G"], ids=["idle", "one-head-byte"])
def test_a_full_front_of_one_connection_per_address_takes_newcomers_in_place_of_stale_ones(tmp_path, sent):
    """Issue 45's open end: 8 addresses with one connection each (`sent`: nothing, or one byte of a head that
    never ends) fill the cap, so no swap is fair (each holds what a newcomer would), and newcomers were refused
    until the attackers' header timeout (60 s here). Now a newcomer takes the place of the connection idle
    longest once it is `http_idle_reclaim` old; a partial head is idle too. Polled: no timing is asserted."""
    limits = HttpLimits(http_max_connections=8, http_max_connections_per_client=4, http_header_timeout=60,
                        http_keep_alive_timeout=60, http_idle_reclaim=0.2)
    with front(tmp_path, limits) as (_, address), ExitStack() as stack:
        url = f"http://{address[0]}:{address[1]}/health"
        held = [stack.enter_context(_connect(address, f"127.0.1.{1 + i}")) for i in range(8)]  # the cap
        for sock in held:
            sock.sendall(sent)
        deadline = time.monotonic() + WAIT_S
        while (status := httpx.get(url, timeout=WAIT_S).status_code) == 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status == 200
        while _still_open(held[0]) and time.monotonic() < deadline:  # its close is on its way
            time.sleep(0.01)
        assert [_still_open(sock) for sock in held] == [False] + [True] * 7  # the one idle longest


def _health_on(sock: socket.socket) -> bytes:
    """GET /health on `sock`, kept alive: the answer's head and body."""
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    return _answer(sock)


def test_a_kept_alive_connection_is_reclaimed_too_the_one_idle_longest_first(tmp_path):
    """Idle also means kept alive after a response, idle since its response: connection 0, opened first but
    answered last, goes last (1 and 2 are idle since they opened, 3 since its answer), and stays: its client
    is down to one connection, as many as the next newcomer would hold, so that one is refused."""
    limits = HttpLimits(http_max_connections=4, http_max_connections_per_client=4, http_header_timeout=60,
                        http_keep_alive_timeout=60)
    with front(tmp_path, limits) as (_, address), ExitStack() as stack:
        url = f"http://{address[0]}:{address[1]}/health"
        held = [stack.enter_context(_connect(address, "127.0.1.1")) for _ in range(4)]
        assert _health_on(held[3]).startswith(b"HTTP/1.1 200")  # so all four are admitted (in the order they came)
        assert _health_on(held[0]).startswith(b"HTTP/1.1 200")
        clients = [stack.enter_context(_client_from(f"127.0.0.{2 + i}")) for i in range(4)]
        assert [client.get(url).status_code for client in clients] == [200] * 3 + [503]
        deadline = time.monotonic() + WAIT_S
        while sum(not _still_open(sock) for sock in held) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [_still_open(sock) for sock in held] == [True, False, False, False]


@pytest.mark.skipif(not hasattr(resource, "prlimit"), reason="sets a running daemon's descriptor limit (Linux)")
def test_a_connection_flood_cannot_take_the_zeromq_door(tiny_pair_dirs, tmp_path):
    """Issue 45 finding 3: idle HTTP connections up to the daemon's descriptor limit cut off HTTP *and* ZeroMQ
    (its ipc socket could accept no one). A daemon held to 400 descriptors, flooded with 400 connections from
    other loopback addresses: the cap holds 100 of them, the rest are refused, and ZeroMQ clients are served."""
    port = free_port()
    daemon = start_daemon(*tiny_pair_dirs, tmp_path, "fd", "--http", f"127.0.0.1:{port}", *FLOOD_FLAGS)
    try:
        resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (400, 400))
        with ExitStack() as flood:
            for i in range(400):
                try:
                    flood.enter_context(_connect(("127.0.0.1", port), f"127.0.0.{2 + i % 8}"))
                except OSError:
                    break  # the listen backlog is full: the daemon stopped accepting
            with FLyClient(daemon.endpoint, timeout=WAIT_S, max_retries=0) as client:
                assert client.generate("def add(a, b):", *build_options(max_tokens=3)).usage.completion_tokens > 0
        assert daemon.proc.poll() is None
    finally:
        daemon.stop()


FLOOD_FLAGS = ("--http-max-connections", "100")
"""The daemon's cap on open HTTP connections in the flood test."""
