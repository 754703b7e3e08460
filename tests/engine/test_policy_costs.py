"""The policy's timed costs are kept per machine and models (fly_llm.policy_costs): timed once, then loaded."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, replace

import pytest
import torch

from fly_llm.common.config import FLyConfig, ModelSpec
from fly_llm.decoding.policy import Costs, StageCost
from fly_llm.loading import load_engine
from fly_llm.model.pair import load_models
from fly_llm.policy_costs import REMEASURE_ENV, costs_identity, costs_path, policy_costs

TIMED = Costs(target_token=0.0123,
              stages={"draft_model": StageCost(step=0.377, prefill=0.0456, widths=((2, 1.08), (4, 1.27)))},
              target_widths=((2, 1.01), (4, 1.05), (8, 1.09), (16, 1.1845)))


@pytest.fixture
def measured(tmp_path, monkeypatch) -> list[tuple]:
    """A private FLY_CACHE_DIR, and Costs.measure replaced by one that records its calls and returns TIMED."""
    monkeypatch.setenv("FLY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(REMEASURE_ENV, raising=False)
    calls: list[tuple] = []

    def measure(target, draft=None, **_):
        calls.append((target, draft))
        return TIMED

    monkeypatch.setattr(Costs, "measure", staticmethod(measure))
    return calls


@pytest.fixture
def spec(tiny_pair_dirs) -> ModelSpec:
    target, draft = tiny_pair_dirs
    return ModelSpec(target=str(target), draft=str(draft), dtype="float32", device="cpu",
                     target_quantization="none", draft_quantization="none")


@pytest.fixture
def loaded(spec):
    return load_models(spec, progress=False)


def test_second_start_loads_the_kept_costs(spec, measured, caplog):
    caplog.set_level(logging.INFO, logger="fly_llm.policy_costs")
    first = load_engine(spec)
    assert len(measured) == 1 and first.policy.costs == TIMED
    assert "policy costs measured" in caplog.text and "target_token=0.0123 (w=2: 1.01, w=4: 1.05" in caplog.text
    assert "draft_model step=0.377 (w=2: 1.08, w=4: 1.27) prefill=0.0456" in caplog.text
    caplog.clear()
    second = load_engine(spec)
    assert len(measured) == 1, "the same models on the same machine are not timed again"
    assert second.policy.costs == first.policy.costs
    path = costs_path(costs_identity(load_models(spec, progress=False)))
    assert f"policy costs loaded from {path}" in caplog.text
    kept = json.loads(path.read_text())
    assert kept["identity"]["threads"] == torch.get_num_threads() and Costs.from_dict(kept["costs"]) == TIMED


def test_defaults_need_no_file(spec, measured, tmp_path):
    assert load_engine(spec, measure_costs=False).policy.costs == Costs()
    assert not measured and not (tmp_path / "cache" / "policy-costs").exists()


def test_thread_count_quantization_or_draft_change_the_key(loaded, measured, monkeypatch):
    policy_costs(loaded)
    others = [replace(loaded, target_quantization="int8"), replace(loaded, draft_quantization="w4a8"),
              replace(loaded, draft=None, draft_name=None)]
    for other in others:
        assert costs_path(costs_identity(other)) != costs_path(costs_identity(loaded))
    for n, other in enumerate(others, start=2):
        policy_costs(other)
        assert len(measured) == n
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    assert costs_identity(loaded)["threads"] == 97
    policy_costs(loaded)
    assert len(measured) == len(others) + 2
    policy_costs(loaded)
    assert len(measured) == len(others) + 2, "each key is timed once"


def test_identity_names_models_kernels_and_machine(loaded, tiny_pair_dirs):
    identity = costs_identity(loaded)
    assert identity["target"]["source"] == str(tiny_pair_dirs[0])
    assert identity["draft"]["source"] == str(tiny_pair_dirs[1])
    assert identity["target"]["parameters"] == sum(p.numel() for p in loaded.target.parameters())
    assert {"w4a8", "row_attention"} <= set(identity["kernels"])
    assert identity["dtype"] == "float32" and identity["device"]["cpu"]
    json.dumps(identity)  # plain JSON values


UNREADABLE = {
    "not JSON": lambda identity: "{not json",
    "other identity": lambda identity: json.dumps({"identity": {}, "costs": asdict(TIMED)}),
    "not a number": lambda identity: json.dumps({"identity": identity, "costs": {"target_token": "x", "stages": {}}}),
    "negative": lambda identity: json.dumps({"identity": identity, "costs": {"target_token": -1, "stages": {}}}),
    "no costs": lambda identity: json.dumps({"identity": identity}),
    "widths not rising": lambda identity: json.dumps({"identity": identity, "costs": {
        **asdict(TIMED), "target_widths": [[4, 1.05], [2, 1.01]]}}),
    "a width's cost not a number": lambda identity: json.dumps({"identity": identity, "costs": {
        **asdict(TIMED), "target_widths": [[2, "x"]]}}),
    "draft widths not rising": lambda identity: json.dumps({"identity": identity, "costs": {
        **asdict(TIMED), "stages": {"draft_model": {"step": 0.4, "prefill": 0.05, "widths": [[4, 1.2], [2, 1.1]]}}}}),
    "an unknown draft cost field": lambda identity: json.dumps({"identity": identity, "costs": {
        **asdict(TIMED), "stages": {"draft_model": {"step": 0.4, "prefill": 0.05, "speed": 2}}}}),
    "a draft width's cost negative": lambda identity: json.dumps({"identity": identity, "costs": {
        **asdict(TIMED), "stages": {"draft_model": {"step": 0.4, "prefill": 0.05, "widths": [[2, -1]]}}}}),
}


@pytest.mark.parametrize("content", UNREADABLE.values(), ids=UNREADABLE.keys())
def test_unreadable_file_is_measured_again(loaded, measured, caplog, content):
    identity = costs_identity(loaded)
    path = costs_path(identity)
    path.parent.mkdir(parents=True)
    path.write_text(content(identity))
    assert policy_costs(loaded) == TIMED and len(measured) == 1
    assert "unreadable" in caplog.text and str(path) in caplog.text
    assert Costs.from_dict(json.loads(path.read_text())["costs"]) == TIMED, "overwritten with the new timing"
    assert [p.name for p in path.parent.iterdir()] == [path.name], "no temporary file left"


def test_remeasure_env_forces_a_new_timing(loaded, measured, monkeypatch):
    policy_costs(loaded)
    monkeypatch.setenv(REMEASURE_ENV, "1")
    policy_costs(loaded)
    assert len(measured) == 2
    monkeypatch.setenv(REMEASURE_ENV, "0")
    policy_costs(loaded)
    assert len(measured) == 2


def test_unwritable_cache_still_gives_the_costs(loaded, measured, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("FLY_CACHE_DIR", str(blocker))  # a file: no directory can be made under it
    assert policy_costs(loaded) == TIMED
    assert "could not keep the policy costs" in caplog.text


def test_multi_stage_costs_round_trip():
    costs = Costs(target_token=0.01, stages={"draft_model": StageCost(0.4, 0.05, ((2, 1.1), (4, 1.3))),
                                             "other_model": StageCost(0.9, 0.1)},
                  target_widths=((2, 1.02), (16, 1.15)))
    assert Costs.from_dict(asdict(costs)) == costs
    assert Costs.from_dict(json.loads(json.dumps(asdict(costs)))) == costs


@pytest.mark.parametrize("step, warned", [(0.377, False), (0.65, True)])
def test_a_draft_too_slow_to_ever_pay_is_named_at_start(spec, measured, monkeypatch, caplog, step, warned):
    """At the embedded pair's target widths of one day, a draft step of 0.65 cannot beat plain decoding by the
    policy's margin even at acceptance 0.9: the policy never runs the draft model, and the start says so."""
    slow = Costs(0.24, {"draft_model": StageCost(step=step, prefill=0.1)},
                 target_widths=((2, 1.089), (4, 1.471), (8, 2.521), (16, 4.646)))
    monkeypatch.setattr(Costs, "measure", staticmethod(lambda target, draft=None, **_: slow))
    caplog.set_level(logging.WARNING, logger="fly_llm.loading")
    engine = load_engine(spec)
    assert engine.policy.model_stages_that_cannot_pay(FLyConfig()) == (["draft_model"] if warned else [])
    assert ("draft model's step costs 0.65 of a target step" in caplog.text) == warned
    assert (REMEASURE_ENV in caplog.text) == warned
