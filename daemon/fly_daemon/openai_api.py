"""The OpenAI API's request and response shapes for the HTTP front (fly_daemon.http).

Requests are pydantic models of the fields we serve; unknown fields are errors (a typo, or an
OpenAI feature we do not have, is answered 400 with the field named, never ignored). Each request
becomes one `fly_llm.protocol.GenerateRequest` (`to_generate`), so its options are validated by the
same models, with the same size caps and error codes, as on the ZeroMQ socket. A field the wire
protocol gains later (tools, response_format, …) is one more field here, passed on in `to_generate`.

Responses are built as plain dicts in OpenAI's shape, with `usage` and, as an extra field,
`fly_stats` (the request's speculation counters: MAT, loose accepts, …).
"""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fly_llm.client.core import build_options, checked
from fly_llm.errors import FLyError
from fly_llm.protocol import GenerateRequest, GenerateResult
from fly_llm.stats import FinishReason


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    """One part of a message's content; only text is served (no images or audio)."""

    type: Literal["text"]
    text: str


class Message(_Strict):
    """A chat message. 'developer' is OpenAI's newer name for 'system'; `name` is accepted and not used."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: str | None = None

    def to_protocol(self) -> dict[str, str]:
        """The message as fly_llm.protocol.ChatMessage fields (text parts joined)."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class StreamOptions(_Strict):
    include_usage: bool = False


class GenerationBody(_Strict, ABC):
    """The fields /v1/chat/completions and /v1/completions share; FLy's options are extra body fields."""

    object_name: ClassVar[str]
    chunk_object_name: ClassVar[str]
    id_prefix: ClassVar[str]
    opens_with_role: ClassVar[bool] = False
    """A stream starts with a chunk without text (OpenAI's chat streams announce the assistant's role)."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = Field(None, description="OpenAI's newer name for max_tokens.")
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: Literal[1] = Field(1, description="One choice per request.")
    user: str | None = Field(None, description="OpenAI's end-user id: accepted, not used.")
    k: int | None = Field(None, description="FLy: upper bound on draft tokens per round.")
    window: int | None = Field(None, description="FLy: deferred window W.")
    entropy_threshold: float | None = Field(None, description="FLy: entropy gate θ in nats.")
    loose: bool | None = Field(None, description="FLy: loose acceptance (false = exact, lossless SPD).")

    @model_validator(mode="after")
    def _one_max_tokens(self) -> "GenerationBody":
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens differ; give one of them")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def head(self, model: str) -> dict[str, Any]:
        """The fields every response and chunk of one request share; its `id` is new."""
        return {"id": f"{self.id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": model,
                "system_fingerprint": None}

    def to_generate(self, request_id: str) -> GenerateRequest:
        """The wire request this body asks for; BadRequest / TooLong (naming the field) if it is not valid."""
        sampling, fly = build_options(
            max_tokens=self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens,
            temperature=self.temperature, top_p=self.top_p, seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else self.stop,
            k=self.k, window=self.window, entropy_threshold=self.entropy_threshold, loose=self.loose)
        with checked():
            return GenerateRequest(id=request_id, sampling=sampling, fly=fly, stream=self.stream, **self._source())

    @abstractmethod
    def _source(self) -> dict[str, Any]:
        """The prompt or the chat messages, as GenerateRequest fields."""

    @abstractmethod
    def _choice(self, text: str, finish_reason: FinishReason | None) -> dict[str, Any]:
        """The one choice of a whole response."""

    @abstractmethod
    def _delta(self, text: str | None, finish_reason: FinishReason | None) -> dict[str, Any]:
        """The one choice of a stream chunk: new text (None: the opening chunk), or the finish reason."""

    # ---- responses ----

    def response(self, head: dict[str, Any], result: GenerateResult) -> dict[str, Any]:
        """The whole (non-streamed) response."""
        return {**head, "object": self.object_name, "choices": [self._choice(result.text, result.finish_reason)],
                "usage": result.usage.model_dump(), "fly_stats": result.stats.model_dump()}

    def chunk(self, head: dict[str, Any], text: str | None = None, final: GenerateResult | None = None,
              ) -> dict[str, Any]:
        """A stream chunk: the opening one (no text, see opens_with_role), new text, or the `final` one.

        The final chunk carries `usage` too, unless the client asked for OpenAI's separate usage chunk
        (`stream_options.include_usage`, see `usage_chunk`): every stream reports its usage exactly once.
        """
        body = {**head, "object": self.chunk_object_name,
                "choices": [self._delta(text, final.finish_reason if final else None)]}
        if final is not None:
            body["fly_stats"] = final.stats.model_dump()
            if not self.include_usage:
                body["usage"] = final.usage.model_dump()
        elif self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, head: dict[str, Any], result: GenerateResult) -> dict[str, Any]:
        """OpenAI's last chunk with `stream_options.include_usage`: no choices, the usage."""
        return {**head, "object": self.chunk_object_name, "choices": [], "usage": result.usage.model_dump()}


class ChatCompletionRequest(GenerationBody):
    """POST /v1/chat/completions: the messages go through the target's chat template."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"
    opens_with_role = True

    messages: list[Message] = Field(min_length=1)

    def _source(self) -> dict[str, Any]:
        return {"messages": [m.to_protocol() for m in self.messages]}

    def _choice(self, text: str, finish_reason: FinishReason | None) -> dict[str, Any]:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
                "logprobs": None}

    def _delta(self, text: str | None, finish_reason: FinishReason | None) -> dict[str, Any]:
        if finish_reason is not None:
            delta: dict[str, str] = {}
        elif text is None:
            delta = {"role": "assistant", "content": ""}
        else:
            delta = {"content": text}
        return {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}


class CompletionRequest(GenerationBody):
    """POST /v1/completions: the model continues the prompt text (one prompt; a list of exactly one is accepted)."""

    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    prompt: str | list[str] = Field(description="A string, or a list holding one string.")

    @model_validator(mode="after")
    def _one_prompt(self) -> "CompletionRequest":
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise ValueError("prompt: give one string (one choice per request)")
        return self

    def _source(self) -> dict[str, Any]:
        return {"prompt": self.prompt if isinstance(self.prompt, str) else self.prompt[0]}

    def _choice(self, text: str, finish_reason: FinishReason | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}

    def _delta(self, text: str | None, finish_reason: FinishReason | None) -> dict[str, Any]:
        return self._choice(text or "", finish_reason)


def error_body(error: FLyError, error_type: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape, with our stable code (fly_llm.errors) as `code`."""
    return {"error": {"message": error.message, "type": error_type, "param": param, "code": error.code}}
