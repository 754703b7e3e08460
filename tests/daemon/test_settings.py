"""Settings precedence through pydantic-settings: CLI > FLY_* environment > TOML table > defaults, per table."""

from __future__ import annotations

import os
from typing import Literal, get_args, get_origin

import pytest

from fly_llm.common.config import FLyConfig, ModelSpec

from fly_daemon.cli import _parser
from fly_daemon.flags import flag_for, without_none
from fly_daemon.settings import DaemonSettings, SettingsError, load_settings

TOML = """
[model]
target = "from-file"
draft = "file-draft"
target_quantization = "int4"
dtype = "float32"
[fly]
window = 3
k = 9
[daemon]
queue_size = 7
max_batch_size = 3
max_tokens_limit = 99
prefix_cache_mb = 64
"""


@pytest.fixture(autouse=True)
def no_fly_env(monkeypatch, tmp_path):
    """No FLY_* variable from the outer environment, and no default config file."""
    for name in [n for n in os.environ if n.upper().startswith("FLY_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text(TOML)
    return path


def test_defaults_without_any_source():
    assert load_settings(ModelSpec) == ModelSpec()
    assert load_settings(FLyConfig) == FLyConfig()
    assert load_settings(DaemonSettings) == DaemonSettings()


def test_precedence_cli_over_env_over_file(config_file, monkeypatch):
    for name, value in {"FLY_TARGET": "from-env", "FLY_WINDOW": "5", "FLY_LOOSE": "false",
                        "FLY_ENDPOINT": "ipc:///x"}.items():
        monkeypatch.setenv(name, value)
    cli = {"target": "from-cli", "device-map": "auto", "k": None, "loose": None}
    spec, fly = (load_settings(model, config_file, cli) for model in (ModelSpec, FLyConfig))
    assert spec == ModelSpec(target="from-cli", draft="file-draft", dtype="float32", device_map="auto",
                             target_quantization="int4")
    assert fly.window == 5 and fly.k == 9 and fly.loose is False
    assert fly.entropy_threshold == FLyConfig().entropy_threshold


@pytest.mark.parametrize(("model", "name", "file", "env", "flag"), [
    (ModelSpec, "draft", "file-draft", "env-draft", "flag-draft"),
    (ModelSpec, "target_quantization", "int4", "none", "int8"),
    (FLyConfig, "k", 9, "11", 13),
    (DaemonSettings, "max_tokens_limit", 99, "98", 97),
    (DaemonSettings, "prefix_cache_mb", 64, "0", 32),
])
def test_flag_over_env_over_file_over_default(config_file, monkeypatch, model, name, file, env, flag):
    """Each table, one source removed at a time: the highest one left wins."""
    default = model.model_fields[name].default
    assert getattr(load_settings(model, config_file, {name.replace("_", "-"): flag}), name) == flag
    monkeypatch.setenv(f"FLY_{name.upper()}", env)
    assert getattr(load_settings(model, config_file, {name: flag}), name) == flag
    assert str(getattr(load_settings(model, config_file, {name: None}), name)) == env
    monkeypatch.delenv(f"FLY_{name.upper()}")
    assert getattr(load_settings(model, config_file), name) == file
    assert getattr(load_settings(model), name) == default


def test_daemon_settings_are_the_scheduler_limits(config_file):
    settings = load_settings(DaemonSettings, config_file, {"heartbeat-timeout": 0.5})
    assert (settings.queue_size, settings.max_batch_size, settings.heartbeat_timeout) == (7, 3, 0.5)
    assert settings.max_tokens_limit == 99 and settings.drain_timeout == DaemonSettings().drain_timeout


def test_config_file_from_env(config_file, monkeypatch):
    monkeypatch.setenv("FLY_CONFIG", str(config_file))
    assert load_settings(ModelSpec).target == "from-file"
    assert load_settings(DaemonSettings).queue_size == 7


def test_invalid_values_are_clear_errors(config_file, tmp_path, monkeypatch):
    monkeypatch.setenv("FLY_WINDOW", "wide")
    with pytest.raises(SettingsError, match="window"):
        load_settings(FLyConfig, config_file)
    with pytest.raises(SettingsError, match="dtype"):
        load_settings(ModelSpec, config_file, {"dtype": "int3"})
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\ntarget = \n")
    with pytest.raises(SettingsError, match="cannot read"):
        load_settings(ModelSpec, bad)
    typo = tmp_path / "typo.toml"
    typo.write_text("[fly]\nwindoww = 2\n[daemon]\nmax_tokens = 5\n")
    with pytest.raises(SettingsError, match="windoww"):
        load_settings(FLyConfig, typo)
    with pytest.raises(SettingsError, match="max_tokens"):
        load_settings(DaemonSettings, typo)
    with pytest.raises(SettingsError, match="not found"):
        load_settings(ModelSpec, tmp_path / "missing.toml")


# ---- the command line's flags are made from the settings (fly_daemon.flags) ----

FLAG_VALUES = {"endpoint": "ipc:///tmp/fly-flag.sock", "http": "127.0.0.1:8123", "trusted_proxies": "10.0.0.0/8",
               "allowed_hosts": "fly.example", "stages": "ngram", "api_key": "k"}
"""A value to give where the field's type alone does not say one that is valid."""


def _flag_value(name: str, field) -> str | None:
    """Text for the flag of field `name` that the field accepts and that differs from its default (None: a switch)."""
    kind, default = without_none(field.annotation), field.default
    if name in FLAG_VALUES:
        return FLAG_VALUES[name]
    if kind is bool:
        return None
    if get_origin(kind) is Literal:
        return next(str(value) for value in get_args(kind) if value != default)
    if kind is int:
        return str(default + 1 if isinstance(default, int) else 1)
    if kind is float:
        return str(default + 0.5)
    return "/tmp/fly-flag" if "Path" in str(kind) else "x"


@pytest.mark.parametrize("model", [ModelSpec, FLyConfig, DaemonSettings])
def test_every_setting_has_a_flag_that_reaches_it(model):
    for name, field in model.model_fields.items():
        flag_text = _flag_value(name, field)
        flag, _ = flag_for(name, field)
        argv = ["start", flag] if flag_text is None else ["start", flag, flag_text]
        loaded = load_settings(model, None, vars(_parser().parse_args(argv)))
        assert getattr(loaded, name) != getattr(model(), name), (name, argv)
        unset = load_settings(model, None, vars(_parser().parse_args(["start"])))
        assert getattr(unset, name) == getattr(model(), name), name  # an absent flag leaves the default
