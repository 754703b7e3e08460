"""Ollama's API shapes (docs/daemon.md, "Ollama API"): the bodies of /api/chat and /api/generate, their
translation into one `fly_llm.common.protocol.GenerateRequest`, and answers, stream lines and model cards in
Ollama's shape. The routes are fly_daemon.http.ollama_routes.

`options` carry Ollama's sampling options that FLy has (num_predict, temperature, top_p, top_k, min_p,
repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty, seed, stop, num_ctx checked against the
context window), FLy's own options (k, window, entropy_threshold, loose) and the structure options Ollama
has no field for (tool_choice, parallel_tool_calls, response_format; `fly_llm.common.tools.StructureOptions`),
all validated where the wire request validates them. Ollama's load-time options (num_gpu, num_thread, ...)
change no output and are ignored; a sampler FLy does not have (typical_p, tfs_z, mirostat) is accepted only
at the value that turns it off; any other option is refused, so a typo never passes silently.
"""

from __future__ import annotations

import hashlib
import re
import time
import uuid
from abc import ABC, abstractmethod
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fly_llm.common.options import build_options, checked
from fly_llm.common.config import FLyOverrides
from fly_llm.common.errors import BadRequest, FLyError
from fly_llm.common.fim import FimTokens, Infill
from fly_llm.common.protocol import GenerateRequest, GenerateResult, TokenChunk
from fly_llm.common.stats import FinishReason
from fly_llm.common.tools import STRUCTURE_OPTIONS, ToolCall, closed_tool, schema_format

from fly_daemon.http.common import Answer, Event, ndjson_line
from fly_daemon.http.shared_fields import SAMPLER_SETTINGS, SAMPLERS_OFF, LlamaSamplers, Strict, check_sampler_off
from fly_daemon.model_info import ModelInfo, served_id

OLLAMA_VERSION = "0.9.0"
"""The Ollama release whose API these routes follow (GET /api/version): streamed tool calls (0.8), `think` (0.9)."""
LOAD_OPTIONS = frozenset({"numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
                          "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep"})
"""Ollama options about loading and running a model on the hardware: accepted and ignored (they change no output)."""
FLY_OPTIONS: tuple[str, ...] = (*FLyOverrides.model_fields, *(n for n in STRUCTURE_OPTIONS if n != "tools"))
"""FLy's options an Ollama request may add to `options` (`tools` is Ollama's own field)."""
NO_LIMIT = (-1, -2)
"""Ollama's num_predict for 'no limit' and 'fill the context'."""


class Options(LlamaSamplers):
    """An Ollama request's `options`: those FLy honours as fields, FLy's own and the ignored ones as extras."""

    model_config = ConfigDict(extra="allow")

    num_predict: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    num_ctx: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _known(self) -> "Options":
        for name, value in (self.model_extra or {}).items():
            if name in SAMPLERS_OFF:
                check_sampler_off(name, value)
            elif name not in (*LOAD_OPTIONS, *SAMPLER_SETTINGS, *FLY_OPTIONS):
                raise ValueError(f"unknown option {name!r}; FLy's own: {', '.join(FLY_OPTIONS)}")
        return self

    def extras(self, names: tuple[str, ...]) -> dict[str, Any]:
        """The extra options among `names` that are set."""
        return {n: v for n, v in (self.model_extra or {}).items() if n in names and v is not None}


class OllamaToolCall(Strict):
    """A call in an assistant turn, in Ollama's shape (arguments an object; `id` and `index` optional)."""

    class Function(Strict):
        name: str
        arguments: dict[str, Any] | str = Field(default_factory=dict)
        index: int | None = None

    id: str | None = None
    type: Literal["function"] = "function"
    function: Function


class OllamaMessage(Strict):
    """A chat turn in Ollama's shape. A tool result names its tool (`tool_name`) or the call it answers
    (`tool_call_id`, as LangChain sends it); `thinking` is accepted and not sent to the model."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    images: list[str] | None = Field(None, description="Refused unless empty: the served models read text only.")
    thinking: str | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None

    def to_protocol(self, turn: int) -> dict[str, Any]:
        """The turn as fly_llm.common.protocol.ChatMessage fields; a call without an id gets `call_<turn>_<i>`."""
        if self.images:
            raise BadRequest("images: the served models read text only")
        message: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id or f"call_{turn}_{i}", "type": "function",
                                      "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                     for i, c in enumerate(self.tool_calls)]
        if self.tool_name is not None:
            message["name"] = self.tool_name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class Served(BaseModel):
    """What a request is translated against: the served model's context window, the max_tokens that
    Ollama's 'no limit' stands for, and whether the target has a chat template."""

    context_window: int
    no_limit_tokens: int
    chat_template: bool


