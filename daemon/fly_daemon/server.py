"""The daemon's socket loop: a ZeroMQ ROUTER in front, the scheduler's model thread behind.

The loop never waits on the model: it parses frames, answers health/info/status itself, hands
generate/cancel/heartbeat/tokenize to the scheduler, and forwards what the model thread emits
(over an inproc PUSH/PULL pair) to the clients. A malformed frame gets an ErrorReply and changes
nothing else; any other failure while handling one frame answers INTERNAL (the traceback goes to
the log) and the loop goes on. A client whose socket is gone (ROUTER_MANDATORY send fails) loses
its requests. Over CURVE each client key is its own tenant (prefix-cache scope) and its own client (what
the per-client caps count, over all of that key's sockets); everything else is the one local tenant, and each
socket its own client (fly_daemon.client_identity).
The scheduler, its model thread and the in-process client (the HTTP front's) are a ServingCore's
(fly_daemon.core): the loop is that core's `remote`, so replies to socket clients come here and
replies to requests from inside the process go back to them.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import zmq
import zmq.auth
from pydantic import BaseModel
from zmq.auth.thread import ThreadAuthenticator

import fly_llm
from fly_llm.common.config import SamplingParams
from fly_llm.common.errors import BadRequest, Cancelled, FLyError, Internal, NotReady
from fly_llm.common.json_text import loads
from fly_llm.common.protocol import (
    MAX_FRAME_BYTES, UNKNOWN_ID, CancelRequest, ErrorReply, GenerateRequest, HealthReply, HealthRequest,
    HeartbeatRequest, InfoReply, InfoRequest, StatusReply, StatusRequest, TokenizeRequest, decode_request, encode,
)

from fly_daemon.client_identity import LOCAL_TENANT, zmq_client
from fly_daemon.runtime import PidLock, check_endpoint, ipc_path, is_loopback
from fly_daemon.scheduling.scheduler import Envelope

if TYPE_CHECKING:
    from fly_daemon.core import ServingCore

log = logging.getLogger("fly_daemon")

_POLL_MS = 100
_MAX_READS_PER_POLL = 1000
_RCVHWM = 16
"""Frames one peer may have queued in libzmq before it stops reading from that peer (its sends then block):
with MAXMSGSIZE = max_frame_bytes, at most 16 × 4 MiB per peer by default."""
_SNDHWM = 1000
"""Replies queued for one peer that is not reading; beyond, it counts as gone and its requests are cancelled.
Replies are only made for a peer's own requests (at most max_requests_per_client), each a few tokens
per step, so a lower mark would only cancel the streams of a client that paused a moment."""


@dataclass(frozen=True)
class CurveKeys:
    """CURVE encryption for a tcp endpoint: the server's secret certificate and the allowed clients' dir."""

    server_secret_file: Path
    clients_dir: Path


class Server:
    """Binds the endpoint, starts `core`'s model thread, serves its scheduler over the socket until drained."""

    def __init__(self, endpoint: str, core: "ServingCore", *, max_frame_bytes: int = MAX_FRAME_BYTES,
                 curve: CurveKeys | None = None) -> None:
        check_endpoint(endpoint)
        if not is_loopback(endpoint) and curve is None:
            raise ValueError(f"refusing to bind {endpoint} (not loopback) without CURVE keys "
                             "(--curve-secret-key and --curve-clients)")
        self.endpoint = endpoint
        self.core = core
        self.scheduler = core.scheduler
        core.remote = self._push
        self.max_frame_bytes = max_frame_bytes
        self.started = time.time()
        self._curve = curve
        self._ctx = zmq.Context()
        self._outbox = f"inproc://fly-outbox-{id(self)}"
        self._local = threading.local()
        self._stop_requests = 0
        self._lock = PidLock(endpoint)
        self._socket_file: Path | None = None

    # ---- lifecycle ----

    def request_stop(self) -> None:
        """Begin a graceful stop (signal-safe); a second request cancels running work at once."""
        self._stop_requests += 1

    def _push(self, envelope: Envelope, message: BaseModel) -> None:
        """Send `message` to a socket client from any thread (through the outbox the loop forwards)."""
        push = getattr(self._local, "push", None)
        if push is None:
            push = self._ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)
            push.connect(self._outbox)
            self._local.push = push
        push.send_multipart([*envelope, encode(message)])

    def serve(self) -> int:
        """Bind, load models, serve until stopped; return the exit status (1 if models failed to load)."""
        self._lock.acquire()
        router = pull = None
        auth = None
        try:
            pull = self._ctx.socket(zmq.PULL)
            pull.setsockopt(zmq.RCVHWM, 0)
            pull.bind(self._outbox)
            router, auth = self._bind()
            log.info("listening on %s (pid %d)", self.endpoint, os.getpid())
            self.core.start(on_exit=self._close_push)
            self._loop(router, pull)
            return 1 if self.scheduler.state == "failed" else 0
        finally:
            for sock in (router, pull):
                if sock is not None:
                    sock.close(linger=1000)
            if auth is not None:
                auth.stop()
            if self._socket_file is not None:
                self._socket_file.unlink(missing_ok=True)
            self._lock.release()
            self._ctx.destroy(linger=0)  # closed sockets keep their own linger; this ends the rest
            log.info("stopped")

    def _close_push(self) -> None:
        """Close this thread's outbox socket (the model thread's, as it ends)."""
        push = getattr(self._local, "push", None)
        if push is not None:
            push.close(linger=1000)

    def _bind(self) -> tuple[zmq.Socket, ThreadAuthenticator | None]:
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)  # a larger frame: zmq drops the peer
        router.setsockopt(zmq.RCVHWM, _RCVHWM)
        router.setsockopt(zmq.SNDHWM, _SNDHWM)
        router.setsockopt(zmq.LINGER, 1000)
        auth = None
        if self._curve is not None:
            auth = ThreadAuthenticator(self._ctx)
            auth.start()
            auth.configure_curve(domain="*", location=str(self._curve.clients_dir))
            public, secret = zmq.auth.load_certificate(self._curve.server_secret_file)
            if secret is None:
                raise ValueError(f"{self._curve.server_secret_file} holds no secret key")
            router.curve_publickey, router.curve_secretkey, router.curve_server = public, secret, True
        sock_path = ipc_path(self.endpoint)
        if sock_path is not None:
            sock_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            _remove_stale_socket(sock_path)
        mask = os.umask(0o177) if sock_path is not None else None  # the socket file is born 0600
        try:
            router.bind(self.endpoint)
        except zmq.ZMQError as exc:
            raise OSError(f"cannot bind {self.endpoint}: {exc}") from None
        finally:
            if mask is not None:
                os.umask(mask)
        self._socket_file = sock_path
        return router, auth

    def _loop(self, router: zmq.Socket, pull: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        stops_seen = 0
        while True:
            events = dict(poller.poll(_POLL_MS))
            if pull in events:
                self._forward(router, pull)
            if router in events:
                for _ in range(_MAX_READS_PER_POLL):
                    try:
                        frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(router, frames)
            if self.scheduler.model is None:
                self.scheduler.expire_queued()
            if self._stop_requests > stops_seen:
                stops_seen = self._stop_requests
                if self.scheduler.model is None:
                    log.info("stop requested while loading: exiting")
                    self.scheduler.drain()
                    self.scheduler.abandon_queue(Cancelled("the daemon is stopping"))
                    self._forward(router, pull)
                    return
                log.info("draining: no new requests; running ones get %.0f s",
                         self.scheduler.limits.drain_timeout)
                self.scheduler.drain(force=stops_seen > 1)
            if not self.core.running():
                self._forward(router, pull)
                return

    # ---- replies to clients ----

    def _forward(self, router: zmq.Socket, pull: zmq.Socket) -> None:
        while True:
            try:
                frames = pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._send(router, tuple(frames[:-1]), frames[-1])

    def _send(self, router: zmq.Socket, envelope: Envelope, payload: bytes) -> None:
        try:
            router.send_multipart([*envelope, payload], zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError) as exc:  # gone (EHOSTUNREACH) or not reading (queue full)
            log.info("client unreachable (%s): cancelling its requests", exc)
            self.scheduler.client_gone(envelope)

    def _reply(self, router: zmq.Socket, envelope: Envelope, message: BaseModel) -> None:
        self._send(router, envelope, encode(message))

    def _error(self, router: zmq.Socket, envelope: Envelope, rid: str, error: FLyError) -> None:
        self._reply(router, envelope, ErrorReply(id=rid, code=error.code, message=error.message))

    # ---- requests from clients ----

    def _handle(self, router: zmq.Socket, frames: list[zmq.Frame]) -> None:
        """Answer one incoming message; malformed input gets BAD_REQUEST, any other failure INTERNAL, and
        nothing else happens (the loop goes on)."""
        parts = [frame.bytes for frame in frames]
        if len(parts) == 2 or (len(parts) == 3 and parts[1] == b""):  # DEALER, or REQ with its delimiter
            envelope, payload = tuple(parts[:-1]), parts[-1]
        else:
            self._error(router, (parts[0],), UNKNOWN_ID, BadRequest("expected exactly one frame per message"))
            return
        try:
            self._answer(router, envelope, payload, _tenant(frames[-1]))
        except Exception:  # noqa: BLE001 - one frame's failure must not stop the loop
            log.exception("unexpected error handling a frame from %r", envelope)
            self._error(router, envelope, self._readable_id(payload),
                        Internal("unexpected error handling this request (see the daemon's log)"))

    def _answer(self, router: zmq.Socket, envelope: Envelope, payload: bytes, tenant: str) -> None:
        try:
            message = decode_request(payload, self.max_frame_bytes)
        except BadRequest as exc:
            self._error(router, envelope, self._readable_id(payload), exc)
            return
        try:
            self._dispatch(router, envelope, message, tenant)
        except FLyError as exc:
            self._error(router, envelope, message.id, exc)

    def _dispatch(self, router: zmq.Socket, envelope: Envelope, message: BaseModel, tenant: str) -> None:
        scheduler = self.scheduler
        if isinstance(message, GenerateRequest):
            scheduler.submit(envelope, message, tenant=tenant, client=zmq_client(tenant))
        elif isinstance(message, CancelRequest):
            if not scheduler.cancel(envelope, message.id):
                raise BadRequest(f"no request {message.id!r} in flight to cancel")
        elif isinstance(message, HeartbeatRequest):
            scheduler.touch(envelope, message.ids, tenant=tenant)
            self._reply(router, envelope, HealthReply(id=message.id, state=scheduler.state,
                                                      detail=scheduler.detail))
        elif isinstance(message, HealthRequest):
            self._reply(router, envelope, HealthReply(id=message.id, state=scheduler.state,
                                                      detail=scheduler.detail))
        elif isinstance(message, InfoRequest):
            self._reply(router, envelope, self._info(message.id))
        elif isinstance(message, StatusRequest):
            self._reply(router, envelope, self._status(message.id))
        elif isinstance(message, TokenizeRequest):
            scheduler.tokenize(envelope, message)

    def _readable_id(self, payload: bytes) -> str:
        """The request id of a malformed frame if one can be read cheaply, else UNKNOWN_ID."""
        if len(payload) > self.max_frame_bytes:
            return UNKNOWN_ID
        try:
            rid = loads(payload).get("id")
        except (ValueError, AttributeError):  # not JSON, or not an object
            return UNKNOWN_ID
        return rid if isinstance(rid, str) and 0 < len(rid) <= 128 else UNKNOWN_ID

    def _info(self, rid: str) -> InfoReply:
        model = self.scheduler.model
        if model is None:
            raise NotReady(f"the daemon is {self.scheduler.state}")
        limits = self.scheduler.limits
        return InfoReply(
            id=rid, version=fly_llm.__version__, target=model.name, draft=model.draft,
            context_window=model.context_window, max_tokens_limit=limits.max_tokens_limit,
            max_prompt_tokens=limits.max_prompt_tokens or model.context_window - 1,
            device=model.device, dtype=model.dtype,
            target_quantization=model.quantization, draft_quantization=model.draft_quantization,
            fly_defaults=model.fly_defaults, sampling_defaults=SamplingParams(),
            chat_template=bool(model.chat_template), fill_in_middle=model.fim is not None)

    def _status(self, rid: str) -> StatusReply:
        model = self.scheduler.model
        return StatusReply(
            id=rid, state=self.scheduler.state, pid=os.getpid(), uptime_s=time.time() - self.started,
            target=model.name if model else None, draft=model.draft if model else None,
            **self.scheduler.snapshot())


def _tenant(frame: zmq.Frame) -> str:
    """Whose credential a frame came with: "curve:" + the client's z85 public key (the ZAP User-Id
    pyzmq's authenticator sets), else the one local tenant (ipc, loopback tcp without CURVE)."""
    try:
        user_id = frame.get("User-Id")
    except zmq.ZMQError:  # no ZAP handler on this socket
        return LOCAL_TENANT
    return f"curve:{user_id}" if user_id else LOCAL_TENANT


def _remove_stale_socket(path: Path) -> None:
    """Delete a crashed daemon's socket file at `path` (we hold the endpoint's lock); refuse any other file."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(f"cannot bind {path}: it exists and is not a socket (remove it or choose another endpoint)")
    log.warning("removing stale socket %s", path)
    path.unlink()
