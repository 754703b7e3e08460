"""Tests of the in-process A/B scripts read the checkout's git history (benchmarks.harness.at_commit)."""

from __future__ import annotations

import pytest

from benchmarks.harness.at_commit import ROOT

needs_git = pytest.mark.skipif(not (ROOT / ".git").exists(), reason="reads the checkout's git history")
