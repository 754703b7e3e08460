"""Hypothesis strategies of forwarded headers a client writes itself to pass as another (issue 45):
`X-Forwarded-For` and `Forwarded` lines as HTTP can carry them, and their single hops.

Used by the identity's property tests (tests/daemon/test_client_identity.py), the HTTP front's
(tests/http/test_http_edges.py) and the hostile fuzzer's spoofing families (tests/hostile/strategies.py).
"""

from __future__ import annotations

from hypothesis import strategies as st

HeaderLines = tuple[tuple[str, bytes], ...]


def hops() -> st.SearchStrategy[str]:
    """One hop's text: any address, loopback and the proxies' own, ports, brackets, RFC 7239's `unknown` and
    obfuscated names, malformed pieces and random text."""
    odd = ["127.0.0.1", "::1", "::ffff:127.0.0.1", "[::1]:80", "10.0.0.1:8080", "unknown", "_hidden", "", " ", "[",
           "[::1", "1.2.3.4:x", '"', "for=", ";", "0", "localhost"]
    return st.one_of(st.ip_addresses().map(str), st.sampled_from(odd), st.text(max_size=12))


def header_value(text: str | bytes) -> bytes:
    """`text` as a header value HTTP can carry (no control characters, no surrounding blanks): any other byte
    stays, UTF-8 and Latin-1 alike."""
    raw = text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass")
    return bytes(b for b in raw if b == 0x09 or 0x20 <= b != 0x7F).strip()


def forwarded_headers(min_lines: int = 0) -> st.SearchStrategy[HeaderLines]:
    """`min_lines` to 3 X-Forwarded-For and Forwarded lines (names in any case): chains of `hops()`, RFC 7239
    elements with and without `for`, raw bytes, thousands of hops."""
    xff = st.lists(hops(), max_size=8).map(", ".join)
    element = st.builds(lambda h, extra: f'for="{h}"{extra}', hops(),
                        st.sampled_from(["", ";proto=https", ";by=10.0.0.1", ";For=6.6.6.6", ";for"]))
    forwarded = st.one_of(st.lists(element, max_size=6).map(", ".join),
                          st.sampled_from(["proto=https", "for=", "for", ";;;", ",,,", "for=unknown, for=_x"]))
    many = st.builds(lambda n, h: ", ".join([h] * n), st.integers(100, 3_000), st.sampled_from(["10.0.0.1", "::1"]))
    value = st.one_of(xff, xff, forwarded, many, st.binary(max_size=40)).map(header_value)
    name = st.sampled_from(["X-Forwarded-For", "x-forwarded-for", "Forwarded", "FORWARDED"])
    return st.lists(st.tuples(name, value), min_size=min_lines, max_size=3).map(tuple)
