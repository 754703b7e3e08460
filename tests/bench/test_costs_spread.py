"""benchmarks.engine.costs_spread estimates one timing's forwards both ways: Costs.measure's median of ratios within
a round, and the replaced ratio of each width's fastest forward."""

from __future__ import annotations

import pytest

from benchmarks.engine.costs_spread import fastest_forwards_ratio, median_ratio
from fly_llm.decoding.policy import Costs
from fly_llm.decoding.stages import DraftModelStage

MODEL = DraftModelStage.name

TARGET = {1: 1.0, 2: 1.05, 4: 1.2, 8: 1.9, 16: 3.5}
DRAFT = {1: 0.45, 2: 0.47, 4: 0.52, 128: 6.4}


def _rounds(lucky_one_token: float) -> list[list[float]]:
    """Five rounds of target then draft seconds; the third round's one-token target forward `lucky_one_token`."""
    rounds = [[*TARGET.values(), *DRAFT.values()] for _ in range(5)]
    rounds[2][0] = lucky_one_token
    return rounds


def test_the_replaced_estimator_divides_by_the_luckiest_one_token_forward():
    assert fastest_forwards_ratio(_rounds(1.0)) == pytest.approx({"c2": 1.05, "c4": 1.2, "c8": 1.9, "c16": 3.5,
                                                                  "step": 0.45})
    dear = fastest_forwards_ratio(_rounds(0.7))
    assert dear["c4"] == pytest.approx(1.2 / 0.7) and dear["step"] == pytest.approx(0.45 / 0.7)


def test_measure_s_figures_are_read_from_its_costs():
    """(Costs.measure's median of ratios itself: tests/engine/test_engine_policy.py.)"""
    costs = Costs(target_widths=((2, 1.05), (4, 1.2), (8, 1.9), (16, 3.5))).with_stage(MODEL, step=0.45)
    assert median_ratio(costs) == pytest.approx({"c2": 1.05, "c4": 1.2, "c8": 1.9, "c16": 3.5, "step": 0.45})
