"""fly-serve on a local Ray instance: two replicas of the tiny pair behind the OpenAI routes.

Requests reach both replicas (the `x-fly-replica` header), streaming works through Ray's proxy,
and killing one replica's process leaves the application answering while Ray replaces it.
"""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

from fly_llm.common.config import FLyConfig, ModelSpec  # noqa: E402
from support.daemon_process import free_port  # noqa: E402

from fly_daemon.replicas import DEPLOYMENT, REPLICA_HEADER, application, build, serve_http_host  # noqa: E402
from fly_daemon.settings import DaemonSettings, SettingsError  # noqa: E402

pytestmark = pytest.mark.timeout(600)
CHAT = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 8}


def _wait_ready(url: str, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("no fly-serve replica became ready")


def _replicas_answering(url: str, requests: int = 16) -> dict[str, int]:
    """Send `requests` chat requests 8 at a time; count the answers per replica (all must succeed)."""
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda _: httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=120),
                                range(requests)))
    assert [r.status_code for r in replies] == [200] * requests, [r.text for r in replies if r.status_code != 200]
    counts: dict[str, int] = {}
    for reply in replies:
        assert reply.json()["choices"][0]["message"]["content"] is not None
        counts[reply.headers[REPLICA_HEADER]] = counts.get(reply.headers[REPLICA_HEADER], 0) + 1
    return counts


@pytest.fixture(scope="module")
def served(tiny_pair_dirs):
    """The application with 2 replicas of the tiny pair on a local Ray instance; its base URL."""
    target, draft = tiny_pair_dirs
    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="fly-serve-test")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = application(ModelSpec(target=str(target), draft=str(draft), dtype="float32", target_quantization="none"),
                          FLyConfig(), DaemonSettings(max_batch_size=8), replicas=2)
        serve.run(app, name="fly", route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url)
        CHAT["model"] = Path(target).name  # the served model's id: its directory's name, never a path
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


def test_requests_reach_both_replicas(served):
    counts = _replicas_answering(served, 24)
    assert len(counts) == 2, counts
    models = httpx.get(f"{served}/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == [CHAT["model"], "all-MiniLM-L6-v2"]  # the target, the embedding model


def test_streaming_goes_through_ray(served):
    whole = httpx.post(f"{served}/v1/chat/completions", json=CHAT, timeout=120).json()
    text, chunks = "", 0
    with httpx.stream("POST", f"{served}/v1/chat/completions", json={**CHAT, "stream": True}, timeout=120) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        assert reply.headers[REPLICA_HEADER]
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = __import__("json").loads(line[6:])["choices"][0]["delta"]
                text += delta.get("content") or ""
                chunks += 1
    assert chunks >= 2 and text == whole["choices"][0]["message"]["content"]  # greedy: the same answer


def test_bad_input_is_answered_by_the_replica(served):
    reply = httpx.post(f"{served}/v1/chat/completions", json={**CHAT, "max_tokens": -1}, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "BAD_REQUEST"
    assert reply.headers[REPLICA_HEADER]


def _running_replicas() -> int:
    status = serve.status().applications["fly"].deployments[DEPLOYMENT]
    return status.replica_states.get("RUNNING", 0)


def test_replicas_answer_only_loopback_host_names_on_a_loopback_proxy(served):
    """DNS rebinding through Ray's proxy: the replicas check Host as the daemon's front does (issue 33)."""
    assert serve_http_host() == "127.0.0.1"
    refused = httpx.get(f"{served}/v1/models", headers={"Host": "evil.example"}, timeout=30)
    assert (refused.status_code, refused.json()["error"]["code"]) == (421, "BAD_REQUEST")
    assert refused.headers[REPLICA_HEADER]
    assert httpx.get(f"{served}/v1/models", headers={"Host": "localhost"}, timeout=30).status_code == 200


def test_a_killed_replica_is_replaced_and_the_app_keeps_answering(served):
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if DEPLOYMENT in a["name"]]
    assert len(names) == 2, names
    victim = ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])
    ray.kill(victim, no_restart=True)
    answered, deadline = 0, time.monotonic() + 240
    while time.monotonic() < deadline:  # the other replica answers while Ray replaces the killed one
        answered += httpx.post(f"{served}/v1/chat/completions", json=CHAT, timeout=120).status_code == 200
        alive = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if DEPLOYMENT in a["name"]]
        if answered >= 3 and names[0]["name"] not in alive and _running_replicas() == 2:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"Ray did not replace the killed replica in time ({answered} answered)")
    seen: set[str] = set()
    deadline = time.monotonic() + 120
    while len(seen) < 2 and time.monotonic() < deadline:  # the proxy learns of the replacement, then routes to it
        seen |= set(_replicas_answering(served, 8))
    assert len(seen) == 2, seen


def test_the_builder_reads_serve_run_arguments():
    app = build({"target": "some/dir", "draft": "none", "window": "4", "max_batch_size": "3", "replicas": "2"})
    deployment = app._bound_deployment
    defaults = DaemonSettings()
    assert deployment.num_replicas == 2
    assert deployment.max_ongoing_requests == 3 + defaults.newcomer_rows + defaults.queue_size
    spec, fly, settings = deployment.init_args
    assert spec.target == "some/dir" and fly.window == 4 and settings.max_batch_size == 3
    scaled = build({"min_replicas": "1", "max_replicas": "3"})._bound_deployment
    assert scaled._deployment_config.autoscaling_config.max_replicas == 3
    with pytest.raises(SettingsError, match="unknown fly-serve settings: windw"):
        build({"windw": "4"})
    with pytest.raises(SettingsError, match="min_replicas"):
        build({"min_replicas": "3", "max_replicas": "1"})
