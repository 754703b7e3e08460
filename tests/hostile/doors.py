"""Send hostile `Case`s to a daemon subprocess through its two doors and judge what comes back.

`FuzzTarget` owns a tiny daemon (ZeroMQ on ipc, the HTTP front on loopback, which it trusts as a proxy, so
the forwarded headers a case carries are parsed and name its client), restarts it when a case killed it,
and checks after a batch that exact mode still equals the target's own greedy output: a victim's request,
from a client no forwarded header can name (a loopback connection without a key). `ZmqDoor` sends raw
frames on a fresh DEALER socket (the client library would refuse much of this before it left), `HttpDoor`
posts OpenAI-shaped bodies (to /tokenize and /detokenize too) with the case's header lines.
Each `send` returns an `Outcome` ("served" or "refused" with its code) or raises `Finding`: a death, a
hang, a code outside `STOP_CODES` (INTERNAL included), an HTTP 5xx or a body not in the route's API's error
shape (Ollama's under /api), a served answer without all its choices (or its vectors), or an empty language
that was served. The daemon also serves a tiny embedding model (tests/support/tiny_embedder.py).
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import httpx
import torch
import zmq
from transformers import AutoModelForCausalLM, AutoTokenizer

from fly_llm.client import FLyClient, build_options
from fly_llm.common.errors import FLyError
from hostile.strategies import EMBEDDING_MODEL, STOP_CODES, Case
from support.daemon_process import DaemonProcess, free_port, start_daemon
from support.tiny_embedder import save_tiny_embedder
from support.tiny_models import greedy_tokens

REQUEST_TIMEOUT_S = 30.0
"""A case with no answer after this long is a hang."""
EXACT_PROMPT = "The quick brown fox"
EXACT_TOKENS = 16
HTTP_FLY_KEYS = ("k", "window", "entropy_threshold", "loose", "nonsense")
"""The FLy options the HTTP body carries (extra body fields), plus one unknown key."""
TERMINAL = frozenset({"result", "error", "health", "tokenize", "info", "status"})


class Finding(AssertionError):
    """What a hostile case did to the daemon; `kind`: crash, hang, bad_answer (outside the rules) or exact
    (exact mode no longer equals greedy)."""

    def __init__(self, message: str, kind: str = "bad_answer") -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Outcome:
    """How the daemon answered one case: served, or refused with a stable code."""

    verdict: Literal["served", "refused"]
    code: str | None = None


def greedy_reference(target_dir):
    """greedy(prompt, n) -> the target's own greedy continuation (float32, cut after EOS), cached."""
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)

    @lru_cache(maxsize=None)
    def greedy(prompt: str, max_new: int) -> list[int]:
        return greedy_tokens(target, tokenizer.encode(prompt), max_new, [tokenizer.eos_token_id])

    return greedy


