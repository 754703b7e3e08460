"""What the scheduler admits (`Limits`): queue and batch sizes, token caps, heartbeat and drain deadlines."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Limits(BaseModel):
    """What the scheduler admits: queue and batch sizes, token caps, heartbeat and drain deadlines.

    The field names are the daemon's setting names (`--max-tokens-limit`, `FLY_HEARTBEAT_TIMEOUT`, …):
    fly_daemon.settings.DaemonSettings extends this model.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    queue_size: int = Field(256, ge=1, le=100_000, description="Requests waiting beyond the batch; more get BUSY.")
    max_batch_size: int = Field(16, ge=1, le=4096, description="Requests in one engine step.")
    max_batch_tokens: int = Field(65_536, ge=1, description="Cap on prompt + max_tokens over the running batch.")
    newcomer_rows: int = Field(2, ge=0, le=64, description="Rows a client with none running may add to a full "
                               "batch, beyond max_batch_size (and max_batch_tokens by as many rows' share of "
                               "it), so its first request starts at once however full one client keeps the "
                               "batch; 0 = a newcomer waits for a row to end.")
    max_tokens_limit: int = Field(4096, ge=1, le=1_000_000, description=(
        "Most tokens one request generates: a larger max_tokens is capped to it; a request without one asks for it."))
    max_prompt_tokens: int | None = Field(None, ge=1, description="None = the context window - 1.")
    max_prompt_chars: int | None = Field(None, ge=1, description="Longest prompt in characters (messages and "
                                         "tools included), refused before tokenizing; None = 16 × the prompt "
                                         "token limit.")
    max_requests_per_client: int = Field(64, ge=1, description="Requests one client may have queued or running; "
                                         "more get BUSY. A client (fly_daemon.client_identity): a CURVE key, else a "
                                         "ZeroMQ socket; over HTTP the credential and the client's address (the one "
                                         "a trusted proxy forwards; a loopback connection without a key).")
    max_tokens_per_client: int = Field(65_536, ge=1, description="Weight one client's queued and running "
                                       "requests may have: each max_tokens plus its echoed prompt tokens, so n "
                                       "choices weigh n × max_tokens (fly_daemon.scheduling.request_weight); more get BUSY.")
    max_reply_units: int = Field(524_288, ge=1, description="Token entries one request's reply may carry: choices × "
                                 "(echoed prompt tokens + max_tokens) × (1 + top logprobs); more get TOO_LONG.")
    share_prefix_cache: bool = Field(False, description="Let every client reuse every other's cached prompts and "
                                     "compiled grammars (a single-tenant deployment); else each credential has "
                                     "its own.")
    heartbeat_timeout: float = Field(5.0, ge=0, description="Seconds without a client heartbeat before a "
                                                             "request is cancelled; 0 = never.")
    drain_timeout: float = Field(10.0, ge=0, description="Seconds running requests get to finish on stop.")
