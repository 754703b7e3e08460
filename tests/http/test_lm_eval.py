"""lm-evaluation-harness's `local-completions` (a log-likelihood and a generate-until task) and
`local-chat-completions` (generate-until) against the HTTP front on the tiny pair, in exact mode, unquantized
(benchmarks/serving/lm_eval_check.py). The log-likelihoods lm-eval reads from `echo` + `logprobs` are the tiny
target's own, computed here in-process."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.serving.lm_eval_check import GENERATE_TASK, ITEMS, LOGLIKELIHOOD_TASK, parse_args, run_check

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                reason="needs lm-evaluation-harness (pip install lm-eval; not a fly-llm extra)")


def reference_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """The target's log-probability of `continuation` after `context`, tokenized as lm-eval does (apart)."""
    ctx = tokenizer.encode(context, add_special_tokens=False)
    cont = tokenizer.encode(continuation, add_special_tokens=False)
    with torch.no_grad():
        logits = model(torch.tensor([ctx + cont])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(ctx) - 1:-1], dim=-1)
    return float(logprobs[torch.arange(len(cont)), torch.tensor(cont)].sum())


def test_lm_eval_runs_its_completion_and_chat_models_against_the_front(tiny_pair_dirs, tmp_path):
    target, draft = tiny_pair_dirs
    runs = run_check(parse_args(["--target", str(target), "--draft", str(draft), "--quantization", "none",
                                 "--out", str(tmp_path)]))

    assert [(r.model, r.tasks) for r in runs] == [
        ("local-completions", [LOGLIKELIHOOD_TASK, GENERATE_TASK]), ("local-chat-completions", [GENERATE_TASK])]
    for run in runs:
        assert run.passed, run
    completions = runs[0]
    assert completions.ok_requests == 2 * len(ITEMS) + len(ITEMS)  # one scoring request per choice, one per answer
    assert "acc,none" in completions.metrics[LOGLIKELIHOOD_TASK]
    assert "exact_match,none" in runs[1].metrics[GENERATE_TASK]

    samples = next(Path(completions.results_file).parent.glob(f"samples_{LOGLIKELIHOOD_TASK}_*.jsonl"))
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target)
    scored = 0
    for line in samples.read_text().splitlines():
        sample = json.loads(line)
        for args, (loglikelihood, _greedy) in zip(sample["arguments"].values(), sample["filtered_resps"]):
            expected = reference_loglikelihood(model, tokenizer, args["arg_0"], args["arg_1"])
            assert float(loglikelihood) == pytest.approx(expected, abs=1e-3), args
            scored += 1
    assert scored == 2 * len(ITEMS)
