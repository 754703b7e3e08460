"""Should llama.cpp run the target (or the draft) inside FLy? One forward over w new tokens after a
cached prompt, llama.cpp (llama-cpp-python, the embedded GGUF files) and torch (the same models as
the engine loads them: int8 weights, float32 attention) side by side, and whether llama.cpp's logits
for a token depend on the batch it is computed in (exact mode needs them not to). docs/models.md,
"Why not a llama.cpp target or draft".

    python benchmarks/forward/llamacpp_forward_bench.py --threads 2 --out benchmarks/results/llamacpp-forward
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from fly_llm.common.config import ModelSpec
from fly_llm.decoding.policy import _forward_seconds
from fly_llm.model.embedded import DRAFT, TARGET, assemble_gguf
from fly_llm.model.pair import load_models

WIDTHS = (1, 2, 4, 8, 16)


class LlamaContext:
    """One llama.cpp context over a GGUF file, one sequence, logits for every position."""

    def __init__(self, path: Path, threads: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(str(path), n_ctx=2048, n_threads=threads, n_threads_batch=threads, logits_all=True,
                         verbose=False, n_batch=512)

    def eval(self, tokens: list[int]) -> np.ndarray:
        """Feed `tokens`; their logits [len, V]."""
        self.llm.eval(tokens)
        return np.array(self.llm.scores[self.llm.n_tokens - len(tokens):self.llm.n_tokens])

    def rollback(self, length: int) -> None:
        self.llm._ctx.kv_cache_seq_rm(-1, length, -1)
        self.llm.n_tokens = length


def llama_ms(ctx: LlamaContext, prompt: list[int], new: list[int], reps: int) -> dict[int, float]:
    """Fastest of `reps` forwards over w of `new` after `prompt`, per width w, in ms."""
    ctx.eval(prompt)
    best = {}
    for width in WIDTHS:
        times = []
        for _ in range(reps + 1):
            start = time.perf_counter()
            ctx.eval(new[:width])
            times.append(time.perf_counter() - start)
            ctx.rollback(len(prompt))
        best[width] = round(min(times[1:]) * 1000, 1)
    return best


def batch_dependence(ctx: LlamaContext, prompt: list[int], new: list[int]) -> dict[str, float | bool]:
    """llama.cpp's logits for `new` computed in one forward vs one token at a time."""
    together = ctx.eval(new)
    ctx.rollback(len(prompt))
    alone = np.stack([ctx.eval([t])[0] for t in new])
    ctx.rollback(len(prompt))
    return {"max_abs_logit_difference": float(np.abs(together - alone).max()),
            "same_argmax": bool((together.argmax(-1) == alone.argmax(-1)).all())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=300, help="cached prompt tokens before the timed forward")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    text = "\n\n".join(inspect.getdoc(__import__(m)) for m in ("json", "itertools", "functools"))
    loaded = load_models(ModelSpec(dtype="auto"), progress=False)
    ids = loaded.tokenizer.encode(text)
    prompt, new = ids[:args.context], ids[args.context:args.context + max(WIDTHS)]
    rows = {}
    with tempfile.TemporaryDirectory(prefix="llamacpp-bench-") as tmp:
        for role, embedded, model in (("target", TARGET, loaded.target), ("draft", DRAFT, loaded.draft)):
            torch_s = _forward_seconds(model, args.context, WIDTHS, args.reps)  # before llama.cpp's threads exist
            ctx = LlamaContext(assemble_gguf(embedded, Path(tmp), progress=False), args.threads)
            rows[role] = {"llama.cpp_ms": llama_ms(ctx, prompt, new, args.reps),
                          "torch_ms": {w: round(s * 1000, 1) for w, s in zip(WIDTHS, torch_s)},
                          "llama.cpp_batch_dependence": batch_dependence(ctx, prompt, new)}
            del ctx
    report = {"command": shlex.join(["python", "benchmarks/forward/llamacpp_forward_bench.py", *(argv or sys.argv[1:])]),
              "platform": platform.platform(), "threads": args.threads, "context": args.context,
              "torch": f"{loaded.dtype}, target {loaded.target_quantization}, draft {loaded.draft_quantization}",
              "models": rows}
    lines = [f"# llama.cpp vs torch: one forward over w new tokens after {args.context} cached\n",
             f"`{report['command']}`\n", f"{report['platform']}, {args.threads} threads; torch: {report['torch']}\n",
             "| model | runtime | " + " | ".join(f"w={w} (ms)" for w in WIDTHS) + " |",
             "|---|---|" + "---:|" * len(WIDTHS)]
    for role, row in rows.items():
        for runtime in ("llama.cpp", "torch"):
            lines.append(f"| {role} | {runtime} | " + " | ".join(str(row[f"{runtime}_ms"][w]) for w in WIDTHS) + " |")
    lines.append("")
    for role, row in rows.items():
        dep = row["llama.cpp_batch_dependence"]
        lines.append(f"- {role}: llama.cpp logits of {max(WIDTHS)} tokens in one forward vs one at a time: max |difference| "
                     f"{dep['max_abs_logit_difference']:.3f}, same argmax: {dep['same_argmax']}")
    md = "\n".join(lines) + "\n"
    print(md)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        (args.out / "results.md").write_text(md, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
