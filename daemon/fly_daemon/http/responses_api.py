"""OpenAI's Responses API (POST /v1/responses) as one chat request: the body we serve and its translation into a
`fly_llm.common.protocol.GenerateRequest`, so the chat route's grammar, tools, size caps and error codes apply.
The answer's shape and its stream's events: fly_daemon.http.responses_stream.

Stateless: nothing is stored, so `store: true`, `previous_response_id`, `conversation`, `prompt` and
`background: true` are refused (400 BAD_REQUEST saying so); the client sends the whole conversation as `input`.
`input` is a string (one user turn) or input items: messages (roles user/system/developer/assistant; content a
string or `input_text` / `output_text` / `refusal` parts), `function_call` items (the calls an earlier answer
made) and `function_call_output` items (their results). `instructions` is a system turn before them; function
`tools` (and Codex's `namespace` tools, shown to the model as `namespace.name`), `tool_choice`,
`parallel_tool_calls` and `text.format` (text, json_object, json_schema: decoded under the grammar) are the chat
route's structure options; `max_output_tokens`, `temperature`, `top_p` and FLy's options (extra body fields) are
its sampling options. What Codex CLI sends with every request and has no meaning here is accepted and not used:
`reasoning` (answered without reasoning), `client_metadata`, `text.verbosity`, hosted tools (not given to the
model). Any other field is a 400 naming it, as on the chat route.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator

from fly_llm.common.options import build_options, checked
from fly_llm.common.protocol import GenerateRequest

from fly_daemon.http.responses_stream import ResponseShaper
from fly_daemon.http.shared_fields import FLyFields, Strict

STATELESS = ("previous_response_id", "conversation", "prompt", "background")
"""Fields that need a stored response, conversation or prompt (or a stored run): refused unless empty."""
UNSERVED = {"top_logprobs": "log-probabilities are not served here (POST /v1/chat/completions has them)",
            "max_tool_calls": "calls are not capped (use tool_choice)"}
"""Other fields refused unless empty, with why."""
HOSTED_TOOLS = ("web_search", "web_search_preview", "web_search_preview_2025_03_11", "file_search", "code_interpreter",
                "image_generation", "computer_use_preview", "local_shell", "custom", "mcp", "tool_search")
"""Tools OpenAI's servers run or a client runs in a shape other than a function call (Codex sends web_search with
every request): not given to the model, which calls only function tools here; one named by tool_choice is a 400."""
NAMESPACE_SEPARATOR = "."
"""Between a namespace's name and its tool's in the name the model sees (`collaboration.spawn_agent`)."""


class TextPart(Strict):
    """A text part of a message: `input_text`, or `output_text` of an earlier answer sent back (its
    annotations and log-probabilities are accepted and not used)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class RefusalPart(Strict):
    """A refusal an earlier answer made, sent back: its text is the turn's text."""

    type: Literal["refusal"]
    refusal: str

    @property
    def text(self) -> str:
        return self.refusal


Part = Annotated[Union[TextPart, RefusalPart], Field(discriminator="type")]


class MessageItem(Strict):
    """A message input item (`type` may be left out); an earlier answer's message item is accepted as it came."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Part]
    id: str | None = None
    status: str | None = None
    phase: str | None = None

    def turn(self) -> dict[str, Any]:
        """The item as fly_llm.common.protocol.ChatMessage fields (parts joined; 'developer' is 'system')."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class FunctionCallItem(Strict):
    """A call an earlier answer made: `call_id` is what its result names; `arguments` JSON text; a namespace's
    tool names its `namespace` too."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None
    id: str | None = None
    status: str | None = None

    def call(self) -> dict[str, Any]:
        """The call as fly_llm.common.protocol.MessageToolCall fields (named as the model saw its tool)."""
        name = self.name if self.namespace is None else f"{self.namespace}{NAMESPACE_SEPARATOR}{self.name}"
        return {"id": self.call_id, "type": "function", "function": {"name": name, "arguments": self.arguments}}


class FunctionCallOutputItem(Strict):
    """The result of the call `call_id`: text, or text parts (the call's `name` and `namespace`, which Codex sends
    with it, are accepted: `call_id` says which call it answers)."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    name: str | None = None
    namespace: str | None = None
    id: str | None = None
    status: str | None = None

    def turn(self) -> dict[str, Any]:
        text = self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)
        return {"role": "tool", "tool_call_id": self.call_id, "content": text}