class FuzzTarget:
    """A tiny daemon subprocess under fuzzing, with both doors open; restarted when a case kills it."""

    def __init__(self, target_dir: Path, draft_dir: Path, workdir: Path, greedy: Callable[[str, int], list[int]]):
        self.dirs = (target_dir, draft_dir)
        self.workdir = workdir
        self.greedy = greedy
        self.daemon: DaemonProcess | None = None
        self.http_url = ""
        self.model = ""
        self.starts = 0
        self.suspect = False
        """A case failed on it: restart before the next one (it may be hung rather than dead)."""

    def start(self) -> None:
        """Start (or restart) the daemon and wait until both doors answer."""
        if self.daemon is not None:
            self.daemon.kill()
        port = free_port()
        self.starts += 1
        encoder = self.workdir / EMBEDDING_MODEL
        if not encoder.exists():
            save_tiny_embedder(encoder)
        self.daemon = start_daemon(*self.dirs, self.workdir / f"run{self.starts}", "h", "--http",
                                   f"127.0.0.1:{port}", "--heartbeat-timeout", "0", "--embedding-model", str(encoder),
                                   "--trusted-proxies", "127.0.0.1")
        self.http_url = f"http://127.0.0.1:{port}"
        self.model = httpx.get(f"{self.http_url}/v1/models", timeout=10).json()["data"][0]["id"]

    def ensure_running(self) -> None:
        """Restart the daemon if it is not running or a previous case left it suspect."""
        if self.daemon is None or self.suspect or self.daemon.proc.poll() is not None:
            self.suspect = False
            self.start()

    def stop(self) -> int | None:
        """Stop the daemon; its exit status."""
        return None if self.daemon is None else self.daemon.stop()

    @property
    def endpoint(self) -> str:
        return self.daemon.endpoint

    def alive(self) -> None:
        """Raise Finding unless the process runs and answers a health request as ready."""
        if self.daemon.proc.poll() is not None:
            raise Finding(f"the daemon died (exit status {self.daemon.proc.returncode}); its log ends:\n"
                          f"{self.log_tail()}", "crash")
        try:
            with FLyClient(self.endpoint, timeout=5.0, max_retries=0) as client:
                health = client.health()
        except FLyError as exc:
            raise Finding(f"the daemon stopped answering health requests ({exc}); its log ends:\n"
                          f"{self.log_tail()}", "hang") from None
        if health.state != "ready":
            raise Finding(f"the daemon is {health.state} ({health.detail}); its log ends:\n{self.log_tail()}",
                          "crash")

    def check_exact(self) -> None:
        """Raise Finding unless exact mode over both doors equals the target's own greedy output."""
        sampling, fly = build_options(max_tokens=EXACT_TOKENS, temperature=0.0, loose=False)
        try:
            with FLyClient(self.endpoint, timeout=REQUEST_TIMEOUT_S, max_retries=0) as client:
                result = client.generate(EXACT_PROMPT, sampling, fly)
        except FLyError as exc:
            raise Finding(f"exact mode over ZeroMQ failed: {exc}; the daemon's log ends:\n{self.log_tail()}",
                          "exact") from None
        expected = self.greedy(EXACT_PROMPT, EXACT_TOKENS)
        if result.token_ids != expected:
            raise Finding(f"exact mode over ZeroMQ gave {result.token_ids}, the target's greedy {expected}", "exact")
        body = {"model": self.model, "prompt": EXACT_PROMPT, "max_tokens": EXACT_TOKENS, "temperature": 0,
                "loose": False}
        answer = httpx.post(f"{self.http_url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
        text = answer.json()["choices"][0]["text"] if answer.status_code == 200 else answer.text
        if text != result.text:
            raise Finding(f"exact mode over HTTP gave {text!r}, over ZeroMQ {result.text!r}", "exact")

    def log_tail(self, chars: int = 3000) -> str:
        return self.daemon.output()[-chars:]

    def died(self, wait: float = 0.0) -> bool:
        """Whether the daemon process has exited (waiting up to `wait` s for it to)."""
        try:
            self.daemon.proc.wait(wait)
        except subprocess.TimeoutExpired:
            return False
        return True


def run_case(target: FuzzTarget, door: ZmqDoor | HttpDoor, case: Case, dump: Path | None = None) -> Outcome:
    """Send `case` through `door`, then check the daemon is alive; on a Finding, name the case (its whole
    body written to `dump`) and leave the target to be restarted."""
    target.ensure_running()
    try:
        outcome = door.send(case)
        target.alive()
    except Finding as exc:
        target.suspect = True
        where = ""
        if dump is not None:
            dump.write_text(repr(case.frame) if case.frame is not None else json.dumps(case.request))
            where = f" (whole body: {dump})"
        raise Finding(f"{door.name} door, {case!r}{where}:\n{exc}", exc.kind) from None
    return outcome


def judge(case: Case, outcome: Outcome) -> Outcome:
    """Raise Finding if a served case had to be refused or a refusal's code is not a stable one."""
    if outcome.verdict == "refused" and outcome.code not in STOP_CODES:
        raise Finding(f"refused with {outcome.code}, not one of {STOP_CODES}")
    if outcome.verdict == "served" and case.must_refuse:
        raise Finding(f"served a request whose language is empty: {outcome}")
    return outcome


class ZmqDoor:
    """Cases as raw frames on a fresh DEALER socket per case."""

    name = "zmq"

    def __init__(self, target: FuzzTarget) -> None:
        self.target = target
        self.context = zmq.Context.instance()

    def send(self, case: Case) -> Outcome:
        """Send one case, wait for its final reply; raise Finding on death, hang or a bad answer."""
        rid = f"h-{uuid.uuid4().hex[:12]}"
        frame = case.frame if case.frame is not None else json.dumps(
            {"v": 1, "id": rid, "kind": "generate", **case.request}).encode()
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.target.endpoint)
        try:
            sock.send_multipart([frame, frame] if case.multipart else [frame])
            return judge(case, self._final(sock, case))
        finally:
            sock.close(0)

    def _final(self, sock: zmq.Socket, case: Case) -> Outcome:
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.target.died():
                raise Finding("the daemon died on this case", "crash")
            if not sock.poll(200):
                continue
            raw = sock.recv()
            try:
                reply = json.loads(raw)
            except ValueError:
                raise Finding(f"an unreadable reply: {raw[:300]!r}") from None
            kind = reply.get("kind")
            if kind == "error":
                return Outcome("refused", reply.get("code"))
            if kind in TERMINAL:
                return Outcome("served")
        raise Finding(f"no final reply within {REQUEST_TIMEOUT_S} s (a hang)", "hang")


