"""Socket-level behaviour of the server and scheduler, in-process, on a test double of the engine (no torch).

The double emits one token per step per request, so deadlines, heartbeats, cancellation, batch
limits, loading state, step failures, CURVE and metrics can be shown quickly and exactly.
End-to-end behaviour on the real engine is in test_daemon_e2e.py and friends.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import zmq
import zmq.auth

from support.engine_double import CountingEngine, serving
from fly_llm.client import FLyClient, build_options, default_endpoint
from fly_llm.common.errors import Cancelled, FLyUnavailable, Internal, NotReady, TooLong
from fly_llm.common.protocol import ErrorReply, GenerateResult, decode_reply

from fly_daemon import runtime
from fly_daemon.core import ServingCore
from fly_daemon.metrics import Metrics
from fly_daemon.runtime import AlreadyRunning, PidLock, daemon_files, is_loopback, running_pid, tcp_host
from fly_daemon.scheduling.scheduler import Limits
from fly_daemon.server import CurveKeys, Server


@pytest.fixture
def endpoint(tmp_path):
    return f"ipc://{tmp_path}/s.sock"


def _raw(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def _generate_frame(rid: str, max_tokens: int, **extra) -> bytes:
    return json.dumps({"v": 1, "id": rid, "kind": "generate", "prompt": "a b c",
                       "sampling": {"max_tokens": max_tokens}, **extra}).encode()


def _reply(sock: zmq.Socket, timeout_s: float = 10.0):
    assert sock.poll(int(timeout_s * 1000)), "no reply"
    return decode_reply(sock.recv())


def test_generate_stream_and_text(endpoint):
    with serving(endpoint, CountingEngine()), FLyClient(endpoint, timeout=10) as client:
        result = client.generate("a b c", *build_options(max_tokens=3))
        assert (result.text, result.token_ids, result.finish_reason) == ("1 2 3 ", [1, 2, 3], "length")
        assert result.usage.prompt_tokens == 3 and result.usage.completion_tokens == 3
        chunks = list(client.stream("a", sampling=build_options(max_tokens=3)[0]))
        assert [c.text for c in chunks[:-1]] == ["1 ", "2 ", "3 "] and chunks[-1].text == "1 2 3 "


def test_request_without_heartbeats_is_cancelled_but_a_client_keeps_its_own(endpoint):
    limits = Limits(heartbeat_timeout=1.5)
    with serving(endpoint, CountingEngine(step_s=0.01), limits), FLyClient(endpoint, timeout=30) as client:
        raw = _raw(endpoint)
        raw.send(_generate_frame("silent", 100_000 // 100))
        started = time.monotonic()
        reply = _reply(raw, 20)
        assert isinstance(reply, ErrorReply) and reply.code == "CANCELLED" and "heartbeat" in reply.message
        assert time.monotonic() - started < 10
        assert client.status().active == 0
        # FLyClient heartbeats once a second, so a 3 s request outlives the 1.5 s heartbeat timeout.
        assert client.generate("a", *build_options(max_tokens=300)).usage.completion_tokens == 300
        raw.close()


def test_deadline_and_cancel(endpoint):
    with serving(endpoint, CountingEngine(step_s=0.01)), FLyClient(endpoint, timeout=10) as client:
        raw = _raw(endpoint)
        raw.send(_generate_frame("late", 1000, timeout_s=0.3))
        assert _reply(raw).code == "TIMEOUT"
        raw.send(_generate_frame("c1", 1000, stream=True))
        assert _reply(raw).kind == "chunk"
        raw.send(json.dumps({"v": 1, "id": "c1", "kind": "cancel"}).encode())
        while (reply := _reply(raw)).kind == "chunk":
            pass
        assert reply.code == "CANCELLED" and reply.id == "c1"
        assert client.status().active == 0
        raw.send(json.dumps({"v": 1, "id": "c1", "kind": "cancel"}).encode())
        assert _reply(raw).code == "BAD_REQUEST"
        raw.close()


def test_same_id_from_two_clients_are_two_requests(endpoint):
    with serving(endpoint, CountingEngine()):
        a, b = _raw(endpoint), _raw(endpoint)
        a.send(_generate_frame("same", 2))
        b.send(_generate_frame("same", 3))
        assert _reply(a).token_ids == [1, 2] and _reply(b).token_ids == [1, 2, 3]
        a.close()
        b.close()


def test_batch_limits(endpoint):
    limits = Limits(max_batch_size=3, max_batch_tokens=10_000)
    with serving(endpoint, CountingEngine(step_s=0.005), limits), FLyClient(endpoint, timeout=30) as client:
        assert len(client.batch(["a"] * 10, *build_options(max_tokens=20))) == 10
        assert client.status().max_batch_size_seen == 3
    limits = Limits(max_batch_tokens=2 * (3 + 20))  # two requests of prompt 3 + max_tokens 20 fit
    with serving(endpoint, CountingEngine(step_s=0.005), limits), FLyClient(endpoint, timeout=30) as client:
        assert len(client.batch(["a b c"] * 6, *build_options(max_tokens=20))) == 6
        assert client.status().max_batch_size_seen == 2


def test_loading_state_then_ready(endpoint):
    loaded = threading.Event()

    def slow_load():
        loaded.wait(30)
        return CountingEngine()

    with serving(endpoint, None, load=slow_load), FLyClient(endpoint, timeout=10) as client:
        assert client.health().state == "loading"
        with pytest.raises(NotReady):
            client.info()
        raw = _raw(endpoint)
        raw.send(_generate_frame("late", 2, timeout_s=0.3))
        assert _reply(raw, 5).code == "TIMEOUT"  # its deadline counts while the models load
        early = {}
        thread = threading.Thread(target=lambda: early.update(r=client.generate("a", *build_options(max_tokens=2))))
        thread.start()  # sent while loading: it waits in the queue instead of failing
        time.sleep(1.5)
        assert client.health().state == "loading" and client.status().queue_depth == 1
        loaded.set()
        thread.join(10)
        assert early["r"].text == "1 2 "
        assert client.health().state == "ready" and client.info().target == "counting"
        raw.close()


def test_stop_while_loading_answers_the_queue(endpoint):
    loaded = threading.Event()
    with serving(endpoint, None, load=lambda: loaded.wait(30) and CountingEngine()) as server:
        raw = _raw(endpoint)
        raw.send(_generate_frame("q", 2))
        time.sleep(0.3)
        server.request_stop()
        reply = _reply(raw, 5)
        assert (reply.id, reply.code) == ("q", Cancelled.code)
        raw.close()
        loaded.set()


def test_failed_step_fails_its_batch_and_the_daemon_keeps_serving(endpoint):
    engine = CountingEngine(step_s=0.01)
    with serving(endpoint, engine), FLyClient(endpoint, timeout=10) as client:
        raw = _raw(endpoint)
        raw.send(_generate_frame("x", 1000))
        time.sleep(0.2)
        engine.fail_next_step = True
        reply = _reply(raw)
        assert reply.code == Internal.code and "engine step failed" in reply.message
        assert "boom" not in reply.message  # the exception's text stays in the log
        assert client.generate("a", *build_options(max_tokens=2)).text == "1 2 "
        raw.close()


def test_draining_refuses_new_work(endpoint):
    engine = CountingEngine(step_s=0.01)
    with serving(endpoint, engine, Limits(drain_timeout=0.5)) as server, FLyClient(endpoint, timeout=10) as c:
        raw = _raw(endpoint)
        raw.send(_generate_frame("long", 100_000 // 100))
        time.sleep(0.2)
        server.request_stop()
        assert _reply(raw).code == Cancelled.code  # did not finish within the drain timeout
        raw.close()
    with pytest.raises(FLyUnavailable):
        FLyClient(endpoint, timeout=1, max_retries=0).health()


def test_curve_on_loopback_tcp(tmp_path, monkeypatch):
    monkeypatch.setenv("FLY_RUNTIME_DIR", str(tmp_path))
    zmq.auth.create_certificates(tmp_path, "server")
    clients = tmp_path / "clients"
    clients.mkdir()
    public, _ = zmq.auth.create_certificates(clients, "client")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    curve = CurveKeys(tmp_path / "server.key_secret", clients)
    with serving(endpoint, CountingEngine(), curve=curve):
        with pytest.raises(FLyUnavailable):
            FLyClient(endpoint, timeout=1, max_retries=0).health()  # no keys: the handshake fails
        monkeypatch.setenv("FLY_CURVE_SERVER_KEY", str(tmp_path / "server.key"))
        monkeypatch.setenv("FLY_CURVE_CLIENT_CERT", str(clients / "client.key_secret"))
        with FLyClient(endpoint, timeout=10) as client:
            assert client.health().state == "ready"
            assert client.generate("a", *build_options(max_tokens=2)).text == "1 2 "
        strangers = tmp_path / "strangers"
        strangers.mkdir()
        zmq.auth.create_certificates(strangers, "stranger")  # a valid key the daemon was not given
        monkeypatch.setenv("FLY_CURVE_CLIENT_CERT", str(strangers / "stranger.key_secret"))
        with FLyClient(endpoint, timeout=1.5, max_retries=0) as stranger:
            with pytest.raises(FLyUnavailable):
                stranger.health()
            with pytest.raises(FLyUnavailable):
                stranger.generate("a", *build_options(max_tokens=2))


def _recording_identities(server: Server) -> list[tuple[str, str | None]]:
    """The tenant and client of every request the server submits from now on."""
    tenants, submit = [], server.scheduler.submit

    def record(envelope, request, *, tenant, client):
        tenants.append((tenant, client))
        return submit(envelope, request, tenant=tenant, client=client)

    server.scheduler.submit = record
    return tenants


def test_each_curve_key_is_its_own_tenant_and_client_and_ipc_is_local(tmp_path, monkeypatch, endpoint):
    """A CURVE key is the client the per-client caps count (over all its sockets); without CURVE, the socket
    (client None: the scheduler counts the envelope)."""
    with serving(endpoint, CountingEngine()) as server, FLyClient(endpoint, timeout=10) as client:
        tenants = _recording_identities(server)
        client.generate("a", *build_options(max_tokens=1))
    assert tenants == [("local", None)]
    monkeypatch.setenv("FLY_RUNTIME_DIR", str(tmp_path))
    tcp, curve, certs = _curve_endpoint(tmp_path, ("alice", "bob"))
    monkeypatch.setenv("FLY_CURVE_SERVER_KEY", str(tmp_path / "server.key"))
    with serving(tcp, CountingEngine(), curve=curve) as server:
        tenants = _recording_identities(server)
        for name in ("alice", "bob", "alice"):
            monkeypatch.setenv("FLY_CURVE_CLIENT_CERT", str(certs[name]))
            with FLyClient(tcp, timeout=10) as client:
                assert client.generate("a", *build_options(max_tokens=1)).text == "1 "
    public = [zmq.auth.load_certificate(certs[name])[0].decode() for name in ("alice", "bob")]
    assert tenants == [(f"curve:{key}", f"curve:{key}") for key in (public[0], public[1], public[0])]


def test_non_loopback_bind_needs_curve(tmp_path):
    with pytest.raises(ValueError, match="CURVE"):
        Server("tcp://0.0.0.0:5555", ServingCore(CountingEngine))
    with pytest.raises(ValueError, match="unsupported"):
        Server("udp://127.0.0.1:5555", ServingCore(CountingEngine))


def test_endpoint_helpers(tmp_path, monkeypatch):
    monkeypatch.setenv("FLY_RUNTIME_DIR", str(tmp_path))
    assert is_loopback("ipc:///tmp/x.sock") and is_loopback("tcp://127.0.0.1:5555")
    assert is_loopback("tcp://[::1]:5555") and is_loopback("tcp://localhost:5555")
    assert not is_loopback("tcp://0.0.0.0:5555") and not is_loopback("tcp://*:5555")
    assert not is_loopback("tcp://192.168.1.4:5555")
    assert tcp_host("tcp://[::1]:80") == "::1" and tcp_host("ipc:///x") is None
    assert daemon_files("ipc:///run/a.sock")[0].as_posix() == "/run/a.sock.pid"
    assert daemon_files("tcp://127.0.0.1:5555")[0] == tmp_path / "tcp-127.0.0.1-5555.pid"


def test_metrics_are_served_on_loopback(endpoint):
    metrics = Metrics()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metrics.serve(port)
    with serving(endpoint, CountingEngine(), metrics=metrics), FLyClient(endpoint, timeout=10) as client:
        client.batch(["a b"] * 4, *build_options(max_tokens=3))
        with pytest.raises(TooLong):
            client.generate("a " * 100)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'fly_requests_total{outcome="ok"} 4.0' in text
    assert 'fly_requests_total{outcome="TOO_LONG"} 1.0' in text
    assert "fly_completion_tokens_total 12.0" in text and "fly_prompt_tokens_total 8.0" in text
    assert "fly_batch_size_count" in text and "fly_time_to_first_token_seconds_count 4.0" in text


def test_result_is_typed(endpoint):
    with serving(endpoint, CountingEngine()), FLyClient(endpoint, timeout=10) as client:
        assert isinstance(client.generate("a", *build_options(max_tokens=1)), GenerateResult)


def test_client_timeout_and_early_close_free_the_slot(endpoint):
    from fly_llm.common.errors import Timeout

    with serving(endpoint, CountingEngine(step_s=0.01)), FLyClient(endpoint, timeout=10) as client:
        with pytest.raises(Timeout):
            client.generate("a", *build_options(max_tokens=100_000 // 100), timeout=0.5)
        stream = client.stream("a", sampling=build_options(max_tokens=1000)[0])
        assert next(stream).text == "1 "
        stream.close()  # leaving early cancels the request on the daemon
        deadline = time.monotonic() + 5
        while client.status().active and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.status().active == 0


async def test_async_stream_left_early_is_cancelled(endpoint):
    from fly_llm.client import AsyncFLyClient

    with serving(endpoint, CountingEngine(step_s=0.01)):
        async with AsyncFLyClient(endpoint, timeout=10) as client:
            stream = client.stream("a", sampling=build_options(max_tokens=1000)[0])
            async for chunk in stream:
                assert chunk.text == "1 "
                break
            await stream.aclose()
            deadline = time.monotonic() + 5
            while (await client.status()).active and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert (await client.status()).active == 0
            results = await client.batch(["a", "b"], *build_options(max_tokens=2))
            assert [r.text for r in results] == ["1 2 ", "1 2 "]


def test_tcp_port_taken_by_another_program(tmp_path, monkeypatch):
    monkeypatch.setenv("FLY_RUNTIME_DIR", str(tmp_path))
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        server = Server(f"tcp://127.0.0.1:{other.getsockname()[1]}", ServingCore(CountingEngine))
        with pytest.raises(OSError, match="cannot bind"):
            server.serve()


def test_pidfile_is_owned_by_one_daemon_even_when_one_stops_as_another_starts(tmp_path, monkeypatch):
    endpoint = f"ipc://{tmp_path}/s.sock"
    first, second, third = PidLock(endpoint), PidLock(endpoint), PidLock(endpoint)
    first.acquire()
    flock = runtime.fcntl.flock

    def first_stops_before_the_lock(fd, operation):  # `second` has opened the pidfile, not yet locked it
        monkeypatch.setattr(runtime.fcntl, "flock", flock)
        first.release()
        return flock(fd, operation)

    monkeypatch.setattr(runtime.fcntl, "flock", first_stops_before_the_lock)
    second.acquire()  # it locked the file `first` removed, saw that, and locked a fresh one
    assert running_pid(endpoint) == os.getpid()
    with pytest.raises(AlreadyRunning):
        third.acquire()
    second.release()
    assert not first.path.exists()
    third.acquire()
    third.release()


def test_stale_socket_is_replaced_but_no_other_file(tmp_path):
    path = tmp_path / "s.sock"
    endpoint = f"ipc://{path}"
    path.write_text("not a socket")
    server = Server(endpoint, ServingCore(CountingEngine))
    server.request_stop()  # were the file taken for a stale socket, serve would return at once, not serve on
    with pytest.raises(OSError, match="not a socket"):
        server.serve()
    assert path.read_text() == "not a socket" and running_pid(endpoint) is None
    path.unlink()
    with socket.socket(socket.AF_UNIX) as crashed:  # a socket file left behind by a crash
        crashed.bind(str(path))
    with serving(endpoint, CountingEngine()), FLyClient(endpoint, timeout=10) as client:
        assert client.health().state == "ready"
    assert not path.exists()


def test_runtime_dir_is_private_and_socket_is_0600(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o755)
    run_dir.chmod(0o755)
    monkeypatch.setenv("FLY_RUNTIME_DIR", str(run_dir))
    endpoint = default_endpoint()  # tightens the runtime dir to 0700
    assert run_dir.stat().st_mode & 0o777 == 0o700
    with serving(endpoint, CountingEngine()), FLyClient(endpoint, timeout=10) as client:
        assert client.health().state == "ready"
        assert (run_dir / "daemon.sock").stat().st_mode & 0o777 == 0o600
    nested = f"ipc://{tmp_path}/new/dir/s.sock"  # a missing socket dir is created 0700
    with serving(nested, CountingEngine()), FLyClient(nested, timeout=10) as client:
        assert client.health().state == "ready"
        assert (tmp_path / "new" / "dir").stat().st_mode & 0o777 == 0o700


def test_an_unexpected_error_handling_a_frame_answers_internal_and_the_loop_goes_on(endpoint, monkeypatch, caplog):
    """Issue 33 finding 2: an exception other than FLyError escaped the frame handler and stopped serve()."""
    with serving(endpoint, CountingEngine()) as server, FLyClient(endpoint, timeout=10) as client:
        def broken(*args, **kwargs):
            raise RecursionError("secret detail of the failure")

        monkeypatch.setattr(server.scheduler, "submit", broken)
        raw = _raw(endpoint)
        for rid in ("boom1", "boom2"):
            raw.send(_generate_frame(rid, 2))
            reply = _reply(raw)
            assert isinstance(reply, ErrorReply) and (reply.id, reply.code) == (rid, "INTERNAL")
            assert "secret" not in reply.message
        assert "secret detail of the failure" in caplog.text  # the traceback is logged instead
        monkeypatch.undo()
        assert client.generate("a", *build_options(max_tokens=2)).text == "1 2 "
        raw.close()


def test_a_frame_over_the_cap_drops_only_its_peer(endpoint):
    """Issue 33 finding 10: zmq took frames up to 4x the cap; now a larger frame ends that connection unread."""
    with serving(endpoint, CountingEngine(), max_frame_bytes=2048), FLyClient(endpoint, timeout=10) as client:
        raw = _raw(endpoint)
        at_cap = _generate_frame("near", 2).replace(b'"a b c"', b'"a b c' + b" " * 2048 + b'"')
        at_cap = at_cap.replace(b" " * (len(at_cap) - 2048), b"", 1)
        assert len(at_cap) == 2048
        raw.send(at_cap)
        assert _reply(raw).id == "near"  # read and answered (whatever the answer)
        raw.send(at_cap + b" ")
        assert not raw.poll(1500), "a frame over the cap was read"
        assert client.generate("a", *build_options(max_tokens=2)).text == "1 2 "
        raw.send(_generate_frame("again", 2))  # the same socket reconnects and is served
        assert _reply(raw).token_ids == [1, 2]
        raw.close()


def _curve_endpoint(tmp_path, names: tuple[str, ...]) -> tuple[str, CurveKeys, dict[str, Path]]:
    """A loopback tcp endpoint, the server's CURVE keys, and a client certificate (secret) per name."""
    zmq.auth.create_certificates(tmp_path, "server")
    clients = tmp_path / "clients"
    clients.mkdir()
    certs = {name: Path(zmq.auth.create_certificates(clients, name)[1]) for name in names}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"tcp://127.0.0.1:{port}", CurveKeys(tmp_path / "server.key_secret", clients), certs