class OllamaBody(Strict, ABC):
    """The fields /api/chat and /api/generate share. `keep_alive` is accepted and ignored (the models
    stay loaded); `think` and `logprobs` are refused when asked for."""

    model: str = Field(min_length=1)
    stream: bool = True
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: Options | None = None
    keep_alive: float | str | None = None
    think: bool | Literal["low", "medium", "high"] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @model_validator(mode="after")
    def _refused(self) -> "OllamaBody":
        if self.think not in (None, False):
            raise ValueError("think: the served model does not think (leave it out or set it to false)")
        if self.logprobs or self.top_logprobs:
            raise ValueError("logprobs: not served on the Ollama routes")
        return self

    @property
    @abstractmethod
    def loads_only(self) -> bool:
        """Ollama's 'load the model' request (no prompt, no messages): answered at once, nothing generated."""

    def to_generate(self, request_id: str, served: Served) -> GenerateRequest:
        """The wire request this body asks for; BadRequest / TooLong (naming the field) if it is not valid."""
        options = self.options or Options()
        if options.num_ctx is not None and options.num_ctx > served.context_window:
            raise BadRequest(f"options.num_ctx {options.num_ctx} is over the model's context window of "
                             f"{served.context_window} tokens")
        structure = options.extras(STRUCTURE_OPTIONS)
        if self.format not in (None, ""):
            if "response_format" in structure:
                raise BadRequest("give either format or options.response_format, not both")
            structure["response_format"] = {"type": "json_object"} if self.format == "json" else \
                schema_format(self.format)
        limit = options.num_predict
        sampling, fly = build_options(
            max_tokens=served.no_limit_tokens if limit is None or limit in NO_LIMIT else limit,
            temperature=options.temperature, top_p=options.top_p, top_k=options.top_k, min_p=options.min_p,
            repetition_penalty=options.repeat_penalty, repeat_last_n=options.repeat_last_n,
            presence_penalty=options.presence_penalty, frequency_penalty=options.frequency_penalty,
            seed=options.seed, stop=[options.stop] if isinstance(options.stop, str) else options.stop,
            **options.extras(tuple(FLyOverrides.model_fields)))
        with checked():
            return GenerateRequest(id=request_id, sampling=sampling, fly=fly, stream=self.stream, **structure,
                                   **self._source(served))

    @abstractmethod
    def _source(self, served: Served) -> dict[str, Any]:
        """The prompt or the chat messages (and tools), as GenerateRequest fields."""

    @abstractmethod
    def _payload(self, text: str, calls: list[tuple[int, ToolCall]]) -> dict[str, Any]:
        """The answer's text (and tool calls with their index), as this route's field."""

    # ---- answers ----

    def head(self) -> dict[str, Any]:
        """The fields every answer and line of one request share: the model as asked for, the time."""
        return {"model": self.model, "created_at": datetime.now(timezone.utc).isoformat()}

    def line(self, head: dict[str, Any], text: str, calls: list[tuple[int, ToolCall]] = ()) -> dict[str, Any]:
        """One stream line: new text and the tool calls completed with it."""
        return {**head, **self._payload(text, list(calls)), "done": False}

    def final(self, head: dict[str, Any], result: GenerateResult, started_ns: int, text: str = "",
              calls: list[tuple[int, ToolCall]] = ()) -> dict[str, Any]:
        """The last line of a stream (no text), or with the whole `text` and `calls` the one answer of
        `stream: false`: done, why, the counts and durations in ns, and FLy's counters as `fly_stats`."""
        first = result.time_to_first_token_s or 0.0
        return {**head, **self._payload(text, list(calls)), "done": True,
                "done_reason": done_reason(result.finish_reason),
                "total_duration": time.perf_counter_ns() - started_ns, "load_duration": 0,
                "prompt_eval_count": result.usage.prompt_tokens, "prompt_eval_duration": _ns(first),
                "eval_count": result.usage.completion_tokens,
                "eval_duration": _ns(max(result.elapsed_s - first, 0.0)), "fly_stats": result.stats.model_dump()}

    def whole(self, head: dict[str, Any], result: GenerateResult, started_ns: int) -> dict[str, Any]:
        """The one answer of `stream: false`."""
        return self.final(head, result, started_ns, result.text, list(enumerate(result.tool_calls)))

    def loaded(self, head: dict[str, Any]) -> dict[str, Any]:
        """The answer to a 'load the model' request."""
        return {**head, **self._payload("", []), "done": True, "done_reason": "load"}


