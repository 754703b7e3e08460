"""What every draft stage implements (docs/design.md §1.1), and the plan that picks stages per row.

A stage is one drafter of the cascade, in the spirit of Hugging Face's candidate generators: it
keeps one row per engine row (in the engine's order), proposes tokens for the rows it drafts, and
hears each round's verdict. A stage runs either as a row's *drafter* (the last stage of the row's
plan, in cascade order) or *upstream* of it: the stages before the drafter in the plan offer it
continuations (`continuation`) that a model drafter checks against its own choices.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from fly_llm.common.config import FLyConfig
from fly_llm.decoding.cache import BatchKV


@dataclass(frozen=True)
class RowStart:
    """What the engine knows of a row when it joins: its prompt's length, the draft-model cache its
    prefill left (a prefix of the prompt, or None), its grammar's matcher at the start of the output,
    its cache scope (the tenant whose recent answers it may draft from) and whether it may draft from
    them (not a seeded sample: its seed must reproduce its answer whatever was asked before)."""

    prompt_length: int
    draft_kv: BatchKV | None = None
    matcher: object | None = None
    scope: str = ""
    copies_recent: bool = True


@dataclass(frozen=True)
class Proposal:
    """One stage's drafts per row, and the model forwards each row took for them (0 for lookups)."""

    tokens: list[list[int]]
    forwards: list[int]


@dataclass(frozen=True)
class DraftPlan:
    """What one row drafts this round: up to k tokens with these stages, in cascade order (k=0: plain
    decoding). The last stage drafts; the ones before it are upstream of it. `model`: the drafter
    runs a model (`Stage.runs_model`)."""

    k: int
    stages: tuple[str, ...] = ()
    model: bool = False

    @property
    def drafter(self) -> str | None:
        """The stage that drafts (the last one; None: no stage, plain decoding)."""
        return self.stages[-1] if self.stages else None

    @property
    def may_loosen(self) -> bool:
        """Whether FLy's loose rule may keep this round's mismatches: only when a model chose the
        tokens (alone, or checking upstream proposals). A raw n-gram copy is no model's judgement,
        and once a loosened copy restarts earlier text the target agrees with the copy's next
        tokens, so the deferred window passes again and again: on HumanEval such rounds looped the
        prompt's docstring to the token limit."""
        return self.model


class Stage(ABC):
    """One drafter of the cascade. Subclasses set `name` (their FLyConfig.stages entry) and
    `runs_model`, and implement `propose`, the row bookkeeping and `check`; the rest is optional.
    A drafter is registered with a factory (`fly_llm.decoding.stages.STAGES`)."""

    name: ClassVar[str]
    runs_model: ClassVar[bool] = False
    """Drafts with a model: its rounds cost forwards (`Costs.stages`), may catch up on a backlog
    first (`behind`), are FLy-loosened, and never run in a row's first round."""

    kv: BatchKV | None = None
    """The stage's batched KV cache, if it keeps one (the prefix cache saves and seeds it)."""

    @abstractmethod
    def add_row(self, start: RowStart) -> None:
        """Append a row for a request joining the batch."""

    @abstractmethod
    def remove_rows(self, keep: list[int]) -> None:
        """Keep only the rows at these indices."""

    @abstractmethod
    def propose(self, contexts: list[list[int]], ks: list[int], upstreams: list[Sequence[Stage]],
                configs: list[FLyConfig]) -> Proposal:
        """Up to ks[b] tokens continuing each row's context (0: the row is not drafted by this stage and
        is left untouched); upstreams[b]: the stages before it in row b's plan; configs[b]: its settings."""

    @abstractmethod
    def check(self, contexts: list[list[int]]) -> None:
        """Assert one row per context and the stage's own invariant (tests call it between steps)."""

    def continuation(self, row: int, context: list[int], drafted: list[int], room: int) -> list[int]:
        """Up to `room` tokens after `context + drafted` offered to a later stage (default: none)."""
        return []

    def answered(self, row: int, tokens: list[int]) -> None:
        """The row leaves the batch with `tokens` (its prompt and answer) as its context; called before
        `remove_rows` (default: nothing kept)."""

    def observe(self, valid: list[int], contexts: list[list[int]]) -> None:
        """After a round: each row's first valid[b] tokens of context plus drafts were right, and its
        context is now contexts[b] (default: nothing to update)."""

    def behind(self, contexts: list[list[int]]) -> list[int]:
        """Per row, the context tokens the stage must catch up on before drafting (default: none)."""
        return [0] * len(contexts)

    def reset(self) -> None:
        """Drop every row."""
        self.remove_rows([])


def continue_from(stages: Sequence[Stage], row: int, context: list[int], drafted: list[int],
                  room: int) -> list[int]:
    """The first non-empty continuation the stages offer (each is asked until one has tokens)."""
    for stage in stages:
        tokens = stage.continuation(row, context, drafted, room)
        if tokens:
            return tokens
    return []


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
