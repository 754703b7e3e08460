"""Soak: seeded random traffic against one daemon for a while; errors, latency and memory.

    python benchmarks/serving/soak.py --embedded --dtype bfloat16 --duration 600     # the embedded pair, 10 min
    python benchmarks/serving/soak.py --duration 30                                  # tiny random pair

Eight client threads; every 20 s the number of them sending changes (1–8), with idle spells that
drain the batch. Each request is drawn from: plain generate, stream, stream cancelled after two
chunks, chat; prompts of one token, a line of code or prose, or a ~1,000-token document with a
question. Reports requests served, errors by code (cancels are deliberate and counted apart),
p50/p99 latency and time to first token, and the daemon's RSS after warm-up and at the end.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import psutil

from benchmarks.harness.prompts import PROMPTS
from benchmarks.serving.serve_bench import add_model_arguments, resolve_models, start_daemon
from fly_llm.client import FLyClient, build_options
from fly_llm.common.errors import FLyError
from fly_llm.common.protocol import GenerateResult

THREADS = 8
PHASE_S = 20.0
QUESTION = "\nQuestion: which of the snippets above prints squares? Answer:"


def document(client: FLyClient, max_tokens: int, target_tokens: int = 1000) -> str:
    """The snippets repeated into a document of about `target_tokens` (less if the context is smaller)."""
    limit = min(target_tokens, client.info().max_prompt_tokens - max_tokens)
    text = "\n".join(PROMPTS)
    repeats = max(1, target_tokens // client.tokenize(text).count)
    while repeats > 1 and client.tokenize((text + "\n") * repeats + QUESTION).count > limit:
        repeats -= 1
    return (text + "\n") * repeats + QUESTION


class Soak:
    """The traffic and what it measured."""

    def __init__(self, endpoint: str, seed: int, max_tokens: int, duration: float, long_prompt: str) -> None:
        self.endpoint, self.max_tokens, self.long_prompt = endpoint, max_tokens, long_prompt
        self.rng = random.Random(seed)
        self.deadline = time.monotonic() + duration
        self.active_threads = THREADS
        self.lock = threading.Lock()
        self.latency: list[float] = []
        self.ttft: list[float] = []
        self.outcomes: dict[str, int] = {}
        self.tokens = 0

    def run(self) -> None:
        """Run the client threads until the duration is over, changing how many send every phase."""
        threads = [threading.Thread(target=self._client, args=(i, random.Random(self.rng.random())))
                   for i in range(THREADS)]
        for thread in threads:
            thread.start()
        while time.monotonic() < self.deadline:
            self.active_threads = self.rng.choice([0, 1, 2, 4, 8, self.rng.randint(1, THREADS)])
            time.sleep(min(PHASE_S, max(0.0, self.deadline - time.monotonic())))
        for thread in threads:
            thread.join()

    def _client(self, index: int, rng: random.Random) -> None:
        with FLyClient(self.endpoint, timeout=600, max_retries=0) as client:
            while time.monotonic() < self.deadline:
                if index >= self.active_threads:
                    time.sleep(0.2)
                    continue
                kind = rng.choices(["generate", "stream", "cancel", "chat"], [5, 3, 1, 1])[0]
                prompt = rng.choices(["x", rng.choice(PROMPTS), self.long_prompt], [2, 6, 2])[0]
                sampling, fly = build_options(max_tokens=rng.randint(8, self.max_tokens))
                start = time.monotonic()
                try:
                    measured = self._request(client, kind, prompt, sampling, fly)
                except FLyError as exc:
                    self._count(exc.code)
                    continue
                self._record(kind, time.monotonic() - start, measured)

    def _request(self, client: FLyClient, kind: str, prompt: str, sampling, fly) -> tuple[float | None, int]:
        """Send one request; return (time to first token or None, completion tokens)."""
        if kind == "generate":
            result = client.generate(prompt, sampling, fly)
            return result.time_to_first_token_s, result.usage.completion_tokens
        if kind == "chat":
            result = client.chat([{"role": "user", "content": prompt}], sampling, fly)
            return result.time_to_first_token_s, result.usage.completion_tokens
        start, first, tokens = time.monotonic(), None, 0
        stream = client.stream(prompt, sampling=sampling, fly=fly)
        for i, event in enumerate(stream):
            first = first if first is not None else time.monotonic() - start
            tokens = event.usage.completion_tokens if isinstance(event, GenerateResult) else tokens
            if kind == "cancel" and i == 1:
                stream.close()
                break
        return first, tokens

    def _count(self, outcome: str) -> None:
        with self.lock:
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def _record(self, kind: str, latency: float, measured: tuple[float | None, int]) -> None:
        ttft, tokens = measured
        with self.lock:
            self.outcomes[kind] = self.outcomes.get(kind, 0) + 1
            if kind != "cancel":
                self.latency.append(latency)
                self.tokens += tokens
            if ttft is not None:
                self.ttft.append(ttft)


def _quantiles(values: list[float]) -> dict[str, float | None]:
    if len(values) < 2:
        return {"p50": values[0] if values else None, "p99": values[0] if values else None}
    cuts = statistics.quantiles(values, n=100)
    return {"p50": round(cuts[49], 3), "p99": round(cuts[98], 3)}


def main(argv: list[str] | None = None) -> None:
    """Run the soak and print (and optionally write) its report."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the report as JSON here")
    args = p.parse_args(argv)
    args.concurrency, args.exact = [THREADS], False  # what start_daemon reads: batch size, FLy mode

    with tempfile.TemporaryDirectory(prefix="fly-soak-") as tmp:
        workdir = Path(tmp)
        target, draft = resolve_models(args, workdir)
        proc, endpoint = start_daemon(target, draft, args, workdir)
        try:
            with FLyClient(endpoint, timeout=600) as client:
                long_prompt = document(client, args.max_tokens)
                client.generate(long_prompt, *build_options(max_tokens=4))  # warm-up
                rss_start = psutil.Process(proc.pid).memory_info().rss
                soak = Soak(endpoint, args.seed, args.max_tokens, args.duration, long_prompt)
                started = time.monotonic()
                soak.run()
                elapsed = time.monotonic() - started
                rss_end = psutil.Process(proc.pid).memory_info().rss
                health, status = client.health(), client.status()
                long_tokens = client.tokenize(long_prompt).count
        finally:
            proc.terminate()
            proc.wait(120)
    errors = {k: v for k, v in soak.outcomes.items() if k not in ("generate", "stream", "cancel", "chat")}
    report = {
        "models": args.target or ("embedded" if args.embedded else "tiny random pair"), "dtype": args.dtype, "long_prompt_tokens": long_tokens, "duration_s": round(elapsed, 1), "seed": args.seed,
        "served": sum(soak.outcomes.get(k, 0) for k in ("generate", "stream", "chat")),
        "cancelled_on_purpose": soak.outcomes.get("cancel", 0), "errors": errors, "outcomes": soak.outcomes,
        "completion_tokens": soak.tokens, "latency_s": _quantiles(soak.latency), "ttft_s": _quantiles(soak.ttft),
        "rss_mb": {"start": round(rss_start / 2**20), "end": round(rss_end / 2**20)},
        "daemon": {"state": health.state, "requests_total": status.requests_total,
                   "max_batch_size_seen": status.max_batch_size_seen, "exit_code": proc.returncode},
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    if errors or health.state != "ready":
        raise SystemExit(f"soak saw errors: {errors}, daemon {health.state}")


if __name__ == "__main__":
    main()
