"""This tree's adaptive policy against a base commit's, side by side on the same loaded pair (issue 44).

Both policies get the same fixed costs (a kept policy-costs file: the costs decide whether the draft model
runs, and a timing at start would differ between two processes), or with `--base-costs` each its own (a
change to how the costs are timed: both files from one timing), FLy's default settings, and the engine
without drafters as the reference; the three take turns item by item, the order rotating, so a slow
minute of the machine falls on all of them:

    python -m benchmarks.engine.policy_ab --base 1a03646 --costs COSTS.json --dataset prose --limit 10 \\
        --max-tokens 128 --rounds 2 --threads 2 --out DIR

DIR gets rows.jsonl (every answer) and results.md: per method the paired decode tok/s ratio to the
engine without drafters (median and geometric mean over the answers of more than 8 tokens, with a
bootstrap 95% interval of the geometric mean), its time for all the answers end to end over the engine
without drafters' (short answers included, prefill and a first probe's catch-up too) and the rounds that
ran the draft model.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.at_commit import module_at
from benchmarks.harness.methods import Method, Runner
from fly_llm.common.config import FLyConfig
from fly_llm.decoding import policy as policy_here

POLICY_PATH = "fly_llm/decoding/policy.py"
PLAIN = Method("plain", "the engine without drafters", "engine", fly=FLyConfig(recent_answers=0, stages=()))
FLY = Method("fly", "FLy's defaults", "engine", fly=FLyConfig(recent_answers=0))
MIN_TOKENS = 8  # answers this short are mostly their first round: no decode speed to compare


def read_costs(path: Path) -> dict[str, Any]:
    """The costs of a kept policy-costs file (fly_llm.policy_costs) or of a results directory's policy_costs.json."""
    data = json.loads(path.read_text(encoding="utf-8"))
    return data.get("costs", data)


def paired_ratios(rows: list[dict[str, Any]], method: str) -> list[float]:
    """Per answer of `method`: its decode tok/s over the same item's and round's engine without drafters."""
    plain = {(r["round"], r["item"]): r for r in rows if r["method"] == PLAIN.name}
    ratios = []
    for r in rows:
        p = plain[(r["round"], r["item"])]
        if r["method"] == method and min(r["tokens"], p["tokens"]) > MIN_TOKENS:
            ratios.append((r["tokens"] / r["decode_s"]) / (p["tokens"] / p["decode_s"]))
    return ratios


def geometric_interval(ratios: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Bootstrap 95% interval of the geometric mean."""
    rng = random.Random(seed)
    means = sorted(statistics.geometric_mean(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return means[int(0.025 * draws)], means[int(0.975 * draws) - 1]


def report(rows: list[dict[str, Any]], methods: list[str], header: list[str]) -> str:
    """results.md: the paired ratios and the draft model's rounds per method."""
    lines = [*header, "", "| method | decode ÷ no drafters, median | geometric mean [95%] | answers | "
             "all answers' time ÷ no drafters' | draft-model rounds | n-gram rounds | answers equal to no drafters' |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    plain = {(r["round"], r["item"]): r["ids"] for r in rows if r["method"] == PLAIN.name}
    plain_seconds = sum(r["seconds"] for r in rows if r["method"] == PLAIN.name)
    for method in methods:
        ratios = paired_ratios(rows, method)
        mine = [r for r in rows if r["method"] == method]
        low, high = geometric_interval(ratios)
        equal = sum(r["ids"] == plain[(r["round"], r["item"])] for r in mine)
        lines.append(f"| {method} | {statistics.median(ratios):.3f} | {statistics.geometric_mean(ratios):.3f} "
                     f"[{low:.3f}, {high:.3f}] | {len(ratios)} | {sum(r['seconds'] for r in mine) / plain_seconds:.3f} | "
                     f"{sum(r['model_rounds'] for r in mine)} | "
                     f"{sum(r['ngram_rounds'] for r in mine)} | {equal} / {len(mine)} |")
    return "\n".join(lines) + "\n"


def ab_parser(description: str, limit: int, rounds: int) -> argparse.ArgumentParser:
    """The options every policy A/B script takes: the base commit, the kept costs, the items and the run."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--base", required=True, help="the commit whose policy.py is compared with this tree's")
    p.add_argument("--costs", type=Path, required=True, help="a kept policy-costs file (every policy uses it)")
    p.add_argument("--dataset", default="prose")
    p.add_argument("--limit", type=int, default=limit)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    from benchmarks.harness.cli import encode
    from benchmarks.harness.datasets import load
    from fly_llm.common.config import ModelSpec
    from fly_llm.model.pair import load_models

    p = ab_parser(__doc__.split("\n\n")[0], limit=10, rounds=2)
    p.add_argument("--base-costs", type=Path, help="the base policy's own costs file instead (default: --costs)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = module_at(args.base, POLICY_PATH)
    costs = read_costs(args.costs)
    base_costs = read_costs(args.base_costs) if args.base_costs else costs
    policies = {f"fly at {args.base}": base.AdaptivePolicy(base.Costs.from_dict(base_costs)),
                "fly here": policy_here.AdaptivePolicy(policy_here.Costs.from_dict(costs))}
    models = load_models(ModelSpec())
    runner = Runner(models.target, models.tokenizer, models.draft, args.max_tokens, models.context_window,
                    policy=policies["fly here"])
    prompts = [encode(models.tokenizer, item) for item in load(args.dataset, args.limit)]
    turns = [(PLAIN.name, PLAIN, None), *((name, FLY, policy) for name, policy in policies.items())]
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with (args.out / "rows.jsonl").open("w", encoding="utf-8") as sink:
        for round_ in range(args.rounds):
            for item, prompt in enumerate(prompts):
                shift = (item + round_) % len(turns)
                for name, method, policy in turns[shift:] + turns[:shift]:
                    runner.engine.policy = policy or policies["fly here"]
                    run = runner.run(method, prompt, args.max_tokens)
                    stats = run.stats
                    rows.append({"round": round_, "item": item, "method": name, "tokens": len(run.token_ids),
                                 "seconds": run.seconds, "decode_s": run.seconds - run.ttft,
                                 "model_rounds": stats.draft_model_rounds, "ngram_rounds": stats.ngram_rounds,
                                 "ids": run.token_ids})
                    sink.write(json.dumps(rows[-1]) + "\n")
                    sink.flush()
    command = " ".join(["python -m benchmarks.engine.policy_ab", *(argv or sys.argv[1:])])
    header = [f"# Policy A/B: this tree against {args.base} ({args.dataset}, {len(prompts)} items × "
              f"{args.max_tokens} tokens, {args.rounds} rounds, {args.threads} threads)", "",
              f"Costs from {args.costs}: {json.dumps(costs)}",
              *(["", f"The base's costs from {args.base_costs}: {json.dumps(base_costs)}"] if args.base_costs else []),
              "", f"    {command}"]
    text = report(rows, list(policies), header)
    (args.out / "results.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
