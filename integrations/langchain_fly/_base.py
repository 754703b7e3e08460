"""What FLyLLM and ChatFLy share: the declared fields, the daemon clients, options and metadata.

Built only on `fly_llm.client` (no torch): the models run in the fly daemon, these classes talk to it.
"""

from __future__ import annotations

import functools
from typing import Any

from langchain_core.language_models import LangSmithParams
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from pydantic import BaseModel, Field

from fly_llm.client import AsyncFLyClient, FLyClient, call_options, default_endpoint
from fly_llm.common.config import REQUEST_OPTIONS
from fly_llm.common.protocol import GenerateResult


class FLyBase(BaseModel):
    """Fields and daemon plumbing shared by `FLyLLM` and `ChatFLy` (a mixin, listed first).

    Every option left at None uses the daemon's default.
    """

    endpoint: str = Field(default_factory=default_endpoint)
    """ZeroMQ endpoint of the fly daemon; default `$FLY_ENDPOINT`, else the local ipc socket."""
    model: str | None = None
    """Informational: the daemon serves one model pair; answers report the served target's name."""
    temperature: float | None = None
    """Sampling temperature; 0 is greedy."""
    top_p: float | None = None
    """Nucleus sampling mass."""
    top_k: int | None = None
    """Sample among the k most likely tokens only (0: off)."""
    min_p: float | None = None
    """Drop tokens less likely than min_p times the most likely one (0: off)."""
    repetition_penalty: float | None = None
    """Divide a repeated token's positive logit by this, multiply a negative one (1: off)."""
    presence_penalty: float | None = None
    """-2..2: subtracted once from the logit of a token in the window (0: off)."""
    frequency_penalty: float | None = None
    """-2..2: times a token's count in the window, subtracted from its logit (0: off)."""
    repeat_last_n: int | None = None
    """The context tokens the penalties count (default 64; -1: all of them)."""
    max_tokens: int | None = None
    """Most tokens to generate per request."""
    stop: list[str] | None = None
    """Stop strings; a call's `stop` replaces them (`stop=[]`: none for that call)."""
    seed: int | None = None
    """Seed for reproducible sampling."""
    timeout: float | None = None
    """Seconds to wait for the daemon per request (None: the client's default, 120 s)."""
    max_retries: int = 2
    """Retries when the daemon is busy or does not answer."""
    streaming: bool = False
    """Generate through the streaming path even on `invoke` (token callbacks fire)."""
    k: int | None = None
    """FLy: most draft tokens per round."""
    window: int | None = None
    """FLy: deferred window W (0 accepts any mismatch that passes the entropy gate)."""
    entropy_threshold: float | None = None
    """FLy: entropy gate θ in nats (<= 0.01 disables the gate)."""
    loose: bool | None = None
    """FLy: loose acceptance on; False is exact (lossless) speculative decoding."""
    response_format: dict[str, Any] | None = None
    """Constrain the output by a grammar: {"type": "json_schema", "schema": {...}}, {"type": "json_object"}
    or {"type": "regex", "pattern": "..."}; a call's `response_format` replaces it."""

    @classmethod
    def is_lc_serializable(cls) -> bool:
        """Serialisable with `langchain_core.load.dumpd`."""
        return True

    @property
    def _client(self) -> FLyClient:
        """The process-wide client for this endpoint and these settings (connects lazily)."""
        return _sync_client(self.endpoint, self.timeout, self.max_retries)

    @property
    def _async_client(self) -> AsyncFLyClient:
        """The process-wide async client for this endpoint and these settings (a socket per event loop)."""
        return _async_client(self.endpoint, self.timeout, self.max_retries)

    @property
    def _identifying_params(self) -> dict[str, Any]:
        """What tells two configurations apart (tracing, caching)."""
        options = {name: getattr(self, name) for name in REQUEST_OPTIONS}
        return {"endpoint": self.endpoint, "model": self.model, **options, "response_format": self.response_format}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        """Standard tracing parameters, with provider `fly`."""
        params = super()._get_ls_params(stop=stop, **kwargs)  # type: ignore[misc]
        params["ls_provider"] = "fly"
        params["ls_model_name"] = kwargs.get("model") or self.model or "fly"
        if stops := self.stop if stop is None else stop:
            params["ls_stop"] = stops
        return params

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of `text` from the daemon's tokenizer."""
        return self._client.tokenize(text).token_ids

    def get_num_tokens(self, text: str) -> int:
        """Count the tokens of `text` with the daemon's tokenizer."""
        return self._client.tokenize(text).count

    def _request_options(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The client's keyword arguments for one call (`call_options`): the call's options (and `stop`)
        replace the fields."""
        requested = kwargs.get("model")
        if requested is not None and requested != self.model:
            raise ValueError(
                f"{type(self).__name__} cannot switch models per call: the daemon at {self.endpoint} serves "
                f"one model pair. Start a daemon with `fly-daemon start --target {requested}` and point "
                f"`endpoint` at it.")
        call = {name: value for name, value in kwargs.items() if name not in ("model", "stream")}
        if stop is not None:
            call["stop"] = stop  # a call's stop replaces the instance's, like every other option
        return call_options(self, call)

    def _model_name(self, result: GenerateResult) -> str:
        return result.model or self.model or "fly"

    def _response_metadata(self, result: GenerateResult) -> dict[str, Any]:
        """model_name, finish_reason and the FLy counters of one finished request."""
        stats = result.stats
        return {
            "model_name": self._model_name(result),
            "finish_reason": result.finish_reason,
            "fly_stats": {
                "mat": stats.mat,
                "accepted_loose": stats.accepted_loose,
                "accepted_native": stats.accepted_native,
                "loose_rate": stats.loose_rate,
                "rounds": stats.rounds,
                "drafted": stats.drafted,
            },
            "time_to_first_token_s": result.time_to_first_token_s,
            "elapsed_s": result.elapsed_s,
        }


@functools.cache
def _sync_client(endpoint: str, timeout: float | None, max_retries: int) -> FLyClient:
    """Clients are shared by every model with the same settings, so models stay copyable and picklable."""
    return FLyClient(endpoint, **_client_settings(timeout, max_retries))


@functools.cache
def _async_client(endpoint: str, timeout: float | None, max_retries: int) -> AsyncFLyClient:
    return AsyncFLyClient(endpoint, **_client_settings(timeout, max_retries))


def _client_settings(timeout: float | None, max_retries: int) -> dict[str, Any]:
    return {"max_retries": max_retries} if timeout is None else {"max_retries": max_retries, "timeout": timeout}


def usage_metadata(result: GenerateResult) -> UsageMetadata:
    """LangChain's usage record for one finished request."""
    usage = result.usage
    return UsageMetadata(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                         total_tokens=usage.total_tokens,
                         input_token_details=InputTokenDetails(cache_read=usage.cached_tokens))
