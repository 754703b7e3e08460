"""Every GGUF block type as published against the Q4_K-only reading, side by side on the embedded pair
(issue 44, "the GGUF, exactly"):
    python -m benchmarks.forward.published_bench --threads 2 --rounds 20 --out benchmarks/results/step/published.md
"published": every Linear of the GGUF in its own block type (Q4_K, Q6_K, Q8_0, Q5_0), as loading does
now; "Q4_K only": the Q4_K tensors as published and the others rounded again to 4 bits, as loading did
before. Both models are loaded; their forwards alternate, one by one, after `--context` cached tokens
(the machine's bandwidth drifts by the minute, so only side by side counts). Also reported: the bytes
each streams per forward, and how often the two pick the same next token.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from unittest import mock

import torch
from gguf import GGMLQuantizationType

from benchmarks.harness.environment import cpu_name
from benchmarks.forward.step_profile import load_embedded_pair, write_report
from fly_llm.decoding.cache import BatchKV
from fly_llm.model import pair
from fly_llm.model.w4a8_layers import PackedW4A8
from fly_llm.model.kernels.gguf_blocks import Published, PublishedWeights


class Q4KOnly(Mapping[str, Published]):
    """The Q4_K weights of a published file, as loading read them before the other block types."""

    def __init__(self, weights: PublishedWeights) -> None:
        self._weights = weights
        self._names = [n for n in weights if weights.kind(n) == GGMLQuantizationType.Q4_K]

    def __getitem__(self, name: str) -> Published:
        if name not in self._names:
            raise KeyError(name)
        return self._weights[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def load_q4k_only(threads: int) -> pair.LoadedModels:
    """The embedded pair with only its Q4_K weights taken as published."""
    read = pair.published_weights

    def q4k_only(path):
        weights = read(path)
        return None if weights is None else Q4KOnly(weights)

    with mock.patch.object(pair, "published_weights", side_effect=q4k_only):
        return load_embedded_pair("w4a8", threads)


def streamed_bytes(model: torch.nn.Module) -> int:
    """Bytes of packed weights a forward streams."""
    return sum(m.packed.streamed_bytes() for m in model.modules() if isinstance(m, PackedW4A8))


def compare(models: dict[str, torch.nn.Module], context: int, width: int,
            rounds: int) -> tuple[dict[str, list[float]], float]:
    """ms per forward over `width` new tokens for each model, alternating; and the share of positions
    where both pick the same next token."""
    kvs = {name: BatchKV.prefill(model, [i % 100 for i in range(context)], torch.device("cpu"))
           for name, model in models.items()}
    torch.manual_seed(0)
    vocab = min(1000, min(model.config.vocab_size for model in models.values()))
    times: dict[str, list[float]] = {name: [] for name in models}
    same = total = 0
    for r in range(rounds + 2):  # two warm-up rounds
        tokens = torch.randint(0, vocab, (1, width))
        order = list(models) if r % 2 else list(reversed(models))
        picks = {}
        for name in order:
            start = time.perf_counter()
            logits = kvs[name].forward(models[name], tokens, logits_to_keep=width)
            elapsed = time.perf_counter() - start
            kvs[name].truncate([context])
            picks[name] = logits.argmax(-1)
            if r >= 2:
                times[name].append(elapsed * 1000)
        a, b = picks.values()
        same += int((a == b).sum())
        total += a.numel()
    return times, same / total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--widths", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    published, q4k = load_embedded_pair("w4a8", args.threads), load_q4k_only(args.threads)
    lines = [f"# Published block types vs Q4_K only, side by side ({cpu_name()}, {args.threads} threads, "
             f"{published.dtype}, {args.context} cached, {args.rounds} forwards each)", "",
             "| model | MB streamed at w <= 4 (published / Q4_K only) | w | published fastest / median ms "
             "| Q4_K only fastest / median ms | median cost | same next token |", "|---|---|---:|---|---|---:|---:|"]
    with torch.inference_mode():
        for role in ("target", "draft"):
            models = {"published": getattr(published, role), "q4k": getattr(q4k, role)}
            size = " / ".join(f"{streamed_bytes(m) / 1e6:.0f}" for m in models.values())
            for width in args.widths:
                t, agree = compare(models, args.context, width, args.rounds)
                a, b = t["published"], t["q4k"]
                lines.append(f"| {role} | {size} | {width} | {min(a):.1f} / {statistics.median(a):.1f} | "
                             f"{min(b):.1f} / {statistics.median(b):.1f} | "
                             f"{statistics.median(a) / statistics.median(b) - 1:+.1%} | {agree:.0%} |")
    write_report("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
