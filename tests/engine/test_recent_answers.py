"""Recent answers: the n-gram stage copies from its scope's earlier answers (fly_llm.decoding.stages.recent_answers).

The store is checked against a brute-force reference under seeded random traffic (adds of several scopes,
lookups, eviction by the token budget); through the engine (tiny pair, float32, exact mode) a repeated
request is answered with the target's own greedy tokens in fewer target rounds, and never from another
scope's answers.
"""

from __future__ import annotations

import random

import pytest
import torch

from fly_llm.common.config import FLyConfig, SamplingParams
from fly_llm.common.stats import RequestStats
from fly_llm.decoding.engine import FLyEngine
from fly_llm.decoding.stages import NgramStage, RowStart
from fly_llm.decoding.stages.recent_answers import MIN_NGRAM, PROMPT_TAIL, RecentAnswers
from support.tiny_models import greedy_tokens, make_pair

torch.set_num_threads(1)


class Reference:
    """Recent answers as a plain list, searched by brute force."""

    def __init__(self, budget: int, max_ngram: int) -> None:
        self.budget, self.max_ngram, self.answers = budget, max_ngram, []

    def add(self, scope: str, tokens: list[int]) -> None:
        tokens = tokens[:self.budget]
        if len(tokens) > MIN_NGRAM:
            self.answers.append((scope, tokens))
        while sum(len(t) for _, t in self.answers) > self.budget:
            self.answers.pop(0)

    def lookup(self, scope: str, tokens: list[int], count: int, at_least: int) -> tuple[int, list[int]]:
        if count <= 0:
            return 0, []
        for n in range(min(self.max_ngram, len(tokens)), max(at_least, MIN_NGRAM) - 1, -1):
            key = tokens[-n:]
            for s, answer in reversed(self.answers):
                ends = [e for e in range(n, len(answer) + 1) if answer[e - n:e] == key]
                if s == scope and ends and ends[0] < len(answer):
                    return n, answer[ends[0]:ends[0] + count]
        return 0, []


@pytest.mark.parametrize("seed", range(6))
def test_the_store_matches_a_brute_force_reference_under_random_traffic(seed):
    rng = random.Random(seed)
    budget, max_ngram = rng.choice([0, 7, 40, 200]), rng.choice([2, 4, 8])
    store, reference = RecentAnswers(budget, max_ngram), Reference(budget, max_ngram)
    scopes, vocab = ["a", "b", "c"], rng.choice([3, 6, 20])
    for _ in range(300):
        scope = rng.choice(scopes)
        if rng.random() < 0.3:
            tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 30))]
            store.add(scope, tokens)
            reference.add(scope, tokens)
        else:
            tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 10))]
            count, at_least = rng.randrange(0, 8), rng.randrange(0, 6)
            assert store.lookup(scope, tokens, count, at_least) == reference.lookup(scope, tokens, count, at_least)
        store.check()
        assert store.tokens == sum(len(t) for _, t in reference.answers)


def test_the_stage_copies_a_longer_match_from_a_recent_answer_of_its_own_scope_only():
    stage = NgramStage(max_ngram=4, ngram_tokens=6, recent=RecentAnswers(100))
    stage.add_row(RowStart(3, scope="alice"))
    stage.answered(0, [1, 2, 3, 10, 11, 12, 13, 14, 15])  # prompt [1, 2, 3], answer [10 .. 15]
    stage.remove_rows([])
    for scope, expected in (("alice", [13, 14, 15]), ("bob", [])):
        stage.add_row(RowStart(4, scope=scope))
        assert stage.propose_row(0, [7, 3, 10, 11, 12], 6) == expected  # 11, 12 never occurred in the context
        stage.remove_rows([])
    stage.add_row(RowStart(4, scope="alice"))
    assert stage.propose_row(0, [9, 10, 11, 12, 5, 10, 11, 12], 6) == [5, 10, 11, 12]  # the context's 4-gram wins
    stage.check([[0]])


TARGET, DRAFT, TOKENIZER = make_pair("llama")


def _run(engine: FLyEngine, rid: str, prompt: list[int], scope: str) -> tuple[list[int], RequestStats]:
    engine.add_request(rid, prompt, SamplingParams(max_tokens=40), cache_scope=scope)
    tokens: list[int] = []
    stats = None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            stats = out.stats if out.finished else stats
        engine.check()
    return tokens, stats


def test_a_repeated_request_is_the_targets_greedy_answer_in_fewer_rounds_and_only_in_its_scope():
    prompt = TOKENIZER.encode("The quick brown fox jumps over the lazy dog", add_special_tokens=False)
    greedy = greedy_tokens(TARGET, prompt, 40, [TOKENIZER.eos_token_id])
    rounds = {}
    for recent in (0, 4096):
        config = FLyConfig(loose=False, adaptive=False, stages=("ngram",), recent_answers=recent)
        engine = FLyEngine(TARGET, TOKENIZER, DRAFT, config)
        runs = [_run(engine, f"{i}", prompt, scope) for i, scope in enumerate(("alice", "alice", "bob"))]
        assert all(tokens == greedy for tokens, _ in runs)  # exact mode stays the target's own output
        rounds[recent] = [stats.rounds for _, stats in runs]
    assert len(greedy) > 2 * PROMPT_TAIL
    assert rounds[4096][1] < rounds[0][1]  # the second ask of alice copied her first answer
    assert rounds[4096][0] == rounds[0][0] and rounds[4096][2] == rounds[0][2]  # bob saw none of alice's


def test_a_seeded_sample_is_reproduced_after_its_answer_became_a_recent_one():
    """A seeded sampled row drafts from its own context only: recent answers would change its draws."""
    engine = FLyEngine(TARGET, TOKENIZER, DRAFT, FLyConfig(k=4, adaptive=False, stages=("ngram",)))
    prompts = ["The quick brown fox", "Once upon a time"]
    sampling = SamplingParams(max_tokens=24, temperature=1.0, seed=7)
    first = [g.token_ids for g in engine.generate(prompts, sampling)]
    assert engine._cascade.drafters["ngram"].recent.tokens > 0  # their answers are kept …
    assert [g.token_ids for g in engine.generate(prompts, sampling)] == first  # … and not copied