def _curve_raw(endpoint: str, server_key: Path, cert: Path) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_serverkey = zmq.auth.load_certificate(server_key)[0]
    sock.curve_publickey, sock.curve_secretkey = zmq.auth.load_certificate(cert)
    sock.connect(endpoint)
    return sock


def test_heartbeats_keep_alive_only_requests_of_the_senders_credential(tmp_path, monkeypatch):
    """Issue 33 finding 10: a heartbeat naming another client's request id kept that request alive."""
    monkeypatch.setenv("FLY_RUNTIME_DIR", str(tmp_path))
    endpoint, curve, certs = _curve_endpoint(tmp_path, ("owner", "stranger"))
    with serving(endpoint, CountingEngine(step_s=0.01), Limits(heartbeat_timeout=1.0), curve=curve):
        owner, stranger = (_curve_raw(endpoint, tmp_path / "server.key", certs[name]) for name in ("owner", "stranger"))
        owner.send(_generate_frame("r", 1000))  # 10 s of steps
        started = time.monotonic()
        while not owner.poll(200):
            stranger.send(json.dumps({"v": 1, "id": "hb", "kind": "heartbeat", "ids": ["r"]}).encode())
            assert _reply(stranger).kind == "health"
            assert time.monotonic() - started < 8, "another client's heartbeats kept the request alive"
        reply = _reply(owner)
        assert isinstance(reply, ErrorReply) and reply.code == "CANCELLED" and "heartbeat" in reply.message
        owner.close()
        stranger.close()


