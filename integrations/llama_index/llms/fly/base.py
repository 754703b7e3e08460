"""FLyLLM: the fly-llm daemon as a LlamaIndex LLM (shaped like llama-index-llms-ollama).

Every call goes through `fly_llm.client`; request options are built by
`fly_llm.client.build_options`, the same function the LangChain adapter uses. Responses carry the
daemon's `GenerateResult` as `raw` (a dict with `usage.prompt_tokens` / `usage.completion_tokens`),
which is what LlamaIndex's `TokenCountingHandler` reads.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Iterator, Sequence

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.llm import LLM

from fly_llm.client import AsyncFLyClient, FLyClient, build_options, default_endpoint
from fly_llm.config import REQUEST_OPTIONS
from fly_llm.protocol import GenerateResult, InfoReply, TokenChunk

_ROLES = {
    MessageRole.DEVELOPER: "system",
    MessageRole.FUNCTION: "tool",
    MessageRole.CHATBOT: "assistant",
    MessageRole.MODEL: "assistant",
}
"""LlamaIndex roles the daemon's chat template knows under another name."""


class FLyLLM(LLM):
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
    """

    endpoint: str = Field(
        default_factory=default_endpoint, description="Daemon endpoint; $FLY_ENDPOINT, else the local ipc socket."
    )
    temperature: float | None = Field(default=None, ge=0.0, description="Sampling temperature; 0 is greedy.")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, description="Nucleus sampling mass.")
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
            model_name=self._info.target,
        )

    def to_payload(self) -> dict[str, Any]:
        """What instrumentation events record about this LLM; never asks the daemon."""
        payload = {"class_name": self.class_name(), **self.model_dump(exclude={"callback_manager"})}
        if self._info is not None:
            payload["model_name"] = self._info.target
        return payload

    def _request(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Sampling, FLy options and timeout of one call: the fields, overridden by the call's keywords."""
        call = {name: value for name, value in kwargs.items() if name != "timeout"}
        sampling, fly = build_options(**{**{name: getattr(self, name) for name in REQUEST_OPTIONS}, **call})
        return {"sampling": sampling, "fly": fly, "timeout": kwargs.get("timeout", self.timeout)}

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
        result = self.client.chat(_to_wire(messages), **self._request(kwargs))
        return _chat(result.text, None, result.model_dump())

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        stream = self.client.stream(messages=_to_wire(messages), **self._request(kwargs))
        return (_chat(*step) for step in _running(stream))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        result = await self.async_client.chat(_to_wire(messages), **self._request(kwargs))
        return _chat(result.text, None, result.model_dump())

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        stream = self.async_client.stream(messages=_to_wire(messages), **self._request(kwargs))
        return (_chat(*step) async for step in _arunning(stream))


def _to_wire(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """LlamaIndex messages as the daemon's chat messages (text content only)."""
    return [{"role": _ROLES.get(m.role, m.role.value), "content": m.content or ""} for m in messages]


def _advance(text: str, item: TokenChunk | GenerateResult) -> tuple[str, str, dict[str, Any]]:
    """(running text, delta, raw) after one stream item; the final result has an empty delta and the usage."""
    delta = item.text if isinstance(item, TokenChunk) else ""
    return text + delta, delta, item.model_dump()


def _running(stream: Iterator[TokenChunk | GenerateResult]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """`_advance` over a stream of chunks and the final result."""
    text = ""
    for item in stream:
        text, delta, raw = _advance(text, item)
        yield text, delta, raw


async def _arunning(
    stream: AsyncIterator[TokenChunk | GenerateResult],
) -> AsyncIterator[tuple[str, str, dict[str, Any]]]:
    """`_advance` over an async stream of chunks and the final result."""
    text = ""
    async for item in stream:
        text, delta, raw = _advance(text, item)
        yield text, delta, raw


def _completion(text: str, delta: str | None, raw: dict[str, Any]) -> CompletionResponse:
    return CompletionResponse(text=text, delta=delta, raw=raw)


def _chat(text: str, delta: str | None, raw: dict[str, Any]) -> ChatResponse:
    return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta, raw=raw)
