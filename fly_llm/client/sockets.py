"""The ZeroMQ side of the clients: a DEALER socket to the daemon (CURVE keys from the environment), and a
monitor of it that tells when the daemon's end of the connection dropped (the daemon stopped, was killed or
crashed: its kernel closed the connection)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from contextlib import suppress
from typing import Any

import zmq
import zmq.asyncio
import zmq.auth
from pydantic import BaseModel
from zmq.utils.monitor import parse_monitor_message

from fly_llm.common.errors import FLyUnavailable
from fly_llm.common.protocol import CancelRequest, encode


def new_socket(context: zmq.Context, endpoint: str) -> zmq.Socket:
    """A DEALER socket connected to `endpoint`, with CURVE keys from the environment when set.

    $FLY_CURVE_SERVER_KEY: the daemon's public certificate file; $FLY_CURVE_CLIENT_CERT: this
    client's secret certificate file (both made with zmq.auth.create_certificates).
    """
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    server_key = os.environ.get("FLY_CURVE_SERVER_KEY")
    if server_key:
        public, secret = zmq.auth.load_certificate(os.environ["FLY_CURVE_CLIENT_CERT"])
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_serverkey = zmq.auth.load_certificate(server_key)[0]
    sock.connect(endpoint)
    return sock


def watch(sock: zmq.Socket | zmq.asyncio.Socket) -> zmq.Socket | zmq.asyncio.Socket:
    """A monitor of `sock` (a PAIR socket of the same kind) that reports each connection that dropped."""
    return sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)


def readable(sock: zmq.Socket | zmq.asyncio.Socket,
             monitor: zmq.Socket | zmq.asyncio.Socket) -> zmq.Poller | zmq.asyncio.Poller:
    """A poller (of the sockets' kind: blocking or asyncio) for frames on `sock` and events on its `monitor`."""
    poller = zmq.asyncio.Poller() if isinstance(sock, zmq.asyncio.Socket) else zmq.Poller()
    for watched in (sock, monitor):
        poller.register(watched, zmq.POLLIN)
    return poller


def close(sock: zmq.Socket | zmq.asyncio.Socket, monitor: zmq.Socket | zmq.asyncio.Socket) -> None:
    """Close `sock` and its `monitor` (from `watch`)."""
    if not sock.closed:
        sock.disable_monitor()
        sock.close(0)
    monitor.close(0)


def dropped(monitor: zmq.Socket | zmq.asyncio.Socket) -> bool:
    """Whether a connection dropped since the last look (reads every event `monitor` has queued)."""
    events = [parse_monitor_message(frames)["event"] for frames in _queued(monitor.recv_multipart)]
    return zmq.EVENT_DISCONNECTED in events


def arrived(sock: zmq.Socket | zmq.asyncio.Socket) -> list[bytes]:
    """Every frame queued on `sock` now, without waiting."""
    return list(_queued(sock.recv))


def _queued(recv: Callable[[int], Any]) -> Iterator[Any]:
    """What `recv` (a socket's recv or recv_multipart) returns with NOBLOCK, until nothing is queued."""
    while True:
        try:
            yield _done(recv(zmq.NOBLOCK))
        except zmq.Again:
            return


def _done(value: Any) -> Any:
    """The value of a NOBLOCK call: pyzmq's asyncio sockets make it at once and return it as a finished future."""
    return value.result() if isinstance(value, asyncio.Future) else value


def send(sock: zmq.Socket | zmq.asyncio.Socket, message: BaseModel) -> None:
    """Queue one frame without ever blocking; a full queue means nobody is reading it (asyncio sockets too)."""
    try:
        _done(sock.send(encode(message), zmq.NOBLOCK))
    except zmq.Again:
        raise FLyUnavailable(f"cannot queue a request to {sock.getsockopt_string(zmq.LAST_ENDPOINT)}") from None


def cancel(sock: zmq.Socket | zmq.asyncio.Socket, ids: list[str]) -> None:
    """Best effort: tell the daemon to drop requests this client left before they finished."""
    for rid in ids:
        with suppress(zmq.ZMQError, FLyUnavailable):
            send(sock, CancelRequest(id=rid))
