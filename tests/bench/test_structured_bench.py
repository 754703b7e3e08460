"""benchmarks/engine/structured_bench.py on the tiny pair: every output valid, exact SPD equal to target under the grammar, resumable."""

from __future__ import annotations

import json

import pytest

from benchmarks.engine import structured_bench


@pytest.fixture(scope="module")
def run(tiny_pair_dirs, tmp_path_factory):
    target, draft = tiny_pair_dirs
    out = tmp_path_factory.mktemp("structured")
    args = ["--target", str(target), "--draft", str(draft), "--dtype", "float32", "--limit", "2",
            "--max-tokens", "48", "--out", str(out)]
    assert structured_bench.main(args) == 0
    return out, args


def test_every_output_is_valid_and_exact_spd_equals_target(run):
    out, _ = run
    results = json.loads((out / "results.json").read_text())["results"]
    assert {(r["task"], r["method"]) for r in results} == {
        (t, m) for t in ("gsm8k-json", "tool-calls") for m in structured_bench.METHODS}
    rows = [json.loads(line) for line in (out / "items.jsonl").read_text().splitlines()]
    target = {r["id"]: r["tokens"] for r in rows if r["method"] == "target"}
    for r in rows:
        finished = len(r["tokens"]) < 48
        assert r["valid"] or not finished, r  # a grammar it could not finish in 48 tokens is cut, never invalid
        if r["method"] == "spd":
            assert r["tokens"] == target[r["id"]], r["id"]
    tools = [r for r in rows if r["task"] == "tool-calls" and r["method"] != "target"]
    assert all(r["forced"] > 0 for r in tools)  # '<tool_call>\n{"name": "' is forced
    assert "| tool-calls | fly |" in (out / "results.md").read_text()


def test_a_rerun_resumes_instead_of_decoding_again(run):
    out, args = run
    before = (out / "items.jsonl").read_text()
    assert structured_bench.main(args) == 0
    assert (out / "items.jsonl").read_text() == before


def test_judge_rejects_wrong_answers_and_calls():
    item = {"task": "gsm8k-json", "expected": "42"}
    assert structured_bench.judge(item, '{"reasoning": "x", "answer": 42}') == (True, True)
    assert structured_bench.judge(item, '{"reasoning": "x", "answer": 41}') == (True, False)
    assert structured_bench.judge(item, '{"reasoning": "x"}') == (False, False)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'
    item = {"task": "tool-calls", "expected": "calculator"}
    assert structured_bench.judge(item, call) == (True, True)
    assert structured_bench.judge({**item, "expected": "get_weather"}, call) == (True, False)
    assert structured_bench.judge(item, call.replace('"1+1"', "1")) == (False, False)
