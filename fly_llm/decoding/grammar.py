"""Constrained decoding inside speculation (docs/design.md §1.5), on llguidance.

- `grammar_of(constraint)`: the llguidance grammar (Lark syntax with inline JSON Schemas) of a
  `fly_llm.common.constraints.Constraint` (a grammar, a regex or a JSON Schema). The engine knows no tools:
  the serving edge (fly_llm.common.tool_formats) turns a request's structure options into the constraint.
- `GrammarCompiler`: builds llguidance's view of the tokenizer once, compiles grammars into
  matchers (a cache of compiled prototypes bounded in bytes, copied per request; a grammar whose compiled
  form is bigger than a per-grammar cap is refused) and reports bad ones as
  BadRequest naming the problem (and the constraint's part, e.g. a tool's parameters, when one is the cause). Every
  grammar is untrusted: schemas are walked against caps first (`schema_limits`), a grammar not
  seen before compiles first in a sacrificial worker process (`grammar_sandbox`), then here on a
  big-stack thread with llguidance's limits. Thread-safe: any thread may compile while the model
  thread decodes. Every cache is scoped (a tenant): a grammar one tenant sent never makes another's
  compile fast, so timing tells nobody what others sent.
- `apply_masks`: the target's logits masked by the grammar stage's allowed tokens (the stage itself,
  forced tokens, cuts and masks per row, is `fly_llm.decoding.stages.grammar.GrammarStage`).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import llguidance
import torch

from fly_llm.decoding.grammar_sandbox import (MEMORY_BYTES, TIMEOUT_S, WORKERS, GrammarSandbox, big_stack_call,
                                              build_tokenizer, compile_grammar, shared_sandbox, tokenizer_setup)
from fly_llm.decoding.heap_bytes import kept_bytes
from fly_llm.decoding.stages import GrammarStage, RowStart
from fly_llm.common.constraints import Constraint, json_lexeme
from fly_llm.common.errors import BadRequest
from fly_llm.common.lru import ENTRY_BYTES, LruCache, text_bytes
from fly_llm.common.schema_limits import SchemaCaps, check_schema
from fly_llm.common.stats import GrammarCacheStats

CACHE_BYTES = 256 << 20
"""Bytes of compiled grammars kept for reuse (LRU): their compiled forms as measured, and their texts."""
MAX_GRAMMAR_BYTES = 64 << 20
"""The most one grammar's compiled form may take; a bigger one is refused (BadRequest naming the cap)."""
TEXTS_SHARE = 8
"""The constraints' grammar texts kept for reuse (LRU) take at most 1/TEXTS_SHARE of the compiled grammars'
budget (as do the serving edge's structures' constraints, `fly_llm.common.tool_formats.Constraints`)."""

T = TypeVar("T")


