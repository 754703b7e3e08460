"""Open WebUI in headless Chromium against fly-daemon: one chat turn per API, checked, timed, screenshotted.

Open WebUI (its own virtual environment: it pins hundreds of packages) is pointed at the daemon's HTTP
front as an OpenAI connection (`/v1`) and, in a second start, as an Ollama connection (`/api`); Playwright
drives Chromium through the page as a person would: pick the model, send the prompt, wait until the
streamed answer is finished. The checks: the answer on screen is not empty, the daemon counted exactly
one more successful request for it, and its words are the daemon's own answer to the same messages asked
again directly on the same API (greedy decoding is deterministic). See docs/webui.md.

    python benchmarks/serving/webui_check.py --open-webui ~/webui-venv/bin/open-webui              # tiny random pair
    python benchmarks/serving/webui_check.py --open-webui ~/webui-venv/bin/open-webui --embedded --dtype auto \
        --screenshot docs/images/webui-chat.png

Needs `playwright` (the Python package only: it drives the system's Chromium, nothing is downloaded) and a
Chromium (`apt-get install chromium`). No network: Open WebUI runs offline, without its embedding model.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.serving.serve_bench import add_model_arguments, resolve_models, start_daemon

PROMPT = "What is speculative decoding? Answer in two sentences."
APIS = ("openai", "ollama")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1280, "height": 800}


@dataclass
class Turn:
    """One chat turn through the UI and what the checks found."""

    api: str
    model: str
    answer: str
    first_text_s: float
    turn_s: float
    ok_requests: int
    failed_requests: int
    completion_tokens: int
    same_as_daemon: bool

    @property
    def passed(self) -> bool:
        """Every check held."""
        return bool(self.answer.strip()) and self.ok_requests == 1 and not self.failed_requests \
            and self.same_as_daemon


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, body: dict | None = None, timeout: float = 600) -> dict:
    """GET (or POST `body` as JSON to) `url`; the decoded JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.load(reply)


def request_counts(metrics_url: str) -> dict[str, float]:
    """The daemon's `fly_requests_total` by outcome, and `completion_tokens`, from its Prometheus text."""
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "fly_requests_total":
                counts[sample.labels["outcome"]] = sample.value
            elif sample.name == "fly_completion_tokens_total":
                counts["completion_tokens"] = sample.value
    return counts


def open_webui_env(api: str, daemon_url: str, data_dir: Path) -> dict[str, str]:
    """Open WebUI's settings: one connection to the daemon, offline, no login, no side requests.

    Its built-in tools (36 function specs, ~26,000 characters of prompt on every turn) are off: on a CPU
    their prefill alone would take minutes. Title, tag and follow-up generation would each be one more
    request to the model per turn.
    """
    env = {key: value for key, value in os.environ.items() if not key.startswith(("OPENAI_", "OLLAMA_"))}
    env.update(
        DATA_DIR=str(data_dir), WEBUI_AUTH="False", WEBUI_SECRET_KEY="fly-webui-check",
        OFFLINE_MODE="true", HF_HUB_OFFLINE="1", RAG_EMBEDDING_MODEL="", ENABLE_VERSION_UPDATE_CHECK="False",
        ANONYMIZED_TELEMETRY="False", DO_NOT_TRACK="true", SCARF_NO_ANALYTICS="true",
        DEFAULT_MODEL_METADATA=json.dumps({"capabilities": {"builtin_tools": False}}),
        ENABLE_TITLE_GENERATION="False", ENABLE_TAGS_GENERATION="False", ENABLE_FOLLOW_UP_GENERATION="False",
        ENABLE_AUTOCOMPLETE_GENERATION="False",
        ENABLE_OPENAI_API=str(api == "openai"), ENABLE_OLLAMA_API=str(api == "ollama"),
    )
    if api == "openai":
        env.update(OPENAI_API_BASE_URL=f"{daemon_url}/v1", OPENAI_API_KEY="unused")
    else:
        env["OLLAMA_BASE_URL"] = daemon_url
    return env


