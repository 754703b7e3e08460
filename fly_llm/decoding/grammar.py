"""Constrained decoding inside speculation (docs/design.md §1.5), on llguidance.

- `grammar_of(constraint)`: the llguidance grammar (Lark syntax with inline JSON Schemas) of a
  `fly_llm.constraints.Constraint` (a grammar, a regex or a JSON Schema). The engine knows no tools:
  the serving edge (fly_llm.tool_formats) turns a request's structure options into the constraint.
- `GrammarCompiler`: builds llguidance's view of the tokenizer once, compiles grammars into
  matchers (a bounded cache of compiled prototypes, copied per request) and reports bad ones as
  BadRequest naming the problem (and the constraint's part, e.g. a tool's parameters, when one is the cause). Every
  grammar is untrusted: schemas are walked against caps first (`schema_limits`), a grammar not
  seen before compiles first in a sacrificial worker process (`grammar_sandbox`), then here on a
  big-stack thread with llguidance's limits. Thread-safe: any thread may compile while the model
  thread decodes.
- `GrammarStage`: the cascade's grammar stage. Each row has its own matcher (or none), kept at
  the row's committed tokens between rounds. It proposes the tokens the grammar forces (free
  drafts), cuts a draft at its first forbidden token, and gives the allowed-token masks for the
  target's logits at every verified position; `observe` feeds it each round's emitted tokens.
  A row whose matcher fails (the grammar allows no continuation, a parser limit) is reported by
  `failures`, for the engine to end that request with an error.
"""

from __future__ import annotations

import json
import threading
import time

import llguidance
import llguidance.torch
import torch

from fly_llm.decoding.grammar_sandbox import (MEMORY_BYTES, TIMEOUT_S, GrammarSandbox, big_stack_call,
                                              build_tokenizer, compile_grammar, shared_sandbox, tokenizer_setup)
from fly_llm.constraints import Constraint, json_lexeme
from fly_llm.errors import BadRequest
from fly_llm.lru import LruCache
from fly_llm.schema_limits import SchemaCaps, check_schema

COMPILED_CACHE_SIZE = 64
"""Compiled grammars kept for reuse (LRU), and as many constraints' grammar texts."""


def grammar_of(constraint: Constraint, caps: SchemaCaps = SchemaCaps()) -> str:
    """The llguidance grammar of a constraint; BadRequest when its JSON Schema exceeds `caps`."""
    if constraint.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(constraint.text)
    if constraint.kind == "json_schema":
        schema = json.loads(constraint.text)
        check_schema(schema, caps)
        return f"start: {json_lexeme(schema)}\n"
    return constraint.text


