"""The ZeroMQ side of the clients: a DEALER socket to the daemon (CURVE keys from the environment)."""

from __future__ import annotations

import asyncio
import os
from contextlib import suppress

import zmq
import zmq.asyncio
import zmq.auth
from pydantic import BaseModel

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


def send(sock: zmq.Socket | zmq.asyncio.Socket, message: BaseModel) -> None:
    """Queue one frame without ever blocking; a full queue means nobody is reading it.

    Works on asyncio sockets too: with NOBLOCK pyzmq sends at once and returns a finished future.
    """
    try:
        sent = sock.send(encode(message), zmq.NOBLOCK)
        if isinstance(sent, asyncio.Future):
            sent.result()
    except zmq.Again:
        raise FLyUnavailable(f"cannot queue a request to {sock.getsockopt_string(zmq.LAST_ENDPOINT)}") from None


def cancel(sock: zmq.Socket | zmq.asyncio.Socket, ids: list[str]) -> None:
    """Best effort: tell the daemon to drop requests this client left before they finished."""
    for rid in ids:
        with suppress(zmq.ZMQError, FLyUnavailable):
            send(sock, CancelRequest(id=rid))
