"""Faults: a client killed mid-stream, a full queue, SIGTERM during work, SIGKILL, restarts, the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from support.daemon_process import DaemonProcess, start_daemon
from support.device import TEST_DEVICE
from fly_llm.client import FLyClient, build_options
from fly_llm.common.errors import Busy, Cancelled, FLyUnavailable, NotReady

CANDIDATES = ["def add(a, b):", "The quick brown fox", "for i in range(10):", "class Stack:", "Question:"]
LONG = 200
# A "long" request must still be running while a test looks at it. On the 2-layer tiny pair 400 tokens
# take about 0.1 s (the random model loops, so n-gram drafts are accepted whole). Here each forward
# takes ~15 ms and a round drafts one token, so LONG tokens take a few seconds. Exact mode: the
# continuation is the target's greedy one whatever draft lengths the daemon's timed policy picks.
SLOW_SIZE = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8)
LONG_OPTIONS = build_options(max_tokens=LONG, loose=False, k=1)


@pytest.fixture(scope="module")
def slow_pair_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(target_dir, draft_dir) of a pair like the tiny one but ~30M parameters each."""
    from support.tiny_models import save_tiny_pair

    return save_tiny_pair(tmp_path_factory.mktemp("slow_llama"), "llama", **SLOW_SIZE)


@pytest.fixture(scope="module")
def slow_daemon(slow_pair_dirs, tmp_path_factory):
    """Endpoint of a daemon serving the slow pair; stopped at the end of the module."""
    daemon = start_daemon(*slow_pair_dirs, tmp_path_factory.mktemp("slow_daemon"), "s")
    yield daemon.endpoint
    daemon.stop()


@pytest.fixture(scope="module")
def long_prompt(slow_daemon) -> str:
    """A prompt whose greedy continuation runs to LONG tokens without hitting EOS."""
    with FLyClient(slow_daemon, timeout=120) as client:
        results = client.batch(CANDIDATES, *LONG_OPTIONS)
    return next(p for p, r in zip(CANDIDATES, results) if r.finish_reason == "length")


def _cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fly_daemon.cli", *args], capture_output=True, timeout=timeout,
                          env=env, encoding="utf-8", errors="replace")


