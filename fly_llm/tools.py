"""Tools and structured output on the wire: OpenAI-shaped specs, and tool calls found in text (no torch).

Tool calls use the Hermes / Qwen format that the embedded Qwen2.5 chat template asks for:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The daemon renders `tools` with the target's chat template, constrains decoding with a grammar
(fly_llm.decoding.grammar), and reads the calls back out of the text with `split_tool_calls` /
`ToolCallStream`. Everything here is validated data or string work, so clients import it too.
"""

from __future__ import annotations

import json
import secrets
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"
MAX_TOOLS = 128
"""Most tools one request may offer."""

_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionSpec(_Strict):
    """A function the model may call: its name, what it does and a JSON Schema of its arguments."""

    name: str = Field(pattern=_NAME)
    description: str = Field("", max_length=8192)
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class ToolSpec(_Strict):
    """One OpenAI-style tool: {"type": "function", "function": {...}}."""

    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedToolChoice(_Strict):
    """tool_choice naming one function: {"type": "function", "function": {"name": ...}}."""

    class _Name(_Strict):
        name: str

    type: Literal["function"] = "function"
    function: _Name


ToolChoice = Union[Literal["auto", "none", "required"], NamedToolChoice]


class TextFormat(_Strict):
    """Free text (the default)."""

    type: Literal["text"] = "text"


class JsonObjectFormat(_Strict):
    """Any JSON object."""

    type: Literal["json_object"] = "json_object"


class JsonSchemaFormat(_Strict):
    """JSON valid under `schema`. OpenAI's nested form {"json_schema": {"name", "schema", "strict"}} is accepted too."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["json_schema"] = "json_schema"
    json_schema_: dict[str, Any] = Field(alias="schema")
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _lift_openai_form(cls, data: Any) -> Any:
        if isinstance(data, dict) and "json_schema" in data and "schema" not in data:
            nested = data["json_schema"]
            if not isinstance(nested, dict) or not isinstance(nested.get("schema"), dict):
                raise ValueError("json_schema must be an object with a 'schema' object")
            return {"type": data.get("type", "json_schema"), "schema": nested["schema"], "name": nested.get("name")}
        return data


class RegexFormat(_Strict):
    """Text matching a regular expression (llguidance's regex syntax, anchored at both ends)."""

    type: Literal["regex"] = "regex"
    pattern: str = Field(min_length=1, max_length=16_384)


ResponseFormat = Annotated[Union[TextFormat, JsonObjectFormat, JsonSchemaFormat, RegexFormat],
                           Field(discriminator="type")]


class ToolCall(_Strict):
    """A call the model made: its id, the function's name and the arguments as a JSON object."""

    id: str
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class Structure(_Strict):
    """What constrains one request's output: offered tools and the choice among them, or a response format."""

    tools: list[ToolSpec] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "Structure":
        names = [t.function.name for t in self.tools or ()]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate tool names: {', '.join(duplicates)}")
        choice = self.tool_choice
        if choice not in (None, "auto", "none") and not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names the unknown tool {choice.function.name!r} (offered: {names})")
        if self.calls_tools and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("give either tools (with tool_choice other than 'none') or a response_format, not both")
        return self

    @property
    def calls_tools(self) -> bool:
        """Whether the model may call tools (tools offered and tool_choice is not 'none')."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def is_free(self) -> bool:
        """Nothing constrains the output."""
        return not self.tools and (self.response_format is None or self.response_format.type == "text")


def parse_call(body: str) -> ToolCall:
    """A ToolCall (with a fresh id) from the JSON between the tags; ValueError unless {"name": str, "arguments": {…}}."""
    data = json.loads(body)
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        raise ValueError("a tool call must be a JSON object with a string 'name'")
    arguments = data.get("arguments", {})
    if not isinstance(arguments, dict):
        raise ValueError("a tool call's 'arguments' must be a JSON object")
    return ToolCall(id=f"call_{secrets.token_hex(8)}", name=data["name"], arguments=arguments)


def split_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Split generated text into (text outside the calls, the calls); a block that does not parse stays text."""
    stream = ToolCallStream()
    shown, calls = stream.feed(text)
    content = shown + stream.finish()
    return (content.strip() if calls else content), calls


class ToolCallStream:
    """Splits streamed text into text deltas and whole tool calls (one delta per call, when it closes).

    Text that might be the start of TOOL_OPEN is held back until it is clear. A call still open
    when the stream ends is returned as text by `finish` (it never parsed).
    """

    def __init__(self) -> None:
        self._pending = ""
        self._in_call = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Add a text delta; return (text to show now, calls completed by it)."""
        self._pending += text
        shown, calls = [], []
        while True:
            if self._in_call:
                end = self._pending.find(TOOL_CLOSE)
                if end < 0:
                    break
                body, self._pending = self._pending[:end], self._pending[end + len(TOOL_CLOSE):]
                self._in_call = False
                try:
                    calls.append(parse_call(body))
                except ValueError:
                    shown.append(TOOL_OPEN + body + TOOL_CLOSE)
                continue
            start = self._pending.find(TOOL_OPEN)
            if start >= 0:
                shown.append(self._pending[:start])
                self._pending = self._pending[start + len(TOOL_OPEN):]
                self._in_call = True
                continue
            keep = _partial_suffix(self._pending, TOOL_OPEN)
            shown.append(self._pending[:len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep:]
            break
        return "".join(shown), calls

    def finish(self) -> str:
        """The text still held back when the stream ends."""
        rest = (TOOL_OPEN if self._in_call else "") + self._pending
        self._pending, self._in_call = "", False
        return rest


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
