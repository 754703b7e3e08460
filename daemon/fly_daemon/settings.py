"""The daemon's settings, read with pydantic-settings: one table of the config file per model.

Precedence: CLI flag > FLY_<NAME> environment variable > config file > built-in default. One name
per setting everywhere: ModelSpec's `device_map` is `device_map = ...` in the file's `[model]`
table, `FLY_DEVICE_MAP` in the environment and `--device-map` on the command line; FLyConfig's
`window` is `[fly] window`, `FLY_WINDOW`, `--window`; DaemonSettings' `queue_size` is
`[daemon] queue_size`, `FLY_QUEUE_SIZE`, `--queue-size`. The flags are made from these declarations
(fly_daemon.flags): a new field is a new key, variable and flag at once.

    # ~/.config/fly-llm/config.toml   (or --config PATH, or $FLY_CONFIG)
    [model]
    target = "Qwen/Qwen2.5-7B-Instruct"
    draft = "Qwen/Qwen2.5-0.5B-Instruct"
    [fly]
    window = 4
    [daemon]
    queue_size = 64
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar

import platformdirs
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import (BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict,
                               TomlConfigSettingsSource)

from fly_llm.common.config import FLyConfig, ModelSpec
from fly_llm.common.protocol import MAX_FRAME_BYTES

from fly_daemon.client_identity import Network, trusted_networks
from fly_daemon.embeddings import EmbeddingSettings
from fly_daemon.limits import Limits
from fly_daemon.runtime import host_port

M = TypeVar("M", bound=BaseModel)
ENV_PREFIX = "FLY_"


def comma_separated(text: str) -> list[str]:
    """'a, b,,c' as ['a', 'b', 'c']; '' as [] (how a list setting is written in FLY_* variables and flags)."""
    return [item.strip() for item in text.split(",") if item.strip()]


class SettingsError(ValueError):
    """A config file that cannot be read, or a setting with an invalid value."""


class HttpLimits(BaseModel):
    """Timeouts and connection caps of the HTTP front (fly_daemon.http.connections); DaemonSettings extends
    this model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    http_header_timeout: float = Field(10.0, gt=0, le=3600, description="Seconds a request's head may take to "
                                       "arrive (from the connection's start or the previous response); then closed.")
    http_body_timeout: float = Field(60.0, gt=0, le=3600, description="Seconds a request's body may take to "
                                     "arrive after its head; then the connection is closed.")
    http_keep_alive_timeout: float = Field(5.0, gt=0, le=3600, description="Seconds an idle kept-alive "
                                           "connection stays open after a response.")
    http_max_connections: int = Field(512, ge=1, le=1_000_000, description="Open HTTP connections in all; one "
                                      "more is answered 503 BUSY and closed (lowered to fit the fd limit).")
    http_max_connections_per_client: int = Field(64, ge=1, le=1_000_000, description="Open HTTP connections from "
                                                 "one client address (an IPv6 one's /64; a trusted proxy's count only "
                                                 "in all); one more is answered 503 BUSY and closed.")
    http_idle_reclaim: float = Field(1.0, gt=0, le=3600, description="Seconds a connection must have been idle "
                                     "(no complete request head since its start or its last response) before a "
                                     "newcomer to a full front takes its place when no fair-share swap is possible.")
    trusted_proxies: Annotated[list[Network], NoDecode] = Field(
        default_factory=list, description="Reverse proxies (addresses or CIDR networks, e.g. 10.0.0.0/8) whose "
        "X-Forwarded-For (else Forwarded: for=) names the client that per-client caps and fairness count; "
        "default none: forwarded headers are ignored and the peer address counts. FLY_TRUSTED_PROXIES takes "
        "them comma-separated.")

    @field_validator("trusted_proxies", mode="before")
    @classmethod
    def _networks(cls, entries: Any) -> Any:
        """Comma-separated text or a list of addresses and networks (host bits allowed), as networks."""
        if isinstance(entries, str):
            entries = comma_separated(entries)
        if isinstance(entries, list | tuple) and all(isinstance(e, str) for e in entries):
            return list(trusted_networks(e for e in entries if e.strip()))
        return entries


