"""Tenants: the prefix cache is scoped per credential (docs/daemon.md, issue 33 finding 7).

A real engine (tiny pair, float32, prefix cache on) behind an in-process server on a CURVE-secured
loopback tcp endpoint. Two clients with different CURVE keys send the same prompt: neither sees the
other's cache hits in `usage.cached_tokens`, while each still gets its own; `cached_tokens` counts
whole prefix blocks only. With `share_prefix_cache` every client shares one cache (single tenant).
"""

from __future__ import annotations

import socket

import pytest
import torch
import zmq.auth

from fly_llm.client import FLyClient, build_options
from fly_llm.common.config import FLyConfig
from fly_llm.decoding.engine import FLyEngine
from support.engine_double import serving
from support.tiny_models import make_pair

from fly_daemon.scheduling.scheduler import Limits
from fly_daemon.server import CurveKeys

BLOCK = 4
PROMPT = ("Retrieval augmented generation answers questions from documents. "
          "The quick brown fox jumps over the lazy dog. " * 3)


@pytest.fixture(scope="module")
def pair():
    torch.set_num_threads(1)
    return make_pair("llama")


@pytest.fixture
def keys(tmp_path, monkeypatch):
    """The server's secret certificate, the clients' directory, and two client certificates (a, b)."""
    monkeypatch.setenv("FLY_RUNTIME_DIR", str(tmp_path))
    zmq.auth.create_certificates(tmp_path, "server")
    clients = tmp_path / "clients"
    clients.mkdir()
    for name in ("a", "b"):
        zmq.auth.create_certificates(clients, name)
    monkeypatch.setenv("FLY_CURVE_SERVER_KEY", str(tmp_path / "server.key"))
    return CurveKeys(tmp_path / "server.key_secret", clients)


def _endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _engine(pair) -> FLyEngine:
    target, draft, tokenizer = pair
    return FLyEngine(target, tokenizer, draft, FLyConfig(loose=False), prefix_cache_bytes=1 << 22,
                     prefix_block=BLOCK)


def _ask(endpoint: str, keys: CurveKeys, who: str, monkeypatch) -> tuple[list[int], int]:
    """One exact-mode request as client `who`; (tokens, cached_tokens)."""
    monkeypatch.setenv("FLY_CURVE_CLIENT_CERT", str(keys.clients_dir / f"{who}.key_secret"))
    with FLyClient(endpoint, timeout=60) as client:
        result = client.generate(PROMPT, *build_options(max_tokens=8, loose=False))
    assert result.usage.cached_tokens % BLOCK == 0, "cached_tokens must count whole blocks"
    return result.token_ids, result.usage.cached_tokens


def test_clients_with_different_keys_do_not_see_each_others_cache_hits(pair, keys, monkeypatch):
    endpoint = _endpoint()
    with serving(endpoint, _engine(pair), Limits(), curve=keys):
        first_a, cached = _ask(endpoint, keys, "a", monkeypatch)
        assert cached == 0
        first_b, cached_b = _ask(endpoint, keys, "b", monkeypatch)
        assert cached_b == 0, "client b saw client a's prompt in the prefix cache"
        again_a, cached_a = _ask(endpoint, keys, "a", monkeypatch)
        assert cached_a > 0, "the same credential must still get its own cache hits"
        assert first_a == first_b == again_a  # exact mode: the cache never changes an answer


def test_share_prefix_cache_makes_one_tenant(pair, keys, monkeypatch):
    endpoint = _endpoint()
    with serving(endpoint, _engine(pair), Limits(share_prefix_cache=True), curve=keys):
        _ask(endpoint, keys, "a", monkeypatch)
        _, cached_b = _ask(endpoint, keys, "b", monkeypatch)
        assert cached_b > 0
