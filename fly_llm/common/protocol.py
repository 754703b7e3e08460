"""Wire messages between clients and the daemon (docs/design.md §4): pydantic models as JSON, never pickle.

Every frame is one JSON object with the protocol version `v`, a message `kind` and a request `id`
chosen by the client. One DEALER socket carries many concurrent requests; replies carry the id of
the request they answer. Requests: generate, cancel, heartbeat, info, health, status, tokenize.
Replies: chunk (streamed text), result, error, info, health, status, tokenize.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator
from pydantic_core import ErrorDetails, PydanticCustomError, from_json

from fly_llm.common.config import FLyConfig, FLyOverrides, SamplingParams
from fly_llm.common.errors import BadRequest, TooLong
from fly_llm.common.fim import Infill
from fly_llm.common.json_text import loads
from fly_llm.common.stats import FinishReason, GrammarCacheStats, PromptStats, RequestStats
from fly_llm.common.tools import (
    MAX_TOOLS, Structure, StructureOptions, ToolCall, ToolSpec, UnparsedCall, structure_options,
)

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 4 * 1024 * 1024
"""Default cap on one frame; the daemon may configure a smaller one."""
MAX_PROMPT_CHARS = 1024 * 1024
"""Most characters in a prompt, a tokenize text, or all chat messages' contents together (beyond: TOO_LONG)."""
MAX_MESSAGES = 1024
"""Most chat messages in one request (beyond: TOO_LONG)."""
MAX_TOP_LOGPROBS = 20
"""Most alternatives per token a request may ask log-probabilities of (OpenAI's cap)."""
MAX_CHOICES = 16
"""Most choices (OpenAI's `n`) one API request may ask for."""

RequestId = Annotated[str, Field(min_length=1, max_length=128)]
UNKNOWN_ID = "-"
"""The id of an ErrorReply to a frame whose own id could not be read."""


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    v: Literal[1] = PROTOCOL_VERSION
    id: RequestId


class MessageToolCall(BaseModel):
    """A call an assistant turn made, in OpenAI's shape; `arguments` as a JSON object or its JSON text."""

    model_config = ConfigDict(extra="forbid")

    class Function(BaseModel):
        model_config = ConfigDict(extra="forbid")

        name: str = Field(min_length=1, max_length=64)
        arguments: dict[str, Any] | str = Field(default_factory=dict)

    id: str = Field(min_length=1, max_length=128)
    type: Literal["function"] = "function"
    function: Function

    @model_validator(mode="before")
    @classmethod
    def _from_flat(cls, data: Any) -> Any:
        """Also accept a ToolCall as results carry it: {"id", "name", "arguments"}."""
        if isinstance(data, dict) and "name" in data and "function" not in data:
            return {"id": data.get("id"), "type": "function",
                    "function": {"name": data["name"], "arguments": data.get("arguments", {})}}
        return data

    @model_validator(mode="after")
    def _parse_arguments(self) -> "MessageToolCall":
        arguments = self.function.arguments
        if isinstance(arguments, str):
            try:
                arguments = loads(arguments) if arguments.strip() else {}
            except ValueError as exc:
                raise ValueError(f"tool call {self.id}: arguments are not JSON: {exc}") from None
            if not isinstance(arguments, dict):
                raise ValueError(f"tool call {self.id}: arguments must be a JSON object")
            self.function.arguments = arguments
        return self

    def for_template(self) -> dict:
        """The call as chat templates read it (arguments as an object)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": self.function.arguments}}


class ChatMessage(BaseModel):
    """One chat turn; the daemon renders a list of them with the target's chat template.

    An assistant turn may carry the `tool_calls` it made; a `tool` turn carries a result and the
    `tool_call_id` of the call it answers.
    """

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    tool_calls: list[MessageToolCall] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(None, max_length=128)
    name: str | None = Field(None, max_length=64)

    @model_validator(mode="before")
    @classmethod
    def _null_content(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("content", "") is None:  # OpenAI: an assistant turn with only calls
            return {**data, "content": ""}
        return data

    def for_template(self) -> dict:
        """The turn as chat templates read it."""
        turn: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            turn["tool_calls"] = [c.for_template() for c in self.tool_calls]
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            turn["name"] = self.name
        return turn


def _check_messages(messages: list[ChatMessage] | None) -> None:
    """Raise a size error (TOO_LONG on the wire) when the messages' contents exceed MAX_PROMPT_CHARS together."""
    total = sum(len(m.content) for m in messages or ())
    if total > MAX_PROMPT_CHARS:
        raise PydanticCustomError("too_long", "messages hold {total} characters, over the limit of {limit}",
                                  {"total": total, "limit": MAX_PROMPT_CHARS})