class DaemonSettings(Limits, HttpLimits, EmbeddingSettings):
    """Where the daemon listens and what it admits (the scheduler's Limits, the HTTP front's HttpLimits and
    the embedding worker's EmbeddingSettings are fields here too)."""

    endpoint: str | None = Field(None, description="ipc:///path.sock or tcp://127.0.0.1:PORT; None = an "
                                    "ipc socket in the private runtime directory.")
    max_frame_bytes: int = Field(MAX_FRAME_BYTES, ge=1024, le=256 * 2**20, description="Largest ZeroMQ frame or "
                                 "HTTP body, in bytes; a larger one is refused unread.")
    metrics_port: int | None = Field(None, ge=1, le=65535, description="Serve Prometheus metrics on "
                                     "127.0.0.1:PORT; None = off (GET /metrics on the HTTP front has them too).")
    prefix_cache_mb: int = Field(1024, ge=0, le=1 << 20, description="MiB of KV the prefix cache keeps of recent "
                                 "prompts and conversations (both models); 0 = off.")
    grammar_cache_mb: int = Field(256, ge=1, le=1 << 20, description="MiB of compiled grammars (JSON schemas, "
                                  "tools, regexes) kept for reuse, as measured where they compile; least recently "
                                  "used dropped first.")
    max_grammar_mb: int = Field(64, ge=1, le=1 << 20, description="MiB one grammar's compiled form may take; a "
                                "bigger one is refused (BAD_REQUEST naming this cap).")
    grammar_workers: int = Field(2, ge=1, le=64, description="Sandbox processes that judge new grammars at once "
                                 "(each holds a tokenizer view); a slow grammar holds up only its own compile.")
    prefill_chunk: int = Field(128, ge=0, description="Prompt tokens prefilled per engine step, so running streams "
                               "keep going while a long prompt enters; 0 = a whole prompt at once.")
    curve_secret_key: Path | None = Field(None, description="Server certificate (zmq.auth) for a tcp bind.")
    curve_clients: Path | None = Field(None, description="Directory of allowed client public certificates.")
    http: str | None = Field(None, description="HOST:PORT of the OpenAI-compatible HTTP front; None = off.")
    api_key: SecretStr | None = Field(None, description="Bearer key the HTTP front requires (needed to bind a "
                                      "non-loopback address); empty or blank = no key.")
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Host names the HTTP front answers besides the loopback names and its "
        "bound host ('*' = any); FLY_ALLOWED_HOSTS takes them comma-separated.")

    def api_key_value(self) -> str | None:
        """The API key's text; None when there is none."""
        return self.api_key.get_secret_value() if self.api_key else None

    @field_validator("http")
    @classmethod
    def _host_port(cls, address: str | None) -> str | None:
        if address is not None:
            host_port(address)
        return address

    @field_validator("api_key", mode="before")
    @classmethod
    def _blank_is_none(cls, key: Any) -> Any:
        """An empty or blank key is no key (surrounding blanks, as a shell or a file leaves them, are dropped)."""
        if isinstance(key, SecretStr):
            key = key.get_secret_value()
        return (key.strip() or None) if isinstance(key, str) else key

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _comma_separated(cls, hosts: Any) -> Any:
        return comma_separated(hosts) if isinstance(hosts, str) else hosts


TABLES: dict[type[BaseModel], str] = {ModelSpec: "model", FLyConfig: "fly", DaemonSettings: "daemon"}
"""The config-file table of each settings model."""


def default_config_file() -> Path:
    """`$FLY_CONFIG`, else `<user config dir>/fly-llm/config.toml` (XDG on Linux)."""
    return Path(os.environ.get("FLY_CONFIG") or Path(platformdirs.user_config_dir("fly-llm")) / "config.toml")


def load_settings(model: type[M], config_file: Path | str | None = None,
                  cli: Mapping[str, Any] | None = None) -> M:
    """`model` (a key of TABLES) from CLI values > FLY_<FIELD> env > its config-file table > defaults.

    CLI keys may use dashes or underscores; None values and keys that are not fields of `model` are
    ignored, so one argparse namespace can feed every table.
    """
    file, table = _config_file(config_file), TABLES[model]

    class Sources(model, BaseSettings):  # type: ignore[valid-type,misc]  # the file is known only now
        model_config = SettingsConfigDict(env_prefix=ENV_PREFIX)

        @classmethod
        def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                       env_settings: PydanticBaseSettingsSource, **_: PydanticBaseSettingsSource,
                                       ) -> tuple[PydanticBaseSettingsSource, ...]:
            return init_settings, env_settings, _TomlTable(settings_cls, file, table)

    flags = {key.replace("-", "_"): value for key, value in (cli or {}).items() if value is not None}
    try:
        return model.model_validate(dict(Sources(**{n: v for n, v in flags.items() if n in model.model_fields})))
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise SettingsError(f"invalid [{table}] settings ({problems})") from exc


def _config_file(path: Path | str | None) -> Path | None:
    """The config file to read: `path`, else the default one; None when the default does not exist."""
    explicit = path is not None or "FLY_CONFIG" in os.environ
    file = Path(path).expanduser() if path is not None else default_config_file()
    if file.is_file():
        return file
    if explicit:
        raise SettingsError(f"config file not found: {file}")
    return None


class _TomlTable(TomlConfigSettingsSource):
    """One table (`[model]`, `[fly]`, `[daemon]`) of the TOML config file."""

    def __init__(self, settings_cls: type[BaseSettings], file: Path | None, table: str):
        self.table = table
        super().__init__(settings_cls, file)

    def _read_file(self, file_path: Path) -> dict[str, Any]:
        try:
            data = super()._read_file(file_path).get(self.table, {})
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise SettingsError(f"cannot read config file {file_path}: {exc}") from exc
        if not isinstance(data, dict):
            raise SettingsError(f"[{self.table}] in the config file must be a table")
        return data
