"""Replicas of the daemon's serving core on Ray Serve, behind the same OpenAI-compatible routes.

Each replica is a Ray Serve deployment replica (its own process) holding what a daemon holds: a
serving core (fly_daemon.core: a Scheduler running its engine in a model thread) and the HTTP
front's FastAPI app (fly_daemon.http.app) over the core's in-process client. Ray Serve's ingress routes
each request to a replica; the response names it in an `x-fly-replica` header. Ray calls
`check_health` on every replica: one whose models failed to load or whose model thread stopped
reports unhealthy, and Ray replaces it.

Used by `fly-serve` (fly_daemon.serve_cli), or by Ray users directly: `serve run
fly_daemon.replicas:build target=... replicas=2` or a Serve config file naming `fly_daemon.replicas:build`.

Wherever Serve's HTTP proxies listen beyond loopback, the builder and every replica refuse to serve
without an API key or with Ray's token authentication off (`require_secure_exposure`); on loopback the
routes answer only loopback Host names and `allowed_hosts`, as the daemon's own front does.
"""

from __future__ import annotations

import os
import time
from typing import Any

import ray
from ray import serve
from ray._private.authentication.authentication_utils import is_token_auth_enabled
from ray.serve.config import AutoscalingConfig, HTTPOptions
from ray.serve.context import _get_global_client
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fly_llm.common.config import FLyConfig, ModelSpec

from fly_daemon.core import build_core
from fly_daemon.http.app import require_key_off_loopback
from fly_daemon.runtime import is_loopback_host
from fly_daemon.settings import DaemonSettings, SettingsError, load_settings

REPLICA_HEADER = "x-fly-replica"
DEPLOYMENT = "FLyReplica"
RAY_AUTH_MODE = "RAY_AUTH_MODE"
"""Ray's switch for token authentication of its own cluster (gRPC, dashboard): 'token' or 'disabled'."""
_LOAD_POLL_S = 0.1


def serve_http_host() -> str | None:
    """Where Ray Serve's HTTP proxies listen: the running Serve instance's host, else the host `serve.start`
    takes by default (None: no proxies)."""
    client = _get_global_client(raise_if_no_controller_running=False) if ray.is_initialized() else None
    return client.http_config.host if client is not None else HTTPOptions().host


def require_secure_exposure(host: str | None, api_key: str | None) -> None:
    """ValueError if HTTP proxies on `host`, beyond loopback, would serve without an API key or with Ray's
    token authentication off; for a Ray not started yet in this process, RAY_AUTH_MODE=token when unset."""
    if host is None or is_loopback_host(host):
        return
    require_key_off_loopback(host, api_key)
    mode = _ray_auth_mode()
    if mode != "token":
        raise ValueError(f"refusing to serve HTTP on {host} (not loopback) with Ray's token authentication off "
                         f"({RAY_AUTH_MODE}={mode}): start the cluster with {RAY_AUTH_MODE}=token "
                         "(`ray get-auth-token --generate` makes a token)")


def _ray_auth_mode() -> str:
    """Ray's authentication mode here: the running cluster's, else RAY_AUTH_MODE (set to 'token' when unset)."""
    if ray.is_initialized():
        return "token" if is_token_auth_enabled() else "disabled"
    return os.environ.setdefault(RAY_AUTH_MODE, "token").lower()


class ReplicaHeader:
    """ASGI middleware: every HTTP response carries the replica that served it."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)


@serve.ingress()
class FLyReplica:
    """One replica: a serving core (a scheduler with its engine in a model thread) behind the HTTP front's routes."""

    def __init__(self, spec: ModelSpec, fly: FLyConfig, settings: DaemonSettings) -> None:
        self.settings = settings
        self.http_host = serve_http_host()
        # before loading models: Serve may be bound anywhere
        require_secure_exposure(self.http_host, settings.api_key_value())
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.core = build_core(spec, fly, settings)
        self.core.start()
        # Ray routes to a replica once its constructor returns: return when the models are loaded,
        # or fail (Ray retries the replica) when they cannot be.
        while self.core.scheduler.state == "loading":
            time.sleep(_LOAD_POLL_S)
        self.check_health()

    def __serve_build_asgi_app__(self) -> ASGIApp:
        """The HTTP front's app over this replica's core, naming the replica in each response."""
        app = self.core.http_app(self.settings, self.http_host)
        app.add_middleware(ReplicaHeader, replica=self.replica)
        return app

    def check_health(self) -> None:
        """Ray's health check: raise (Ray then replaces this replica) if the models failed or the model thread died."""
        scheduler = self.core.scheduler
        if scheduler.state == "failed" or not self.core.running():
            raise RuntimeError(f"replica {self.replica}: {scheduler.detail or 'the model thread stopped'}")


def application(spec: ModelSpec, fly: FLyConfig, settings: DaemonSettings, *, replicas: int = 1,
                min_replicas: int | None = None, max_replicas: int | None = None,
                num_gpus_per_replica: float = 0.0) -> serve.Application:
    """The Ray Serve application: `replicas` fixed replicas, or autoscaling between min and max."""
    options: dict[str, Any] = {"name": DEPLOYMENT, "ray_actor_options": {"num_gpus": num_gpus_per_replica},
                               "max_ongoing_requests": (settings.max_batch_size + settings.newcomer_rows
                                                        + settings.queue_size),  # all a replica may hold
                               "health_check_period_s": 5.0}
    if min_replicas is not None or max_replicas is not None:
        low = min_replicas if min_replicas is not None else 1
        high = max_replicas if max_replicas is not None else max(low, replicas)
        if not 0 <= low <= high or high < 1:
            raise SettingsError(f"autoscaling needs 0 <= min_replicas <= max_replicas, >= 1; got {low}..{high}")
        options["autoscaling_config"] = AutoscalingConfig(min_replicas=low, max_replicas=high,
                                                          initial_replicas=min(max(replicas, low), high))
    else:
        if replicas < 1:
            raise SettingsError(f"replicas must be at least 1, got {replicas}")
        options["num_replicas"] = replicas
    return serve.deployment(FLyReplica).options(**options).bind(spec, fly, settings)


def build(args: dict[str, Any]) -> serve.Application:
    """Application builder for `serve run fly_daemon.replicas:build key=value ...` and Serve config files.

    Keys: any ModelSpec, FLyConfig or daemon setting (`target`, `draft`, `dtype`, `window`,
    `max_batch_size`, …) plus `replicas`, `min_replicas`, `max_replicas`, `num_gpus_per_replica`;
    values are strings as `serve run` passes them; FLY_* variables and the config file apply as for
    `fly-daemon start`.
    """
    args = dict(args)
    config = args.pop("config", None)
    shape = {key: args.pop(key) for key in ("replicas", "min_replicas", "max_replicas", "num_gpus_per_replica")
             if key in args}
    known = set(ModelSpec.model_fields) | set(FLyConfig.model_fields) | set(DaemonSettings.model_fields)
    unknown = sorted(set(args) - known)
    if unknown:
        raise SettingsError(f"unknown fly-serve settings: {', '.join(unknown)}")
    settings = load_settings(DaemonSettings, config, args)
    require_secure_exposure(serve_http_host(), settings.api_key_value())
    return application(
        load_settings(ModelSpec, config, args), load_settings(FLyConfig, config, args),
        settings, replicas=int(shape.get("replicas", 1)),
        min_replicas=_optional_int(shape.get("min_replicas")), max_replicas=_optional_int(shape.get("max_replicas")),
        num_gpus_per_replica=float(shape.get("num_gpus_per_replica", 0.0)))


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)
