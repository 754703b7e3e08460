"""CallText: the text around tool calls as OpenAI streams it (no whitespace-only text beside a call)."""

from __future__ import annotations

import pytest

from fly_llm.common.tool_formats.hermes import ToolCallStream

from fly_daemon.scheduling.call_text import CallText

CALL = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'


def _stream(pieces: list[str]) -> tuple[list[str], int]:
    text = CallText(ToolCallStream())
    shown, calls = [], 0
    for i, piece in enumerate(pieces):
        out, new = text.feed(piece, i == len(pieces) - 1)
        shown.append(out)
        calls += len(new)
    return shown, calls


@pytest.mark.parametrize(("pieces", "text", "calls"), [
    ([CALL, "\n", CALL, "\n", ""], "", 2),  # between and after calls: nothing
    (["\n", CALL, "\n\n"], "", 1),  # before the first call too
    (["Let me look.", "\n", CALL, "\n"], "Let me look.", 1),
    (["Hi", "\n", CALL, "\n", "there", " "], "Hi\n\nthere", 1),  # held whitespace is shown once text follows
    (["  a", " b\n", "\n"], "  a b\n\n", 0),  # without calls every character is shown
])
def test_whitespace_around_calls_is_never_shown(pieces, text, calls):
    shown, found = _stream(pieces)
    assert "".join(shown) == text and found == calls
    assert all(s.strip() or not s for s in shown) or not calls  # no whitespace-only delta beside a call
