"""The grammar stage (docs/design.md §1.5): forced tokens as free drafts, cuts and masks for constrained rows."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import llguidance
import llguidance.torch
import torch

from fly_llm.common.config import FLyConfig
from fly_llm.decoding.grammar_sandbox import public_message
from fly_llm.common.errors import contained
from fly_llm.decoding.row_faults import log
from fly_llm.decoding.stages.base import Proposal, RowStart, Stage

T = TypeVar("T")

BROKEN = "the grammar engine failed on this request's grammar while decoding"
"""The problem of a row whose matcher raised (or panicked): the details go to the log only."""


class GrammarStage(Stage):
    """Per-row grammar matchers (None: a free row), kept at each row's committed tokens between rounds.

    It proposes the tokens the grammar forces (free drafts), cuts a draft at its first forbidden
    token, and gives the allowed-token masks for the target's logits at every verified position;
    `observe` feeds it each round's emitted tokens. A row whose matcher fails (the grammar allows
    no continuation, a parser limit) is reported by `failures`, for the engine to end that request
    with an error; so is a row whose matcher raised or panicked (it is *broken*: never called again).
    The cascade runs it first for every row, whatever the row's plan.
    """

    name = "grammar"

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.rows: list[llguidance.LLMatcher | None] = []
        self.consumed: list[int] = []  # context tokens each row's matcher has seen (prompt included)
        self.broken: list[bool] = []  # its matcher raised: the row ends after this round

    def add_row(self, start: RowStart) -> None:
        """Append a row whose matcher (`start.matcher`, if any) is at the start of its output."""
        self.rows.append(start.matcher)
        self.consumed.append(start.prompt_length)
        self.broken.append(False)

    def remove_rows(self, keep: list[int]) -> None:
        """Keep only the rows at these indices."""
        self.rows = [self.rows[i] for i in keep]
        self.consumed = [self.consumed[i] for i in keep]
        self.broken = [self.broken[i] for i in keep]

    def propose(self, contexts: list[list[int]], ks: list[int], upstreams: list[Sequence[Stage]],
                configs: list[FLyConfig]) -> Proposal:
        """The tokens each row's grammar forces next (at most ks[b]): free drafts, nearly always accepted."""
        return Proposal([self._guarded(b, lambda: self._forced(b, k), []) for b, k in enumerate(ks)], [0] * len(ks))

    def _forced(self, row: int, budget: int) -> list[int]:
        matcher = self.rows[row]
        if matcher is None or budget <= 0 or matcher.is_stopped():
            return []
        return matcher.compute_ff_tokens()[:budget]

    def cut(self, row: int, draft: list[int]) -> list[int]:
        """The longest prefix of `draft` that the grammar allows (none of it for a broken row)."""
        matcher = self.rows[row]
        if matcher is None or not draft:
            return draft
        return self._guarded(row, lambda: draft[:matcher.validate_tokens(draft)], [])

    def _guarded(self, row: int, work: Callable[[], T], default: T) -> T:
        """`work()` for one row; `default` when the row is broken or `work` raises (then it is broken)."""
        if not self.broken[row]:
            try:
                return work()
            except BaseException as exc:
                if not contained(exc):
                    raise
                log.error("a grammar matcher raised; its row ends", exc_info=exc)
                self.broken[row] = True
        return default

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
            if not self._guarded(b, lambda: self._fill(self.rows[b], drafts[b], bitmask, i * width), False):
                bitmask[i * width:(i + 1) * width] = -1  # a broken row: unmasked, and it ends after the round
        bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.view(len(rows), width, words * 32)[..., :self.vocab_size].bool()
        return rows, allowed

    @staticmethod
    def _fill(matcher: llguidance.LLMatcher, draft: list[int], bitmask: torch.Tensor, first: int) -> bool:
        """Fill one row's masks from bitmask row `first` on: the state after each prefix of its draft."""
        consumed = 0
        for j in range(len(draft) + 1):
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, first + j)
            # stopped: only EOS can follow (or the matcher failed: `failures` reports it after the round)
            if j < len(draft) and not matcher.is_stopped() and matcher.consume_token(draft[j]):
                consumed += 1
        matcher.rollback(consumed)
        return True

    def observe(self, valid: list[int], contexts: list[list[int]]) -> None:
        """Feed each constrained row the tokens its context gained this round."""
        for b, (matcher, context) in enumerate(zip(self.rows, contexts)):
            new = context[self.consumed[b]:]
            self.consumed[b] = len(context)
            if matcher is not None:
                self._guarded(b, lambda: self._feed(matcher, new), None)

    @staticmethod
    def _feed(matcher: llguidance.LLMatcher, tokens: list[int]) -> None:
        """Feed a row's new context tokens to its matcher, up to the first it refuses (then it is in error)."""
        for token in tokens:
            if matcher.is_stopped() or not matcher.consume_token(token):  # refused: the matcher failed
                break

    def failures(self) -> list[tuple[int, str]]:
        """`(row, the grammar problem)` for each row whose matcher failed: the output so far has no
        continuation in the grammar's language, the grammar hit a parser limit, or the matcher raised.
        The engine ends those requests with that error (the other rows go on)."""
        problems = [self._guarded(b, lambda: _problem(m) if m is not None and m.is_error() else None, None)
                    for b, m in enumerate(self.rows)]
        return [(b, BROKEN if self.broken[b] else problem) for b, problem in enumerate(problems)
                if problem is not None or self.broken[b]]

    def check(self, contexts: list[list[int]]) -> None:
        """Assert one entry per row, every matcher at its row's committed context and none in error."""
        assert len(self.rows) == len(self.consumed) == len(contexts), (len(self.rows), len(contexts))
        assert self.consumed == [len(c) for c in contexts], "grammar matchers behind their rows"
        assert not any(m is not None and m.is_error() for m in self.rows), "a grammar matcher is in error"
        assert not any(self.broken), "a broken grammar row is still running"


def _problem(matcher: llguidance.LLMatcher) -> str:
    """What a failed matcher's grammar did wrong, in words."""
    detail = public_message(matcher.get_error() or "no detail")
    if detail in ("NoExtension", "NoExtensionBias"):
        return f"the grammar allows no continuation of the output so far: its language is empty from there ({detail})"
    if detail in ("ParserTooComplex", "LexerTooComplex"):
        return f"the grammar is too complex for the parser's limits while decoding ({detail})"
    return f"the grammar failed while decoding: {detail}"
