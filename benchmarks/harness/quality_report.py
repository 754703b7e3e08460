"""The report of a quality run: per dataset and method, the metric and retention with 95% confidence
intervals, flips and McNemar's test against target-only, token agreement; JSON, Markdown, plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.harness.confidence import flips, mcnemar_p, retention_interval, wilson_interval
from benchmarks.harness.datasets import Item
from benchmarks.harness.quality_run import ItemRecord, Sitting, part_path, read_records, read_sittings
from benchmarks.harness.report import METRIC_NAMES, REFERENCE, fmt, footer, header, merged_stats, save
from fly_llm.decoding.stages import common_prefix


def summarize_part(dataset: str, method: str, records: list[ItemRecord], reference: dict[str, ItemRecord],
                   sittings: list[Sitting]) -> dict[str, Any]:
    """Every figure of one (dataset, method) part; `reference` is target-only's records by id."""
    paired = [(r, reference[r.item_id]) for r in records if r.item_id in reference]
    scored = bool(records) and all(r.passed is not None for r in records)
    passed = sum(bool(r.passed) for r in records)
    summary: dict[str, Any] = {
        "dataset": dataset, "method": method, "items": len(records), "paired_items": len(paired),
        "tokens": sum(r.tokens for r in records),
        "hit_limit": _share([r.hit_limit for r in records]),
        "metric_name": METRIC_NAMES.get(dataset, "unscored"),
        "metric": passed / len(records) if scored else None,
        "metric_ci": list(wilson_interval(passed, len(records))) if scored else None,
        "agreement": _share([r.token_ids == ref.token_ids for r, ref in paired]),
        "prefix_agreement": _share([common_prefix(r.token_ids, ref.token_ids) / max(1, len(ref.token_ids))
                                    for r, ref in paired]),
        "strict_items": sum(not loosened(r) for r, _ in paired),
        "strict_differ": sum(not loosened(r) and r.token_ids != ref.token_ids for r, ref in paired),
        "retention": None, "retention_ci": None, "pass_to_fail": None, "fail_to_pass": None, "mcnemar_p": None,
    }
    if scored and paired and all(ref.passed is not None for _, ref in paired):
        mine, theirs = [bool(r.passed) for r, _ in paired], [bool(ref.passed) for _, ref in paired]
        b, c = flips(mine, theirs)
        ci = retention_interval(mine, theirs)
        summary.update(retention=sum(mine) / sum(theirs) if any(theirs) else None,
                       retention_ci=list(ci) if ci else None, pass_to_fail=b, fail_to_pass=c, mcnemar_p=mcnemar_p(b, c))
    stats = merged_stats([r.stats for r in records])
    seconds = sum(s.seconds for s in sittings)
    summary.update(
        mat=stats.mat if stats else None, loose_rate=stats.loose_rate if stats else None,
        throughput_tokens_per_s=sum(s.tokens for s in sittings) / seconds if seconds else None,
        batch=sorted({s.batch for s in sittings}), sittings=len(sittings),
        machines=sorted({s.machine or "unrecorded" for s in sittings}),
        engine_stats=stats.model_dump() if stats else None)
    return summary


def build_report(out: Path, datasets: dict[str, list[Item]], methods: list[str]) -> list[dict[str, Any]]:
    """Summaries of every part under `out` for the selected items and methods (the reference first)."""
    results = []
    for dataset, items in datasets.items():
        wanted = {item.item_id for item in items}
        parts = {}
        for method in methods:
            path = part_path(out, dataset, method)
            parts[method] = ([r for r in read_records(path).values() if r.item_id in wanted], read_sittings(path))
        reference = {r.item_id: r for r in parts.get(REFERENCE, ([], []))[0]}
        results += [summarize_part(dataset, method, records, reference, sittings)
                    for method, (records, sittings) in parts.items() if records]
    return results


def loosened(record: ItemRecord) -> bool:
    """Whether any draft token of the item was accepted loosely. Without one, greedy FLy decodes exactly
    target-only's tokens, so a strict item that differs from the reference is a numerics difference (the
    parts were decoded on machines or thread counts that round differently), not the method's."""
    return bool((record.stats or {}).get("accepted_loose", 0))


def _share(values: list[bool | float]) -> float | None:
    return sum(values) / len(values) if values else None


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.1%}"


def _interval(ci: list[float] | None) -> str:
    return "" if ci is None else f" [{ci[0]:.1%}, {ci[1]:.1%}]"


