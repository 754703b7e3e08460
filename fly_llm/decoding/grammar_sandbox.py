"""A sacrificial grammar compiler: untrusted grammars compile first in a worker process (docs/design.md §1.5).

llguidance is native code: a grammar can crash it (a long `$ref` chain overflows its stack) or
make it take too long or too much memory. `GrammarSandbox.check(grammar)` compiles a grammar in a
worker process under a time limit and an address-space limit (RLIMIT_AS) on a thread with a small
stack, and raises BadRequest naming what happened: a compile error, an empty language, a crash, a
timeout, the memory limit. Only grammars that survived there are compiled in the daemon, on a
thread with a stack many times larger (`compile_grammar`, `big_stack_call`).

A worker is `python -m fly_llm.decoding.grammar_sandbox`, started on first use (never forked
from the daemon, which has threads, torch and ZeroMQ); it builds llguidance's view of the
tokenizer once, from the tokenizer's JSON, and is restarted after a crash or a timeout. A sandbox has
`WORKERS` of them (a setting), so one slow grammar holds up only its own compile. A worker that
died by a signal or timed out may have been killed or stopped from outside (an OOM killer, a SIGSTOP),
so the grammar is tried once more in a fresh worker, and that outcome is the verdict. A grammar that
compiles is measured there: the bytes its compiled form keeps (`heap_bytes.kept_bytes`, exact in the
worker), which the daemon's compiled-grammar cache counts and its per-grammar cap judges. Verdicts are
cached by the grammar's hash (within `VERDICT_BYTES`), so a grammar is judged once; a failure that a
fresh worker did not repeat is never kept. Messages are JSON frames
(4-byte length, then UTF-8) on the worker's stdin and stdout; it imports llguidance and nothing else.
"""

from __future__ import annotations

import atexit
import copy
import hashlib
import json
import os
import queue
import re
import resource
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import llguidance

from fly_llm.common.errors import BadRequest, Internal
from fly_llm.common.lru import ENTRY_BYTES, LruCache, text_bytes
from fly_llm.decoding.heap_bytes import kept_bytes

PARSER_LIMITS = dict(max_items_in_row=2_000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                     step_max_items=50_000, max_lexer_states=250_000, max_grammar_size=500_000,
                     precompute_large_lexemes=True, verbose_errors=False)
"""llguidance's limits, passed explicitly wherever a grammar is compiled (its 1.9 defaults, except
that errors do not echo the parser's state). The step limits bound the time of one token mask."""

TIMEOUT_S = 5.0
"""How long the worker may take over one grammar."""
MEMORY_BYTES = 1 << 30
"""Address space the worker may add, beyond what it holds once the tokenizer view is built."""
SANDBOX_STACK_BYTES = 4 << 20
"""The worker compiles on a thread with this stack; the daemon compiles with `BIG_STACK_BYTES`,
so a grammar whose compile recursion fits the worker fits the daemon many times over."""
BIG_STACK_BYTES = 64 << 20
VERDICT_BYTES = 4 << 20
"""Bytes of verdicts (grammar hash -> problem or compiled size) kept, LRU: ~10,000 of them."""
WORKERS = 2
"""Worker processes judging grammars at once (each holds a tokenizer view): one slow grammar holds one."""
START_TIMEOUT_S = 120.0
"""How long the worker may take to start (building the tokenizer view of a large vocabulary)."""

T = TypeVar("T")
Verdict = tuple[str | None, int]
"""A grammar's problem (None: it compiles), and the bytes its compiled form keeps (0 with a problem)."""


def parser_limits() -> llguidance.LLParserLimits:
    """`PARSER_LIMITS` as llguidance's object."""
    return llguidance.LLParserLimits(**PARSER_LIMITS)


