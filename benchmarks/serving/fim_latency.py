"""Autocomplete latency as Continue sends it: fly-daemon (FLy and target-only) against llama.cpp's own
`llama-server` on the same GGUF, every server through llama.cpp's `/infill`.

The requests (the same text for every server, written once to --out/requests.jsonl and reused): one real
Python source file, fly-llm's own `fly_llm/decoding/engine.py` read from git at a pinned commit
(`--source-commit`, its sha256 in the report), cut at `--positions` cursor positions spread over the file.
At each position the user is writing a line: the cursor sits a few characters into it; the prefix is the
code above (whole lines, the nearest ~`--prefix-tokens` tokens) plus the line so far, the suffix the lines
below (~`--suffix-tokens`), the rest of the line not yet written. Then `--keystrokes` - 1 more requests
as the user types `--chars-per-keystroke` more characters of that line each time, as Continue sends them.
Each request: `n_predict` 64, greedy (`temperature` 0), not streamed; the client times the whole request
(time to last token) and reads `tokens_predicted` from the answer.

Servers, started one at a time (never two loaded at once), each warmed with one short request:

- `fly`: `fly-daemon start --http` on the embedded pair (or --target/--draft), default FLy;
- `target`: the same with `--stages ''`: the target alone, no drafting;
- `llamacpp`: `llama-server -m TARGET.gguf --port P -t THREADS`, its defaults otherwise
  (build it with benchmarks/serving/build_llama_server.sh);
- `llamacpp-python`: where llama-server is not built, a reference from the same llama.cpp (llama-cpp-python's
  `Llama` in this process, 2 threads, the PSM prompt with Qwen2.5-Coder's FIM tokens; its own `suffix` support
  sends prefix token 0): no HTTP, so its latency is a little lower than a server's.

Each part appends its rows to --out/rows.jsonl and skips the requests it already has there (resumable);
`--max-requests N` measures only the first N pending ones. `--report` writes results.json and results.md over
the requests every server measured: p50/p95 per server, over all of them, the first request at each position
(a cold prefix) and the keystrokes after it, and FLy's p50 over llama.cpp's (aim ≤ 0.7×).

    flock /tmp/fly-cpu.lock python benchmarks/serving/fim_latency.py --server llamacpp --out DIR
    flock /tmp/fly-cpu.lock python benchmarks/serving/fim_latency.py --server fly --out DIR
    flock /tmp/fly-cpu.lock python benchmarks/serving/fim_latency.py --server target --out DIR
    python benchmarks/serving/fim_latency.py --report --out DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness.cli import model_gguf
from benchmarks.harness.environment import cpu_name, git_commit
from benchmarks.serving.llama_server import LLAMA_SERVER, MODES, build_info, command
from benchmarks.serving.processes import serve
from benchmarks.serving.serve_bench import add_model_arguments
from benchmarks.serving.server_side_by_side import fly_server, parse_part_args, ratio, read_jsonl
from benchmarks.serving.webui_check import free_port, get_json

SERVERS = ("llamacpp", "llamacpp-python", "fly", "target")
REFERENCES = ("llamacpp", "llamacpp-python")
"""The server every ratio is taken against: the first of these measured."""
AIM = 0.7
"""Issue 47's aim: FLy's p50 at most this times llama.cpp's."""
SOURCE_PATH = "fly_llm/decoding/engine.py"
SOURCE_COMMIT = "818119a"
"""The file the cursors are placed in, and the commit it is read at (the same text for every run)."""
WARMUP = {"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n", "n_predict": 4, "temperature": 0}
MIN_TYPED = 4
"""Characters of the line (after its indentation) already typed at a position's first request."""


@dataclass(frozen=True)
class FimRequest:
    """One autocomplete request: the text before and after the cursor."""

    request_id: str
    position: int
    keystroke: int
    prefix: str
    suffix: str


