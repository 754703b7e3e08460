"""Replicas of the daemon's serving core on Ray Serve, behind the same OpenAI-compatible routes.

Each replica is a Ray Serve deployment replica (its own process) holding what a daemon holds: a
Scheduler running its engine in a model thread, and the HTTP front's FastAPI app (fly_daemon.http)
over an in-process client of that scheduler. Ray Serve's ingress routes each request to a replica;
the response names it in an `x-fly-replica` header. Ray calls `check_health` on every replica: one
whose models failed to load or whose model thread stopped reports unhealthy, and Ray replaces it.

Used by `fly-serve` (fly_daemon.serve_cli), or by Ray users directly: `serve run
fly_daemon.replicas:build target=... replicas=2` or a Serve config file naming `fly_daemon.replicas:build`.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fly_llm.config import FLyConfig, ModelSpec

from fly_daemon.cli import engine_loader
from fly_daemon.http import create_app
from fly_daemon.inproc import InProcessClient
from fly_daemon.scheduler import Scheduler
from fly_daemon.settings import DaemonSettings, SettingsError, load_settings

REPLICA_HEADER = "x-fly-replica"
DEPLOYMENT = "FLyReplica"
_LOAD_POLL_S = 0.1


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
    """One replica: a scheduler with its engine in a model thread, served by the HTTP front's routes."""

    def __init__(self, spec: ModelSpec, fly: FLyConfig, settings: DaemonSettings) -> None:
        self.settings = settings
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.scheduler = Scheduler(engine_loader(spec, fly, settings), self._emit, settings)
        self.client = InProcessClient(self.scheduler)
        self.model_thread = threading.Thread(target=self.scheduler.run, name="fly-model", daemon=True)
        self.model_thread.start()
        # Ray routes to a replica once its constructor returns: return when the models are loaded,
        # or fail (Ray retries the replica) when they cannot be.
        while self.scheduler.state == "loading":
            time.sleep(_LOAD_POLL_S)
        self.check_health()

    def _emit(self, envelope: Any, message: Any) -> None:
        self.client.deliver(envelope, message)

    def __serve_build_asgi_app__(self) -> ASGIApp:
        """The HTTP front's app over this replica's scheduler, naming the replica in each response."""
        api_key = self.settings.api_key.get_secret_value() if self.settings.api_key else None
        app = create_app(self.client, api_key=api_key, max_body_bytes=self.settings.max_frame_bytes)
        app.add_middleware(ReplicaHeader, replica=self.replica)
        return app

    def check_health(self) -> None:
        """Ray's health check: raise (Ray then replaces this replica) if the models failed or the model thread died."""
        if self.scheduler.state == "failed" or not self.model_thread.is_alive():
            raise RuntimeError(f"replica {self.replica}: {self.scheduler.detail or 'the model thread stopped'}")


def application(spec: ModelSpec, fly: FLyConfig, settings: DaemonSettings, *, replicas: int = 1,
                min_replicas: int | None = None, max_replicas: int | None = None,
                num_gpus_per_replica: float = 0.0) -> serve.Application:
    """The Ray Serve application: `replicas` fixed replicas, or autoscaling between min and max."""
    options: dict[str, Any] = {"name": DEPLOYMENT, "ray_actor_options": {"num_gpus": num_gpus_per_replica},
                               "max_ongoing_requests": settings.max_batch_size + settings.queue_size,
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
    return application(
        load_settings(ModelSpec, config, args), load_settings(FLyConfig, config, args),
        load_settings(DaemonSettings, config, args), replicas=int(shape.get("replicas", 1)),
        min_replicas=_optional_int(shape.get("min_replicas")), max_replicas=_optional_int(shape.get("max_replicas")),
        num_gpus_per_replica=float(shape.get("num_gpus_per_replica", 0.0)))


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)
