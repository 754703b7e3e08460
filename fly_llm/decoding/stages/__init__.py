"""Draft stages and the draft cascade (docs/design.md §1.1).

`STAGES` registers every drafter by its FLyConfig.stages name, in cascade order (upstream first):
a factory that builds it for an engine's defaults and draft model (None: it cannot run there).
A new drafter is a `Stage` subclass in a module of its own, a line here and its name in
`fly_llm.common.config.DRAFT_STAGES`.
"""

from __future__ import annotations

from collections.abc import Callable

from fly_llm.common.config import FLyConfig
from fly_llm.decoding.stages.base import DraftPlan, Proposal, RowStart, Stage, common_prefix
from fly_llm.decoding.stages.cascade import Cascade
from fly_llm.decoding.stages.draft_model import DraftModelStage
from fly_llm.decoding.stages.grammar import GrammarStage
from fly_llm.decoding.stages.ngram import NgramStage

StageFactory = Callable[[FLyConfig, object], "Stage | None"]

STAGES: dict[str, StageFactory] = {
    NgramStage.name: NgramStage.build,
    DraftModelStage.name: DraftModelStage.build,
}
"""Every drafter, by name, in cascade order; its keys are `fly_llm.common.config.DRAFT_STAGES`."""


def build_cascade(vocab_size: int, config: FLyConfig, draft=None) -> Cascade:
    """The cascade of an engine: the grammar stage and every registered drafter that can run here."""
    drafters = (factory(config, draft) for factory in STAGES.values())
    return Cascade(GrammarStage(vocab_size), [stage for stage in drafters if stage is not None])


__all__ = ["STAGES", "Cascade", "DraftModelStage", "DraftPlan", "GrammarStage", "NgramStage", "Proposal",
           "RowStart", "Stage", "build_cascade", "common_prefix"]
