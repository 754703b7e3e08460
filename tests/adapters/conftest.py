"""Fixtures of the adapter tests: the real embedded pair in a daemon (slow tests), the examples folder."""

from __future__ import annotations

from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[2] / "examples"


@pytest.fixture(scope="session")
def real_daemon(tmp_path_factory):
    """Endpoint of a daemon serving the embedded pair (float32, cpu) on a private socket."""
    from support.daemon_process import start_daemon

    from fly_llm.model.embedded import ensure_default_pair

    daemon = start_daemon(*ensure_default_pair(progress=False), tmp_path_factory.mktemp("real_daemon"), "real")
    yield daemon.endpoint
    daemon.stop()


@pytest.fixture
def examples(monkeypatch: pytest.MonkeyPatch) -> Path:
    """The examples folder, importable (`import langchain_agent`) for the test."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return EXAMPLES
