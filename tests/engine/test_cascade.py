"""Draft stages: n-gram lookup semantics; the model stage and the cascade are lossless w.r.t. the draft model;
a new drafter is one Stage subclass plus its registration."""

from __future__ import annotations

import pytest
import torch

import fly_llm.common.config as config_module
from fly_llm.common.config import FLyConfig, SamplingParams
from fly_llm.decoding.cache import BatchKV
from fly_llm.decoding.engine import FLyEngine
from fly_llm.decoding.stages import (STAGES, Cascade, DraftModelStage, DraftPlan, GrammarStage, NgramStage, Proposal,
                                     RowStart, Stage)
from support.tiny_models import make_pair

torch.set_num_threads(1)  # tiny models: threads only contend on a shared CPU

FLY = FLyConfig()


def _stage(context: list[int], **kw) -> NgramStage:
    stage = NgramStage(**kw)
    stage.add_row(RowStart(len(context)))
    return stage


def test_ngram_copies_after_earliest_longest_match():
    context = [1, 2, 3, 9, 9, 5, 2, 3, 7, 8, 1, 2, 3]
    stage = _stage(context, max_ngram=3, ngram_tokens=4)
    # "1 2 3" first occurs at 0..2 (not at the end itself): copy what followed it.
    assert stage.propose_row(0, context, 10) == [9, 9, 5, 2]
    assert stage.propose_row(0, context, 2) == [9, 9]  # k caps the copy


def test_ngram_falls_back_to_shorter_ngrams():
    context = [4, 5, 6, 7, 1, 5, 6, 9, 0, 6]
    stage = _stage(context, max_ngram=3, ngram_tokens=3)
    # no earlier "9 0 6" or "0 6"; "6" first occurs at 2, followed by 7 1 5.
    assert stage.propose_row(0, context, 8) == [7, 1, 5]


def test_ngram_lookup_sees_speculative_tokens():
    context = [1, 2, 3, 4, 5, 6, 9, 1]
    stage = _stage(context, max_ngram=2, ngram_tokens=3)
    stage.propose_row(0, context, 3)
    # drafts [2, 3] appended: the suffix "2 3" occurred at 1..2 -> continue with 4 5 6.
    assert stage.lookup(0, context + [2, 3], 5) == [4, 5, 6]


def test_ngram_miss_reuses_rest_of_previous_proposal():
    context = [1, 2, 3, 4, 5, 6, 7, 1]
    stage = _stage(context, max_ngram=2, ngram_tokens=6)
    assert stage.propose_row(0, context, 6) == [2, 3, 4, 5, 6, 7]
    # The round kept 2 and the target emitted 42 instead of 3: no n-gram ends in "2 42" or "42".
    context = context + [2, 42]
    assert stage.propose_row(0, context, 6) == [4, 5, 6, 7]
    assert stage.propose_row(0, context + [4, 5, 6, 7, 99], 6) == []  # nothing left to reuse


def test_ngram_rows_are_independent():
    stage = NgramStage(max_ngram=2, ngram_tokens=2)
    stage.add_row(RowStart(3))
    stage.add_row(RowStart(4))
    assert stage.propose_row(0, [1, 2, 1], 2) == [2, 1]
    assert stage.propose_row(1, [3, 4, 5, 3], 2) == [4, 5]
    stage.remove_rows([1])
    assert stage.propose_row(0, [3, 4, 5, 3], 2) == [4, 5]


@pytest.fixture(scope="module")
def draft_model():
    return make_pair("qwen2")[1]


def _greedy(model, tokens: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([tokens], device=model.device),
                         attention_mask=torch.ones(1, len(tokens), dtype=torch.long, device=model.device),
                         max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(tokens):].tolist()


