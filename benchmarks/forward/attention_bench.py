"""The row attention op against a baseline source, side by side and bit for bit (issue 34, long contexts):
the embedded target's attention shape (12 query heads over 2 kv heads of 128, bfloat16) at a few
context lengths and query counts (1: a decode step; 4-16: a verify), for one layer.
    git show 78cb4a5:fly_llm/model/kernels/row_attention.cpp > /tmp/row_attention_base.cpp
    python -m benchmarks.forward.attention_bench --baseline /tmp/row_attention_base.cpp --threads 2 --forwards \
        --out benchmarks/results/step/attention-long-context.md
The baseline is compiled as an extension of its own and the two run alternately, call by call, on the
same inputs; their outputs must be equal (checked with and without a mask with holes) or the run stops.
Without --baseline only the current op is timed. With --forwards (and a baseline) whole forwards of the
embedded target (w4a8) are compared too, the op swapped forward by forward, logits equal every time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from benchmarks.harness.environment import cpu_name
from benchmarks.forward.step_profile import load_embedded_pair, write_report
from fly_llm.decoding.cache import BatchKV
from fly_llm.model.kernels.build import compile_extension
from fly_llm.model.kernels import row_attention as current

HEADS, KV_HEADS, DIM, LAYERS = 12, 2, 128, 28  # the embedded target's attention
Op = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float], torch.Tensor]


def build_baseline(source: Path) -> ModuleType:
    """The row attention extension compiled from `source` under another name (row_attention_baseline)."""
    directory = Path(tempfile.mkdtemp(prefix="row-attention-baseline-"))
    copy = directory / "row_attention_baseline.cpp"
    copy.write_text(source.read_text(encoding="utf-8"), encoding="utf-8")
    return compile_extension("row_attention_baseline", copy, directory)


def inputs(context: int, queries: int) -> tuple[torch.Tensor, ...]:
    """Query, key, value and a causal mask with a hole (rejected drafts) a third of the way in."""
    generator = torch.Generator().manual_seed(context * 100 + queries)
    q = torch.randn(1, HEADS, queries, DIM, generator=generator).bfloat16()
    k, v = (torch.randn(1, KV_HEADS, context, DIM, generator=generator).bfloat16() for _ in range(2))
    mask = torch.ones(1, queries, context, dtype=torch.bool).tril(context - queries)
    mask[0, :, context // 3:context // 3 + 7] = False
    return q, k, v, mask


def alternate(calls: dict[str, Callable[[], torch.Tensor]], rounds: int, differ: str) -> dict[str, float]:
    """Median seconds of each call over `rounds` rounds after a warm-up one, their order reversed every
    other round; stops with the message `differ` if their outputs ever differ (rounds 0: only that check)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(rounds + 1):
        outputs = []
        for name in (list(calls) if r % 2 else reversed(list(calls))):
            start = time.perf_counter()
            outputs.append(calls[name]())
            if r:
                times[name].append(time.perf_counter() - start)
        if not all(torch.equal(outputs[0], out) for out in outputs[1:]):
            raise SystemExit(differ)
    return {name: statistics.median(t) for name, t in times.items()} if rounds else {}


def compare(ops: dict[str, Op], context: int, queries: int, rounds: int) -> dict[str, float]:
    """Median µs per call of each op, alternating call by call; stops if any output differs (with and without
    a mask with holes)."""
    q, k, v, mask = inputs(context, queries)
    differ = f"the ops differ at context {context}, {queries} queries"
    alternate({name: lambda op=op: op(q, k, v, mask, DIM ** -0.5) for name, op in ops.items()}, 0, differ)
    calls = {name: lambda op=op: op(q, k, v, None, DIM ** -0.5) for name, op in ops.items()}
    return {name: seconds * 1e6 for name, seconds in alternate(calls, rounds, differ).items()}


def compare_forwards(baseline: ModuleType, contexts: list[int], widths: list[int], rounds: int) -> list[str]:
    """Rows of ms per target forward over each width after each context, with the current op and the
    baseline's (swapped in as `row_attention._ops`), alternating; stops if the logits ever differ."""
    target = load_embedded_pair("auto", torch.get_num_threads()).target
    original = current._ops
    modules = {"current": original(), "baseline": baseline}
    rows = []
    try:
        for context in contexts:
            kv = BatchKV.prefill(target, list(range(context)), torch.device("cpu"))
            for width in widths:
                median = _forward_medians(target, kv, context, width, modules, rounds)
                rows.append(f"| {context} | {width} | {median['current']:.1f} | {median['baseline']:.1f} | "
                            f"{median['current'] / median['baseline']:.3f} |")
                print(rows[-1], flush=True)
    finally:
        current._ops = original
    return rows


def _forward_medians(target, kv: BatchKV, context: int, width: int, modules: dict[str, ModuleType],
                     rounds: int) -> dict[str, float]:
    """Median ms of a forward over `width` new tokens with each op module, alternating, logits equal."""
    tokens = torch.arange(width)[None]

    def forward(module: ModuleType) -> torch.Tensor:
        current._ops = lambda: module  # what row_attention.attention() calls
        logits = kv.forward(target, tokens, logits_to_keep=width)
        kv.truncate([context])
        return logits

    calls = {name: lambda module=module: forward(module) for name, module in modules.items()}
    medians = alternate(calls, rounds, f"the target's logits differ at context {context}, width {width}")
    return {name: seconds * 1000 for name, seconds in medians.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", type=Path, help="a row_attention.cpp to compare with")
    p.add_argument("--contexts", type=int, nargs="+", default=[300, 1500, 3000])
    p.add_argument("--queries", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--forwards", action="store_true", help="also whole target forwards (loads the embedded pair)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not current.available():
        print("the row attention op cannot be built or run here", file=sys.stderr)
        return 1
    ops: dict[str, Op] = {"current": current.attention}
    baseline = build_baseline(args.baseline) if args.baseline else None
    if baseline is not None:
        ops["baseline"] = lambda q, k, v, mask, scale: baseline.attention(q, k, v, mask, scale, True)
    names = list(ops)
    lines = [f"# Row attention, {HEADS} heads over {KV_HEADS} kv heads of {DIM}, bfloat16, one layer",
             "", f"`python -m benchmarks.forward.attention_bench {' '.join(argv if argv is not None else sys.argv[1:])}`",
             f"({cpu_name()}, {args.threads} threads, {args.rounds} calls each, alternating; outputs equal)", "",
             "| context | queries | " + " | ".join(f"{n} µs" for n in names) + " |"
             + (f" current / baseline | {LAYERS} layers saved |" if args.baseline else ""),
             "|---:|---:|" + "---:|" * len(names) + ("---:|---:|" if args.baseline else "")]
    for context in args.contexts:
        for queries in args.queries:
            median = compare(ops, context, queries, args.rounds)
            row = f"| {context} | {queries} | " + " | ".join(f"{median[n]:.1f}" for n in names) + " |"
            if args.baseline:
                saved = LAYERS * (median["baseline"] - median["current"]) / 1000
                row += f" {median['current'] / median['baseline']:.2f} | {saved:+.2f} ms |"
            lines.append(row)
            print(row, flush=True)
    if args.forwards and baseline is not None:
        lines += ["", f"Whole forwards of the embedded target (w4a8), {args.rounds} each, alternating; logits equal:", "",
                  "| context | new tokens | current ms | baseline ms | current / baseline |", "|---:|---:|---:|---:|---:|"]
        lines += compare_forwards(baseline, args.contexts, args.queries, args.rounds)
    write_report("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
