"""Hostile cases through the Responses API (/v1/responses) and Anthropic's Messages API (/v1/messages).

`ResponsesDoor` and `MessagesDoor` post the door-neutral `Case`s of tests/hostile/strategies.py in each API's
shape (a prompt as the one user turn, chat turns as input items or content blocks, tools and tool_choice in the
API's form, a response format as `text.format` / `output_config.format`: one the API cannot express, a regex, is
sent as it is and must be refused), raw frames as bodies, and a case with a `route` of its own (the API's own
families, tests/hostile/api_strategies.py) as its body there. Each answer is judged as the other doors judge:
served (a whole answer in the API's shape, or a stream that ends as the API ends one, its Responses events
numbered 0, 1, …) or refused with a stable code in the API's error shape; anything else (a 5xx, another
shape, a stream cut short) is a Finding.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx

from hostile.doors import (HTTP_FLY_KEYS, REQUEST_TIMEOUT_S, Finding, FuzzTarget, Outcome, _error_code, judge,
                           plain_outcome)
from hostile.strategies import Case

RESPONSES, MESSAGES = "/v1/responses", "/v1/messages"
DEFAULT_MAX_TOKENS = 16
"""max_tokens of a Messages case that names none (the API requires one)."""


class _ApiDoor:
    """Posts cases to `path` (built by `_body`), judging answers by the API's whole-answer and stream rules."""

    name: str
    path: str

    def __init__(self, target: FuzzTarget) -> None:
        self.target = target

    def send(self, case: Case) -> Outcome:
        """Post one case and read its answer (a stream to its end); raise Finding on a bad one."""
        path, content = self._request(case)
        try:
            with httpx.stream("POST", f"{self.target.http_url}{path}", content=content,
                              headers={"content-type": "application/json"}, timeout=REQUEST_TIMEOUT_S) as response:
                if response.status_code == 200 and response.headers.get("content-type", "").startswith(
                        "text/event-stream"):
                    return judge(case, self._stream(_events(response)))
                response.read()
        except httpx.TimeoutException:
            raise Finding(f"no answer within {REQUEST_TIMEOUT_S} s (a hang)", "hang") from None
        except httpx.TransportError as exc:
            raise Finding(f"the connection failed ({exc!r})", "crash" if self.target.died(2.0) else "bad_answer") \
                from None
        return judge(case, plain_outcome(response, self._error_code, self._served, self.answer, self.name))

    def _request(self, case: Case) -> tuple[str, bytes]:
        if case.frame is not None:
            return self.path, case.frame
        if case.route is not None:
            return case.route, json.dumps({"model": self.target.model, **case.request}).encode()
        request = dict(case.request)
        sampling, fly = request.pop("sampling", {}), request.pop("fly", {})
        request.pop("timeout_s", None)
        body = {"model": self.target.model, **{k: v for k, v in fly.items() if k in HTTP_FLY_KEYS}}
        return self.path, json.dumps(body | self._body(request, sampling)).encode()

    answer: str
    """What a served whole answer must hold (named in findings)."""

    def _body(self, request: dict[str, Any], sampling: dict[str, Any]) -> dict[str, Any]:
        """The API's body of a door-neutral request (FLy's options and the model added by the caller)."""
        raise NotImplementedError

    @staticmethod
    def _error_code(body: Any) -> str | None:
        raise NotImplementedError

    @staticmethod
    def _served(body: Any) -> bool:
        raise NotImplementedError

    def _stream(self, events: list[tuple[str | None, Any]]) -> Outcome:
        raise NotImplementedError


