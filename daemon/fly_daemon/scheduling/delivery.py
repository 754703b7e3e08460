"""Delivery, the scheduler's third room: what comes out of the engine turned into replies (as vLLM's
output processor does).

One `OutputState` per request in the engine turns each step's `RequestOutput` into its streamed
`TokenChunk` and, at the end, its `GenerateResult`: the text, its tokens' log-probabilities with each
token's text, the tool calls split from the text (the model's tool format's parser,
`fly_llm.common.tool_formats`, wrapped in fly_daemon.scheduling.call_text) and the timings. `Delivery` owns what
all requests share: the replies' sender, the metrics and counters, and the failures' replies.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import TYPE_CHECKING

from pydantic import BaseModel

from fly_llm.common.errors import FLyError
from fly_llm.common.protocol import (
    ErrorReply, GenerateRequest, GenerateResult, TokenChunk, TokenLogprob, TopLogprob, Usage,
)
from fly_llm.common.stats import PromptStats, RequestStats
from fly_llm.common.tool_formats import ToolFormat
from fly_llm.common.tools import ToolCall

from fly_daemon.metrics import Metrics
from fly_daemon.scheduling.call_text import CallText

if TYPE_CHECKING:
    from fly_llm.decoding.engine import FLyEngine, RequestOutput

Envelope = tuple[bytes, ...]
"""The ROUTER routing frames of one client socket."""
LOCAL: Envelope = ()
"""The envelope of requests submitted from inside the process (fly_daemon.inproc): no routing frames, so it
is never a socket's, and no heartbeats (their owner cancels them when it stops waiting)."""
Emit = Callable[[Envelope, BaseModel], None]
"""Sends a reply to the client behind an envelope (thread-safe)."""


@dataclass(eq=False)
class OutputState:
    """One request's output so far, from joining the engine to its result."""

    envelope: Envelope
    request: GenerateRequest
    submitted: float
    prompt_ids: list[int]  # kept only when the request asks for its prompt's log-probabilities
    call_text: CallText | None  # set when the request may call tools: splits calls from text
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of token_ids, when the request asks
    sent: int = 0  # token_ids (and logprobs) already streamed
    prompt_logprobs: list[TokenLogprob] | None = None
    content: list[str] = field(default_factory=list)  # text outside tool calls
    calls: list[ToolCall] = field(default_factory=list)
    first_token_at: float | None = None
    last_token_at: float | None = None

    def chunk(self, text: str, calls: list[ToolCall]) -> TokenChunk:
        """The stream's next chunk: `text` and `calls` with the tokens (and log-probabilities) not yet sent."""
        asked = self.request.logprobs is not None
        chunk = TokenChunk(id=self.request.id, text=text, token_ids=self.token_ids[self.sent:], tool_calls=calls,
                           logprobs=self.logprobs[self.sent:] if asked else None)
        self.sent = len(self.token_ids)
        return chunk

    def result(self, out: "RequestOutput", now: float, model: str) -> GenerateResult:
        """The request's result once `out` finished it."""
        reason = out.finish_reason or "stop"
        if self.calls and reason == "stop":
            reason = "tool_calls"
        completion = len(self.token_ids)
        return GenerateResult(
            id=self.request.id, text="".join(self.content), token_ids=self.token_ids, finish_reason=reason,
            tool_calls=self.calls, invalid_tool_calls=self.call_text.invalid if self.call_text else [],
            usage=Usage(prompt_tokens=out.prompt_tokens, completion_tokens=completion,
                        total_tokens=out.prompt_tokens + completion, cached_tokens=out.cached_tokens),
            stats=out.stats, model=model,
            time_to_first_token_s=None if self.first_token_at is None else self.first_token_at - self.submitted,
            elapsed_s=now - self.submitted, logprobs=self.logprobs if self.request.logprobs is not None else None,
            prompt_logprobs=self.prompt_logprobs)


