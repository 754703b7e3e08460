"""The w4a8 kernel's two scale layouts side by side on the embedded pair (issue 34, "fewer bytes"):
the published Q4_K weights packed with two levels (a float16 per 256 weights and an 8-bit multiplier
per 32, as GGUF stores them) against the same weights with a float32 scale and minimum per 32 (their
products; before issue 44's last step a float16 rounding of them).
    python -m benchmarks.forward.scale_layout_bench --threads 2 --rounds 20 --out benchmarks/results/step/scale-layout.md
Both layouts stand for the same scales, so every forward's logits must be equal (checked on
each pair of forwards). The two run alternately, forward by forward, on the same loaded models after
`--context` cached tokens: the machine's bandwidth drifts by the minute, so only side by side counts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.harness.environment import cpu_name
from benchmarks.forward.step_profile import load_embedded_pair, write_report
from fly_llm.decoding.cache import BatchKV
from fly_llm.model.w4a8_layers import PackedW4A8
from fly_llm.model.kernels.w4a8 import Packed


def layouts(model: nn.Module) -> tuple[dict[nn.Module, Packed], dict[nn.Module, Packed]]:
    """Each packed layer's weight as loaded (two-level scales kept where published) and without them."""
    loaded = {m: m.packed for m in model.modules() if isinstance(m, PackedW4A8)}
    return loaded, {m: packed.one_level() for m, packed in loaded.items()}


def streamed_bytes(packed: dict[nn.Module, Packed]) -> int:
    """Bytes a forward streams: the levels and the scales (two levels where kept)."""
    return sum(p.streamed_bytes() for p in packed.values())


def compare(model: nn.Module, kv: BatchKV, context: int, width: int, rounds: int) -> dict[str, list[float]]:
    """ms per forward over `width` new tokens for each layout, alternating; logits equal every time."""
    two, one = layouts(model)
    times: dict[str, list[float]] = {"two levels": [], "one level": []}
    tokens = torch.arange(width)[None]
    for r in range(rounds + 2):  # two warm-up rounds
        outputs = []
        for name, packed in (("two levels", two), ("one level", one)) if r % 2 else (("one level", one),
                                                                                      ("two levels", two)):
            for module, weight in packed.items():
                module.packed = weight
            start = time.perf_counter()
            outputs.append(kv.forward(model, tokens, logits_to_keep=width))
            elapsed = time.perf_counter() - start
            kv.truncate([context])
            if r >= 2:
                times[name].append(elapsed * 1000)
        if not torch.equal(outputs[0], outputs[1]):
            raise AssertionError("the two layouts gave different logits")
    for module, weight in two.items():
        module.packed = weight
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--widths", type=int, nargs="+", default=[1, 16])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    loaded = load_embedded_pair("w4a8", args.threads)
    lines = [f"# w4a8 scale layouts, side by side ({cpu_name()}, {args.threads} threads, {loaded.dtype}, "
             f"{args.context} cached, {args.rounds} forwards each)", "",
             "| model | MB streamed at w <= 4 (two / one level) | w | two levels fastest / median ms "
             "| one level fastest / median ms | median saved |", "|---|---|---:|---|---|---:|"]
    with torch.inference_mode():
        for role, model in (("target", loaded.target), ("draft", loaded.draft)):
            two, one = layouts(model)
            size = f"{streamed_bytes(two) / 1e6:.0f} / {streamed_bytes(one) / 1e6:.0f}"
            kv = BatchKV.prefill(model, list(range(args.context)), loaded.device)
            for width in args.widths:
                t = compare(model, kv, args.context, width, args.rounds)
                a, b = t["two levels"], t["one level"]
                lines.append(f"| {role} | {size} | {width} | {min(a):.1f} / {statistics.median(a):.1f} | "
                             f"{min(b):.1f} / {statistics.median(b):.1f} | "
                             f"{1 - statistics.median(a) / statistics.median(b):.1%} |")
    write_report("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
