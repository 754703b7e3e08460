"""Shared fixtures: tiny model pairs built locally (see support/tiny_models.py), and the suite's own cache root."""

from __future__ import annotations

import pytest

from fly_llm.model.cache_paths import cache_root

SHARED_WITH_THE_SUITE = "kernels"  # the user's cache entry the suite uses too: compiled kernels, keyed by their source
COSTS_DIRECTORY = "policy-costs"  # fly_llm.policy_costs.DIRECTORY (a module that imports torch): never linked


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """`$FLY_CACHE_DIR` for the whole session (every daemon a test starts inherits it), so the suite never writes
    the user's cache: tiny models converted from GGUF files and the policy costs timed for them (a run left seven
    costs files and a converted tiny model there). Linked in: the user's compiled kernels (a build is keyed by its
    source, torch and Python: the same bytes the user's daemon builds, and minutes a session otherwise; the only
    thing the suite may add there) and the models already converted there (the `slow` tests' embedded pair)."""
    root = tmp_path_factory.mktemp("fly-cache")
    user = cache_root()
    (user / SHARED_WITH_THE_SUITE).mkdir(parents=True, exist_ok=True)
    for entry in user.iterdir():
        if entry.is_dir() and entry.name != COSTS_DIRECTORY:
            (root / entry.name).symlink_to(entry, target_is_directory=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FLY_CACHE_DIR", str(root))
        yield root


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
