"""A stateful property test of FLyEngine: any sequence of adds, steps, aborts and drains.

The engine has a prefix cache (off, a few blocks, or roomy) and a per-step prefill budget (none
or a few tokens), so prompts hit, miss, evict and enter in chunks. Rules add requests with random
prompts (1–120 tokens, exactly 1 often, or an earlier prompt or prompt + output cut anywhere and
continued, so they share prefixes), max_tokens, k, and per-request options (adaptive, n-gram
stage, draft model, draft-confidence stopping, loose, greedy or seeded sampling, a grammar or
none), run steps, abort running or waiting requests, and run until the engine is empty and then
go on.
After every rule: no exception, `engine.check()` (both caches' invariants, one row per running
request in every stage, the prefix cache within its budget and consistent), and every exact-mode
greedy request's tokens so far are a prefix of the target's own greedy output for that prompt run
alone (HF `generate`, float32, under the same grammar through a reference logits processor); a
finished one equals it, cut at EOS or max_tokens. Every constrained request's tokens so far are
accepted by a fresh matcher of its grammar, whatever its mode. Outputs never name an unknown or
finished request.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fly_llm.common.config import DRAFT_STAGES, FLyConfig, SamplingParams
from fly_llm.decoding.engine import FLyEngine
from fly_llm.decoding.grammar import grammar_of
from fly_llm.common.tool_formats import constraint_for
from fly_llm.common.tools import Structure
from support.grammar_reference import constrained_greedy, grammar_valid_prefix
from support.tiny_models import greedy_tokens, make_pair

torch.set_num_threads(1)

MAX_NEW = 24
BLOCK = 4
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * BLOCK * 2  # layers × (k, v) × kv heads × head dim × fp32 × tokens × models
MAX_RELATED = 200
_PAIR: tuple | None = None


def pair():
    """The tiny float32 Llama pair, built once for the module."""
    global _PAIR
    if _PAIR is None:
        _PAIR = make_pair("llama")
    return _PAIR


CONSTRAINTS = [None, None, None] + [constraint_for(Structure.model_validate(s)) for s in (
    {"response_format": {"type": "json_schema", "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
        "required": ["ok", "n"], "additionalProperties": False}}},
    {"response_format": {"type": "regex", "pattern": "(ab|c)+d"}},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"enum": ["u", "v"]}}, "required": ["x"]}}}], "tool_choice": "required"},
)]


@lru_cache(maxsize=None)
def greedy_alone(prompt: tuple[int, ...], grammar: str | None = None) -> tuple[int, ...]:
    """The target's greedy continuation of `prompt` alone (up to MAX_NEW tokens, through EOS)."""
    target, _, tokenizer = pair()
    if grammar is not None:
        return tuple(constrained_greedy(target, tokenizer, list(prompt), grammar, MAX_NEW, [tokenizer.eos_token_id]))
    return tuple(greedy_tokens(target, list(prompt), MAX_NEW, [tokenizer.eos_token_id]))


