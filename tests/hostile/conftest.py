"""Fixtures of the hostile-content fuzzer: one tiny daemon with both doors open, and the target's greedy output."""

from __future__ import annotations

import pytest

from hostile.doors import FuzzTarget, greedy_reference


@pytest.fixture(scope="module")
def fuzz_target(tiny_pair_dirs, tmp_path_factory):
    """A FuzzTarget on the tiny pair (float32, ipc + loopback HTTP, no heartbeat deadline); stopped at the end."""
    target = FuzzTarget(*tiny_pair_dirs, tmp_path_factory.mktemp("hostile"), greedy_reference(tiny_pair_dirs[0]))
    target.start()
    yield target
    target.stop()
