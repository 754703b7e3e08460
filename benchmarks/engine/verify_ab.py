"""This tree's `verify` against a commit's, for sampling rows (what drawing the target's tokens costs a round).

Logits of the shape a round gives (B rows, K+1 positions, the vocabulary), every row sampling at temperature
0.8, drafts the greedy choice; the two versions take turns call by call, on the same tensors:

    python -m benchmarks.engine.verify_ab --base 1a03646 --vocab 151936 --k 6 --batches 1 4 \
        --top-ps 1.0 0.9 --calls 15 --threads 2 --out DIR

Each sampling row gets a seed: an integer where this tree's `RowSampling` takes seeds, a seeded
`torch.Generator` where the base's takes generators (before 2a5534a). DIR/results.md: the median ms per call.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
import types
from pathlib import Path

import torch

from benchmarks.harness.at_commit import module_at
from fly_llm.common.config import FLyConfig
from fly_llm.decoding import verify as verify_here

VERIFY_PATH = "fly_llm/decoding/verify.py"
TEMPERATURE = 0.8


def sampling_of(module: types.ModuleType, rows: int, top_p: float):
    """`module`'s RowSampling for `rows` sampling rows, seeded 0..rows-1 in whichever form it takes."""
    seeded = "seeds" in inspect.signature(module.RowSampling).parameters
    seeds = list(range(rows)) if seeded else [torch.Generator().manual_seed(s) for s in range(rows)]
    return module.RowSampling(torch.full((rows,), TEMPERATURE), torch.full((rows,), top_p), seeds)


def median_ms(calls: dict[str, types.FunctionType], count: int) -> dict[str, float]:
    """Each call `count` times, taking turns; the median ms of each."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(count):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: 1000 * statistics.median(seconds) for name, seconds in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the commit whose verify.py is compared with this tree's")
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--k", type=int, default=6, help="draft tokens per row (K+1 positions)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--top-ps", type=float, nargs="+", default=[1.0, 0.9])
    p.add_argument("--calls", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = module_at(args.base, VERIFY_PATH)
    versions = {f"at {args.base}": base, "here": verify_here}
    lines = [f"# verify with sampling rows: this tree against {args.base}", "",
             "    " + " ".join(["python -m benchmarks.engine.verify_ab", *(argv or sys.argv[1:])]), "",
             f"Vocabulary {args.vocab}, K {args.k}, temperature {TEMPERATURE}, {args.threads} threads; median ms "
             f"per call of {args.calls}, the versions taking turns.", "",
             "| rows | top_p | " + " | ".join(versions) + " |", "|---:|---:|" + "---:|" * len(versions)]
    torch.manual_seed(0)
    for rows in args.batches:
        for top_p in args.top_ps:
            logits = torch.randn(rows, args.k + 1, args.vocab) * 3
            drafts = logits[:, :args.k].argmax(-1)
            lengths = torch.full((rows,), args.k)
            calls = {}
            for name, module in versions.items():
                rules = module.RowRules.from_configs([FLyConfig(loose=False)] * rows, "cpu")
                sampling = sampling_of(module, rows, top_p)
                calls[name] = (lambda m=module, r=rules, s=sampling: m.verify(drafts, logits, lengths, r, s))
            ms = median_ms(calls, args.calls)
            lines.append(f"| {rows} | {top_p} | " + " | ".join(f"{ms[name]:.2f}" for name in versions) + " |")
            print(lines[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
