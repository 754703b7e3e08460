"""FLyEngine on tiny random-weight pairs: exact mode is lossless, batching, stops, limits, stats."""

from __future__ import annotations

import copy

import pytest
import torch

from fly_llm.common.config import FLyConfig, SamplingParams
from fly_llm.decoding.cache import BatchKV
from fly_llm.decoding.engine import FLyEngine
from fly_llm.common.errors import BadRequest, TooLong
from support.tiny_models import greedy_tokens, make_pair

torch.set_num_threads(1)  # tiny models: threads only contend on a shared CPU

PROMPTS = [
    "def add(a, b):",
    "The quick brown fox",
    "for i in range(10):\n    print(",
    "Question: what is 2 + 3? Answer:",
    "class Stack:\n    def push(self, x):",
    "Speculative decoding drafts",
    "x",
]
MAX_NEW = 24


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request):
    """(arch, target, draft, tokenizer, reference): reference = target greedy tokens per prompt."""
    target, draft, tokenizer = make_pair(request.param)
    reference = {}
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        reference[prompt] = greedy_tokens(target, ids, MAX_NEW)
    return request.param, target, draft, tokenizer, reference


def _check_lossless(gens, reference, eos):
    for prompt, gen in zip(PROMPTS, gens):
        expected = reference[prompt]
        if eos in expected:
            expected = expected[:expected.index(eos) + 1]
        assert gen.token_ids == expected[:MAX_NEW], prompt
        assert gen.completion_tokens == len(gen.token_ids)


STAGES = {"ngram": dict(stages=("ngram",)), "model": dict(stages=("draft_model",)),
          "cascade": dict(stages=("ngram", "draft_model"))}


@pytest.mark.parametrize("k", [1, 4, 15])
@pytest.mark.parametrize("stages", list(STAGES))
def test_exact_mode_is_lossless(pair, k, stages):
    _, target, draft, tokenizer, reference = pair
    engine = FLyEngine(target, tokenizer, draft, FLyConfig(k=k, loose=False, adaptive=False, **STAGES[stages]))
    gens = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW))
    _check_lossless(gens, reference, tokenizer.eos_token_id)
    if stages != "ngram":
        assert engine.stats.draft_model_rounds > 0


@pytest.mark.parametrize("threshold", [0.3, 0.9])
def test_exact_mode_is_lossless_with_draft_confidence_stopping(pair, threshold):
    _, target, draft, tokenizer, reference = pair
    engine = FLyEngine(target, tokenizer, draft, FLyConfig(loose=False, draft_confidence=threshold))
    gens = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW))
    _check_lossless(gens, reference, tokenizer.eos_token_id)


def test_exact_mode_is_lossless_adaptive_and_without_draft(pair):
    _, target, draft, tokenizer, reference = pair
    for engine in (FLyEngine(target, tokenizer, draft, FLyConfig(loose=False)),
                   FLyEngine(target, tokenizer, None, FLyConfig(loose=False, adaptive=False))):
        gens = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW))
        _check_lossless(gens, reference, tokenizer.eos_token_id)
    assert engine.stats.draft_model_rounds == 0


def test_reused_engine_one_token_prompts_and_batches_that_prefill_nothing(pair):
    """Regressions (issue 14): after the engine emptied, a one-token prompt (prefilled to zero
    columns) was decoded against a cache still sized for the old batch, and two of them crashed."""
    _, target, draft, tokenizer, reference = pair
    assert len(tokenizer.encode("x")) == 1
    eos = tokenizer.eos_token_id
    expected = reference["x"][:reference["x"].index(eos) + 1] if eos in reference["x"] else reference["x"]
    engine = FLyEngine(target, tokenizer, draft, FLyConfig(loose=False))
    sampling = SamplingParams(max_tokens=MAX_NEW)
    engine.generate(PROMPTS[0], sampling)
    assert engine.generate("x", sampling)[0].token_ids == expected
    assert [g.token_ids for g in engine.generate(["x", "x"], sampling)] == [expected, expected]
    engine.check()


