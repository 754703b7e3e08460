"""The client a request counts as (fly_daemon.client_identity, issue 45): credential, address (an IPv6 one's
/64), loopback connection, trusted proxies' forwarded addresses; and that no header or peer can make it raise,
and no untrusted peer can choose its identity by a header. The client a connection counts as: its peer's
address grouped the same way, as its requests' client.

Requests are starlette Requests built from an ASGI scope (peer and raw header lines), as uvicorn gives them.
The HTTP front's wiring (settings, every route, the per-client cap end to end): tests/http/test_http_edges.py.
"""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.requests import Request

from support.forwarded_headers import forwarded_headers, hops

from fly_daemon.client_identity import LOCAL_TENANT, HttpClients, connection_client, trusted_networks, zmq_client
from fly_daemon.settings import DaemonSettings, SettingsError, load_settings

KEYED = "http-key:0123456789abcdef"
PROXY = "10.0.0.5"
PROXIES = trusted_networks(["10.0.0.0/8", "fd00::/8"])


def request(peer: tuple[str, int] | None, *headers: tuple[str | bytes, str | bytes]) -> Request:
    """A request from `peer` (host, port) with these header lines (names any case, values text, sent as UTF-8, or
    raw bytes)."""
    def raw(text: str | bytes) -> bytes:
        return text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass")

    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "client": peer,
                    "headers": [(raw(name).lower(), raw(value)) for name, value in headers]})


def via_proxy(*headers: tuple[str, str], tenant: str = LOCAL_TENANT) -> str:
    """The identity of a request from the trusted proxy PROXY carrying `headers`."""
    return HttpClients(tenant, PROXIES).identity(request((PROXY, 40000), *headers))


@pytest.mark.parametrize("peer, tenant, expected", [
    (("198.51.100.7", 5000), LOCAL_TENANT, "local@198.51.100.7"),
    (("198.51.100.7", 5000), KEYED, f"{KEYED}@198.51.100.7"),
    (("127.0.0.1", 5000), LOCAL_TENANT, "local@127.0.0.1:5000"),  # two local apps are two clients
    (("127.0.0.2", 6000), LOCAL_TENANT, "local@127.0.0.2:6000"),
    (("::1", 5000), LOCAL_TENANT, "local@[::1]:5000"),
    (("::ffff:127.0.0.1", 5000), LOCAL_TENANT, "local@127.0.0.1:5000"),
    (("127.0.0.1", 5000), KEYED, f"{KEYED}@127.0.0.1"),  # the key's holders on this host
    (("testclient", 50000), LOCAL_TENANT, "local@testclient"),  # not an address: named as given
    (("2001:db8:1:2:3:4:5:6", 5000), LOCAL_TENANT, "local@2001:db8:1:2::/64"),  # one host owns a /64
    (("2001:db8:1:2::ffff", 5000), KEYED, f"{KEYED}@2001:db8:1:2::/64"),
    (("::ffff:198.51.100.7", 5000), KEYED, f"{KEYED}@198.51.100.7"),  # IPv4-mapped: the IPv4 address
    (None, LOCAL_TENANT, "local@unknown"),
])
def test_without_a_trusted_proxy_the_peer_names_the_client(peer, tenant, expected):
    spoof = [("X-Forwarded-For", "203.0.113.9"), ("Forwarded", "for=203.0.113.9")]
    assert HttpClients(tenant).identity(request(peer)) == expected
    assert HttpClients(tenant).identity(request(peer, *spoof)) == expected  # nobody trusted: headers ignored
    assert HttpClients(tenant, PROXIES).identity(request(peer, *spoof)) == expected  # the peer is not trusted


