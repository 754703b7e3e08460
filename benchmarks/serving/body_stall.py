"""How long one invalid body holds the HTTP front (issue 65): /health polled while each door refuses it.

    python -m benchmarks.serving.body_stall --out benchmarks/results/attacks/invalid-arrays/after

The front runs in this process on the engine double (tests/support), as the tests run it. For each door, a
body whose one long array holds items of the wrong type (tests/support/hostile_bodies.py) is posted from a
thread while this thread asks /health on its own connection every 5 ms; per body: the answer's status and
code, how long the refusal took, and /health's longest answer time meanwhile (the front's event loop is shared
by every client). Writes results.json and results.md to `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import httpx

from benchmarks.harness.environment import cpu_name, git_commit

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from support.hostile_bodies import WRONG_ITEMS, refused  # noqa: E402
from support.http_double import double_front  # noqa: E402

ITEMS = (1_000_000, 30_000)
"""Wrong items per body: 3 MB of `{},` (under the front's 4 MB body limit), and as many as fit under
MAX_BODY_VALUES (fly_llm.common.json_text): the most validation a body that is not refused unread can ask for."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--items", type=int, nargs="+", default=ITEMS)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, double_front(Path(tmp)) as (_, client):
        client.timeout = httpx.Timeout(300)
        for items in args.items:
            for name, (path, make) in WRONG_ITEMS.items():
                refusal = refused(client, path, make(items))
                error = refusal.error
                code = error.get("code") if isinstance(error, dict) else "(Ollama's: text only)"
                row = {"body": name, "items": items, **dataclasses.asdict(refusal), "code": code}
                print(row, flush=True)
                rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"commit": git_commit(), "cpu": cpu_name(), "items": args.items}
    (args.out / "results.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    lines = [f"# One invalid body against the HTTP front ({meta['commit']}, {meta['cpu']})", "",
             "| body | items | status | code | refused in | /health longest |", "|---|---:|---:|---|---:|---:|"]
    lines += [f"| {r['body']} | {r['items']:,} | {r['status']} | {r['code']} | {r['seconds'] * 1000:.0f} ms | "
              f"{r['health_longest'] * 1000:.0f} ms |" for r in rows]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