def test_the_socket_file_is_0600_from_the_moment_it_is_bound(tmp_path, monkeypatch):
    path = tmp_path / "s.sock"
    modes = []
    bind = zmq.Socket.bind

    def bind_and_look(sock, address):
        result = bind(sock, address)
        if address.startswith("ipc://"):
            modes.append(path.stat().st_mode & 0o777)
        return result

    monkeypatch.setattr(zmq.Socket, "bind", bind_and_look)
    before = os.umask(0o022)
    try:
        with serving(f"ipc://{path}", CountingEngine()):
            pass
        assert os.umask(0o022) == 0o022  # the process umask is restored after the bind
    finally:
        os.umask(before)
    assert modes == [0o600]


def test_pidfile_and_log_are_never_opened_through_a_symbolic_link(tmp_path):
    """Issue 33 finding 10: a link planted where the pidfile goes made the daemon truncate its target."""
    precious = tmp_path / "precious"
    precious.write_text("keep me")
    endpoint = f"ipc://{tmp_path}/s.sock"
    pidfile, logfile = daemon_files(endpoint)
    pidfile.symlink_to(precious)
    with pytest.raises(OSError, match="symbolic link"):
        PidLock(endpoint).acquire()
    logfile.symlink_to(precious)
    with pytest.raises(OSError, match="symbolic link"):
        runtime.open_private(logfile, os.O_WRONLY | os.O_APPEND)
    assert precious.read_text() == "keep me"
