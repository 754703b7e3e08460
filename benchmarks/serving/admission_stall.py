"""A running stream's longest stall while the worst admissible requests are admitted (issue 33, finding 6).

    python benchmarks/serving/admission_stall.py                       # the tiny random pair (tests/support), CPU
    python benchmarks/serving/admission_stall.py --embedded --dtype auto --device cuda

A Scheduler runs in this process, as in the daemon (prefix cache off, `--prefill-chunk` prompt
tokens per step). Each phase starts a greedy stream, waits for its first token, sends the phase's
requests, waits for their replies, and cancels the stream. A stall is the time between two engine
steps that give the stream new tokens (its chunk gaps, measured where the scheduler decides them:
the tiny pair's text is often held back as incomplete UTF-8, so its chunks themselves are
irregular). Three phases:

- alone: nothing else arrives;
- admit: the longest admissible prompt (the token limit less 80, as chat messages) with a big
  JSON schema as its response_format joins the batch;
- refuse: `--flood` prompts just under the character limit that are refused only after tokenizing
  (TOO_LONG: too many tokens), with as many tokenize requests of the same text.

Reported per phase: the longest stall, the median gap, and how long the phase took.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from pydantic import BaseModel

from benchmarks.serving.serve_bench import add_model_arguments
from fly_llm.common.config import FLyConfig, ModelSpec, SamplingParams
from fly_llm.decoding.engine import FLyEngine
from fly_llm.common.protocol import ErrorReply, GenerateRequest, GenerateResult, TokenizeReply, TokenizeRequest

from fly_daemon.scheduling.scheduler import CHARS_PER_TOKEN, Limits, Scheduler

STREAM_PROMPT = "def add(a, b):"  # the tiny pair's greedy answer to it runs to max_tokens
FILLER = ("The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens with a small model "
          "and verifies them with a large one. for i in range(10):\n    print(i * i)\n")
CLIENT = (b"bench",)


def big_schema(properties: int) -> dict:
    """An object schema of `properties` nested objects with enums and patterns: big, but admissible."""
    item = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "count": {"type": "integer", "minimum": 0},
        "kind": {"enum": [f"kind{i}" for i in range(20)]}, "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5}}, "required": ["name", "kind"]}
    return {"type": "object", "properties": {f"field{i}": item for i in range(properties)},
            "required": [f"field{i}" for i in range(properties)]}


class Stream:
    """The scheduler's emit: keeps the final replies; `watch(engine)` records when engine steps gave
    the stream (the one request with STREAM_PROMPT's length) new tokens."""

    def __init__(self, max_tokens: int, prompt: str = STREAM_PROMPT) -> None:
        self.max_tokens = max_tokens
        self.prompt = prompt
        self.scheduler: Scheduler | None = None
        self.arrivals: list[float] = []
        self.finals: dict[str, BaseModel] = {}
        self._n = 0
        self._cond = threading.Condition()

    def watch(self, engine: FLyEngine) -> None:
        step, prompt_tokens = engine.step, len(engine.encode(self.prompt))

        def timed_step():
            outputs = step()
            if any(out.new_token_ids and out.prompt_tokens == prompt_tokens for out in outputs):
                with self._cond:
                    self.arrivals.append(time.perf_counter())
                    self._cond.notify_all()
            return outputs

        engine.step = timed_step

    def __call__(self, envelope: tuple[bytes, ...], message: BaseModel) -> None:
        if isinstance(message, (GenerateResult, ErrorReply, TokenizeReply)):
            with self._cond:
                self.finals[message.id] = message
                self._cond.notify_all()

    def start(self) -> float:
        """Start the next stream; return when its first token came."""
        self._n += 1
        with self._cond:
            seen = len(self.arrivals)
        self.scheduler.submit(CLIENT, GenerateRequest(id=f"stream{self._n}", prompt=self.prompt, stream=True,
                                                      sampling=SamplingParams(max_tokens=self.max_tokens)))
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.arrivals) > seen, 600), "the stream did not start"
            return self.arrivals[-1]

    def stop(self) -> bool:
        """Cancel the stream; whether it was still running."""
        return self.scheduler.cancel(CLIENT, f"stream{self._n}")

    def wait(self, ids: list[str], timeout: float = 600.0) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: all(i in self.finals for i in ids), timeout), "no reply"

    def gaps(self, start: float, end: float) -> list[float]:
        """The gaps between the stream's tokens from `start` to `end` (both ends count as tokens)."""
        with self._cond:
            times = [start] + [t for t in self.arrivals if start < t <= end] + [end]
        return [b - a for a, b in zip(times, times[1:])]