class ChatBody(OllamaBody):
    """POST /api/chat: the messages go through the target's chat template; `tools` as OpenAI's and Ollama's,
    their parameters closed as `format`'s schema is (`fly_llm.common.tools.closed_schema`: no keys beyond those listed)."""

    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None

    @property
    def loads_only(self) -> bool:
        return not self.messages

    def _source(self, served: Served) -> dict[str, Any]:
        return {"messages": [m.to_protocol(i) for i, m in enumerate(self.messages)],
                "tools": None if self.tools is None else [closed_tool(t) for t in self.tools]}

    def _payload(self, text: str, calls: list[tuple[int, ToolCall]]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = [ollama_tool_call(call, index) for index, call in calls]
        return {"message": message}


class GenerateBody(OllamaBody):
    """POST /api/generate: the prompt (with `system`) through the chat template, or as it is with `raw`
    or when the target has no template; with a `suffix`, the middle between prompt and suffix (the target's
    FIM tokens, no chat template, as Ollama's `{{ if .Suffix }}` templates do). `template`, `context` and
    `images` are refused."""

    prompt: str = ""
    system: str | None = None
    raw: bool = False
    suffix: str | None = Field(None, description=(
        "Fill in the middle between prompt and suffix (empty: none, as in Ollama)."))
    template: str | None = Field(None, description="Refused unless empty: the target's chat template is used.")
    context: list[int] | None = Field(None, description="Refused unless empty: send the conversation to /api/chat.")
    images: list[str] | None = Field(None, description="Refused unless empty: the served models read text only.")

    @model_validator(mode="after")
    def _unserved(self) -> "GenerateBody":
        if self.suffix and self.system:
            raise ValueError("system is not served with suffix (fill-in-the-middle uses no chat template)")
        for name, why in (("template", "the target's chat template is used"),
                          ("context", "send the conversation to /api/chat as messages"),
                          ("images", "the served models read text only")):
            if getattr(self, name):
                raise ValueError(f"{name}: not served ({why})")
        return self

    @property
    def loads_only(self) -> bool:
        return not (self.prompt or self.suffix)

    def _source(self, served: Served) -> dict[str, Any]:
        if self.suffix:
            return {"infill": Infill(prefix=self.prompt, suffix=self.suffix)}
        if self.raw or not served.chat_template:
            if self.system:
                raise BadRequest("system needs the chat template (not with raw, nor a target without one)")
            return {"prompt": self.prompt}
        system = [{"role": "system", "content": self.system}] if self.system else []
        return {"messages": [*system, {"role": "user", "content": self.prompt}]}

    def _payload(self, text: str, calls: list[tuple[int, ToolCall]]) -> dict[str, Any]:
        return {"response": text}


class OllamaAnswer(Answer):
    """A chat or generate request's answer (the door contract): whole, or NDJSON lines of new text and tool calls
    and a last one with the counts; a request that only loads the model is answered at once; an error after the
    stream began is a last `{"error", "code"}` line."""

    media_type = "application/x-ndjson"

    def __init__(self, body: OllamaBody, served: Served) -> None:
        """`body` asked of the model `served` describes."""
        self.started = time.perf_counter_ns()
        self.body, self.stream, self.head = body, body.stream, body.head()
        self.request = None if body.loads_only else body.to_generate(f"ollama-{uuid.uuid4().hex}", served)
        self.calls = 0  # tool calls sent so far: the next one's index

    def requests(self) -> list[GenerateRequest]:
        return [] if self.request is None else [self.request]

    def whole(self, results: list[GenerateResult]) -> dict[str, Any]:
        return self.body.whole(self.head, results[0], self.started) if results else self.body.loaded(self.head)

    def chunk(self, index: int, chunk: TokenChunk) -> list[Event]:
        calls = list(enumerate(chunk.tool_calls, self.calls))
        self.calls += len(calls)
        return [self.body.line(self.head, chunk.text, calls)] if chunk.text or calls else []

    def final(self, index: int, result: GenerateResult, results: list[GenerateResult] | None) -> list[Event]:
        return [self.body.final(self.head, result, self.started)]

    def failure(self, error: FLyError, status: int) -> list[Event]:
        return [ollama_error(error, status)]

    def frame(self, event: Event) -> str:
        return ndjson_line(event)


def ollama_error(error: FLyError, status: int) -> dict[str, str]:
    """Ollama's error shape, with our stable code (fly_llm.common.errors) as `code` (the status is the answer's
    alone: an `ErrorShape` takes it)."""
    return {"error": error.message, "code": error.code}


class ShowBody(BaseModel):
    """POST /api/show: the model (older clients call it `name`); other fields are accepted and not used."""

    model: str | None = None
    name: str | None = None

    @property
    def asked(self) -> str:
        if not (self.model or self.name):
            raise BadRequest("model: give the model's name")
        return self.model or self.name


def show_template(chat_template: str, fim: FimTokens | None) -> str:
    """/api/show's `template`: the chat template, inside an Ollama `{{ if .Suffix }}` branch that fills in the
    middle with the target's FIM tokens where it has them (how clients such as Continue tell FIM is served)."""
    if fim is None:
        return chat_template
    prefix, suffix, middle = fim.names
    return (f"{{{{- if .Suffix }}}}{prefix}{{{{ .Prompt }}}}{suffix}{{{{ .Suffix }}}}{middle}"
            f"{{{{- else }}}}{chat_template}{{{{- end }}}}")


def capabilities(chat_template: str, fim: FimTokens | None) -> list[str]:
    """/api/show's `capabilities`: completion; tools with a chat template; insert (Ollama's FIM) with FIM tokens."""
    return ["completion", *(["tools"] if chat_template else []), *(["insert"] if fim is not None else [])]


def ollama_tool_call(call: ToolCall, index: int) -> dict[str, Any]:
    """A tool call in Ollama's shape (arguments an object), with its id and index in the answer."""
    return {"id": call.id, "function": {"index": index, "name": call.name, "arguments": call.arguments}}


def done_reason(finish: FinishReason) -> str:
    """Ollama's done_reason: 'length' at the token limit, else 'stop' (Ollama says 'stop' after tool calls too)."""
    return "length" if finish == "length" else "stop"


def same_model(asked: str, served: str) -> bool:
    """Whether a request's model names the served one: its id (Ollama's implicit ':latest' tag allowed), the path
    it was loaded from, or its Ollama-style alias (`ollama_alias`: `qwen2.5-coder:1.5b`), any case."""
    names = {served.lower(), f"{served.lower()}:latest"}
    alias = ollama_alias(served)
    return (asked.lower() in (names if alias is None else names | {alias})
            or served_id(asked).lower() == served.lower())


_FAMILY_SIZE = re.compile(r"^(?P<family>.+?)-(?P<size>\d+(?:\.\d+)?[bm])(?:-|$)", re.IGNORECASE)


def ollama_alias(name: str) -> str | None:
    """The Ollama library's name of a model served as `name`: family and size as a tag, lower case
    (`Qwen2.5-Coder-1.5B-Instruct-Q4_K_M` is `qwen2.5-coder:1.5b`); None when the name says no size."""
    found = _FAMILY_SIZE.match(name)
    return None if found is None else f"{found['family']}:{found['size']}".lower()


def model_card(model: ModelInfo, started: float) -> dict[str, Any]:
    """The served target as /api/tags and /api/ps list a model: name, size in bytes, digest, details."""
    arch = model.architecture
    return _card(model.name, started, model.size_bytes,
                 {"format": "gguf" if model.name.endswith(".gguf") else "safetensors", "family": arch,
                  "families": [arch], "parameter_size": _size(model.parameter_count),
                  "quantization_level": model.quantization.upper()})


def embedding_card(name: str, started: float) -> dict[str, Any]:
    """The embedding model as /api/tags lists it, loaded or not (clients pick it from the list before the first
    request loads it): its size and family are not known before, so 0 and ''; it runs in float32."""
    return _card(name, started, 0, {"format": "safetensors", "family": "", "families": [], "parameter_size": "",
                                    "quantization_level": "F32"})


def _card(name: str, started: float, size: int, details: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "model": name, "modified_at": datetime.fromtimestamp(started, timezone.utc).isoformat(),
            "size": size, "digest": hashlib.sha256(name.encode()).hexdigest(),
            "details": {"parent_model": "", **details}}


def _size(count: int) -> str:
    """A parameter count as Ollama writes it: 1.5B, 494M."""
    return f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.0f}M" if count >= 1e6 else f"{count / 1e3:.0f}K"


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
