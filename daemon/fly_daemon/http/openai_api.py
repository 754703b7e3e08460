"""The OpenAI API's request and response shapes for the HTTP front (fly_daemon.http.app).

Requests are pydantic models of the fields we serve; unknown fields are errors (a typo, or an
OpenAI feature we do not have, is answered 400 with the field named, never ignored). Each request
becomes one `fly_llm.common.protocol.GenerateRequest` (`to_generate`), so its options are validated by the
same models, with the same size caps and error codes, as on the ZeroMQ socket. A field the wire
protocol gains is one more field here, passed on in `to_generate`; the structure options (tools,
tool_choice, response_format, ...) are declared once, in `fly_llm.common.tools.StructureOptions`, and come
with it: chat completions take them all, completions those of `FormatOptions`.

Responses are built as plain dicts in OpenAI's shape, with `usage` and, as an extra field,
`fly_stats` (the request's speculation counters: MAT, loose accepts, …); `Choices` is a completion's answer
as the front's door serves it (fly_daemon.http.door).
"""

from __future__ import annotations

import json
import time
import uuid
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from fly_llm.common.options import build_options, checked
from fly_llm.common.errors import FLyError
from fly_llm.common.fim import Infill
from fly_llm.common.protocol import (
    MAX_CHOICES, MAX_TOP_LOGPROBS, GenerateRequest, GenerateResult, MessageToolCall, TokenChunk, TokenLogprob,
    TopLogprob,
)
from fly_llm.common.stats import FinishReason, RequestStats
from fly_llm.common.tools import FormatOptions, StructureOptions, ToolCall, structure_options

from fly_daemon.http.common import Answer, Event, data_event, openai_error
from fly_daemon.http.shared_fields import FLyFields, Strict


class TextPart(Strict):
    """One part of a message's content; only text is served (no images or audio)."""

    type: Literal["text"]
    text: str


