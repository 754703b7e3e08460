"""The prefix cache and chunked prefill in FLyEngine: exact mode stays lossless (float32, tiny pair).

Every exact-mode answer equals the target's own greedy output for that prompt alone, with the cache
on: a hit ending mid-prompt, a hit on the whole prompt, the next turn of a conversation, two
requests sharing a prefix in one batch, eviction in the middle of traffic, and prompts entering in
chunks. `cached_tokens` counts the prompt tokens served from the cache.
"""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from fly_llm.common.config import FLyConfig, SamplingParams
from fly_llm.decoding.engine import FLyEngine
from fly_llm.decoding.policy import AdaptivePolicy, Costs
from fly_llm.decoding.stages import DraftModelStage
from fly_llm.decoding.stages.draft_model import CATCH_UP_WIDTH
from support.tiny_models import make_pair

torch.set_num_threads(1)

MAX_NEW = 16
BLOCK = 4
EXACT = FLyConfig(loose=False)
PAIR = make_pair("llama")
TARGET, DRAFT, TOKENIZER = PAIR
BYTES_PER_BLOCK = 2 * 2 * 2 * 16 * 4 * BLOCK * 2  # layers × (k, v) × kv heads × head dim × fp32 × tokens × models


@lru_cache(maxsize=None)
def greedy(prompt: tuple[int, ...]) -> list[int]:
    """The target's greedy continuation of `prompt` alone (MAX_NEW tokens, through EOS)."""
    out = TARGET.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=MAX_NEW, do_sample=False)
    tokens = out[0, len(prompt):].tolist()
    eos = TOKENIZER.eos_token_id
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def engine(cache_bytes: int = 1 << 20, chunk: int = 0, draft=DRAFT) -> FLyEngine:
    return FLyEngine(TARGET, TOKENIZER, draft, EXACT, prefix_cache_bytes=cache_bytes, prefix_block=BLOCK,
                     prefill_chunk=chunk)


def run(eng: FLyEngine, *prompts: list[int], fly: FLyConfig = EXACT) -> list[tuple[list[int], int]]:
    """Run prompts together to the end; (tokens, cached_tokens) per prompt, checking invariants each step."""
    ids = [f"q{len(eng._prompt.model_dump())}-{i}-{id(p)}" for i, p in enumerate(prompts)]
    for rid, prompt in zip(ids, prompts):
        eng.add_request(rid, prompt, SamplingParams(max_tokens=MAX_NEW), fly)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    cached: dict[str, int] = {}
    while len(cached) < len(ids):
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                cached[out.request_id] = out.cached_tokens
        eng.check()
    return [(tokens[rid], cached[rid]) for rid in ids]


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text)


SYSTEM = ids("You answer questions about the documents. Retrieval augmented generation answers questions "
             "from documents. The quick brown fox jumps over the lazy dog.")
QUESTIONS = [ids(" Question: what is 2 + 3? Answer:"), ids(" Question: who sleeps in the sun? Answer:"),
             ids(" def fibonacci(n):")]


def test_a_hit_ending_mid_prompt_is_exact_and_counted():
    eng = engine()
    first = SYSTEM + QUESTIONS[0]
    [(tokens, cached)] = run(eng, first)
    assert cached == 0 and tokens == greedy(tuple(first))
    second = SYSTEM + QUESTIONS[1]
    [(tokens, cached)] = run(eng, second)
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert cached == shared // BLOCK * BLOCK > 0
    assert tokens == greedy(tuple(second))
    stats = eng.prompt_stats
    assert stats.cached_tokens == cached and stats.prompt_tokens == len(first) + len(second)
    assert stats.prefilled_tokens == len(first) - 1 + len(second) - 1 - cached
    assert 0 < stats.cache_bytes <= stats.cache_budget_bytes


@pytest.mark.parametrize("fly", [EXACT, FLyConfig(loose=False, draft_model=False),
                                 FLyConfig(loose=False, adaptive=False, k=6, ngram=False)])
