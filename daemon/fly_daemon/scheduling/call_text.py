"""The text of a request that may call tools, trimmed around its calls as OpenAI streams it."""

from __future__ import annotations

from fly_llm.common.tool_formats import CallParser
from fly_llm.common.tools import ToolCall, UnparsedCall


class CallText:
    """Splits a request's streamed output into text and tool calls (with the model's `CallParser`) and
    never shows whitespace around the calls: whitespace before the first call, between calls and after
    the last is dropped; whitespace after text is held until more text follows it (an answer without
    calls keeps all of its text). What `feed` shows, joined, is the whole answer's text.
    """

    def __init__(self, parser: CallParser) -> None:
        self._parser = parser
        self._held = ""
        self._shown = False
        self.called = False

    @property
    def invalid(self) -> list[UnparsedCall]:
        """The call blocks that stayed text (they did not parse, or were cut off)."""
        return self._parser.unparsed

    def feed(self, text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        """Add the model's new text (`finished`: its last); return (text to show now, calls completed by it)."""
        text, calls = self._parser.feed(text)
        if finished:
            rest, last = self._parser.finish()
            text, calls = text + rest, calls + last
        whole = self._held + text
        if self.called and not self._shown:
            whole = whole.lstrip()
        shown = whole.rstrip()
        self._held = whole[len(shown):]
        self._shown = self._shown or bool(shown)
        if calls:
            self.called = True
            if not self._shown:
                self._held = ""
        if finished and not self.called:
            shown, self._held = whole, ""
        return shown, calls
