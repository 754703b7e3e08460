"""FLyLLM: the fly-llm daemon as a LlamaIndex LLM (shaped like llama-index-llms-ollama).

Every call goes through `fly_llm.client`; request options are merged by
`fly_llm.client.call_options`, the same function the LangChain adapter uses. Responses carry the
daemon's `GenerateResult` as `raw` (a dict with `usage.prompt_tokens` / `usage.completion_tokens`),
which is what LlamaIndex's `TokenCountingHandler` reads.

It is a `FunctionCallingLLM`: tools and structured output are decoded under a grammar in the
daemon, so a required call is always a valid call of an offered tool and a structured answer
always parses (docs/llama_index.md).
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Iterator, Sequence, Type

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
)
from llama_index.core.bridge.pydantic import BaseModel, Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.tools.types import BaseTool
from llama_index.core.types import PydanticProgramMode

from fly_llm.client import AsyncFLyClient, FLyClient, call_options, default_endpoint
from fly_llm.common.protocol import GenerateResult, InfoReply, TokenChunk, ToolCall
from fly_llm.common.tools import closed_tool, offer_tools
from llama_index.llms.fly._messages import answer, to_wire, tool_selections
from llama_index.llms.fly._structured import parse_partial, parse_structured, response_format_for


class FLyLLM(FunctionCallingLLM):
    """LlamaIndex LLM served by a local fly-llm daemon (FLy loosely speculative decoding).

    Start the daemon with `fly-daemon start`, then:

        ```python
        from llama_index.llms.fly import FLyLLM

        llm = FLyLLM(max_tokens=128)
        print(llm.complete("def fibonacci(n):"))
        ```

    `chat`/`stream_chat` render the messages with the target model's chat template (this is what
    query engines use: `is_chat_model=True`); `complete`/`stream_complete` send the prompt as raw
    text. Option fields left at None take the daemon's defaults; every call may override them as
    keyword arguments, e.g. `llm.complete(prompt, max_tokens=32, stop=["\\n\\n"])` (a call's value
    replaces the field's, `stop` included); unknown keywords are a TypeError.
    Code completion: `llm.complete(prefix, suffix=suffix)` (and `stream_complete`, the async twins) fills
    in the middle between them with the target's FIM tokens (`formatted=True` keeps a
    `completion_to_prompt` off the prefix); a target without them is refused (FimUnsupported).

    Tools: `chat_with_tools` (and its async / streaming twins), `predict_and_call`, agents such as
    `FunctionAgent`; calls come back as `ToolCallBlock`s (`get_tool_calls_from_response`).
    Structured output: `structured_predict` and friends, `as_structured_llm` and pydantic programs
    decode JSON under the output class's schema (`response_format`, also a field and a call option).
    """

    endpoint: str = Field(
        default_factory=default_endpoint, description="Daemon endpoint; $FLY_ENDPOINT, else the local ipc socket."
    )
    temperature: float | None = Field(default=None, ge=0.0, description="Sampling temperature; 0 is greedy.")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int | None = Field(default=None, ge=0, description="Sample among the k most likely tokens (0: off).")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0,
                                description="Drop tokens less likely than min_p × the most likely one (0: off).")
    repetition_penalty: float | None = Field(default=None, gt=0.0,
                                             description="CTRL's ratio for tokens in the window (1: off).")
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0,
                                           description="Subtracted once from a repeated token's logit (0: off).")
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0,
                                            description="Times a token's count, subtracted from its logit (0: off).")
    repeat_last_n: int | None = Field(default=None, ge=-1,
                                      description="The context tokens the penalties count (64; -1: all).")
    max_tokens: int | None = Field(default=None, ge=1, description="Most tokens to generate per call.")
    stop: list[str] | None = Field(default=None, description="Stop strings (not included in the output).")
    seed: int | None = Field(default=None, ge=0, description="Seed for reproducible sampling.")
    timeout: float | None = Field(
        default=None, gt=0, description="Seconds to wait per request (None: the client's default, 120 s)."
    )
    max_retries: int = Field(default=2, ge=0, description="Retries when the daemon is busy or unreachable.")
    k: int | None = Field(default=None, ge=1, description="FLy: most draft tokens per round.")
    window: int | None = Field(default=None, ge=0, description="FLy: deferred window W (0: any gated mismatch).")
    entropy_threshold: float | None = Field(default=None, ge=0.0, description="FLy: entropy gate θ in nats.")
    loose: bool | None = Field(default=None, description="FLy loose acceptance; False: exact, lossless decoding.")
    response_format: dict[str, Any] | None = Field(
        default=None, description='Constrain the output by a grammar: {"type": "json_schema", "schema": {...}}, '
                                  '{"type": "json_object"} or {"type": "regex", "pattern": "..."}.')

    _client: FLyClient | None = PrivateAttr(default=None)
    _async_client: AsyncFLyClient | None = PrivateAttr(default=None)
    _info: InfoReply | None = PrivateAttr(default=None)

    @classmethod
    def class_name(cls) -> str:
        return "FLyLLM"

    @property
    def client(self) -> FLyClient:
        """The synchronous client, created on first use (it connects lazily)."""
        if self._client is None:
            self._client = FLyClient(**self._client_settings())
        return self._client

    @property
    def async_client(self) -> AsyncFLyClient:
        """The asynchronous client, created on first use (a socket per event loop)."""
        if self._async_client is None:
            self._async_client = AsyncFLyClient(**self._client_settings())
        return self._async_client

    def _client_settings(self) -> dict[str, Any]:
        settings: dict[str, Any] = {"endpoint": self.endpoint, "max_retries": self.max_retries}
        if self.timeout is not None:
            settings["timeout"] = self.timeout
        return settings

    @property
    def metadata(self) -> LLMMetadata:
        """Context window, output budget and model name, from the daemon's `info`.

        LlamaIndex reads this property often, so `info` is asked once per instance and cached
        (a restarted daemon with other models needs a new FLyLLM).
        """
        if self._info is None:
            self._info = self.client.info()
        return LLMMetadata(
            context_window=self._info.context_window,
            num_output=self.max_tokens or self._info.sampling_defaults.max_tokens,
            is_chat_model=True,
            is_function_calling_model=True,
            model_name=self._info.target,
        )

    def to_payload(self) -> dict[str, Any]:
        """What instrumentation events record about this LLM; never asks the daemon."""
        payload = {"class_name": self.class_name(), **self.model_dump(exclude={"callback_manager"})}
        if self._info is not None:
            payload["model_name"] = self._info.target
        return payload

    def _request(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The client's keywords for one call (`call_options`): the fields, overridden by the call's keywords."""
        return call_options(self, kwargs)

    def _prompt(self, prompt: str, formatted: bool) -> str:
        return prompt if formatted else self.completion_to_prompt(prompt)

    # ---- completion ----

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        result = self.client.generate(self._prompt(prompt, formatted), **self._request(kwargs))
        return CompletionResponse(text=result.text, raw=result.model_dump())

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        stream = self.client.stream(self._prompt(prompt, formatted), **self._request(kwargs))
        return (_completion(*step) for step in _running(stream))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        result = await self.async_client.generate(self._prompt(prompt, formatted), **self._request(kwargs))
        return CompletionResponse(text=result.text, raw=result.model_dump())

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        stream = self.async_client.stream(self._prompt(prompt, formatted), **self._request(kwargs))
        return (_completion(*step) async for step in _arunning(stream))

    # ---- chat ----

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        result = self.client.chat(to_wire(messages), **self._request(kwargs))
        return _chat(result.text, None, result.tool_calls, result.model_dump())

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        stream = self.client.stream(messages=to_wire(messages), **self._request(kwargs))
        return (_chat(*step) for step in _running(stream))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        result = await self.async_client.chat(to_wire(messages), **self._request(kwargs))
        return _chat(result.text, None, result.tool_calls, result.model_dump())

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        stream = self.async_client.stream(messages=to_wire(messages), **self._request(kwargs))
        return (_chat(*step) async for step in _arunning(stream))


    # ---- tools ----

    def _prepare_chat_with_tools(self, tools: Sequence[BaseTool], user_msg: str | ChatMessage | None = None,
                                 chat_history: list[ChatMessage] | None = None, verbose: bool = False,
                                 allow_parallel_tool_calls: bool = False, tool_required: bool = False,
                                 tool_choice: str | dict | None = None, **kwargs: Any) -> dict[str, Any]:
        """The `chat` arguments for a turn with `tools` (what `chat_with_tools` and its twins send).

        `tool_required` forces at least one call; `tool_choice` ("auto", "none", "required", a
        tool's name or an OpenAI dict) takes precedence; unless `allow_parallel_tool_calls`, the
        grammar allows at most one call. A bad tool or choice is a ValueError naming it.
        """
        specs = [closed_tool(t.metadata.to_openai_tool()) for t in tools]
        choice = tool_choice if tool_choice is not None else ("required" if tool_required else None)
        options = offer_tools(specs, choice)  # checked even when no tool is offered
        if not allow_parallel_tool_calls:
            options["parallel_tool_calls"] = False
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(ChatMessage(role="user", content=user_msg) if isinstance(user_msg, str) else user_msg)
        return {"messages": messages, **(options if specs else {}), **kwargs}

    def get_tool_calls_from_response(self, response: ChatResponse, error_on_no_tool_call: bool = True,
                                     **kwargs: Any) -> list[ToolSelection]:
        """The calls in a (possibly streamed, partial) response; ValueError for none when `error_on_no_tool_call`."""
        calls = tool_selections(response.message)
        if not calls and error_on_no_tool_call:
            reason = (response.raw or {}).get("finish_reason")
            raise ValueError(f"expected at least one tool call, but the model answered without one "
                             f"(finish_reason {reason!r}); pass tool_required=True to force a call")
        return calls

    # ---- structured output ----

    def structured_predict(self, output_cls: Type[BaseModel], prompt: BasePromptTemplate,
                           llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> BaseModel:
        """An `output_cls` answer, decoded under its JSON schema (`pydantic_program_mode` DEFAULT; other
        modes use LlamaIndex's programs)."""
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return super().structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        response = self.chat(self._get_messages(prompt, **prompt_args), **_structured(output_cls, llm_kwargs))
        return parse_structured(output_cls, response)

    async def astructured_predict(self, output_cls: Type[BaseModel], prompt: BasePromptTemplate,
                                  llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> BaseModel:
        """`structured_predict`, async."""
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return await super().astructured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        messages = self._get_messages(prompt, **prompt_args)
        return parse_structured(output_cls, await self.achat(messages, **_structured(output_cls, llm_kwargs)))

    def stream_structured_predict(self, output_cls: Type[BaseModel], prompt: BasePromptTemplate,
                                  llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> Iterator[BaseModel]:
        """Partial `output_cls` objects as the JSON arrives (the last one complete)."""
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return super().stream_structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        stream = self.stream_chat(self._get_messages(prompt, **prompt_args), **_structured(output_cls, llm_kwargs))
        return _partials(output_cls, stream)

    async def astream_structured_predict(self, output_cls: Type[BaseModel], prompt: BasePromptTemplate,
                                         llm_kwargs: dict[str, Any] | None = None,
                                         **prompt_args: Any) -> AsyncIterator[BaseModel]:
        """`stream_structured_predict`, async."""
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return await super().astream_structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        messages = self._get_messages(prompt, **prompt_args)
        return _apartials(output_cls, await self.astream_chat(messages, **_structured(output_cls, llm_kwargs)))


def _structured(output_cls: Type[BaseModel], llm_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The call options of a structured prediction: the caller's, and the output class's response format."""
    return {**(llm_kwargs or {}), "response_format": response_format_for(output_cls)}


def _partials(output_cls: Type[BaseModel], stream: ChatResponseGen) -> Iterator[BaseModel]:
    latest = None
    for response in stream:
        latest = parse_partial(output_cls, response, latest)
        yield latest


async def _apartials(output_cls: Type[BaseModel], stream: ChatResponseAsyncGen) -> AsyncIterator[BaseModel]:
    latest = None
    async for response in stream:
        latest = parse_partial(output_cls, response, latest)
        yield latest


Step = tuple[str, str, list[ToolCall], dict[str, Any]]
"""(running text, delta, calls so far, raw) after one stream item."""


def _advance(step: Step, item: TokenChunk | GenerateResult) -> Step:
    """The next step; the final result has an empty delta and carries the usage."""
    text, _, calls, _ = step
    if isinstance(item, GenerateResult):
        return text, "", calls, item.model_dump()
    return text + item.text, item.text, calls + item.tool_calls, item.model_dump()


def _running(stream: Iterator[TokenChunk | GenerateResult]) -> Iterator[Step]:
    """`_advance` over a stream of chunks and the final result."""
    step: Step = ("", "", [], {})
    for item in stream:
        step = _advance(step, item)
        yield step


async def _arunning(stream: AsyncIterator[TokenChunk | GenerateResult]) -> AsyncIterator[Step]:
    """`_advance` over an async stream of chunks and the final result."""
    step: Step = ("", "", [], {})
    async for item in stream:
        step = _advance(step, item)
        yield step


def _completion(text: str, delta: str | None, calls: list[ToolCall], raw: dict[str, Any]) -> CompletionResponse:
    return CompletionResponse(text=text, delta=delta, raw=raw)


def _chat(text: str, delta: str | None, calls: list[ToolCall], raw: dict[str, Any]) -> ChatResponse:
    return ChatResponse(message=answer(text, calls), delta=delta, raw=raw)
