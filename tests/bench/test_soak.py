"""benchmarks/serving/soak.py runs end to end on the tiny pair (a few seconds of traffic) and reports no errors."""

from __future__ import annotations

import json

from benchmarks.serving.soak import main


def test_a_short_soak_on_the_tiny_pair(tmp_path, capsys):
    out = tmp_path / "soak.json"
    main(["--duration", "4", "--max-tokens", "8", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["errors"] == {} and report["served"] > 0 and report["daemon"]["state"] == "ready"
    assert report["long_prompt_tokens"] > 50 and report["rss_mb"]["end"] > 0
    assert json.loads(capsys.readouterr().out) == report
