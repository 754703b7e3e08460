"""The n-gram stage: prompt lookup over an incremental index of each row's context, and over its
scope's recent answers (docs/design.md §1.1)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from fly_llm.common.config import FLyConfig
from fly_llm.decoding.stages.base import Proposal, RowStart, Stage, continue_from
from fly_llm.decoding.stages.recent_answers import PROMPT_TAIL, RecentAnswers, index_ngrams


@dataclass
class _NgramRow:
    scope: str  # whose recent answers it keeps its answer with …
    prompt_length: int
    copies_recent: bool  # … and may copy from
    first_end: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> end of its first occurrence
    indexed: int = 0  # context tokens indexed so far
    last: list[int] = field(default_factory=list)  # the previous proposal …
    last_at: int = 0  # … and the context length it continued


class NgramStage(Stage):
    """Prompt-lookup drafting over an incremental index of each row's committed context.

    The proposal copies what followed the earliest earlier occurrence of the context's last n tokens
    (n from `max_ngram` down to 1). The index maps every n-gram (n <= max_ngram) to the end of its
    earliest occurrence, so a lookup costs max_ngram dict probes whatever the context length. On a
    miss (no n-gram of any length occurred before) the stage reuses its previous proposal: what is
    left of it after the tokens emitted since. A copied span interrupted by a one-token variant
    often goes on (the premise of FLy's deferred window), and a wrong proposal costs only its
    verification columns. As a drafter it chains lookups (each continues the copy) up to k tokens.

    With `recent` the stage also copies from the row's scope's recent answers
    (fly_llm.decoding.stages.recent_answers) when one of them holds a longer suffix of the context
    than the context itself (unless its RowStart says it may not), and keeps each answered row there
    when it leaves.
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 4, ngram_tokens: int = 6, recent: RecentAnswers | None = None) -> None:
        self.max_ngram = max_ngram
        self.ngram_tokens = ngram_tokens
        self.recent = recent
        self.rows: list[_NgramRow] = []

    @classmethod
    def build(cls, config: FLyConfig, draft) -> NgramStage:
        """Lookups of up to `config.max_ngram` tokens copying `config.ngram_tokens`, and over
        `config.recent_answers` tokens of recent answers."""
        recent = RecentAnswers(config.recent_answers) if config.recent_answers else None
        return cls(config.max_ngram, config.ngram_tokens, recent)

    def add_row(self, start: RowStart) -> None:
        """Append a row for a new request (its index is built from the context on first use)."""
        self.rows.append(_NgramRow(start.scope, start.prompt_length, start.copies_recent))

    def answered(self, row: int, tokens: list[int]) -> None:
        """Keep the row's answer (after its prompt's last PROMPT_TAIL tokens) among its scope's recent answers."""
        state = self.rows[row]
        if self.recent is not None and len(tokens) > state.prompt_length:
            self.recent.add(state.scope, tokens[max(0, state.prompt_length - PROMPT_TAIL):])

    def remove_rows(self, keep: list[int]) -> None:
        """Keep only the rows at these indices."""
        self.rows = [self.rows[i] for i in keep]

    def check(self, contexts: list[list[int]]) -> None:
        """Assert one row per context, and the recent answers' books."""
        assert len(self.rows) == len(contexts), (len(self.rows), len(contexts))
        if self.recent is not None:
            self.recent.check()

    def propose(self, contexts: list[list[int]], ks: list[int], upstreams: list[Sequence[Stage]],
                configs: list[FLyConfig]) -> Proposal:
        """Per row with ks[b] > 0: chained continuations (upstream stages' first, then this stage's)."""
        drafts = [self._chain((*upstreams[b], self), b, contexts[b], k) if k > 0 else [] for b, k in enumerate(ks)]
        return Proposal(drafts, [0] * len(contexts))

    def continuation(self, row: int, context: list[int], drafted: list[int], room: int) -> list[int]:
        """`propose_row` at the committed context, else a `lookup` after the drafts."""
        return self.propose_row(row, context, room) if not drafted else self.lookup(row, context + drafted, room)

    def propose_row(self, row: int, context: list[int], k: int) -> list[int]:
        """Up to k tokens continuing `context` (the row's committed tokens); [] when nothing fits."""
        state = self.rows[row]
        self._index(state, context)
        tokens = self.lookup(row, context, k)
        if not tokens:
            consumed = len(context) - state.last_at
            tokens = state.last[consumed:consumed + k] if 0 <= consumed < len(state.last) else []
        if tokens:
            state.last, state.last_at = tokens, len(context)
        return tokens

    def lookup(self, row: int, tokens: list[int], k: int) -> list[int]:
        """Up to min(k, ngram_tokens) tokens that followed the earliest earlier occurrence of the
        longest matching suffix of `tokens` (committed context plus speculative drafts), or what
        followed a longer one in a recent answer of the row's scope."""
        state = self.rows[row]
        count = min(k, self.ngram_tokens)
        if count <= 0:
            return []
        n, copy = self._in_context(state, tokens, count)
        if self.recent is not None and state.copies_recent:
            _, recent = self.recent.lookup(state.scope, tokens, count, at_least=n + 1)
            copy = recent or copy
        return copy

    def _in_context(self, state: _NgramRow, tokens: list[int], count: int) -> tuple[int, list[int]]:
        """`(n, continuation)` of the longest suffix of `tokens` that occurred earlier in them; `(0, [])`: none."""
        for n in range(min(self.max_ngram, len(tokens)), 0, -1):
            end = state.first_end.get(tuple(tokens[-n:]))
            if end is not None and end < len(tokens):
                return n, tokens[end:end + count]
        return 0, []

    @staticmethod
    def _chain(stages: Sequence[Stage], row: int, context: list[int], k: int) -> list[int]:
        """Continuations chained (each continues the copy) up to k tokens."""
        tokens = continue_from(stages, row, context, [], k)
        while tokens and len(tokens) < k:
            more = continue_from(stages, row, context, tokens, k - len(tokens))
            if not more:
                break
            tokens = tokens + more
        return tokens

    def _index(self, state: _NgramRow, context: list[int]) -> None:
        index_ngrams(state.first_end, context, state.indexed, self.max_ngram)
        state.indexed = len(context)
