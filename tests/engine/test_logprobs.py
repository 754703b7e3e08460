"""The target's log-probabilities of emitted and prompt tokens (OpenAI's logprobs), on a tiny float32 pair."""

from __future__ import annotations

import pytest
import torch

from fly_llm.common.config import FLyConfig, SamplingParams
from fly_llm.decoding.engine import FLyEngine
from support.tiny_models import make_pair

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over", "x"]


@pytest.fixture(scope="module")
def engine():
    target, draft, tokenizer = make_pair()
    return FLyEngine(target, tokenizer, draft, FLyConfig(loose=False), prefix_cache_bytes=1 << 22, prefill_chunk=4)


def _run(engine, prompts, **asks):
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=12), **asks)
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    logprobs = {f"r{i}": [] for i in range(len(prompts))}
    prompt_logprobs = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            assert (out.logprobs is None) == ("logprobs" not in asks)
            logprobs[out.request_id] += out.logprobs or []
            if out.prompt_logprobs is not None:
                assert out.request_id not in prompt_logprobs
                prompt_logprobs[out.request_id] = out.prompt_logprobs
    return tokens, logprobs, prompt_logprobs


def test_logprobs_are_the_targets_log_softmax_at_each_position(engine):
    prompts = [engine.encode(p) for p in PROMPTS]
    _run(engine, prompts)  # the prompts are in the prefix cache now: prompt scoring must not skip them
    tokens, logprobs, prompt_logprobs = _run(engine, prompts, logprobs=3, prompt_logprobs=True)
    for i, prompt in enumerate(prompts):
        output = tokens[f"r{i}"]
        whole = torch.tensor([prompt + output])
        with torch.no_grad():
            reference = engine.target(whole).logits[0].float().log_softmax(-1)
        want = [reference[j - 1, t].item() for j, t in enumerate(prompt + output) if j > 0]
        got = [lp for lp, _ in prompt_logprobs.get(f"r{i}", []) + logprobs[f"r{i}"]]
        assert len(got) == len(want) == len(prompt) + len(output) - 1
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
        for j, (lp, top) in enumerate(logprobs[f"r{i}"]):  # greedy: the emitted token is the most likely
            position = len(prompt) - 1 + j
            assert len(top) == 3 and top[0][0] == output[j] and abs(top[0][1] - lp) < 1e-6
            assert [t for t, _ in top] == reference[position].topk(3).indices.tolist()


def test_no_logprobs_unless_asked(engine):
    tokens, logprobs, prompt_logprobs = _run(engine, [engine.encode(PROMPTS[0])])
    assert tokens["r0"] and logprobs["r0"] == [] and prompt_logprobs == {}


def test_the_choices_of_one_prompt_score_it_once_and_share_its_log_probabilities(engine):
    """OpenAI's `n` choices of an echoed prompt (issue 45's amplification): the first choice scores the prompt, the
    others take its log-probabilities (the same list) and its cached prefix; another scope, or other alternatives,
    score it again, with the same values."""
    prompt = engine.encode("The quick brown fox " * 6)
    before = engine.prompt_stats.prefilled_tokens
    tokens, logprobs, prompt_logprobs = _run(engine, [prompt] * 4, logprobs=3, prompt_logprobs=True)
    scored = [prompt_logprobs[f"r{i}"] for i in range(4)]
    assert all(s is scored[0] for s in scored) and len(scored[0]) == len(prompt) - 1
    assert engine.prompt_stats.prefilled_tokens - before < 2 * len(prompt)  # not 4 × the prompt
    with torch.no_grad():
        reference = engine.target(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    want = [reference[j - 1, t].item() for j, t in enumerate(prompt) if j > 0]
    assert max(abs(lp - w) for (lp, _), w in zip(scored[0], want)) < 1e-4
    for asks in ({"cache_scope": "other"}, {"logprobs": 2}):
        _, _, again = _run(engine, [prompt], **{"logprobs": 3, "prompt_logprobs": True} | asks)
        assert again["r0"] is not scored[0] and len(again["r0"]) == len(want)
        assert max(abs(lp - w) for (lp, _), w in zip(again["r0"], want)) < 1e-4
    engine.check()