class Compiled(NamedTuple):
    """A compiled grammar (a matcher at its start, copied per request) and the bytes it keeps."""

    prototype: llguidance.LLMatcher
    nbytes: int


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
    first (one of `workers` processes), within `timeout_s` and `memory_bytes` (docs/design.md §1.5), and
    measures its compiled form
    there (without the sandbox it is measured here); `caps` bound the schemas. Compiled grammars are kept
    within `cache_bytes`; one whose compiled form takes more than `max_grammar_bytes` is refused.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int], *, sandbox: bool = True,
                 timeout_s: float = TIMEOUT_S, memory_bytes: int = MEMORY_BYTES,
                 caps: SchemaCaps = SchemaCaps(), cache_bytes: int = CACHE_BYTES,
                 max_grammar_bytes: int = MAX_GRAMMAR_BYTES, workers: int = WORKERS) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.caps = caps
        self.max_grammar_bytes = max_grammar_bytes
        self._sandbox_limits = (timeout_s, memory_bytes, workers) if sandbox else None
        self._special: dict[tuple[str, ...], frozenset[str]] = {}
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._sandbox: GrammarSandbox | None = None
        self._setup: dict | None = None
        self._compiled: LruCache[tuple[str, str], Compiled] = LruCache(cache_bytes, _compiled_bytes)  # by scope
        self.texts_budget = cache_bytes // TEXTS_SHARE
        """Bytes of text a cache of grammars' or constraints' texts may keep."""
        self._grammars: LruCache[tuple[str, Constraint], str] = LruCache(self.texts_budget, _text_bytes)  # -> grammar
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

    def grammar(self, constraint: Constraint, scope: str = "") -> str:
        """The grammar of a constraint, remembered in `scope` (a repeated JSON Schema is not walked again)."""
        return self._grammars.get_or_make((scope, constraint), lambda: grammar_of(constraint, self.caps))

    def for_constraint(self, constraint: Constraint | None, scope: str = "") -> llguidance.LLMatcher | None:
        """A matcher for a constraint (None: free output), from and into the caches of `scope` (a tenant).

        When the grammar does not compile, the first of the constraint's parts that fails on its
        own is named in the BadRequest (checked only then, so good requests pay nothing for it).
        """
        if constraint is None:
            return None
        grammar = self.grammar(constraint, scope)
        try:
            return self.matcher(grammar, scope)
        except BadRequest:
            for what, schema in constraint.parts:
                try:
                    self._prototype(f"start: {json_lexeme(json.loads(schema))}\n", scope)
                except BadRequest as exc:
                    reason = exc.message.splitlines()[0].split(": ", 1)[-1]
                    raise BadRequest(f"{what} cannot be used: {reason}") from None
            raise

    def compiled(self, constraint: Constraint, scope: str = "") -> llguidance.LLMatcher | None:
        """A fresh matcher for a constraint whose grammar `scope` has compiled already, else None: compiles
        nothing (its grammar text is made, within the schema caps, if not remembered)."""
        compiled = self._compiled.get((scope, self.grammar(constraint, scope)))
        return None if compiled is None else compiled.prototype.deep_copy()

    def matcher(self, grammar: str, scope: str = "") -> llguidance.LLMatcher:
        """A fresh matcher at the start of `grammar`; BadRequest if it does not compile, its language is
        empty, its compiled form is over the per-grammar cap, or (in the sandbox) it crashes the compiler,
        takes too long or too much memory."""
        return self._prototype(grammar, scope).deep_copy()

    def stats(self) -> GrammarCacheStats:
        """The caches' sizes and budgets now."""
        verdicts = self.sandbox.verdict_bytes() if self._sandbox_limits is not None else (0, 0)
        return GrammarCacheStats(compiled_bytes=self._compiled.bytes, compiled_entries=len(self._compiled),
                                 compiled_budget_bytes=self._compiled.budget, texts_bytes=self._grammars.bytes,
                                 texts_budget_bytes=self._grammars.budget, verdict_bytes=verdicts[0],
                                 verdict_budget_bytes=verdicts[1], max_grammar_bytes=self.max_grammar_bytes)

    def check(self) -> None:
        """Assert every cache's invariant: its byte count is its entries' and within its budget."""
        self._compiled.check()
        self._grammars.check()
        if self._sandbox_limits is not None:
            self.sandbox.check_invariants()

    def _prototype(self, grammar: str, scope: str) -> llguidance.LLMatcher:
        """The compiled grammar from `scope`'s cache, or compiled now (sandbox first) and cached there."""
        return self._compiled.get_or_make((scope, grammar), lambda: self._compile(grammar, scope)).prototype

    def _compile(self, grammar: str, scope: str) -> Compiled:
        """`grammar` compiled in the sandbox first (when on: its size is measured there), then here (measured
        here without the sandbox); BadRequest if its compiled form is over the per-grammar cap."""
        tokenizer = self.tokenizer
        if self._sandbox_limits is not None:
            nbytes = self._within_cap(self.sandbox.check(grammar, scope))
            return Compiled(self._timed(lambda: compile_grammar(tokenizer, grammar)), nbytes)
        prototype, nbytes = self._timed(lambda: kept_bytes(lambda: compile_grammar(tokenizer, grammar), grammar))
        return Compiled(prototype, self._within_cap(nbytes))

    def _timed(self, compile_: Callable[[], T]) -> T:
        """`compile_()` on a big-stack thread, its time added to `compile_s`."""
        start = time.perf_counter()
        result = big_stack_call(compile_)
        with self._lock:
            self.compile_s += time.perf_counter() - start
        return result

    def _within_cap(self, nbytes: int) -> int:
        """`nbytes`, if a grammar's compiled form of that size is within the per-grammar cap; else BadRequest."""
        if nbytes > self.max_grammar_bytes:
            raise BadRequest(f"the grammar compiles to {nbytes / 2**20:.1f} MiB, more than the per-grammar cap "
                             f"of {self.max_grammar_bytes / 2**20:g} MiB (the daemon's max_grammar_mb)")
        return nbytes


def _compiled_bytes(key: tuple[str, str], compiled: Compiled) -> int:
    return ENTRY_BYTES + text_bytes(*key) + compiled.nbytes


def _text_bytes(key: tuple[str, Constraint], grammar: str) -> int:
    scope, constraint = key
    return ENTRY_BYTES + text_bytes(scope, constraint.text, grammar, *(t for part in constraint.parts for t in part))


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
        self.stage.add_row(RowStart(prompt_length, matcher=matcher))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.stage.observe([], [input_ids[0].tolist()])
        logits = scores.unsqueeze(1)
        apply_masks(logits, self.stage.masks([[]], 1))
        return logits.squeeze(1)