class HttpDoor:
    """Cases as POSTs to /v1/chat/completions (messages) or /v1/completions (a prompt), raw frames as bodies,
    a case with a route of its own (/tokenize, /detokenize, /infill, the embedding routes) there as it is."""

    name = "http"

    def __init__(self, target: FuzzTarget) -> None:
        self.target = target

    def send(self, case: Case) -> Outcome:
        """Post one case and read its answer (a stream to its end); raise Finding on a bad one."""
        path, content = self._body(case)
        url = f"{self.target.http_url}{path}"
        headers = [("content-type", b"application/json"), *case.headers]
        try:
            with httpx.stream("POST", url, content=content, headers=headers, timeout=REQUEST_TIMEOUT_S) as response:
                if response.status_code == 200 and response.headers.get("content-type", "").startswith(
                        "text/event-stream"):
                    return judge(case, _stream_outcome(response, _asked_choices(case)))
                response.read()
        except httpx.TimeoutException:
            raise Finding(f"no answer within {REQUEST_TIMEOUT_S} s (a hang)", "hang") from None
        except httpx.TransportError as exc:
            kind = "crash" if self.target.died(2.0) else "bad_answer"
            raise Finding(f"the connection failed ({exc!r})", kind) from None
        return judge(case, _plain_outcome(response, case))

    def _body(self, case: Case) -> tuple[str, bytes]:
        if case.frame is not None:
            return "/v1/chat/completions", case.frame
        if case.route is not None:
            return case.route, json.dumps(case.request).encode()
        request = dict(case.request)
        body: dict[str, Any] = {"model": self.target.model, **request.pop("sampling", {})}
        body |= {key: value for key, value in request.pop("fly", {}).items() if key in HTTP_FLY_KEYS}
        request.pop("timeout_s", None)
        body |= request
        return ("/v1/chat/completions" if "messages" in body else "/v1/completions"), json.dumps(body).encode()


def _error_code(body: Any) -> str | None:
    """The `code` of OpenAI's error shape {"error": {"message", "type", "param", "code"}}, else None."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error):
        return error["code"]
    return None


def ollama_error_code(body: Any) -> str | None:
    """The `code` of our Ollama error shape {"error": str, "code": str}, else None."""
    if isinstance(body, dict) and isinstance(body.get("error"), str) and isinstance(body.get("code"), str):
        return body["code"]
    return None


def plain_outcome(response: httpx.Response, error_code: Callable[[Any], str | None], served: Callable[[Any], bool],
                  missing: str, shape: str) -> Outcome:
    """A whole (unstreamed) HTTP answer judged: served when `served(body)`, refused when `error_code(body)`
    finds our stable code in `shape`'s error shape; Finding for a 5xx (but 503/504), a body that is not
    JSON, a 200 `missing` its answer or an error in another shape."""
    if response.status_code >= 500 and response.status_code not in (503, 504):
        raise Finding(f"HTTP {response.status_code}: {response.text[:500]}")
    try:
        body = response.json()
    except ValueError:
        raise Finding(f"HTTP {response.status_code} with a body that is not JSON: {response.text[:300]!r}") from None
    if response.status_code == 200:
        if not served(body):
            raise Finding(f"HTTP 200 without {missing}: {response.text[:300]}")
        return Outcome("served")
    code = error_code(body)
    if code is None:
        raise Finding(f"HTTP {response.status_code} not in {shape}'s error shape: {response.text[:300]}")
    return Outcome("refused", code)


ROUTE_ANSWERS = {"/tokenize": ("tokens", list), "/detokenize": ("content", str), "/infill": ("content", str),
                 "/completion": ("content", str),
                 "/v1/embeddings": ("data", list), "/api/embed": ("embeddings", list),
                 "/api/embeddings": ("embedding", list)}
"""What a served answer of a route of its own holds: (field, type)."""


def _asked_choices(case: Case) -> int | None:
    """The `n` a generation case asks for (1 if it names none); None if it is not an int (pydantic may coerce it)."""
    n = case.request.get("n", 1)
    return n if type(n) is int else None


def _plain_outcome(response: httpx.Response, case: Case) -> Outcome:
    if case.route is not None:
        key, kind = ROUTE_ANSWERS[case.route]
        ollama = case.route.startswith("/api/")
        return plain_outcome(response, ollama_error_code if ollama else _error_code,
                             lambda body: isinstance(body, dict) and isinstance(body.get(key), kind), key,
                             "Ollama" if ollama else "OpenAI")
    return plain_outcome(response, _error_code, lambda body: _all_choices(body, _asked_choices(case)),
                         "its choices indexed 0..n-1", "OpenAI")


def _all_choices(body: Any, asked: int | None) -> bool:
    """Whether a whole answer holds its choices, indexed 0..n-1 (n as asked, if known)."""
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or not choices:
        return False
    return [c.get("index") for c in choices] == list(range(asked or len(choices)))


def _stream_outcome(response: httpx.Response, asked: int | None) -> Outcome:
    """A stream judged: served when it ends with [DONE] after each choice (0..n-1, n as asked if known) has
    finished, refused by an error event; Finding otherwise."""
    last, finished = None, set()
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            if not finished or finished != set(range(asked or len(finished))):
                raise Finding(f"the stream ended with its choices {sorted(finished)} finished, {asked} asked")
            return Outcome("served")
        last = json.loads(data)
        code = _error_code(last)
        if code is not None:
            return Outcome("refused", code)
        finished |= {c.get("index") for c in last.get("choices", ()) if c.get("finish_reason")}
    raise Finding(f"the stream ended without [DONE] or an error event; last event: {str(last)[:300]}")