def markdown(report: dict[str, Any]) -> str:
    """The quality report as Markdown: one table per dataset, then the command and environment."""
    lines = header(report, "fly-bench quality run")
    for dataset in report["settings"]["datasets"]:
        rows = [s for s in report["results"] if s["dataset"] == dataset]
        if not rows:
            continue
        lines += [
            f"## {dataset} ({rows[0]['metric_name']})", "",
            "| method | items | metric [95% CI] | retention [95% CI] | pass→fail | fail→pass | McNemar p "
            "| identical to target | hit max tokens | MAT | loose rate | throughput tok/s | batch |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for s in rows:
            lines.append(
                f"| {s['method']} | {s['items']} | {_pct(s['metric'])}{_interval(s['metric_ci'])} "
                f"| {_pct(s['retention'])}{_interval(s['retention_ci'])} | {fmt(s['pass_to_fail'])} "
                f"| {fmt(s['fail_to_pass'])} | {fmt(s['mcnemar_p'], '.3f')} | {_pct(s['agreement'])} "
                f"| {_pct(s['hit_limit'])} | {fmt(s['mat'], '.2f')} | {_pct(s['loose_rate'])} "
                f"| {fmt(s['throughput_tokens_per_s'], '.1f')} | {', '.join(map(str, s['batch']))} |")
        lines += ["", "Numerics check (items with no loose acceptance must equal target-only's tokens): "
                  + "; ".join(f"{s['method']} {s['strict_differ']} of {s['strict_items']} differ"
                              for s in rows if s["method"] != REFERENCE) + "."]
        machines = sorted({m for s in rows for m in s["machines"]})
        if len(machines) > 1:
            consistent = all(s["strict_differ"] == 0 for s in rows)
            lines += ["", f"**Warning: these parts were recorded as decoded on different kinds of machine "
                          f"({'; '.join(machines)}):** " + (
                              "yet no item without a loose acceptance differs from target-only, so their numerics agree."
                              if consistent else "greedy tokens differ between them (see the numerics check), so "
                              "identity and flips compare numerics, not methods.")]
        lines.append("")
    lines += footer(report["methods"], "Metric: pass@1 (HumanEval) or exact match (GSM8K) with its Wilson 95% "
                    "interval. Retention = metric / target-only's metric on the same items, with a paired bootstrap "
                    "95% interval (10,000 resamples of the items). pass→fail / fail→pass count the items whose "
                    "outcome differs from target-only's; McNemar p is the exact two-sided test on those. Identical = "
                    "share of items with target-only's exact tokens; hit max tokens = share cut at the token limit. "
                    "Throughput is the batch's tokens per second (continuous batching), not a latency; batch = the most "
                    "items decoded at once in the part's sittings.")
    return "\n".join(lines)


def write(report: dict[str, Any], out: Path) -> list[Path]:
    """quality.json, quality.md and retention_ci.png under `out`; the paths written."""
    paths = save(report, out, "quality", markdown(report))
    return [*paths, plot_retention(report, out / "retention_ci.png")]


def plot_retention(report: dict[str, Any], path: Path) -> Path:
    """Retention per method with its 95% interval, one marker series per dataset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [s for s in report["results"] if s["retention"] is not None]
    methods = list(dict.fromkeys(s["method"] for s in rows))
    datasets = list(dict.fromkeys(s["dataset"] for s in rows))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(methods) + 2), 4))
    width = 0.6 / max(1, len(datasets))
    for j, dataset in enumerate(datasets):
        by_method = {s["method"]: s for s in rows if s["dataset"] == dataset}
        xs, ys, low, high = [], [], [], []
        for i, method in enumerate(methods):
            s = by_method.get(method)
            if s is None:
                continue
            ci = s["retention_ci"] or [s["retention"], s["retention"]]
            xs.append(i + (j - (len(datasets) - 1) / 2) * width)
            ys.append(s["retention"])
            low.append(max(0.0, s["retention"] - ci[0]))
            high.append(max(0.0, ci[1] - s["retention"]))
        ax.errorbar(xs, ys, yerr=[low, high], fmt="o", capsize=4, label=dataset)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.axhline(0.99, color="tab:red", lw=0.8, ls=":", label="99%")
    ax.set_xticks(range(len(methods)), methods, rotation=20, ha="right")
    ax.set(title="Quality retention vs target-only (95% paired bootstrap CI)", ylabel="metric / target's metric")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