@pytest.mark.parametrize("headers, expected", [
    ([("X-Forwarded-For", "203.0.113.9")], "203.0.113.9"),
    ([("X-Forwarded-For", "203.0.113.9, 10.0.0.3")], "203.0.113.9"),  # a second trusted proxy in between
    ([("X-Forwarded-For", "6.6.6.6, 203.0.113.9")], "203.0.113.9"),  # the client's own (spoofed) hop is left of it
    ([("X-Forwarded-For", "6.6.6.6"), ("X-Forwarded-For", "203.0.113.9")], "203.0.113.9"),  # two lines: one list
    ([("X-Forwarded-For", "10.1.1.1, 10.0.0.3")], "10.1.1.1"),  # every hop trusted: the leftmost
    ([("X-Forwarded-For", "garbage, 203.0.113.9")], "203.0.113.9"),  # malformed, but never reached
    ([("X-Forwarded-For", "203.0.113.9, garbage")], PROXY),  # malformed where the walk needs it: the peer
    ([("X-Forwarded-For", "203.0.113.9:4711")], "203.0.113.9"),
    ([("X-Forwarded-For", "[2001:db8::1]:4711")], "2001:db8::/64"),  # a forwarded IPv6 address: its /64 too
    ([("X-Forwarded-For", "2001:db8::1, fd00::2")], "2001:db8::/64"),
    ([("X-Forwarded-For", "fd00::1, fd00::2")], "fd00::1"),  # every hop trusted: the leftmost, a proxy itself
    ([("X-Forwarded-For", " , ")], PROXY),
    ([("Forwarded", "for=192.0.2.60;proto=http;by=203.0.113.43")], "192.0.2.60"),
    ([("Forwarded", 'for="[2001:db8:cafe::17]:4711"')], "2001:db8:cafe::/64"),
    ([("Forwarded", "for=6.6.6.6, FOR=192.0.2.60, for=10.0.0.9")], "192.0.2.60"),
    ([("Forwarded", "for=unknown")], PROXY),  # RFC 7239 obfuscated / unknown: no address
    ([("Forwarded", "proto=https")], PROXY),
    ([("Forwarded", "for=192.0.2.60"), ("X-Forwarded-For", "203.0.113.9")], "203.0.113.9"),  # X-Forwarded-For first
    ([("X-Forwarded-For", ""), ("Forwarded", "for=192.0.2.60")], "192.0.2.60"),  # a blank one is none
    ([], PROXY),
])
def test_a_trusted_proxy_forwards_the_rightmost_untrusted_hop(headers, expected):
    assert via_proxy(*headers) == f"local@{expected}"
    assert via_proxy(*headers, tenant=KEYED) == f"{KEYED}@{expected}"


def test_a_trusted_proxy_on_loopback_forwards_and_its_own_requests_are_its_connections():
    clients = HttpClients(LOCAL_TENANT, trusted_networks(["127.0.0.1"]))
    assert clients.identity(request(("127.0.0.1", 5000), ("X-Forwarded-For", "127.0.0.1"))) == "local@127.0.0.1"
    assert clients.identity(request(("127.0.0.1", 5000), ("X-Forwarded-For", "::1"))) == "local@::1"
    assert clients.identity(request(("127.0.0.1", 5000))) == "local@127.0.0.1:5000"
    assert clients.identity(request(("::ffff:127.0.0.1", 5000), ("X-Forwarded-For", "203.0.113.9"))) == \
        "local@203.0.113.9"


@pytest.mark.parametrize("peer, expected", [
    ("198.51.100.7", "198.51.100.7"),
    ("::ffff:198.51.100.7", "198.51.100.7"),
    ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),
    ("2001:db8:1:2::", "2001:db8:1:2::/64"),
    ("2001:db8:1:3::1", "2001:db8:1:3::/64"),
    ("::1", "::1"),  # loopback: one address
    ("fd00::5", "fd00::5"),  # a trusted proxy (fd00::/8): counted by its own address, exempt from the cap
    ("testclient", "testclient"),  # not an address: as given
])
def test_a_connection_counts_as_its_peers_address_an_ipv6_one_as_its_64(peer, expected):
    assert connection_client(peer, PROXIES) == expected
    # the same client as its requests' (with a key: a loopback peer is not named by its connection)
    assert HttpClients(KEYED, PROXIES).identity(request((peer, 5000))) == f"{KEYED}@{expected}"


def test_zmq_clients_are_curve_keys_else_sockets():
    assert zmq_client("curve:abc") == "curve:abc"
    assert zmq_client(LOCAL_TENANT) is None  # the scheduler counts the socket (its envelope)


