"""In exact mode a seeded request's text is a function of its seed and its tokens (docs/design.md §1.3).

Each sampled position draws with a uniform keyed by the seed and the position's index in the context,
so what the request is batched with, the policy's costs and plans (how many tokens a round drafts, with
which drafter) and the draft model itself change how fast it is answered, never what it says. A seeded
random walk over those, each checked against the request run alone with plain decoding.
"""

from __future__ import annotations

import random

import pytest
import torch

from fly_llm.common.config import FLyConfig, SamplingParams
from fly_llm.decoding.engine import FLyEngine
from fly_llm.decoding.policy import AdaptivePolicy, Costs
from support.tiny_models import make_pair

torch.set_num_threads(1)

PROMPTS = ["The quick brown fox", "def add(a, b):", "hello hello hello hello", "for i in range(10):", "x"]


@pytest.fixture(scope="module")
def pair():
    return make_pair("llama")


def _answers(engine: FLyEngine, requests: list[tuple[str, str, SamplingParams, FLyConfig]]) -> dict[str, list[int]]:
    """Add every request, step until done (checking the engine's invariants), and return each one's tokens."""
    for rid, prompt, sampling, fly in requests:
        engine.add_request(rid, engine.encode(prompt), sampling, fly=fly)
    out: dict[str, list[int]] = {rid: [] for rid, *_ in requests}
    while engine.has_unfinished():
        for o in engine.step():
            engine.check()
            out[o.request_id] += o.new_token_ids
    return out


@pytest.mark.parametrize("seed", range(6))
def test_a_seeded_request_says_the_same_whatever_runs_beside_it_and_however_it_is_drafted(pair, seed):
    target, draft, tokenizer = pair
    rng = random.Random(seed)
    sampling = SamplingParams(max_tokens=rng.randint(8, 24), temperature=rng.choice([0.5, 0.9, 1.3]),
                              top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(2**31))
    prompt = rng.choice(PROMPTS)
    alone = _answers(FLyEngine(target, tokenizer, draft), [("me", prompt, sampling, FLyConfig(stages=()))])["me"]
    for _ in range(3):
        costs = Costs(target_token=rng.choice([0.007, 0.1, 0.3])).with_stage("draft_model", step=rng.choice([0.1, 0.5]))
        engine = FLyEngine(target, tokenizer, draft if rng.random() < 0.8 else None, policy=AdaptivePolicy(costs))
        mine = rng.choice([FLyConfig(loose=False), FLyConfig(loose=False, adaptive=False, k=rng.randint(1, 8)),
                           FLyConfig(loose=False, stages=("ngram",))])
        if engine.draft is None and "draft_model" in mine.stages:
            mine = mine.model_copy(update={"stages": ("ngram",)})
        others = [(f"o{i}", rng.choice(PROMPTS), SamplingParams(max_tokens=rng.randint(1, 30),
                                                                  temperature=rng.choice([0.0, 0.8])),
                   FLyConfig(loose=rng.random() < 0.5)) for i in range(rng.randint(0, 5))]
        batch = others[:len(others) // 2] + [("me", prompt, sampling, mine)] + others[len(others) // 2:]
        assert _answers(engine, batch)["me"] == alone
