"""Heartbeats: the client tells the daemon which requests it still waits for, and notices a dead daemon.

While requests are open, a small background thread sends `HeartbeatRequest`s (once a second) so
the daemon keeps them; the daemon answers each heartbeat, which is how a client notices a daemon
that hangs (or a peer gone without closing its connection): no answer at all for
`min(timeout, LIVENESS_S)` seconds raises `FLyUnavailable`. A daemon that went away and closed the
connection (its process ended) is noticed sooner, from the socket's monitor (`base.Connection.pump`).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterable

import zmq

from fly_llm.client.sockets import new_socket
from fly_llm.common.errors import FLyUnavailable
from fly_llm.common.protocol import HeartbeatRequest, encode

HEARTBEAT_INTERVAL_S = 1.0
"""How often a client tells the daemon which requests it still waits for."""
LIVENESS_S = 10.0
"""No answer at all from the daemon for this long → FLyUnavailable (at a call's deadline: sooner, see check)."""
_POLL_MS = 100
_IDS_PER_BEAT = 4096


class Heartbeat:
    """Tells the daemon once a second which requests this client still waits for, and notes when it answered.

    Runs in its own daemon thread with its own socket while requests are open (so a consumer that
    is slow to read a stream does not lose it); the thread ends after a while with nothing open,
    or on `close`, and a later `add` starts a fresh one.
    """

    def __init__(self, endpoint: str) -> None:
        self._endpoint = endpoint
        self._ids: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop: threading.Event | None = None
        self._kick = threading.Event()
        self.last_heard = 0.0

    def add(self, ids: Iterable[str]) -> None:
        """Start heartbeating for `ids`."""
        with self._lock:
            for rid in ids:
                self._ids[rid] = self._ids.get(rid, 0) + 1
            if self._stop is None:
                self._stop = threading.Event()
                threading.Thread(target=self._run, args=(self._stop,), name="fly-heartbeat", daemon=True).start()
        self._kick.set()  # beat now: the daemon's answer shows it is there

    def discard(self, ids: Iterable[str]) -> None:
        """Stop heartbeating for `ids`."""
        with self._lock:
            for rid in ids:
                left = self._ids.pop(rid, 1) - 1
                if left > 0:
                    self._ids[rid] = left

    def heard(self) -> None:
        """The daemon answered something just now."""
        self.last_heard = time.monotonic()

    def check(self, since: float, deadline: float, now: float) -> None:
        """Raise FLyUnavailable when the daemon, asked at `since`, has been silent for LIVENESS_S by `now`, or at
        the `deadline` when it never answered or its heartbeats went unanswered (gone, not slow)."""
        silent = now - max(self.last_heard, since)
        gone_at_deadline = now >= deadline and (self.last_heard < since or silent > 3 * HEARTBEAT_INTERVAL_S)
        if silent > LIVENESS_S or gone_at_deadline:
            raise FLyUnavailable(f"no answer from a fly-daemon at {self._endpoint} for {silent:.1f} s")

    def close(self) -> None:
        """Stop the thread."""
        with self._lock:
            if self._stop is not None:
                self._stop.set()
                self._stop = None

    def _run(self, stop: threading.Event) -> None:
        sock = new_socket(zmq.Context.instance(), self._endpoint)
        idle = 0
        try:
            while not stop.is_set():
                with self._lock:
                    ids = list(self._ids)
                    idle = 0 if ids else idle + 1
                    if idle > 30 and self._stop is stop:
                        self._stop = None
                        return
                for start in range(0, len(ids), _IDS_PER_BEAT):
                    beat = HeartbeatRequest(id=f"hb-{uuid.uuid4().hex}", ids=ids[start:start + _IDS_PER_BEAT])
                    try:
                        sock.send(encode(beat), zmq.NOBLOCK)
                    except zmq.Again:
                        pass
                self._kick.clear()
                deadline = time.monotonic() + HEARTBEAT_INTERVAL_S
                while (left := deadline - time.monotonic()) > 0 and not stop.is_set() and not self._kick.is_set():
                    if sock.poll(min(_POLL_MS, int(left * 1000) + 1)):
                        sock.recv()
                        self.heard()
        finally:
            sock.close(0)
