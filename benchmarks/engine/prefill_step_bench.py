"""Each engine step of one long prompt's chunked prefill, forward by forward (issue 33/34: what a chunk costs).

    python benchmarks/engine/prefill_step_bench.py --tokens 4000 --chunk 128 --threads 2   # the embedded pair

Loads the embedded pair (exact mode), submits one prompt of `--tokens` filler tokens with `max_tokens`
4, steps the engine to the end and prints, per step, its time and the shape and time of every target
(T) and draft (D) forward inside it.
"""

from __future__ import annotations

import argparse
import time

import torch

from fly_llm.common.config import FLyConfig, ModelSpec, SamplingParams
from fly_llm.loading import load_engine

FILLER = ("The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens with a small model "
          "and verifies them with a large one. for i in range(10):\n    print(i * i)\n")


def timed(model: torch.nn.Module, name: str, log: list) -> None:
    """Record (name, input shape, seconds) of every forward of `model` in `log`."""
    forward = model.forward

    def wrapper(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        start = time.perf_counter()
        out = forward(*args, **kwargs)
        log.append((name, tuple(ids.shape) if ids is not None else None, round(time.perf_counter() - start, 3)))
        return out

    model.forward = wrapper


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4000)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine = load_engine(ModelSpec(), FLyConfig(loose=False), prefill_chunk=args.chunk)
    ids = engine.encode(FILLER * (args.tokens // 20 + 1))[:args.tokens]
    log: list = []
    timed(engine.target, "T", log)
    if engine.draft is not None:
        timed(engine.draft, "D", log)
    engine.add_request("probe", ids, SamplingParams(max_tokens=4))
    while engine.has_unfinished():
        log.clear()
        start = time.perf_counter()
        engine.step()
        print(f"step {time.perf_counter() - start:.2f} s: {log}")


if __name__ == "__main__":
    main()
