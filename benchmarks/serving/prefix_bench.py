"""Prompt work: time to first token with the prefix cache vs without, and inter-token latency of a
running stream while a long prompt arrives, with chunked prefill vs without (docs/design.md §3.5–3.6).

    python benchmarks/serving/prefix_bench.py                                   # tiny random pair (tests/support)
    python benchmarks/serving/prefix_bench.py --embedded --dtype auto --threads 2 --out benchmarks/results/prefix

Three scenarios, in one process on the same model objects (engines that differ only in their
prompt options), greedy exact mode so both sides give the same tokens:

- agent: a 6-turn chat; each turn sends the whole conversation so far (the previous answers and a
  new user message). Per turn: TTFT without the cache and with it, and whether the answers match.
  Run twice: as a plain chat, and as an agent does it, with tool schemas in every prompt
  (`AGENT_TOOLS`, rendered by the chat template into the system prompt).
- rag: the same long system prompt + context (`--context-tokens`) with 6 different questions.
- itl: a stream is decoding when a `--long-tokens` prompt arrives; the stream's inter-token
  latency (median, p99, longest stall) with the whole prompt prefilled at once vs in pieces of
  each `--chunks` size (to choose the daemon's `--prefill-chunk` by measurement).

TTFT is measured in the engine: from `add_request` to the step that returns the first token.
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.serving.serve_bench import add_model_arguments
from fly_llm.common.config import FLyConfig, ModelSpec, SamplingParams
from fly_llm.decoding.engine import FLyEngine

EXACT = FLyConfig(loose=False)
SYSTEM = "You are a helpful assistant. Answer from the documentation below, briefly and precisely."
AGENT_TURNS = [
    "Write a Python function that parses a CSV line into fields, handling quoted commas.",
    "Now add type hints and a docstring.",
    "Write three pytest tests for it.",
    "Make it also accept a custom delimiter.",
    "What is the time complexity?",
    "Summarise the final function in one sentence.",
]
AGENT_TOOLS = [  # what a coding agent offers its model: six tools, OpenAI function format
    {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {arg: {"type": "string", "description": arg_doc} for arg, arg_doc in args.items()},
        "required": list(args)}}}
    for name, description, args in [
        ("read_file", "Read a text file of the project and return its contents.",
         {"path": "Path of the file, relative to the project root."}),
        ("write_file", "Create or overwrite a text file of the project with the given contents.",
         {"path": "Path of the file, relative to the project root.", "contents": "The file's new text."}),
        ("run_tests", "Run the project's test suite (or the tests matching a pattern) and return the report.",
         {"pattern": "A pytest -k expression selecting tests; empty for all."}),
        ("search_code", "Search the project's source for a regular expression; returns matching lines.",
         {"regex": "A Python regular expression.", "glob": "Which files to search, e.g. '*.py'."}),
        ("python", "Run a short Python snippet in a sandbox and return what it printed.",
         {"code": "The Python source to run."}),
        ("search_docs", "Search the Python standard library documentation and return the best passages.",
         {"query": "What to look for, in words."}),
    ]
]
RAG_QUESTIONS = [
    "How do I serialise a Python object to JSON?",
    "What does itertools.chain do?",
    "How can I cache the results of a function?",
    "What is a deque good for?",
    "How do I join two paths?",
    "How do I parse command-line arguments?",
]
DOC_MODULES = ["json", "itertools", "functools", "collections", "pathlib", "argparse", "textwrap", "heapq",
               "bisect", "string"]


def load(args: argparse.Namespace) -> FLyEngine:
    """The engine with the prefix cache off and whole-prompt prefill (the tiny pair unless told)."""
    if args.embedded or args.target:
        from fly_llm.loading import load_engine

        return load_engine(ModelSpec(target=args.target, draft=args.draft, dtype=args.dtype, device=args.device),
                           EXACT)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from support.tiny_models import make_pair

    target, draft, tokenizer = make_pair("llama", max_position_embeddings=8192)  # room for the long prompts
    return FLyEngine(target, tokenizer, draft, EXACT)


def variant(engine: FLyEngine, cache_mb: int = 0, chunk: int = 0) -> FLyEngine:
    """An engine on the same models and policy with other prompt options."""
    return FLyEngine(engine.target, engine.tokenizer, engine.draft, engine.config, context_window=engine.context_window,
                     policy=engine.policy, prefix_cache_bytes=cache_mb * 2**20, prefill_chunk=chunk)


def first_token(engine: FLyEngine, prompt: list[int], max_tokens: int) -> tuple[float, list[int], int]:
    """(TTFT in seconds, generated tokens, cached prompt tokens) of one request run alone."""
    rid = f"q{time.perf_counter_ns()}"
    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens))
    ttft, tokens, cached = None, [], 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids and ttft is None:
                ttft = time.perf_counter() - start
            tokens += out.new_token_ids
            cached = out.cached_tokens
    return ttft or 0.0, tokens, cached


def context_text(tokenizer, tokens: int) -> str:
    """About `tokens` tokens of standard-library documentation (the same on every machine with this Python)."""
    docs = "\n\n".join(f"# {name}\n{inspect.getdoc(__import__(name))}" for name in DOC_MODULES)
    ids = tokenizer.encode(docs)[:tokens]
    return tokenizer.decode(ids)


def chat(engine: FLyEngine, messages: list[dict]) -> list[int]:
    return engine.encode(messages=messages)


def compare_turns(plain: FLyEngine, cached: FLyEngine, prompts, max_tokens: int) -> list[dict]:
    """Each prompt (a function of the answers so far) without and with the cache, alternating."""
    rows, answers = [], []
    for turn, make in enumerate(prompts, 1):
        prompt = make(answers)
        off, answer, _ = first_token(plain, prompt, max_tokens)
        on, answer_on, hit = first_token(cached, prompt, max_tokens)
        answers.append(answer)
        rows.append(dict(turn=turn, prompt_tokens=len(prompt), cached_tokens=hit, ttft_off_s=off, ttft_on_s=on,
                         speedup=off / on if on else 0.0, same_answer=answer == answer_on))
    return rows


def agent(plain: FLyEngine, cached: FLyEngine, max_tokens: int, tools: list[dict] | None = None) -> list[dict]:
    """The 6-turn conversation, each turn's prompt holding the whole conversation (and `tools`' schemas)."""
    def prompt(turn: int):
        def make(answers: list[list[int]]) -> list[int]:
            messages = [{"role": "system", "content": SYSTEM}]
            for i in range(turn):
                messages.append({"role": "user", "content": AGENT_TURNS[i]})
                if i < len(answers):
                    text = plain.tokenizer.decode(answers[i], skip_special_tokens=True)
                    messages.append({"role": "assistant", "content": text})
            return plain.encode(messages=messages, tools=tools)
        return make
    return compare_turns(plain, cached, [prompt(t) for t in range(1, len(AGENT_TURNS) + 1)], max_tokens)


def rag(plain: FLyEngine, cached: FLyEngine, context_tokens: int, max_tokens: int) -> list[dict]:
    system = f"{SYSTEM}\n\n{context_text(plain.tokenizer, context_tokens)}"
    prompts = [chat(plain, [{"role": "system", "content": system}, {"role": "user", "content": q}])
               for q in RAG_QUESTIONS]
    return compare_turns(plain, cached, [lambda _, p=p: p for p in prompts], max_tokens)


def itl(engine: FLyEngine, long_prompt: list[int], stream_tokens: int, arrive_at: int = 3) -> dict:
    """A stream's inter-token latencies over its life, while `long_prompt` arrives after `arrive_at` steps.

    Each gap between two outputs of the stream counts once per token it brought (a speculative step
    emits several); `max_stall_s` is the longest gap, what a reader of the stream sees freeze;
    `long_ttft_s` is the arriving prompt's time to first token, what the chunking costs it.
    """
    stream = chat(engine, [{"role": "user", "content": AGENT_TURNS[0]}])
    engine.add_request("stream", stream, SamplingParams(max_tokens=stream_tokens))
    per_token, stalls, steps, last, arrived, long_ttft = [], [], 0, None, 0.0, 0.0
    while engine.has_unfinished():
        if steps == arrive_at:
            engine.add_request("long", long_prompt, SamplingParams(max_tokens=1))
            arrived = time.perf_counter()
        outputs = engine.step()
        now, steps = time.perf_counter(), steps + 1
        for out in outputs:
            if out.request_id == "long" and out.new_token_ids:
                long_ttft = now - arrived
            if out.request_id == "stream" and out.new_token_ids:
                if last is not None:
                    stalls.append(now - last)
                    per_token += [(now - last) / len(out.new_token_ids)] * len(out.new_token_ids)
                last = now
    per_token.sort()
    return dict(samples=len(per_token), median_s=statistics.median(per_token),
                p99_s=per_token[min(len(per_token) - 1, int(0.99 * len(per_token)))], max_stall_s=max(stalls),
                long_ttft_s=long_ttft)


def summary(rows: list[dict]) -> str:
    later = [r["speedup"] for r in rows[1:]]
    return f"turns 2-{len(rows)}: TTFT {statistics.mean(later):.1f}x lower on average (min {min(later):.1f}x)"


def table(name: str, rows: list[dict]) -> str:
    lines = [f"### {name}", "", "| turn | prompt tokens | cached | TTFT off (s) | TTFT on (s) | speedup | same answer |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['turn']} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['ttft_off_s']:.3f} | "
              f"{r['ttft_on_s']:.3f} | {r['speedup']:.1f}x | {r['same_answer']} |" for r in rows]
    return "\n".join(lines + ["", summary(rows), ""])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--max-tokens", type=int, default=32, help="answer length per turn")
    p.add_argument("--context-tokens", type=int, default=1500, help="RAG context length (capped by the window)")
    p.add_argument("--long-tokens", type=int, default=2000, help="the arriving prompt (capped by the window)")
    p.add_argument("--chunks", type=int, nargs="+", default=[128, 256, 512],
                   help="--prefill-chunk values for the ITL runs (besides whole prompts)")
    p.add_argument("--cache-mb", type=int, default=1024)
    p.add_argument("--out", type=Path, help="write results.json and results.md here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    base = load(args)
    room = base.context_window - args.max_tokens - 64
    plain, cached = variant(base), variant(base, cache_mb=args.cache_mb)
    first_token(plain, chat(plain, [{"role": "user", "content": "hi"}]), 4)  # warm-up
    report = dict(command=" ".join(sys.argv), target=base.target_name, draft=base.draft_name, dtype=str(base.dtype),
                  device=str(base.device), threads=torch.get_num_threads(), platform=platform.platform(),
                  max_tokens=args.max_tokens)
    report["agent"] = agent(plain, cached, args.max_tokens)
    report["agent_tools"] = agent(plain, cached, args.max_tokens, AGENT_TOOLS)
    report["rag"] = rag(plain, cached, min(args.context_tokens, room // 2), args.max_tokens)
    long_prompt = base.tokenizer.encode(context_text(base.tokenizer, min(args.long_tokens, room)))
    report["itl"] = {f"chunk {chunk or 'off'}": itl(variant(base, chunk=chunk), long_prompt, 4 * args.max_tokens)
                     for chunk in (0, *args.chunks)}
    report["itl_long_prompt_tokens"] = len(long_prompt)
    md = "\n".join([f"# prefix_bench\n\n`{report['command']}`\n\ntarget {report['target']}, draft {report['draft']}, "
                    f"{report['dtype']} on {report['device']}, {report['threads']} threads\n",
                    table("agent: 6 turns, the whole conversation each time", report["agent"]),
                    table(f"agent with tools: the same, {len(AGENT_TOOLS)} tool schemas in every prompt",
                          report["agent_tools"]),
                    table("rag: one long context, 6 questions", report["rag"]),
                    f"### itl: a stream while a {len(long_prompt)}-token prompt arrives\n",
                    "| prefill | tokens | median ITL (s) | p99 ITL (s) | p99 / median | longest stall (s) | "
                    "long prompt's TTFT (s) |",
                    "|---|---|---|---|---|---|---|",
                    *[f"| {name} | {r['samples']} | {r['median_s']:.3f} | {r['p99_s']:.3f} | "
                      f"{r['p99_s'] / r['median_s']:.1f} | {r['max_stall_s']:.3f} | {r['long_ttft_s']:.2f} |"
                      for name, r in report["itl"].items()]])
    print(md)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        (args.out / "results.md").write_text(md + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
