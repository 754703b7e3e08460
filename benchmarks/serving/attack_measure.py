"""What the issue-45 attacks do to everyone else, measured (issue 45, "Measure"), on a tiny daemon.

    python benchmarks/serving/attack_measure.py --out benchmarks/results/attacks

A tiny random pair (tests/support) is served by a daemon subprocess with the given HTTP and grammar
limits. A victim client on 127.0.0.2 streams a greedy completion over HTTP (a new stream when one ends)
while each attack runs from 127.0.0.1 in a process of its own (so the attacker's work does not hold
this process's interpreter); a normal client on 127.0.0.2 sends small requests, each on a new
connection, and a ZeroMQ client sends health and small generate requests, both counting what they got.
Phases:

- baseline: no attack;
- grammar_flood: `--grammars` distinct expensive JSON schemas (a `pattern` of hundreds to thousands of
  alternated words, tests/hostile/test_grammar_memory.py) one after another, alternating the OpenAI and
  Ollama doors; the daemon's RSS and its compiled-grammar cache are sampled after every `--sample-every`;
- idle_flood: up to `--idle-connections` connections that send nothing (as many as the file descriptor
  limit allows, its soft limit raised to the hard one), each the daemon closes opened again;
- idle_flood_spread: the same from 254 addresses (127.0.1.1-254): each under the per-client cap, all of
  them over the cap on connections in all;
- slow_requests: `--slow-connections` connections sending a request's head, or its body, a byte a second;
- amplification: requests with n=16, echo and 20 logprobs, back to back from `--attackers` threads;
- extreme_sampling: requests with temperatures, top_p and min_p at float32's edges from `--attackers` threads,
  batched beside the victim.

A phase named twice or more in `--phases` runs again each time (labelled `amplification_2`, …): its RSS after
each run tells a bounded high-water mark from growth.

Per phase: the victim's gaps between streamed chunks (longest, median, 99th percentile) while the attack
ran, its time to first chunk, whether its text stayed the baseline's, the normal and ZeroMQ clients'
counts, the attack's own counts, and the daemon's RSS and prefix cache (results.json only). Writes
results.json and results.md to `--out`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import random
import resource
import selectors
import shlex
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness.environment import cpu_name, git_commit

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from hostile.test_grammar_memory import expensive_schema, request_of, rss_mb  # noqa: E402
from support.daemon_process import free_port, start_daemon  # noqa: E402
from support.tiny_models import save_tiny_pair  # noqa: E402

from fly_llm.client import FLyClient, build_options  # noqa: E402
from fly_llm.common.errors import FLyError  # noqa: E402

VICTIM_PROMPT = "def add(a, b):"  # the tiny pair's greedy answer to it runs to max_tokens
ATTACKER = "127.0.0.1"
CLIENT = "127.0.0.2"
"""The victim's and the normal client's source address: another client to the daemon (Linux routes 127/8)."""
IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)  # Linux's; Python names it from 3.12
FD_KEPT = 200
"""File descriptors the attack process keeps for itself when it opens idle connections."""
EXTREME_SAMPLING = ({"temperature": 1e-45}, {"temperature": 1e-30, "top_p": 1e-45}, {"top_p": 5e-324},
                    {"temperature": 1e-40, "min_p": 1e-45}, {"temperature": 10.0, "top_p": 1e-38},
                    {"temperature": 1.2e-38, "top_k": 1})
AMPLIFY_PROMPT = "The quick brown fox " * 18  # 288 tokens of the tiny pair: with max_tokens 200, in its 512
SPREAD = tuple(f"127.0.1.{i}" for i in range(1, 255))
"""The spread idle flood's source addresses: one attacker posing as many clients (each under the per-client cap)."""
PHASES = ("baseline", "grammar_flood", "idle_flood", "idle_flood_spread", "slow_requests", "amplification",
          "extreme_sampling")


# ---- pure parts ----

def phase_labels(chosen: list[str]) -> list[tuple[str, str]]:
    """(label, phase) of each phase to run: the baseline first, then `chosen` in order (its first baseline dropped);
    a phase chosen again is labelled `<phase>_2`, `<phase>_3`, … (to see whether its RSS growth repeats)."""
    rest = list(chosen)
    if "baseline" in rest:
        rest.remove("baseline")
    seen: Counter = Counter()
    labels = []
    for name in ("baseline", *rest):
        seen[name] += 1
        labels.append((name if seen[name] == 1 else f"{name}_{seen[name]}", name))
    return labels


