"""Where FLy's time goes against plain decoding, round by round: each engine round of FLy on a few items,
timed, with the policy's plan (plain, n-gram, draft model, probe), the draft's catch-up backlog and the
round's outcome; the same items decoded by the engine with no drafters for comparison (issue 34):

    python -m benchmarks.engine.policy_trace --dataset prose --items mt_bench/86 mt_bench/156 --max-tokens 128 \
        --threads 2 --out benchmarks/results/cpu-floor/policy-trace.md

A round's extra time is its time minus the median plain round of the same answer; its extra tokens are the
draft tokens it kept. Rounds that emit fewer extra tokens than their extra time buys plain steps are losses.
The first round of an answer also prefills its prompt and is shown apart.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.methods import Method, Runner, all_methods
from fly_llm.common.config import FLyConfig
from fly_llm.decoding.policy import AdaptivePolicy

PLAIN_ENGINE = Method("engine-plain", "our engine, no drafters", "engine", fly=FLyConfig(stages=()))


@dataclass
class Round:
    """One engine round of one request: what the policy planned and what came of it."""

    kind: str  # 'plain', 'ngram', 'model' or 'probe'
    k: int
    behind: int  # context tokens the draft cache lacked before the round
    accepted: int = 0
    forwards: int = 0
    seconds: float = 0.0


def trace(runner: Runner, method: Method, prompt_ids: list[int], max_tokens: int) -> tuple[list[Round], Any]:
    """Decode `prompt_ids` alone with `method` (an engine method) and return its rounds and the run."""
    engine = runner.engine
    policy: AdaptivePolicy = engine.policy
    rounds: list[Round] = []
    plan, observe, step = policy.plan, policy.observe, engine.step

    def planned(state, *args, **kwargs):
        chosen = plan(state, *args, **kwargs)
        probing = any(h.probing for h in state.models.values())
        kind = "plain" if not chosen.k else ("probe" if probing else "model") if chosen.model else "ngram"
        rounds.append(Round(kind, chosen.k, sum(state.behind.values()) if chosen.model else 0))
        return chosen

    def observed(state, chosen, drafted, accepted, forwards=0, **kwargs):
        rounds[-1].accepted, rounds[-1].forwards = accepted, forwards
        return observe(state, chosen, drafted, accepted, forwards, **kwargs)

    def timed():
        start, count = time.perf_counter(), len(rounds)
        outputs = step()
        if len(rounds) > count:
            rounds[-1].seconds = time.perf_counter() - start
        return outputs

    policy.plan, policy.observe, engine.step = planned, observed, timed
    try:
        run = runner.run(method, prompt_ids, max_tokens)
    finally:
        del policy.plan, policy.observe, engine.step  # back to the class's methods
    return rounds, run


def summary(rounds: list[Round]) -> dict[str, tuple[int, float, int]]:
    """Per kind of round after the first: (rounds, extra ms over the median plain round, extra tokens);
    empty for an answer of one round."""
    later = rounds[1:]
    if not later:
        return {}
    plain = [r.seconds for r in later if r.kind == "plain"] or [min(r.seconds for r in later)]
    base = statistics.median(plain)
    kinds: dict[str, tuple[int, float, int]] = {}
    for r in later:
        n, ms, tokens = kinds.get(r.kind, (0, 0.0, 0))
        kinds[r.kind] = (n + 1, ms + 1000 * (r.seconds - base), tokens + r.accepted)
    return {"base_ms": (len(plain), 1000 * base, 0), **kinds}


def main(argv: list[str] | None = None) -> int:
    from benchmarks.harness.cli import encode
    from benchmarks.harness.datasets import load
    from fly_llm.common.config import ModelSpec
    from fly_llm.model.embedded import ensure_default_pair
    from fly_llm.model.pair import load_models

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="prose")
    p.add_argument("--items", nargs="+", required=True, help="item ids of the dataset")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target_dir, draft_dir = ensure_default_pair(progress=False)
    models = load_models(ModelSpec(target=str(target_dir), draft=str(draft_dir), dtype="auto"), progress=False)
    runner = Runner(models.target, models.tokenizer, models.draft, args.max_tokens, models.context_window)
    items = [item for item in load(args.dataset) if item.item_id in args.items]
    fly = all_methods()["fly"]
    lines = [f"# FLy round by round ({args.dataset}, {args.max_tokens} tokens, {args.threads} threads)", "",
             f"Costs: {runner.engine.policy.costs}", ""]
    for item in items:
        prompt = encode(models.tokenizer, item)
        runner.run(fly, prompt, 4)  # warm
        rounds, run = trace(runner, fly, prompt, args.max_tokens)
        plain = runner.run(PLAIN_ENGINE, prompt, args.max_tokens)
        lines += [f"## {item.item_id}: FLy {run.seconds:.2f} s, engine without drafters {plain.seconds:.2f} s, "
                  f"{len(run.token_ids)} tokens, {len(rounds)} rounds (first, with the prompt's prefill: "
                  f"{1000 * rounds[0].seconds:.0f} ms)", "",
                  "| kind | rounds | extra ms over plain rounds | extra tokens |", "|---|---:|---:|---:|"]
        for kind, (n, ms, tokens) in summary(rounds).items():
            lines.append(f"| {kind} | {n} | {ms:.0f} | {tokens} |" if kind != "base_ms"
                         else f"| plain round median | {n} | {ms:.1f} ms each | – |")
        lines += ["", "Drafting rounds: " + "; ".join(
            f"r{i} {r.kind} k={r.k} behind={r.behind} kept={r.accepted} fw={r.forwards} {1000 * r.seconds:.0f} ms"
            for i, r in enumerate(rounds) if r.kind != "plain"), ""]
        print("\n".join(lines[-8:]), flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
