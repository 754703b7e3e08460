"""The CLI's settings and refusals (no models are loaded here; the daemon lifecycle is in test_daemon_faults)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from fly_llm.client import FLyClient, build_options


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fly_daemon.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_config_file_endpoint_and_precedence(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(f'[daemon]\nendpoint = "ipc://{tmp_path}/from-file.sock"\n')
    env = dict(os.environ, FLY_RUNTIME_DIR=str(tmp_path))
    env.pop("FLY_ENDPOINT", None)
    out = _cli("status", "--config", str(config), env=env)
    assert out.returncode == 1 and f"not running at ipc://{tmp_path}/from-file.sock" in out.stderr
    out = _cli("status", "--config", str(config), env={**env, "FLY_ENDPOINT": f"ipc://{tmp_path}/env.sock"})
    assert f"ipc://{tmp_path}/env.sock" in out.stderr
    out = _cli("stop", "--config", str(config), "--endpoint", f"ipc://{tmp_path}/flag.sock", env=env)
    assert out.returncode == 1 and f"ipc://{tmp_path}/flag.sock" in out.stderr


def test_bad_settings_are_refused_before_starting(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[daemon]\nqueue_size = -1\n")
    out = _cli("start", "--config", str(bad), "--endpoint", f"ipc://{tmp_path}/x.sock")
    assert out.returncode == 2 and "queue_size" in out.stderr
    bad.write_text("[fly]\nwindow = 'wide'\n")
    out = _cli("start", "--config", str(bad), "--endpoint", f"ipc://{tmp_path}/x.sock")
    assert out.returncode == 2 and "window" in out.stderr
    out = _cli("start", "--endpoint", "udp://127.0.0.1:1")
    assert out.returncode == 2 and "unsupported endpoint" in out.stderr
    out = _cli("start", "--foreground", "--endpoint", "tcp://0.0.0.0:5999", "--target", str(tmp_path))
    assert out.returncode == 2 and "CURVE" in out.stderr


def test_generate_sends_a_chat_message_by_default_and_the_text_with_raw(tiny_daemon):
    prompt = "Write a Python function that reverses a string."
    sampling, fly = build_options(max_tokens=12, loose=False)
    with FLyClient(tiny_daemon) as client:
        assert client.info().chat_template  # the tiny tokenizer has a ChatML template
        chat = client.chat([{"role": "user", "content": prompt}], sampling, fly).text
        raw = client.generate(prompt, sampling, fly).text
    assert chat != raw
    flags = ("--endpoint", tiny_daemon, "--max-tokens", "12", "--no-loose")
    out = _cli("generate", prompt, *flags)
    assert out.returncode == 0 and out.stdout == chat
    assert _cli("generate", "--raw", prompt, *flags).stdout == raw
    assert _cli("generate", "--chat", prompt, *flags).stdout == chat  # the old opt-in is still accepted
    assert "--raw" in _cli("generate", "--help").stdout


def test_generate_with_a_json_schema_or_tools_from_files(tiny_daemon, tmp_path):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    flags = ("--endpoint", tiny_daemon, "--max-tokens", "40")
    out = _cli("generate", "--json-schema", str(tmp_path / "schema.json"), "Is it?", *flags)
    assert out.returncode == 0 and json.loads(out.stdout)["ok"] in (True, False), out
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"key": {"enum": ["fox", "dog"]}}, "required": ["key"],
        "additionalProperties": False}}}]
    (tmp_path / "tools.json").write_text(json.dumps(tools))
    out = _cli("generate", "--tools", str(tmp_path / "tools.json"), "--tool-choice", "lookup", "Which?",
               "--endpoint", tiny_daemon, "--max-tokens", "100")
    assert out.returncode == 0 and "[tool call] lookup({\"key\": " in out.stdout and "finish: tool_calls" in out.stderr
    out = _cli("generate", "--json-schema", str(tmp_path / "missing.json"), "x", *flags)
    assert out.returncode == 1 and "cannot read" in out.stderr
