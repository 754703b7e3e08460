"""Tools and structured output on the wire: the structure options (`StructureOptions`, declared once for the
wire, the clients, the HTTP front and the adapters), OpenAI-shaped specs and the calls a model made (no torch).

The daemon renders `tools` with the target's chat template; the model's tool-call format
(fly_llm.common.tool_formats) turns them into the constraint the engine compiles and reads the calls back
out of the text. Everything here is validated data, so clients import it too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

MAX_TOOLS = 128
"""Most tools one request may offer."""

_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"


MAX_DESCRIPTION = 1 << 17
"""Characters of one tool's description: agents' are long (Claude Code's Bash tool: 18,780); what bounds a
request is its prompt's tokens and its body's bytes, this only a pathological field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionSpec(_Strict):
    """A function the model may call: its name, what it does and a JSON Schema of its arguments."""

    name: str = Field(pattern=_NAME)
    description: str = Field("", max_length=MAX_DESCRIPTION)
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
_TOOL_CHOICE: TypeAdapter[ToolChoice | None] = TypeAdapter(ToolChoice | None)


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


class UnparsedCall(_Strict):
    """A call the model began that did not parse (its text stays in the answer): the name it seems to
    give, if any, its text, and why it is not a call."""

    name: str | None = None
    arguments: str
    error: str


class FormatOptions(_Strict):
    """The structure options for a prompt or chat messages alike (see `StructureOptions`)."""

    response_format: ResponseFormat | None = None


class StructureOptions(FormatOptions):
    """The options that constrain a request's output, declared once.

    The wire request (`fly_llm.common.protocol.GenerateRequest`) and the HTTP bodies inherit these fields,
    the clients take them as keywords (`STRUCTURE_OPTIONS`, checked by `option_names`) and the
    adapters merge them with `fly_llm.client.core.call_options`. A new option is one field here
    (in `FormatOptions` when a plain prompt takes it too) plus its meaning where the output is
    constrained (fly_llm.common.tool_formats); `Structure` checks the fields together.
    """

    tools: list[ToolSpec] | None = Field(None, description=f"At most {MAX_TOOLS} (a request's size cap).")
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = Field(
        None, description="False: at most one call per answer (None, True: any number).")


STRUCTURE_OPTIONS: tuple[str, ...] = tuple(StructureOptions.model_fields)
"""The clients' keywords next to sampling and FLy options; `FormatOptions`' fields among them."""


def option_names(options: Mapping[str, Any]) -> None:
    """TypeError naming the keywords of `options` that are no structure option (the clients' and adapters' check)."""
    if unknown := set(options) - set(STRUCTURE_OPTIONS):
        raise TypeError(f"unknown option(s) {sorted(unknown)}; accepted: {', '.join(STRUCTURE_OPTIONS)}")


def structure_options(model: BaseModel) -> dict[str, Any]:
    """The structure options that `model` (a wire request, an HTTP body) declares, by name, as it holds them."""
    return {name: getattr(model, name) for name in STRUCTURE_OPTIONS if name in type(model).model_fields}


class Structure(StructureOptions):
    """What constrains one request's output (what the engine compiles): the structure options, checked together."""

    @model_validator(mode="after")
    def _consistent(self) -> "Structure":
        names = [t.function.name for t in self.tools or ()]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate tool names: {', '.join(duplicates)}")
        choice = self.tool_choice
        if choice not in (None, "auto", "none") and not names:
            raise ValueError("tool_choice needs tools")
        _check_offered(choice, names)
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


def _check_offered(choice: ToolChoice | None, names: list[str]) -> None:
    """ValueError unless a choice naming a function names one of the offered tools."""
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ValueError(f"tool_choice names the unknown tool {choice.function.name!r} (offered: {names})")


_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def closed_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of a JSON Schema in which an object that lists `properties` allows no other key, unless it says so.

    JSON Schema lets such an object carry any further key, and a model decoding under that grammar
    may wander into made-up keys until it runs out of tokens. An object that states
    `additionalProperties` or `patternProperties`, and an object without `properties` (a free
    dict), keep their meaning. Only schema positions are walked, never `enum`, `const` or defaults.
    """
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_schema(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(sub) for sub in out[key]]
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = closed_schema(out[key])
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out \
            and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def closed_tool(spec: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI-style tool dict whose parameters are closed (`closed_schema`); any other shape as it is."""
    function = spec.get("function")
    if isinstance(function, dict) and isinstance(function.get("parameters"), dict):
        return {**spec, "function": {**function, "parameters": closed_schema(function["parameters"])}}
    return spec


def schema_format(schema: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    """The json_schema response format of a JSON Schema, its objects closed (`closed_schema`), named if `name`."""
    fmt = {"type": "json_schema", "schema": closed_schema(schema)}
    return fmt if name is None else {**fmt, "name": name}


def tool_choice_for(choice: Any, names: list[str]) -> str | dict | None:
    """A framework's tool_choice in the wire form: "auto", "none", "required" or a named function.

    "any" and True mean "required" (LangChain's and Anthropic's word), a bare name of an offered
    tool names that tool, None and False leave it unset; anything else is a ValueError listing
    what would do.
    """
    if choice is None or choice is False:
        return None
    if choice is True or choice == "any":
        return "required"
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, str) and choice in names:
        return {"type": "function", "function": {"name": choice}}
    if isinstance(choice, dict):
        return choice
    raise ValueError(f"unknown tool_choice {choice!r}: use 'auto', 'none', 'required' (or 'any'), or the name "
                     f"of an offered tool ({', '.join(names) or 'none offered'})")


def offer_tools(tools: list[dict], choice: Any = None) -> dict[str, Any]:
    """The `tools` and `tool_choice` options for a framework's tool list and its choice (`tool_choice_for`),
    checked as the daemon will; a ValueError names the tool or the choice and why.

    Catches bad names and shapes and a choice naming no offered tool before anything is sent.
    Duplicate names are refused when a request is built (frameworks bind lists they never send),
    and whether a schema compiles to a grammar only the daemon knows (its BAD_REQUEST names the tool).
    """
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list of tools, not {type(tools).__name__}")
    names = [_tool(i, tool).function.name for i, tool in enumerate(tools)]
    wire = tool_choice_for(choice, names)
    try:
        _check_offered(_TOOL_CHOICE.validate_python(wire), names)
    except ValidationError as exc:
        raise ValueError(f"tool_choice {wire!r}: {_reason(exc)}") from None
    return {"tools": tools} if wire is None else {"tools": tools, "tool_choice": wire}


def _tool(i: int, tool: Any) -> ToolSpec:
    """The i-th offered tool validated; ValueError naming it."""
    try:
        return ToolSpec.model_validate(tool)
    except ValidationError as exc:
        name = (tool.get("function") or {}).get("name") if isinstance(tool, dict) else None
        raise ValueError(f"tool {name or f'#{i}'!r}: {_reason(exc)}") from None


def _reason(exc: ValidationError) -> str:
    """The first problem of a validation error, with where it is."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ()))
    message = err.get("msg", "invalid").removeprefix("Value error, ")
    return f"{where}: {message}" if where else message