class ResponsesDoor(_ApiDoor):
    name, path, answer = "responses", RESPONSES, "an object 'response' with its output"

    def _body(self, request: dict[str, Any], sampling: dict[str, Any]) -> dict[str, Any]:
        body: dict[str, Any] = {_RESPONSES_SAMPLING.get(k, k): v for k, v in sampling.items()
                                if k not in ("seed", "stop")}  # no such fields in the Responses API
        if "prompt" in request:
            body["input"] = request.pop("prompt")
        if "messages" in request:
            messages = request.pop("messages")
            body["input"] = [i for m in messages for i in _input_items(m)] if isinstance(messages, list) else messages
        if "tools" in request:
            tools = request.pop("tools")
            body["tools"] = [_flat_tool(t) for t in tools] if isinstance(tools, list) else tools
        if "tool_choice" in request:
            choice = request.pop("tool_choice")
            body["tool_choice"] = {"type": "function", "name": choice["function"].get("name")} \
                if _named(choice) else choice
        if "response_format" in request:
            body["text"] = {"format": _flat_format(request.pop("response_format"))}
        return body | request

    @staticmethod
    def _error_code(body: Any) -> str | None:
        return _error_code(body)

    @staticmethod
    def _served(body: Any) -> bool:
        return isinstance(body, dict) and body.get("object") == "response" and isinstance(body.get("output"), list)

    def _stream(self, events: list[tuple[str | None, Any]]) -> Outcome:
        for index, (name, data) in enumerate(events):
            if not isinstance(data, dict) or data.get("type") != name or data.get("sequence_number") != index:
                raise Finding(f"event {index} is not numbered {index} and named by its type: {str(data)[:300]}")
            if name == "error":
                return Outcome("refused", data.get("code"))
            if name in ("response.completed", "response.incomplete"):
                return Outcome("served")
        raise Finding(f"the stream ended without response.completed or an error: {str(events[-1:])[:300]}")


class MessagesDoor(_ApiDoor):
    name, path, answer = "messages", MESSAGES, "a 'message' with its content (or count_tokens' input_tokens)"

    def _body(self, request: dict[str, Any], sampling: dict[str, Any]) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": DEFAULT_MAX_TOKENS}
        body |= {_MESSAGES_SAMPLING.get(k, k): v for k, v in sampling.items() if k != "seed"}
        if "prompt" in request:
            body["messages"] = [{"role": "user", "content": request.pop("prompt")}]
        if "messages" in request:
            messages = request.pop("messages")
            if isinstance(messages, list):
                system = [m for m in messages if isinstance(m, dict) and m.get("role") == "system"]
                if system:
                    body["system"] = system[0].get("content")
                messages = [_anthropic_turn(m) for m in messages if m not in system[:1]]
            body["messages"] = messages
        if "tools" in request:
            tools = request.pop("tools")
            body["tools"] = [_anthropic_tool(t) for t in tools] if isinstance(tools, list) else tools
        if "tool_choice" in request:
            body["tool_choice"] = _anthropic_choice(request.pop("tool_choice"))
        if "parallel_tool_calls" in request:
            parallel = request.pop("parallel_tool_calls")
            if parallel is False and isinstance(body.get("tool_choice"), dict):
                body["tool_choice"]["disable_parallel_tool_use"] = True
        if "response_format" in request:
            fmt = request.pop("response_format")
            body["output_config"] = {"format": _flat_format(fmt)}
        return body | request

    @staticmethod
    def _error_code(body: Any) -> str | None:
        """The code of Anthropic's error shape {"type": "error", "error": {"type", "message", "code"}}, else None."""
        error = body.get("error") if isinstance(body, dict) and body.get("type") == "error" else None
        if isinstance(error, dict) and all(isinstance(error.get(k), str) for k in ("type", "message", "code")):
            return error["code"]
        return None

    @staticmethod
    def _served(body: Any) -> bool:
        """A message with its content, or count_tokens' count."""
        if not isinstance(body, dict):
            return False
        return body.get("type") == "message" and isinstance(body.get("content"), list) or \
            type(body.get("input_tokens")) is int

    def _stream(self, events: list[tuple[str | None, Any]]) -> Outcome:
        if not events or events[0][0] != "message_start":
            raise Finding(f"the stream does not open with message_start: {str(events[:1])[:300]}")
        for name, data in events:
            if not isinstance(data, dict) or data.get("type") != name:
                raise Finding(f"an event not named by its type: {str(data)[:300]}")
            if name == "error":
                code = self._error_code(data)
                if code is None:
                    raise Finding(f"an error event not in Anthropic's shape: {str(data)[:300]}")
                return Outcome("refused", code)
            if name == "message_stop":
                return Outcome("served")
        raise Finding(f"the stream ended without message_stop or an error: {str(events[-1:])[:300]}")


