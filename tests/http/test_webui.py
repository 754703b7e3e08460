"""A real web UI in a real browser: Open WebUI, driven by headless Chromium, chats with fly-daemon on the
embedded pair over its OpenAI and its Ollama connection (benchmarks/serving/webui_check.py; docs/webui.md)."""

from __future__ import annotations

import importlib.util

import pytest

from benchmarks.serving.webui_check import installed_programs, parse_args, run_check

OPEN_WEBUI, CHROMIUM = installed_programs()
MISSING = [what for what, found in (
    ("Open WebUI (its own venv; FLY_OPEN_WEBUI=/path/to/bin/open-webui)", OPEN_WEBUI),
    ("Chromium (apt-get install chromium)", CHROMIUM),
    ("playwright (pip install playwright)", importlib.util.find_spec("playwright")),
) if not found]

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)}: see docs/webui.md")]


def test_open_webui_streams_an_answer_from_the_embedded_pair(tmp_path):
    screenshot = tmp_path / "chat.png"
    turns = run_check(parse_args(["--embedded", "--dtype", "auto", "--screenshot", str(screenshot)]))
    assert [t.api for t in turns] == ["openai", "ollama"]
    for turn in turns:
        assert turn.answer.strip(), turn
        assert (turn.ok_requests, turn.failed_requests) == (1, 0), turn  # the answer's one request, no other
        assert turn.same_as_daemon, turn  # the words on screen are the daemon's answer
        assert turn.completion_tokens > 0
    assert screenshot.stat().st_size > 10_000 and (tmp_path / "chat-ollama.png").exists()
