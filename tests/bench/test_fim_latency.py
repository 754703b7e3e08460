"""benchmarks/serving/fim_latency.py's pure parts: cutting the file at cursors, the keystroke sequence,
resuming parts, percentiles and the report."""

from __future__ import annotations

import json

import pytest

from benchmarks.serving.fim_latency import (
    MIN_TYPED,
    FimRequest,
    build_requests,
    lines_within,
    markdown,
    parse_args,
    pending,
    percentile,
    psm_prompt,
    read_jsonl,
    summarize,
)


def words(text: str) -> int:
    """A stand-in tokenizer: one token per word."""
    return len(text.split())


SOURCE = "".join(f"    value_{i} = compute(alpha_{i}, beta_{i}, gamma_{i})\n" if i % 3 else "\n" for i in range(60))
"""60 lines: every third one blank, the others 5 words long."""


def test_lines_within_takes_whole_lines_nearest_the_cursor_within_the_budget():
    lines = ["a b\n", "c d e\n", "f\n"]
    assert lines_within(lines, 4, words, from_end=True) == "c d e\nf\n"
    assert lines_within(lines, 5, words, from_end=False) == "a b\nc d e\n"
    assert lines_within(lines, 0, words, from_end=True) == ""


def test_each_position_types_its_line_a_few_characters_more_per_keystroke():
    requests = build_requests(SOURCE, words, positions=3, keystrokes=4, chars=3, prefix_tokens=20, suffix_tokens=10)
    assert [q.request_id for q in requests[:5]] == ["p0k0", "p0k1", "p0k2", "p0k3", "p1k0"]
    lines = SOURCE.splitlines(keepends=True)
    for p in range(3):
        mine = [q for q in requests if q.position == p]
        assert [q.keystroke for q in mine] == [0, 1, 2, 3]
        assert len({q.suffix for q in mine}) == 1  # the code below stays; the line is being written
        for a, b in zip(mine, mine[1:]):
            assert b.prefix.startswith(a.prefix) and len(b.prefix) - len(a.prefix) == 3
        typed = mine[0].prefix.split("\n")[-1]
        assert typed == "    " + lines[[line.startswith(typed) for line in lines].index(True)][4:4 + MIN_TYPED]
        last_typed = mine[-1].prefix.split("\n")[-1]
        line = next(line for line in lines if line.startswith(last_typed))
        # the prefix and suffix are the file around the cursor, whole lines within the budgets
        whole = mine[0].prefix[: -len(typed)] + line + mine[0].suffix
        assert whole in SOURCE
        assert 20 - 5 < words(mine[0].prefix[: -len(typed)]) <= 20 and 10 - 5 < words(mine[0].suffix) <= 10
    assert len({q.prefix for q in requests if q.keystroke == 0}) == 3  # three different cursors


def test_positions_are_spread_over_the_lines_with_room_for_both_budgets():
    requests = build_requests(SOURCE, words, positions=2, keystrokes=2, chars=3, prefix_tokens=100, suffix_tokens=50)
    lines = SOURCE.splitlines(keepends=True)
    starts = []
    for q in requests:
        if q.keystroke == 0:
            above = q.prefix[: q.prefix.rindex("\n") + 1]
            starts.append(SOURCE[: SOURCE.index(above) + len(above)].count("\n"))  # the cursor's line
            assert words(above) > 95 and words(q.suffix) > 45
    assert starts[0] < starts[1] and all(lines[i].strip() for i in starts)
    with pytest.raises(SystemExit, match="long enough"):
        build_requests(SOURCE, words, positions=3, keystrokes=30, chars=3, prefix_tokens=1, suffix_tokens=1)


def test_pending_skips_what_this_server_already_measured(tmp_path):
    requests = [FimRequest(f"p0k{k}", 0, k, "a", "b") for k in range(3)]
    path = tmp_path / "rows.jsonl"
    assert read_jsonl(path) == []
    path.write_text(json.dumps(row("fly", "p0k0", 1.0)) + "\n" + json.dumps(row("target", "p0k1", 1.0)) + "\n")
    assert [q.request_id for q in pending(read_jsonl(path), "fly", requests)] == ["p0k1", "p0k2"]


