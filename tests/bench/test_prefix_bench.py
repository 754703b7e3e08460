"""benchmarks/serving/prefix_bench.py runs end to end on the tiny pair: same answers with and without the cache,
hits from turn 2 on, and an ITL row per prefill setting."""

from __future__ import annotations

import json

from benchmarks.serving.prefix_bench import main


def test_prefix_bench_on_the_tiny_pair(tmp_path, capsys):
    main(["--threads", "1", "--max-tokens", "4", "--context-tokens", "200", "--long-tokens", "300", "--chunks", "64",
          "--out", str(tmp_path)])
    report = json.loads((tmp_path / "results.json").read_text())
    for scenario in ("agent", "agent_tools", "rag"):
        rows = report[scenario]
        assert len(rows) == 6 and all(r["same_answer"] for r in rows)
        assert all(r["cached_tokens"] > 0 for r in rows[1:])
    assert all(t["prompt_tokens"] > a["prompt_tokens"] for t, a in zip(report["agent_tools"], report["agent"]))
    assert set(report["itl"]) == {"chunk off", "chunk 64"}
    assert all(r["samples"] > 0 and r["long_ttft_s"] > 0 for r in report["itl"].values())
    assert "### rag" in (tmp_path / "results.md").read_text() and "### itl" in capsys.readouterr().out