@dataclass
class Row:
    """One measured request."""

    server: str
    request_id: str
    position: int
    keystroke: int
    e2e_s: float
    tokens_predicted: int
    content: str
    commit: str
    details: dict[str, Any] | None = None
    """The answer's `timings` (prompt tokens evaluated: the cache's reuse) and `fly_stats`, where given."""


def lines_within(lines: list[str], budget: int, count_tokens: Callable[[str], int], from_end: bool) -> str:
    """As many whole lines as fit in `budget` tokens, taken from the end of `lines` (the code above the
    cursor) or from the start (the code below), joined back; each line counted with its own tokens."""
    taken: list[str] = []
    used = 0
    for line in (reversed(lines) if from_end else lines):
        used += count_tokens(line)
        if used > budget:
            break
        taken.append(line)
    return "".join(reversed(taken) if from_end else taken)


def cursor_lines(lines: list[str], counts: list[int], positions: int, keystrokes: int, chars: int,
                 prefix_tokens: int, suffix_tokens: int) -> list[int]:
    """`positions` line numbers spread evenly over the lines long enough to type MIN_TYPED +
    (keystrokes - 1) * chars characters of and still leave some unwritten, and with the whole prefix
    budget above and the suffix budget below (any long-enough line when too few have both)."""
    need = MIN_TYPED + (keystrokes - 1) * chars + 1
    long_enough = [i for i, line in enumerate(lines) if len(line.strip()) >= need]
    above = np.cumsum([0, *counts])
    room = [i for i in long_enough if above[i] >= prefix_tokens and above[-1] - above[i + 1] >= suffix_tokens]
    fit = room if len(room) >= positions else long_enough
    if len(fit) < positions:
        raise SystemExit(f"only {len(fit)} lines are long enough for {positions} positions")
    if positions == 1:
        return [fit[len(fit) // 2]]
    return [fit[round(k * (len(fit) - 1) / (positions - 1))] for k in range(positions)]


def build_requests(text: str, count_tokens: Callable[[str], int], positions: int, keystrokes: int, chars: int,
                   prefix_tokens: int, suffix_tokens: int) -> list[FimRequest]:
    """The request sequence: per cursor position, the first request and `keystrokes` - 1 more, each with
    `chars` more characters of the line typed."""
    lines = text.splitlines(keepends=True)
    counts = [count_tokens(line) for line in lines]
    requests = []
    for p, i in enumerate(cursor_lines(lines, counts, positions, keystrokes, chars, prefix_tokens, suffix_tokens)):
        line = lines[i]
        indent = len(line) - len(line.lstrip())
        above = lines_within(lines[:i], prefix_tokens, count_tokens, from_end=True)
        below = lines_within(lines[i + 1:], suffix_tokens, count_tokens, from_end=False)
        for k in range(keystrokes):
            typed = line[:indent + MIN_TYPED + k * chars]
            requests.append(FimRequest(f"p{p}k{k}", p, k, above + typed, below))
    return requests


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100, linear between ranks as numpy's default); None for no values."""
    return round(float(np.percentile(values, q)), 3) if values else None


def _stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    times = [r["e2e_s"] for r in rows]
    return {"requests": len(rows), "p50_s": percentile(times, 50), "p95_s": percentile(times, 95),
            "mean_tokens": round(sum(r["tokens_predicted"] for r in rows) / len(rows), 1) if rows else None}


def common_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the requests every server in `rows` measured (parts cut short compare like with like)."""
    servers = {r["server"] for r in rows}
    ids = set.intersection(*({r["request_id"] for r in rows if r["server"] == s} for s in servers)) if rows else set()
    return [r for r in rows if r["request_id"] in ids]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per server, over the requests every server measured: p50/p95 time to last token over all of them,
    the first at each position and the keystrokes; its p50 and p95 over the reference's (llama-server,
    else llama-cpp-python); how many answers are the reference's exactly."""
    rows = common_rows(rows)
    servers = [s for s in SERVERS if any(r["server"] == s for r in rows)]
    summary: dict[str, Any] = {}
    for s in servers:
        mine = [r for r in rows if r["server"] == s]
        summary[s] = {"all": _stats(mine), "first": _stats([r for r in mine if r["keystroke"] == 0]),
                      "keystrokes": _stats([r for r in mine if r["keystroke"] > 0])}
    name = next((s for s in REFERENCES if s in summary), None)
    if name is not None:
        summary["reference"] = name
        ref = summary[name]["all"]
        reference = {r["request_id"]: r["content"] for r in rows if r["server"] == name}
        for s in servers:
            mine = summary[s]["all"]
            both = [r for r in rows if r["server"] == s and r["request_id"] in reference]
            summary[s]["vs_reference"] = {"p50": ratio(mine["p50_s"], ref["p50_s"]),
                                         "p95": ratio(mine["p95_s"], ref["p95_s"]),
                                         "same_content": f"{sum(reference[r['request_id']] == r['content'] for r in both)}/{len(both)}"}
        if "fly" in summary:
            fly_p50 = summary["fly"]["vs_reference"]["p50"]
            summary["aim"] = {"fly_p50_over_reference": fly_p50, "aim": AIM, "met": fly_p50 is not None and fly_p50 <= AIM}
    return summary


def markdown(summary: dict[str, Any], settings: dict[str, Any]) -> str:
    """results.md: the latency table and how it was measured."""
    servers = [s for s in SERVERS if s in summary]
    ref = summary.get("reference")
    lines = [f"# FIM autocomplete latency ({settings['cpu']}, commit {', '.join(settings['commits_measured'])})", "",
             f"`{settings['command']}`", "",
             f"Source: `{settings['source']['path']}` at {settings['source']['commit']} (sha256 "
             f"{settings['source']['sha256'][:16]}…); {settings['requests']['positions']} positions × "
             f"{settings['requests']['keystrokes']} keystrokes ({settings['requests']['chars_per_keystroke']} chars each); "
             f"prefix {settings['requests']['prefix_tokens_mean']} tokens, suffix {settings['requests']['suffix_tokens_mean']} "
             f"tokens on average; n_predict {settings['n_predict']}, greedy, /infill, not streamed.", "",
             "Time to last token, seconds:", "",
             f"| server | requests | p50 | p95 | mean tokens | first p50 | keystroke p50 | p50 × {ref} | p95 × {ref} "
             f"| same content as {ref} |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in servers:
        a, v = summary[s]["all"], summary[s].get("vs_reference", {})
        lines.append(f"| {s} | {a['requests']} | {a['p50_s']} | {a['p95_s']} | {a['mean_tokens']} | "
                     f"{summary[s]['first']['p50_s']} | {summary[s]['keystrokes']['p50_s']} | {v.get('p50')} | "
                     f"{v.get('p95')} | {v.get('same_content')} |")
    if "aim" in summary:
        aim = summary["aim"]
        lines += ["", f"FLy's p50 over {ref}'s: {aim['fly_p50_over_reference']} (aim ≤ {aim['aim']}: "
                      f"{'met' if aim['met'] else 'not met'})."]
    lines += ["", f"llama-server build: {settings['llama_server_build'] or 'unknown'}", ""]
    return "\n".join(lines)


def pending(rows: list[dict[str, Any]], server: str, requests: list[FimRequest]) -> list[FimRequest]:
    """The requests this server has not measured yet."""
    done = {r["request_id"] for r in rows if r["server"] == server}
    return [q for q in requests if q.request_id not in done]


def source_text(commit: str) -> str:
    """The source file's text at `commit`, from this checkout's git."""
    root = Path(__file__).resolve().parents[2]
    return subprocess.run(["git", "-C", str(root), "show", f"{commit}:{SOURCE_PATH}"], capture_output=True,
                          text=True, check=True).stdout


def request_set(args: argparse.Namespace, gguf: Path) -> list[FimRequest]:
    """The requests of --out/requests.jsonl, made first (with the GGUF's own tokenizer) when absent."""
    path = args.out / "requests.jsonl"
    if not path.exists():
        from llama_cpp import Llama

        vocab = Llama(str(gguf), vocab_only=True, verbose=False)

        def count(text: str) -> int:
            return len(vocab.tokenize(text.encode(), add_bos=False, special=False))

        text = source_text(args.source_commit)
        requests = build_requests(text, count, args.positions, args.keystrokes, args.chars_per_keystroke,
                                  args.prefix_tokens, args.suffix_tokens)
        meta = {"source": {"path": SOURCE_PATH, "commit": args.source_commit,
                           "sha256": hashlib.sha256(text.encode()).hexdigest()},
                "positions": args.positions, "keystrokes": args.keystrokes,
                "chars_per_keystroke": args.chars_per_keystroke,
                "prefix_tokens_mean": round(sum(count(q.prefix) for q in requests) / len(requests)),
                "suffix_tokens_mean": round(sum(count(q.suffix) for q in requests) / len(requests))}
        path.write_text("".join(json.dumps(x) + "\n" for x in [meta, *map(asdict, requests)]))
    return [FimRequest(**r) for r in read_jsonl(path)[1:]]


def infill_body(request: FimRequest, n_predict: int) -> dict[str, Any]:
    """The greedy /infill request, not streamed."""
    return {"input_prefix": request.prefix, "input_suffix": request.suffix, "n_predict": n_predict,
            "temperature": 0, "stream": False}


def psm_prompt(request: FimRequest) -> str:
    """Qwen2.5-Coder's prefix-suffix-middle prompt as text (its FIM tokens spelled out, read as the tokens)."""
    return f"<|fim_prefix|>{request.prefix}<|fim_suffix|>{request.suffix}<|fim_middle|>"


Complete = Callable[[FimRequest, int], tuple[int, str, dict[str, Any] | None]]
"""A server's door: (request, n_predict) -> (tokens predicted, the middle, the answer's details)."""


@contextmanager
def http_infill(server: AbstractContextManager[tuple[str, str]]) -> Iterator[Complete]:
    """The /infill door of an HTTP server (a context manager yielding its URL and model id), warmed with one
    request."""
    with server as (url, _model):
        get_json(f"{url}/infill", WARMUP)

        def complete(request: FimRequest, n_predict: int) -> tuple[int, str, dict[str, Any] | None]:
            answer = get_json(f"{url}/infill", infill_body(request, n_predict), timeout=1800)
            details = {k: answer[k] for k in ("timings", "tokens_cached", "fly_stats") if k in answer}
            return int(answer["tokens_predicted"]), answer["content"], details

        yield complete


@contextmanager
def in_process_llama(gguf: Path, threads: int) -> Iterator[Complete]:
    """llama-cpp-python's `Llama` in this process on `gguf` (n_ctx 4096, `threads` for decode and batch):
    the PSM prompt as text, greedy, `repeat_penalty` 1; it reuses the prompt's common start as a server's
    cache does. No HTTP: a reference for when llama-server is not built, its latency a little lower."""
    from llama_cpp import Llama

    llm = Llama(str(gguf), n_ctx=4096, n_threads=threads, n_threads_batch=threads, verbose=False)

    def complete(request: FimRequest, n_predict: int) -> tuple[int, str, dict[str, Any] | None]:
        out = llm.create_completion(psm_prompt(request), max_tokens=n_predict, temperature=0, repeat_penalty=1.0)
        return int(out["usage"]["completion_tokens"]), out["choices"][0]["text"], None

    complete(FimRequest("warmup", 0, 0, WARMUP["input_prefix"], WARMUP["input_suffix"]), 4)
    try:
        yield complete
    finally:
        llm.close()


def run_part(args: argparse.Namespace, requests: list[FimRequest], gguf: Path | None, workdir: Path) -> None:
    """Start `args.server`, warm it, measure the requests given; append each row to rows.jsonl."""
    commit = git_commit() or "unknown"
    if args.server == "llamacpp":
        port = free_port()
        server = http_infill(serve(command(args.llama_server, MODES["llama-server"], gguf, None, port, args.threads),
                                   port, workdir / "llama-server.log"))
    elif args.server == "llamacpp-python":
        server = in_process_llama(gguf, args.threads)
    else:
        server = http_infill(fly_server(args, workdir, args.server == "fly"))
    with server as complete:
        for q in requests:
            start = time.perf_counter()
            tokens, content, details = complete(q, args.n_predict)
            seconds = time.perf_counter() - start
            row = Row(args.server, q.request_id, q.position, q.keystroke, round(seconds, 3), tokens, content, commit,
                      details)
            with open(args.out / "rows.jsonl", "a") as f:
                f.write(json.dumps(asdict(row)) + "\n")
            print(f"{args.server} {q.request_id}: {seconds:.2f} s, {tokens} tokens", flush=True)


def write_report(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    """results.json and results.md from requests.jsonl and rows.jsonl; the report."""
    rows = read_jsonl(args.out / "rows.jsonl")
    if not rows:
        raise SystemExit(f"no rows in {args.out / 'rows.jsonl'}: run a --server part first")
    meta = read_jsonl(args.out / "requests.jsonl")[0]
    settings = {"command": " ".join(["python benchmarks/serving/fim_latency.py", *(sys.argv[1:] if argv is None else argv)]),
                "commits_measured": sorted({r["commit"] for r in rows}), "cpu": cpu_name(), "threads": args.threads,
                "n_predict": args.n_predict, "dtype": args.dtype, "source": meta.pop("source"), "requests": meta,
                "llama_server_build": build_info(args.llama_server),
                "client": "urllib POST /infill (temperature 0, not streamed), one request at a time"}
    report = {"settings": settings, "summary": summarize(rows)}
    (args.out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "results.md").write_text(markdown(report["summary"], settings))
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--server", choices=SERVERS, help="the part to run: one server, started, measured, stopped")
    p.add_argument("--report", action="store_true", help="write results.json and results.md from the rows")
    p.add_argument("--out", type=Path, default=Path("fim-latency"))
    p.add_argument("--llama-server", type=Path, default=LLAMA_SERVER, help="the llama-server binary")
    p.add_argument("--source-commit", default=SOURCE_COMMIT, help=f"the commit {SOURCE_PATH} is read at")
    p.add_argument("--positions", type=int, default=6, help="cursor positions")
    p.add_argument("--keystrokes", type=int, default=4, help="requests per position (the first and the typed)")
    p.add_argument("--chars-per-keystroke", type=int, default=3)
    p.add_argument("--prefix-tokens", type=int, default=1500)
    p.add_argument("--suffix-tokens", type=int, default=300)
    p.add_argument("--n-predict", type=int, default=64)
    p.add_argument("--max-requests", type=int, help="measure at most this many of the part's pending requests, in order")
    return parse_part_args(p, argv)


def main(argv: list[str] | None = None) -> int:
    """Run one part and/or write the report."""
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.server:
        needs_gguf = args.server.startswith("llamacpp") or not (args.out / "requests.jsonl").exists()
        with model_gguf(args.target, needs_gguf) as gguf, tempfile.TemporaryDirectory(prefix="fly-fim-") as tmp:
            if needs_gguf and gguf is None:
                raise SystemExit("llama.cpp needs the target as a .gguf file (--target FILE.gguf)")
            requests = pending(read_jsonl(args.out / "rows.jsonl"), args.server, request_set(args, gguf))
            requests = requests[:args.max_requests] if args.max_requests is not None else requests
            if requests:
                run_part(args, requests, gguf, Path(tmp))
    if args.report:
        write_report(args, argv)
        print((args.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