def _check_tools(tools: list[ToolSpec] | None) -> None:
    """Raise a size error (TOO_LONG on the wire) when more than MAX_TOOLS tools are offered."""
    if tools is not None and len(tools) > MAX_TOOLS:
        raise PydanticCustomError("too_long", "tools: {count} offered, over the limit of {limit}",
                                  {"count": len(tools), "limit": MAX_TOOLS})


def _check_tool_results(messages: list[ChatMessage] | None) -> None:
    """Every tool result answers a call that an earlier assistant turn made."""
    calls: set[str] = set()
    for i, m in enumerate(messages or ()):
        calls.update(c.id for c in m.tool_calls or ())
        if m.role == "tool" and m.tool_call_id is not None and m.tool_call_id not in calls:
            raise ValueError(f"messages[{i}] is a tool result for the unknown call {m.tool_call_id!r}")
        if m.tool_calls and m.role != "assistant":
            raise ValueError(f"messages[{i}]: only assistant turns carry tool_calls")


# ---- requests (client → daemon) ----

class GenerateRequest(_Message, StructureOptions):
    """Generate from a prompt string, from chat messages or by filling in the middle (exactly one of them), its
    output constrained by the structure options (`fly_llm.common.tools.StructureOptions`: tools, tool_choice,
    response_format, ...)."""

    kind: Literal["generate"] = "generate"
    prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    infill: Infill | None = Field(None, description="Fill in the middle (fly_llm.common.fim): the target's FIM "
                                  "tokens, no chat template; FIM_UNSUPPORTED for a target without them.")
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    fly: FLyOverrides = Field(default_factory=FLyOverrides)
    stream: bool = False
    timeout_s: float | None = Field(None, gt=0, le=86_400, description="Deadline from admission.")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description=(
        "Report the target's log-probability of each emitted token and of this many top alternatives."))
    prompt_logprobs: bool = Field(False, description="With logprobs: report those of the prompt's tokens too.")
    choices: int = Field(1, ge=1, le=MAX_CHOICES, description=(
        "How many choices of one API request (OpenAI's `n`) this is one of: the daemon bounds the reply size of "
        "all of them together (`fly_daemon.scheduling.request_weight`)."))

    @model_validator(mode="after")
    def _one_input(self) -> "GenerateRequest":
        _check_tools(self.tools)
        if self.prompt_logprobs and self.logprobs is None:
            raise ValueError("prompt_logprobs needs logprobs (how many alternatives per token)")
        if sum(x is not None for x in (self.prompt, self.messages, self.infill)) != 1:
            raise ValueError("give exactly one of 'prompt', 'messages' or 'infill'")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt must not be empty")
        if self.tools and self.messages is None:
            raise ValueError("tools need chat messages (the chat template renders them)")
        _check_messages(self.messages)
        _check_tool_results(self.messages)
        if self.infill is not None and self.infill.chars > MAX_PROMPT_CHARS:
            raise PydanticCustomError("too_long", "infill holds {total} characters, over the limit of {limit}",
                                      {"total": self.infill.chars, "limit": MAX_PROMPT_CHARS})
        self.structure  # noqa: B018 - validates the structure options together
        return self

    @property
    def structure(self) -> Structure | None:
        """What constrains the output (the structure options, checked together), or None when no option is given."""
        options = structure_options(self)
        return None if all(value is None for value in options.values()) else Structure(**options)


class CancelRequest(_Message):
    """Cancel the in-flight request whose id is `id`."""

    kind: Literal["cancel"] = "cancel"


class HeartbeatRequest(_Message):
    """The client is still waiting for the requests in `ids` (sent while requests are open).

    The daemon answers each heartbeat with a HealthReply carrying the heartbeat's own `id`, so a
    client learns that the daemon is alive even while a long request produces nothing yet.
    """

    kind: Literal["heartbeat"] = "heartbeat"
    ids: list[RequestId] = Field(default_factory=list, max_length=4096)


