"""The samplers through FLyEngine with the tiny pair in float32 (issue 47).

Exact speculative sampling must follow the target's *filtered* distribution (temperature, top_k, min_p,
penalties) token by token, including a token emitted at position 1 of a speculative block, whose penalty
history holds the draft token kept at position 0; greedy exact mode with penalties must equal target-only
decoding (and Hugging Face's own repetition_penalty) token for token.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from fly_llm.common.config import FLyConfig, SamplingParams
from fly_llm.decoding.distributions import distributions
from fly_llm.decoding.engine import FLyEngine
from fly_llm.decoding.penalties import Penalty
from support.tiny_models import greedy_tokens, make_pair

torch.set_num_threads(1)  # tiny models: threads only contend on a shared CPU

PROMPTS = ["The quick brown fox", "def add(a, b):", "Question: what is 2 + 3? Answer:", "x"]
EXACT = FLyConfig(loose=False, adaptive=False)  # the draft model drafts every round it may
MODEL_DRAFTS = FLyConfig(loose=False, adaptive=False, stages=("draft_model",))
TARGET_ONLY = FLyConfig(stages=())


@pytest.fixture(scope="module")
def pair():
    return make_pair("llama")


def decode(pair, fly: FLyConfig, requests: list[tuple[list[int], SamplingParams]]) -> tuple[list[list[int]], FLyEngine]:
    """Every request's output tokens, decoded together in one engine (checked after each step)."""
    target, draft, tokenizer = pair
    engine = FLyEngine(target, tokenizer, draft, fly)
    for i, (prompt, sampling) in enumerate(requests):
        engine.add_request(str(i), prompt, sampling)
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(requests))}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None
            outputs[out.request_id] += out.new_token_ids
        engine.check()
    return [outputs[str(i)] for i in range(len(requests))], engine


# --- greedy: penalties change the argmax, the same way with and without speculation --------------------------

PENALTIES = [dict(repetition_penalty=1.3, repeat_last_n=-1), dict(presence_penalty=1.5, frequency_penalty=0.7,
                                                                  repeat_last_n=16),
             dict(repetition_penalty=0.8, frequency_penalty=-0.5, repeat_last_n=3), dict(top_k=1, min_p=0.9)]


def test_greedy_exact_mode_with_penalties_equals_target_only_token_for_token(pair):
    """Rows with different penalties (and none) in one batch: FLy off with the draft model every round gives the
    target-only output of each row; the penalties changed it."""
    tokenizer = pair[2]
    requests = [(tokenizer.encode(p), SamplingParams(max_tokens=40, **settings))
                for p in PROMPTS for settings in [{}, *PENALTIES]]
    speculative, engine = decode(pair, EXACT, requests)
    assert engine.stats.draft_model_rounds > 0 and engine.stats.accepted_native > 0
    plain, _ = decode(pair, TARGET_ONLY, requests)
    assert speculative == plain
    unpenalized = {tuple(r[0]): out for r, out in zip(requests, plain) if r[1] == SamplingParams(max_tokens=40)}
    changed = [out != unpenalized[tuple(r[0])] for r, out in zip(requests, plain) if r[1].repeat_last_n != 64]
    assert sum(changed) >= len(changed) // 2


def test_greedy_repetition_penalty_equals_hugging_faces(pair):
    """repeat_last_n -1 (the whole context) is Hugging Face's RepetitionPenaltyLogitsProcessor."""
    target, _, tokenizer = pair
    ids = [tokenizer.encode(p) for p in PROMPTS]
    outputs, _ = decode(pair, EXACT, [(p, SamplingParams(max_tokens=30, repetition_penalty=1.4, repeat_last_n=-1))
                                      for p in ids])
    assert outputs == [greedy_tokens(target, p, 30, [tokenizer.eos_token_id], repetition_penalty=1.4) for p in ids]


# --- sampling: the emitted tokens follow the target's filtered distribution ------------------------------------

def filtered(pair, history: list[int], sampling: SamplingParams, counted: list[int] | None = None) -> torch.Tensor:
    """The target's next-token distribution after `history` under the request's penalties (counting `counted`,
    by default `history`) and filters, computed from one plain forward (no speculation)."""
    with torch.no_grad():
        logits = pair[0](torch.tensor([history])).logits[0, -1:].double().clone()
    if (penalty := Penalty.of(sampling)) is not None:
        penalty.apply_(logits, history if counted is None else counted, [])
    return distributions(logits[None], [sampling.temperature], [sampling.top_p], [sampling.top_k],
                         [sampling.min_p])[0, 0]


