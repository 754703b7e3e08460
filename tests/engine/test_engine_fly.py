"""FLy mode end to end: loose accepts happen, and every emitted token is one the rule allows."""

from __future__ import annotations

import pytest
import torch

import fly_llm.decoding.engine as engine_module
from fly_llm.common.config import FLyConfig, SamplingParams
from fly_llm.decoding.engine import FLyEngine
from fly_llm.decoding.verify import target_entropy
from support.tiny_models import make_pair

torch.set_num_threads(1)  # tiny models: threads only contend on a shared CPU

PROMPTS = ["def add(a, b):", "The quick brown fox", "Question: what is 2 + 3? Answer:", "x"]


@pytest.fixture(scope="module")
def pair():
    return make_pair("llama")


@pytest.mark.parametrize("window,theta", [(2, 0.0), (3, 0.3), (0, 0.0)])
def test_every_token_follows_the_rule(pair, monkeypatch, window, theta):
    target, draft, tokenizer = pair
    rounds = []

    def recording_verify(*args, **kwargs):
        verdict = real_verify(*args, **kwargs)
        rounds.append((verdict.accepted.tolist(), verdict.tokens.tolist(), verdict.loose.tolist()))
        return verdict

    real_verify = engine_module.verify
    monkeypatch.setattr(engine_module, "verify", recording_verify)
    config = FLyConfig(k=8, window=window, entropy_threshold=theta, adaptive=False)
    total_loose = 0
    for prompt in PROMPTS:
        rounds.clear()
        engine = FLyEngine(target, tokenizer, draft, config)
        gen = engine.generate(prompt, SamplingParams(max_tokens=30))[0]
        # The output is exactly the concatenation of what verify emitted, round by round.
        emitted, loose_at = [], []
        for accepted, tokens, loose in rounds:
            a = accepted[0]
            loose_at += [len(emitted) + i for i in range(a) if loose[0][i]]
            emitted += tokens[0][:a + 1]
        assert gen.token_ids == emitted[:len(gen.token_ids)]
        loose_at = [i for i in loose_at if i < len(gen.token_ids)]
        assert len(loose_at) == gen.stats.accepted_loose
        total_loose += len(loose_at)
        # Independently of verify: recompute the target on the final text.
        prompt_ids = tokenizer.encode(prompt)
        with torch.no_grad():
            ids = torch.tensor([prompt_ids + gen.token_ids], device=target.device)
            logits = target(ids).logits[0, len(prompt_ids) - 1:-1]
        choice = logits.argmax(-1).tolist()
        entropy = target_entropy(logits).tolist()
        for i, token in enumerate(gen.token_ids):
            if i not in loose_at:
                assert token == choice[i], (prompt, i)
            else:
                assert token != choice[i]
                assert theta <= 0.01 or entropy[i] >= theta
                after = range(i + 1, min(i + window, len(gen.token_ids)))
                assert all(j not in loose_at and gen.token_ids[j] == choice[j] for j in after)
    if theta == 0.0:
        assert total_loose > 0


def test_exact_rows_stay_exact_next_to_loose_rows(pair):
    """Per-request FLyConfig: a loose=False request batched with FLy requests is still lossless."""
    target, draft, tokenizer = pair
    engine = FLyEngine(target, tokenizer, draft, FLyConfig(k=6, window=2, entropy_threshold=0.0, adaptive=False))
    exact = FLyConfig(k=6, loose=False, adaptive=False)
    sampling = SamplingParams(max_tokens=20)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"fly{i}", engine.encode(prompt), sampling)
    engine.add_request("exact", engine.encode(PROMPTS[0]), sampling, exact)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.request_id == "exact":
                assert out.stats.accepted_loose == 0
    ids = tokenizer.encode(PROMPTS[0])
    ref = target.generate(torch.tensor([ids], device=target.device),
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=target.device),
                          max_new_tokens=20, do_sample=False)[0, len(ids):].tolist()
    assert tokens["exact"] == ref[:len(tokens["exact"])]
    assert engine.stats.accepted_loose > 0


@pytest.mark.parametrize("adaptive", [False, True])
def test_ngram_copies_are_never_loosened(pair, adaptive):
    """With the n-gram stage alone FLy has no draft model's judgement to trust: even with the
    loosest rule (W=0, no gate) the output is the target's greedy one, token for token."""
    target, draft, tokenizer = pair
    engine = FLyEngine(target, tokenizer, draft, FLyConfig(k=8, window=0, entropy_threshold=0.0,
                                                           draft_model=False, adaptive=adaptive))
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        gen = engine.generate(prompt, SamplingParams(max_tokens=24))[0]
        ref = target.generate(torch.tensor([ids], device=target.device),
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=target.device),
                              max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
        assert gen.token_ids == ref[:len(gen.token_ids)], prompt
        assert gen.stats.accepted_loose == 0
    assert engine.stats.drafted > 0  # the n-gram stage did draft
