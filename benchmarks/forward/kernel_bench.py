"""The W4A8 kernel against torch's int8 and bfloat16 on the embedded pair: all Linear layers of one
forward at M = 1, 2, 4, 8, 16 rows, and whole forwards over w new tokens after a cached prompt
(docs/models.md). The schemes of one run are loaded one after another in the same process (compare
those side by side); the report is assembled from every run in --out:

    python benchmarks/forward/kernel_bench.py --schemes w4a8 int8 --out benchmarks/results/kernel
    python benchmarks/forward/kernel_bench.py --schemes none --out benchmarks/results/kernel

`w4a8` is timed on its best instruction set and again with the AVX2 path forced (same weights).
Linear layers are timed in model order over distinct weights, so they stream from memory as in a
forward; forwards use the engine's own KV path (fly_llm.decoding.policy._forward_seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.harness.environment import cpu_name
from fly_llm.common.config import ModelSpec
from fly_llm.decoding.policy import _forward_seconds
from fly_llm.model.embedded import ensure_default_pair
from fly_llm.model.kernels import w4a8
from fly_llm.model.pair import load_models
from fly_llm.model.quantization import Int4Linear, Int8Linear
from fly_llm.model.w4a8_layers import FusedW4A8, W4A8Linear

ROWS = (1, 2, 4, 8, 16)
WIDTHS = (1, 2, 4, 8, 16)
_LINEAR_TYPES = (nn.Linear, Int8Linear, Int4Linear, W4A8Linear, FusedW4A8)  # fused: q/k/v, gate/up as one


def linears_ms(model: nn.Module, rows: int, reps: int) -> float:
    """Fastest of `reps` passes over every Linear layer of `model`, in order, with `rows` input rows."""
    layers = [m for m in model.modules() if isinstance(m, _LINEAR_TYPES)]
    return layers_ms(layers, rows, reps, next(model.parameters()).dtype)


def layers_ms(layers: list[nn.Module], rows: int, reps: int, dtype: torch.dtype) -> float:
    """Fastest of `reps` passes over `layers`, in order, with `rows` input rows of `dtype`, in ms."""
    inputs = {m.in_features: torch.randn(rows, m.in_features, dtype=dtype) for m in layers}
    best = float("inf")
    with torch.inference_mode():
        for r in range(reps + 1):  # the first pass warms up
            start = time.perf_counter()
            for layer in layers:
                layer(inputs[layer.in_features])
            if r:
                best = min(best, time.perf_counter() - start)
    return best * 1000


def measure(model: nn.Module, context: int, reps: int) -> dict[str, dict[int, float]]:
    """Linear layers per row count and whole forwards per width, in ms."""
    with torch.inference_mode():
        forwards = _forward_seconds(model, context, WIDTHS, reps)
    return {"linears_ms": {m: round(linears_ms(model, m, reps), 2) for m in ROWS},
            "forward_ms": {w: round(s * 1000, 1) for w, s in zip(WIDTHS, forwards)}}


def variants(scheme: str) -> list[tuple[str, str | None]]:
    """(label, forced instruction set) per timing of `scheme`: w4a8 on its best path and on AVX2."""
    if scheme != "w4a8":
        return [(scheme if scheme != "none" else "bf16 (none)", None)]
    return [(f"w4a8 {w4a8.best_isa()}", None), ("w4a8 avx2 (forced)", "avx2")]


def report(out: Path) -> str:
    """Markdown tables of every run's results in `out`."""
    runs = [json.loads(p.read_text()) for p in sorted(out.glob("run-*.json"), reverse=True)]
    lines = ["# W4A8 kernel vs torch int8 and bf16 on the embedded pair\n"]
    for run in runs:
        lines.append(f"- `{run['command']}`: {run['cpu']}, {run['threads']} threads, torch {run['torch']}, "
                     f"{run['dtype']}")
    for role in ("target", "draft"):
        for key, label, axis in (("linears_ms", "all Linear layers of one forward", ROWS),
                                 ("forward_ms", f"one forward over w new tokens after {runs[0]['context']} cached",
                                  WIDTHS)):
            name = "M" if key == "linears_ms" else "w"
            lines += ["", f"## {role}: {label} (ms, fastest of {runs[0]['reps']})", "",
                      "| weights | " + " | ".join(f"{name}={a}" for a in axis) + " |", "|---|" + "---:|" * len(axis)]
            for run in runs:
                for variant, models in run["results"].items():
                    row = models[role][key]
                    lines.append(f"| {variant} | " + " | ".join(str(row[str(a)]) for a in axis) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schemes", nargs="+", required=True, choices=["w4a8", "int8", "none"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=300, help="cached prompt tokens before a timed forward")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target_dir, draft_dir = ensure_default_pair(progress=False)
    results = {}
    for scheme in args.schemes:
        loaded = load_models(ModelSpec(target=str(target_dir), draft=str(draft_dir), dtype="auto",
                                       target_quantization=scheme, draft_quantization=scheme), progress=False)
        if (loaded.target_quantization, loaded.draft_quantization) != (scheme, scheme):
            raise SystemExit(f"asked for {scheme}, loaded {loaded.target_quantization}/{loaded.draft_quantization}")
        for label, isa in variants(scheme):
            os.environ.pop(w4a8.ISA_ENV, None)
            if isa:
                os.environ[w4a8.ISA_ENV] = isa
            results[label] = {role: measure(model, args.context, args.reps)
                              for role, model in (("target", loaded.target), ("draft", loaded.draft))}
            print(label, json.dumps(results[label]), flush=True)
        os.environ.pop(w4a8.ISA_ENV, None)
        dtype = str(loaded.dtype)
        del loaded
    run = {"command": shlex.join(["python", "benchmarks/forward/kernel_bench.py", *(argv or sys.argv[1:])]),
           "cpu": cpu_name(), "platform": platform.platform(), "threads": args.threads, "torch": torch.__version__,
           "dtype": dtype, "context": args.context, "reps": args.reps, "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"run-{'-'.join(args.schemes)}.json").write_text(json.dumps(run, indent=1) + "\n", encoding="utf-8")
    md = report(args.out)
    (args.out / "results.md").write_text(md, encoding="utf-8")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
