"""FLy against target-only with 1, 2, 4, 8 requests in flight, side by side on one loaded pair (issue 62).

One engine over the embedded pair serves a set of prompts keeping `c` requests in flight (a new one joins
as one finishes, as a server's batch does), greedy, with each method in turn: the engine without
drafters (target-only), FLy's defaults under a base commit's policy, and FLy's defaults under this tree's.
The order of the methods rotates per concurrency and round, so a slow minute of the machine falls on all
of them; every policy gets the same fixed costs (a kept policy-costs file):

    python -m benchmarks.engine.concurrency_sweep --base c63f1f1 --costs COSTS.json --dataset prose \\
        --limit 16 --max-tokens 128 --concurrency 1 2 4 8 --rounds 1 --threads 2 --out DIR

DIR gets rows.jsonl (one line per method, concurrency and round: tokens, seconds, rounds that ran the
draft model or the n-gram stage) and results.md: aggregate tokens/s per method and concurrency, and
each FLy method's over target-only's of the same round.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine.policy_ab import FLY, PLAIN, POLICY_PATH, ab_parser, read_costs
from benchmarks.harness.at_commit import module_at
from fly_llm.common.config import FLyConfig, SamplingParams
from fly_llm.decoding import policy as policy_here


class RowByRow:
    """A policy from before `plan_round` (a base commit's), planning each row as that commit's engine did:
    its own plan at the batch's size."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy

    def plan_round(self, asks: list[policy_here.RowAsk]) -> list[Any]:
        """Each row's `plan` at the batch's size."""
        return [self.policy.plan(a.state, a.fly, a.budget, len(asks), a.offered) for a in asks]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.policy, name)


def serve(engine: Any, prompts: list[list[int]], in_flight: int, max_tokens: int, fly: FLyConfig) -> dict[str, Any]:
    """Run every prompt through `engine`, `in_flight` at a time; aggregate tokens, seconds and draft rounds."""
    waiting = deque(enumerate(prompts))
    running: set[str] = set()
    tokens = model_rounds = ngram_rounds = drafted = native = loose = 0
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    start = time.perf_counter()
    while waiting or running:
        while waiting and len(running) < in_flight:
            index, prompt = waiting.popleft()
            request_id = f"sweep-{index}"
            engine.add_request(request_id, prompt, sampling, fly)
            running.add(request_id)
        for out in engine.step():
            tokens += len(out.new_token_ids)
            if out.finished:
                running.discard(out.request_id)
                stats = out.stats
                model_rounds, ngram_rounds = model_rounds + stats.draft_model_rounds, ngram_rounds + stats.ngram_rounds
                drafted += stats.drafted
                native, loose = native + stats.accepted_native, loose + stats.accepted_loose
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "model_rounds": model_rounds, "ngram_rounds": ngram_rounds,
            "drafted": drafted, "accepted_native": native, "accepted_loose": loose}


def report(rows: list[dict[str, Any]], methods: list[str], header: list[str]) -> str:
    """results.md: per concurrency, each method's aggregate tokens/s and its ratio to target-only's."""
    lines = [*header, "", "| in flight | method | tok/s (median over rounds) | ÷ target-only (median of paired) | "
             "draft-model rounds | n-gram rounds | drafts kept / drafted | loose share of kept |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for c in sorted({r["in_flight"] for r in rows}):
        plain = {r["round"]: r for r in rows if r["in_flight"] == c and r["method"] == PLAIN.name}
        for method in [PLAIN.name, *methods]:
            mine = [r for r in rows if r["in_flight"] == c and r["method"] == method]
            speeds = [r["tokens"] / r["seconds"] for r in mine]
            ratios = [s / (plain[r["round"]]["tokens"] / plain[r["round"]]["seconds"]) for r, s in zip(mine, speeds)]
            drafted = sum(r["drafted"] for r in mine)
            kept = sum(r["accepted_native"] + r["accepted_loose"] for r in mine)
            loose = sum(r["accepted_loose"] for r in mine)
            lines.append(f"| {c} | {method} | {statistics.median(speeds):.2f} | {statistics.median(ratios):.3f} | "
                         f"{sum(r['model_rounds'] for r in mine)} | {sum(r['ngram_rounds'] for r in mine)} | "
                         f"{kept} / {drafted} | {loose / kept if kept else 0:.1%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from benchmarks.harness.cli import encode
    from benchmarks.harness.datasets import load
    from benchmarks.harness.environment import cpu_name
    from fly_llm.common.config import DRAFT_WEIGHTS, ModelSpec
    from fly_llm.decoding.engine import FLyEngine
    from fly_llm.model.pair import load_models

    p = ab_parser(__doc__.split("\n\n")[0], limit=16, rounds=1)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--draft-weights", choices=list(DRAFT_WEIGHTS), default="published",
                   help="the draft's storage (ModelSpec.draft_weights)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = module_at(args.base, POLICY_PATH)
    costs = read_costs(args.costs)
    based = base.AdaptivePolicy(base.Costs.from_dict(costs))
    policies = {f"fly at {args.base}": based if hasattr(based, "plan_round") else RowByRow(based),
                "fly here": policy_here.AdaptivePolicy(policy_here.Costs.from_dict(costs))}
    models = load_models(ModelSpec(draft_weights=args.draft_weights))
    engine = FLyEngine(models.target, models.tokenizer, models.draft, FLY.fly,
                       context_window=models.context_window)
    prompts = [encode(models.tokenizer, item) for item in load(args.dataset, args.limit)]
    turns = [(PLAIN.name, PLAIN.fly, None), *((name, FLY.fly, policy) for name, policy in policies.items())]
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with (args.out / "rows.jsonl").open("w", encoding="utf-8") as sink:
        for round_ in range(args.rounds):
            for i, in_flight in enumerate(args.concurrency):
                shift = (i + round_) % len(turns)
                for name, fly, policy in turns[shift:] + turns[:shift]:
                    engine.policy = policy or policies["fly here"]
                    row = {"round": round_, "in_flight": in_flight, "method": name,
                           **serve(engine, prompts, in_flight, args.max_tokens, fly)}
                    rows.append(row)
                    sink.write(json.dumps(row) + "\n")
                    sink.flush()
                    print(json.dumps(row), flush=True)
    command = " ".join(["python -m benchmarks.engine.concurrency_sweep", *(argv or sys.argv[1:])])
    header = [f"# Concurrency sweep: this tree's policy against {args.base}'s ({args.dataset}, {len(prompts)} "
              f"prompts × {args.max_tokens} tokens, {args.rounds} round(s), {args.threads} threads, the draft "
              f"{args.draft_weights}, {cpu_name()})",
              "", f"Costs from {args.costs}: {json.dumps(costs)}", "", f"    {command}"]
    text = report(rows, list(policies), header)
    (args.out / "results.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
