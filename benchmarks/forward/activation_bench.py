"""bfloat16 against float32 activations on the embedded pair, side by side (issue 44, "activations where
they cost answers"): what a decode step (w=1) and a verify (w=16) cost in each, at a short and a RAG-length
context. Both read the same published weights; the activations (residual stream, norms, attention, the KV
cache, logits) are what differs.
    python -m benchmarks.forward.activation_bench --threads 2 --rounds 20 --out benchmarks/results/step/activations.md
The two pairs are loaded side by side and their forwards alternate one by one (benchmarks.forward.published_bench).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from benchmarks.harness.environment import cpu_name
from benchmarks.forward.published_bench import compare
from benchmarks.forward.step_profile import load_embedded_pair, write_report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--widths", type=int, nargs="+", default=[1, 16])
    p.add_argument("--contexts", type=int, nargs="+", default=[300, 1500])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    pairs = {dtype: load_embedded_pair("w4a8", args.threads, dtype) for dtype in ("bfloat16", "float32")}
    lines = [f"# bfloat16 vs float32 activations, side by side ({cpu_name()}, {args.threads} threads, w4a8 "
             f"published weights, {args.rounds} forwards each)", "",
             "| model | cached | w | bfloat16 fastest / median ms | float32 fastest / median ms | float32 cost |",
             "|---|---:|---:|---|---|---:|"]
    with torch.inference_mode():
        for role in ("target", "draft"):
            models = {dtype: getattr(loaded, role) for dtype, loaded in pairs.items()}
            for context in args.contexts:
                for width in args.widths:
                    t, _ = compare(models, context, width, args.rounds)
                    a, b = t["bfloat16"], t["float32"]
                    lines.append(f"| {role} | {context} | {width} | {min(a):.1f} / {statistics.median(a):.1f} | "
                                 f"{min(b):.1f} / {statistics.median(b):.1f} | "
                                 f"{statistics.median(b) / statistics.median(a) - 1:+.1%} |")
    write_report("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
