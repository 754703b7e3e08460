"""The embedded pair's forwards with their w4a8 weights in 2 MiB pages (fly_llm.model.huge_pages) vs in
ordinary 4 KiB pages, on the same loaded models, taking turns:

    python benchmarks/forward/huge_pages_bench.py --threads 2 --rounds 4 --out benchmarks/results/kernel/huge-pages

Each round moves every packed weight into ordinary pages (a plain copy), times forwards over w new tokens
after a cached prompt (engine KV path, fastest of --reps), moves them back into huge pages and times again.
The figure per placement is the best of its rounds (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.harness.environment import cpu_name
from fly_llm.common.config import ModelSpec
from fly_llm.decoding.policy import _forward_seconds
from fly_llm.model.embedded import ensure_default_pair
from fly_llm.model.huge_pages import in_huge_pages
from fly_llm.model.pair import load_models
from fly_llm.model.quantization import place_packed

WIDTHS = (1, 4, 16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, draft = ensure_default_pair(progress=False)
    loaded = load_models(ModelSpec(target=str(target), draft=str(draft), dtype="auto"), progress=False)
    placements = {"4 KiB pages": lambda t: t.clone(), "2 MiB pages": in_huge_pages}
    best: dict[str, list[float]] = {}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for label, where in placements.items():
                for role, model in (("target", loaded.target), ("draft", loaded.draft)):
                    place_packed(model, where)
                    seconds = _forward_seconds(model, args.context, WIDTHS, args.reps)
                    key = f"{role}|{label}"
                    best[key] = [min(a, b) for a, b in zip(best.get(key, seconds), seconds)]
    result = {"cpu": cpu_name(), "threads": args.threads, "torch": torch.__version__, "when": time.strftime("%F %T"),
              "quantization": [loaded.target_quantization, loaded.draft_quantization],
              "forward_ms": {key: {w: round(s * 1000, 1) for w, s in zip(WIDTHS, seconds)}
                             for key, seconds in best.items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# w4a8 weights in huge pages ({result['cpu']}, {args.threads} threads, torch {torch.__version__}, "
             f"target {loaded.target_quantization}, draft {loaded.draft_quantization}, {args.context} cached)", "",
             "Forward ms over w new tokens, best of " f"{args.rounds} rounds taking turns.", "",
             "| model | pages | " + " | ".join(f"w={w}" for w in WIDTHS) + " |", "|---|---|" + "---:|" * len(WIDTHS)]
    for key, row in result["forward_ms"].items():
        role, label = key.split("|")
        lines.append(f"| {role} | {label} | " + " | ".join(str(row[w]) for w in WIDTHS) + " |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
