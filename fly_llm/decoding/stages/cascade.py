"""The draft cascade: the grammar stage, then the drafters in order, over the batch (docs/design.md §1.1)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from fly_llm.common.config import FLyConfig
from fly_llm.decoding.cache import BatchKV
from fly_llm.decoding.stages.base import DraftPlan, RowStart, Stage
from fly_llm.decoding.stages.grammar import GrammarStage


class Cascade:
    """The grammar stage and an ordered list of drafters, each holding one row per engine row.

    Per row and round, the row's `DraftPlan` names the stages that run: its last one drafts, the
    ones before it are upstream of it (n-gram only: lookups chained up to K tokens; model only: K
    greedy draft steps; n-gram → model: each n-gram proposal checked by the draft model, which adds
    its own next token, until K tokens exist). Whatever the plan, a constrained row's draft starts
    with the tokens its grammar forces and ends before the first token the grammar forbids.
    """

    def __init__(self, grammar: GrammarStage, drafters: Sequence[Stage] = ()) -> None:
        self.grammar = grammar
        self.drafters = {stage.name: stage for stage in drafters}
        self.forced: list[int] = []
        self.forwards: list[int] = []

    @property
    def stages(self) -> tuple[Stage, ...]:
        """Every stage, the grammar stage first."""
        return self.grammar, *self.drafters.values()

    @property
    def kv(self) -> BatchKV | None:
        """The draft-model cache a drafter keeps (the prefix cache saves and seeds it), if any."""
        return next((stage.kv for stage in self.drafters.values() if stage.kv is not None), None)

    def offered(self, first_round: bool) -> tuple[Stage, ...]:
        """The drafters a row may use this round: no model in a row's first round, so its first token
        waits for no draft prefill."""
        return tuple(s for s in self.drafters.values() if not (first_round and s.runs_model))

    def add_row(self, start: RowStart) -> None:
        """Append a row for a request joining the batch."""
        for stage in self.stages:
            stage.add_row(start)

    def answered(self, row: int, tokens: list[int]) -> None:
        """The row leaves the batch with `tokens` (prompt and answer) as its context (before `remove_rows`)."""
        for stage in self.stages:
            stage.answered(row, tokens)

    def remove_rows(self, keep: list[int]) -> None:
        """Keep only the rows at these indices."""
        for stage in self.stages:
            stage.remove_rows(keep)

    def reset(self) -> None:
        """Drop every row of every stage."""
        for stage in self.stages:
            stage.reset()

    def check(self, contexts: list[list[int]]) -> None:
        """Assert every stage's invariant (one row per context, each stage's own)."""
        for stage in self.stages:
            stage.check(contexts)

    def behind(self, contexts: list[list[int]]) -> dict[str, list[int]]:
        """Per drafter that runs a model, per row: the context tokens it must catch up on first."""
        return {name: stage.behind(contexts) for name, stage in self.drafters.items() if stage.runs_model}

    def observe(self, valid: list[int], contexts: list[list[int]]) -> None:
        """After a round: each row's first valid[b] tokens were right; its context is now contexts[b]."""
        for stage in self.stages:
            stage.observe(valid, contexts)

    def masks(self, drafts: list[list[int]], width: int) -> tuple[list[int], torch.Tensor] | None:
        """The grammar's allowed tokens at each verified position of the constrained rows (see GrammarStage)."""
        return self.grammar.masks(drafts, width)

    def failures(self) -> list[tuple[int, str]]:
        """`(row, problem)` for each row whose grammar failed this round."""
        return self.grammar.failures()

    def propose(self, contexts: list[list[int]], plans: list[DraftPlan], budgets: list[int],
                configs: list[FLyConfig]) -> list[list[int]]:
        """Draft tokens per row following its plan, at most budgets[b].

        A constrained row's draft starts with the tokens its grammar forces (`forced[b]` of them)
        and ends before the first token the grammar forbids. Afterwards `forwards[b]` says how many
        model forwards row b's drafter took.
        """
        rows = len(contexts)
        forced = self.grammar.propose(contexts, budgets, [()] * rows, configs).tokens
        self.forced = [len(f) for f in forced]
        if any(self.forced):
            contexts = [c + f if f else c for c, f in zip(contexts, forced)]
            plans = [replace(p, k=min(p.k, n - len(f))) if f else p for p, f, n in zip(plans, forced, budgets)]
        drafts = self._draft(contexts, plans, configs)
        return [self.grammar.cut(b, f + d) for b, (f, d) in enumerate(zip(forced, drafts))]

    def _draft(self, contexts: list[list[int]], plans: list[DraftPlan], configs: list[FLyConfig]) -> list[list[int]]:
        """Each drafter drafts the rows whose plan it ends, with the plan's earlier stages upstream."""
        drafts: list[list[int]] = [[] for _ in contexts]
        self.forwards = [0] * len(contexts)
        upstreams = [tuple(self.drafters[name] for name in p.stages[:-1]) for p in plans]
        for name, stage in self.drafters.items():
            ks = [p.k if p.drafter == name else 0 for p in plans]
            if not any(ks):
                continue
            proposal = stage.propose(contexts, ks, upstreams, configs)
            for b in (b for b, k in enumerate(ks) if k):
                drafts[b], self.forwards[b] = proposal.tokens[b], proposal.forwards[b]
        return [d[:p.k] for d, p in zip(drafts, plans)]
