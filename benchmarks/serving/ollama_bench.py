"""Ollama's /api/chat against ZeroMQ on the same chat requests: the overhead of the Ollama routes (issue 36).

One daemon serves both doors. At each concurrency the same chat requests go through ZeroMQ
(`FLyClient.chat`) and through /api/chat (the official `ollama` client, `stream: false`), taking turns
`--repeats` times, so slow drifts of a shared machine fall on both sides; the medians are reported.

    python benchmarks/serving/ollama_bench.py --threads 1                   # the tiny random pair
    python benchmarks/serving/ollama_bench.py --embedded --dtype auto --threads 2 --repeats 3 --requests 8 \\
        --max-tokens 48 --concurrency 1 8
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.serving.serve_bench import PROMPTS, add_model_arguments, resolve_models, start_daemon
from fly_llm.client import FLyClient, build_options

ADDRESS = "127.0.0.1:18474"
"""Where the daemon serves HTTP (and so the Ollama routes) during the benchmark."""
Chat = list[dict[str, str]]


def tokens_per_s(generate: Callable[[Chat], int], chats: list[Chat], concurrency: int) -> float:
    """Aggregate completion tokens per second of `chats` sent by `concurrency` threads."""
    with ThreadPoolExecutor(concurrency) as pool:
        start = time.perf_counter()
        tokens = sum(pool.map(generate, chats))
        return tokens / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=16, help="chat requests per turn")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--repeats", type=int, default=3, help="pairs of ZeroMQ and Ollama turns per concurrency")
    p.add_argument("--exact", action="store_true", help="exact speculative decoding instead of FLy")
    args = p.parse_args(argv)
    chats = [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(args.requests)]

    import ollama

    with tempfile.TemporaryDirectory(prefix="fly-ollama-bench-") as tmp:
        workdir = Path(tmp)
        target, draft = resolve_models(args, workdir)
        print(f"models: target={target or 'embedded'} draft={draft or 'embedded'} ({args.dtype}, {args.device}, "
              f"threads {args.threads or 'default'}); {args.requests} chat requests × {args.max_tokens} tokens, "
              f"{'exact SPD' if args.exact else 'FLy'}, {args.repeats} alternating pairs", flush=True)
        proc, endpoint = start_daemon(target, draft, args, workdir, ("--http", ADDRESS))
        try:
            sampling, fly = build_options(max_tokens=args.max_tokens)
            with FLyClient(endpoint, timeout=3600) as zmq:
                http = ollama.Client(host=f"http://{ADDRESS}", timeout=3600)
                model = http.list().models[0].model
                doors = {
                    "ZeroMQ": lambda chat: zmq.chat(chat, sampling, fly).usage.completion_tokens,
                    "Ollama": lambda chat: http.chat(model=model, messages=chat, stream=False,
                                                     options={"num_predict": args.max_tokens}).eval_count,
                }
                for generate in doors.values():  # warm-up
                    tokens_per_s(generate, chats[:2], 1)
                print(f"{'concurrency':>11} {'ZeroMQ tok/s':>13} {'Ollama tok/s':>13} {'Ollama vs ZeroMQ':>17}  pairs",
                      flush=True)
                medians = []
                for c in args.concurrency:
                    turns = {name: [] for name in doors}
                    for _ in range(args.repeats):
                        for name, generate in doors.items():
                            turns[name].append(tokens_per_s(generate, chats, c))
                    overheads = [100 * (z / o - 1) for z, o in zip(turns["ZeroMQ"], turns["Ollama"])]
                    medians.append(statistics.median(overheads))
                    print(f"{c:>11} {statistics.median(turns['ZeroMQ']):13.1f} {statistics.median(turns['Ollama']):13.1f}"
                          f" {medians[-1]:+16.1f}%  {', '.join(f'{o:+.1f}%' for o in overheads)}", flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    print(f"Ollama routes vs ZeroMQ overhead (median of pairs): "
          f"{', '.join(f'{m:+.1f}%' for m in medians)} at concurrency {args.concurrency}")


if __name__ == "__main__":
    main()
