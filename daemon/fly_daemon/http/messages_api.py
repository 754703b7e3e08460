"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) as one chat request: the bodies we
serve, their translation into a `fly_llm.common.protocol.GenerateRequest` (so the chat route's grammar, tools,
size caps and error codes apply). The answer, its stream's events and Anthropic's error shape:
fly_daemon.http.messages_stream.

`system` (a string or text blocks) is a system turn; `messages` alternate user and assistant turns whose
content is a string or blocks: `text`, `tool_use` (an assistant's calls) and `tool_result` (a user turn's
results, each a tool turn). `tools` (Anthropic's custom tools: `input_schema`) and `tool_choice` (auto, any,
tool, none; `disable_parallel_tool_use`) and `output_config.format` (a JSON schema) are the chat route's
structure options, decoded under the grammar; `max_tokens` (required), `stop_sequences`, `temperature`, `top_p`
and FLy's options (extra body fields) its sampling options. `top_k` is the sampler's top-k (a bad value is a 400
naming it). Refused (400): images, documents, thinking required (`enabled`; `adaptive` is answered without
thinking), server tools, and a last assistant turn (prefill: the chat template closes every turn). Accepted
and not used: `cache_control` (the prefix cache is automatic), `output_config.effort`, `context_management`,
and a "system" turn among the messages is a system turn in place (Claude Code sends all of these).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Field, model_validator

from fly_llm.common.options import build_options, checked
from fly_llm.common.protocol import GenerateRequest

from fly_daemon.http.messages_stream import MessageShaper
from fly_daemon.http.shared_fields import FLyFields, Strict


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = Field(None, description="Accepted, not used.")


class ToolUseBlock(Strict):
    """A call an assistant turn made."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(Strict):
    """The result of the call `tool_use_id`, in a user turn (`is_error` is accepted; the text says it)."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock], Field(discriminator="type")]


class AnthropicMessage(Strict):
    """One turn. Besides Anthropic's user and assistant turns, a "system" turn between them (Claude Code sends
    its reminders so) is a system turn in place: text only."""

    role: Literal["user", "assistant", "system"]
    content: str | list[Block]

    @model_validator(mode="after")
    def _blocks_in_place(self) -> "AnthropicMessage":
        """Each block in a turn that may carry it (a 400 when the body is read, not a fault when it is served)."""
        if isinstance(self.content, str):
            return self
        if self.role == "system" and not all(isinstance(b, TextBlock) for b in self.content):
            raise ValueError("a system turn carries text blocks only")
        misplaced, name = (ToolResultBlock, "tool_result") if self.role == "assistant" else (ToolUseBlock, "tool_use")
        if any(isinstance(b, misplaced) for b in self.content):
            raise ValueError(f"the {self.role} turn cannot carry {name} blocks")
        return self

    def turns(self) -> list[dict[str, Any]]:
        """The message as fly_llm.common.protocol.ChatMessage fields: an assistant turn with its calls, or a user
        turn's tool results (tool turns) and text (user turns), in their order; a system turn's text."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        if self.role == "system":
            return [{"role": "system", "content": "".join(b.text for b in self.content)}]
        if self.role == "assistant":
            turn: dict[str, Any] = {"role": "assistant",
                                    "content": "".join(b.text for b in self.content if isinstance(b, TextBlock))}
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                     for b in self.content if isinstance(b, ToolUseBlock)]
            return [{**turn, "tool_calls": calls}] if calls else [turn]
        turns: list[dict[str, Any]] = []
        for block in self.content:
            if isinstance(block, ToolResultBlock):
                turns.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text})
            elif turns and turns[-1]["role"] == "user":
                turns[-1]["content"] += block.text
            else:
                turns.append({"role": "user", "content": block.text})
        return turns


class AnthropicTool(Strict):
    """A custom tool: its name, what it does and a JSON Schema of its input."""

    type: Literal["custom"] | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None

    def spec(self) -> dict[str, Any]:
        """The tool as fly_llm.common.tools.ToolSpec fields."""
        return {"type": "function", "function": {"name": self.name, "description": self.description or "",
                                                 "parameters": self.input_schema, "strict": self.strict}}


class AnthropicToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self) -> "AnthropicToolChoice":
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice: a 'name' goes with type 'tool' (and only with it)")
        return self

    def wire(self) -> str | dict[str, Any]:
        """The choice as fly_llm.common.tools.ToolChoice."""
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"any": "required"}.get(self.type, self.type)


class Thinking(Strict):
    """{"type": "disabled"}, or "adaptive" (the model thinks only if it wants to: Claude Code sends it on every
    request), which the served models answer without thinking. "enabled" (thinking required) is refused."""

    type: Literal["disabled", "adaptive"]


class JsonOutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Strict):
    """`output_config`: the answer as JSON valid under `format.schema`; `effort` is accepted and ignored (the
    served models do not reason: every effort is the same answer)."""

    format: JsonOutputFormat | None = None
    effort: Literal["low", "medium", "high", "max"] | None = None


class Conversation(Strict):
    """What a Messages request and a count_tokens request share: the model, the turns and the tools."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = Field(None, description="Accepted: the prefix cache is automatic.")
    context_management: dict[str, Any] | None = Field(
        None, description="Accepted, not used: nothing is cleared from a context the client sends whole.")

    def chat_messages(self) -> list[dict[str, Any]]:
        """`system` and the messages as chat turns (a list of text blocks joined)."""
        system = self.system if isinstance(self.system, str) or self.system is None else \
            "".join(b.text for b in self.system)
        turns = [] if system is None else [{"role": "system", "content": system}]
        return turns + [turn for message in self.messages for turn in message.turns()]

    def tool_specs(self) -> list[dict[str, Any]] | None:
        return None if self.tools is None else [t.spec() for t in self.tools]


