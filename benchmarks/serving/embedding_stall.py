"""A running stream's slowdown while a 1,000-chunk index is embedded, and the embedding throughput (issue 47).

    python benchmarks/serving/embedding_stall.py                  # the tiny random pair (tests/support), embedded MiniLM
    python benchmarks/serving/embedding_stall.py --embedded       # the embedded pair (real models)

Starts `fly-daemon start --foreground --http` in a subprocess (its default embedding model unless
`--daemon-args` names another) and runs three phases through its HTTP front:

- stream: greedy streams back to back (POST /v1/completions, `--max-tokens` each) for `--seconds`;
- embed: `--chunks` texts of ~256 MiniLM word pieces (seeded random words) posted to /api/embed
  (truncate: the model's 256) `--per-request` at a time by `--clients` concurrent posters, as a RAG indexer;
- both: the same chunks are posted again and, while they are being embedded, the streams run for
  `--both-seconds` (the chunks embedded by then are counted; the rest is dropped with the daemon).

Per phase: the streams' decode rate (completion tokens over first-to-last chunk, median over the streams
that ran wholly inside the phase), their chunk gaps (median, p99, max) and the embedding rate (texts/s,
tokens per text). The slowdown is the stream rate during `both` against `stream`. Each phase prints as it
ends; the JSON goes to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from benchmarks.harness.environment import cpu_name, git_commit

WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her she there would their we him been has when who will more no if out so said what up its "
         "about into than them can only other new some could time these two may then do first any my now such like "
         "our over man me even most made after also did many before must through back years where much your way "
         "well down should because each just those people how too little state good very make world still own see "
         "men work long get here between both life being under never day same another know while last might us "
         "great old year off come since against go came right used take three startup lisp language program "
         "essay founders investors software hackers programmers users company money growth idea").split()
PROMPT = "def add(a, b):"


def chunks(count: int, words: int, seed: int = 0) -> list[str]:
    """`count` texts of `words` seeded random words (~1.1 MiniLM word pieces each)."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=words)) for _ in range(count)]


