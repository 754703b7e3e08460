"""Where a forward's time goes: the embedded target's and draft's forward over w new tokens after a
cached prompt, timed whole, its Linear layers alone at the same width, and a torch.profiler table of
the rest (issue 34, "a lean step"):

    python benchmarks/forward/step_profile.py --widths 1 16 --threads 2 --out benchmarks/results/step/profile.md

Linear layers (any quantized kind) are profiled as one labelled range each ("linear"), so the table
splits a forward into its matmuls and everything else (attention, norms, rotary, KV writes, Python).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.forward.kernel_bench import _LINEAR_TYPES, linears_ms
from benchmarks.harness.environment import cpu_name
from fly_llm.common.config import ModelSpec
from fly_llm.decoding.cache import BatchKV
from fly_llm.model.embedded import ensure_default_pair
from fly_llm.model.pair import LoadedModels, load_models


def forward_ms(model: nn.Module, kv: BatchKV, context: int, width: int, reps: int) -> float:
    """Fastest of `reps` forwards over `width` new tokens after `context` cached ones, in ms."""
    tokens = torch.arange(width)[None]
    best = float("inf")
    for r in range(reps + 1):
        start = time.perf_counter()
        kv.forward(model, tokens, logits_to_keep=width)
        if r:
            best = min(best, time.perf_counter() - start)
        kv.truncate([context])
    return best * 1000


def label_linears(model: nn.Module) -> None:
    """Wrap every Linear layer's forward (and a packed w4a8 layer's `project`, which fused layers call
    directly) in a profiler range named 'linear'."""
    for layer in model.modules():
        if isinstance(layer, _LINEAR_TYPES):
            for name in ("forward", "project"):
                method = getattr(layer, name, None)
                if method is not None:
                    setattr(layer, name, _labelled(method))


def _labelled(method):
    """`method` inside a profiler range named 'linear'."""

    def labelled(*args):
        with torch.profiler.record_function("linear"):
            return method(*args)

    return labelled


def profile_table(model: nn.Module, kv: BatchKV, context: int, width: int, rows: int) -> str:
    """torch.profiler's ops by self CPU time over 5 forwards (profiler overhead included)."""
    tokens = torch.arange(width)[None]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            kv.forward(model, tokens, logits_to_keep=width)
            kv.truncate([context])
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def load_embedded_pair(quantization: str, threads: int, dtype: str = "auto") -> LoadedModels:
    """The embedded pair with both models at `quantization` and `dtype`, torch on `threads` threads."""
    torch.set_num_threads(threads)
    target_dir, draft_dir = ensure_default_pair(progress=False)
    return load_models(ModelSpec(target=str(target_dir), draft=str(draft_dir), dtype=dtype,
                                 target_quantization=quantization, draft_quantization=quantization), progress=False)


def write_report(text: str, out: Path | None) -> None:
    """Print `text` and write it to `out` (its folder made) if given."""
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", type=int, nargs="+", default=[1, 16])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rows", type=int, default=25, help="profiler table rows")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    loaded = load_embedded_pair(args.quantization, args.threads)
    lines = [f"# Forward profile ({cpu_name()}, {args.threads} threads, torch {torch.__version__}, {loaded.dtype}, "
             f"target {loaded.target_quantization}, draft {loaded.draft_quantization}, {args.context} cached)", "",
             "| model | w | forward ms | Linear layers ms | rest ms | rest share |", "|---|---:|---:|---:|---:|---:|"]
    tables = []
    with torch.inference_mode():
        for role, model in (("target", loaded.target), ("draft", loaded.draft)):
            kv = BatchKV.prefill(model, list(range(args.context)), loaded.device)
            for width in args.widths:
                whole = forward_ms(model, kv, args.context, width, args.reps)
                linear = linears_ms(model, width, args.reps)
                lines.append(f"| {role} | {width} | {whole:.1f} | {linear:.1f} | {whole - linear:.1f} | "
                             f"{(whole - linear) / whole:.0%} |")
                print(lines[-1], flush=True)
            label_linears(model)
            for width in args.widths:
                tables += ["", f"## {role}, w={width}: ops by self CPU time (5 forwards)", "", "```",
                           profile_table(model, kv, args.context, width, args.rows), "```"]
    write_report("\n".join(lines + tables) + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
