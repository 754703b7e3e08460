"""The suite's daemons keep what they time and convert in the session's own cache root, not the user's."""

from __future__ import annotations

import os


def test_a_daemon_the_suite_starts_keeps_its_costs_in_the_sessions_cache(tiny_daemon, private_cache):
    """A started daemon (ready: its policy costs were timed or loaded at start) kept them under the session's root."""
    assert os.environ["FLY_CACHE_DIR"] == str(private_cache)
    costs = private_cache / "policy-costs"
    assert not costs.is_symlink() and list(costs.glob("*.json"))