def prompts() -> st.SearchStrategy[list[int]]:
    """Token prompts: exactly one token, short random ones, and repetitive ones the n-gram stage can copy."""
    vocab = len(pair()[2])
    token = st.integers(3, vocab - 1)
    repeated = st.tuples(st.lists(token, min_size=1, max_size=8), st.integers(1, 120)).map(
        lambda t: (t[0] * (t[1] // len(t[0]) + 1))[:t[1]])
    return st.one_of(st.lists(token, min_size=1, max_size=1), st.lists(token, min_size=1, max_size=40), repeated)


def related() -> st.SearchStrategy[tuple[int, int, list[int]] | None]:
    """None (a fresh prompt), or (which earlier context, where to cut it, what to append)."""
    return st.one_of(st.none(), st.tuples(st.integers(0, 10**6), st.integers(1, MAX_RELATED), prompts()))


class EngineMachine(RuleBasedStateMachine):
    """Drives one FLyEngine; `requests` maps each live request id to (prompt, exact-greedy?, max_tokens, grammar);
    `contexts` holds earlier prompts and finished prompt + output, for prompts that share a prefix."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: dict[str, tuple[tuple[int, ...], bool, int, str | None]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.contexts: list[list[int]] = []
        self.next_id = 0

    @initialize(cache_bytes=st.sampled_from([0, 6 * BLOCK_BYTES, 1 << 20]), chunk=st.sampled_from([0, 5, 32]))
    def start(self, cache_bytes, chunk):
        target, draft, tokenizer = pair()
        self.engine = FLyEngine(target, tokenizer, draft, FLyConfig(), prefix_cache_bytes=cache_bytes,
                                prefix_block=BLOCK, prefill_chunk=chunk)

    @rule(prompt=prompts(), related=related(), max_tokens=st.integers(1, MAX_NEW), k=st.integers(1, 15),
          adaptive=st.booleans(), stages=st.lists(st.sampled_from(DRAFT_STAGES), unique=True), loose=st.booleans(),
          seed=st.one_of(st.none(), st.integers(0, 2**31)), confidence=st.sampled_from([0.0, 0.0, 0.5, 0.9]),
          constraint=st.sampled_from(CONSTRAINTS))
    def add(self, prompt, related, max_tokens, k, adaptive, stages, loose, seed, confidence, constraint):
        if related is not None and self.contexts:
            which, cut, more = related
            prompt = (self.contexts[which % len(self.contexts)][:cut] + more)[:MAX_RELATED]
        self.contexts.append(list(prompt))
        rid = f"r{self.next_id}"
        self.next_id += 1
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0 if seed is None else 0.8, seed=seed)
        fly = FLyConfig(k=k, adaptive=adaptive, stages=stages, loose=loose,
                        draft_confidence=confidence)
        self.engine.add_request(rid, prompt, sampling, fly, constraint)
        grammar = grammar_of(constraint) if constraint is not None else None
        self.requests[rid] = (tuple(prompt), not loose and seed is None, max_tokens, grammar)
        self.tokens[rid] = []

    @rule()
    def step(self):
        self._record(self.engine.step())

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        assert self.engine.abort_request(rid)
        del self.requests[rid]

    @rule()
    def abort_unknown(self):
        assert not self.engine.abort_request("no-such-request")

    @rule()
    def drain(self):
        for _ in range(200):
            if not self.engine.has_unfinished():
                break
            self._record(self.engine.step())
        assert not self.engine.has_unfinished()
        assert not self.requests

    def _record(self, outputs) -> None:
        for out in outputs:
            assert out.request_id in self.requests, f"output for {out.request_id}, which is not running"
            assert 0 <= out.cached_tokens < len(self.requests[out.request_id][0])
            self.tokens[out.request_id] += out.new_token_ids
            if out.finished:
                self._check_finished(out.request_id, out.finish_reason)

    def _check_finished(self, rid: str, reason: str | None) -> None:
        prompt, exact, max_tokens, grammar = self.requests.pop(rid)
        tokens = self.tokens[rid]
        self.contexts.append(list(prompt) + tokens)
        assert 1 <= len(tokens) <= max_tokens
        ended_by_eos = tokens[-1] in self.engine._eos
        assert reason == ("stop" if ended_by_eos else "length")
        assert ended_by_eos or len(tokens) == max_tokens
        self._check_grammar(tokens, grammar)
        if exact:
            assert tuple(tokens) == greedy_alone(prompt, grammar)[:max_tokens], (rid, prompt)

    def _check_grammar(self, tokens: list[int], grammar: str | None) -> None:
        if grammar is not None:
            tokenizer, eos = pair()[2], sorted(self.engine._eos)
            assert grammar_valid_prefix(tokenizer, self.engine.vocab_size, eos, grammar, tokens) == len(tokens)

    @invariant()
    def consistent(self):
        self.engine.check()
        assert self.engine.num_active == len(self.requests)
        for rid, (prompt, exact, _, grammar) in self.requests.items():
            tokens = tuple(self.tokens[rid])
            self._check_grammar(list(tokens), grammar)
            if exact:
                assert tokens == greedy_alone(prompt, grammar)[:len(tokens)], (rid, prompt)


EngineMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
test_engine_state_machine = EngineMachine.TestCase