def compile_grammar(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    """A matcher at the start of `grammar`, its first mask computed; BadRequest if the grammar does not
    compile or its language is empty (no token may start the output, and the empty output is not in it)."""
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
    if matcher.is_error():
        raise BadRequest(f"the grammar does not compile: {public_message(matcher.get_error())}")
    matcher.compute_bitmask()  # where an empty language shows: the matcher enters an error state
    if matcher.is_error():
        raise BadRequest(f"the grammar's language is empty: no output satisfies it "
                         f"({public_message(matcher.get_error() or 'no error')})")
    return matcher


def public_message(error: str) -> str:
    """What a client may read of an llguidance error: its first line, unless it is a panic or names a
    source file (a Rust panic's text carries build paths), which become one line of ours."""
    first = (error.strip().splitlines() or ["no detail"])[0][:500]
    if _INTERNAL_ERROR.search(first):
        return "an internal error of the grammar engine"
    return first


_INTERNAL_ERROR = re.compile(r"panic|\.rs:\d|/rustc/|\.cargo/|/home/|/src/", re.IGNORECASE)


def big_stack_call(fn: Callable[[], T], stack_bytes: int = BIG_STACK_BYTES) -> T:
    """`fn()` on a new thread with a `stack_bytes` stack (native recursion then has room whatever the
    calling thread's stack); its exception is raised here."""
    result: list[Any] = [None, None]

    def run() -> None:
        try:
            result[0] = fn()
        except BaseException as exc:  # re-raised in the caller
            result[1] = exc

    previous = threading.stack_size(stack_bytes)
    try:
        thread = threading.Thread(target=run, name="grammar-compile", daemon=True)
        thread.start()
    finally:
        threading.stack_size(previous)
    thread.join()
    if result[1] is not None:
        raise result[1]
    return result[0]


def tokenizer_setup(hf_tokenizer, vocab_size: int, eos_ids: list[int]) -> dict:
    """What the worker needs to build llguidance's view of a fast Hugging Face tokenizer."""
    backend = copy.copy(hf_tokenizer.backend_tokenizer)  # as llguidance.hf does: no padding, no truncation
    backend.no_padding()
    backend.no_truncation()
    return {"tokenizer": backend.to_str(), "n_vocab": vocab_size, "eos": list(eos_ids)}


def build_tokenizer(setup: dict) -> llguidance.LLTokenizer:
    """llguidance's view of the tokenizer in `setup` (`tokenizer_setup`)."""
    return llguidance.LLTokenizer(setup["tokenizer"], n_vocab=setup["n_vocab"], eos_token=setup["eos"] or None)


class GrammarSandbox:
    """Worker processes that compile grammars first, under a time and a memory limit.

    Thread-safe: each of `workers` processes judges one grammar at a time, so a slow grammar holds one
    worker while the others judge the rest (started when first needed); cached verdicts answer at once.
    """

    def __init__(self, setup: dict, timeout_s: float = TIMEOUT_S, memory_bytes: int = MEMORY_BYTES,
                 workers: int = WORKERS) -> None:
        self._setup = {**setup, "memory_bytes": memory_bytes}
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self._workers = [_Worker(self) for _ in range(workers)]
        self._idle: queue.LifoQueue[_Worker] = queue.LifoQueue()  # the last used first: the others start late
        for worker in reversed(self._workers):
            self._idle.put(worker)
        self._counts = threading.Lock()
        self._verdicts: LruCache[bytes, Verdict] = LruCache(VERDICT_BYTES, _verdict_bytes)  # sha256 of scope, grammar
        self.starts = 0
        """Worker processes started so far (one more after each crash or timeout)."""
        self.retries = 0
        """Grammars tried a second time, in a fresh worker, after a death by a signal or a timeout."""

    def check(self, grammar: str, scope: str = "") -> int:
        """The bytes `grammar`'s compiled form keeps, if it compiles in a worker to a non-empty language;
        else BadRequest naming the problem (its compile error, an empty language, a crash, a timeout, the
        memory limit). Verdicts are kept per `scope` (a tenant): one tenant's never answers another's at once."""
        key = hashlib.sha256(scope.encode() + b"\0" + grammar.encode()).digest()
        problem, nbytes = self._verdicts.get_or_make(key, lambda: self._verdict(grammar))
        if problem is not None:
            raise BadRequest(problem)
        return nbytes

    def verdict_bytes(self) -> tuple[int, int]:
        """(bytes of the verdicts kept, their budget)."""
        return self._verdicts.bytes, self._verdicts.budget

    def check_invariants(self) -> None:
        """Assert the verdict cache's byte count and budget (`LruCache.check`)."""
        self._verdicts.check()

    def close(self) -> None:
        """Stop the workers, once each is done with its grammar (a later check starts new ones)."""
        workers = [self._idle.get() for _ in self._workers]
        try:
            for worker in workers:
                worker.stop()
        finally:
            for worker in reversed(workers):
                self._idle.put(worker)

    def _verdict(self, grammar: str) -> Verdict:
        """The verdict on a grammar not seen before, from the next idle worker. A worker that died by a signal
        or timed out is replaced and the grammar tried once more; the fresh worker's outcome is the verdict."""
        worker = self._idle.get()
        try:
            verdict, transient = worker.judge(grammar)
            if transient:
                self._count(retries=1)
                verdict, _ = worker.judge(grammar)
            return verdict
        finally:
            self._idle.put(worker)

    def _count(self, starts: int = 0, retries: int = 0) -> None:
        with self._counts:
            self.starts += starts
            self.retries += retries


class _Worker:
    """One worker process of a sandbox (started on first use, restarted after a crash or a timeout); used by one
    thread at a time (the sandbox hands it out)."""

    def __init__(self, sandbox: GrammarSandbox) -> None:
        self.sandbox = sandbox
        self._process: subprocess.Popen | None = None

    def judge(self, grammar: str) -> tuple[Verdict, bool]:
        """This worker's verdict on a grammar, and whether a failure may be the worker's own (it died by a
        signal, or did not answer in time) rather than the grammar's."""
        timeout_s = self.sandbox.timeout_s
        process = self._process if self._process is not None and self._process.poll() is None else self._start()
        _send(process, {"grammar": grammar})
        try:
            reply = _receive(process, time.monotonic() + timeout_s)
        except TimeoutError:
            self.stop()
            return (f"the grammar compiler took longer than {timeout_s:g} s on this grammar", 0), True
        except EOFError:
            problem, transient = self._crashed()
            return (problem, 0), transient
        return (reply.get("problem"), int(reply.get("bytes", 0))), False

    def stop(self) -> None:
        """Kill the process, if any (the next grammar starts a new one)."""
        process, self._process = self._process, None
        if process is not None:
            process.kill()
            process.wait()
            _close_pipes(process)

    def _crashed(self) -> tuple[str, bool]:
        """The outcome of a grammar the worker died compiling, and whether it died by a signal (the worker
        is reaped; the next grammar restarts it). Running out of its memory limit is the grammar's."""
        process, self._process = self._process, None
        code = process.wait()
        stderr = _drain(process.stderr)
        _close_pipes(process)
        if b"memory allocation" in stderr or b"MemoryError" in stderr:
            return (f"the grammar compiler ran out of its memory limit ({self.sandbox.memory_bytes >> 20} MiB) on "
                    f"this grammar"), False
        return f"the grammar compiler crashed on this grammar ({_exit_name(code)})", code < 0

    def _start(self) -> subprocess.Popen:
        """A new process, its tokenizer view built (Internal if it cannot start)."""
        self.stop()
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
               "MALLOC_ARENA_MAX": "1"}  # one heap: RLIMIT_AS then counts what the compile allocates
        process = subprocess.Popen([sys.executable, "-m", "fly_llm.decoding.grammar_sandbox"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, close_fds=True)
        self._process = process
        self.sandbox._count(starts=1)
        _send(process, self.sandbox._setup)
        try:
            _receive(process, time.monotonic() + START_TIMEOUT_S)
        except (TimeoutError, EOFError) as exc:
            self.stop()
            raise Internal(f"the grammar sandbox did not start ({type(exc).__name__})") from None
        return process


_SHARED: dict[tuple, GrammarSandbox] = {}
_SHARED_LOCK = threading.Lock()


def shared_sandbox(setup: dict, timeout_s: float = TIMEOUT_S, memory_bytes: int = MEMORY_BYTES,
                   workers: int = WORKERS) -> GrammarSandbox:
    """The process-wide sandbox for this tokenizer and these limits (engines over one tokenizer share
    its workers and its verdicts); workers stop when the process exits."""
    key = (hashlib.sha256(json.dumps(setup, sort_keys=True).encode()).hexdigest(), timeout_s, memory_bytes, workers)
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = GrammarSandbox(setup, timeout_s, memory_bytes, workers)
        return _SHARED[key]


@atexit.register
def _close_shared() -> None:
    for sandbox in list(_SHARED.values()):
        sandbox.close()


# -- framing -------------------------------------------------------------------------------------

def _send(process: subprocess.Popen, message: dict) -> None:
    data = json.dumps(message).encode()
    try:
        process.stdin.write(struct.pack(">I", len(data)) + data)
        process.stdin.flush()
    except (BrokenPipeError, ValueError):
        pass  # a dead worker: the receive that follows sees EOF


def _receive(process: subprocess.Popen, deadline: float) -> dict:
    """The worker's next message; TimeoutError after `deadline`, EOFError if it died."""
    fd = process.stdout.fileno()
    header = _read_exactly(fd, 4, deadline)
    return json.loads(_read_exactly(fd, struct.unpack(">I", header)[0], deadline))


def _read_exactly(fd: int, n: int, deadline: float) -> bytes:
    poller = select.poll()  # not select.select: the daemon may hold more than 1,024 descriptors (HTTP connections)
    poller.register(fd, select.POLLIN)
    data = b""
    while len(data) < n:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            raise TimeoutError
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def _close_pipes(process: subprocess.Popen) -> None:
    """Close a dead worker's pipes (what was left unsent to it is dropped: closing never raises BrokenPipeError)."""
    for pipe in (process.stdin, process.stdout, process.stderr):
        try:
            pipe.close()
        except BrokenPipeError:  # stdin's buffer held a frame the worker died before reading
            pipe.close()


def _verdict_bytes(key: bytes, verdict: Verdict) -> int:
    return ENTRY_BYTES + text_bytes(key, verdict[0] or "")


def _exit_name(code: int) -> str:
    """'SIGSEGV' for a process killed by signal 11, 'exit 3' for one that exited with status 3."""
    try:
        return signal.Signals(-code).name if code < 0 else f"exit {code}"
    except ValueError:
        return f"signal {-code}"


def _drain(pipe) -> bytes:
    """What a dead worker left on a pipe (its last 64 KiB at most)."""
    os.set_blocking(pipe.fileno(), False)
    try:
        return (pipe.read() or b"")[-65536:]
    except OSError:
        return b""


# -- the worker ------------------------------------------------------------------------------------

def _worker() -> None:
    """The worker's loop: the setup frame, then one verdict per grammar frame until stdin closes."""
    channel = os.fdopen(os.dup(1), "wb")  # the frames; anything else written to stdout goes to stderr
    os.dup2(2, 1)
    source = sys.stdin.buffer

    def read() -> dict | None:
        header = source.read(4)
        return json.loads(source.read(struct.unpack(">I", header)[0])) if len(header) == 4 else None

    def write(message: dict) -> None:
        data = json.dumps(message).encode()
        channel.write(struct.pack(">I", len(data)) + data)
        channel.flush()

    setup = read()
    tokenizer = build_tokenizer(setup)
    _limit_address_space(setup["memory_bytes"])
    write({"ready": True})
    while (message := read()) is not None:
        try:
            grammar = message["grammar"]
            matcher, nbytes = kept_bytes(lambda: compile_grammar(tokenizer, grammar), grammar)
            del matcher
            write({"problem": None, "bytes": nbytes})
        except BadRequest as exc:
            write({"problem": exc.message})


def _limit_address_space(extra: int) -> None:
    """RLIMIT_AS: what the process maps now plus `extra` bytes (Linux; elsewhere no memory limit)."""
    try:
        with open("/proc/self/status") as status:
            size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    except OSError:
        return
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    limit = size + extra if hard == resource.RLIM_INFINITY else min(size + extra, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


if __name__ == "__main__":
    threading.stack_size(SANDBOX_STACK_BYTES)
    worker = threading.Thread(target=_worker, name="grammar-sandbox")
    worker.start()
    worker.join()
