"""`fly-serve`: replicas of the daemon's serving core on Ray Serve, behind the OpenAI-compatible routes.

    fly-serve --replicas 2                        # a local Ray instance; http://127.0.0.1:8000/v1
    fly-serve --min-replicas 1 --max-replicas 4   # Ray autoscales on ongoing requests
    RAY_ADDRESS=auto fly-serve --replicas 4 --num-gpus-per-replica 1 --http 0.0.0.0:8000 --api-key ...

Starts a local Ray instance, or joins the cluster at RAY_ADDRESS. Each replica loads its own models
(the same options as `fly-daemon start`) and serves POST /v1/chat/completions, /v1/completions,
GET /v1/models and /health; every response names its replica in the `x-fly-replica` header.
Stops (and removes the application) on Ctrl-C or SIGTERM. Beyond loopback it needs an API key (an
empty one is none) and Ray's token authentication (RAY_AUTH_MODE=token, set when unset; a cluster
joined at RAY_ADDRESS must run with it); on loopback the routes answer only loopback Host names
and --allowed-host.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from fly_llm.common.config import FLyConfig, ModelSpec

from fly_daemon.cli import add_model_arguments
from fly_daemon.runtime import host_port
from fly_daemon.settings import DaemonSettings, SettingsError, load_settings

APP_NAME = "fly"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fly-serve", description=__doc__.split("\n\n")[0].strip("`"))
    parser.add_argument("--http", default="127.0.0.1:8000", metavar="HOST:PORT",
                        help="where Ray Serve's HTTP proxy listens")
    parser.add_argument("--replicas", type=int, default=1, help="replicas (each holds its own models)")
    parser.add_argument("--min-replicas", type=int, help="autoscaling: fewest replicas (with --max-replicas)")
    parser.add_argument("--max-replicas", type=int, help="autoscaling: most replicas")
    parser.add_argument("--num-gpus-per-replica", type=float, default=0.0, help="GPUs Ray reserves per replica")
    parser.add_argument("--api-key", help="Bearer key the routes require (needed off loopback; prefer FLY_API_KEY)")
    parser.add_argument("--allowed-host", dest="allowed_hosts", action="append", metavar="HOST",
                        help="also answer requests whose Host is HOST (repeatable; '*': any)")
    parser.add_argument("--wait", type=float, default=900.0, help="seconds to wait for the first ready replica")
    parser.add_argument("--config", type=Path, help="TOML config file, as for fly-daemon")
    serving = parser.add_argument_group("serving, per replica (as for fly-daemon start)")
    for flag in ("--queue-size", "--max-batch-size", "--max-tokens-limit", "--prefix-cache-mb", "--prefill-chunk"):
        serving.add_argument(flag, type=int)
    add_model_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `fly-serve`."""
    args = _parser().parse_args(argv)
    try:
        host, port = host_port(args.http)
        values = {key: value for key, value in vars(args).items() if key != "http"}
        spec, fly = load_settings(ModelSpec, args.config, values), load_settings(FLyConfig, args.config, values)
        settings = load_settings(DaemonSettings, args.config, values)
    except (SettingsError, ValueError) as exc:
        print(f"fly-serve: {exc}", file=sys.stderr)
        return 2

    import ray
    from ray import serve
    from ray.exceptions import AuthenticationError

    from fly_daemon.replicas import application, require_secure_exposure

    try:
        require_secure_exposure(host, settings.api_key_value())
        app = application(spec, fly, settings, replicas=args.replicas, min_replicas=args.min_replicas,
                          max_replicas=args.max_replicas, num_gpus_per_replica=args.num_gpus_per_replica)
        ray.init()  # joins RAY_ADDRESS when set, else starts a local instance
    except (ValueError, AuthenticationError) as exc:  # SettingsError is a ValueError
        print(f"fly-serve: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options=http_options(host, port, settings))
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        if not _wait_ready(url, args.wait, stop):
            print(f"fly-serve: no replica became ready within {args.wait:.0f} s", file=sys.stderr)
            return 1
        print(f"fly-serve: serving {url}/v1 ({_shape(args)}); Ctrl-C stops", flush=True)
        stop.wait()
        return 0
    finally:
        serve.delete(APP_NAME)
        ray.shutdown()


def http_options(host: str, port: int, settings: DaemonSettings) -> dict[str, Any]:
    """Ray Serve's HTTP proxy options: where it listens, and the daemon's idle keep-alive timeout (Ray takes
    whole seconds; its own default is 90).

    The proxies are Ray's (uvicorn inside), so of the daemon front's connection limits only this one
    carries over: head and body timeouts and the connection caps (`http_header_timeout`,
    `http_body_timeout`, `http_max_connections*`) are not Ray's to set (docs/daemon.md, fly-serve)."""
    return {"host": host, "port": port, "keep_alive_timeout_s": math.ceil(settings.http_keep_alive_timeout)}  # whole s


def _shape(args: argparse.Namespace) -> str:
    if args.min_replicas is not None or args.max_replicas is not None:
        return f"autoscaling {args.min_replicas or 1}..{args.max_replicas or max(args.replicas, 1)} replicas"
    return f"{args.replicas} replica{'s' if args.replicas != 1 else ''}"


def _wait_ready(url: str, timeout: float, stop: threading.Event) -> bool:
    """Poll GET /health until a replica answers 200 (its models are loaded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stop.is_set():
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
                if reply.status == 200 and json.load(reply).get("state") == "ready":
                    return True
        except (urllib.error.URLError, OSError, ValueError):
            pass
        stop.wait(1.0)
    return False


if __name__ == "__main__":
    sys.exit(main())
