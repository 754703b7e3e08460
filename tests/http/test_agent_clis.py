"""The coding agents' own command lines against the HTTP front, installed from npm as a user installs them
(issue 64): Claude Code on the Messages API and Codex CLI on the Responses API, each asked one thing in its
non-interactive mode. The engine double answers a few words, so what is checked is the door: the CLI's first
request (its system prompt, tools and settings as it really sends them) is accepted, streamed back in the shape
the CLI parses, and printed. Skipped where npm is not installed; the versions are pinned."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from support.engine_double import ShortAnswers
from support.http_double import double_front

CLIS = {"claude": "@anthropic-ai/claude-code@2.1.197", "codex": "@openai/codex@0.171.0"}
"""The CLIs and the versions checked (their requests change from release to release)."""
ANSWER = "1 2 3 4 5 6"
"""What ShortAnswers says: the double's six counted tokens."""

pytestmark = pytest.mark.skipif(shutil.which("npm") is None, reason="needs npm (Node.js) to install the agent CLIs")


@pytest.fixture(scope="module")
def bin_dir(tmp_path_factory) -> Path:
    """The CLIs' executables, installed with npm into a fresh directory."""
    root = tmp_path_factory.mktemp("clis")
    subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(root), *CLIS.values()],
                   check=True, capture_output=True, timeout=600)
    return root / "node_modules" / ".bin"


def run_cli(command: list[str], env: dict[str, str], home: Path) -> subprocess.CompletedProcess[str]:
    """`command` with only `env` and a fresh home beside PATH: no key or setting of this machine leaks in."""
    home.mkdir()
    base = {"PATH": os.environ["PATH"], "HOME": str(home), "NO_COLOR": "1"}
    return subprocess.run(command, env={**base, **env}, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)


def test_claude_code_prints_the_answer(bin_dir, tmp_path):
    engine = ShortAnswers()
    with double_front(tmp_path, engine) as (_, client):
        done = run_cli([str(bin_dir / "claude"), "-p", "say hi"],
                       {"ANTHROPIC_BASE_URL": str(client.base_url), "ANTHROPIC_API_KEY": "sk-local",
                        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}, tmp_path / "home")
    assert done.returncode == 0 and ANSWER in done.stdout, (done.stdout[-2000:], done.stderr[-2000:])
    assert engine.prompts and engine.prompts[0] > 500  # its system prompt and tools came through


def test_codex_prints_the_answer(bin_dir, tmp_path):
    engine = ShortAnswers()
    with double_front(tmp_path, engine) as (_, client):
        provider = f'{{name="fly",base_url="{client.base_url}/v1",wire_api="responses"}}'
        home = tmp_path / "home"
        done = run_cli([str(bin_dir / "codex"), "exec", "--skip-git-repo-check", "-c", "model_provider=fly",
                        "-c", f"model_providers.fly={provider}", "-m", "qwen2.5-coder", "say hi"],
                       {"CODEX_HOME": str(home)}, home)
    assert done.returncode == 0 and ANSWER in done.stdout, (done.stdout[-2000:], done.stderr[-2000:])
    assert engine.prompts and engine.prompts[0] > 500
