"""Draft stages and the draft cascade (docs/design.md §1.1).

Three stages, the first two in the spirit of Hugging Face's candidate generators:

- `NgramStage`: prompt lookup. The proposal copies what followed the earliest earlier
  occurrence of the context's last n tokens (n from `max_ngram` down to 1). Nearly free.
- `ModelStage`: the draft model, greedy, over its own batched KV cache (`BatchKV`) that is
  rolled back to the accepted length after every round.

`- `GrammarStage` (fly_llm.decoding.grammar): for rows under a grammar, the tokens the grammar
  forces are drafted first, at no model cost, and every draft is cut at its first token the
  grammar forbids.

`Cascade` combines them per row and per round: n-gram only (lookups chained up to K tokens),
model only (K greedy draft steps), or n-gram → model, where each n-gram proposal is checked by
the draft model in one forward with exact match (lossless with respect to the draft model), the
draft model adds its own next token, and this repeats until K tokens exist.

Row bookkeeping: every stage holds one row per engine row, in the engine's order (`add_row`,
`remove_rows`); after verification the engine calls `rollback(valid)` with the number of leading
tokens of each row's context that are still right.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from fly_llm.decoding.cache import BatchKV
from fly_llm.decoding.grammar import GrammarStage

_CATCH_UP_AT = 4
"""A draft row more than this many tokens behind is caught up in a separate forward first."""


@dataclass
class _NgramRow:
    first_end: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> end of its first occurrence
    indexed: int = 0  # context tokens indexed so far
    last: list[int] = field(default_factory=list)  # the previous proposal …
    last_at: int = 0  # … and the context length it continued


class NgramStage:
    """Prompt-lookup drafting over an incremental index of each row's committed context.

    The index maps every n-gram (n <= max_ngram) to the end of its earliest occurrence, so a
    lookup costs max_ngram dict probes whatever the context length. On a miss (no n-gram of any
    length occurred before) the stage reuses its previous proposal: what is left of it after the
    tokens emitted since. A copied span interrupted by a one-token variant often goes on (the
    premise of FLy's deferred window), and a wrong proposal costs only its verification columns.
    """

    def __init__(self, max_ngram: int = 4, ngram_tokens: int = 6) -> None:
        self.max_ngram = max_ngram
        self.ngram_tokens = ngram_tokens
        self.rows: list[_NgramRow] = []

    def add_row(self) -> None:
        """Append a row for a new request."""
        self.rows.append(_NgramRow())

    def remove_rows(self, keep: list[int]) -> None:
        """Keep only the rows at these indices."""
        self.rows = [self.rows[i] for i in keep]

    def propose(self, row: int, context: list[int], k: int) -> list[int]:
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
        longest matching suffix of `tokens` (committed context plus speculative drafts)."""
        first_end = self.rows[row].first_end
        count = min(k, self.ngram_tokens)
        if count <= 0:
            return []
        for n in range(min(self.max_ngram, len(tokens)), 0, -1):
            end = first_end.get(tuple(tokens[-n:]))
            if end is not None and end < len(tokens):
                return tokens[end:end + count]
        return []

    def _index(self, state: _NgramRow, context: list[int]) -> None:
        first_end = state.first_end
        for end in range(state.indexed + 1, len(context) + 1):
            for n in range(1, min(self.max_ngram, end) + 1):
                first_end.setdefault(tuple(context[end - n:end]), end)
        state.indexed = len(context)


class ModelStage:
    """Greedy drafting with a draft model over its own batched KV cache.

    Invariant: row b's cache holds a prefix of its context plus drafts (`kv.lengths[b]` tokens);
    before drafting, the tokens after that prefix are fed first (normally 1 or 2 tokens).
    `forwards[b]` counts the forwards row b took part in during the last `propose`.
    """

    def __init__(self, model, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.kv = BatchKV(device)
        self.forwards: list[int] = []

    def add_row(self, row: BatchKV) -> None:
        """Append a row whose cache is `row`: a one-row BatchKV holding a prefix of the context
        (the prompt minus its last token when prefilled; less is caught up on first use)."""
        self.kv.add_row(row)

    def remove_rows(self, keep: list[int]) -> None:
        """Keep only the rows at these indices."""
        self.kv.remove_rows(keep)

    def rollback(self, valid: list[int]) -> None:
        """Forget each row's cached tokens past the first valid[b] of its context."""
        self.kv.truncate(valid)

    def behind(self, contexts: list[list[int]]) -> list[int]:
        """Per row, the context tokens its cache lacks besides the last: what a round prefills first."""
        return [max(len(c) - 1 - n, 0) for c, n in zip(contexts, self.kv.lengths)]

    def propose(self, contexts: list[list[int]], ks: list[int], ngram: NgramStage | None = None,
                ngram_rows: list[bool] | None = None, confidence: list[float] | None = None) -> list[list[int]]:
        """Draft up to ks[b] tokens per row (0 = row not drafting; it is left untouched).

        With `ngram`, each forward also checks an n-gram proposal for the rows in `ngram_rows`
        (default all): the longest prefix equal to the draft model's own greedy choices is kept,
        plus the model's next token. With `confidence`, row b stops drafting after a token of its
        own to which the draft model gives less than confidence[b] probability (0: never).
        """
        rows = len(contexts)
        drafts: list[list[int]] = [[] for _ in range(rows)]
        active = [b for b in range(rows) if ks[b] > 0]
        self.forwards = [0] * rows
        self._catch_up(contexts, active)
        while active:
            for b in active:
                self.forwards[b] += 1
            feeds: list[list[int]] = [[] for _ in range(rows)]
            proposals: dict[int, list[int]] = {}
            for b in active:
                tokens = contexts[b] + drafts[b]
                room = ks[b] - len(drafts[b]) - 1  # the model adds one token of its own
                proposal = []
                if ngram is not None and (ngram_rows is None or ngram_rows[b]):
                    proposal = self._lookup(ngram, b, contexts[b], tokens, room)
                proposals[b] = proposal
                feeds[b] = tokens[self.kv.lengths[b]:] + proposal
            width = max(len(f) for f in feeds)
            keep_last = max(len(proposals[b]) + 1 + width - len(feeds[b]) for b in active)
            input_ids = torch.tensor([f + [0] * (width - len(f)) for f in feeds], device=self.device)
            before = list(self.kv.lengths)
            logits = self.kv.forward(self.model, input_ids, logits_to_keep=keep_last)
            choices = logits.argmax(-1).tolist()
            offset = width - keep_last  # column of choices[b][0] in the forward
            valid = before
            own: dict[int, int] = {}  # row -> column of the model's own token in `choices`
            for b in active:
                proposal = proposals[b]
                first = len(feeds[b]) - len(proposal) - 1 - offset
                greedy = choices[b][first:first + len(proposal) + 1]
                m = common_prefix(proposal, greedy)
                valid[b] = len(contexts[b]) + len(drafts[b]) + m
                drafts[b] += proposal[:m] + [greedy[m]]
                own[b] = first + m
            self.kv.truncate(valid)
            unsure = _unconfident(logits, own, confidence) if confidence else set()
            active = [b for b in active if len(drafts[b]) < ks[b] and b not in unsure]
        return drafts

    def _lookup(self, ngram: NgramStage, b: int, context: list[int], tokens: list[int], room: int) -> list[int]:
        if len(tokens) == len(context):
            return ngram.propose(b, context, room)
        return ngram.lookup(b, tokens, room)

    def _catch_up(self, contexts: list[list[int]], active: list[int]) -> None:
        """Feed long backlogs (all but each row's last token) in one forward of their own."""
        behind = {b: contexts[b][self.kv.lengths[b]:-1] for b in active}
        if max((len(t) for t in behind.values()), default=0) <= _CATCH_UP_AT:
            return
        width = max(len(t) for t in behind.values())
        feeds = [behind.get(b, []) for b in range(len(contexts))]
        target = [self.kv.lengths[b] + len(feeds[b]) for b in range(len(contexts))]
        input_ids = torch.tensor([f + [0] * (width - len(f)) for f in feeds], device=self.device)
        self.kv.forward(self.model, input_ids, logits_to_keep=1)
        self.kv.truncate(target)
        for b in behind:
            self.forwards[b] += 1


def _unconfident(logits: torch.Tensor, columns: dict[int, int], confidence: list[float]) -> set[int]:
    """Rows whose greedy token at `columns[b]` has a draft probability below confidence[b] (> 0)."""
    rows = [b for b in columns if confidence[b] > 0]
    if not rows:
        return set()
    picked = logits[rows, [columns[b] for b in rows]].float()
    top = torch.softmax(picked, -1).max(-1).values.tolist()
    return {b for b, p in zip(rows, top) if p < confidence[b]}


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class DraftPlan:
    """What one row drafts this round: up to k tokens, with which stages (k=0: plain decoding)."""

    k: int
    ngram: bool
    model: bool

    @property
    def may_loosen(self) -> bool:
        """Whether FLy's loose rule may keep this round's mismatches: only when the draft model chose
        the tokens (alone, or checking n-gram proposals). A raw n-gram copy is no model's judgement,
        and once a loosened copy restarts earlier text the target agrees with the copy's next
        tokens, so the deferred window passes again and again: on HumanEval such rounds looped the
        prompt's docstring to the token limit."""
        return self.model


class Cascade:
    """The draft cascade over the batch: the grammar stage, an optional n-gram and an optional model stage."""

    def __init__(self, grammar: GrammarStage, ngram: NgramStage | None = None, model: ModelStage | None = None) -> None:
        self.grammar = grammar
        self.ngram = ngram
        self.model = model
        self.model_forwards: list[int] = []
        self.forced: list[int] = []

    def add_row(self, context: list[int], draft_row: BatchKV | None = None, matcher=None) -> None:
        """Append a row for a new request (context = its prompt; draft_row: its draft-model cache, see
        ModelStage.add_row; matcher: its grammar's, or None)."""
        self.grammar.add_row(matcher, len(context))
        if self.ngram is not None:
            self.ngram.add_row()
        if self.model is not None:
            self.model.add_row(draft_row)

    def remove_rows(self, keep: list[int]) -> None:
        """Keep only the rows at these indices."""
        for stage in (self.grammar, self.ngram, self.model):
            if stage is not None:
                stage.remove_rows(keep)

    def check(self, contexts: list[list[int]]) -> None:
        """Assert that every stage holds one row per context and each stage's own invariant."""
        rows = len(contexts)
        self.grammar.check(contexts)
        if self.ngram is not None:
            assert len(self.ngram.rows) == rows, (len(self.ngram.rows), rows)
        if self.model is not None:
            self.model.kv.check()
            assert self.model.kv.batch_size == rows, (self.model.kv.batch_size, rows)

    def draft_behind(self, contexts: list[list[int]]) -> list[int]:
        """Per row, what a draft-model round would prefill first (`ModelStage.behind`; 0 without a model)."""
        return self.model.behind(contexts) if self.model is not None else [0] * len(contexts)

    def rollback(self, valid: list[int]) -> None:
        """After verification: each row's first valid[b] context tokens are right."""
        if self.model is not None:
            self.model.rollback(valid)

    def observe(self, contexts: list[list[int]]) -> None:
        """After a round's tokens are emitted: the stages that follow the committed context catch up."""
        self.grammar.observe(contexts)

    def propose(self, contexts: list[list[int]], plans: list[DraftPlan], budgets: list[int],
                confidence: list[float] | None = None) -> list[list[int]]:
        """Draft tokens per row following its plan, at most budgets[b] (stages the cascade lacks are skipped).

        A constrained row's draft starts with the tokens its grammar forces (`forced[b]` of them)
        and ends before the first token the grammar forbids. `confidence[b]` stops row b's
        draft-model drafting early (see `ModelStage.propose`). Afterwards `model_forwards[b]`
        says how many draft-model forwards row b took.
        """
        forced = [self.grammar.propose(b, n) for b, n in enumerate(budgets)]
        self.forced = [len(f) for f in forced]
        if any(self.forced):
            contexts = [c + f if f else c for c, f in zip(contexts, forced)]
            plans = [replace(p, k=min(p.k, n - len(f))) if f else p for p, f, n in zip(plans, forced, budgets)]
        drafts = self._draft(contexts, plans, confidence)
        return [self.grammar.cut(b, f + d) for b, (f, d) in enumerate(zip(forced, drafts))]

    def _draft(self, contexts: list[list[int]], plans: list[DraftPlan],
               confidence: list[float] | None) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in contexts]
        model_ks = [p.k if p.model and self.model is not None else 0 for p in plans]
        self.model_forwards = [0] * len(contexts)
        if any(model_ks):
            drafts = self.model.propose(contexts, model_ks, self.ngram, [p.ngram for p in plans], confidence)
            self.model_forwards = self.model.forwards
        if self.ngram is not None:
            for b, (plan, context) in enumerate(zip(plans, contexts)):
                if plan.ngram and not model_ks[b] and plan.k:
                    drafts[b] = self._chain(b, context, plan.k)
        return [d[:p.k] for d, p in zip(drafts, plans)]

    def _chain(self, b: int, context: list[int], k: int) -> list[int]:
        """n-gram only: chain lookups (each continues the copy) up to k tokens."""
        tokens = self.ngram.propose(b, context, k)
        while tokens and len(tokens) < k:
            more = self.ngram.lookup(b, context + tokens, k - len(tokens))
            if not more:
                break
            tokens = tokens + more
        return tokens