class Message(Strict):
    """A chat message. 'developer' is OpenAI's newer name for 'system'; `name` is accepted and not used.

    An assistant message may carry the `tool_calls` it made, a tool message the `tool_call_id` it answers.
    """

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    def to_protocol(self) -> dict[str, Any]:
        """The message as fly_llm.common.protocol.ChatMessage fields (text parts joined)."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or ())
        turn: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.tool_calls:
            turn["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
        return turn



class StreamOptions(Strict):
    include_usage: bool = False


class GenerationBody(FLyFields, ABC):
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
    presence_penalty: float | None = Field(None, description="-2..2: subtracted once from a repeated token's logit.")
    frequency_penalty: float | None = Field(None, description="-2..2: times a token's repeat count, subtracted.")
    top_k: int | None = Field(None, description="Extra body (vLLM, llama-server): the k most likely tokens only.")
    min_p: float | None = Field(None, description="Extra body: drop tokens under min_p × the most likely one's.")
    repetition_penalty: float | None = Field(None, description="Extra body (vLLM): CTRL's ratio for repeats.")
    repeat_last_n: int | None = Field(None, description="Extra body (llama-server): the tokens penalties count.")
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="Choices: sampled requests decoded together in the batch.")
    user: str | None = Field(None, description="OpenAI's end-user id: accepted, not used.")

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

    scores_only: ClassVar[bool] = False
    """Overridden where a body may ask for the prompt's scores and no completion (then no completion tokens)."""

    @property
    def asked_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    def to_generate(self, request_id: str, max_tokens_limit: int) -> GenerateRequest:
        """The wire request this body asks for: without max_tokens until the context ends or a stop (the daemon's
        `max_tokens_limit`, as llama-server and vLLM do); BadRequest / TooLong (naming the field) if it is not
        valid."""
        sampling, fly = build_options(
            max_tokens=self._wire_max_tokens(max_tokens_limit),
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, repeat_last_n=self.repeat_last_n, seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else self.stop, **self.fly_options())
        with checked():
            return GenerateRequest(id=request_id, sampling=sampling, fly=fly, stream=self.stream,
                                   **structure_options(self), **self._source(), **self._logprob_fields())

    def _wire_max_tokens(self, limit: int) -> int:
        return limit if self.asked_max_tokens is None else self.asked_max_tokens

    @abstractmethod
    def _logprob_fields(self) -> dict[str, Any]:
        """GenerateRequest's logprobs and prompt_logprobs, as this body asks for them."""

    def choice_requests(self, request_id: str, max_tokens_limit: int) -> list[GenerateRequest]:
        """One wire request per choice (`n`): ids `request_id` (n = 1) or `request_id-i`, seeds `seed + i`."""
        first = self.to_generate(request_id, max_tokens_limit)
        if self.n == 1:
            return [first]
        seeds = [None if self.seed is None else (self.seed + i) % 2**63 for i in range(self.n)]
        return [first.model_copy(update={"id": f"{request_id}-{i}", "choices": self.n,
                                         "sampling": first.sampling.model_copy(update={"seed": seed})})
                for i, seed in enumerate(seeds)]

    @abstractmethod
    def _source(self) -> dict[str, Any]:
        """The prompt or the chat messages, as GenerateRequest fields."""

    @abstractmethod
    def _choice(self, index: int, result: GenerateResult) -> dict[str, Any]:
        """Choice `index` of a whole response."""

    @abstractmethod
    def _delta(self, index: int, text: str | None, finish_reason: FinishReason | None,
               calls: list[tuple[int, ToolCall]], logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        """Choice `index` of a stream chunk: new text (None: the opening chunk), (index, call) pairs and
        the new tokens' log-probabilities, or the finish reason."""

    # ---- responses ----

    def response(self, head: dict[str, Any], results: list[GenerateResult]) -> dict[str, Any]:
        """The whole (non-streamed) response: one choice per result, their usage and speculation summed."""
        return {**head, "object": self.object_name, "choices": [self._choice(i, r) for i, r in enumerate(results)],
                "usage": openai_usage(results, completed=not self.scores_only),
                "fly_stats": merged_stats(results).model_dump()}

    def chunk(self, head: dict[str, Any], index: int = 0, text: str | None = None,
              final: GenerateResult | None = None, calls: list[tuple[int, ToolCall]] = (),
              usage: list[GenerateResult] | None = None, logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        """A stream chunk of choice `index`: the opening one (no text, see opens_with_role), new text and
        tool calls (with their index in the choice), or its `final` one.

        The final chunk of the last choice to finish carries the `usage` of all of them, unless the client
        asked for OpenAI's separate usage chunk (`stream_options.include_usage`, see `usage_chunk`): every
        stream reports its usage exactly once.
        """
        body = {**head, "object": self.chunk_object_name,
                "choices": [self._delta(index, text, final.finish_reason if final else None, list(calls), logprobs)]}
        if final is not None:
            body["fly_stats"] = final.stats.model_dump()
            if usage is not None and not self.include_usage:
                body["usage"] = openai_usage(usage)
        elif self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, head: dict[str, Any], results: list[GenerateResult]) -> dict[str, Any]:
        """OpenAI's last chunk with `stream_options.include_usage`: no choices, the usage."""
        return {**head, "object": self.chunk_object_name, "choices": [], "usage": openai_usage(results)}


def openai_usage(results: list[GenerateResult], completed: bool = True) -> dict[str, Any]:
    """The usage of one request's choices in OpenAI's shape: the prompt once (and its cached tokens, under
    prompt_tokens_details), the completion tokens of all choices (none unless `completed`)."""
    prompt, cached = results[0].usage.prompt_tokens, results[0].usage.cached_tokens
    completion = sum(r.usage.completion_tokens for r in results) if completed else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def merged_stats(results: list[GenerateResult]) -> RequestStats:
    """The speculation counters of one request's choices, summed."""
    total = RequestStats()
    for result in results:
        total.merge(result.stats)
    return total


def openai_tool_call(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """A tool call in OpenAI's shape (arguments as JSON text); `index` for stream deltas."""
    shaped = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
    return shaped if index is None else {"index": index, **shaped}


class ChatCompletionRequest(GenerationBody, StructureOptions):
    """POST /v1/chat/completions: the messages go through the target's chat template."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"
    opens_with_role = True

    messages: list[Message] = Field(min_length=1)
    logprobs: bool = Field(False, description="Report the target's log-probability of each emitted token.")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="With logprobs: alternatives per token.")

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def _source(self) -> dict[str, Any]:
        return {"messages": [m.to_protocol() for m in self.messages]}

    def _logprob_fields(self) -> dict[str, Any]:
        return {"logprobs": self.top_logprobs or 0} if self.logprobs else {}

    @staticmethod
    def _logprobs(entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        """OpenAI's chat logprobs: {content: [{token, logprob, bytes, top_logprobs}]}."""
        if entries is None:
            return None
        def one(e: TopLogprob) -> dict[str, Any]:
            return {"token": e.token, "logprob": e.logprob, "bytes": list(e.token.encode())}
        return {"content": [{**one(e), "top_logprobs": [one(t) for t in e.top]} for e in entries], "refusal": None}

    def _choice(self, index: int, result: GenerateResult) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": result.text}
        if result.tool_calls:
            message["content"] = result.text or None
            message["tool_calls"] = [openai_tool_call(c) for c in result.tool_calls]
        return {"index": index, "message": message, "finish_reason": result.finish_reason,
                "logprobs": self._logprobs(result.logprobs)}

    def _delta(self, index: int, text: str | None, finish_reason: FinishReason | None,
               calls: list[tuple[int, ToolCall]], logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        if finish_reason is not None:
            delta: dict[str, Any] = {}
        elif text is None:
            delta = {"role": "assistant", "content": ""}
        else:  # as OpenAI streams a call: no content beside it unless there is text
            delta = {"content": text} if text or not calls else {}
            if calls:
                delta["tool_calls"] = [openai_tool_call(call, i) for i, call in calls]
        return {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": self._logprobs(logprobs)}


class CompletionRequest(GenerationBody, FormatOptions):
    """POST /v1/completions: the model continues the prompt text (one prompt; a list of exactly one is accepted),
    or with `suffix` fills in what goes between the prompt and the suffix (the target's FIM tokens)."""

    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    prompt: str | list[str] = Field(description="A string, or a list holding one string.")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                 description="Report each token's log-probability and this many alternatives.")
    echo: bool = Field(False, description="The prompt before the completion (with logprobs: its tokens' too).")
    suffix: str | None = Field(None, description=(
        "The text after the completion: fill in the middle between prompt and suffix (FIM_UNSUPPORTED for a "
        "model without FIM tokens)."))

    @model_validator(mode="after")
    def _one_prompt(self) -> "CompletionRequest":
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise ValueError("prompt: give one string (several choices of it: n)")
        if self.suffix is not None and self.echo:
            raise ValueError("echo is not served with suffix (the completion goes between prompt and suffix)")
        if self.echo and self.stream:
            raise ValueError("echo is served without stream")
        if self.asked_max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 needs echo (it scores the prompt)")
        return self

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    @property
    def scores_only(self) -> bool:  # type: ignore[override]
        """max_tokens 0 with echo: the prompt (and its log-probabilities), no completion."""
        return self.asked_max_tokens == 0

    def _wire_max_tokens(self, limit: int) -> int:
        return 1 if self.scores_only else super()._wire_max_tokens(limit)  # scores only: one token decoded, dropped

    def _logprob_fields(self) -> dict[str, Any]:
        if self.logprobs is None:
            return {}
        return {"logprobs": self.logprobs, "prompt_logprobs": self.echo}

    def _logprobs(self, entries: list[TokenLogprob] | None, offset: int) -> dict[str, Any] | None:
        """OpenAI's completion logprobs: {tokens, token_logprobs, top_logprobs, text_offset}."""
        if entries is None:
            return None
        offsets = []
        for e in entries:
            offsets.append(offset)
            offset += len(e.token)
        return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [None if e.logprob is None else {t.token: t.logprob for t in e.top} for e in entries],
                "text_offset": offsets}

    def _source(self) -> dict[str, Any]:
        if self.suffix is not None:
            return {"infill": Infill(prefix=self.text, suffix=self.suffix)}
        return {"prompt": self.text}

    def _choice(self, index: int, result: GenerateResult) -> dict[str, Any]:
        text, logprobs = ("", []) if self.scores_only else (result.text, result.logprobs)
        if self.echo:
            text = self.text + text
            logprobs = None if logprobs is None else (result.prompt_logprobs or []) + logprobs
        offset = 0 if self.echo else len(self.text)
        return {"index": index, "text": text, "finish_reason": "length" if self.scores_only else result.finish_reason,
                "logprobs": self._logprobs(logprobs, offset)}

    def _delta(self, index: int, text: str | None, finish_reason: FinishReason | None,
               calls: list[tuple[int, ToolCall]], logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        return {"index": index, "text": text or "", "finish_reason": finish_reason,
                "logprobs": self._logprobs(logprobs, 0)}


class TokenizeBody(Strict):
    """POST /tokenize, as llama.cpp's server has it: the text's token ids (`add_special`: with BOS and the like)."""

    content: str
    add_special: bool = False


class DetokenizeBody(Strict):
    """POST /detokenize, as llama.cpp's server has it: the text of token ids."""

    tokens: list[int]


class Choices(Answer):
    """A chat or text completion's answer (the door contract): its `n` choices, whole or as data events ending in
    `[DONE]`; an error after the stream began is an `error` event in OpenAI's shape."""

    def __init__(self, body: GenerationBody, model: str, max_tokens_limit: int) -> None:
        """`body` asked of the served `model`; `max_tokens_limit`: what a body without max_tokens asks for."""
        self.body, self.stream, self.limit = body, body.stream, max_tokens_limit
        self.head = body.head(model)
        self.calls = [0] * body.n  # tool calls sent so far per choice: the next one's index

    def requests(self) -> list[GenerateRequest]:
        return self.body.choice_requests(self.head["id"], self.limit)

    def whole(self, results: list[GenerateResult]) -> dict[str, Any]:
        return self.body.response(self.head, results)

    def opening(self) -> list[Event]:
        return [self.body.chunk(self.head, i) for i in range(self.body.n)] if self.body.opens_with_role else []

    def chunk(self, index: int, chunk: TokenChunk) -> list[Event]:
        calls = list(enumerate(chunk.tool_calls, self.calls[index]))
        self.calls[index] += len(calls)
        return [self.body.chunk(self.head, index, chunk.text, calls=calls, logprobs=chunk.logprobs)]

    def final(self, index: int, result: GenerateResult, results: list[GenerateResult] | None) -> list[Event]:
        return [self.body.chunk(self.head, index, final=result, usage=results)]

    def closing(self, results: list[GenerateResult]) -> list[str]:
        usage = [self.frame(self.body.usage_chunk(self.head, results))] if self.body.include_usage else []
        return [*usage, "data: [DONE]\n\n"]

    def failure(self, error: FLyError, status: int) -> list[Event]:
        return [openai_error(error, status)]

    def frame(self, event: Event) -> str:
        return data_event(event)