def _item_type(item: Any) -> Any:
    """An input item's `type`; a message may leave it out."""
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", None)


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")]],
                      Discriminator(_item_type)]


class FunctionTool(Strict):
    """A function tool, in the Responses API's flat shape."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def specs(self, prefix: str = "") -> list[dict[str, Any]]:
        """The tool as fly_llm.common.tools.ToolSpec fields, its name after `prefix` (a namespace's)."""
        function: dict[str, Any] = {"name": prefix + self.name, "description": self.description or "",
                                    "strict": self.strict}
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return [{"type": "function", "function": function}]


class NamespaceTool(Strict):
    """A namespace of function tools (Codex groups MCP and collaboration tools so): each is given to the model as
    `namespace.name`, and its calls are answered with the namespace and the tool's own name apart."""

    type: Literal["namespace"]
    name: str
    description: str | None = None
    tools: list[FunctionTool] = Field(max_length=128)

    def specs(self) -> list[dict[str, Any]]:
        """The namespace's tools as fly_llm.common.tools.ToolSpec fields, named as the model sees them."""
        return [spec for tool in self.tools for spec in tool.specs(self.name + NAMESPACE_SEPARATOR)]


class HostedTool(BaseModel):
    """A tool of HOSTED_TOOLS (its other fields are that tool's settings): accepted, not given to the model."""

    model_config = ConfigDict(extra="allow")

    type: Literal[HOSTED_TOOLS]  # type: ignore[valid-type]

    def specs(self) -> list[dict[str, Any]]:
        """None: the model is not offered it."""
        return []


def _tool_type(tool: Any) -> Any:
    """A tool's `type`: function, namespace, or any hosted one."""
    kind = tool.get("type") if isinstance(tool, dict) else getattr(tool, "type", None)
    return "hosted" if kind in HOSTED_TOOLS else kind


Tool = Annotated[Union[Annotated[FunctionTool, Tag("function")], Annotated[NamespaceTool, Tag("namespace")],
                       Annotated[HostedTool, Tag("hosted")]], Discriminator(_tool_type)]


class Reasoning(Strict):
    """`reasoning`: how much a reasoning model may think (Codex sends it, `none` included) — accepted and answered
    without reasoning, as the served models do not reason."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed", "none"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class NamedFunction(Strict):
    """tool_choice naming one function: {"type": "function", "name": ...}."""

    type: Literal["function"]
    name: str


class TextFormat(Strict):
    """`text.format`: free text, any JSON object, or JSON valid under `schema` (`strict` and `description`
    are accepted: the grammar holds the output to the schema either way)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> "TextFormat":
        if (self.type == "json_schema") != (self.schema_ is not None):
            raise ValueError("text.format: a 'schema' goes with type 'json_schema' (and only with it)")
        return self

    def response_format(self) -> dict[str, Any]:
        """The format as a fly_llm.common.tools.ResponseFormat."""
        if self.type == "json_schema":
            return {"type": "json_schema", "schema": self.schema_, "name": self.name}
        return {"type": self.type}


class TextConfig(Strict):
    """`text`: its format (`verbosity` accepted, as Codex sends it: the served models have no such knob)."""

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class StreamOptions(Strict):
    """Accepted and not used: deltas are sent without obfuscation padding."""

    include_obfuscation: bool | None = None


class ResponsesRequest(FLyFields):
    """POST /v1/responses (stateless), served as one chat request."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    model: str
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    tools: list[Tool] | None = Field(None, max_length=512)
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool | None = Field(None, description="false (or left out): nothing is stored; true is refused.")
    include: list[Literal["reasoning.encrypted_content"]] | None = Field(
        None, description="Accepted: there is no reasoning to include.")
    truncation: Literal["disabled"] | None = None
    metadata: dict[str, str] | None = Field(None, description="Echoed in the answer, not used.")
    client_metadata: dict[str, str] | None = Field(None, max_length=64, description=(
        "Accepted and not used (Codex sends its installation and session ids with every request)."))
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = Field(None, description="Accepted: the prefix cache needs no key.")
    service_tier: Literal["auto", "default"] | None = None
    previous_response_id: Any = None
    conversation: Any = None
    prompt: Any = None
    background: Any = None
    reasoning: Reasoning | None = None
    top_logprobs: Any = None
    max_tool_calls: Any = None

    @field_validator("store")
    @classmethod
    def _nothing_stored(cls, store: bool | None) -> bool | None:
        if store:
            raise ValueError("store: true is not supported: this server stores no responses (send store: false, or "
                             "leave it out, and the whole conversation as input)")
        return store

    @field_validator(*STATELESS)
    @classmethod
    def _stateless(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in (None, False, "", {}, []):
            raise ValueError(f"{info.field_name} is not supported: this server stores no responses, conversations or "
                             "prompts, and runs none in the background (send the whole conversation as input)")
        return value

    @field_validator(*UNSERVED)
    @classmethod
    def _unserved(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in (None, {}, []):
            raise ValueError(f"{info.field_name} is not supported: {UNSERVED[info.field_name]}")
        return value

    @model_validator(mode="after")
    def _choice_names_a_served_tool(self) -> "ResponsesRequest":
        if isinstance(self.tool_choice, NamedFunction) and self.tool_choice.name not in self.tool_names():
            raise ValueError(f"tool_choice: {self.tool_choice.name!r} is not one of the function tools served here "
                             "(hosted tools such as web_search are not)")
        return self

    def tool_specs(self) -> list[dict[str, Any]] | None:
        """The function tools (a namespace's named `namespace.name`) as ToolSpec fields; hosted tools are left out."""
        return None if self.tools is None else [spec for tool in self.tools for spec in tool.specs()]

    def tool_names(self) -> set[str]:
        """The names of the tools the model may call."""
        return {spec["function"]["name"] for spec in self.tool_specs() or []}

    def namespaced(self, name: str) -> tuple[str | None, str]:
        """(namespace, tool name) of a called tool: a namespace's tool apart from its namespace, else (None, name)."""
        for tool in self.tools or []:
            if isinstance(tool, NamespaceTool) and name.startswith(tool.name + NAMESPACE_SEPARATOR):
                child = name[len(tool.name) + len(NAMESPACE_SEPARATOR):]
                if any(t.name == child for t in tool.tools):
                    return tool.name, child
        return None, name

    def chat_messages(self) -> list[dict[str, Any]]:
        """`instructions` and `input` as chat turns; a call item joins the assistant turn just before it."""
        turns: list[dict[str, Any]] = [] if self.instructions is None else [
            {"role": "system", "content": self.instructions}]
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, FunctionCallItem):
                if not turns or turns[-1]["role"] != "assistant":
                    turns.append({"role": "assistant", "content": ""})
                turns[-1].setdefault("tool_calls", []).append(item.call())
            else:
                turns.append(item.turn())
        return turns

    def to_generate(self, request_id: str, max_tokens_limit: int) -> GenerateRequest:
        """The wire request this body asks for: without `max_output_tokens` (Codex CLI never sends it) until the
        context ends or a stop, i.e. the daemon's limit, and never above it; BadRequest / TooLong (naming the
        field) if it is not valid."""
        wanted = self.max_output_tokens
        sampling, fly = build_options(max_tokens=max_tokens_limit if wanted is None else min(wanted, max_tokens_limit),
                                      temperature=self.temperature,
                                      top_p=self.top_p, **self.fly_options())
        choice = self.tool_choice
        if isinstance(choice, NamedFunction):
            choice = {"type": "function", "function": {"name": choice.name}}
        text_format = self.text.format if self.text is not None else None
        with checked():
            return GenerateRequest(
                id=request_id, sampling=sampling, fly=fly, stream=self.stream, messages=self.chat_messages(),
                tools=self.tool_specs(), tool_choice=choice,
                parallel_tool_calls=self.parallel_tool_calls,
                response_format=None if text_format is None else text_format.response_format())

    def shaper(self, model: str) -> ResponseShaper:
        """A new answer of `model` to this request."""
        return ResponseShaper(self.echo(), self.namespaced, model)

    def echo(self) -> dict[str, Any]:
        """The settings of this request that its `response` object repeats."""
        choice = self.tool_choice if isinstance(self.tool_choice, str) or self.tool_choice is None else \
            self.tool_choice.model_dump()
        text_format = self.text.format if self.text is not None and self.text.format is not None else None
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "parallel_tool_calls": self.parallel_tool_calls is not False,
                "temperature": self.temperature, "top_p": self.top_p,
                "text": {"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format
                         else {"type": "text"}},
                "tool_choice": choice or "auto", "tools": [t.model_dump() for t in self.tools or ()],
                "metadata": self.metadata or {}, "user": self.user}
