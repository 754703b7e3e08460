"""fly-serve throughput with 1 vs 2 (or more) Ray Serve replicas on the same requests, over HTTP.

    python benchmarks/serving/replica_bench.py                      # tiny random pair, 1 and 2 replicas
    python benchmarks/serving/replica_bench.py --embedded --dtype auto --requests 16 --max-tokens 32

For each replica count: a local Ray instance, the fly-serve application, a warm-up request per
replica, then `--requests` completions sent `--concurrency` at a time; aggregate generated tokens
per second and how many requests each replica (`x-fly-replica`) answered. Ray gives each replica
one CPU (and so one torch thread), so on an N-core machine up to N replicas run side by side.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.serving.serve_bench import PROMPTS, add_model_arguments, resolve_models
from fly_llm.common.config import FLyConfig, ModelSpec


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(spec: ModelSpec, replicas: int, requests: int, concurrency: int, max_tokens: int) -> dict:
    """Tokens/s and requests per replica of one fly-serve application with `replicas` replicas."""
    import ray
    from ray import serve

    from fly_daemon.replicas import REPLICA_HEADER, application
    from fly_daemon.settings import DaemonSettings

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    ray.init(num_cpus=max(2, replicas), include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(application(spec, FLyConfig(), DaemonSettings(), replicas=replicas), name="fly", route_prefix="/")
        model = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]

        def complete(i: int) -> tuple[int, str]:
            reply = httpx.post(f"{url}/v1/completions", timeout=600, json={
                "model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0})
            reply.raise_for_status()
            return reply.json()["usage"]["completion_tokens"], reply.headers[REPLICA_HEADER]

        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(complete, range(2 * replicas)))  # warm-up: every replica has answered once
            start = time.perf_counter()
            answers = list(pool.map(complete, range(requests)))
            seconds = time.perf_counter() - start
    finally:
        serve.shutdown()
        ray.shutdown()
    per_replica: dict[str, int] = {}
    for _, replica in answers:
        per_replica[replica] = per_replica.get(replica, 0) + 1
    tokens = sum(t for t, _ in answers)
    return {"replicas": replicas, "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": tokens / seconds, "per_replica": sorted(per_replica.values(), reverse=True)}


def main(argv: list[str] | None = None) -> None:
    """Run the measurement for each replica count; print (and with --out write) a Markdown table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, help="directory for results.md")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="replica-bench-") as tmp:
        target, draft = resolve_models(args, Path(tmp))
        spec = ModelSpec(target=target, draft=draft, dtype=args.dtype, device=args.device,
                         **({} if args.embedded else {"target_quantization": "none"}))
        rows = [measure(spec, n, args.requests, args.concurrency, args.max_tokens) for n in args.replicas]
    base = rows[0]["tokens_per_s"]
    lines = ["| replicas | tokens | seconds | tok/s | vs first | requests per replica |", "|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {r['replicas']} | {r['tokens']} | {r['seconds']} | {r['tokens_per_s']:.1f} | "
              f"{r['tokens_per_s'] / base:.2f}× | {r['per_replica']} |" for r in rows]
    command = " ".join(["python benchmarks/serving/replica_bench.py", *(sys.argv[1:] if argv is None else argv)])
    text = "\n".join([f"`{command}`", "", *lines, ""])
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