def buckets(p: torch.Tensor, q: torch.Tensor | None = None) -> list[tuple[int, ...]]:
    """The tokens `p` (or `q`) gives 2% or more, one bucket each, and one bucket for all the rest."""
    big = (p >= 0.02) if q is None else (p >= 0.02) | (q >= 0.02)
    return [(int(j),) for j in big.nonzero().flatten()] + [tuple(int(j) for j in (~big).nonzero().flatten())]


def bucketed(p: torch.Tensor, groups: list[tuple[int, ...]]) -> list[float]:
    return [float(p[list(g)].sum()) if g else 0.0 for g in groups]


def distance(samples: list[int], expected: torch.Tensor) -> tuple[float, float]:
    """The total variation between the samples' frequencies and `expected` over `buckets(expected)`, and a bound
    it stays under for seeded samples of `expected`: three times its expected value's upper bound ½ Σ σ_j."""
    groups = buckets(expected)
    where = {j: g for g, members in enumerate(groups) for j in members}
    counts = Counter(where[j] for j in samples)
    frequencies = [counts.get(g, 0) / len(samples) for g in range(len(groups))]
    tv = 0.5 * sum(abs(f - e) for f, e in zip(frequencies, bucketed(expected, groups)))
    sigma = 0.5 * sum(math.sqrt(e * (1 - e) / len(samples)) for e in bucketed(expected, groups))
    return tv, max(3 * sigma, 0.02)


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    """Between two distributions, over the buckets `distance` uses (so that both speak of the same thing)."""
    groups = buckets(p, q)
    return 0.5 * sum(abs(a - b) for a, b in zip(bucketed(p, groups), bucketed(q, groups)))


SAMPLERS = {  # (prompt, sampling): each chosen so its sampler changes the distribution it is tested on
    "top_k": ("The quick brown fox", SamplingParams(max_tokens=3, temperature=1.5, top_k=3)),
    "min_p": ("The quick brown fox", SamplingParams(max_tokens=3, temperature=1.5, min_p=0.15)),
    "penalties": ("x", SamplingParams(max_tokens=3, temperature=1.0, presence_penalty=-2.0, frequency_penalty=-1.0,
                                      repeat_last_n=3)),
}


@pytest.mark.parametrize("name", SAMPLERS)
def test_exact_speculative_sampling_follows_the_filtered_target(pair, name):
    """1,500 seeded requests of 3 tokens, decoded together. Round 1 emits t0 (plain); the draft model proposes d
    for round 2, whose position 0 gives t1 (the rejection test, or the residual without d) and, when d was kept
    (t1 == d), position 1 gives t2, penalized with d in its history. Each token's empirical distribution, given
    the tokens before it, is the filtered target's. The filters move the first token's distribution far; the
    penalties (boosts here: negative) move t2's, whose window [x, t0, d] holds the kept draft."""
    text, sampling = SAMPLERS[name]
    prompt, n = pair[2].encode(text), 1500
    outputs, engine = decode(pair, MODEL_DRAFTS, [(prompt, sampling.model_copy(update={"seed": s}))
                                                  for s in range(n)])
    assert engine.stats.draft_model_rounds > 0 and engine.stats.accepted_native > 50

    first = filtered(pair, prompt, sampling)
    tv, bound = distance([o[0] for o in outputs], first)
    assert tv < bound
    if name != "penalties":
        plain = SamplingParams(temperature=sampling.temperature, max_tokens=3)
        assert bound < total_variation(first, filtered(pair, prompt, plain)) / 2

    t0 = Counter(o[0] for o in outputs).most_common(1)[0][0]
    second = filtered(pair, prompt + [t0], sampling)
    tv, bound = distance([o[1] for o in outputs if o[0] == t0 and len(o) > 1], second)
    assert tv < bound

    # The branch (t0, d) whose draft d (the draft model's proposal after t0) was kept most often.
    with torch.no_grad():
        proposals = {t: int(pair[1](torch.tensor([prompt + [t]])).logits[0, -1].argmax()) for t in {o[0] for o in outputs}}
    kept = Counter((o[0], o[1]) for o in outputs if len(o) > 2 and o[1] == proposals[o[0]])
    (t0, d), _ = kept.most_common(1)[0]
    after_d = [o[2] for o in outputs if o[:2] == [t0, d] and len(o) > 2]
    assert len(after_d) > 150
    third = filtered(pair, prompt + [t0, d], sampling)
    tv, bound = distance(after_d, third)
    assert tv < bound
    if name == "penalties":  # position 1's window holds the kept draft: without it, another distribution
        assert bound < total_variation(third, filtered(pair, prompt + [t0, d], sampling, counted=prompt + [t0])) / 2