def test_percentile_is_linear_between_ranks():
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == 4.8
    assert percentile([], 50) is None


def row(server: str, request_id: str, seconds: float, tokens: int = 64, content: str = "x") -> dict:
    position, keystroke = (int(x) for x in request_id[1:].split("k"))
    return {"server": server, "request_id": request_id, "position": position, "keystroke": keystroke,
            "e2e_s": seconds, "tokens_predicted": tokens, "content": content, "commit": "abc"}


def test_summary_gives_percentiles_per_server_ratios_to_llamacpp_and_the_aim():
    rows = [row("llamacpp", "p0k0", 2.0), row("llamacpp", "p0k1", 1.0), row("llamacpp", "p1k0", 3.0),
            row("fly", "p0k0", 1.0, content="y"), row("fly", "p0k1", 0.5), row("fly", "p1k0", 1.5, tokens=10),
            row("target", "p0k0", 2.5), row("target", "p0k1", 2.0), row("target", "p1k0", 4.0)]
    summary = summarize(rows)
    assert summary["llamacpp"]["all"] == {"requests": 3, "p50_s": 2.0, "p95_s": 2.9, "mean_tokens": 64.0}
    assert summary["fly"]["first"]["p50_s"] == 1.25 and summary["fly"]["keystrokes"]["p50_s"] == 0.5
    assert summary["fly"]["all"]["mean_tokens"] == 46.0
    assert summary["fly"]["vs_reference"] == {"p50": 0.5, "p95": 0.5, "same_content": "2/3"}
    assert summary["aim"] == {"fly_p50_over_reference": 0.5, "aim": 0.7, "met": True}
    assert summary["target"]["keystrokes"]["p50_s"] == 2.0
    settings = {"cpu": "cpu", "commits_measured": ["abc"], "command": "cmd", "n_predict": 64,
                "source": {"path": "f.py", "commit": "c", "sha256": "0" * 64},
                "requests": {"positions": 2, "keystrokes": 2, "chars_per_keystroke": 3, "prefix_tokens_mean": 1500,
                             "suffix_tokens_mean": 300},
                "llama_server_build": "flags"}
    text = markdown(summary, settings)
    assert "| fly | 3 | 1.0 | 1.45 | 46.0 | 1.25 | 0.5 | 0.5 | 0.5 | 2/3 |" in text
    assert "aim ≤ 0.7: met" in text and "llama-server build: flags" in text
    assert "aim" not in summarize([r for r in rows if r["server"] != "fly"])


def test_servers_are_compared_on_the_requests_every_one_of_them_measured():
    rows = [row("llamacpp", "p0k0", 2.0), row("llamacpp", "p0k1", 1.0), row("fly", "p0k0", 1.0)]
    summary = summarize(rows)
    assert summary["llamacpp"]["all"]["requests"] == 1 and summary["fly"]["vs_reference"]["p50"] == 0.5
    assert summarize([r for r in rows if r["server"] == "llamacpp"])["llamacpp"]["all"]["requests"] == 2
    assert summarize([row("target", "p0k0", 1.0)])["target"]["keystrokes"] == {
        "requests": 0, "p50_s": None, "p95_s": None, "mean_tokens": None}


def test_llamacpp_python_is_the_reference_when_llama_server_did_not_run():
    rows = [row("llamacpp-python", "p0k0", 2.0), row("fly", "p0k0", 1.0)]
    summary = summarize(rows)
    assert summary["reference"] == "llamacpp-python" and summary["aim"]["fly_p50_over_reference"] == 0.5
    assert summarize(rows + [row("llamacpp", "p0k0", 4.0)])["reference"] == "llamacpp"
    assert psm_prompt(FimRequest("x", 0, 0, "a = ", "\nb")) == "<|fim_prefix|>a = <|fim_suffix|>\nb<|fim_middle|>"


def test_a_part_or_the_report_must_be_asked_for():
    with pytest.raises(SystemExit):
        parse_args([])
    assert parse_args(["--server", "fly"]).embedded
