"""Turning per-item runs into figures: the summary per (dataset, method), JSON, Markdown and plots."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fly_llm.decoding.stages import common_prefix
from fly_llm.common.stats import RequestStats

REFERENCE = "target"
METRIC_NAMES = {"humaneval": "pass@1", "gsm8k": "exact match", "prose": "unscored", "rag": "answer match"}


@dataclass
class ItemResult:
    """One item decoded by one method, scored."""

    item_id: str
    tokens: int
    seconds: float
    ttft_s: float
    target_forwards: int
    passed: bool | None  # None: an unscored dataset (prose)
    token_ids: list[int]
    text: str
    stats: dict[str, Any] | None = None


def summarize(dataset: str, method: str, items: list[ItemResult], reference: list[ItemResult]) -> dict[str, Any]:
    """Every figure for one method on one dataset; `reference` is target-only on the same items."""
    tokens = sum(r.tokens for r in items)
    forwards = sum(r.target_forwards for r in items)
    scored = all(r.passed is not None for r in items + reference)
    metric = _mean([r.passed for r in items]) if scored else None
    ref_speed, ref_metric = _tokens_per_s(reference), _mean([r.passed for r in reference]) if scored else None
    ref = {r.item_id: r for r in reference}
    stats = merged_stats([r.stats for r in items])
    return {
        "dataset": dataset, "method": method, "items": len(items), "tokens": tokens,
        "seconds": round(sum(r.seconds for r in items), 4),
        "tokens_per_s": _tokens_per_s(items),
        "speedup": _tokens_per_s(items) / ref_speed if ref_speed else None,
        "ttft_s": _mean([r.ttft_s for r in items]),
        "seconds_per_answer": _mean([r.seconds for r in items]),
        "decode_tokens_per_s": decode_tokens_per_s(items),
        "target_forwards": forwards,
        "mat": tokens / forwards if forwards else 0.0,
        "loose_rate": stats.loose_rate if stats else 0.0,
        "acceptance_by_position": _acceptance_by_position(stats),
        "engine_stats": stats.model_dump() if stats else None,
        "metric_name": METRIC_NAMES.get(dataset, "unscored"),
        "metric": metric,
        "retention": metric / ref_metric if ref_metric else None,
        "flipped": _mean([r.passed != ref[r.item_id].passed for r in items]) if scored else None,
        "agreement": _mean([r.token_ids == ref[r.item_id].token_ids for r in items]),
        "prefix_agreement": _mean([common_prefix(r.token_ids, ref[r.item_id].token_ids)
                                   / max(1, len(ref[r.item_id].token_ids)) for r in items]),
        "per_item": [asdict(r) for r in items],
    }


def compare_to_best_hf(summaries: list[dict[str, Any]], hf_methods: set[str], llamacpp_methods: set[str]) -> None:
    """Add to each summary of one dataset `vs_best_hf` (its tok/s over the fastest HF method's)
    and `vs_llamacpp` (over the fastest llama.cpp method's; None when none ran)."""
    best = max((s["tokens_per_s"] for s in summaries if s["method"] in hf_methods), default=0.0)
    llama = max((s["tokens_per_s"] for s in summaries if s["method"] in llamacpp_methods), default=0.0)
    for s in summaries:
        s["vs_best_hf"] = s["tokens_per_s"] / best if best else None
        s["vs_llamacpp"] = s["tokens_per_s"] / llama if llama else None


def _mean(values: list[float | bool]) -> float:
    return sum(values) / len(values) if values else 0.0


def decode_tokens_per_s(items: list[ItemResult]) -> float | None:
    """The decode-phase rate: tokens after each answer's first over the time after its first token
    (prefill and first round excluded), summed over the items; None when no answer has two tokens."""
    tokens = sum(r.tokens - 1 for r in items if r.tokens > 1)
    seconds = sum(r.seconds - r.ttft_s for r in items if r.tokens > 1)
    return tokens / seconds if tokens and seconds > 0 else None


def _tokens_per_s(items: list[ItemResult]) -> float:
    seconds = sum(r.seconds for r in items)
    return sum(r.tokens for r in items) / seconds if seconds else 0.0


def merged_stats(per_item: list[dict[str, Any] | None]) -> RequestStats | None:
    """The engine counters of many items summed (their JSON dicts); None if none has any."""
    if not any(per_item):
        return None
    total = RequestStats()
    for stats in per_item:
        if stats:
            total.merge(RequestStats.model_validate({k: v for k, v in stats.items() if k in RequestStats.model_fields}))
    return total


def _acceptance_by_position(stats: RequestStats | None) -> list[float] | None:
    """Share of drafted tokens accepted, per draft position (1-based position i at index i-1)."""
    if stats is None:
        return None
    return [a / d if d else 0.0 for a, d in zip(stats.accepted_by_position, stats.drafted_by_position)]


def fmt(value: float | None, spec: str = "") -> str:
    """`value` formatted with `spec`, or a dash for None."""
    return "–" if value is None else format(value, spec)


def header(report: dict[str, Any], title: str, run: str = "") -> list[str]:
    """The first Markdown lines of a report: title, command, models, machine, settings (`run` adds to them)."""
    env = report["environment"]
    quantization = f" ({env['target_quantization']} weights)" if env.get("target_quantization") else ""
    return [
        f"# {title}", "",
        f"`{report['command']}`", "",
        f"Target `{env['target']}`{quantization}, draft `{env['draft']}`, {env['dtype']} on {env['device']} "
        f"({env['threads']} threads, {env['cpu']}); greedy, chat template, max {report['settings']['max_tokens']} "
        f"new tokens{run}; commit `{env['git_commit']}`; {report['created']}.", "",
    ]


def markdown(report: dict[str, Any]) -> str:
    """The results as Markdown: one table per dataset, then the command and environment."""
    lines = header(report, "fly-bench results")
    for dataset in report["settings"]["datasets"]:
        rows = [s for s in report["results"] if s["dataset"] == dataset]
        if not rows:
            continue
        lines += [
            f"## {dataset} ({rows[0]['items']} items, {rows[0]['metric_name']})", "",
            "| method | tok/s | speedup | vs best HF | vs llama.cpp | s/answer | decode tok/s | MAT | loose rate "
            "| TTFT s | metric | retention | flipped vs target | identical to target |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for s in rows:
            lines.append(
                f"| {s['method']} | {s['tokens_per_s']:.2f} | {fmt(s['speedup'], '.2f')}× "
                f"| {fmt(s.get('vs_best_hf'), '.2f')}× | {fmt(s.get('vs_llamacpp'), '.2f')}× "
                f"| {s['seconds_per_answer']:.2f} | {fmt(s['decode_tokens_per_s'], '.2f')} | {s['mat']:.2f} "
                f"| {s['loose_rate']:.1%} | {s['ttft_s']:.2f} | {fmt(s['metric'], '.1%')} | {fmt(s['retention'], '.1%')} "
                f"| {fmt(s['flipped'], '.0%')} | {fmt(s['agreement'], '.0%')} |")
        lines.append("")
    lines += footer({name: m["description"] for name, m in report["methods"].items()},
                    "tok/s = all tokens over all time (prefill included); s/answer = mean end-to-end seconds "
                    "per item; decode tok/s = tokens after each answer's first over the time after it (the "
                    "decode phase, prefill excluded). "
                    "MAT = generated tokens per target forward pass (prefill included). vs best HF = tok/s "
                    "over the fastest of the Hugging Face methods (target, assisted, lookup); vs llama.cpp = tok/s "
                    "over the fastest llama.cpp method's (flash attention off or on) target-only decoding of the GGUF file "
                    "(– when none ran). Speedup, "
                    "retention (metric / target's metric), flipped (share of items whose pass/fail differs) and "
                    "identical (share of items with the target's exact tokens) compare with `target` on the same "
                    "items.")
    return "\n".join(lines)


def footer(descriptions: dict[str, str], note: str) -> list[str]:
    """The last Markdown lines of a report: each method's description, then what the columns mean."""
    return ["Methods:", "", *(f"- `{name}`: {text}" for name, text in descriptions.items()), "", note, ""]


def save(report: dict[str, Any], out: Path, stem: str, text: str) -> list[Path]:
    """`<stem>.json` (the whole report) and `<stem>.md` (`text`) under `out`; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    json_path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    md_path.write_text(text, encoding="utf-8")
    return [json_path, md_path]


def write(report: dict[str, Any], out: Path) -> list[Path]:
    """Write results.json, results.md and the PNG plots under `out`; return the paths written."""
    return [*save(report, out, "results", markdown(report)), *plot(report, out)]


def plot(report: dict[str, Any], out: Path) -> list[Path]:
    """PNG plots: speedup, MAT and quality retention per method and dataset; acceptance by position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    results = report["results"]
    datasets = [d for d in report["settings"]["datasets"] if any(s["dataset"] == d for s in results)]
    methods = list(dict.fromkeys(s["method"] for s in results))
    paths = []
    for key, title, ylabel, ref_line in (
        ("speedup", "Speedup vs target-only greedy", "× target-only tok/s", 1.0),
        ("mat", "Tokens per target forward (MAT)", "tokens", 1.0),
        ("retention", "Quality retention vs target-only", "metric / target's metric", 1.0),
    ):
        fig, ax = plt.subplots(figsize=(min(14.0, 2.0 + 0.55 * len(methods) * max(1, len(datasets))), 4))
        width = 0.8 / max(1, len(datasets))
        for j, dataset in enumerate(datasets):
            by_method = {s["method"]: s for s in results if s["dataset"] == dataset}
            values = [by_method[m][key] if m in by_method else None for m in methods]
            xs = [i + (j - (len(datasets) - 1) / 2) * width for i in range(len(methods))]
            bars = ax.bar(xs, [v or 0.0 for v in values], width, label=dataset)
            ax.bar_label(bars, ["n/a" if v is None else f"{v:.2f}" for v in values], fontsize=7)
        ax.axhline(ref_line, color="grey", lw=0.8, ls="--")
        ax.set_xticks(range(len(methods)), methods, rotation=30, ha="right")
        ax.set(title=title, ylabel=ylabel)
        ax.legend()
        fig.tight_layout()
        paths.append(out / f"{key}.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)

    fig, axes = plt.subplots(1, len(datasets), figsize=(5.5 * len(datasets), 4), sharey=True, squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        for s in results:
            if s["dataset"] == dataset and s["acceptance_by_position"]:
                rates = s["acceptance_by_position"]
                ax.plot(range(1, len(rates) + 1), rates, marker=".", label=s["method"])
        ax.set(title=dataset, xlabel="draft position i", ylim=(0, 1.05))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ax.lines:
            ax.legend(fontsize=7)
    axes[0][0].set_ylabel("P(accepted ≥ i | drafted ≥ i)")
    fig.suptitle("Acceptance by draft position (engine methods)")
    fig.tight_layout()
    paths.append(out / "acceptance.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths
