"""The embedded target's w4a8 weights taken from the GGUF's published Q4_K blocks against the same
weights rounded a second time (from the dequantized float weight), int8, and head precisions:
teacher-forced next-token agreement with the float (bf16) target, the KL divergence from its
next-token distribution, and the cost of one forward over 1 and 16 new tokens. docs/models.md;
the method (and its helpers) is benchmarks/forward/quantization_bench.py's.

    python -m benchmarks.forward.repack_agreement --threads 2 --items 6 --out benchmarks/results/kernel

One process; each variant is quantized from a fresh load of the float target, in the order given.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
from pathlib import Path

import torch
from torch import nn

from benchmarks.harness.environment import cpu_name
from benchmarks.forward.quantization_bench import chat_prompts, forward_ms, greedy_answers
from fly_llm.common.config import ModelSpec
from fly_llm.model.embedded import ensure_default_pair
from fly_llm.model.cache import published_weights
from fly_llm.model.pair import load_models
from fly_llm.model.quantization import Int8Linear, quantize

WIDTHS = (1, 16)
# label: (scheme of the Linear layers, Q4_K weights as published, output head: as the others / int8 / bf16,
#         the other layers without published weights (Q6_K in this GGUF) kept in bf16)
VARIANTS = {
    "bf16 (reference)": ("none", False, "same", False),
    "int8": ("int8", False, "same", False),
    "w4a8 rounded again": ("w4a8", False, "same", False),
    "w4a8 published Q4_K": ("w4a8", True, "same", False),
    "w4a8 published Q4_K, head int8": ("w4a8", True, "int8", False),
    "w4a8 published Q4_K, head bf16": ("w4a8", True, "bf16", False),
    "w4a8 published Q4_K, Q6_K layers bf16": ("w4a8", True, "same", True),
}


def build(target_dir: Path, scheme: str, published: bool, head: str,
          unpublished_float: bool) -> tuple[torch.nn.Module, object]:
    """The float target loaded afresh, then quantized as one variant says; (model, tokenizer)."""
    loaded = load_models(ModelSpec(target=str(target_dir), draft="none", target_quantization="none"),
                         progress=False)
    target, given = loaded.target, published_weights(target_dir) if published else None
    floats = {name: module for name, module in target.named_modules() if type(module) is nn.Linear}
    quantize(target, scheme, loaded.device, "target", given)
    if head == "int8":
        target.lm_head = Int8Linear(floats["lm_head"])
    elif head == "bf16":
        target.lm_head = floats["lm_head"]
    if unpublished_float:
        for name, module in floats.items():
            if name != "lm_head" and name not in given:
                parent, _, child = name.rpartition(".")
                setattr(target.get_submodule(parent), child, module)
    return target, loaded.tokenizer


def answer_log_probs(model: torch.nn.Module, sequences: list[torch.Tensor], starts: list[int]) -> torch.Tensor:
    """Next-token log-probabilities (float32 [positions, vocab]) at every answer position, teacher-forced."""
    with torch.no_grad():
        return torch.cat([torch.log_softmax(model(seq[None]).logits[0, start - 1:-1].float(), dim=-1)
                          for seq, start in zip(sequences, starts)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=300, help="prompt tokens in the cache before a timed forward")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--items", type=int, default=4, help="prompts per dataset (HumanEval, GSM8K)")
    p.add_argument("--answer-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target_dir, _ = ensure_default_pair(progress=False)
    if published_weights(target_dir) is None:
        raise SystemExit(f"{target_dir} has no published Q4_K weights")
    reference = sequences = starts = None
    rows = []
    for label in args.variants:
        target, tokenizer = build(target_dir, *VARIANTS[label])
        if sequences is None:  # the float target's own greedy answers, on the first variant (the reference)
            prompts = chat_prompts(tokenizer, args.items)
            sequences = greedy_answers(target, prompts, args.answer_tokens)
            starts = [len(prompt) for prompt in prompts]
        context = torch.randint(100, 20_000, (1, args.context))
        with torch.no_grad():
            times = {f"forward_{w}_ms": round(forward_ms(target, context, w, args.reps), 1) for w in WIDTHS}
        log_probs = answer_log_probs(target, sequences, starts)
        reference = log_probs if reference is None else reference
        positions, agree = len(reference), int((log_probs.argmax(-1) == reference.argmax(-1)).sum())
        kl = (reference.exp() * (reference - log_probs)).sum(-1).mean()  # KL(reference || variant), nats
        rows.append({"variant": label, **times, "agreement": round(agree / positions, 4), "differ": positions - agree,
                     "positions": positions, "kl_nats": round(float(kl), 5)})
        print(json.dumps(rows[-1]), flush=True)
        del target
    command = shlex.join(["python", "-m", "benchmarks.forward.repack_agreement", *(sys.argv[1:] if argv is None else argv)])
    meta = {"command": command, "cpu": cpu_name(), "platform": platform.platform(), "threads": args.threads,
            "torch": torch.__version__, "context": args.context, "reps": args.reps, "reference": args.variants[0]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "repack.json").write_text(json.dumps({"settings": meta, "rows": rows}, indent=1) + "\n")
    lines = [f"# Published Q4_K vs a second rounding: agreement and cost\n\n`{command}`\n",
             f"{meta['cpu']}, {args.threads} threads, torch {meta['torch']}; forwards after a {args.context}-token "
             f"prompt, median of {args.reps}; agreement = share of {positions} teacher-forced answer positions "
             f"where the next-token choice equals {meta['reference']}'s; KL = mean KL divergence of the next-token "
             f"distribution from {meta['reference']}'s over the same positions (nats).\n",
             "| variant | 1 token ms | 16 tokens ms | agreement | positions differing | KL |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['variant']} | {r['forward_1_ms']} | {r['forward_16_ms']} | {r['agreement']:.2%} | {r['differ']} | "
              f"{r['kl_nats']} |" for r in rows]
    (args.out / "repack.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