class GrammarCompiler:
    """Compiles grammars into llguidance matchers over one tokenizer (built on first use: ~2 s for Qwen).

    Thread-safe. `sandbox` (on by default) compiles each grammar not seen before in a worker process
    first, within `timeout_s` and `memory_bytes` (docs/design.md §1.5); `caps` bound the schemas.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int], *, sandbox: bool = True,
                 timeout_s: float = TIMEOUT_S, memory_bytes: int = MEMORY_BYTES,
                 caps: SchemaCaps = SchemaCaps()) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.caps = caps
        self._sandbox_limits = (timeout_s, memory_bytes) if sandbox else None
        self._special: dict[tuple[str, ...], frozenset[str]] = {}
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._sandbox: GrammarSandbox | None = None
        self._setup: dict | None = None
        self._compiled: LruCache[str, llguidance.LLMatcher] = LruCache(COMPILED_CACHE_SIZE)
        self._grammars: LruCache[Constraint, str] = LruCache(COMPILED_CACHE_SIZE)  # constraint -> its grammar
        self._lock = threading.RLock()  # the caches and the tokenizer view
        self.compile_s = 0.0
        """Seconds spent building the tokenizer view and compiling grammars so far."""

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer."""
        with self._lock:
            if self._tokenizer is None:
                start = time.perf_counter()
                self._tokenizer = build_tokenizer(self.setup)
                self.compile_s += time.perf_counter() - start
            return self._tokenizer

    @property
    def setup(self) -> dict:
        """The tokenizer as the sandbox's worker gets it (both build their view from it)."""
        with self._lock:
            if self._setup is None:
                self._setup = tokenizer_setup(self._hf_tokenizer, self.vocab_size, self.eos_ids)
            return self._setup

    def special_tokens(self, texts: tuple[str, ...]) -> frozenset[str]:
        """Those of `texts` that are one special token each for llguidance (Qwen2.5's `<tool_call>`)."""
        with self._lock:
            if texts not in self._special:
                ids = {text: self._hf_tokenizer.encode(text, add_special_tokens=False) for text in texts}
                self._special[texts] = frozenset(text for text, tokens in ids.items()
                                                 if len(tokens) == 1 and self.tokenizer.is_special_token(tokens[0]))
            return self._special[texts]

    @property
    def sandbox(self) -> GrammarSandbox | None:
        """The worker process grammars compile in first (shared by compilers over one tokenizer); None: off."""
        with self._lock:
            if self._sandbox is None and self._sandbox_limits is not None:
                self._sandbox = shared_sandbox(self.setup, *self._sandbox_limits)
            return self._sandbox

    def grammar(self, constraint: Constraint) -> str:
        """The grammar of a constraint, remembered (a repeated JSON Schema is not walked again)."""
        return self._grammars.get_or_make(constraint, lambda: grammar_of(constraint, self.caps))

    def for_constraint(self, constraint: Constraint | None) -> llguidance.LLMatcher | None:
        """A matcher for a constraint (None: free output).

        When the grammar does not compile, the first of the constraint's parts that fails on its
        own is named in the BadRequest (checked only then, so good requests pay nothing for it).
        """
        if constraint is None:
            return None
        grammar = self.grammar(constraint)
        try:
            return self.matcher(grammar)
        except BadRequest:
            for what, schema in constraint.parts:
                try:
                    self._prototype(f"start: {json_lexeme(json.loads(schema))}\n")
                except BadRequest as exc:
                    reason = exc.message.splitlines()[0].split(": ", 1)[-1]
                    raise BadRequest(f"{what} cannot be used: {reason}") from None
            raise

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher at the start of `grammar`; BadRequest if it does not compile, its language is
        empty, or (in the sandbox) it crashes the compiler, takes too long or too much memory."""
        return self._prototype(grammar).deep_copy()

    def _prototype(self, grammar: str) -> llguidance.LLMatcher:
        """The compiled grammar from the cache, or compiled now (sandbox first) and cached."""
        return self._compiled.get_or_make(grammar, lambda: self._compile(grammar))

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        """`grammar` compiled in the sandbox first (when on), then here."""
        if self._sandbox_limits is not None:
            self.sandbox.check(grammar)
        tokenizer = self.tokenizer
        start = time.perf_counter()
        prototype = big_stack_call(lambda: compile_grammar(tokenizer, grammar))
        with self._lock:
            self.compile_s += time.perf_counter() - start
        return prototype


class GrammarStage:
    """Per-row matchers, kept at each row's committed tokens between rounds (None: a free row)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.rows: list[llguidance.LLMatcher | None] = []
        self.consumed: list[int] = []  # context tokens each row's matcher has seen (prompt included)

    def add_row(self, matcher: llguidance.LLMatcher | None, prompt_length: int) -> None:
        """Append a row whose matcher (if any) is at the start of its output."""
        self.rows.append(matcher)
        self.consumed.append(prompt_length)

    def remove_rows(self, keep: list[int]) -> None:
        """Keep only the rows at these indices."""
        self.rows = [self.rows[i] for i in keep]
        self.consumed = [self.consumed[i] for i in keep]

    def propose(self, row: int, budget: int) -> list[int]:
        """The tokens the grammar forces next (at most `budget`): free drafts, nearly always accepted."""
        matcher = self.rows[row]
        if matcher is None or budget <= 0 or matcher.is_stopped():
            return []
        return matcher.compute_ff_tokens()[:budget]

    def cut(self, row: int, draft: list[int]) -> list[int]:
        """The longest prefix of `draft` that the grammar allows."""
        matcher = self.rows[row]
        if matcher is None or not draft:
            return draft
        return draft[:matcher.validate_tokens(draft)]

    def masks(self, drafts: list[list[int]], width: int) -> tuple[list[int], torch.Tensor] | None:
        """Allowed tokens at each verified position of the constrained rows: (rows, bool [R, width, V]).

        Position j of row b is the state after its first j draft tokens (all of which the grammar
        allows, see `cut`); positions past len(draft) are left all-allowed (never used).
        """
        rows = [b for b, m in enumerate(self.rows) if m is not None]
        if not rows:
            return None
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(rows) * width, words), -1, dtype=torch.int32)
        for i, b in enumerate(rows):
            matcher, draft = self.rows[b], drafts[b]
            consumed = 0
            for j in range(len(draft) + 1):
                llguidance.torch.fill_next_token_bitmask(matcher, bitmask, i * width + j)
                # stopped: only EOS can follow (or the matcher failed: `failures` reports it after the round)
                if j < len(draft) and not matcher.is_stopped() and matcher.consume_token(draft[j]):
                    consumed += 1
            matcher.rollback(consumed)
        bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.view(len(rows), width, words * 32)[..., :self.vocab_size].bool()
        return rows, allowed

    def observe(self, contexts: list[list[int]]) -> None:
        """Feed each constrained row the tokens its context gained this round."""
        for b, (matcher, context) in enumerate(zip(self.rows, contexts)):
            new = context[self.consumed[b]:]
            self.consumed[b] = len(context)
            for token in new if matcher is not None else ():
                if matcher.is_stopped() or not matcher.consume_token(token):  # refused: the matcher failed
                    break

    def failures(self) -> list[tuple[int, str]]:
        """`(row, the grammar problem)` for each row whose matcher failed: the output so far has no
        continuation in the grammar's language, or the grammar hit a parser limit. The engine ends
        those requests with that error (the other rows go on)."""
        return [(b, _problem(m)) for b, m in enumerate(self.rows) if m is not None and m.is_error()]

    def check(self, contexts: list[list[int]]) -> None:
        """Assert one entry per row, every matcher at its row's committed context and none in error."""
        assert len(self.rows) == len(self.consumed) == len(contexts), (len(self.rows), len(contexts))
        assert self.consumed == [len(c) for c in contexts], "grammar matchers behind their rows"
        assert not any(m is not None and m.is_error() for m in self.rows), "a grammar matcher is in error"