def test_a_full_prompt_hit_recomputes_nothing_at_admission(fly):
    eng = engine()
    prompt = SYSTEM + QUESTIONS[0]
    [(first, _)] = run(eng, prompt, fly=fly)
    prefilled = eng.prompt_stats.prefilled_tokens
    [(again, cached)] = run(eng, prompt, fly=fly)
    # everything but the last token (which the first round feeds) is reused; usage counts whole blocks
    assert cached == (len(prompt) - 1) // BLOCK * BLOCK
    assert eng.prompt_stats.prefilled_tokens == prefilled
    assert first == again == greedy(tuple(prompt))


def test_the_next_turn_reuses_the_previous_turns_prompt_and_output():
    eng = engine()
    turn = SYSTEM + QUESTIONS[0]
    for question in QUESTIONS[1:]:
        [(answer, _)] = run(eng, turn)
        assert answer == greedy(tuple(turn))
        turn = turn + answer + question
        [(tokens, cached)] = run(eng, turn)
        assert cached >= (len(turn) - len(question) - 1) // BLOCK * BLOCK - BLOCK
        assert tokens == greedy(tuple(turn))


def test_requests_sharing_a_prefix_in_one_batch():
    eng = engine()
    prompts = [SYSTEM + q for q in QUESTIONS]
    results = run(eng, *prompts)
    assert results[0][1] == 0 and all(cached >= len(SYSTEM) // BLOCK * BLOCK - BLOCK for _, cached in results[1:])
    for prompt, (tokens, _) in zip(prompts, results):
        assert tokens == greedy(tuple(prompt))


def test_eviction_in_the_middle_of_traffic_keeps_the_budget_and_the_answers():
    eng = engine(cache_bytes=6 * BYTES_PER_BLOCK)
    prompts = [SYSTEM[:n] + q for n in (40, 12, 40, 25) for q in QUESTIONS[:2]]
    for batch in (prompts[:3], prompts[3:5], prompts[5:]):
        for prompt, (tokens, _) in zip(batch, run(eng, *batch)):
            assert tokens == greedy(tuple(prompt))
    stats = eng.prompt_stats
    assert stats.cache_evictions > 0 and stats.cached_tokens > 0
    assert stats.cache_bytes <= 6 * BYTES_PER_BLOCK


def test_the_cache_off_stores_nothing_and_without_a_draft_model_it_still_hits():
    off = engine(cache_bytes=0)
    prompt = SYSTEM + QUESTIONS[0]
    assert run(off, prompt) == run(off, prompt) == [(greedy(tuple(prompt)), 0)]
    assert off.prompt_stats.cache_bytes == 0
    no_draft = engine(draft=None)
    run(no_draft, prompt)
    [(tokens, cached)] = run(no_draft, prompt)
    assert cached == (len(prompt) - 1) // BLOCK * BLOCK and tokens == greedy(tuple(prompt))


def test_reset_empties_the_prefix_cache():
    eng = engine()
    run(eng, SYSTEM + QUESTIONS[0])
    assert eng.prompt_stats.cache_bytes > 0
    eng.reset()
    eng.check()
    assert eng.prompt_stats.cache_bytes == 0


PLAIN = FLyConfig(loose=False, adaptive=False, ngram=False, draft_model=False)  # one token per step


@pytest.mark.parametrize("cache_bytes", [0, 1 << 20])
def test_a_long_prompt_enters_in_chunks_while_a_running_row_keeps_decoding(cache_bytes):
    chunk = 16
    eng = engine(cache_bytes=cache_bytes, chunk=chunk)
    short, long = QUESTIONS[0], SYSTEM + QUESTIONS[1]
    eng.add_request("running", short, SamplingParams(max_tokens=MAX_NEW), PLAIN)
    tokens = {"running": [t for out in eng.step() for t in out.new_token_ids], "long": []}
    eng.add_request("long", long, SamplingParams(max_tokens=MAX_NEW), EXACT)
    steps: list[set[str]] = []  # who got tokens, step by step
    while eng.has_unfinished():
        outputs = eng.step()
        eng.check()
        for out in outputs:
            tokens[out.request_id] += out.new_token_ids
        steps.append({out.request_id for out in outputs if out.new_token_ids})
    first_long = next(i for i, who in enumerate(steps) if "long" in who)
    assert first_long == -(-(len(long) - 1) // chunk) - 1  # the step of its last chunk
    assert all(who == {"running"} for who in steps[:first_long])  # the running row got a token every step
    assert tokens == {"running": greedy(tuple(short)), "long": greedy(tuple(long))}


@pytest.mark.parametrize("chunk", [0, 256])
def test_a_first_token_waits_for_no_draft_prefill(chunk):
    """A prompt within one chunk joins with its draft cache empty and its first round runs no
    draft-model forward; the draft catches up in a later round, and the output stays exact. (The
    catch-up is made free here: at the default cost the policy rightly never pays it for 16 tokens.)"""
    eng = engine(cache_bytes=0, chunk=chunk)
    eng.policy = AdaptivePolicy(Costs().with_stage(DraftModelStage.name, prefill=0.0))
    prompt = SYSTEM + QUESTIONS[2]
    calls: list[int] = []
    hook = DRAFT.register_forward_hook(lambda *_: calls.append(1))
    try:
        eng.add_request("r", prompt, SamplingParams(max_tokens=MAX_NEW), EXACT)
        tokens = [t for out in eng.step() for t in out.new_token_ids]
        assert tokens and not calls
        while eng.has_unfinished():
            tokens += [t for out in eng.step() for t in out.new_token_ids]
            eng.check()
    finally:
        hook.remove()
    assert calls and eng.stats.draft_model_rounds > 0
    assert tokens == greedy(tuple(prompt))


@pytest.mark.parametrize("chunk", [0, 64])
def test_a_long_catch_up_is_fed_in_pieces_and_stays_exact(chunk):
    """Two long prompts whose every round after the first drafts with the model (adaptive off): each
    draft cache catches up on its whole prompt in its first model round, in forwards at most
    CATCH_UP_WIDTH tokens wide (ragged rows in one batch when they join together), and both answers
    are the target's own greedy ones."""
    text = ids("The quick brown fox jumps over the lazy dog. The dog sleeps in the sun. " * 40)
    prompts = [text[:400], text[7:300]]
    assert len(prompts[0]) == 400 and len(prompts[1]) > CATCH_UP_WIDTH
    widths: list[int] = []
    hook = DRAFT.register_forward_hook(lambda _m, _a, kwargs, _o: widths.append(kwargs["input_ids"].shape[1]),
                                       with_kwargs=True)
    try:
        results = run(engine(cache_bytes=0, chunk=chunk), *prompts,
                      fly=FLyConfig(loose=False, adaptive=False, stages=(DraftModelStage.name,)))
    finally:
        hook.remove()
    assert [tokens for tokens, _ in results] == [greedy(tuple(p)) for p in prompts]

    def pieces(n: int) -> list[int]:
        return [min(CATCH_UP_WIDTH, n - start) for start in range(0, n, CATCH_UP_WIDTH)]

    together = pieces(max(map(len, prompts)))  # both rows' backlogs in the same forwards
    apart = pieces(len(prompts[0])) + pieces(len(prompts[1]))
    assert [w for w in widths if w > 2 * EXACT.k] == (together if chunk == 0 else apart)


def test_short_prompts_share_one_steps_prefill_budget():
    """Budget 8 per step: 5 + 0 tokens join in step 1, the 9-token prompt gets 3 there and 6 in step 2."""
    eng = engine(cache_bytes=0, chunk=8)
    for i, prompt in enumerate(([50] * 6, [60], [70] * 10)):
        eng.add_request(f"p{i}", prompt, SamplingParams(max_tokens=3), PLAIN)
    assert [sorted(out.request_id for out in eng.step()) for _ in range(2)] == [["p0", "p1"], ["p0", "p1", "p2"]]


def test_out_of_memory_while_storing_empties_the_cache_and_fails_nothing(monkeypatch):
    eng = engine()
    prompt = SYSTEM + QUESTIONS[0]
    run(eng, SYSTEM + QUESTIONS[1])
    assert eng.prompt_stats.cache_bytes > 0

    def no_memory(*_):
        raise torch.OutOfMemoryError("injected")

    monkeypatch.setattr(type(eng._kv), "row_kv", no_memory)
    [(tokens, _)] = run(eng, prompt)
    assert tokens == greedy(tuple(prompt)) and eng.prompt_stats.cache_bytes == 0
