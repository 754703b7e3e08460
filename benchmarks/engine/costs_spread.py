"""Time the policy's costs N times back to back on the embedded pair and estimate each timing both ways
from the same forwards: `Costs.measure` (each cost a ratio within a round, its median over the rounds) and
the estimator it replaced (each width's fastest forward over all rounds, then their ratio).

    python -m benchmarks.engine.costs_spread --timings 10 --out DIR

DIR gets timings.json (every round's forward seconds) and prints one line per timing.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from fly_llm.common.config import ModelSpec
from fly_llm.decoding import policy
from fly_llm.decoding.policy import _DRAFT_WIDTHS, _PREFILL_WIDTH, _TIMED_WIDTHS, Costs, _relative
from fly_llm.model.kernels.cpu import cpu_model
from fly_llm.model.pair import load_models


def fastest_forwards_ratio(rounds: list[list[float]]) -> dict[str, float]:
    """The replaced estimator: each forward's fastest time over the rounds, over the target's fastest one-token."""
    fastest = [min(column) for column in zip(*rounds)]
    target, draft = fastest[:len(_TIMED_WIDTHS)], fastest[len(_TIMED_WIDTHS):]
    return {**{f"c{w}": cost for w, cost in _relative(_TIMED_WIDTHS, target)}, "step": draft[0] / target[0]}


def median_ratio(costs: Costs) -> dict[str, float]:
    """The same figures from `Costs.measure`'s result."""
    return {**{f"c{w}": costs.target(w) for w in _TIMED_WIDTHS[1:]}, "step": costs.of("draft_model").step}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--timings", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_models(ModelSpec(), progress=False)
    timed_forwards = policy._forward_seconds
    rounds: list[list[float]] = []

    def recording(model, context, widths, repeats):
        seconds = timed_forwards(model, context, widths, repeats)
        if model is loaded.target:
            rounds.append(list(seconds))
        else:
            rounds[-1].extend(seconds)
        return seconds

    policy._forward_seconds = recording
    timings = []
    for i in range(args.timings):
        rounds.clear()
        started = time.strftime("%H:%M:%S")
        median = median_ratio(Costs.measure(loaded.target, loaded.draft))
        fastest = fastest_forwards_ratio(rounds)
        timings.append({"started": started, "rounds": [list(r) for r in rounds], "median_ratio": median,
                        "fastest_forwards_ratio": fastest})
        print(f"{started} median ratio: " + " ".join(f"{k}={v:.3f}" for k, v in median.items())
              + " | fastest forwards: " + " ".join(f"{k}={v:.3f}" for k, v in fastest.items()), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"widths": {"target": _TIMED_WIDTHS, "draft": [*_DRAFT_WIDTHS, _PREFILL_WIDTH]},
              "machine": cpu_model(), "threads": args.threads, "timings": timings}
    (args.out / "timings.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
