"""Serving speed: aggregate tokens/s through the daemon at concurrency 1, 2, 4, 8, 16 vs one request
after another, and daemon + ZeroMQ vs the in-process engine on the same requests (overhead %).
With --http the same requests also go through the daemon's OpenAI-compatible HTTP front (the official
`openai` client), taking turns with ZeroMQ at each concurrency: HTTP vs ZeroMQ overhead %.

    python benchmarks/serving/serve_bench.py                          # tiny random pair (tests/support/tiny_models.py)
    python benchmarks/serving/serve_bench.py --target DIR --draft DIR --dtype bfloat16 --max-tokens 64
    python benchmarks/serving/serve_bench.py --embedded --dtype bfloat16 --requests 8 --concurrency 1 2 4 8
    python benchmarks/serving/serve_bench.py --http --threads 1       # + the HTTP front
    python benchmarks/serving/serve_bench.py --embedded --dtype auto --threads 2 --http --repeats 3 --concurrency 1 8

One run: the in-process engine first (sequential, then all requests in one batch), then it is
freed and a daemon subprocess serves the same models (one pair in memory at a time). All ratios
come from this run. Greedy decoding with the daemon's default FLy settings (or --exact).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.harness.prompts import PROMPTS as SHORT_PROMPTS
from fly_llm.client import FLyClient, build_options
from fly_llm.common.config import FLyConfig, ModelSpec, SamplingParams
from fly_llm.common.errors import FLyUnavailable

HTTP_ADDRESS = "127.0.0.1:18473"
"""Where --http serves the OpenAI API during the benchmark."""

PROMPTS = SHORT_PROMPTS + [
    "Speculative decoding drafts tokens with a small model and",
    "def add(a, b):\n    return a + b\ndef sub(a, b):\n",
]


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The options that say which models a benchmark's daemon serves, and how."""
    p.add_argument("--target", help="target model dir / HF id (default: the tiny random pair)")
    p.add_argument("--draft", help="draft model dir / HF id, or 'none'")
    p.add_argument("--embedded", action="store_true", help="the embedded default pair (real models)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, help="torch CPU threads, the same in-process and in the daemon")


def resolve_models(args: argparse.Namespace, workdir: Path) -> tuple[str | None, str | None]:
    """(target, draft) to load; (None, None) is the embedded default pair."""
    if args.embedded:
        return None, None
    if args.target:
        return args.target, args.draft or "none"
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from support.tiny_models import save_tiny_pair

    target, draft = save_tiny_pair(workdir / "tiny", "llama")
    return str(target), str(draft)


def _in_process(target: str | None, draft: str | None, args: argparse.Namespace, prompts: list[str]) -> tuple[float, float]:
    """(sequential tokens/s, one-batch tokens/s) of the engine in this process."""
    import torch

    from fly_llm.loading import load_engine

    if args.threads:
        torch.set_num_threads(args.threads)
    engine = load_engine(ModelSpec(target=target, draft=draft, dtype=args.dtype, device=args.device),
                         FLyConfig(loose=not args.exact))
    sampling = SamplingParams(max_tokens=args.max_tokens)
    engine.generate(prompts[0], SamplingParams(max_tokens=4))  # warm-up
    start = time.perf_counter()
    tokens = sum(engine.generate(p, sampling)[0].completion_tokens for p in prompts)
    sequential = tokens / (time.perf_counter() - start)
    start = time.perf_counter()
    tokens = sum(g.completion_tokens for g in engine.generate(prompts, sampling))
    batched = tokens / (time.perf_counter() - start)
    del engine
    gc.collect()
    return sequential, batched


def start_daemon(target: str | None, draft: str | None, args: argparse.Namespace, workdir: Path,
                 extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """Start a daemon subprocess on `args`' models and options (+ `extra` flags); return it and its endpoint
    once ready."""
    endpoint = f"ipc://{workdir / 'bench.sock'}"
    log = open(workdir / "daemon.log", "ab")
    models = [] if target is None else ["--target", target, "--draft", draft]
    cmd = [sys.executable, "-m", "fly_daemon.cli", "start", "--foreground", "--endpoint", endpoint,
           *models, "--dtype", args.dtype, "--device", args.device,
           "--max-batch-size", str(max(args.concurrency)), *(["--no-loose"] if args.exact else []), *extra]
    env = dict(os.environ, FLY_RUNTIME_DIR=str(workdir))
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    with FLyClient(endpoint, timeout=2, max_retries=0) as client:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if client.health().state == "ready":
                    return proc, endpoint
            except FLyUnavailable:
                pass
            time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"daemon did not get ready; see {workdir / 'daemon.log'}")


def _through_daemon(endpoint: str, prompts: list[str], concurrency: int, max_tokens: int,
                    http: bool = False) -> tuple[float, int]:
    """(aggregate tokens/s, largest batch seen) with `concurrency` client threads sharing the prompts.

    With `http` the requests go through the HTTP front with the official `openai` client instead of ZeroMQ.
    """
    sampling, fly = build_options(max_tokens=max_tokens)
    todo = list(range(len(prompts)))
    lock = threading.Lock()
    tokens = [0]
    with FLyClient(endpoint, timeout=3600) as client:
        generate = _http_generate(max_tokens) if http else \
            (lambda prompt: client.generate(prompt, sampling, fly).usage.completion_tokens)

        def worker() -> None:
            while True:
                with lock:
                    if not todo:
                        return
                    i = todo.pop(0)
                n = generate(prompts[i])
                with lock:
                    tokens[0] += n

        threads = [threading.Thread(target=worker) for _ in range(concurrency)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
        return tokens[0] / elapsed, client.status().max_batch_size_seen


def _http_vs_zeromq(endpoint: str, prompts: list[str], concurrency: int, max_tokens: int, zeromq_tps: float,
                    repeats: int) -> tuple[float, float]:
    """(median HTTP tok/s, median HTTP overhead %) over `repeats` pairs of turns: HTTP, then ZeroMQ
    again (the first pair reuses the ZeroMQ turn already measured), so slow drifts of a shared
    machine fall on both sides of each pair."""
    http, overheads = [], []
    for turn in range(repeats):
        if turn:
            zeromq_tps = _through_daemon(endpoint, prompts, concurrency, max_tokens)[0]
        http.append(_through_daemon(endpoint, prompts, concurrency, max_tokens, http=True)[0])
        overheads.append(100 * (zeromq_tps / http[-1] - 1))
    return statistics.median(http), statistics.median(overheads)


def _http_generate(max_tokens: int):
    """A function prompt -> completion tokens, through the HTTP front (a /v1/completions request)."""
    import openai

    client = openai.OpenAI(base_url=f"http://{HTTP_ADDRESS}/v1", api_key="unused", max_retries=0, timeout=3600)
    model = client.models.list().data[0].id
    return lambda prompt: client.completions.create(model=model, prompt=prompt,
                                                    max_tokens=max_tokens).usage.completion_tokens


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=16, help="requests per measurement")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--exact", action="store_true", help="exact speculative decoding instead of FLy")
    p.add_argument("--http", action="store_true", help=f"also through the HTTP front (on {HTTP_ADDRESS})")
    p.add_argument("--repeats", type=int, default=1,
                   help="with --http: pairs of HTTP and ZeroMQ turns per concurrency (the median is reported)")
    args = p.parse_args(argv)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]

    with tempfile.TemporaryDirectory(prefix="fly-serve-bench-") as tmp:
        workdir = Path(tmp)
        target, draft = resolve_models(args, workdir)
        print(f"models: target={target or 'embedded'} draft={draft or 'embedded'} ({args.dtype}, {args.device}, "
              f"threads {args.threads or 'default'}); {args.requests} requests × {args.max_tokens} tokens, "
              f"{'exact SPD' if args.exact else 'FLy'}", flush=True)
        local_seq, local_batch = _in_process(target, draft, args, prompts)
        print(f"in-process engine: {local_seq:8.1f} tok/s one after another, {local_batch:8.1f} tok/s in one batch",
              flush=True)
        proc, endpoint = start_daemon(target, draft, args, workdir, ("--http", HTTP_ADDRESS) if args.http else ())
        try:
            _through_daemon(endpoint, prompts[:2], 1, 4)  # warm-up
            if args.http:
                _through_daemon(endpoint, prompts[:2], 1, 4, http=True)
            print(f"{'concurrency':>11} {'tok/s':>9} {'vs sequential':>14} {'largest batch':>14}"
                  + (f" {'HTTP tok/s':>11} {'HTTP vs ZeroMQ':>15}" if args.http else ""), flush=True)
            rows, http_overheads = [], []
            for c in args.concurrency:
                tps, batch = _through_daemon(endpoint, prompts, c, args.max_tokens)
                rows.append((c, tps))
                ratio = f"{tps / rows[0][1]:13.2f}×" if rows[0][0] == 1 else "-"
                line = f"{c:>11} {tps:9.1f} {ratio:>14} {batch:>14}"
                if args.http:
                    http_tps, overhead = _http_vs_zeromq(endpoint, prompts, c, args.max_tokens, tps, args.repeats)
                    http_overheads.append(overhead)
                    line += f" {http_tps:11.1f} {overhead:+14.1f}%"
                print(line, flush=True)
        finally:
            proc.terminate()
            proc.wait(60)

    if rows[0][0] == 1:
        print(f"daemon + ZeroMQ overhead, sequential: {100 * (local_seq / rows[0][1] - 1):+.1f}% "
              f"(in-process {local_seq:.1f} vs daemon {rows[0][1]:.1f} tok/s)")
    if rows[-1][0] >= args.requests:
        print(f"daemon + ZeroMQ overhead, all {args.requests} at once: {100 * (local_batch / rows[-1][1] - 1):+.1f}% "
              f"(in-process batch {local_batch:.1f} vs daemon {rows[-1][1]:.1f} tok/s)")
    if http_overheads:
        print(f"HTTP front vs ZeroMQ overhead: {sum(http_overheads) / len(http_overheads):+.1f}% on average "
              f"({', '.join(f'{o:+.1f}%' for o in http_overheads)} at concurrency {args.concurrency})")


if __name__ == "__main__":
    main()
