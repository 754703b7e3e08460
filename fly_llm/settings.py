"""Daemon/CLI settings from a TOML file, FLY_* environment variables and CLI flags (no torch here).

Precedence: CLI flag > environment variable > config file > built-in default. One name per
setting everywhere: the field `device_map` of ModelSpec is `device_map = ...` in the file's
`[model]` table, `FLY_DEVICE_MAP` in the environment and `--device-map` on the command line;
FLyConfig's `window` is `[fly] window`, `FLY_WINDOW`, `--window`. Other tables (e.g. `[daemon]`)
are left for their owners and read with `section_settings`.

    # ~/.config/fly-llm/config.toml   (or --config PATH, or $FLY_CONFIG)
    [model]
    target = "Qwen/Qwen2.5-7B-Instruct"
    draft = "Qwen/Qwen2.5-0.5B-Instruct"
    [fly]
    window = 4
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import platformdirs
from pydantic import BaseModel, ValidationError

from fly_llm.config import FLyConfig, ModelSpec

T = TypeVar("T", bound=BaseModel)
ENV_PREFIX = "FLY_"


class SettingsError(ValueError):
    """A config file that cannot be read, or a setting with an invalid value."""


def default_config_file() -> Path:
    """`$FLY_CONFIG`, else `<user config dir>/fly-llm/config.toml` (XDG on Linux)."""
    return Path(os.environ.get("FLY_CONFIG") or Path(platformdirs.user_config_dir("fly-llm")) / "config.toml")


def read_config_file(path: Path | str | None = None) -> dict[str, Any]:
    """The parsed TOML file; {} when no path is given and the default file does not exist."""
    explicit = path is not None or "FLY_CONFIG" in os.environ
    file = Path(path).expanduser() if path is not None else default_config_file()
    if not file.is_file():
        if explicit:
            raise SettingsError(f"config file not found: {file}")
        return {}
    try:
        return tomllib.loads(file.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SettingsError(f"cannot read config file {file}: {exc}") from exc


def section_settings(cls: type[T], section: str, file_data: Mapping[str, Any],
                     env: Mapping[str, str] | None = None, cli: Mapping[str, Any] | None = None) -> T:
    """Build `cls` from `file_data[section]`, then FLY_<FIELD> env vars, then CLI values (None = unset).

    CLI keys may use dashes or underscores (`device-map` / `device_map`); CLI keys that are not
    fields of `cls` are ignored, so one argparse namespace can feed several sections.
    """
    env = os.environ if env is None else env
    table = file_data.get(section, {})
    if not isinstance(table, Mapping):
        raise SettingsError(f"[{section}] in the config file must be a table")
    values: dict[str, Any] = dict(table)
    for name in cls.model_fields:
        if (raw := env.get(f"{ENV_PREFIX}{name.upper()}")) is not None:
            values[name] = raw
    for key, value in (cli or {}).items():
        name = key.replace("-", "_")
        if name in cls.model_fields and value is not None:
            values[name] = value
    try:
        return cls.model_validate(values)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise SettingsError(f"invalid [{section}] settings ({problems})") from exc


def load_settings(config_file: Path | str | None = None, *, cli: Mapping[str, Any] | None = None,
                  env: Mapping[str, str] | None = None) -> tuple[ModelSpec, FLyConfig]:
    """(ModelSpec, FLyConfig) from CLI > FLY_* env > TOML `[model]`/`[fly]` > defaults."""
    data = read_config_file(config_file)
    return (section_settings(ModelSpec, "model", data, env, cli),
            section_settings(FLyConfig, "fly", data, env, cli))
