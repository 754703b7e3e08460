"""benchmarks.engine.policy_ab loads a commit's policy beside this tree's and compares answers paired by item."""

from __future__ import annotations

import math

import pytest

from benchmarks.engine.policy_ab import PLAIN, POLICY_PATH, paired_ratios, report
from benchmarks.harness.at_commit import module_at
from fly_llm.decoding import policy as policy_here
from support.git_checkout import needs_git


@needs_git
def test_a_commits_policy_loads_as_a_module_of_its_own():
    base = module_at("HEAD", POLICY_PATH)
    assert base is not policy_here and base.AdaptivePolicy is not policy_here.AdaptivePolicy
    costs = base.Costs.from_dict({"target_token": 0.2, "draft_step": 0.5})
    assert base.AdaptivePolicy(costs).costs.of("draft_model").step == 0.5


def _row(round_: int, item: int, method: str, tokens: int, decode_s: float, ids: list[int]) -> dict:
    return {"round": round_, "item": item, "method": method, "tokens": tokens, "decode_s": decode_s,
            "seconds": decode_s + 1.0, "model_rounds": 1, "ngram_rounds": 2, "ids": ids}


def test_ratios_pair_each_answer_with_the_same_items_plain_answer():
    rows = [_row(0, 0, PLAIN.name, 100, 4.0, [1]), _row(0, 0, "a", 100, 2.0, [1]),
            _row(0, 1, PLAIN.name, 100, 2.0, [2]), _row(0, 1, "a", 100, 4.0, [3]),
            _row(0, 2, PLAIN.name, 5, 1.0, [4]), _row(0, 2, "a", 5, 0.1, [4])]  # too short to rate
    assert paired_ratios(rows, "a") == pytest.approx([2.0, 0.5])
    text = report(rows, ["a"], ["# title"])
    geometric = math.sqrt(2.0 * 0.5)
    time = (3.0 + 5.0 + 1.1) / (5.0 + 3.0 + 2.0)  # every answer's time end to end, the short one's too
    assert f"| a | 1.250 | {geometric:.3f} [" in text and f"| 2 | {time:.3f} | 3 | 6 | 2 / 3 |" in text
