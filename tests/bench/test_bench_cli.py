"""fly-bench smoke test: the whole CLI on the tiny pair, every method, every field in the JSON."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.harness import cli
from benchmarks.harness.methods import MAIN_METHODS, TARGET_FLOAT, all_methods

SUMMARY_FIELDS = {
    "dataset", "method", "items", "tokens", "seconds", "tokens_per_s", "speedup", "ttft_s", "target_forwards",
    "mat", "loose_rate", "acceptance_by_position", "engine_stats", "metric_name", "metric", "retention",
    "flipped", "agreement", "prefix_agreement", "vs_best_hf", "per_item", "seconds_per_answer", "decode_tokens_per_s",
}
_EACH_TOKEN_ONE_FORWARD = (
    "a token costs at most one target forward, and an item one more: the engine prefills the prompt but its last "
    "token, which goes with the first drafts, so with every draft rejected (random weights: CI's CPU rounds "
    "differently and got MAT 16/17) MAT is just under 1")
ENVIRONMENT_FIELDS = {"target", "draft", "dtype", "device", "threads", "cpu", "versions", "git_commit", "python"}


def _bench(pair_dirs, out, *extra: str) -> dict:
    """Run fly-bench in-process on the tiny pair (1 torch thread, restored afterwards)."""
    target, draft = pair_dirs
    threads = torch.get_num_threads()
    try:
        assert cli.main(["--target", str(target), "--draft", str(draft), "--dtype", "float32",
                         "--threads", "1", "--out", str(out), *extra]) == 0
    finally:
        torch.set_num_threads(threads)
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def report(tiny_pair_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    return out, _bench(tiny_pair_dirs, out, "--limit", "2", "--max-tokens", "16")


def test_every_method_and_dataset_has_every_field(report):
    out, data = report
    assert {"command", "created", "settings", "environment", "methods", "results"} <= data.keys()
    assert ENVIRONMENT_FIELDS <= data["environment"].keys()
    assert data["environment"]["dtype"] == "float32"
    assert data["settings"]["methods"] == MAIN_METHODS  # the target is quantized ('auto', int8 on CPU)
    assert len(data["results"]) == 2 * len(MAIN_METHODS)
    for summary in data["results"]:
        assert SUMMARY_FIELDS <= summary.keys(), summary["method"]
        assert summary["items"] == 2 and len(summary["per_item"]) == 2
        assert 0 < summary["tokens"] <= 2 * 16
        assert summary["tokens_per_s"] > 0 and summary["speedup"] > 0 and summary["mat"] > 0
        assert summary["target_forwards"] <= summary["tokens"] + summary["items"], _EACH_TOKEN_ONE_FORWARD
        if summary["method"] in ("spd", "fly"):
            assert summary["engine_stats"]["rounds"] > 0 and summary["acceptance_by_position"] is not None
    for name in ("results.md", "speedup.png", "mat.png", "acceptance.png", "retention.png"):
        assert (out / name).stat().st_size > 0


def test_exact_methods_reproduce_target_in_float32(report):
    _, data = report
    for summary in data["results"]:
        if summary["method"] in ("target", "spd"):
            assert summary["agreement"] == 1.0, summary["method"]
            assert summary["flipped"] == 0.0 and summary["loose_rate"] == 0.0


def test_markdown_table_lists_every_method(report):
    out, data = report
    table = (out / "results.md").read_text()
    assert data["command"] in table
    for name in MAIN_METHODS:
        assert f"| {name} |" in table


def test_ablations_run_and_target_always_runs(tiny_pair_dirs, tmp_path):
    data = _bench(tiny_pair_dirs, tmp_path, "--dataset", "humaneval", "--limit", "1", "--max-tokens", "8",
                  "--methods", "fly", "--ablate")
    ablations = [name for name in all_methods() if name.startswith("fly-")]
    assert data["settings"]["methods"] == ["target", "fly", *ablations]
    by_method = {s["method"]: s for s in data["results"]}
    assert by_method["fly-ngram-only"]["engine_stats"]["draft_model_rounds"] == 0
    assert by_method["fly-no-gate"]["speedup"] is not None


def test_without_a_draft_the_methods_that_need_one_are_skipped(tiny_pair_dirs, tmp_path):
    target, _ = tiny_pair_dirs
    data = _bench((target, "none"), tmp_path, "--dataset", "gsm8k", "--limit", "1", "--max-tokens", "4",
                  "--methods", "assisted", "fly")
    assert data["settings"]["methods"] == ["target", "fly"]
    assert data["settings"]["skipped"] == {"assisted": "needs a draft model"}
    assert data["environment"]["draft"] is None


def test_llamacpp_decodes_the_targets_gguf(tiny_pair_dirs, tmp_path):
    """Method (f) on a float32 GGUF of the tiny target: llama.cpp's greedy tokens are the target's."""
    pytest.importorskip("llama_cpp")
    from support.tiny_models import write_tiny_gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir, draft_dir = tiny_pair_dirs
    gguf_path = write_tiny_gguf(tmp_path / "target.gguf", AutoModelForCausalLM.from_pretrained(target_dir),
                                AutoTokenizer.from_pretrained(target_dir))
    data = _bench((gguf_path, draft_dir), tmp_path / "out", "--dataset", "humaneval", "--limit", "2",
                  "--max-tokens", "16", "--methods", "llamacpp", "llamacpp-flash-attn", "--target-quantization", "none")
    assert data["settings"]["methods"] == ["target", "llamacpp", "llamacpp-flash-attn"]
    llama, flash = (next(s for s in data["results"] if s["method"] == m) for m in ("llamacpp", "llamacpp-flash-attn"))
    assert llama["tokens"] > 0 and llama["tokens_per_s"] > 0 and llama["mat"] == 1.0
    assert llama["agreement"] == 1.0
    assert flash["tokens"] > 0 and data["methods"]["llamacpp-flash-attn"]["flash_attn"] is True
    fastest = max(llama["tokens_per_s"], flash["tokens_per_s"])  # "vs llama.cpp" is over its faster setting
    assert all(s["vs_llamacpp"] == pytest.approx(s["tokens_per_s"] / fastest) for s in data["results"])


def test_the_float_target_is_a_row_of_its_own_when_the_target_is_quantized(report, tiny_pair_dirs, tmp_path):
    """What quantization costs (target-float vs target) and what FLy costs (fly vs target), separately."""
    _, data = report
    quantized = data["environment"]["target_quantization"] != "none"
    assert (TARGET_FLOAT in data["settings"]["methods"]) == quantized
    plain = _bench(tiny_pair_dirs, tmp_path, "--dataset", "gsm8k", "--limit", "1", "--max-tokens", "8",
                   "--methods", TARGET_FLOAT, "--target-quantization", "none")
    assert plain["environment"]["target_quantization"] == "none"
    assert "unquantized already" in plain["settings"]["skipped"][TARGET_FLOAT]


def test_your_own_prompts_get_speed_and_agreement_unscored(tiny_pair_dirs, tmp_path):
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"prompt": "Summarise: the cat sat on the mat."}\n'
                       '{"messages": [{"role": "user", "content": "Name three rivers."}]}\n', encoding="utf-8")
    data = _bench(tiny_pair_dirs, tmp_path / "out", "--prompts", str(prompts), "--max-tokens", "8",
                  "--methods", "spd", "fly")
    assert data["settings"]["datasets"] == ["prompts:mine"] and data["settings"]["prompts"] == str(prompts)
    by_method = {s["method"]: s for s in data["results"]}
    assert set(by_method) == {"target", "spd", "fly"}
    for s in by_method.values():
        assert s["items"] == 2 and s["metric"] is None and s["metric_name"] == "unscored"
        assert s["tokens_per_s"] > 0 and s["agreement"] is not None
        assert 0 < s["target_forwards"] <= s["tokens"] + s["items"], _EACH_TOKEN_ONE_FORWARD
    assert by_method["spd"]["agreement"] == 1.0
    assert "## prompts:mine (2 items, unscored)" in (tmp_path / "out" / "results.md").read_text()


def test_a_bad_prompt_file_fails_before_the_models_load(tmp_path):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"prompt": "ok"}\n{"prompt": 3}\n', encoding="utf-8")
    with pytest.raises(SystemExit, match="bad.jsonl line 2: prompt: Input should be a valid string"):
        cli.main(["--prompts", str(prompts), "--target", str(tmp_path / "nowhere"), "--out", str(tmp_path)])
