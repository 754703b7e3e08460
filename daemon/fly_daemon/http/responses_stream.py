"""The Responses API's answer (fly_daemon.http.responses_api): the `response` object and its stream's events, in the
openai SDK's shapes.

Output items are built as the replies come: the text in a `message` item (one `output_text` part), each
completed tool call a `function_call` item (its `call_id` is what a `function_call_output` names). A stream
is response.created, response.in_progress, then per item output_item.added, (content_part.added,
output_text.delta…, output_text.done, content_part.done | function_call_arguments.delta,
function_call_arguments.done), output_item.done, and last response.completed, or response.incomplete when
`max_output_tokens` ran out. Every event carries its `sequence_number`. A failure after the stream began is an
`error` event (our stable code as `code`) and response.failed. The whole answer is the same object as the
stream's last event, so the items' ids agree.
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from fly_llm.common.errors import FLyError
from fly_llm.common.protocol import GenerateResult
from fly_llm.common.tools import ToolCall

from fly_daemon.http.common import Event, EventShaper


class ResponseShaper(EventShaper):
    """One answer to a Responses request: its output items so far, and the events that built them."""

    def __init__(self, echo: dict[str, Any], namespaced: Callable[[str], tuple[str | None, str]], model: str) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.echo = echo
        """The request's settings that the `response` object repeats (instructions, tools, sampling…)."""
        self.namespaced = namespaced
        """(namespace, tool name) of a called tool's name as the model saw it."""
        self.model = model
        self.created_at = int(time.time())
        self.output: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None
        """The message item whose text is still coming, if any."""
        self._sequence = 0

    def opening(self) -> list[Event]:
        return [self._event("response.created", response=self.response("in_progress")),
                self._event("response.in_progress", response=self.response("in_progress"))]

    def final(self, result: GenerateResult) -> list[Event]:
        status = "incomplete" if result.finish_reason == "length" else "completed"
        return [*self._close_message(), self._event(f"response.{status}", response=self.response(status, result))]

    def failure(self, error: FLyError, status: int) -> list[Event]:
        failed = {**self.response("failed"), "error": {"code": error.code, "message": error.message}}
        return [self._event("error", code=error.code, message=error.message, param=None),
                self._event("response.failed", response=failed)]

    def whole(self, result: GenerateResult) -> dict[str, Any]:
        if result.text and (result.text.strip() or not result.tool_calls):  # no whitespace item beside calls
            self.text_events(result.text)
        for call in result.tool_calls:
            self.call_events(call)
        return self.final(result)[-1]["response"]

    def response(self, status: str, result: GenerateResult | None = None) -> dict[str, Any]:
        """The `response` object as it stands, with `status` (and the result's usage and FLy's counters)."""
        answer: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.model, "output": copy.deepcopy(self.output), "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False, "truncation": "disabled",
            **copy.deepcopy(self.echo), "usage": None}
        if result is not None:
            usage = result.usage
            answer["usage"] = {"input_tokens": usage.prompt_tokens,
                               "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                               "output_tokens": usage.completion_tokens,
                               "output_tokens_details": {"reasoning_tokens": 0},
                               "total_tokens": usage.prompt_tokens + usage.completion_tokens}
            answer["fly_stats"] = result.stats.model_dump()
        return answer

    # ---- items ----

    def text_events(self, delta: str) -> list[Event]:
        """Events adding `delta` to the open message item (opened first if there is none)."""
        events = []
        if self._message is None:
            self._message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress",
                             "role": "assistant", "content": []}
            self.output.append(self._message)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events += [self._event("response.output_item.added", output_index=len(self.output) - 1,
                                   item=copy.deepcopy(self._message)),
                       self._event("response.content_part.added", part=dict(part), **self._where())]
            self._message["content"].append(part)
        self._message["content"][0]["text"] += delta
        return [*events, self._event("response.output_text.delta", delta=delta, logprobs=[], **self._where())]

    def _close_message(self) -> list[Event]:
        """Events ending the open message item, if any."""
        if self._message is None:
            return []
        where, part = self._where(), self._message["content"][0]
        self._message["status"] = "completed"
        events = [self._event("response.output_text.done", text=part["text"], logprobs=[], **where),
                  self._event("response.content_part.done", part=copy.deepcopy(part), **where),
                  self._event("response.output_item.done", output_index=where["output_index"],
                              item=copy.deepcopy(self._message))]
        self._message = None
        return events

    def call_events(self, call: ToolCall) -> list[Event]:
        """Events of one completed call: a function_call item, its arguments in one delta."""
        events = self._close_message()
        arguments = json.dumps(call.arguments)
        namespace, name = self.namespaced(call.name)
        item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "completed", "call_id": call.id,
                "name": name, "arguments": arguments, **({} if namespace is None else {"namespace": namespace})}
        self.output.append(item)
        index = len(self.output) - 1
        where = {"item_id": item["id"], "output_index": index}
        return [*events,
                self._event("response.output_item.added", output_index=index,
                            item={**item, "status": "in_progress", "arguments": ""}),
                self._event("response.function_call_arguments.delta", delta=arguments, **where),
                self._event("response.function_call_arguments.done", arguments=arguments, name=name, **where),
                self._event("response.output_item.done", output_index=index, item=dict(item))]

    def _where(self) -> dict[str, Any]:
        """The open message item's place: item id, output index, content index."""
        return {"item_id": self._message["id"], "output_index": self.output.index(self._message), "content_index": 0}

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event