class OpenWebUI:
    """`open-webui serve` on a loopback port with a fresh data directory; its output goes to `log`."""

    def __init__(self, executable: str, api: str, daemon_url: str, workdir: Path) -> None:
        """Start it (the page answers once `wait_ready` returns)."""
        port = str(free_port())
        self.url = f"http://127.0.0.1:{port}"
        data_dir = workdir / f"webui-{api}"
        data_dir.mkdir()
        self.log = workdir / f"webui-{api}.log"
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([executable, "serve", "--host", "127.0.0.1", "--port", port],
                                         stdout=out, stderr=subprocess.STDOUT,
                                         env=open_webui_env(api, daemon_url, data_dir))

    def wait_ready(self, timeout: float = 300) -> None:
        """Wait for its /health; raise with the log's tail if it exits or never answers."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if get_json(f"{self.url}/health", timeout=5).get("status"):
                    return
            except OSError:
                time.sleep(1)
        tail = self.log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"Open WebUI did not start (exit {self.proc.poll()}):\n{tail}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 20 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def words(text: str) -> list[str]:
    """The letters-and-digits words of a text: rendered Markdown and its source have the same ones."""
    return re.findall(r"[^\W_]+", text)


def chat_turn(page, url: str, model: str, prompt: str, timeout_s: float) -> tuple[str, float, float]:
    """Open the UI, pick `model`, send `prompt`, wait for the finished answer.

    Returns (answer as shown, seconds to its first text, seconds to the end of the turn).
    """
    timeout_ms = timeout_s * 1000
    page.goto(url, wait_until="load", timeout=timeout_ms)
    page.locator("#chat-input").wait_for(timeout=timeout_ms)
    dismiss_changelog(page)
    page.locator("button[aria-label^='Selected model']").first.click()
    page.get_by_role("option").filter(has_text=model).first.click()
    page.locator("#chat-input").click()
    page.keyboard.type(prompt)
    start = time.monotonic()
    page.keyboard.press("Enter")
    content = page.locator(".chat-assistant #response-content-container").last
    content.filter(has_text=re.compile(r"\S")).wait_for(timeout=timeout_ms)
    first_text = time.monotonic() - start
    page.locator("button[aria-label='Regenerate']").last.wait_for(timeout=timeout_ms)
    return content.inner_text(), first_text, time.monotonic() - start


def dismiss_changelog(page, wait_s: float = 3.0) -> None:
    """Close Open WebUI's 'What's New' dialog, which a fresh install opens over the chat."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    button = page.get_by_role("button", name="Okay, Let's Go!")
    try:
        button.wait_for(timeout=wait_s * 1000)
    except PlaywrightTimeout:  # no dialog this time
        return
    button.click()