class Delivery:
    """Turns the engine's outputs into replies sent with `emit`, and answers failed requests; records
    `metrics` and counts requests and tokens. Thread-safe counters; `update` runs on the model thread."""

    def __init__(self, emit: Emit, metrics: Metrics) -> None:
        self.emit = emit
        self.metrics = metrics
        self.stats = RequestStats()
        self.prompt_stats = PromptStats()
        self._requests_total = 0
        self._tokens_generated = 0
        self._counting = threading.Lock()
        self._engine: FLyEngine | None = None
        self._tool_format: ToolFormat | None = None
        self._texts: dict[int, str] = {}  # token id -> its text, at most the vocabulary
        self._last_prompt: tuple[list, list[TokenLogprob]] | None = None  # the engine's list, named

    @property
    def requests_total(self) -> int:
        """Requests answered, with a result or an error."""
        return self._requests_total

    @property
    def tokens_generated(self) -> int:
        return self._tokens_generated

    def start(self, engine: "FLyEngine", tool_format: ToolFormat) -> None:
        """The models are loaded: name tokens with `engine`'s tokenizer, split calls in `tool_format`."""
        self._engine, self._tool_format = engine, tool_format
        self._texts, self._last_prompt = {}, None

    def open(self, envelope: Envelope, request: GenerateRequest, submitted: float,
             prompt_ids: list[int]) -> OutputState:
        """The output state of a request joining the engine with `prompt_ids`."""
        structure = request.structure
        calls = structure is not None and structure.calls_tools
        return OutputState(envelope, request, submitted, prompt_ids if request.prompt_logprobs else [],
                           CallText(self._tool_format.parser(structure)) if calls else None)

    def update(self, state: OutputState, out: "RequestOutput", now: float) -> GenerateResult | None:
        """Take one step's output: stream its chunk if the request streams; its result (not yet sent:
        `finish` sends it) once it finished. Raises if its output cannot be read (hostile tool calls)."""
        self._count_tokens(state, out, now)
        state.token_ids += out.new_token_ids
        if out.logprobs is not None:
            state.logprobs += self._named(out.new_token_ids, out.logprobs)
        if out.prompt_logprobs is not None:
            state.prompt_logprobs = self._named_prompt(state.prompt_ids, out.prompt_logprobs)
        text, calls = out.new_text, []
        if state.call_text is not None:
            text, calls = state.call_text.feed(text, out.finished)
            state.calls += calls
        state.content.append(text)
        if state.request.stream and (text or calls):
            self.emit(state.envelope, state.chunk(text, calls))
        return state.result(out, now, self._engine.target_name) if out.finished else None

    def finish(self, state: OutputState, result: GenerateResult) -> None:
        """Count and send a finished request's result."""
        with self._counting:
            self._requests_total += 1
        self.metrics.finished("ok", result.usage.prompt_tokens, result.stats)
        self.emit(state.envelope, result)

    def fail(self, envelope: Envelope, request_id: str, error: FLyError) -> None:
        """Count a failed generate request and send its error."""
        with self._counting:
            self._requests_total += 1
        self.metrics.finished(error.code)
        self.refuse(envelope, request_id, error)

    def refuse(self, envelope: Envelope, request_id: str, error: FLyError) -> None:
        """Send a request's error (uncounted: a tokenize request's)."""
        self.emit(envelope, ErrorReply(id=request_id, code=error.code, message=error.message))

    def record_step(self) -> None:
        """After an engine step: the engine's acceptance and prompt statistics, into the metrics."""
        self.stats = self._engine.stats.model_copy(deep=True)
        self.metrics.mat.set(self.stats.mat)
        self.prompt_stats = self._engine.prompt_stats
        self.metrics.prompt_work(self.prompt_stats)

    def _count_tokens(self, state: OutputState, out: "RequestOutput", now: float) -> None:
        """Time to first token, inter-token latency and tokens generated, for one step's new tokens."""
        new = len(out.new_token_ids)
        if not new:
            return
        if state.first_token_at is None:
            state.first_token_at = now
            self.metrics.ttft.observe(now - state.submitted)
        elif state.last_token_at is not None:
            self.metrics.itl.observe((now - state.last_token_at) / new)
        state.last_token_at = now
        with self._counting:
            self._tokens_generated += new
        self.metrics.completion_tokens.inc(new)

    def _token_text(self, token_id: int) -> str:
        """One token's text, decoded once per vocabulary id (a log-probability reply names every alternative)."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._engine.decode([token_id])
        return text

    def _named(self, token_ids: list[int], logprobs: list) -> list[TokenLogprob]:
        """The engine's log-probabilities of `token_ids` (fly_llm.decoding.logprobs) with each token's text."""
        text = self._token_text
        return [TokenLogprob(token_id=t, token=text(t), logprob=lp,
                             top=[TopLogprob(token_id=i, token=text(i), logprob=v) for i, v in alternatives])
                for t, (lp, alternatives) in zip(token_ids, logprobs)]

    def _named_prompt(self, prompt_ids: list[int], logprobs: list) -> list[TokenLogprob]:
        """The prompt's log-probabilities with each token's text (the first token's is None). The engine gives
        the choices of one prompt the same list (FLyEngine's scored prompts), so they share one named list."""
        if self._last_prompt is not None and self._last_prompt[0] is logprobs:
            return self._last_prompt[1]
        first = TokenLogprob(token_id=prompt_ids[0], token=self._token_text(prompt_ids[0]), logprob=None)
        named = [first, *self._named(prompt_ids[1:], logprobs)]
        self._last_prompt = (logprobs, named)
        return named
