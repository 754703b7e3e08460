"""Anthropic's Messages API answer (fly_daemon.http.messages_api): the `message` object, its stream's events and
Anthropic's error shape, as the anthropic SDK reads them.

Content blocks are built as the replies come: the text in a `text` block, each completed tool call a
`tool_use` block. A stream is message_start, then per block content_block_start, content_block_delta
(text_delta, or the call's whole input as one input_json_delta), content_block_stop, and last message_delta
(stop_reason, usage) and message_stop. The prompt's token count is known only with the result, so
message_start's usage has input_tokens 0 and message_delta's the real counts (the SDK takes them from there).
stop_reason: end_turn (EOS or a stop sequence: which one is not known, so `stop_sequence` stays null),
max_tokens, or tool_use. Usage splits the prompt as Anthropic does: `input_tokens` prefilled,
`cache_read_input_tokens` served from the prefix cache. A failure after the stream began is an `error` event
in Anthropic's error shape.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from fly_llm.common.errors import FLyError
from fly_llm.common.protocol import GenerateResult, Usage
from fly_llm.common.tools import ToolCall

from fly_daemon.http.common import Event, EventShaper

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
"""Anthropic's error `type` of an HTTP status (others: invalid_request_error below 500, api_error above)."""
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
"""Anthropic's stop_reason of each finish reason."""


def anthropic_error(error: FLyError, status: int) -> dict[str, Any]:
    """Anthropic's error shape, with our stable code (fly_llm.common.errors) added as `error.code`."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message, "code": error.code}}


def anthropic_usage(usage: Usage) -> dict[str, int]:
    """A result's usage in Anthropic's shape (the prompt split into prefilled and cached tokens)."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0}


class MessageShaper(EventShaper):
    """One answer of `model`: its content blocks so far, and the events that built them."""

    def __init__(self, model: str) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.content: list[dict[str, Any]] = []
        self._text_open = False
        """Whether the last block is text still coming."""

    def opening(self) -> list[Event]:
        usage = {"input_tokens": 0, "output_tokens": 0}
        return [{"type": "message_start", "message": self._message([], None, usage)}]

    def final(self, result: GenerateResult) -> list[Event]:
        return [*self._close_text(),
                {"type": "message_delta", "delta": {"stop_reason": STOP_REASONS[result.finish_reason],
                                                    "stop_sequence": None},
                 "usage": anthropic_usage(result.usage)},
                {"type": "message_stop"}]

    def failure(self, error: FLyError, status: int) -> list[Event]:
        return [anthropic_error(error, status)]

    def whole(self, result: GenerateResult) -> dict[str, Any]:
        if result.text and (result.text.strip() or not result.tool_calls):  # no whitespace block beside calls
            self.text_events(result.text)
        for call in result.tool_calls:
            self.call_events(call)
        return {**self._message(self.content, STOP_REASONS[result.finish_reason], anthropic_usage(result.usage)),
                "fly_stats": result.stats.model_dump()}

    def _message(self, content: list[dict[str, Any]], stop_reason: str | None, usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": None, "usage": usage}

    def text_events(self, delta: str) -> list[Event]:
        """Events adding `delta` to the open text block (opened first if there is none)."""
        events = []
        if not self._text_open:
            self.content.append({"type": "text", "text": ""})
            self._text_open = True
            events.append({"type": "content_block_start", "index": len(self.content) - 1,
                           "content_block": {"type": "text", "text": ""}})
        self.content[-1]["text"] += delta
        return [*events, {"type": "content_block_delta", "index": len(self.content) - 1,
                          "delta": {"type": "text_delta", "text": delta}}]

    def _close_text(self) -> list[Event]:
        if not self._text_open:
            return []
        self._text_open = False
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]

    def call_events(self, call: ToolCall) -> list[Event]:
        """Events of one completed call: a tool_use block, its input as one input_json_delta."""
        events = self._close_text()
        self.content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments})
        index = len(self.content) - 1
        return [*events,
                {"type": "content_block_start", "index": index,
                 "content_block": {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}},
                {"type": "content_block_delta", "index": index,
                 "delta": {"type": "input_json_delta", "partial_json": json.dumps(call.arguments)}},
                {"type": "content_block_stop", "index": index}]