@pytest.mark.parametrize("compact_every_round", [False, True])
def test_batched_with_joins_equals_alone_float64(monkeypatch, compact_every_round):
    """FLy mode (loose on, fixed K) in float64: joining mid-way changes nothing for any row."""
    compactions = []
    if compact_every_round:
        monkeypatch.setattr(BatchKV, "_should_compact", lambda kv: kv.width > max(kv.lengths, default=0))
        real_compact = BatchKV.compact
        monkeypatch.setattr(BatchKV, "compact", lambda kv: compactions.append(1) or real_compact(kv))
    target, draft, tokenizer = make_pair("qwen2", dtype=torch.float64)
    config = FLyConfig(k=6, window=2, entropy_threshold=0.0, adaptive=False)
    sampling = SamplingParams(max_tokens=20)
    alone = [FLyEngine(target, tokenizer, draft, config).generate(p, sampling)[0].token_ids for p in PROMPTS]
    engine = FLyEngine(target, tokenizer, draft, config)
    got: dict[str, list[int]] = {}
    pending = list(enumerate(PROMPTS))
    steps = 0
    while pending or engine.has_unfinished():
        if pending and steps % 2 == 0:  # one request joins every other step
            i, prompt = pending.pop(0)
            engine.add_request(str(i), engine.encode(prompt), sampling)
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps += 1
    assert [got[str(i)] for i in range(len(PROMPTS))] == alone
    assert engine.stats.accepted_loose > 0
    assert len(compactions) > 10 or not compact_every_round


def test_stats_add_up(pair):
    _, target, draft, tokenizer, _ = pair
    engine = FLyEngine(target, tokenizer, draft, FLyConfig(k=5, window=2, entropy_threshold=0.0, adaptive=False))
    gens = engine.generate(PROMPTS, SamplingParams(max_tokens=17))
    for stats in [g.stats for g in gens] + [engine.stats]:
        assert stats.emitted == stats.accepted_native + stats.accepted_loose + stats.rounds - stats.trimmed
        assert sum(stats.accepted_by_position) == stats.accepted_native + stats.accepted_loose
        assert sum(stats.drafted_by_position) == stats.drafted
    assert all(g.stats.emitted == g.completion_tokens == len(g.token_ids) for g in gens)
    assert engine.stats.emitted == sum(g.completion_tokens for g in gens)
    assert engine.stats.rounds < engine.stats.emitted  # speculation paid somewhere


def test_max_tokens_and_k_larger_than_budget(pair):
    _, target, draft, tokenizer, reference = pair
    engine = FLyEngine(target, tokenizer, draft, FLyConfig(k=15, loose=False, adaptive=False))
    for max_tokens in (1, 2, 3):
        gen = engine.generate(PROMPTS[0], SamplingParams(max_tokens=max_tokens))[0]
        assert gen.token_ids == reference[PROMPTS[0]][:max_tokens]
        assert gen.finish_reason == "length"
        assert len(gen.stats.drafted_by_position) <= max_tokens - 1  # never drafts past the budget
        assert gen.stats.trimmed == 0


def test_empty_and_too_long_prompts(pair):
    _, target, draft, tokenizer, _ = pair
    engine = FLyEngine(target, tokenizer, draft, context_window=32)
    with pytest.raises(BadRequest):
        engine.add_request("a", [], SamplingParams())
    with pytest.raises(TooLong, match="context window is 32"):
        engine.add_request("b", list(range(5, 45)), SamplingParams())
    with pytest.raises(TooLong):
        engine.add_request("c", list(range(5, 37)), SamplingParams())
    engine.add_request("d", list(range(5, 25)), SamplingParams(max_tokens=100))
    with pytest.raises(BadRequest, match="duplicate"):
        engine.add_request("d", [5], SamplingParams())
    tokens, reason = [], None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            reason = out.finish_reason
    if tokenizer.eos_token_id not in tokens:
        assert len(tokens) == 12 and reason == "length"  # clipped to the window


def test_eos_stops(pair):
    _, target, draft, tokenizer, reference = pair
    expected = reference[PROMPTS[1]]
    fake_eos = expected[5]
    saved = target.generation_config.eos_token_id
    target.generation_config.eos_token_id = [fake_eos]
    try:
        engine = FLyEngine(target, tokenizer, draft, FLyConfig(k=8, loose=False, adaptive=False))
    finally:
        target.generation_config.eos_token_id = saved
    gen = engine.generate(PROMPTS[1], SamplingParams(max_tokens=MAX_NEW))[0]
    assert gen.finish_reason == "stop"
    assert gen.token_ids == expected[:expected.index(fake_eos) + 1]
    stats = gen.stats
    assert stats.emitted == len(gen.token_ids) == stats.accepted_native + stats.accepted_loose + stats.rounds - stats.trimmed


