"""`fly-daemon start | stop | status | generate`: run and use the daemon from a shell, like ollama.

    fly-daemon start                  # the embedded default pair, detached; prints where and when ready
    fly-daemon start --foreground --target DIR --draft DIR --endpoint ipc:///tmp/fly.sock
    fly-daemon status                 # state, models, uptime, queue, batch, throughput, acceptance
    fly-daemon generate "Write a Python function that reverses a string."  # chat; streams the answer
    fly-daemon generate --raw "def fib(n):"  # plain completion of the text
    fly-daemon generate --json-schema answer.json "What is 2 + 3?"  # JSON valid under the schema
    fly-daemon generate --tools tools.json "Weather in Paris?"  # may call the tools (OpenAI format)
    fly-daemon stop                   # graceful: running requests finish within --drain-timeout
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from fly_llm.client import FLyClient, build_options, default_endpoint
from fly_llm.common.config import DRAFT_STAGES, FLyConfig, ModelSpec
from fly_llm.common.errors import BadRequest, FLyError, FLyUnavailable
from fly_llm.common.protocol import GenerateResult
from fly_llm.common.tools import offer_tools

from fly_daemon.embeddings import EmbeddingSettings
from fly_daemon.flags import add_flags
from fly_daemon.runtime import AlreadyRunning, check_endpoint, daemon_files, open_private, running_pid
from fly_daemon.settings import DaemonSettings, SettingsError, load_settings


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `fly-daemon` command."""
    parser = _parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.func(args)
    except SettingsError as exc:
        print(f"fly-daemon: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fly-daemon", description="FLy speculative decoding, served locally.")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    start = sub.add_parser("start", help="start the daemon (detached unless --foreground)")
    _endpoint_arg(start)
    add_model_arguments(start)
    serve = start.add_argument_group("serving ([daemon] settings: fly_daemon.settings.DaemonSettings)")
    add_flags(serve, DaemonSettings, [name for name in DaemonSettings.model_fields
                                      if name not in EmbeddingSettings.model_fields and name != "endpoint"])
    add_flags(start.add_argument_group("embeddings (/v1/embeddings, /api/embed; the model loads on first use)"),
              EmbeddingSettings)
    start.add_argument("--foreground", action="store_true", help="stay attached; log to the terminal")
    start.add_argument("--wait", type=float, default=900.0, help="detached: seconds to wait for 'ready'")
    start.add_argument("-v", "--verbose", action="store_true")
    start.set_defaults(func=_start)

    stop = sub.add_parser("stop", help="stop the daemon gracefully")
    _endpoint_arg(stop)
    stop.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for it to exit")
    stop.set_defaults(func=_stop)

    status = sub.add_parser("status", help="state, models, load and acceptance of the daemon")
    _endpoint_arg(status)
    status.add_argument("--json", action="store_true", help="print the raw status reply")
    status.set_defaults(func=_status)

    gen = sub.add_parser("generate", help="stream an answer to the terminal (a chat turn unless --raw)",
                         description="Send PROMPT as a user chat message through the model's chat template "
                                     "(when it has none, or with --raw, as plain text to complete).")
    _endpoint_arg(gen)
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="plain completion: the model continues the prompt text")
    gen.add_argument("--chat", action="store_true", help=argparse.SUPPRESS)  # accepted: chat is the default now
    gen.add_argument("--max-tokens", type=int)
    gen.add_argument("--temperature", type=float)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--k", type=int)
    gen.add_argument("--window", type=int)
    gen.add_argument("--entropy-threshold", type=float)
    gen.add_argument("--no-loose", action="store_true")
    gen.add_argument("--json-schema", type=Path, metavar="FILE", help="answer with JSON valid under this JSON Schema")
    gen.add_argument("--json", action="store_true", help="answer with a JSON object")
    gen.add_argument("--tools", type=Path, metavar="FILE", help="a JSON list of OpenAI-style tools the model may call")
    gen.add_argument("--tool-choice", default=None,
                     help="'auto' (default with --tools), 'none', 'required', or the name of one tool")
    gen.add_argument("--timeout", type=float, default=600.0)
    gen.set_defaults(func=_generate)
    return parser


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and FLy options of `fly-daemon start` (fly-serve takes the same)."""
    add_flags(parser.add_argument_group("models ([model] settings)"), ModelSpec)
    fly = parser.add_argument_group("FLy ([fly] settings: defaults for every request; requests may override k, "
                                    "window, θ, loose)")
    add_flags(fly, FLyConfig)
    fly.add_argument("--no-ngram", dest="stages", action="store_const",
                     const=tuple(s for s in DRAFT_STAGES if s != "ngram"), help="no n-gram prompt-lookup stage")


def _endpoint_arg(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, DaemonSettings, ["endpoint"])
    parser.add_argument("--config", type=Path, help="TOML config file (default: $FLY_CONFIG or "
                                                    "~/.config/fly-llm/config.toml)")


def _daemon_settings(args: argparse.Namespace) -> DaemonSettings:
    """The [daemon] settings: CLI flags > FLY_* environment > config file > defaults."""
    return load_settings(DaemonSettings, args.config, vars(args))


def _endpoint(args: argparse.Namespace) -> str:
    return _daemon_settings(args).endpoint or default_endpoint()


# ---- start ----

def _start(args: argparse.Namespace) -> int:
    endpoint = _endpoint(args)
    for model in (ModelSpec, FLyConfig):  # report bad model/FLy settings here, not in a detached log
        load_settings(model, args.config, vars(args))
    try:
        check_endpoint(endpoint)
    except ValueError as exc:
        print(f"fly-daemon: {exc}", file=sys.stderr)
        return 2
    pid = running_pid(endpoint)
    if pid is not None:
        print(f"fly-daemon: already running at {endpoint} (pid {pid}); `fly-daemon stop` first", file=sys.stderr)
        return 1
    return _serve(args, endpoint) if args.foreground else _detach(args, endpoint)


def _serve(args: argparse.Namespace, endpoint: str) -> int:
    """Run the daemon in this process until stopped."""
    from fly_daemon.core import build_core
    from fly_daemon.server import CurveKeys, Server

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s fly-daemon: %(message)s", datefmt="%H:%M:%S")
    settings = _daemon_settings(args)
    curve = None
    if settings.curve_secret_key or settings.curve_clients:
        if not (settings.curve_secret_key and settings.curve_clients):
            print("fly-daemon: CURVE needs both --curve-secret-key and --curve-clients", file=sys.stderr)
            return 2
        curve = CurveKeys(settings.curve_secret_key, settings.curve_clients)

    core = build_core(load_settings(ModelSpec, args.config, vars(args)),
                      load_settings(FLyConfig, args.config, vars(args)), settings)
    try:
        server = Server(endpoint, core, max_frame_bytes=settings.max_frame_bytes, curve=curve)
        http = core.http_front(settings)
    except (ValueError, OSError) as exc:  # a bind refused or taken
        print(f"fly-daemon: {exc}", file=sys.stderr)
        return 2
    if settings.metrics_port:
        core.scheduler.metrics.serve(settings.metrics_port)
        logging.getLogger("fly_daemon").info("metrics on http://127.0.0.1:%d/metrics", settings.metrics_port)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.request_stop())
    try:
        if http is not None:
            http.start()
        return server.serve()
    except (AlreadyRunning, OSError, ValueError) as exc:  # endpoint taken, unreadable CURVE keys
        print(f"fly-daemon: {exc}", file=sys.stderr)
        return 1
    finally:
        if http is not None:
            http.stop()


def _detach(args: argparse.Namespace, endpoint: str) -> int:
    """Start `start --foreground` in a new session with its output in the log file; wait for ready."""
    _, logfile = daemon_files(endpoint)
    argv = [a for a in args.argv if a != "--foreground"]
    try:
        log_fd = open_private(logfile, os.O_WRONLY | os.O_APPEND)
    except OSError as exc:  # e.g. a symbolic link planted where the log goes
        print(f"fly-daemon: {exc}", file=sys.stderr)
        return 1
    with os.fdopen(log_fd, "ab") as log:
        child = subprocess.Popen([sys.executable, "-m", "fly_daemon.cli", *argv, "--foreground",
                                  "--endpoint", endpoint], stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    print(f"fly-daemon: started (pid {child.pid}) on {endpoint}; log: {logfile}")
    client = FLyClient(endpoint, timeout=2.0, max_retries=0)
    deadline = time.monotonic() + args.wait
    shown = ""
    try:
        while time.monotonic() < deadline:
            if child.poll() is not None:
                print(f"fly-daemon: exited with status {child.returncode}; last lines of {logfile}:\n"
                      + _tail(logfile), file=sys.stderr)
                return 1
            try:
                health = client.health()
            except FLyUnavailable:
                time.sleep(0.5)
                continue
            if health.state == "ready":
                http = _daemon_settings(args).http
                print(f"fly-daemon: ready on {endpoint}" + (f" and http://{http}/v1" if http else ""))
                return 0
            if health.state == "failed":
                print(f"fly-daemon: {health.detail}", file=sys.stderr)
                return 1
            if health.detail != shown:
                print(f"fly-daemon: {health.state}: {health.detail}")
                shown = health.detail
            time.sleep(0.5)
    finally:
        client.close()
    print(f"fly-daemon: not ready after {args.wait:.0f} s; still starting, see {logfile}")
    return 0


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# ---- stop / status / generate ----

def _stop(args: argparse.Namespace) -> int:
    endpoint = _endpoint(args)
    pid = running_pid(endpoint)
    if pid is None:
        print(f"fly-daemon: not running at {endpoint}", file=sys.stderr)
        return 1
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        if running_pid(endpoint) is None:
            print(f"fly-daemon: stopped (pid {pid})")
            return 0
        time.sleep(0.2)
    print(f"fly-daemon: pid {pid} did not stop within {args.timeout:.0f} s", file=sys.stderr)
    return 1


def _status(args: argparse.Namespace) -> int:
    endpoint = _endpoint(args)
    with FLyClient(endpoint, timeout=3.0, max_retries=0) as client:
        try:
            st = client.status()
        except FLyUnavailable:
            print(f"fly-daemon: not running at {endpoint}", file=sys.stderr)
            return 1
    if args.json:
        print(st.model_dump_json(indent=2))
        return 0
    s, p, g = st.stats, st.prompt, st.grammars
    print(f"state      {st.state} (pid {st.pid}, up {_duration(st.uptime_s)}) on {endpoint}\n"
          f"models     target {st.target}  draft {st.draft}\n"
          f"load       {st.queue_depth} queued, {st.active} running, largest batch {st.max_batch_size_seen}\n"
          f"served     {st.requests_total} requests, {st.tokens_generated} tokens, "
          f"{st.tokens_per_s:.1f} tokens/s while busy\n"
          f"accepted   MAT {s.mat:.2f} tokens/round, {s.accepted_native + s.accepted_loose} of {s.drafted} "
          f"drafted ({s.loose_rate:.0%} loosely)\n"
          f"prompts    {p.prompt_tokens} tokens, {p.hit_rate:.0%} from the prefix cache "
          f"({p.cache_bytes / 2**20:.1f} of {p.cache_budget_bytes / 2**20:.0f} MiB, {p.cache_evictions} blocks evicted)\n"
          f"grammars   {g.compiled_entries} compiled, {g.compiled_bytes / 2**20:.1f} of "
          f"{g.compiled_budget_bytes / 2**20:.0f} MiB (texts {g.texts_bytes / 2**20:.1f} MiB, verdicts "
          f"{g.verdict_bytes / 2**20:.1f} MiB)")
    return 0


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def _generate(args: argparse.Namespace) -> int:
    endpoint = _endpoint(args)
    sampling, fly = build_options(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                                  k=args.k, window=args.window, entropy_threshold=args.entropy_threshold,
                                  loose=False if args.no_loose else None)
    with FLyClient(endpoint, timeout=args.timeout) as client:
        try:
            structure = _structure(args)
            chat = not args.raw and _has_chat_template(client)
            source = {"messages": [{"role": "user", "content": args.prompt}]} if chat else {"prompt": args.prompt}
            for item in client.stream(**source, sampling=sampling, fly=fly, **structure):
                if isinstance(item, GenerateResult):
                    rate = item.usage.completion_tokens / item.elapsed_s if item.elapsed_s else 0.0
                    print(f"\n[{item.usage.completion_tokens} tokens, {rate:.1f} tokens/s, "
                          f"MAT {item.stats.mat:.2f}, forced {item.stats.forced}, finish: {item.finish_reason}]",
                          file=sys.stderr)
                else:
                    print(item.text, end="", flush=True)
                    for call in item.tool_calls:
                        print(f"\n[tool call] {call.name}({json.dumps(call.arguments)})", flush=True)
        except FLyError as exc:
            print(f"\nfly-daemon: {exc}", file=sys.stderr)
            return 1
    return 0


def _structure(args: argparse.Namespace) -> dict:
    """tools / tool_choice / response_format from the generate flags (BadRequest for an unreadable file, a bad
    tool or a tool_choice naming no tool in it)."""
    structure: dict = {}
    if args.json_schema is not None:
        structure["response_format"] = {"type": "json_schema", "schema": _read_json(args.json_schema)}
    elif args.json:
        structure["response_format"] = {"type": "json_object"}
    if args.tools is not None:
        try:
            structure.update(offer_tools(_read_json(args.tools), args.tool_choice or "auto"))
        except ValueError as exc:
            raise BadRequest(f"{args.tools}: {exc}") from None
    return structure


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BadRequest(f"cannot read {path}: {exc}") from None


def _has_chat_template(client: FLyClient) -> bool:
    """Whether the served model has a chat template (waits while the daemon loads its models)."""
    while client.health().state == "loading":
        time.sleep(0.5)
    return client.info().chat_template


if __name__ == "__main__":
    sys.exit(main())