class InfoRequest(_Message):
    kind: Literal["info"] = "info"


class HealthRequest(_Message):
    kind: Literal["health"] = "health"


class StatusRequest(_Message):
    kind: Literal["status"] = "status"


class TokenizeRequest(_Message):
    """Count/encode text (or chat messages and the tools offered, through the chat template) with the
    daemon's tokenizer: the prompt a GenerateRequest with the same messages and tools would have.
    Or decode `token_ids` back to text (the reply's `text`)."""

    kind: Literal["tokenize"] = "tokenize"
    text: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_MESSAGES)
    tools: list[ToolSpec] | None = None
    token_ids: list[int] | None = Field(None, max_length=MAX_PROMPT_CHARS)
    add_special: bool = True
    """With `text`: add the tokenizer's special tokens (BOS where it has one), as a prompt gets them."""

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        _check_tools(self.tools)
        if sum(x is not None for x in (self.text, self.messages, self.token_ids)) != 1:
            raise ValueError("give exactly one of 'text', 'messages' or 'token_ids'")
        if self.tools and self.messages is None:
            raise ValueError("tools need chat messages (the chat template renders them)")
        _check_messages(self.messages)
        return self


Request = Annotated[
    Union[GenerateRequest, CancelRequest, HeartbeatRequest, InfoRequest, HealthRequest, StatusRequest,
          TokenizeRequest],
    Field(discriminator="kind"),
]

# ---- replies (daemon → client) ----

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = 0
    """Prompt tokens served from the daemon's prefix cache instead of being prefilled (OpenAI's meaning)."""


class TopLogprob(BaseModel):
    """A token and the target's log-probability of it at a position (log-softmax of the raw logits:
    temperature 1, before any sampling filter or grammar mask)."""

    token_id: int
    token: str
    logprob: float | None
    """None only for a prompt's first token (nothing precedes it)."""


class TokenLogprob(TopLogprob):
    """An emitted (or prompt) token's log-probability, with the most likely tokens at its position."""

    top: list[TopLogprob] = Field(default_factory=list)


class TokenChunk(_Message):
    """New text of a streamed request (stop strings already held back / removed)."""

    kind: Literal["chunk"] = "chunk"
    text: str
    token_ids: list[int] = Field(default_factory=list)
    tool_calls: list[ToolCall] = Field(default_factory=list)
    """Calls completed in this chunk (each arrives whole, once its closing tag is decoded)."""
    logprobs: list[TokenLogprob] | None = None
    """Of `token_ids`, when the request asked for logprobs."""


class GenerateResult(_Message):
    """The final answer to a generate request (streamed or not)."""

    kind: Literal["result"] = "result"
    text: str
    """The text outside tool calls (all of it when the request offered no tools)."""
    token_ids: list[int]
    finish_reason: FinishReason
    tool_calls: list[ToolCall] = Field(default_factory=list)
    invalid_tool_calls: list[UnparsedCall] = Field(default_factory=list)
    """Calls the model began that did not parse (their text stays in `text`), when the request offered tools."""
    usage: Usage
    stats: RequestStats = Field(default_factory=RequestStats)
    model: str = ""
    time_to_first_token_s: float | None = None
    elapsed_s: float = 0.0
    logprobs: list[TokenLogprob] | None = None
    """Of `token_ids`, when the request asked for logprobs."""
    prompt_logprobs: list[TokenLogprob] | None = None
    """Of every prompt token (the first with logprob None), when the request asked for prompt_logprobs."""


class ErrorReply(_Message):
    """A request failed; `code` is one of fly_llm.common.errors' stable codes."""

    kind: Literal["error"] = "error"
    code: str
    message: str


class InfoReply(_Message):
    kind: Literal["info"] = "info"
    version: str
    protocol: int = PROTOCOL_VERSION
    target: str
    draft: str | None
    context_window: int
    max_tokens_limit: int
    max_prompt_tokens: int
    device: str
    dtype: str
    target_quantization: str = "none"
    """Weights of the target as it runs: none, int8, int4 or w4a8 (docs/models.md)."""
    draft_quantization: str = "none"
    fly_defaults: FLyConfig
    sampling_defaults: SamplingParams
    chat_template: bool = False
    """The target's tokenizer has a chat template, so `messages` work (False from older daemons)."""
    fill_in_middle: bool = False
    """The target's tokenizer has FIM tokens (fly_llm.common.fim), so `infill` works (False from older daemons)."""