def test_stop_strings_spanning_tokens_and_stream_holdback(pair):
    _, target, draft, tokenizer, reference = pair
    engine = FLyEngine(target, tokenizer, draft, FLyConfig(k=8, loose=False, adaptive=False))
    full = engine.generate(PROMPTS[0], SamplingParams(max_tokens=MAX_NEW))[0]
    # A stop string made of the end of token 3 and the start of token 4 (spanning two tokens).
    t3 = tokenizer.decode(full.token_ids[3:4])
    t4 = tokenizer.decode(full.token_ids[4:5])
    prefix = tokenizer.decode(full.token_ids[:3])
    if len(t3) < 1 or len(t4) < 1:
        pytest.skip("tokens decode to nothing")
    stop = t3[-1:] + t4[:1]
    cut = (prefix + t3 + t4).find(stop)
    sampling = SamplingParams(max_tokens=MAX_NEW, stop=[stop])
    gen = engine.generate(PROMPTS[0], sampling)[0]
    assert gen.finish_reason == "stop"
    assert stop not in gen.text
    assert gen.text == full.text[:cut]
    assert gen.token_ids == full.token_ids[:len(gen.token_ids)]
    deltas = list(engine.stream(PROMPTS[0], sampling))
    assert "".join(deltas) == gen.text
    assert all(stop not in d for d in deltas)


def test_stream_matches_generate_and_abort(pair):
    _, target, draft, tokenizer, _ = pair
    engine = FLyEngine(target, tokenizer, draft)
    sampling = SamplingParams(max_tokens=MAX_NEW)
    gen = engine.generate(PROMPTS[2], sampling)[0]
    assert gen.text == tokenizer.decode(gen.token_ids, skip_special_tokens=True)
    assert "".join(engine.stream(PROMPTS[2], sampling)) == gen.text
    engine.add_request("x", engine.encode(PROMPTS[0]), sampling)
    engine.add_request("y", engine.encode(PROMPTS[1]), sampling)
    assert engine.num_active == 2
    engine.step()
    assert engine.abort_request("x") and not engine.abort_request("x")
    assert engine.num_active == 1
    while engine.has_unfinished():
        assert {o.request_id for o in engine.step()} == {"y"}


def test_seeded_sampling_is_reproducible(pair):
    _, target, draft, tokenizer, _ = pair
    engine = FLyEngine(target, tokenizer, draft, FLyConfig(k=4, adaptive=False))

    def run(seed):
        return engine.generate(PROMPTS[:3], SamplingParams(max_tokens=16, temperature=1.0, seed=seed))

    first, again, other = run(7), run(7), run(8)
    assert [g.token_ids for g in first] == [g.token_ids for g in again]
    assert [g.token_ids for g in first] != [g.token_ids for g in other]


def test_encode_messages_uses_chat_template(pair):
    _, target, draft, tokenizer, _ = pair
    engine = FLyEngine(target, tokenizer, draft)
    ids = engine.encode(messages=[{"role": "user", "content": "hi"}])
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    with pytest.raises(BadRequest):
        engine.encode()


def test_a_template_that_fails_is_a_bad_request_in_our_words(pair):
    """A chat template's own refusal (`raise_exception`) is told as it is; any other failure while rendering
    (a library's TypeError: a lone surrogate once gave "TextEncodeInput must be Union[...]") is named by its
    kind only, never its text (issue 45: no exception text reaches a client)."""
    _, target, draft, tokenizer, _ = pair
    engine = FLyEngine(target, copy.deepcopy(tokenizer), draft)
    messages = [{"role": "user", "content": "hi"}]
    engine.tokenizer.chat_template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    with pytest.raises(BadRequest, match="] the chat template refused these messages: Conversation roles must alternate"):
        engine.encode(messages=messages)
    engine.tokenizer.chat_template = "{{ messages[0]['content'] + 1 }}"
    with pytest.raises(BadRequest) as refused:
        engine.encode(messages=messages)
    assert refused.value.message == "the chat template could not render these messages (TypeError)"