def gap_stats(streams: list[list[float]], start: float, end: float) -> dict[str, Any]:
    """The gaps between consecutive chunks of each stream (arrival times) that fall within [start, end]:
    longest, median and 99th percentile (seconds) and how many; None values when there were none."""
    gaps = sorted(b - a for times in streams for a, b in zip(times, times[1:]) if start <= a and b <= end)
    if not gaps:
        return {"max_gap_s": None, "p50_gap_s": None, "p99_gap_s": None, "gaps": 0}
    return {"max_gap_s": round(gaps[-1], 4), "p50_gap_s": round(statistics.median(gaps), 4),
            "p99_gap_s": round(gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], 4), "gaps": len(gaps)}


def _seconds(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"


def render(results: dict[str, Any]) -> str:
    """results.md: the settings, one row per phase, the RSS series and each attack's own counts."""
    s = results["settings"]
    lines = ["# Attacks against a tiny daemon, measured (issue 45)", "",
             f"`{results['command']}` on commit {results['commit']}, {results['cpu']}, {results['elapsed_s']:.0f} s.",
             f"Daemon flags: `{' '.join(s['daemon_flags'])}`.", "",
             "| phase | victim longest gap | p50 gap | p99 gap | gaps | longest first chunk | victim streams "
             "(ok / wrong text / failed) | normal client (127.0.0.2) | ZeroMQ client | daemon RSS after |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, p in results["phases"].items():
        v = p["victim"]
        lines.append(f"| {name} | {_seconds(v['max_gap_s'])} | {_seconds(v['p50_gap_s'])} | "
                     f"{_seconds(v['p99_gap_s'])} | {v['gaps']} | {_seconds(v['max_first_chunk_s'])} | "
                     f"{v['streams_ok']} / {v['streams_wrong_text']} / {v['streams_failed']} | "
                     f"{_counts(p['normal_client'])} | {_counts(p['zmq_client'])} | {p['rss_mb_after']:.0f} MiB |")
    flood = results["phases"].get("grammar_flood", {}).get("attack", {})
    if flood.get("samples"):
        lines += ["", f"Grammar flood ({flood['grammars']} distinct schemas, cache budget {s['grammar_cache_mb']} MiB, "
                  f"per-grammar cap {s['max_grammar_mb']} MiB): outcomes {_counts(flood['outcomes'])}.", "",
                  "| grammars sent | daemon RSS | compiled-grammar cache |", "|---|---|---|"]
        lines += [f"| {x['sent']} | {x['rss_mb']:.0f} MiB | {x['compiled_mb']:.1f} MiB |" for x in flood["samples"]]
    lines += ["", "Each attack's own counts:", ""]
    for name, p in results["phases"].items():
        attack = {k: v for k, v in p["attack"].items() if k != "samples"}
        if attack:
            lines.append(f"- {name}: `{json.dumps(attack, sort_keys=True)}`")
    return "\n".join(lines) + "\n"


# ---- the clients beside the attack ----

def _client_http(timeout: float = 60.0, **limits: int) -> httpx.Client:
    """An HTTP client whose connections come from CLIENT."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=CLIENT, limits=httpx.Limits(**limits)),
                        timeout=timeout)


@dataclass
class Victim:
    """Greedy streams over HTTP from CLIENT, one after another, until stopped: each stream's chunk times."""

    url: str
    model: str
    max_tokens: int
    streams: list[list[float]] = field(default_factory=list)
    first_chunk_s: list[tuple[float, float]] = field(default_factory=list)  # (request sent, wait)
    texts: list[str] = field(default_factory=list)  # of the streams that ran to their end
    failures: Counter = field(default_factory=Counter)
    stop: threading.Event = field(default_factory=threading.Event)
    started: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        body = {"model": self.model, "prompt": VICTIM_PROMPT, "max_tokens": self.max_tokens, "temperature": 0,
                "stream": True, "loose": False}
        with _client_http() as http:
            while not self.stop.is_set():
                times: list[float] = []
                self.streams.append(times)
                sent, text, done = time.monotonic(), [], False
                try:
                    with http.stream("POST", f"{self.url}/v1/completions", json=body) as reply:
                        if reply.status_code != 200:
                            self.failures[f"HTTP {reply.status_code}"] += 1
                            time.sleep(0.2)
                            continue
                        for line in reply.iter_lines():
                            if not line.startswith("data: "):
                                continue
                            if line == "data: [DONE]":
                                done = True
                                break
                            times.append(time.monotonic())
                            if len(times) == 1:
                                self.first_chunk_s.append((sent, times[0] - sent))
                                self.started.set()
                            choice = json.loads(line[6:])["choices"][0]
                            text.append(choice.get("text") or "")
                            if self.stop.is_set():
                                break
                except httpx.HTTPError as exc:
                    self.failures[type(exc).__name__] += 1
                    continue
                if done:
                    self.texts.append("".join(text))

    def report(self, start: float, end: float, reference: str | None) -> dict[str, Any]:
        """Its gaps from `start` to `end`, its longest wait for a first chunk, its streams that ran to their end
        with `reference`'s text (the first one's when None) or another, and its failures."""
        reference = reference if reference is not None else (self.texts or [None])[0]
        waits = [w for sent, w in self.first_chunk_s if start <= sent <= end]
        return gap_stats(self.streams, start, end) | {
            "max_first_chunk_s": round(max(waits), 4) if waits else None,
            "streams_ok": sum(t == reference for t in self.texts),
            "streams_wrong_text": sum(t != reference for t in self.texts),
            "streams_failed": sum(self.failures.values()), "failures": dict(self.failures)}


def normal_client(url: str, model: str, stop: threading.Event, counts: Counter) -> None:
    """Small completions from CLIENT, each on a new connection, until stopped: counts by outcome."""
    body = {"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    with _client_http(timeout=30, max_keepalive_connections=0) as http:
        while not stop.is_set():
            try:
                reply = http.post(f"{url}/v1/completions", json=body)
                counts["ok" if reply.status_code == 200 else f"HTTP {reply.status_code}"] += 1
            except httpx.HTTPError as exc:
                counts[type(exc).__name__] += 1
            stop.wait(0.2)


def zmq_client(endpoint: str, stop: threading.Event, counts: Counter) -> None:
    """Health and 4-token generate requests over ZeroMQ until stopped: counts by outcome."""
    sampling, fly = build_options(max_tokens=4, temperature=0.0)
    with FLyClient(endpoint, timeout=30, max_retries=0) as client:
        while not stop.is_set():
            try:
                client.health()
                client.generate("Hello", sampling, fly)
                counts["ok"] += 1
            except FLyError as exc:
                counts[exc.code] += 1
            stop.wait(0.2)


# ---- the attacks (each in a process of its own; returns its counts and when it ran, in monotonic time) ----

def grammar_flood(url: str, endpoint: str, pid: int, grammars: int, sample_every: int) -> dict[str, Any]:
    """`grammars` distinct expensive schemas, one after another; RSS and cache size every `sample_every`."""
    rng, outcomes, samples = random.Random(0), Counter(), []
    start = time.monotonic()
    with httpx.Client(base_url=url, timeout=120) as http, FLyClient(endpoint, timeout=60, max_retries=0) as zmq:
        model = http.get("/v1/models").json()["data"][0]["id"]
        samples.append({"sent": 0, "rss_mb": rss_mb(pid), "compiled_mb": zmq.status().grammars.compiled_bytes / 2**20})
        for index in range(grammars):
            door = ("openai_format", "ollama_format")[index % 2]
            path, body = request_of(door, model, expensive_schema(rng))
            try:
                reply = http.post(path, json=body)
                over_cap = reply.status_code == 400 and "max_grammar_mb" in reply.text
                outcomes["served" if reply.status_code == 200 else "over cap" if over_cap
                         else f"HTTP {reply.status_code}"] += 1
            except httpx.HTTPError as exc:
                outcomes[type(exc).__name__] += 1
            if (index + 1) % sample_every == 0 or index + 1 == grammars:
                samples.append({"sent": index + 1, "rss_mb": rss_mb(pid),
                                "compiled_mb": zmq.status().grammars.compiled_bytes / 2**20})
    return {"start": start, "end": time.monotonic(), "grammars": grammars, "outcomes": dict(outcomes),
            "samples": samples}


def _raise_fd_limit() -> int:
    """Raise this process's soft file descriptor limit to the hard one; the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft


class Flood:
    """Connections from `sources` (in turn) to ATTACKER's `port` held open: each one the server answers or closes
    is counted and opened again, at most `reopen_per_s` a second; `feed(sock, kind, state)` (if given) is called on
    every open one each second (`state`: a one-item list it may keep a flag in)."""

    def __init__(self, port: int, reopen_per_s: float,
                 feed: Callable[[socket.socket, str, list[bool]], None] | None = None,
                 sources: tuple[str, ...] = (ATTACKER,)) -> None:
        self.port, self.reopen_per_s, self.feed, self.sources = port, reopen_per_s, feed, sources
        self.selector = selectors.DefaultSelector()
        self.counts: Counter = Counter()
        self.held_s: dict[str, float] = {}  # the longest time the server kept a connection of each kind
        self.pending: list[str] = []

    def open(self, kind: str) -> None:
        sock = socket.socket()
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)  # the port is picked at connect
        sock.bind((self.sources[self.counts["opened"] % len(self.sources)], 0))
        sock.connect_ex((ATTACKER, self.port))
        self.selector.register(sock, selectors.EVENT_READ, (kind, time.monotonic(), [False]))
        self.counts["opened"] += 1

    def _answered(self, key: selectors.SelectorKey) -> None:
        kind, opened, _ = key.data
        sock = key.fileobj
        try:
            data = sock.recv(4096)
        except OSError:
            data = b""
        what = "refused 503" if data.startswith(b"HTTP/1.1 503") else (
            f"answered {data[9:12].decode(errors='replace')}" if data.startswith(b"HTTP/") else "closed by server")
        self.counts[f"{kind} {what}"] += 1
        if what == "closed by server":
            self.held_s[kind] = max(self.held_s.get(kind, 0.0), time.monotonic() - opened)
        self.selector.unregister(sock)
        sock.close()
        self.pending.append(kind)

    def run(self, until: float) -> None:
        """Serve the flood until monotonic time `until`."""
        budget, last, fed = 0.0, time.monotonic(), time.monotonic()
        while (now := time.monotonic()) < until:
            for key, _ in self.selector.select(0.05):
                self._answered(key)
            budget = min(budget + (now - last) * self.reopen_per_s, self.reopen_per_s)
            last = now
            while self.pending and budget >= 1:
                self.open(self.pending.pop())
                budget -= 1
                self.counts["reopened"] += 1
            if self.feed is not None and now - fed >= 1:
                fed = now
                for key in list(self.selector.get_map().values()):
                    try:
                        self.feed(key.fileobj, key.data[0], key.data[2])
                    except OSError:
                        pass

    def close(self) -> int:
        """Close every connection; how many were still open (the server had not closed them)."""
        keys = list(self.selector.get_map().values())
        for key in keys:
            key.fileobj.close()
        self.selector.close()
        return len(keys)


def idle_flood(port: int, connections: int, seconds: float, reopen_per_s: float,
               sources: tuple[str, ...] = (ATTACKER,)) -> dict[str, Any]:
    """Up to `connections` connections from `sources` that send nothing, for `seconds`."""
    limit = _raise_fd_limit()
    flood = Flood(port, reopen_per_s, sources=sources)
    wanted = min(connections, limit - FD_KEPT)
    start = time.monotonic()
    for _ in range(wanted):
        flood.open("idle")
    flood.run(start + seconds)
    end = time.monotonic()
    return {"start": start, "end": end, "fd_soft_limit": limit, "connections": wanted, "sources": len(sources),
            "open_at_end": flood.close(), **flood.counts}


HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
FIRST_BYTES = {"slow_head": HEAD + b"x-slow: ", "slow_body": HEAD + b"content-length: 100000\r\n\r\n"}
"""What a slow connection sends first: a head that is never finished, or a whole head before its body."""


def _feed_slow(sock: socket.socket, kind: str, sent: list[bool]) -> None:
    """The start of a request first, then one byte of the head (or the body) each second."""
    sock.send(b"x" if sent[0] else FIRST_BYTES[kind])
    sent[0] = True


def slow_requests(port: int, connections: int, seconds: float, reopen_per_s: float) -> dict[str, Any]:
    """`connections` connections, half sending a head and half a body (after a whole head) a byte a second."""
    flood = Flood(port, reopen_per_s, _feed_slow)
    start = time.monotonic()
    for i in range(connections):
        flood.open("slow_head" if i % 2 else "slow_body")
    flood.run(start + seconds)
    end = time.monotonic()
    return {"start": start, "end": end, "connections": connections, "open_at_end": flood.close(),
            "longest_held_s": {k: round(v, 2) for k, v in flood.held_s.items()}, **flood.counts}


def _hammer(url: str, seconds: float, threads: int, bodies: list[dict]) -> dict[str, Any]:
    """`threads` clients posting `bodies` (in turn) to /v1/completions back to back for `seconds`."""
    counts: Counter = Counter()
    reply_bytes = [0]
    lock = threading.Lock()
    start = time.monotonic()
    until = start + seconds

    def one(offset: int) -> None:
        with httpx.Client(base_url=url, timeout=120) as http:
            i = offset
            while time.monotonic() < until:
                try:
                    reply = http.post("/v1/completions", json=bodies[i % len(bodies)])
                    outcome = "ok" if reply.status_code == 200 else f"HTTP {reply.status_code} " + str(
                        (reply.json().get("error") or {}).get("code"))
                    size = len(reply.content)
                except (httpx.HTTPError, ValueError) as exc:
                    outcome, size = type(exc).__name__, 0
                with lock:
                    counts[outcome] += 1
                    reply_bytes[0] += size
                i += 1

    workers = [threading.Thread(target=one, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return {"start": start, "end": time.monotonic(), "replies": dict(counts), "reply_bytes": reply_bytes[0]}


def amplification(url: str, model: str, seconds: float, threads: int) -> dict[str, Any]:
    body = {"model": model, "prompt": AMPLIFY_PROMPT, "n": 16, "echo": True, "logprobs": 20, "max_tokens": 200}
    return _hammer(url, seconds, threads, [body])


def extreme_sampling(url: str, model: str, seconds: float, threads: int) -> dict[str, Any]:
    bodies = [{"model": model, "prompt": "Once upon a time", "max_tokens": 64, **s} for s in EXTREME_SAMPLING]
    return _hammer(url, seconds, threads, bodies)


# ---- the run ----

def run_phase(name: str, attack: Callable[..., dict[str, Any]] | None, attack_args: tuple, pool: Any, daemon: Any,
              url: str, model: str, args: argparse.Namespace, reference: str | None) -> dict[str, Any]:
    """One phase: the victim, the normal and the ZeroMQ clients running while `attack(*attack_args)` runs in
    `pool`'s process (or, for the baseline, for `--phase-s`)."""
    victim = Victim(url, model, args.victim_tokens)
    stop = threading.Event()
    normal, zmq = Counter(), Counter()
    threads = [threading.Thread(target=victim.run),
               threading.Thread(target=normal_client, args=(url, model, stop, normal)),
               threading.Thread(target=zmq_client, args=(daemon.endpoint, stop, zmq))]
    for t in threads:
        t.start()
    victim.started.wait(120)
    if attack is None:
        start = time.monotonic()
        time.sleep(args.phase_s)
        outcome: dict[str, Any] = {"start": start, "end": time.monotonic()}
    else:
        outcome = pool.apply(attack, attack_args)
    time.sleep(args.after_s)  # the victim's stream as the attack ends (a stall it caused shows by then)
    stop.set()
    victim.stop.set()
    for t in threads:
        t.join(120)
    start, end = outcome.pop("start"), outcome.pop("end")
    print(f"{name}: {end - start:.0f} s", flush=True)
    return {"seconds": round(end - start, 1), "victim": victim.report(start, end + args.after_s, reference),
            "victim_text": reference or (victim.texts or [None])[0], "normal_client": dict(normal),
            "zmq_client": dict(zmq),
            "attack": outcome, "rss_mb_after": rss_mb(daemon.pid), "prefix_cache_mb_after": prefix_cache_mb(daemon),
            "alive": daemon.proc.poll() is None}


def prefix_cache_mb(daemon: Any) -> float | None:
    """The daemon's prefix cache now (MiB of KV it keeps, within --prefix-cache-mb); None if it cannot say."""
    try:
        with FLyClient(daemon.endpoint, timeout=30, max_retries=0) as client:
            return round(client.status().prompt.cache_bytes / 2**20, 1)
    except FLyError:
        return None


def daemon_flags(args: argparse.Namespace, port: int) -> list[str]:
    """The measured daemon's flags (the HTTP front on `port`)."""
    return ["--http", f"127.0.0.1:{port}", "--heartbeat-timeout", "0",
            "--grammar-cache-mb", str(args.grammar_cache_mb), "--max-grammar-mb", str(args.max_grammar_mb),
            *[flag for name in ("http_header_timeout", "http_body_timeout", "http_keep_alive_timeout",
                                "http_max_connections", "http_max_connections_per_client", "newcomer_rows")
              if getattr(args, name) is not None
              for flag in ("--" + name.replace("_", "-"), str(getattr(args, name)))]]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/attacks"))
    parser.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES)
    parser.add_argument("--phase-s", type=float, default=20.0, help="seconds each timed attack (and the baseline) runs")
    parser.add_argument("--slow-s", type=float, default=75.0, help="seconds the slow connections run (past the body "
                        "timeout)")
    parser.add_argument("--after-s", type=float, default=1.0, help="the victim runs on this long after each attack")
    parser.add_argument("--victim-tokens", type=int, default=200)
    parser.add_argument("--grammars", type=int, default=500)
    parser.add_argument("--sample-every", type=int, default=25)
    parser.add_argument("--idle-connections", type=int, default=10_000)
    parser.add_argument("--slow-connections", type=int, default=200)
    parser.add_argument("--reopen-per-s", type=float, default=500.0,
                        help="the most connections an attacker opens again a second")
    parser.add_argument("--attackers", type=int, default=4, help="threads of the amplification and sampling attacks")
    parser.add_argument("--grammar-cache-mb", type=int, default=256, help="the daemon's (256, its default)")
    parser.add_argument("--max-grammar-mb", type=int, default=64, help="the daemon's (64, its default)")
    for name in ("header-timeout", "body-timeout", "keep-alive-timeout"):
        parser.add_argument(f"--http-{name}", type=float, help="the daemon's (its default if not given)")
    for name in ("max-connections", "max-connections-per-client"):
        parser.add_argument(f"--http-{name}", type=int, help="the daemon's (its default if not given)")
    parser.add_argument("--newcomer-rows", type=int, help="the daemon's (its default if not given)")
    args = parser.parse_args(argv)
    began = time.monotonic()
    port = free_port()
    flags = daemon_flags(args, port)
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="attack-measure-") as tmp:
        dirs = save_tiny_pair(Path(tmp) / "pair", "llama")
        pool = multiprocessing.get_context("spawn").Pool(1)  # the attacks' process, started before any thread
        daemon = start_daemon(*dirs, Path(tmp) / "run", "a", *flags)
        try:
            model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
            httpx.post(f"{url}/v1/completions", timeout=120, json={  # warm-up: the first request's one-time costs
                "model": model, "prompt": VICTIM_PROMPT, "max_tokens": args.victim_tokens, "temperature": 0})
            attacks: dict[str, tuple[Callable[..., dict[str, Any]] | None, tuple]] = {
                "baseline": (None, ()),
                "grammar_flood": (grammar_flood, (url, daemon.endpoint, daemon.pid, args.grammars, args.sample_every)),
                "idle_flood": (idle_flood, (port, args.idle_connections, args.phase_s, args.reopen_per_s)),
                "idle_flood_spread": (idle_flood, (port, args.idle_connections, args.phase_s, args.reopen_per_s,
                                                   SPREAD)),
                "slow_requests": (slow_requests, (port, args.slow_connections, args.slow_s, args.reopen_per_s)),
                "amplification": (amplification, (url, model, args.phase_s, args.attackers)),
                "extreme_sampling": (extreme_sampling, (url, model, args.phase_s, args.attackers))}
            phases: dict[str, Any] = {}
            reference = None
            for label, name in phase_labels(args.phases):
                phases[label] = run_phase(label, *attacks[name], pool, daemon, url, model, args, reference)
                text = phases[label].pop("victim_text")
                reference = text if reference is None else reference
        finally:
            pool.terminate()
            exit_status = daemon.stop()
            log = daemon.output()
    command = shlex.join(["python", "benchmarks/serving/attack_measure.py",
                          *(argv if argv is not None else sys.argv[1:])])
    results = {"command": command, "commit": git_commit() or "unknown", "cpu": cpu_name(),
               "platform": platform.platform(),
               "elapsed_s": round(time.monotonic() - began, 1),
               "settings": vars(args) | {"out": str(args.out), "daemon_flags": flags},
               "daemon_exit_status": exit_status, "daemon_tracebacks": log.count("Traceback"), "phases": phases}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "results.md").write_text(render(results))
    print(render(results))
    return results


if __name__ == "__main__":
    main()
