"""Who a request comes from: the client that the per-client caps and fairness count by (issue 45).

The scheduler counts `max_requests_per_client` and `max_tokens_per_client` (fly_daemon.scheduling.request_weight), and
takes turns, by a *client* string. Each door names it here, one way for all its routes:

- ZeroMQ (`zmq_client`): the CURVE public key when the door authenticates with CURVE (every socket of one
  key is one client), else None: the scheduler then counts the socket (its routing envelope).
- HTTP (`HttpClients.identity`, for every route of every API): `<tenant>@<address>`. The tenant is the
  credential the request carried (the front's API key, hashed: fly_daemon.http.app.request_tenant) or
  LOCAL_TENANT. A front has one key, so the credential tells the deployment apart, not its clients; the
  address does that:
  - the peer's address (the TCP connection's other end), grouped (`connection_client`): an IPv6 address
    counts as its /64 network, since one host is commonly given a whole /64 and could otherwise be as many
    clients as it likes; IPv4 (and IPv4-mapped IPv6) addresses, IPv6 loopback and trusted proxies count one
    by one;
  - for a loopback peer without a credential, the connection (address and port): two local apps, or a
    browser tab and an editor plugin, are two clients;
  - when the peer is a trusted proxy (`trusted_proxies`, CIDR networks; none by default), the address the
    proxy forwarded: the rightmost `X-Forwarded-For` hop that is not itself a trusted proxy, or, without
    that header, the same walk over `Forwarded: for=` (RFC 7239), grouped alike. An untrusted peer's
    forwarded headers are ignored (anyone can send them), and a malformed or obfuscated hop (`unknown`,
    `_hidden`) where the walk needs it names the peer instead: a header never fails a request.

The HTTP front's connection caps count the same grouping of the TCP peer (`connection_client`, before any
header is read), so a connection's client and its requests' client agree on the address.

Only the rightmost hops are read, because each proxy appends the address it saw: what a client wrote
itself is on the left, past the first untrusted hop, and never reached. uvicorn's own proxy-header
handling is off (fly_daemon.http.app.HttpFront), so the peer uvicorn gives is the TCP peer.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.requests import Request

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

LOCAL_TENANT = "local"
"""The tenant of requests that carried no credential (ipc, loopback TCP without CURVE, an HTTP front
without a key)."""


def trusted_networks(entries: Iterable[str]) -> tuple[Network, ...]:
    """The networks of `entries` (CIDR '10.0.0.0/8', or one address '127.0.0.1', '::1'); ValueError naming a
    bad one. Host bits are allowed ('10.1.2.3/8' is 10.0.0.0/8)."""
    networks = []
    for entry in entries:
        try:
            networks.append(ipaddress.ip_network(entry.strip(), strict=False))
        except ValueError:
            raise ValueError(f"not an address or CIDR network: {entry!r} (e.g. 10.0.0.0/8, 127.0.0.1, "
                             "fd00::/8)") from None
    return tuple(networks)


def is_trusted(host: str, trusted: Sequence[Network]) -> bool:
    """Whether `host` (a peer's address as the server gives it) is in one of the `trusted` networks."""
    address = _address(host)
    return address is not None and _within(address, trusted)


def connection_client(host: str, trusted: Sequence[Network]) -> str:
    """The client the connection caps count a connection from peer `host` (as the server gives it) as: the
    `_grouped` address, or `host` itself when it names no address."""
    address = _address(host)
    return host if address is None else _grouped(address, trusted)


def _grouped(address: Address, trusted: Sequence[Network]) -> str:
    """The client `address` counts as: its /64 network for an IPv6 address ('2001:db8:1:2::/64'), since one
    host commonly owns a whole /64; the address itself for IPv4 (an IPv4-mapped one is given as IPv4 by
    `_address`), for IPv6 loopback and for a `trusted` proxy (whose own caps are per address)."""
    if address.version == 4 or address.is_loopback or _within(address, trusted):
        return str(address)
    return str(ipaddress.IPv6Network((int(address) >> 64 << 64, 64)))


def zmq_client(tenant: str) -> str | None:
    """The client of a ZeroMQ request with credential `tenant` (fly_daemon.server): the CURVE key's tenant
    itself, else None (the scheduler counts the socket)."""
    return None if tenant == LOCAL_TENANT else tenant


@dataclass(frozen=True)
class HttpClients:
    """How one HTTP front names the client of each request: the `tenant` its credential makes (every request
    it serves carried the front's key, or none) and the `trusted` proxies' networks."""

    tenant: str = LOCAL_TENANT
    trusted: tuple[Network, ...] = ()

    def identity(self, request: Request) -> str:
        """The client of `request` (see the module docstring); never raises, whatever its headers and peer."""
        host, port = request.client if request.client else ("unknown", 0)
        peer = _address(host)
        if peer is not None and _within(peer, self.trusted):
            forwarded = _forwarded(request.headers.getlist("x-forwarded-for"), _xff_hops) \
                or _forwarded(request.headers.getlist("forwarded"), _forwarded_hops)
            if forwarded is not None:
                return f"{self.tenant}@{_grouped(_walk(forwarded, self.trusted) or peer, self.trusted)}"
        if peer is not None and peer.is_loopback and self.tenant == LOCAL_TENANT:
            return f"{self.tenant}@{f'[{peer}]' if peer.version == 6 else peer}:{port}"
        return f"{self.tenant}@{connection_client(host, self.trusted)}"


def _forwarded(values: list[str], hops: Callable[[str], list[str]]) -> list[str] | None:
    """The hops that one forwarding header's lines (`values`, in order) list, or None when there are none."""
    listed = [hop for value in values for hop in hops(value)]
    return listed or None


def _xff_hops(value: str) -> list[str]:
    """The hops of `X-Forwarded-For: client, proxy1, proxy2` (addresses, possibly with a port)."""
    return [hop.strip() for hop in value.split(",") if hop.strip()]


def _forwarded_hops(value: str) -> list[str]:
    """The hops of `Forwarded: for=client;proto=https, for="[2001:db8::1]:4711"` (RFC 7239): each element's
    `for`, or "" (no address) for an element without one."""
    hops = []
    for element in value.split(","):
        if element.strip():
            pairs = (pair.partition("=") for pair in element.split(";"))
            names = [v.strip() for k, _, v in pairs if k.strip().lower() == "for"]
            hops.append(names[0] if names else "")
    return hops


def _walk(hops: list[str], trusted: Sequence[Network]) -> Address | None:
    """The rightmost hop that is not a trusted proxy (the leftmost if all are); None if a hop that the walk
    reaches is not an address."""
    address = None
    for hop in reversed(hops):
        address = _address(hop)
        if address is None or not _within(address, trusted):
            return address
    return address


def _within(address: Address, networks: Sequence[Network]) -> bool:
    return any(address in network for network in networks)


def _address(text: str) -> Address | None:
    """The address `text` names ('1.2.3.4', '1.2.3.4:80', '::1', '[::1]', '[::1]:80'; an IPv4-mapped IPv6
    address as its IPv4 one), or None when it names none."""
    text = text.strip().strip('"')
    if text.startswith("["):
        text = text[1:].partition("]")[0]
    elif text.count(":") == 1:
        text = text.partition(":")[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    return address.ipv4_mapped or address if isinstance(address, ipaddress.IPv6Address) else address