def test_trusted_proxies_setting(monkeypatch):
    assert DaemonSettings().trusted_proxies == []
    assert trusted_networks(["10.1.2.3/8", " ::1 "]) == (ipaddress.ip_network("10.0.0.0/8"),
                                                          ipaddress.ip_network("::1/128"))
    monkeypatch.setenv("FLY_TRUSTED_PROXIES", "127.0.0.1, 192.168.0.0/16,")
    assert load_settings(DaemonSettings).trusted_proxies == [ipaddress.ip_network("127.0.0.1/32"),
                                                              ipaddress.ip_network("192.168.0.0/16")]
    assert load_settings(DaemonSettings, cli={"trusted_proxies": "fd00::/8"}).trusted_proxies == \
        [ipaddress.ip_network("fd00::/8")]
    for bad in ("proxy.example", "10.0.0.0/33", "*"):
        with pytest.raises(SettingsError, match=r"trusted_proxies: .*not an address or CIDR network"):
            load_settings(DaemonSettings, cli={"trusted_proxies": bad})


# ---- properties ----

addresses = st.one_of(st.ip_addresses(v=4), st.ip_addresses(v=6)).map(str)
networks = st.builds(lambda address, prefix: ipaddress.ip_network(f"{address}/{prefix % (address.max_prefixlen + 1)}",
                                                                  strict=False),
                     st.one_of(st.ip_addresses(v=4), st.ip_addresses(v=6)), st.integers(0, 128))
peers = st.one_of(st.none(), st.tuples(st.one_of(addresses, st.sampled_from(["127.0.0.1", "::1", "testclient", ""])),
                                       st.integers(0, 65535)))
raw_lines = st.lists(st.tuples(st.sampled_from(["x-forwarded-for", "forwarded"]), st.binary(max_size=60)), max_size=3)
"""Header lines with any bytes, control characters too (what a lenient HTTP parser might pass on)."""
tenants = st.sampled_from([LOCAL_TENANT, KEYED])


@settings(max_examples=400, deadline=None)
@given(peer=peers, lines=st.one_of(forwarded_headers(), raw_lines), trusted=st.lists(networks, max_size=4),
       tenant=tenants)
def test_no_header_or_peer_fails_and_an_untrusted_peer_cannot_choose_its_identity(peer, lines, trusted, tenant):
    clients = HttpClients(tenant, tuple(trusted))
    named = clients.identity(request(peer, *lines))
    assert isinstance(named, str) and named.startswith(f"{tenant}@")
    plain = clients.identity(request(peer))
    peer_trusted = peer is not None and any(_in(peer[0], n) for n in trusted)
    if not peer_trusted:
        assert named == plain  # forwarded headers of an untrusted peer change nothing
    nobody = HttpClients(tenant)
    assert nobody.identity(request(peer, *lines)) == nobody.identity(request(peer))  # nobody trusted: nobody forwards


@settings(max_examples=300, deadline=None)
@given(spoofed=st.lists(hops(), max_size=5), client=addresses, proxies=st.lists(st.ip_addresses(v=4), max_size=3),
       tenant=tenants)
def test_what_a_client_writes_left_of_its_own_hop_never_counts(spoofed, client, proxies, tenant):
    """Through a chain of trusted proxies (10.0.0.0/8, each appending the address it saw), the client's identity
    is the address the first proxy saw, whatever the client put in the header itself."""
    trusted = (ipaddress.ip_network("10.0.0.0/8"),)
    if _in(client, trusted[0]):
        return  # a client inside the proxies' own network is a proxy hop itself
    hops = [*spoofed, client, *(f"10.{a.packed[1]}.{a.packed[2]}.{a.packed[3]}" for a in proxies)]
    for name in ("x-forwarded-for", "forwarded"):
        value = ", ".join(hops) if name == "x-forwarded-for" else ", ".join(f"for=\"{h}\"" for h in hops)
        named = HttpClients(tenant, trusted).identity(request((PROXY, 1), (name, value)))
        assert named == f"{tenant}@{_grouped(client)}", (name, value)


def _in(host: str, network: ipaddress.IPv4Network | ipaddress.IPv6Network) -> bool:
    try:
        return _normal(host) in network
    except ValueError:
        return False


def _grouped(host: str) -> str:
    """Brute force: the client an untrusted address counts as, an IPv6 one (not loopback) as its /64."""
    address = _normal(host)
    if address.version == 6 and not address.is_loopback:
        return ipaddress.ip_network(f"{address}/64", strict=False).with_prefixlen
    return str(address)


def _normal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The address `host` names, an IPv4-mapped IPv6 one as its IPv4 address; ValueError if it names none."""
    address = ipaddress.ip_address(host)
    return getattr(address, "ipv4_mapped", None) or address