HealthState = Literal["loading", "ready", "draining", "failed"]


class HealthReply(_Message):
    kind: Literal["health"] = "health"
    state: HealthState
    detail: str = ""


class StatusReply(_Message):
    """What `fly-daemon status` prints: state, models, load and acceptance so far."""

    kind: Literal["status"] = "status"
    state: HealthState
    pid: int
    uptime_s: float
    target: str | None = None
    draft: str | None = None
    queue_depth: int = 0
    active: int = 0
    max_batch_size_seen: int = 0
    requests_total: int = 0
    tokens_generated: int = 0
    tokens_per_s: float = 0.0
    stats: RequestStats = Field(default_factory=RequestStats)
    prompt: PromptStats = Field(default_factory=PromptStats)
    """Prompt tokens so far, the prefix cache's hit rate and size."""
    grammars: GrammarCacheStats = Field(default_factory=GrammarCacheStats)
    """The grammar caches' bytes and budgets."""


class TokenizeReply(_Message):
    kind: Literal["tokenize"] = "tokenize"
    token_ids: list[int]
    count: int
    text: str | None = None
    """The decoded text, when the request gave `token_ids`."""


Reply = Annotated[
    Union[TokenChunk, GenerateResult, ErrorReply, InfoReply, HealthReply, StatusReply, TokenizeReply],
    Field(discriminator="kind"),
]

_REQUEST = TypeAdapter(Request)
_REPLY = TypeAdapter(Reply)


def encode(message: BaseModel) -> bytes:
    """Serialise one message to a JSON frame."""
    return message.model_dump_json().encode()


def decode_request(frame: bytes, max_bytes: int = MAX_FRAME_BYTES) -> GenerateRequest | CancelRequest | \
        HeartbeatRequest | InfoRequest | HealthRequest | StatusRequest | TokenizeRequest:
    """Parse a client frame; raises BadRequest (TooLong for a size cap, see `invalid`) on any bad input."""
    if len(frame) > max_bytes:
        raise BadRequest(f"frame of {len(frame)} bytes exceeds the limit of {max_bytes}")
    try:
        return _REQUEST.validate_json(frame)
    except ValidationError as exc:
        raise invalid(exc) from None


def decode_reply(frame: bytes) -> TokenChunk | GenerateResult | ErrorReply | InfoReply | HealthReply | \
        StatusReply | TokenizeReply:
    """Parse a daemon frame; raises BadRequest if the daemon sent something unreadable."""
    try:
        return _REPLY.validate_json(frame)
    except ValidationError as exc:
        raise BadRequest(f"unreadable reply from daemon: {_describe(_first_errors(exc))}") from None


_SIZE_ERRORS = frozenset({"too_long", "string_too_long"})


def invalid(exc: ValidationError) -> BadRequest:
    """The error for a failed validation: TooLong when every problem is a size cap, else BadRequest; its
    message names the first few problems, its `param` the first one's field."""
    errors = _first_errors(exc)
    too_long = all(err.get("type") in _SIZE_ERRORS for err in errors)
    return (TooLong if too_long else BadRequest)(_describe(errors), ".".join(map(str, errors[0]["loc"])) or None)


_SHOWN_ERRORS = 5
"""Problems named in an error message."""
_ERRORS_READ = 16_384
"""Characters of a ValidationError's JSON read back for its first problems (a few hundred each at most)."""


def _first_errors(exc: ValidationError) -> list[ErrorDetails]:
    """The first few of `exc`'s errors (type, loc, msg). Read back from a prefix of its JSON, which is written in
    native code at ~0.2 µs an error, not as Python objects (`errors()`, ~2 µs each): a body with a long array of
    wrong items has one per item per union branch, 180,000 of them for 60,000 items."""
    text = exc.json(include_url=False, include_context=False, include_input=False)
    errors = from_json(text[:_ERRORS_READ], allow_partial=True)
    return [error for error in errors[:_SHOWN_ERRORS] if "msg" in error] or errors[:1]


def _describe(errors: list[ErrorDetails]) -> str:
    """The errors, each with where it is."""
    parts = []
    for err in errors:
        where = ".".join(str(p) for p in err.get("loc", ())) or "frame"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)
