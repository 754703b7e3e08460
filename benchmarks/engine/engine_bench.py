"""Engine speed in one process on the same prompts: target-only greedy vs exact SPD vs FLy.

    python benchmarks/engine/engine_bench.py                       # tiny random pair (tests/support/tiny_models.py)
    python benchmarks/engine/engine_bench.py --target DIR --draft DIR --max-tokens 128
    python benchmarks/engine/engine_bench.py --target embedded --threads 2   # the embedded default pair

Prints tokens/s, the ratio to target-only decoding, MAT (tokens per target forward), the loose
accept rate, the share of rounds that ran the draft model / drafted nothing (the adaptive
policy's choices), and the share of wall time spent outside model forwards (the engine's own
Python and tensor bookkeeping). On a shared CPU pass --threads 1: oversubscribed threads make
every forward many times slower. Each method runs the prompts one at a time (batch 1) and, with --batch,
all together in one batch as well.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.harness.prompts import PROMPTS
from fly_llm.common.config import FLyConfig, ModelSpec, SamplingParams
from fly_llm.decoding.engine import FLyEngine
from fly_llm.decoding.policy import AdaptivePolicy, Costs
from fly_llm.loading import load_engine

METHODS: dict[str, FLyConfig | None] = {
    "target-only": FLyConfig(ngram=False, draft_model=False, adaptive=False),
    "spd-exact-k15": FLyConfig(loose=False, adaptive=False),
    "spd-exact-adaptive": FLyConfig(loose=False),
    "fly-k15": FLyConfig(adaptive=False),
    "fly-adaptive": FLyConfig(),
}


class ForwardTimer:
    """Accumulates wall time spent inside the forward calls of some modules."""

    def __init__(self, models, device: torch.device) -> None:
        self.total = 0.0
        self._start = 0.0
        self._sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        for model in models:
            model.register_forward_pre_hook(self._pre)
            model.register_forward_hook(self._post)

    def _pre(self, *_):
        self._sync()
        self._start = time.perf_counter()

    def _post(self, *_):
        self._sync()
        self.total += time.perf_counter() - self._start


@dataclass
class Result:
    name: str
    tokens: int
    seconds: float
    forward_seconds: float
    mat: float
    loose_rate: float
    model_share: float  # rounds that ran the draft model
    plain_share: float  # rounds that drafted nothing
    token_ids: list[list[int]]


def run(engine: FLyEngine, timer: ForwardTimer, name: str, fly: FLyConfig, prompts: list[str],
        max_tokens: int, batch: bool) -> Result:
    """Generate for every prompt with one method; time it and its model forwards."""
    sampling = SamplingParams(max_tokens=max_tokens)
    engine.stats = type(engine.stats)()
    timer.total = 0.0
    start = time.perf_counter()
    gens = engine.generate(prompts, sampling, fly) if batch else [engine.generate(p, sampling, fly)[0]
                                                                  for p in prompts]
    seconds = time.perf_counter() - start
    stats = engine.stats
    rounds = max(stats.rounds, 1)
    return Result(name, sum(g.completion_tokens for g in gens), seconds, timer.total, stats.mat, stats.loose_rate,
                  stats.draft_model_rounds / rounds, stats.plain_rounds / rounds, [g.token_ids for g in gens])


def load(args) -> FLyEngine:
    """The engine on the given models (`--target embedded`: the embedded default pair), or on the tiny random
    pair of the tests."""
    if args.target == "embedded":
        return load_engine(ModelSpec(dtype=args.dtype, device=args.device))
    if args.target:
        return load_engine(ModelSpec(target=args.target, draft=args.draft, dtype=args.dtype, device=args.device))
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from support.tiny_models import make_pair

    target, draft, tokenizer = make_pair("llama")
    return FLyEngine(target, tokenizer, draft)


def main(argv: list[str] | None = None) -> None:
    """Run every method on the same prompts and print the comparison."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="target model dir / HF id, or 'embedded' for the embedded default pair "
                   "(default: the tiny random pair)")
    p.add_argument("--draft", help="draft model dir / HF id ('none' = n-gram only)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the built-in prompts")
    p.add_argument("--batch", action="store_true", help="also run all prompts in one batch")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--measure-costs", action="store_true",
                   help="time the models first and give the adaptive policy those costs (default: CPU defaults)")
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS),
                   help="methods to run; the first is the reference for ratios")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = load(args)
    if args.measure_costs:
        engine.policy = AdaptivePolicy(Costs.measure(engine.target, engine.draft))
        print(f"measured costs: {engine.policy.costs}")
    timer = ForwardTimer([m for m in (engine.target, engine.draft) if m is not None], engine.device)
    prompts = PROMPTS[:args.prompts]
    engine.generate(prompts[0], SamplingParams(max_tokens=4))  # warm-up
    modes = [False, True] if args.batch else [False]
    print(f"target={engine.target_name} draft={engine.draft_name} device={engine.device} dtype={engine.dtype} "
          f"prompts={len(prompts)} max_tokens={args.max_tokens}")
    print(f"{'method':<22}{'batch':>6}{'tokens':>8}{'tok/s':>9}{'ratio':>7}{'MAT':>6}{'loose':>7}"
          f"{'model':>7}{'plain':>7}{'outside fwd':>12}{'same as target':>16}")
    for batch in modes:
        base = None
        for name in args.methods:
            r = run(engine, timer, name, METHODS[name], prompts, args.max_tokens, batch)
            base = base or r
            speed = r.tokens / r.seconds
            ratio = speed / (base.tokens / base.seconds)
            outside = 1 - r.forward_seconds / r.seconds
            same = sum(a == b for a, b in zip(r.token_ids, base.token_ids))
            print(f"{name:<22}{len(prompts) if batch else 1:>6}{r.tokens:>8}{speed:>9.1f}{ratio:>7.2f}{r.mat:>6.2f}"
                  f"{r.loose_rate:>7.2f}{r.model_share:>7.0%}{r.plain_share:>7.0%}{outside:>11.1%}"
                  f"{same:>9}/{len(prompts)}")


if __name__ == "__main__":
    main()
