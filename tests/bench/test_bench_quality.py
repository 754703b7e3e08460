"""fly-bench --quality on the tiny pair: batched decoding equals one-at-a-time, parts resume and merge
into the same report, the statistics match hand-computed cases, bad methods fail before loading."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from benchmarks.harness import cli
from benchmarks.harness.confidence import flips, mcnemar_p, retention_interval, wilson_interval
from benchmarks.harness.quality_run import QUALITY_METHODS, SingleStreamPolicy, part_path, read_records, read_sittings

RUN = ["--dataset", "humaneval", "gsm8k", "--limit", "2", "--max-tokens", "12"]
TIMING_FIELDS = {"throughput_tokens_per_s", "sittings", "batch"}


def _quality(pair_dirs, out, *extra: str) -> dict:
    """A quality run in-process on the tiny pair (float32, 1 torch thread, restored afterwards)."""
    target, draft = pair_dirs
    threads = torch.get_num_threads()
    try:
        assert cli.main(["--quality", "--target", str(target), "--draft", str(draft), "--dtype", "float32",
                         "--target-quantization", "none", "--threads", "1", "--out", str(out), *extra]) == 0
    finally:
        torch.set_num_threads(threads)
    return json.loads((out / "quality.json").read_text())


def _without_timing(report: dict) -> list[dict]:
    return [{k: v for k, v in s.items() if k not in TIMING_FIELDS} for s in report["results"]]


@pytest.fixture(scope="module")
def batched(tiny_pair_dirs, tmp_path_factory):
    """A run whose policy sees a draft model 20x cheaper than the target, as on a real pair: the tiny
    pair's draft costs what its target does, so timed costs would plan only n-gram and plain rounds,
    and FLy loosens only draft-model rounds. Its catch-up prefill is free, so 12-token answers run it."""
    out = tmp_path_factory.mktemp("quality_batched")
    (out / "policy_costs.json").write_text(json.dumps({"target_token": 0.05, "draft_step": 0.05, "draft_prefill": 0}))
    return out, _quality(tiny_pair_dirs, out, *RUN, "--batch", "4")


def test_batched_decoding_equals_one_at_a_time(tiny_pair_dirs, tmp_path):
    """Same tokens and scores at batch 4 and batch 1: each row drafts as it would alone (the quality
    run's policy plans every row as at batch 1), so FLy's loose acceptances do not depend on the batch."""
    methods = ["--methods", "spd", "fly", "fly-fixed-k8"]
    tokens = {}
    for batch in ("4", "1"):
        out = tmp_path / batch
        _quality(tiny_pair_dirs, out, *RUN, *methods, "--batch", batch)
        tokens[batch] = {(d, m): {i: (r.token_ids, r.passed, r.hit_limit)
                                  for i, r in read_records(part_path(out, d, m)).items()}
                         for d in ("humaneval", "gsm8k") for m in ("target", "spd", "fly", "fly-fixed-k8")}
    assert tokens["4"] == tokens["1"]
    assert all(len(v) == 2 for v in tokens["4"].values())
    fly = read_records(part_path(tmp_path / "4", "gsm8k", "fly")).values()
    assert sum(r.stats["drafted"] for r in fly) > 0  # FLy drafted in the batch (not plain decoding)


def test_the_quality_policy_plans_as_if_each_row_ran_alone():
    from fly_llm.common.config import FLyConfig
    from fly_llm.decoding.policy import AdaptivePolicy, Costs, PolicyState

    from fly_llm.decoding.stages import DraftModelStage, NgramStage

    costs = Costs(target_token=0.2).with_stage(DraftModelStage.name, step=0.3)  # grows fast with the batch
    fly, offered = FLyConfig(), (NgramStage, DraftModelStage)
    alone = AdaptivePolicy(costs).plan(PolicyState(), fly, 100, 1, offered)
    assert alone.k > 0 and AdaptivePolicy(costs).plan(PolicyState(), fly, 100, 8, offered).k == 0
    assert SingleStreamPolicy(costs).plan(PolicyState(), fly, 100, 8, offered) == alone


def test_the_quality_policy_learns_from_a_round_as_if_its_row_ran_alone():
    """A batched round's realized cost must not count the batch: else a batched quality run stops
    drafting where the same item alone drafts (as a GSM8K part at --batch 4 did: MAT 1.14)."""
    from fly_llm.decoding.policy import AdaptivePolicy, Costs, PolicyState
    from fly_llm.decoding.stages import DraftModelStage, DraftPlan

    costs = Costs(target_token=0.2).with_stage(DraftModelStage.name, step=0.3)
    plan = DraftPlan(k=8, stages=(DraftModelStage.name,), model=True)
    alone, batched = PolicyState(), PolicyState()
    AdaptivePolicy(costs).observe(alone, plan, 8, 3, 8, batch_size=1)
    SingleStreamPolicy(costs).observe(batched, plan, 8, 3, 8, batch_size=4)
    assert batched == alone


def test_report_has_every_method_and_exact_spd_is_the_target(batched):
    out, report = batched
    assert report["settings"]["methods"] == QUALITY_METHODS
    assert [(s["dataset"], s["method"]) for s in report["results"]] == [
        (d, m) for d in ("humaneval", "gsm8k") for m in QUALITY_METHODS]
    by = {(s["dataset"], s["method"]): s for s in report["results"]}
    for dataset in ("humaneval", "gsm8k"):
        spd = by[dataset, "spd"]
        assert spd["agreement"] == 1.0 and spd["pass_to_fail"] == spd["fail_to_pass"] == 0 and spd["loose_rate"] == 0
        assert spd["strict_items"] == 2 and spd["strict_differ"] == 0
        assert by[dataset, "target"]["mat"] == 1.0 and spd["mat"] >= 1.0
        assert by[dataset, "fly-w0"]["loose_rate"] > 0  # W=0 accepts any gated mismatch of the draft model
        for s in by.values():
            assert s["items"] == s["paired_items"] == 2 and s["throughput_tokens_per_s"] > 0
            assert s["metric_ci"][0] <= s["metric"] <= s["metric_ci"][1]
    for name in ("quality.md", "retention_ci.png"):
        assert (out / name).stat().st_size > 0
    assert "| fly-no-gate | 2 |" in (out / "quality.md").read_text()


def test_an_interrupted_run_resumes_and_parts_merge_into_the_same_report(tiny_pair_dirs, tmp_path):
    """One item at a time, so that which items shared a batch cannot differ between the runs; the
    policy's costs are timed once per run directory and copied with the parts, as a user would."""
    whole = tmp_path / "whole"
    report = _quality(tiny_pair_dirs, whole, *RUN, "--batch", "1")
    costs = whole / "policy_costs.json"
    # A run stopped part-way: one item of one part lost, another part never started.
    resumed = tmp_path / "resumed"
    shutil.copytree(whole / "parts", resumed / "parts")
    shutil.copy(costs, resumed)
    fly = part_path(resumed, "gsm8k", "fly")
    fly.write_text(fly.read_text().splitlines()[0] + "\n")
    for path in (part_path(resumed, "gsm8k", "spd"), part_path(resumed, "gsm8k", "spd").with_suffix(".timing.jsonl")):
        path.unlink()
    again = _quality(tiny_pair_dirs, resumed, *RUN, "--batch", "1")
    assert _without_timing(again) == _without_timing(report)
    assert [s.items for s in read_sittings(fly)] == [2, 1]  # the first sitting, then only the lost item
    # Two runs on different datasets (other sittings), merged by copying the parts.
    merged, other = tmp_path / "merged", tmp_path / "other"
    for out, dataset in ((merged, "humaneval"), (other, "gsm8k")):
        out.mkdir()
        shutil.copy(costs, out)
        _quality(tiny_pair_dirs, out, "--dataset", dataset, "--limit", "2", "--max-tokens", "12", "--batch", "1")
    for path in (other / "parts").iterdir():
        shutil.copy(path, merged / "parts" / path.name)
    assert _without_timing(_quality(tiny_pair_dirs, merged, *RUN, "--report-only")) == _without_timing(report)


def test_methods_that_cannot_batch_fail_before_the_models_load(tmp_path):
    with pytest.raises(SystemExit, match="'assisted' does not run batched"):
        cli.main(["--quality", "--methods", "assisted", "--target", str(tmp_path / "nowhere"), "--out", str(tmp_path)])
    with pytest.raises(SystemExit):  # argparse: --report-only belongs to --quality
        cli.main(["--report-only", "--out", str(tmp_path)])


def test_wilson_interval_matches_the_hand_computed_case():
    # 8 of 10: p = 0.8, z = 1.96; centre (0.8 + z²/20) / (1 + z²/10) = 0.71674,
    # half-width z / (1 + z²/10) * sqrt(0.016 + z²/400) = 0.22658.
    low, high = wilson_interval(8, 10)
    assert low == pytest.approx(0.49016, abs=1e-4) and high == pytest.approx(0.94332, abs=1e-4)
    assert wilson_interval(0, 5)[0] == 0.0 and wilson_interval(5, 5)[1] == 1.0
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_flips_and_mcnemar_match_the_hand_computed_cases():
    method = [True, False, False, True, True, False, True]
    reference = [True, True, False, False, False, False, False]
    assert flips(method, reference) == (1, 3)
    assert mcnemar_p(1, 3) == pytest.approx(2 * (1 + 4) / 16)  # binomial(4, ½): P(X ≤ 1) doubled
    assert mcnemar_p(1, 6) == pytest.approx(0.125)
    assert mcnemar_p(0, 5) == pytest.approx(0.0625)
    assert mcnemar_p(0, 0) == 1.0 and mcnemar_p(3, 3) == 1.0


def test_retention_interval_matches_the_exact_bootstrap_distribution():
    # The reference passes all 4 items and the method 3: a resample's ratio is X/4 with X ~ binomial(4, ¾).
    # P(X = 0) = 0.004 < 2.5% ≤ P(X ≤ 1) = 0.051, and P(X ≤ 3) = 0.68 < 97.5%: the interval is [¼, 1].
    assert retention_interval([True, True, True, False], [True] * 4) == (0.25, 1.0)
    same = [True, False, True, True, False]
    assert retention_interval(same, same) == (1.0, 1.0)
    assert retention_interval([True], [False]) is None
    with pytest.raises(ValueError):
        retention_interval([True], [True, False])


def test_the_target_part_runs_after_the_other_methods(monkeypatch, tmp_path):
    """So that a `--methods fly` run and a `--methods target` run started side by side into one
    directory do not both decode the target-only part first."""
    from types import SimpleNamespace

    from benchmarks.harness import quality_run
    from benchmarks.harness.methods import all_methods

    order = []
    monkeypatch.setattr(quality_run, "run_part", lambda runner, method, *rest: order.append(method.name))
    runner = SimpleNamespace(engine=SimpleNamespace(context_window=100))
    item = SimpleNamespace(item_id="x")
    methods = [all_methods()[name] for name in ("target", "fly", "spd")]
    quality_run.run_quality(runner, methods, {"d": ([item], [[1, 2]])}, tmp_path, 1, 1.0)
    assert order == ["fly", "spd", "target"]


def test_parts_from_different_machines_are_flagged(batched, tiny_pair_dirs, tmp_path):
    """Each sitting records what decoded it; a dataset whose parts come from different kinds of machine
    gets a warning in the report (their greedy tokens differ for reasons other than the method)."""
    out, report = batched
    assert all(s["machines"] == [report["results"][0]["machines"][0]] for s in report["results"])
    assert report["results"][0]["machines"][0].startswith("cpu ")
    assert "Warning" not in (out / "quality.md").read_text()
    mixed = tmp_path / "mixed"
    shutil.copytree(out / "parts", mixed / "parts")
    shutil.copy(out / "policy_costs.json", mixed)
    timing = part_path(mixed, "gsm8k", "spd").with_suffix(".timing.jsonl")
    timing.write_text(json.dumps({**json.loads(timing.read_text()), "machine": "cpu AVX2 float32"}) + "\n")
    _quality(tiny_pair_dirs, mixed, *RUN, "--report-only")
    humaneval, gsm8k = (mixed / "quality.md").read_text().split("## gsm8k")
    gsm8k = gsm8k.split("Methods:")[0]
    assert "Warning" not in humaneval and "cpu AVX2 float32" in gsm8k and "numerics agree" in gsm8k
    assert "spd 0 of 2 differ" in gsm8k

    # An exact-SPD item (no loose acceptance) whose tokens differ from target-only's: other numerics.
    spd = part_path(mixed, "gsm8k", "spd")
    records = [json.loads(line) for line in spd.read_text().splitlines()]
    records[0]["token_ids"] = records[0]["token_ids"][:-1] + [records[0]["token_ids"][-1] + 1]
    spd.write_text("".join(json.dumps(r) + "\n" for r in records))
    report = _quality(tiny_pair_dirs, mixed, *RUN, "--report-only")
    gsm8k = (mixed / "quality.md").read_text().split("## gsm8k")[1].split("Methods:")[0]
    assert "spd 1 of 2 differ" in gsm8k and "compare numerics, not methods" in gsm8k
    assert {(s["dataset"], s["method"]): s["strict_differ"] for s in report["results"]}["gsm8k", "spd"] == 1


def test_the_machine_kind_names_the_thread_count_that_changes_int8_numerics():
    import torch
    from torch import nn

    from benchmarks.harness.quality_run import machine_kind

    model = nn.Linear(2, 2)
    model.device, model.dtype = torch.device("cpu"), torch.float32
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = machine_kind(model)
        torch.set_num_threads(2)
        assert machine_kind(model) != one and one.endswith("float32 1 threads")
    finally:
        torch.set_num_threads(before)


class _GreedyLlama:
    """A stand-in for llama_cpp.Llama over the tiny target: greedy tokens one at a time, as `generate` yields them."""

    def __init__(self, model) -> None:
        self.model = model

    def reset(self) -> None:
        pass

    def generate(self, prompt_ids, top_k, temp, repeat_penalty, reset):
        assert (top_k, temp, repeat_penalty) == (1, 0.0, 1.0)  # greedy, nothing else
        ids = list(prompt_ids)
        with torch.inference_mode():
            while True:
                token = int(self.model(torch.tensor([ids])).logits[0, -1].argmax())
                ids.append(token)
                yield token


def test_llamacpp_is_a_quality_method_decoding_one_item_at_a_time(tiny_pair_dirs, tmp_path, monkeypatch):
    """The llamacpp part is decoded item by item on llama.cpp's own decoder (here a greedy stand-in over the
    same float32 target), scored and reported beside the target: equal tokens when the decoders agree."""
    from contextlib import contextmanager

    from benchmarks.harness import methods

    monkeypatch.setattr(methods, "llamacpp_installed", lambda: True)
    monkeypatch.setattr(cli, "llamacpp_installed", lambda: False)  # no llama_cpp module to ask for its build

    @contextmanager
    def some_gguf(target, wanted):
        yield tmp_path / "target.gguf" if wanted else None

    monkeypatch.setattr(cli, "model_gguf", some_gguf)
    loaded: list[bool] = []

    def greedy_llama(runner, flash_attn):
        loaded.append(flash_attn)
        return _GreedyLlama(runner.target)

    monkeypatch.setattr(methods.Runner, "llama", greedy_llama)
    both = ("llamacpp", "llamacpp-flash-attn")
    report = _quality(tiny_pair_dirs, tmp_path / "out", *RUN, "--methods", "target", *both, "--batch", "2")
    assert set(loaded) == {False, True}  # llama-cpp-python's default (flash attention off), llama.cpp's (on)
    for dataset in ("humaneval", "gsm8k"):
        ours = read_records(part_path(tmp_path / "out", dataset, "target"))
        for method in both:
            theirs = read_records(part_path(tmp_path / "out", dataset, method))
            assert len(theirs) == 2 and {i: r.token_ids for i, r in theirs.items()} == {
                i: r.token_ids for i, r in ours.items()}
            assert [s.batch for s in read_sittings(part_path(tmp_path / "out", dataset, method))] == [1]
    assert {(s["dataset"], s["method"]) for s in report["results"]} >= {
        (dataset, method) for dataset in ("gsm8k", "humaneval") for method in both}
    monkeypatch.setattr(methods, "llamacpp_installed", lambda: False)  # a report decodes nothing: not needed
    again = _quality(tiny_pair_dirs, tmp_path / "out", *RUN, "--methods", "target", *both, "--report-only")
    assert _without_timing(again) == _without_timing(report)
