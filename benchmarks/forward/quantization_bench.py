"""What each target quantization costs and saves: a target forward over 1 and over 16 new tokens
(after a prompt in the KV cache), and how often the quantized target's next-token choice equals
the float target's (teacher-forced on the float target's own greedy answers). docs/models.md.

    python benchmarks/forward/quantization_bench.py --threads 2 --out benchmarks/results/quantization

One process, the schemes one after another on freshly loaded weights (the embedded target unless
--target), the same prompts for each; times are the median of --reps forwards.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from benchmarks.harness.datasets import load
from fly_llm.common.config import ModelSpec
from fly_llm.model.pair import load_models

WIDTHS = (1, 4, 16)


def forward_ms(model: torch.nn.Module, prompt: torch.Tensor, width: int, reps: int) -> float:
    """Median milliseconds of one forward over `width` new tokens after `prompt` (cached)."""
    times = []
    for _ in range(reps + 1):
        cache = DynamicCache(config=model.config)
        model(prompt, past_key_values=cache, use_cache=True)
        new = torch.full((1, width), 13, dtype=torch.long)
        start = time.perf_counter()
        model(new, past_key_values=cache, use_cache=True)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times[1:])


def chat_prompts(tokenizer, items: int) -> list[list[int]]:
    """The first `items` HumanEval and GSM8K prompts through the chat template, as token ids."""
    return [tokenizer.apply_chat_template(item.messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            for name in ("humaneval", "gsm8k") for item in load(name, items)]


def greedy_answers(model: torch.nn.Module, prompts: list[list[int]], tokens: int) -> list[torch.Tensor]:
    """The float target's greedy continuations: prompt + answer ids, one tensor per prompt."""
    return [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           do_sample=False, max_new_tokens=tokens)[0] for p in prompts]


def next_token_choices(model: torch.nn.Module, sequences: list[torch.Tensor], starts: list[int]) -> list[torch.Tensor]:
    """argmax of the logits at every answer position, teacher-forced."""
    with torch.no_grad():
        return [model(seq[None]).logits[0, start - 1:-1].argmax(-1) for seq, start in zip(sequences, starts)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="target model (default: the embedded one)")
    p.add_argument("--schemes", nargs="+", default=["none", "int8", "int4"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--context", type=int, default=300, help="prompt tokens in the cache before the timed forward")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--items", type=int, default=2, help="prompts per dataset for the agreement check")
    p.add_argument("--answer-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("quantization-results"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows, reference, sequences, starts = [], None, [], []
    for scheme in args.schemes:
        models = load_models(ModelSpec(target=args.target, draft="none", target_quantization=scheme), progress=False)
        target, tokenizer = models.target, models.tokenizer
        if reference is None:  # the first scheme is the reference ('none' by default)
            prompts = chat_prompts(tokenizer, args.items)
            sequences = greedy_answers(target, prompts, args.answer_tokens)
            starts = [len(prompt) for prompt in prompts]
        context = torch.randint(100, 20_000, (1, args.context))
        with torch.no_grad():
            times = {f"forward_{w}_ms": round(forward_ms(target, context, w, args.reps), 1) for w in WIDTHS}
        choices = next_token_choices(target, sequences, starts)
        if reference is None:
            reference = choices
        agree = sum(int((c == r).sum()) for c, r in zip(choices, reference))
        total = sum(len(r) for r in reference)
        rows.append({"scheme": models.target_quantization, **times, "agreement_with_first": round(agree / total, 4),
                     "positions": total})
        print(json.dumps(rows[-1]), flush=True)
        del models, target
    args.out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "benchmarks/forward/quantization_bench.py", *(sys.argv[1:] if argv is None else argv)])
    meta = {"command": command, "target": args.target or "embedded", "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "context": args.context}
    (args.out / "results.json").write_text(json.dumps({"settings": meta, "rows": rows}, indent=1) + "\n")
    lines = [f"# Target quantization: forward cost and agreement\n\n`{command}`\n",
             f"Target {meta['target']}, {meta['threads']} threads, CPU capability {meta['cpu_capability']}, "
             f"torch {meta['torch']}; forwards after a {args.context}-token prompt, median of {args.reps}; "
             f"agreement = share of {rows[0]['positions']} teacher-forced answer positions where the next-token "
             f"choice equals the first scheme's.\n",
             "| scheme | 1 token ms | 4 tokens ms | 16 tokens ms | agreement |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['scheme']} | {r['forward_1_ms']} | {r['forward_4_ms']} | {r['forward_16_ms']} | "
              f"{r['agreement_with_first']:.1%} |" for r in rows]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