def _wait_for(predicate, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_client_killed_mid_stream_frees_its_slot(slow_daemon, long_prompt):
    script = (
        "from fly_llm.client import FLyClient, build_options\n"
        f"client = FLyClient({slow_daemon!r}, timeout=120)\n"
        f"options = build_options(max_tokens={LONG}, loose=False, k=1)\n"
        f"for chunk in client.stream({long_prompt!r}, sampling=options[0], fly=options[1]):\n"
        "    print('chunk', flush=True)\n")
    with FLyClient(slow_daemon, timeout=30) as client:
        tokens_before = client.status().tokens_generated
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "chunk"
        proc.kill()
        proc.wait()
        assert _wait_for(lambda: client.status().active == 0)
        assert client.status().tokens_generated - tokens_before < LONG
        assert client.generate("def add(a, b):", *build_options(max_tokens=4)).usage.completion_tokens > 0


def test_crash_restart_busy_and_graceful_stop(slow_pair_dirs, tmp_path, long_prompt):
    """One endpoint's life: SIGKILL under a waiting client, a detached restart that replaces the stale
    files, a second daemon refused, the CLI, a full queue, and a graceful `stop` during work."""
    target, draft = (str(p) for p in slow_pair_dirs)
    crashed = start_daemon(*slow_pair_dirs, tmp_path, "k")
    endpoint, sock = crashed.endpoint, Path(crashed.endpoint.removeprefix("ipc://"))
    client = FLyClient(endpoint, timeout=8, max_retries=0)
    _sigkill_under_a_waiting_client(crashed, client, long_prompt)
    assert sock.exists() and Path(f"{sock}.pid").exists()  # stale, left by the crash

    env = dict(os.environ, FLY_RUNTIME_DIR=str(tmp_path))
    start = _cli("start", "--endpoint", endpoint, "--target", target, "--draft", draft, "--dtype", "float32",
                 "--device", TEST_DEVICE, "--queue-size", "2", "--max-batch-size", "2", "--newcomer-rows", "0", "--drain-timeout", "120",
                 env=env)  # no newcomer rows: the short requests queue behind the two long streams
    assert start.returncode == 0, start.stdout + start.stderr
    assert "ready" in start.stdout and endpoint in start.stdout
    try:
        assert "removing stale socket" in Path(f"{sock}.log").read_text()
        second = _cli("start", "--foreground", "--endpoint", endpoint, "--target", target, env=env)
        assert second.returncode == 1 and "already running" in second.stderr
        assert client.health().state == "ready"  # the same client object, after the restart
        _cli_status_and_generate(client, endpoint, target, env)
        _busy_then_graceful_stop(client, endpoint, long_prompt, env)
    finally:
        _cli("stop", "--endpoint", endpoint, env=env, timeout=120)
    assert not sock.exists() and not Path(f"{sock}.pid").exists()
    assert _cli("status", "--endpoint", endpoint, env=env, timeout=60).returncode == 1
    with pytest.raises(FLyUnavailable):
        client.health()
    client.close()


def _sigkill_under_a_waiting_client(daemon: DaemonProcess, client: FLyClient, prompt: str) -> None:
    errors: list[BaseException] = []

    def waiting() -> None:
        try:
            client.generate(prompt, *LONG_OPTIONS)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion below
            errors.append(exc)

    waiter = threading.Thread(target=waiting)
    waiter.start()
    assert _wait_for(lambda: client.status().active == 1, 30)
    daemon.kill()
    waiter.join(30)
    assert errors and isinstance(errors[0], FLyUnavailable)


def _cli_status_and_generate(client: FLyClient, endpoint: str, target: str, env: dict) -> None:
    status = _cli("status", "--endpoint", endpoint, env=env, timeout=60)
    assert status.returncode == 0 and "ready" in status.stdout and Path(target).name in status.stdout  # its id
    assert "from the prefix cache" in status.stdout and "MiB" in status.stdout
    gen = _cli("generate", "def add(a, b):", "--raw", "--max-tokens", "8", "--no-loose", "--endpoint", endpoint,
               env=env, timeout=60)
    expected = client.generate("def add(a, b):", *build_options(max_tokens=8, loose=False)).text
    assert gen.returncode == 0 and "tokens" in gen.stderr
    assert gen.stdout == expected.replace("\r\n", "\n").replace("\r", "\n")


def _busy_then_graceful_stop(client: FLyClient, endpoint: str, prompt: str, env: dict) -> None:
    """Batch size 2, queue 2: two long streams run, two requests queue, the rest are BUSY; then `stop`
    (SIGTERM) while the batch runs: the running streams finish, the queued are cancelled."""
    outcomes: dict[str, object] = {}
    started = [threading.Event(), threading.Event()]

    def long_stream(i: int) -> None:
        with FLyClient(endpoint, timeout=300) as own:
            items = []
            for item in own.stream(prompt, sampling=LONG_OPTIONS[0], fly=LONG_OPTIONS[1]):
                started[i].set()
                items.append(item)
        outcomes[f"long{i}"] = items[-1]

    def short(name: str) -> None:
        try:
            outcomes[name] = client.generate("def add(a, b):", *build_options(max_tokens=4), timeout=300)
        except (Busy, Cancelled, NotReady, FLyUnavailable) as exc:
            outcomes[name] = exc

    workers = [threading.Thread(target=long_stream, args=(i,)) for i in range(2)]
    for w in workers:
        w.start()
    assert all(e.wait(60) for e in started)
    workers += [threading.Thread(target=short, args=(f"s{i}",)) for i in range(5)]
    for w in workers[2:]:
        w.start()
    assert _wait_for(lambda: sum(isinstance(v, Busy) for v in outcomes.values()) >= 3)
    status = client.status()
    assert (status.active, status.queue_depth) == (2, 2)  # two running, two queued, the rest refused

    stop = _cli("stop", "--endpoint", endpoint, "--timeout", "280", env=env, timeout=300)
    for w in workers:
        w.join(300)
    assert stop.returncode == 0 and "stopped" in stop.stdout
    for i in range(2):  # the running requests finished
        assert outcomes[f"long{i}"].finish_reason == "length" and len(outcomes[f"long{i}"].token_ids) == LONG
    queued = [v for k, v in outcomes.items() if k.startswith("s") and not isinstance(v, Busy)]
    assert len(queued) == 2 and all(isinstance(v, Cancelled) for v in queued)


def test_model_load_failure_exits_with_its_message(tmp_path):
    bad = DaemonProcess(tmp_path / "missing", tmp_path / "missing", f"ipc://{tmp_path}/x.sock", tmp_path / "x.log")
    with pytest.raises(RuntimeError, match="exited"):
        bad.wait_ready(120)
    assert bad.proc.returncode == 1 and "loading models failed" in bad.output()
    assert not (tmp_path / "x.sock").exists()
