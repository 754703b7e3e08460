"""Paired comparison of quality-run parts from any runs (issue 44: one target against another, on the
same items): each part's score with a Wilson interval, then each against the first, on the items all of
them hold: flips, exact McNemar p, the share of items with identical tokens, the answers that differ from
the first's without a loosely accepted draft token (the numerics check of a quality report, across runs),
and the mean answer length.
    python -m benchmarks.harness.compare_parts old=results/a/parts/gsm8k.target.jsonl new=results/b/parts/gsm8k.target.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.harness.confidence import flips, mcnemar_p, wilson_interval
from benchmarks.harness.quality_report import loosened
from benchmarks.harness.quality_run import ItemRecord, read_records


def compare(parts: dict[str, dict[str, ItemRecord]]) -> str:
    """A markdown table of `parts` (label -> records), the first the reference, on their common items."""
    common = sorted(set.intersection(*(set(records) for records in parts.values())))
    if not common:
        raise ValueError("the parts hold no item in common")
    (first, reference), *_ = parts.items()
    lines = [f"{len(common)} items in every part; flips and McNemar against {first}.", "",
             "| part | score [95% CI] | pass→fail / fail→pass | McNemar p | identical tokens "
             "| differ without a loose token | mean tokens |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    base = [bool(reference[i].passed) for i in common]
    for label, records in parts.items():
        passed = [bool(records[i].passed) for i in common]
        low, high = wilson_interval(sum(passed), len(common))
        down, up = flips(passed, base)
        same = sum(records[i].token_ids == reference[i].token_ids for i in common) / len(common)
        strict_differ = sum(records[i].token_ids != reference[i].token_ids and not loosened(records[i])
                            for i in common)
        mean = sum(records[i].tokens for i in common) / len(common)
        versus = f"{down} / {up} | {mcnemar_p(down, up):.2f} | {same:.1%} | {strict_differ}"
        lines.append(f"| {label} | {sum(passed) / len(common):.1%} [{low:.1%}, {high:.1%}] | "
                     f"{versus if label != first else '– | – | – | –'} | {mean:.0f} |")
    lines += ["", "Differ without a loose token: answers off the first part's tokens in which FLy's rule kept no "
              "draft token. Between parts of our engine on one target and machine this is 0 (greedy FLy then "
              "decodes the target's own tokens), so a count there means the two ran different numerics (code or "
              "machine) and their flips compare those, not the methods; for llama.cpp's parts it counts every "
              "answer that differs."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("parts", nargs="+", help="label=path of a part file (.jsonl); the first is the reference")
    p.add_argument("--out", type=Path, help="also write the table here")
    args = p.parse_args(argv)
    if any("=" not in part for part in args.parts) or len(args.parts) < 2:
        p.error("give two or more parts as label=path")
    paths = [part.split("=", 1) for part in args.parts]
    for _, path in paths:
        if not Path(path).is_file():
            p.error(f"no part file {path!r} (a label may not hold '=')")
    parts = {label: read_records(Path(path)) for label, path in paths}
    text = compare(parts)
    print(text)
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
