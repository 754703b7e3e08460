"""The daemon's own settings: the `[daemon]` table of the config file, FLY_* variables, CLI flags.

Same precedence and names as fly_llm.settings (CLI > environment > file > default): the field
`queue_size` is `queue_size = 64` under `[daemon]`, `FLY_QUEUE_SIZE`, `--queue-size`.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from fly_llm.protocol import MAX_FRAME_BYTES

from fly_daemon.scheduler import Limits

_LIMITS = Limits()


class DaemonSettings(BaseModel):
    """Where the daemon listens and what it admits."""

    model_config = ConfigDict(extra="forbid")

    endpoint: str | None = Field(None, description="ipc:///path.sock or tcp://127.0.0.1:PORT; None = default.")
    queue_size: int = Field(_LIMITS.queue_size, ge=1, le=100_000)
    max_batch_size: int = Field(_LIMITS.max_batch_size, ge=1, le=4096)
    max_batch_tokens: int = Field(_LIMITS.max_batch_tokens, ge=1)
    max_tokens_limit: int = Field(_LIMITS.max_tokens, ge=1, le=1_000_000)
    max_prompt_tokens: int | None = Field(None, ge=1, description="None = the context window - 1.")
    max_frame_bytes: int = Field(MAX_FRAME_BYTES, ge=1024, le=256 * 2**20)
    heartbeat_timeout: float = Field(_LIMITS.heartbeat_timeout_s, ge=0, description="0 = never cancel.")
    drain_timeout: float = Field(_LIMITS.drain_timeout_s, ge=0)
    metrics_port: int | None = Field(None, ge=1, le=65535)
    curve_secret_key: Path | None = None
    curve_clients: Path | None = None

    def limits(self) -> Limits:
        """The scheduler's limits from these settings."""
        return Limits(queue_size=self.queue_size, max_batch_size=self.max_batch_size,
                      max_batch_tokens=self.max_batch_tokens, max_tokens=self.max_tokens_limit,
                      max_prompt_tokens=self.max_prompt_tokens, heartbeat_timeout_s=self.heartbeat_timeout,
                      drain_timeout_s=self.drain_timeout)
