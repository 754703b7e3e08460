"""ChatFLy and the example chain on the real embedded pair (Qwen2.5-Coder 1.5B / 0.5B) in a daemon.

Slow (minutes on a CPU; needs `fly-llm[models]`). Run with
`python -m pytest tests/adapters/test_langchain_real.py -m slow -s`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from langchain_fly import ChatFLy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

TASK = "Write a Python function add(a, b) that returns the sum of a and b."


def test_chat_answers_a_coding_task(real_daemon: str) -> None:
    chat = ChatFLy(endpoint=real_daemon, max_tokens=64, temperature=0, timeout=1800)
    message = chat.invoke([("system", "You write Python."), ("human", TASK)])
    assert "def add" in message.content
    meta = message.response_metadata
    assert "Qwen2.5-Coder-1.5B" in meta["model_name"]
    assert meta["fly_stats"]["rounds"] >= 1
    assert message.usage_metadata["output_tokens"] <= 64
    streamed = "".join(c.content for c in chat.stream([("system", "You write Python."), ("human", TASK)]))
    assert streamed == message.content


def test_example_chain_streams_an_answer(real_daemon: str) -> None:
    example = Path(__file__).parents[2] / "examples" / "langchain_chain.py"
    run = subprocess.run([sys.executable, str(example), "--endpoint", real_daemon, "--max-tokens", "64", TASK],
                         capture_output=True, text=True, timeout=1800, check=True)
    assert "def add" in run.stdout
    assert "tokens per pass" in run.stderr
