"""Paired ratios of an interleaved serving benchmark: each server against a reference server on the same
prompt, asked back to back in the same round, so the machine's drift (this VM's memory bandwidth moves
±15-30 % from minute to minute) cancels out of each ratio instead of landing in it.

A row is one measured request (benchmarks/serving/server_side_by_side.py's `Row`, as a dict); only rows with a
`position` (measured in an interleaved run) pair up. For a (prompt, round) both servers answered, the pair's
ratio is the server's metric over the reference's; across pairs the report gives the median, a bootstrap 95 %
interval of that median (pairs resampled with replacement, a fixed seed) and the smallest and largest ratio.
"""

from __future__ import annotations

import random
import statistics
from typing import Any

RESAMPLES = 2000
"""Bootstrap resamples of the pairs per interval."""


def pair_ratios(rows: list[dict[str, Any]], server: str, reference: str, metric: str,
                kind: str | None = None) -> list[float]:
    """For each (prompt, round) that `server` and `reference` both answered in an interleaved run (of `kind`,
    where given): `server`'s `metric` over the reference's, in (prompt, round) order; pairs where either lacks
    the metric (a RAG answer too short to time its decode) or the reference's is 0 are left out."""
    def by_pair(name: str) -> dict[tuple[str, int], float | None]:
        return {(r["prompt_id"], r["round"]): r[metric] for r in rows
                if r["server"] == name and r.get("position") is not None and kind in (None, r["kind"])}

    mine, ref = by_pair(server), by_pair(reference)
    return [mine[k] / ref[k] for k in sorted(mine.keys() & ref.keys()) if mine[k] is not None and ref[k]]


def spread(ratios: list[float], seed: int = 0) -> dict[str, Any] | None:
    """The median of `ratios`, a bootstrap 95 % interval of it (`low`, `high`), `min`, `max` and the number of
    `pairs`, to three places; None without ratios."""
    if not ratios:
        return None
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(RESAMPLES))
    values = {"median": statistics.median(ratios), "low": medians[int(0.025 * RESAMPLES)],
              "high": medians[int(0.975 * RESAMPLES) - 1], "min": min(ratios), "max": max(ratios)}
    return {k: round(v, 3) for k, v in values.items()} | {"pairs": len(ratios)}


def paired(rows: list[dict[str, Any]], servers: list[str], reference: str, kinds: list[str],
           metrics: tuple[str, ...]) -> dict[str, dict[str, dict[str, dict[str, Any] | None]]]:
    """Per server but the reference, per part ("all" and each kind), per metric: the spread of its paired
    ratios to `reference`."""
    return {s: {part: {m: spread(pair_ratios(rows, s, reference, m, None if part == "all" else part))
                       for m in metrics} for part in ["all", *kinds]}
            for s in servers if s != reference}


def cell(spread_: dict[str, Any] | None) -> str:
    """One spread in a Markdown table cell: `median (low–high; min–max; n pairs)`."""
    if spread_ is None:
        return "–"
    s = spread_
    return f"{s['median']:.2f} ({s['low']:.2f}–{s['high']:.2f}; {s['min']:.2f}–{s['max']:.2f}; {s['pairs']})"