class Streams:
    """Greedy streams back to back in a thread: per stream (start, end, tokens) and every chunk's arrival."""

    def __init__(self, url: str, model: str, max_tokens: int) -> None:
        self.url, self.model, self.max_tokens = url, model, max_tokens
        self.runs: list[tuple[float, float, int]] = []
        self.arrivals: list[list[float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Streams":
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        body = {"model": self.model, "prompt": PROMPT, "max_tokens": self.max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx.Client(timeout=600) as client:
            while not self._stop.is_set():
                times, tokens = [], 0
                with client.stream("POST", f"{self.url}/v1/completions", json=body) as answer:
                    for line in answer.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if event.get("usage"):
                            tokens = event["usage"]["completion_tokens"]
                        if event.get("choices") and event["choices"][0].get("text"):
                            times.append(time.perf_counter())
                if len(times) > 1:
                    self.runs.append((times[0], times[-1], tokens))
                    self.arrivals.append(times)

    def summary(self, start: float, end: float) -> dict:
        """Decode rate and chunk gaps of the streams that ran wholly within [start, end]."""
        inside = [i for i, (a, b, _) in enumerate(self.runs) if a >= start and b <= end]
        rates = [self.runs[i][2] / (self.runs[i][1] - self.runs[i][0]) for i in inside]
        gaps = sorted(b - a for i in inside for a, b in zip(self.arrivals[i], self.arrivals[i][1:]))
        if not gaps:
            return {"streams": 0}
        return {"streams": len(inside), "tokens_per_s": round(statistics.median(rates), 2),
                "gap_ms_p50": round(1e3 * gaps[len(gaps) // 2], 1),
                "gap_ms_p99": round(1e3 * gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))], 1),
                "gap_ms_max": round(1e3 * gaps[-1], 1)}


class Embedding:
    """Posts texts to /api/embed in requests of `per_request` from `clients` threads, counting what is done."""

    def __init__(self, url: str, model: str, texts: list[str], per_request: int, clients: int) -> None:
        self.url, self.model, self.clients = url, model, clients
        self.batches = [texts[i:i + per_request] for i in range(0, len(texts), per_request)]
        self.texts = self.tokens = 0
        self.start = self.end = 0.0
        self._lock = threading.Lock()

    def _post(self, batch: list[str]) -> None:
        answer = httpx.post(f"{self.url}/api/embed", json={"model": self.model, "input": batch}, timeout=1800)
        answer.raise_for_status()
        assert len(answer.json()["embeddings"]) == len(batch)
        with self._lock:
            self.texts += len(batch)
            self.tokens += answer.json()["prompt_eval_count"]

    def run(self) -> "Embedding":
        """Embed every batch (returns when all are done)."""
        self.start = time.perf_counter()
        with ThreadPoolExecutor(self.clients) as pool:
            list(pool.map(self._post, self.batches))
        self.end = time.perf_counter()
        return self

    def summary(self, until: float | None = None) -> dict:
        """Texts embedded, seconds, texts/s and tokens per text, up to `until` (default: the end)."""
        with self._lock:
            elapsed = (until or self.end) - self.start
            return {"texts": self.texts, "seconds": round(elapsed, 1), "texts_per_s": round(self.texts / elapsed, 1),
                    "tokens_per_text": round(self.tokens / max(self.texts, 1), 1)}


def start_daemon(args: argparse.Namespace, workdir: Path) -> tuple[subprocess.Popen, str]:
    """`fly-daemon start --foreground --http` on a free port; waits for /health 200."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    models: list[str] = []
    if not args.embedded:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
        from support.tiny_models import save_tiny_pair

        target, draft = save_tiny_pair(workdir / "pair", "llama")
        models = ["--target", str(target), "--draft", str(draft), "--dtype", "float32",
                  "--target-quantization", "none", "--draft-quantization", "none"]
    cmd = [sys.executable, "-m", "fly_daemon.cli", "start", "--foreground", "--endpoint",
           f"ipc://{workdir / 'd.sock'}", "--http", f"127.0.0.1:{port}", *models, *shlex.split(args.daemon_args)]
    log = open(workdir / "daemon.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, FLY_RUNTIME_DIR=str(workdir)))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError((workdir / "daemon.log").read_text()[-3000:])
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the daemon did not get ready")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--embedded", action="store_true", help="the embedded pair (default: the tiny random pair)")
    parser.add_argument("--daemon-args", default="", help="more `fly-daemon start` flags, e.g. '--embedding-threads 2'")
    parser.add_argument("--embedding-model", default="all-MiniLM-L6-v2", help="the name requests give")
    parser.add_argument("--chunks", type=int, default=1000)
    parser.add_argument("--words", type=int, default=230, help="words per chunk (~256 MiniLM word pieces)")
    parser.add_argument("--per-request", type=int, default=100)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per stream")
    parser.add_argument("--seconds", type=float, default=30.0, help="length of the streams-only phase")
    parser.add_argument("--both-seconds", type=float, default=60.0, help="streams measured while embedding")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/embeddings/stall.json"))
    args = parser.parse_args(argv)
    texts = chunks(args.chunks, args.words)
    with tempfile.TemporaryDirectory(prefix="embedding-stall-") as tmp:
        proc, url = start_daemon(args, Path(tmp))
        try:
            model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
            Embedding(url, args.embedding_model, texts[:4], 4, 1).run()  # loads the embedding model (lazy)
            command = ["python", "benchmarks/serving/embedding_stall.py", *(argv if argv is not None else sys.argv[1:])]
            result: dict = {"command": shlex.join(command), "target": model, "cpus": os.cpu_count(),
                            "cpu": cpu_name(), "commit": git_commit(), "daemon_args": args.daemon_args}
            with Streams(url, model, args.max_tokens) as streams:
                start = time.perf_counter()
                time.sleep(args.seconds)
                result["stream"] = streams.summary(start, time.perf_counter())
            print("stream", result["stream"], flush=True)
            alone = Embedding(url, args.embedding_model, texts, args.per_request, args.clients)
            result["embed"] = alone.run().summary()
            print("embed", result["embed"], flush=True)
            both = Embedding(url, args.embedding_model, texts, args.per_request, args.clients)
            threading.Thread(target=both.run, daemon=True).start()
            time.sleep(1.0)  # the first requests are queued
            with Streams(url, model, args.max_tokens) as streams:
                start = time.perf_counter()
                time.sleep(args.both_seconds)
                result["both_stream"] = streams.summary(start, time.perf_counter())
            result["both_embed"] = both.summary(time.perf_counter())
            print("both", result["both_stream"], result["both_embed"], flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    alone, during = result["stream"].get("tokens_per_s"), result["both_stream"].get("tokens_per_s")
    result["stream_slowdown"] = round(1 - during / alone, 3) if alone and during else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
