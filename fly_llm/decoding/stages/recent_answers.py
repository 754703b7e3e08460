"""Recent answers the n-gram stage also looks up, per cache scope (docs/design.md §1.1).

Consecutive requests of one client often repeat an earlier answer: a code-completion keystroke
asks again for the middle it was just given, a few characters further on; an agent re-emits the
same tool call; a regenerated reply starts over. Their own context does not hold that answer, so
prompt lookup cannot copy it. This store keeps the last answers of each scope (each with the tail of
its prompt, so the join between prompt and answer can match too), indexed like a row's context,
and bounded in tokens over all scopes (the oldest answer goes first). Like llama.cpp's dynamic
lookup cache, only the drafts change: the target verifies every copied token, so exact decoding
stays exact, and a scope (a tenant) never sees another's answers.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

PROMPT_TAIL = 8
"""Prompt tokens kept before each answer: the join a new request's first draft matches."""

MIN_NGRAM = 2
"""Shortest suffix looked up among answers: a single token says too little about which answer goes on."""


def index_ngrams(first_end: dict[tuple[int, ...], int], tokens: list[int], indexed: int, max_ngram: int) -> None:
    """Add to `first_end` (n-gram -> end of its first occurrence) every n-gram of up to `max_ngram` tokens
    ending after `tokens[:indexed]`, the part indexed before."""
    for end in range(indexed + 1, len(tokens) + 1):
        for n in range(1, min(max_ngram, end) + 1):
            first_end.setdefault(tuple(tokens[end - n:end]), end)


@dataclass
class _Answer:
    scope: str
    tokens: list[int]
    first_end: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> end of its first occurrence


class RecentAnswers:
    """The last answers per scope, at most `budget` tokens in all (0: none kept), looked up by their
    n-grams of up to `max_ngram` tokens."""

    def __init__(self, budget: int, max_ngram: int = 8) -> None:
        self.budget = budget
        self.max_ngram = max_ngram
        self._answers: OrderedDict[int, _Answer] = OrderedDict()  # every scope's, oldest first
        self._by_scope: dict[str, dict[int, _Answer]] = {}  # each scope's, oldest first
        self._ids = 0
        self.tokens = 0

    def add(self, scope: str, tokens: list[int]) -> None:
        """Keep `tokens` (a prompt's tail and its answer) as the scope's newest answer, dropping the
        oldest answers of any scope beyond the budget; an answer longer than the budget is cut to its start."""
        tokens = tokens[:self.budget]
        if len(tokens) <= MIN_NGRAM:
            return
        answer = _Answer(scope, tokens)
        index_ngrams(answer.first_end, tokens, 0, self.max_ngram)
        self._ids += 1
        self._answers[self._ids] = answer
        self._by_scope.setdefault(scope, {})[self._ids] = answer
        self.tokens += len(tokens)
        while self.tokens > self.budget:
            oldest_id, oldest = self._answers.popitem(last=False)
            self.tokens -= len(oldest.tokens)
            mine = self._by_scope[oldest.scope]
            del mine[oldest_id]
            if not mine:
                del self._by_scope[oldest.scope]

    def lookup(self, scope: str, tokens: list[int], count: int, at_least: int = MIN_NGRAM) -> tuple[int, list[int]]:
        """`(n, continuation)`: up to `count` tokens that followed the longest suffix of `tokens` (n >=
        `at_least` and >= MIN_NGRAM tokens) in the scope's newest answer holding it; `(0, [])` when none does."""
        if count <= 0:
            return 0, []
        answers = list(reversed(self._by_scope.get(scope, {}).values()))
        for n in range(min(self.max_ngram, len(tokens)), max(at_least, MIN_NGRAM) - 1, -1):
            key = tuple(tokens[-n:])
            for answer in answers:
                end = answer.first_end.get(key)
                if end is not None and end < len(answer.tokens):
                    return n, answer.tokens[end:end + count]
        return 0, []

    def check(self) -> None:
        """Assert the token count, the budget, and each index against its answer."""
        assert self.tokens == sum(len(a.tokens) for a in self._answers.values())
        assert self.tokens <= max(self.budget, 0)
        assert {i: a for mine in self._by_scope.values() for i, a in mine.items()} == dict(self._answers)
        assert all(a.scope == scope for scope, mine in self._by_scope.items() for a in mine.values())
        assert all(self._by_scope.values())
        for answer in self._answers.values():
            for key, end in answer.first_end.items():
                assert tuple(answer.tokens[end - len(key):end]) == key