_RESPONSES_SAMPLING = {"max_tokens": "max_output_tokens"}
_MESSAGES_SAMPLING = {"stop": "stop_sequences"}


def _events(response: httpx.Response) -> list[tuple[str | None, Any]]:
    """(event name, data) of each server-sent event; Finding for data that is not JSON."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            try:
                events.append((name, json.loads(line.removeprefix("data: "))))
            except ValueError:
                raise Finding(f"an event whose data is not JSON: {line[:300]!r}") from None
            name = None
    return events


def _named(choice: Any) -> bool:
    return isinstance(choice, dict) and isinstance(choice.get("function"), dict)


def _flat_format(fmt: Any) -> Any:
    """A response_format as the Responses API's `text.format` (and Anthropic's `output_config.format`): OpenAI's
    nested json_schema lifted; any other shape as it is (a regex is refused there)."""
    if isinstance(fmt, dict) and isinstance(fmt.get("json_schema"), dict):
        nested = fmt["json_schema"]
        return {"type": fmt.get("type"), **{k: nested[k] for k in ("name", "schema") if k in nested}}
    return fmt


def _flat_tool(tool: Any) -> Any:
    """An OpenAI tool in the Responses API's flat shape."""
    if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
        return {"type": tool.get("type"), **tool["function"]}
    return tool


def _input_items(message: Any) -> list[Any]:
    """A chat turn as Responses input items: a message, its calls as function_call items, a tool turn as a
    function_call_output item."""
    if not isinstance(message, dict):
        return [message]
    if message.get("role") == "tool":
        return [{"type": "function_call_output", "call_id": message.get("tool_call_id"),
                 "output": message.get("content")}]
    calls = message.get("tool_calls")
    items = [] if calls and message.get("content") is None else [
        {"role": message.get("role"), "content": message.get("content")}]
    for call in calls if isinstance(calls, list) else ():
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            items.append(call)
            continue
        arguments = function.get("arguments")
        items.append({"type": "function_call", "call_id": call.get("id"), "name": function.get("name"),
                      "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)})
    return items


def _anthropic_turn(message: Any) -> Any:
    """A chat turn as an Anthropic message: calls as tool_use blocks, a tool turn as a user turn's tool_result."""
    if not isinstance(message, dict):
        return message
    if message.get("role") == "tool":
        return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": message.get("tool_call_id"),
                                             "content": message.get("content")}]}
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return {"role": message.get("role"), "content": message.get("content")}
    blocks: list[Any] = [{"type": "text", "text": message["content"]}] if message.get("content") else []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        blocks.append({"type": "tool_use", "id": call.get("id") if isinstance(call, dict) else None,
                       "name": function.get("name") if isinstance(function, dict) else None,
                       "input": _parsed(arguments)})
    return {"role": message.get("role"), "content": blocks}


def _parsed(arguments: Any) -> Any:
    """Arguments JSON text as the object it holds, if it parses and the body can carry it (a few levels deeper);
    else the text as it is (the API wants an object, so that is refused)."""
    if not isinstance(arguments, str):
        return arguments
    try:
        value = json.loads(arguments)
        json.dumps({"messages": [{"content": [{"input": value}]}]})
    except (ValueError, RecursionError):
        return arguments
    return value


def _anthropic_tool(tool: Any) -> Any:
    """An OpenAI tool as an Anthropic custom tool (its parameters as `input_schema`)."""
    if not (isinstance(tool, dict) and isinstance(tool.get("function"), dict)):
        return tool
    function = tool["function"]
    shaped = {"name": function.get("name"),
              "input_schema": function.get("parameters", {"type": "object", "properties": {}})}
    return shaped | ({"description": function["description"]} if "description" in function else {})


def _anthropic_choice(choice: Any) -> Any:
    """An OpenAI tool_choice as Anthropic's: auto, any (required), none, or a named tool; junk as it is."""
    words: dict[Any, Callable[[], Any]] = {"auto": lambda: {"type": "auto"}, "required": lambda: {"type": "any"},
                                           "none": lambda: {"type": "none"}}
    if _named(choice):
        return {"type": "tool", "name": choice["function"].get("name")}
    return words[choice]() if isinstance(choice, str) and choice in words else choice
