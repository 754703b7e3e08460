"""Settings precedence: CLI > FLY_* environment > TOML file > defaults."""

from __future__ import annotations

import pytest

from fly_llm.config import FLyConfig, ModelSpec
from fly_llm.settings import SettingsError, load_settings, read_config_file

TOML = """
[model]
target = "from-file"
draft = "file-draft"
dtype = "float32"
[fly]
window = 3
k = 9
[daemon]
anything = "left for the daemon"
"""


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text(TOML)
    return path


def test_defaults_without_any_source(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))  # no default config file there
    monkeypatch.delenv("FLY_CONFIG", raising=False)
    assert load_settings(env={}) == (ModelSpec(), FLyConfig())


def test_precedence_cli_over_env_over_file(config_file):
    env = {"FLY_TARGET": "from-env", "FLY_WINDOW": "5", "FLY_LOOSE": "false", "FLY_ENDPOINT": "ipc:///x"}
    cli = {"target": "from-cli", "device-map": "auto", "k": None, "loose": None}
    spec, fly = load_settings(config_file, cli=cli, env=env)
    assert spec == ModelSpec(target="from-cli", draft="file-draft", dtype="float32", device_map="auto")
    assert fly.window == 5 and fly.k == 9 and fly.loose is False
    assert fly.entropy_threshold == FLyConfig().entropy_threshold


def test_config_file_from_env(config_file, monkeypatch):
    monkeypatch.setenv("FLY_CONFIG", str(config_file))
    spec, _ = load_settings(env={})
    assert spec.target == "from-file"
    assert read_config_file()["daemon"]["anything"] == "left for the daemon"


def test_invalid_values_are_clear_errors(config_file, tmp_path):
    with pytest.raises(SettingsError, match="window"):
        load_settings(config_file, env={"FLY_WINDOW": "wide"})
    with pytest.raises(SettingsError, match="dtype"):
        load_settings(config_file, cli={"dtype": "int3"}, env={})
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\ntarget = \n")
    with pytest.raises(SettingsError, match="cannot read"):
        load_settings(bad, env={})
    typo = tmp_path / "typo.toml"
    typo.write_text("[fly]\nwindoww = 2\n")
    with pytest.raises(SettingsError, match="windoww"):
        load_settings(typo, env={})
    with pytest.raises(SettingsError, match="not found"):
        load_settings(tmp_path / "missing.toml", env={})
