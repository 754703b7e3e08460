"""The daemon on the embedded default pair (slow: real models; run with -m slow)."""

from __future__ import annotations

import pytest

from support.daemon_process import start_daemon
from fly_llm.client import FLyClient, build_options


@pytest.mark.slow
def test_default_pair_serves_real_text(tmp_path):
    daemon = start_daemon(None, None, tmp_path, "real", ready_timeout=900)
    try:
        with FLyClient(daemon.endpoint, timeout=600) as client:
            info = client.info()
            assert "Qwen2.5-Coder-1.5B" in info.target and "Qwen2.5-Coder-0.5B" in (info.draft or "")
            result = client.generate("def fibonacci(n):\n", *build_options(max_tokens=32))
            assert "return" in result.text or "fibonacci" in result.text, result.text
            chat = client.chat([{"role": "user", "content": "Write a Python function add(a, b)."}],
                               *build_options(max_tokens=48))
            assert "def add" in chat.text, chat.text
            stats = client.status().stats
            assert stats.rounds > 0 and stats.emitted >= result.usage.completion_tokens
            print(f"\ncompletion: {result.text!r}\nchat: {chat.text!r}\nMAT {stats.mat:.2f}, "
                  f"loose rate {stats.loose_rate:.2f}, {client.status().tokens_per_s:.1f} tok/s while busy")
    finally:
        assert daemon.stop(120) == 0
