"""The Hermes / Qwen tool-call format (what the embedded Qwen2.5 chat template asks for), no torch:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

- `HERMES.constraint(structure, special_tags, caps)`: the grammar for a request's tools and
  tool_choice: forced calls ('required', a name), optional calls ('auto') or none.
- `HERMES.parser(structure)`: a `ToolCallStream` that reads the calls back out of streamed text (and
  keeps the blocks that did not parse as `UnparsedCall`s); `split_tool_calls` does the same for a whole text.
- `HERMES.written_by(template)`: whether a chat template asks for this format (`format_for` picks by it).

Under 'auto', small models (Qwen2.5-Coder among them) often answer a tool request with a bare call
object instead of the tags; both the grammar and the parser allow it (`bare_calls_allowed`).
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from fly_llm.common.constraints import Constraint, json_lexeme
from fly_llm.common.json_text import loads, loads_objects
from fly_llm.common.schema_limits import SchemaCaps, check_schema, hoist_defs, loosened
from fly_llm.common.tools import NamedToolChoice, Structure, ToolCall, UnparsedCall

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"


def bare_calls_allowed(structure: Structure) -> bool:
    """Whether a bare call object counts as a call (tool_choice 'auto' or unset)."""
    return structure.tool_choice in (None, "auto")


class HermesFormat:
    """Hermes-tagged calls: the grammar that constrains them and the parser that finds them."""

    name = "hermes"
    tags = (TOOL_OPEN, TOOL_CLOSE)
    """The strings that may be one special token each of a tokenizer (named as tokens in the grammar)."""

    def constraint(self, structure: Structure, special_tags: frozenset[str] = frozenset(),
                   caps: SchemaCaps = SchemaCaps()) -> Constraint:
        """The grammar of a request that offers tools; BadRequest when a schema in it exceeds `caps`.
        `special_tags`: those of `tags` that are single special tokens of the tokenizer (Qwen2.5's)."""
        offered = [t.function for t in structure.tools]
        tools = offered
        if isinstance(structure.tool_choice, NamedToolChoice):
            tools = [f for f in offered if f.name == structure.tool_choice.function.name]
        parts = tuple((f"tool {f.name!r}: its parameters schema", json.dumps(f.parameters)) for f in offered)
        return Constraint("grammar", _tools_grammar(structure, tools, special_tags, caps), parts)

    def written_by(self, chat_template: str) -> bool:
        """Whether a chat template asks the model for Hermes-tagged calls (it names the opening tag)."""
        return TOOL_OPEN in chat_template

    def parser(self, structure: Structure) -> "ToolCallStream":
        """The streaming call parser for a request that may call tools."""
        names = frozenset(t.function.name for t in structure.tools) if bare_calls_allowed(structure) else frozenset()
        return ToolCallStream(names)


HERMES = HermesFormat()


def _tools_grammar(structure: Structure, tools: list, special_tags: frozenset[str], caps: SchemaCaps) -> str:
    """Hermes-format calls of the offered `tools` (the named one only, if named); at most one call when
    `parallel_tool_calls` is False."""
    choice = structure.tool_choice or "auto"
    if choice == "none":  # tools are described in the prompt, but no call may start
        return ("start: TEXT\n"
                f"TEXT: /(?s:.*)/ & ~/(?s:.*){_regex_literal(TOOL_OPEN)}(?s:.*)/\n")
    for f in tools:  # each on its own first: the hoisting below then recurses no deeper than the caps
        check_schema(f.parameters, caps)
    schema = _calls_schema(tools, loosen=bare_calls_allowed(structure))
    check_schema(schema, caps)
    body = f"body: {json_lexeme(schema)}\n"
    open_tag, close_tag = (f"<{t[1:-1]}>" if t in special_tags else json.dumps(t) for t in (TOOL_OPEN, TOOL_CLOSE))
    call = f'call: {open_tag} "\\n" body "\\n" {close_tag}\n'
    several = structure.parallel_tool_calls is not False
    repeat = "*" if several else "?"
    if bare_calls_allowed(structure):  # text, tagged calls in it, or bare call objects, constrained too
        bare = 'bare: body ("\\n" body)*\n' if several else "bare: body\n"
        bare += 'TEXT: /([^{](.|\\n)*)?/\n'  # text never starts like a bare call
        if TOOL_OPEN in special_tags:  # text cannot hold a special token: the tag itself starts a call
            return f"start: TEXT (call TEXT){repeat} | bare\n" + call + body + bare
        end = "TEXT" if several else "LAST"  # after the one call, text with no tag (it would start another)
        last = "" if several else f"LAST: /([^{{](.|\\n)*)?/ & ~/(?s:.*){_regex_literal(TOOL_OPEN)}(?s:.*)/\n"
        return (f"start: (call_head call_tail){repeat} {end} | bare\n"
                f"call_head[lazy]: TEXT {open_tag}\n"
                f'call_tail: "\\n" body "\\n" {close_tag}\n' + body + bare + last)
    calls = 'call ("\\n" call)*' if several and not isinstance(choice, NamedToolChoice) else "call"
    return f'start: {calls} "\\n"?\n' + call + body  # the model may end its last call with a newline


def _calls_schema(tools: list, loosen: bool) -> dict:
    """One call object of the tools: `{"name": …, "arguments": …}` with each tool's parameters as its
    arguments; their `$defs` / `definitions` hoisted to the root (as `<tool name>:<name>`; a name
    holds no colon) and their local `$ref`s rewritten, so pydantic's nested models work one level down.
    `loosen` (tool_choice auto): a schema keyword the grammar engine does not implement (Claude Code sends
    `propertyNames`) is left out of that tool's arguments, which the grammar then holds to the rest of its
    schema, instead of the whole request failing."""
    hoisted: dict = {}
    variants = []
    for f in tools:
        arguments, definitions = hoist_defs(loosened(f.parameters) if loosen else f.parameters, f.name)
        hoisted.update(definitions)
        variants.append({"type": "object", "properties": {"name": {"const": f.name}, "arguments": arguments},
                         "required": ["name", "arguments"], "additionalProperties": False})
    schema = {"anyOf": variants} if len(variants) > 1 else variants[0]
    return {**schema, "$defs": hoisted} if hoisted else schema


def _regex_literal(text: str) -> str:
    return re.escape(text).replace("/", "\\/")


def parse_call(body: str) -> ToolCall:
    """A ToolCall (with a fresh id) from the JSON between the tags; ValueError unless {"name": str, "arguments": {…}}.

    Any text either parses or raises ValueError (nesting deeper than json_text.MAX_DEPTH included).
    """
    return _call(loads(body))


def _call(data: Any) -> ToolCall:
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
    rest, _ = stream.finish()
    content = shown + rest
    return (content.strip() if calls else content), calls


class ToolCallStream:
    """Splits streamed text into text deltas and whole tool calls (one delta per call, when it closes).

    Text that might be the start of TOOL_OPEN is held back until it is clear. A call still open
    when the stream ends is returned as text by `finish` (it never parsed). Each block that stays text
    (it does not parse, or was cut off) is also listed in `unparsed`.

    With `names` (the offered tools), an answer that is one bare or ```json-fenced call object
    of an offered tool also counts as a call: small models (Qwen2.5-Coder among them) often answer
    a tool request that way instead of with the tags. Such an answer is held back whole and
    decided at `finish`; it is not constrained by the grammar, so its arguments are as the model wrote them.
    """

    def __init__(self, names: frozenset[str] = frozenset()) -> None:
        self._names = names
        self._pending = ""
        self._in_call = False
        self._bare: bool | None = None if names else False  # None: too early to tell
        self.unparsed: list[UnparsedCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Add a text delta; return (text to show now, calls completed by it)."""
        self._pending += text
        if self._bare is None:
            start = self._pending.lstrip()
            if any(prefix.startswith(start) for prefix in _BARE_STARTS):
                return "", []
            self._bare = start.startswith(_BARE_STARTS)
        if self._bare:
            return "", []
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
                    self.unparsed.append(_unparsed(body, "not a JSON object with a name and arguments"))
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

    def finish(self) -> tuple[str, list[ToolCall]]:
        """When the stream ends: the text still held back, and a bare call if the answer was one."""
        if self._in_call:
            self.unparsed.append(_unparsed(self._pending, "the call was cut off before its end"))
        rest = (TOOL_OPEN if self._in_call else "") + self._pending
        self._pending, self._in_call = "", False
        if self._bare is not False:
            calls = _bare_calls(rest.strip().removeprefix("```json").removesuffix("```").strip())
            if calls and all(call.name in self._names for call in calls):
                return "", calls
        return rest, []


_BARE_STARTS = ("{", "```json")
_NAME = re.compile(r'"name"\s*:\s*"([^"]*)"')


def _unparsed(body: str, error: str) -> UnparsedCall:
    """A block between the tags that is not a call: the name it seems to give, its text, and why."""
    name = _NAME.search(body)
    return UnparsedCall(name=name.group(1) if name else None, arguments=body.strip(), error=error)


def _bare_calls(text: str) -> list[ToolCall]:
    """The call objects of a bare answer (one or more, separated by whitespace); [] if it is anything else."""
    try:
        return [_call(data) for data in loads_objects(text)]
    except ValueError:
        return []


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