def _problem(matcher: llguidance.LLMatcher) -> str:
    """What a failed matcher's grammar did wrong, in words."""
    detail = (matcher.get_error() or "no detail").splitlines()[0]
    if detail in ("NoExtension", "NoExtensionBias"):
        return f"the grammar allows no continuation of the output so far: its language is empty from there ({detail})"
    if detail in ("ParserTooComplex", "LexerTooComplex"):
        return f"the grammar is too complex for the parser's limits while decoding ({detail})"
    return f"the grammar failed while decoding: {detail}"


def apply_masks(logits: torch.Tensor, masks: tuple[list[int], torch.Tensor] | None) -> None:
    """In place: -inf at the tokens a row's grammar forbids ([B, K+1, V] logits; V may exceed the mask's)."""
    if masks is None:
        return
    rows, allowed = masks
    vocab = allowed.shape[-1]
    index = torch.tensor(rows, device=logits.device)
    block = logits.index_select(0, index)
    block[..., :vocab].masked_fill_(~allowed.to(logits.device), float("-inf"))
    block[..., vocab:] = float("-inf")
    logits.index_copy_(0, index, block)


class GrammarLogitsProcessor:
    """A Hugging Face `generate` logits processor that constrains one sequence by a grammar.

    The baseline fly-bench's structured runs compare against (target-only decoding under the same
    grammar); it reuses the grammar stage's masks, one row, one position per step.
    """

    def __init__(self, matcher: llguidance.LLMatcher, prompt_length: int, vocab_size: int) -> None:
        self.stage = GrammarStage(vocab_size)
        self.stage.add_row(matcher, prompt_length)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.stage.observe([input_ids[0].tolist()])
        logits = scores.unsqueeze(1)
        apply_masks(logits, self.stage.masks([[]], 1))
        return logits.squeeze(1)
