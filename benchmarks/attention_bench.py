"""The row attention op against a baseline source, side by side and bit for bit (issue 34, long contexts):
the embedded target's attention shape (12 query heads over 2 kv heads of 128, bfloat16) at a few
context lengths and query counts (1: a decode step; 4-16: a verify), for one layer.
    git show 78cb4a5:fly_llm/model/kernels/row_attention.cpp > /tmp/row_attention_base.cpp
    python -m benchmarks.attention_bench --baseline /tmp/row_attention_base.cpp --threads 2 \
        --out benchmarks/results/step/attention-long-context.md
The baseline is compiled as an extension of its own and the two run alternately, call by call, on the
same inputs; their outputs must be equal (checked with and without a mask with holes) or the run stops.
Without --baseline only the current op is timed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from benchmarks.kernel_bench import cpu_name
from benchmarks.step_profile import write_report
from fly_llm.model.kernels import build
from fly_llm.model.kernels import row_attention as current

HEADS, KV_HEADS, DIM = 12, 2, 128  # the embedded target's attention
Op = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float], torch.Tensor]


def baseline_op(source: Path) -> Op:
    """The row attention op compiled from `source` under another extension name."""
    directory = Path(tempfile.mkdtemp(prefix="row-attention-baseline-"))
    copy = directory / "row_attention_baseline.cpp"
    copy.write_text(source.read_text(encoding="utf-8"), encoding="utf-8")
    module = load(name="row_attention_baseline", sources=[str(copy)], extra_cflags=build._FLAGS,
                  extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=False)
    return lambda q, k, v, mask, scale: module.attention(q, k, v, mask, scale, True)


def inputs(context: int, queries: int) -> tuple[torch.Tensor, ...]:
    """Query, key, value and a causal mask with a hole (rejected drafts) a third of the way in."""
    generator = torch.Generator().manual_seed(context * 100 + queries)
    q = torch.randn(1, HEADS, queries, DIM, generator=generator).bfloat16()
    k, v = (torch.randn(1, KV_HEADS, context, DIM, generator=generator).bfloat16() for _ in range(2))
    mask = torch.ones(1, queries, context, dtype=torch.bool).tril(context - queries)
    mask[0, :, context // 3:context // 3 + 7] = False
    return q, k, v, mask


def compare(ops: dict[str, Op], context: int, queries: int, rounds: int) -> dict[str, float]:
    """Median µs per call of each op, alternating call by call; stops if any output differs."""
    q, k, v, mask = inputs(context, queries)
    for m in (None, mask):
        outs = [op(q, k, v, m, DIM ** -0.5) for op in ops.values()]
        if not all(torch.equal(outs[0], out) for out in outs[1:]):
            raise SystemExit(f"the ops differ at context {context}, {queries} queries")
    times: dict[str, list[float]] = {name: [] for name in ops}
    for r in range(rounds):
        for name in (list(ops) if r % 2 else reversed(list(ops))):
            start = time.perf_counter()
            ops[name](q, k, v, None, DIM ** -0.5)
            times[name].append((time.perf_counter() - start) * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", type=Path, help="a row_attention.cpp to compare with")
    p.add_argument("--contexts", type=int, nargs="+", default=[300, 1500, 3000])
    p.add_argument("--queries", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not current.available():
        print("the row attention op cannot be built or run here", file=sys.stderr)
        return 1
    ops: dict[str, Op] = {"current": current.attention}
    if args.baseline:
        ops["baseline"] = baseline_op(args.baseline)
    names = list(ops)
    lines = [f"# Row attention, {HEADS} heads over {KV_HEADS} kv heads of {DIM}, bfloat16, one layer",
             "", f"`python -m benchmarks.attention_bench {' '.join(argv if argv is not None else sys.argv[1:])}`",
             f"({cpu_name()}, {args.threads} threads, {args.rounds} calls each, alternating; outputs equal)", "",
             "| context | queries | " + " | ".join(f"{n} µs" for n in names) + " |"
             + (" current / baseline | 28 layers saved |" if args.baseline else ""),
             "|---:|---:|" + "---:|" * len(names) + ("---:|---:|" if args.baseline else "")]
    for context in args.contexts:
        for queries in args.queries:
            median = compare(ops, context, queries, args.rounds)
            row = f"| {context} | {queries} | " + " | ".join(f"{median[n]:.1f}" for n in names) + " |"
            if args.baseline:
                saved = 28 * (median["baseline"] - median["current"]) / 1000
                row += f" {median['current'] / median['baseline']:.2f} | {saved:+.2f} ms |"
            lines.append(row)
            print(row, flush=True)
    write_report("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
