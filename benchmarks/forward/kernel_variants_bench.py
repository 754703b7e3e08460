"""Two or more builds of the w4a8 kernel side by side on the embedded pair's Linear layers, per block type
(issue 44: the matmuls' memory access):

    git show 8d1fac9~2:fly_llm/model/kernels/w4a8.cpp > /tmp/before.cpp
    python benchmarks/forward/kernel_variants_bench.py --variants before=/tmp/before.cpp \\
        now=fly_llm/model/kernels/w4a8.cpp --rows 1 --out benchmarks/results/kernel/prefetch

Each variant is compiled as its own extension (the package's flags) and swapped in for the package's
kernel; every model's w4a8 Linear layers are grouped by block type (Q4_K, Q5_K, Q6_K, Q5_0, Q8_0, fused mixes)
and each group is timed over `--rows` input rows (the fastest of 3 passes in model order, so weights
stream from memory as in a forward), the variants taking turns `--rounds` times: read the medians.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from benchmarks.forward.kernel_bench import _LINEAR_TYPES, layers_ms
from benchmarks.harness.environment import cpu_name
from fly_llm.common.config import ModelSpec
from fly_llm.model.embedded import ensure_default_pair
from fly_llm.model.kernels import w4a8
from fly_llm.model.kernels.build import compile_extension
from fly_llm.model.pair import load_models


def block_type(packed: w4a8.Packed) -> str:
    """A packed weight's block type, as its GGUF tensors had it."""
    if isinstance(packed, w4a8.PackedParts):
        return "+".join(block_type(part) for part in packed.parts)
    if isinstance(packed, w4a8.PackedSymmetric):
        return {(4, False): "Q8_0", (2, True): "Q6_K", (1, False): "Q5_0", (0, False): "Q4_0"}.get(
            (packed.bits, packed.sc is not None), f"symmetric {packed.bits} bits")
    if packed.levels is not None:
        return "Q5_K" if packed.planes is not None else "Q4_K"
    return "5-bit" if packed.planes is not None else "4-bit"


def groups_of(models: dict[str, nn.Module]) -> dict[tuple[str, str], list[nn.Module]]:
    """Each model's w4a8 Linear layers by block type, in model order."""
    groups: dict[tuple[str, str], list[nn.Module]] = defaultdict(list)
    for role, model in models.items():
        for layer in model.modules():
            if isinstance(layer, _LINEAR_TYPES) and hasattr(layer, "packed"):
                groups[role, block_type(layer.packed)].append(layer)
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", required=True, metavar="NAME=SOURCE.cpp")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    scratch = Path(tempfile.mkdtemp(prefix="fly-kernel-variants-"))
    builds = {}
    for spec in args.variants:
        name, source = spec.split("=", 1)
        builds[name] = compile_extension(f"fly_w4a8_{name}", Path(source), scratch / name)  # the package's flags
    target, draft = ensure_default_pair(progress=False)
    loaded = load_models(ModelSpec(target=str(target), draft=str(draft), dtype="auto"), progress=False)
    groups = groups_of({"target": loaded.target, "draft": loaded.draft})
    times: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for _ in range(args.rounds):
        for name, build in builds.items():
            w4a8._native = lambda build=build: build  # the package's layers call this variant
            for (role, kind), layers in groups.items():
                times[f"{role} {kind}"][name].append(layers_ms(layers, args.rows, 3, loaded.dtype))
    names = list(builds)
    lines = [f"# w4a8 kernel variants, {args.rows} row(s) ({cpu_name()}, {args.threads} threads, "
             f"torch {torch.__version__}, {time.strftime('%F %T')})", "",
             f"`{shlex.join(['python', 'benchmarks/forward/kernel_variants_bench.py', *sys.argv[1:]])}`",
             "", "Median ms of " + str(args.rounds) + " rounds in turns (GB/s of packed weights).", "",
             "| model | block type | layers | MB | " + " | ".join(names) + " |",
             "|---|---|---:|---:|" + "---:|" * len(names)]
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for (role, kind), layers in groups.items():
        size = sum(layer.packed.streamed_bytes() for layer in layers)
        medians = {name: statistics.median(times[f"{role} {kind}"][name]) for name in names}
        for name in names:
            totals[role][name] += medians[name]
        lines.append(f"| {role} | {kind} | {len(layers)} | {size / 1e6:.1f} | " + " | ".join(
            f"{medians[n]:.2f} ({size / medians[n] / 1e6:.1f})" for n in names) + " |")
    for role, by_name in totals.items():
        lines.append(f"| {role} | all | | | " + " | ".join(f"**{by_name[n]:.2f}**" for n in names) + " |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    (args.out / "results.json").write_text(json.dumps({"cpu": cpu_name(), "rows": args.rows, "times_ms": times},
                                                      indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