def phase(stream: Stream, disturb: Callable[[], list[str]], seconds: float) -> dict:
    """The stream's gaps while `disturb`'s requests are served (or for `seconds` if it sends none)."""
    start = stream.start()
    ids = disturb()
    if ids:
        stream.wait(ids)
    else:
        time.sleep(seconds)
    end = time.perf_counter()
    ran_through = stream.stop()
    gaps = stream.gaps(start, end)
    codes: dict[str, int] = {}
    for rid in ids:
        reply = stream.finals[rid]
        code = getattr(reply, "code", type(reply).__name__)
        codes[code] = codes.get(code, 0) + 1
    return dict(longest_stall_s=max(gaps), median_gap_s=statistics.median(gaps), steps=len(gaps) - 1,
                took_s=end - start, stream_ran_through=ran_through, replies=codes)


def load(args: argparse.Namespace) -> FLyEngine:
    """The engine: the tiny pair with a `--context`-token window unless told otherwise."""
    if args.embedded or args.target:
        from fly_llm.loading import load_engine

        return load_engine(ModelSpec(target=args.target, draft=args.draft, dtype=args.dtype, device=args.device),
                           FLyConfig(loose=False), prefill_chunk=args.prefill_chunk)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from support.tiny_models import make_pair

    target, draft, tokenizer = make_pair("llama", max_position_embeddings=args.context)
    return FLyEngine(target, tokenizer, draft, FLyConfig(loose=False), prefill_chunk=args.prefill_chunk)


def text_of_tokens(engine: FLyEngine, tokens: int) -> str:
    """Filler text of about `tokens` tokens (as chat content: the template's tokens come on top)."""
    per = len(engine.tokenizer.encode(FILLER))
    return FILLER * max(1, tokens // per)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--context", type=int, default=8192, help="the tiny pair's context window")
    p.add_argument("--prefill-chunk", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, help="the daemon's prompt limit (default: the context window - 1)")
    p.add_argument("--stream-prompt", default=STREAM_PROMPT, help="the stream's prompt (a real model's must not end soon)")
    p.add_argument("--stream-tokens", type=int, default=8000, help="max_tokens of each phase's stream")
    p.add_argument("--schema-properties", type=int, default=60)
    p.add_argument("--flood", type=int, default=8, help="prompts refused after tokenizing (and tokenize requests)")
    p.add_argument("--alone-s", type=float, default=3.0)
    p.add_argument("--out", type=Path, help="write the report (JSON) here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = load(args)
    limits = Limits(heartbeat_timeout=0, max_tokens_limit=args.stream_tokens, max_prompt_tokens=args.max_prompt_tokens)
    token_cap = args.max_prompt_tokens or engine.context_window - 1
    stream = Stream(args.stream_tokens, args.stream_prompt)
    stream.watch(engine)
    scheduler = Scheduler(lambda: engine, stream, limits)
    stream.scheduler = scheduler
    thread = threading.Thread(target=scheduler.run, name="model", daemon=True)
    thread.start()

    def admit() -> list[str]:
        content = text_of_tokens(engine, token_cap - 80)
        scheduler.submit((b"other",), GenerateRequest(
            id="worst", messages=[{"role": "user", "content": content}], sampling=SamplingParams(max_tokens=16),
            response_format={"type": "json_schema", "schema": big_schema(args.schema_properties)}))
        return ["worst"]

    def refuse() -> list[str]:
        chars = limits.max_prompt_chars or CHARS_PER_TOKEN * token_cap
        text = (FILLER * (chars // len(FILLER) + 1))[:chars]
        for i in range(args.flood):
            scheduler.submit((b"flood%d" % i,), GenerateRequest(id=f"long{i}", prompt=text,
                                                                sampling=SamplingParams(max_tokens=1)))
            scheduler.tokenize((b"flood%d" % i,), TokenizeRequest(id=f"count{i}", text=text))
        return [f"long{i}" for i in range(args.flood)] + [f"count{i}" for i in range(args.flood)]

    report = dict(command=" ".join(["python", *sys.argv]), target=engine.target_name, draft=engine.draft_name,
                  device=str(engine.device), threads=torch.get_num_threads(), platform=platform.platform(),
                  context_window=engine.context_window, prefill_chunk=args.prefill_chunk)
    try:
        report["alone"] = phase(stream, lambda: [], args.alone_s)
        report["admit"] = phase(stream, admit, 0)
        report["refuse"] = phase(stream, refuse, 0)
    finally:
        scheduler.drain(force=True)
        thread.join(60)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