@pytest.mark.parametrize("use_ngram", [False, True])
def test_model_stage_and_cascade_follow_draft_greedy(draft_model, use_ngram):
    """Batched rows, several rounds with partial rollbacks: drafts == the draft model's own greedy."""
    torch.manual_seed(0)
    vocab = draft_model.config.vocab_size
    contexts = [torch.randint(5, vocab, (n,)).tolist() for n in (7, 1, 12)]
    contexts[2] += contexts[2][:6]  # a repeat, so n-gram proposals hit
    cascade = Cascade(GrammarStage(vocab), [NgramStage(4, 3), DraftModelStage(draft_model, draft_model.device)])
    stages = (NgramStage.name, DraftModelStage.name) if use_ngram else (DraftModelStage.name,)
    for b, context in enumerate(contexts):
        # row 0 starts empty: caught up on first use
        cascade.add_row(RowStart(len(context), BatchKV.prefill(draft_model, context[:-1] if b else [],
                                                               draft_model.device)))
    with torch.inference_mode():
        for round_, ks in enumerate([[5, 3, 8], [1, 0, 6], [4, 4, 4], [8, 2, 1]]):
            plans = [DraftPlan(k=k, stages=stages, model=True) for k in ks]
            drafts = cascade.propose(contexts, plans, [64] * len(contexts), [FLY] * len(contexts))
            for b, (context, k) in enumerate(zip(contexts, ks)):
                assert drafts[b] == (_greedy(draft_model, context, k) if k else []), (round_, b)
            # Keep a prefix of each draft, then a different "target" token, like a verify round.
            kept = [d[:len(d) // 2] for d in drafts]
            valid = [len(c) + len(k) for c, k in zip(contexts, kept)]
            for context, keep in zip(contexts, kept):
                context.extend(keep + [(context[-1] * 7 + round_) % vocab])
            cascade.observe(valid, contexts)
            cascade.check(contexts)
        cascade.remove_rows([0, 2])
        del contexts[1]
        drafts = cascade.propose(contexts, [DraftPlan(k=5, stages=stages, model=True)] * 2, [64, 64], [FLY] * 2)
        assert drafts == [_greedy(draft_model, c, 5) for c in contexts]


def test_ngram_only_plan_chains_lookups():
    cascade = Cascade(GrammarStage(16), [NgramStage(2, 3)])
    context = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    cascade.add_row(RowStart(len(context)))
    lookup = (NgramStage.name,)
    assert cascade.propose([context], [DraftPlan(k=7, stages=lookup)], [64], [FLY]) == [[3, 4, 5, 6, 7, 8, 1]]
    assert cascade.propose([context], [DraftPlan(k=0, stages=lookup)], [64], [FLY]) == [[]]


def test_confidence_stopping_cuts_a_row_at_its_first_unsure_token_and_no_other_row():
    """float64, so the stage's incremental probabilities equal a full forward's to ~1e-15."""
    _, draft, tokenizer = make_pair("llama", dtype=torch.float64)
    contexts = [tokenizer.encode("def add(a, b):"), tokenizer.encode("The quick brown fox")]

    def drafts(confidence: list[float]) -> list[list[int]]:
        s = DraftModelStage(draft, draft.device)
        for context in contexts:
            s.add_row(RowStart(len(context), BatchKV.prefill(draft, context[:-1], draft.device)))
        return s.propose(contexts, [8, 8], [(), ()], [FLyConfig(draft_confidence=c) for c in confidence]).tokens

    full = drafts([0.0, 0.0])
    ids = torch.tensor([contexts[0] + full[0]], device=draft.device)
    with torch.no_grad():
        probs = torch.softmax(draft(ids).logits[0, len(contexts[0]) - 1:-1], -1).max(-1).values.tolist()
    assert [len(d) for d in full] == [8, 8]
    cut = min(range(4), key=lambda i: probs[i])  # the least sure of the first four tokens
    threshold = probs[cut] + 1e-9
    assert all(p >= threshold for p in probs[:cut])
    stopped = drafts([threshold, 0.0])
    assert stopped[0] == full[0][:cut + 1]  # the unsure token is still drafted, then the row stops
    assert stopped[1] == full[1]  # the row without a threshold is untouched


class _FixedStage(Stage):
    """A tests-only drafter over fixed tokens: proposes k copies of tokens[0], offers tokens upstream."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.rows = 0

    def add_row(self, start: RowStart) -> None:
        self.rows += 1

    def remove_rows(self, keep: list[int]) -> None:
        self.rows = len(keep)

    def propose(self, contexts, ks, upstreams, configs) -> Proposal:
        return Proposal([self.tokens[:1] * k for k in ks], [0] * len(ks))

    def continuation(self, row: int, context: list[int], drafted: list[int], room: int) -> list[int]:
        return self.tokens[len(drafted):len(drafted) + room]

    def check(self, contexts: list[list[int]]) -> None:
        assert self.rows == len(contexts)


class RepeatStage(_FixedStage):
    name = "repeat"


class OracleStage(_FixedStage):
    name = "oracle"  # given what the draft model would choose


@pytest.mark.parametrize("stages,adaptive", [(("repeat",), False), (("ngram", "draft_model", "repeat"), True),
                                             (("ngram", "draft_model", "repeat"), False)])
def test_a_new_drafter_is_a_stage_class_plus_its_registration(monkeypatch, stages, adaptive):
    """Registered (STAGES, DRAFT_STAGES) and named in FLyConfig.stages, a drafter runs through the engine
    with no other change; exact mode still emits the target's greedy tokens."""
    target, draft, tokenizer = make_pair("llama")
    ids = tokenizer.encode("def add(a, b):\n    return a + b\n")
    ref = target.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=30, do_sample=False)[0, len(ids):].tolist()
    token = max(set(ref), key=ref.count)  # often right, so some of its drafts are accepted
    monkeypatch.setitem(STAGES, RepeatStage.name, lambda config, draft: RepeatStage([token]))
    monkeypatch.setattr(config_module, "DRAFT_STAGES", (*config_module.DRAFT_STAGES, RepeatStage.name))
    engine = FLyEngine(target, tokenizer, draft, FLyConfig(loose=False, k=4, adaptive=adaptive, stages=stages))
    engine.add_request("r", ids, SamplingParams(max_tokens=30))
    tokens: list[int] = []
    while engine.has_unfinished():
        tokens += engine.step()[0].new_token_ids
        engine.check()
    assert tokens == ref[:len(tokens)] and len(tokens) == 30
    if not adaptive:  # the last stage drafts; stages before it are upstream of it (the repeat stage ignores them)
        assert engine.stats.accepted_native > 0 and engine.stats.draft_model_rounds == 0


def test_stages_are_named_once_and_the_older_switches_still_drop_them():
    assert tuple(STAGES) == config_module.DRAFT_STAGES  # the registry is the settings' list, in cascade order
    assert FLyConfig().stages == ("ngram", "draft_model")
    assert FLyConfig(stages=["draft_model", "ngram"]).stages == ("ngram", "draft_model")  # cascade order
    assert FLyConfig(ngram=False).stages == ("draft_model",) and FLyConfig(draft_model=False).stages == ("ngram",)
    assert FLyConfig(ngram=False, draft_model=False).stages == ()
    with pytest.raises(ValueError, match="unknown draft stage"):
        FLyConfig(stages=["ngram", "suffix"])
    with pytest.raises(ValueError, match="named twice"):
        FLyConfig(stages=["ngram", "ngram"])


def test_upstream_proposals_that_the_draft_model_agrees_with_save_its_forwards(draft_model):
    """A plan's stages before its drafter are upstream of it: the model checks their proposal in the
    forward that drafts its own next token, so a right proposal of k-1 tokens drafts k in one forward."""
    context = [5, 9, 17, 4, 22, 8]
    greedy = _greedy(draft_model, context, 8)
    drafts, forwards = {}, {}
    for stages in (("oracle", "draft_model"), ("draft_model",)):
        cascade = Cascade(GrammarStage(draft_model.config.vocab_size),
                          [OracleStage(greedy), DraftModelStage(draft_model, draft_model.device)])
        cascade.add_row(RowStart(len(context), BatchKV.prefill(draft_model, context[:-1], draft_model.device)))
        with torch.inference_mode():
            drafts[stages], = cascade.propose([context], [DraftPlan(8, stages, True)], [64], [FLY])
        forwards[stages], = cascade.forwards
    assert drafts[("oracle", "draft_model")] == drafts[("draft_model",)] == greedy
    assert forwards == {("oracle", "draft_model"): 1, ("draft_model",): 8}
