"""Shared fixtures: tiny model pairs built locally (see support/tiny_models.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_pair_dirs(tmp_path_factory):
    """(target_dir, draft_dir) of a tiny Llama pair saved to disk, shared by the session."""
    from support.tiny_models import save_tiny_pair

    return save_tiny_pair(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_daemon(tiny_pair_dirs, tmp_path_factory):
    """Endpoint (ipc://…) of a fly-daemon subprocess serving the tiny pair in float32; stopped at the end."""
    from support.daemon_process import start_daemon

    daemon = start_daemon(*tiny_pair_dirs, tmp_path_factory.mktemp("tiny_daemon"), "d", "--max-batch-size", "32")
    yield daemon.endpoint
    daemon.stop()


@pytest.fixture(scope="session")
def batch_daemon(tiny_pair_dirs, tmp_path_factory):
    """A second tiny daemon used only by tests that read its largest batch size so far.

    On the shared `tiny_daemon` the concurrency tests already fill whole batches, so a test that
    asserts "these n requests ran as one batch" needs a daemon nobody else loads.
    """
    from support.daemon_process import start_daemon

    daemon = start_daemon(*tiny_pair_dirs, tmp_path_factory.mktemp("batch_daemon"), "b", "--max-batch-size", "32")
    yield daemon.endpoint
    daemon.stop()