def take_screenshot(page, path: Path) -> None:
    """The finished turn with its usage tooltip open (Ollama's connection shows tokens/s), toasts gone."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.locator("[data-sonner-toast]").first.wait_for(state="detached", timeout=10_000)
    except PlaywrightTimeout:  # a toast that stays is in the picture
        pass
    page.locator("button[aria-label='Info']").last.hover()
    page.wait_for_timeout(1000)
    page.screenshot(path=str(path))


def daemon_answer(api: str, daemon_url: str, model: str, prompt: str) -> str:
    """The daemon's answer to the UI's messages, asked directly on the same API with its defaults."""
    messages = [{"role": "user", "content": prompt}]
    if api == "ollama":
        reply = get_json(f"{daemon_url}/api/chat", {"model": model, "messages": messages, "stream": False})
        return reply["message"]["content"]
    reply = get_json(f"{daemon_url}/v1/chat/completions", {"model": model, "messages": messages})
    return reply["choices"][0]["message"]["content"]


def run_turn(browser, api: str, args: argparse.Namespace, daemon_url: str, metrics_url: str,
             workdir: Path) -> Turn:
    """Start Open WebUI on `api`, drive one turn, check it against the daemon; screenshot it."""
    model = get_json(f"{daemon_url}/v1/models")["data"][0]["id"]
    webui = OpenWebUI(args.open_webui, api, daemon_url, workdir)
    try:
        webui.wait_ready()
        before = request_counts(metrics_url)
        page = browser.new_page(viewport=VIEWPORT)
        answer, first_text, seconds = chat_turn(page, webui.url, model, args.prompt, args.timeout)
        after = request_counts(metrics_url)
        if args.screenshot:
            take_screenshot(page, screenshot_path(args.screenshot, api, args.api))
        page.close()
    finally:
        webui.stop()
    same = words(answer) == words(daemon_answer(api, daemon_url, model, args.prompt))
    failed = sum(after.get(k, 0) - before.get(k, 0) for k in after if k not in ("ok", "completion_tokens"))
    return Turn(api, model, answer, round(first_text, 2), round(seconds, 2),
                int(after.get("ok", 0) - before.get("ok", 0)), int(failed),
                int(after.get("completion_tokens", 0) - before.get("completion_tokens", 0)), same)


def screenshot_path(path: Path, api: str, apis: list[str]) -> Path:
    """`path` for the first API's turn; `<stem>-<api><suffix>` beside it for the others."""
    return path if api == apis[0] else path.with_name(f"{path.stem}-{api}{path.suffix}")


def installed_programs() -> tuple[str | None, str | None]:
    """(open-webui, chromium) executables: $FLY_OPEN_WEBUI / $FLY_CHROMIUM, else found on PATH; None if neither."""
    return (os.environ.get("FLY_OPEN_WEBUI") or shutil.which("open-webui"),
            os.environ.get("FLY_CHROMIUM") or shutil.which("chromium"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    open_webui, chromium = installed_programs()
    p.add_argument("--open-webui", default=open_webui,
                   help="the open-webui executable (default: $FLY_OPEN_WEBUI, else on PATH)")
    p.add_argument("--chromium", default=chromium,
                   help="the Chromium executable (default: $FLY_CHROMIUM, else chromium on PATH)")
    p.add_argument("--api", nargs="+", choices=APIS, default=list(APIS), help="Open WebUI's connection(s)")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--screenshot", type=Path, help="PNG of the finished turn (the first API's)")
    p.add_argument("--timeout", type=float, default=600, help="seconds for each step of a turn")
    p.add_argument("--exact", action="store_true", help="the daemon in exact mode (--no-loose)")
    p.set_defaults(concurrency=[4])  # start_daemon's --max-batch-size
    args = p.parse_args(argv)
    if not args.open_webui or not args.chromium:
        p.error("needs Open WebUI (--open-webui) and Chromium (--chromium)")
    return args


def run_check(args: argparse.Namespace) -> list[Turn]:
    """Serve `args`' models with the HTTP front, then one turn through Open WebUI per API in `args.api`."""
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="fly-webui-") as tmp:
        workdir = Path(tmp)
        target, draft = resolve_models(args, workdir)
        http_port, metrics_port = free_port(), free_port()
        daemon, _ = start_daemon(target, draft, args, workdir,
                                 ("--http", f"127.0.0.1:{http_port}", "--metrics-port", str(metrics_port)))
        try:
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=args.chromium, args=CHROMIUM_FLAGS)
                try:
                    return [run_turn(browser, api, args, f"http://127.0.0.1:{http_port}",
                                     f"http://127.0.0.1:{metrics_port}/metrics", workdir) for api in args.api]
                finally:
                    browser.close()
        finally:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(60)
            except subprocess.TimeoutExpired:
                daemon.kill()


def main(argv: list[str] | None = None) -> int:
    """Run the check; print its turns as JSON; exit 1 when a check failed."""
    turns = run_check(parse_args(argv))
    print(json.dumps([asdict(t) | {"passed": t.passed} for t in turns], indent=2))
    return 0 if all(t.passed for t in turns) else 1


if __name__ == "__main__":
    sys.exit(main())