class CountTokensRequest(Conversation):
    """POST /v1/messages/count_tokens: the prompt's tokens, with the tools offered, as a request would have them."""


class MessagesRequest(Conversation, FLyFields):
    """POST /v1/messages, served as one chat request."""

    max_tokens: int = Field(ge=1, description="Required, as Anthropic requires it.")
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, description="The sampler's top-k; validated where the sampling options are built.")
    metadata: dict[str, Any] | None = Field(None, description="Accepted, not used.")
    service_tier: Literal["auto", "standard_only"] | None = None

    @model_validator(mode="after")
    def _no_prefill(self) -> "MessagesRequest":
        if self.messages[-1].role == "assistant":
            raise ValueError("messages: the last turn is the assistant's (a prefill), which is not supported: "
                             "end with a user turn")
        return self

    def to_generate(self, request_id: str, max_tokens_limit: int) -> GenerateRequest:
        """The wire request this body asks for, `max_tokens` capped at the daemon's limit (Claude Code asks for
        32,000); BadRequest / TooLong (naming the field) if it is not valid."""
        sampling, fly = build_options(max_tokens=min(self.max_tokens, max_tokens_limit), temperature=self.temperature, top_p=self.top_p,
                                      top_k=self.top_k, stop=self.stop_sequences, **self.fly_options())
        choice = self.tool_choice
        output = self.output_config.format if self.output_config is not None else None
        with checked():
            return GenerateRequest(
                id=request_id, sampling=sampling, fly=fly, stream=self.stream, messages=self.chat_messages(),
                tools=self.tool_specs(), tool_choice=None if choice is None else choice.wire(),
                parallel_tool_calls=False if choice is not None and choice.disable_parallel_tool_use else None,
                response_format=None if output is None else {"type": "json_schema", "schema": output.schema_})

    def shaper(self, model: str) -> MessageShaper:
        """A new answer of `model` to this request."""
        return MessageShaper(model)

