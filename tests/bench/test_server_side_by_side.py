"""benchmarks/serving/server_side_by_side.py's pure parts: the decode rate, resuming parts, medians and ratios."""

from __future__ import annotations

import json

from benchmarks.serving.server_side_by_side import Prompt, decode_rate, markdown, pending, read_jsonl, summarize


def row(server: str, prompt_id: str, kind: str, ttft: float, e2e: float, tokens: int = 31, text: str = "a",
        round_: int = 1) -> dict:
    return {"round": round_, "server": server, "prompt_id": prompt_id, "kind": kind, "ttft_s": ttft,
            "decode_tokens_per_s": 0.0, "e2e_s": e2e, "completion_tokens": tokens, "text": text, "commit": "abc"}


def test_decode_rate_counts_the_tokens_after_the_first_over_the_time_after_it():
    assert decode_rate(11, 1.0, 3.0) == 5.0
    assert decode_rate(9, 1.0, 3.0) == 4.0 and decode_rate(8, 1.0, 3.0) is None  # too short to time
    assert decode_rate(11, 2.0, 2.0) is None


def test_pending_skips_what_this_server_and_round_already_measured(tmp_path):
    prompts = [Prompt(p, "code", []) for p in ("a", "b", "c")]
    path = tmp_path / "rows.jsonl"
    assert read_jsonl(path) == []
    path.write_text("".join(json.dumps(r) + "\n" for r in
                            [row("fly", "a", "code", 1, 2), row("llamacpp", "b", "code", 1, 2)]))
    rows = read_jsonl(path)
    assert [p.prompt_id for p in pending(rows, "fly", 1, prompts)] == ["b", "c"]
    assert [p.prompt_id for p in pending(rows, "fly", 2, prompts)] == ["a", "b", "c"]


def test_summary_medians_per_prompt_over_rounds_then_over_prompts_and_ratios_to_llamacpp():
    rows = [row("llamacpp", "a", "code", 1.0, 4.0, text="x"), row("llamacpp", "b", "rag", 3.0, 6.0, tokens=2),
            row("fly", "a", "code", 0.5, 2.0, text="x"), row("fly", "a", "code", 0.5, 1.5, round_=2),
            row("fly", "b", "rag", 1.5, 2.0, tokens=2, text="y")]
    summary = summarize(rows)
    assert summary["llamacpp"]["all"] == {"ttft_s": 2.0, "decode_tokens_per_s": 10.0, "e2e_s": 5.0}
    assert summary["fly"]["code"] == {"ttft_s": 0.5, "decode_tokens_per_s": 25.0, "e2e_s": 1.75}
    assert summary["fly"]["rag"]["decode_tokens_per_s"] is None  # two tokens: too short to time
    assert summary["fly"]["all"] == {"ttft_s": 1.0, "decode_tokens_per_s": 25.0, "e2e_s": 1.875}
    assert summary["fly"]["vs_llamacpp"]["all"]["decode_tokens_per_s"] == 2.5
    assert summary["fly"]["vs_llamacpp"]["tokens_per_s_end_to_end"] == round(round(64 / 5.5, 2) / 3.3, 2)
    assert summary["fly"]["rounds"] == 2 and summary["same_text_as_llamacpp"]["fly"] == "1/3"
    text = markdown(summary, {"cpu": "cpu", "commits_measured": ["abc"], "command": "cmd"})
    assert "| fly | 3 | 1.0 | 25.0 | 1.875 |" in text and "code" in text and "rag" in text
