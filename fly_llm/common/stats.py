"""What a request reports about its generation: why it stopped and its speculation counters.

Shared by the engine and the wire format, so it lives in neither (pure Python: no torch).

Invariant per request: emitted == accepted_native + accepted_loose + rounds - trimmed,
where each round emits its kept draft prefix plus one target token (correction or bonus),
and `trimmed` counts tokens cut at the end (max_tokens, EOS, stop strings).
Plain-decoding rounds (K = 0) count as rounds with nothing drafted.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, computed_field

FinishReason = Literal["stop", "length", "tool_calls"]
"""'stop': EOS or a stop string; 'length': max_tokens reached; 'tool_calls': stopped after calling tools."""


class RequestStats(BaseModel):
    """Counters for one request, or summed over many (`merge`)."""

    rounds: int = 0
    drafted: int = 0
    accepted_native: int = 0
    accepted_loose: int = 0
    emitted: int = 0
    trimmed: int = 0
    draft_model_rounds: int = 0
    ngram_rounds: int = 0
    plain_rounds: int = 0
    forced: int = 0
    """Accepted draft tokens that a grammar forced (drafted at no model cost; counted in accepted_native or _loose)."""
    grammar_s: float = 0.0
    """Seconds spent compiling the request's grammar at admission (0 when it came from the compiled cache)."""
    drafted_by_position: list[int] = Field(default_factory=list)
    accepted_by_position: list[int] = Field(default_factory=list)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def mat(self) -> float:
        """Mean accepted tokens: tokens emitted per target forward (round)."""
        return self.emitted / self.rounds if self.rounds else 0.0

    @computed_field  # type: ignore[prop-decorator]
    @property
    def loose_rate(self) -> float:
        """Share of accepted draft tokens that FLy accepted loosely."""
        accepted = self.accepted_native + self.accepted_loose
        return self.accepted_loose / accepted if accepted else 0.0

    def record_round(self, drafted: int, native: list[bool], loose: list[bool], accepted: int,
                     used_draft_model: bool, used_ngram: bool = False, forced: int = 0) -> None:
        """Count one verification round: `accepted` kept draft tokens plus one target token.

        The adaptive policy's choices are counted too: draft_model_rounds (the draft model ran),
        ngram_rounds (the plan included the n-gram stage and something was drafted; a cascade round
        counts as both) and plain_rounds (nothing drafted: plain target decoding); `forced` of the
        accepted tokens were forced by the row's grammar.
        """
        self.rounds += 1
        self.drafted += drafted
        self.draft_model_rounds += int(used_draft_model)
        self.ngram_rounds += int(used_ngram)
        self.plain_rounds += int(drafted == 0)
        self.forced += forced
        n_loose = sum(loose[:accepted])
        self.accepted_loose += n_loose
        self.accepted_native += accepted - n_loose
        self.emitted += accepted + 1
        _grow(self.drafted_by_position, drafted)
        _grow(self.accepted_by_position, accepted)
        for i in range(drafted):
            self.drafted_by_position[i] += 1
        for i in range(accepted):
            self.accepted_by_position[i] += 1

    def record_trim(self, n: int) -> None:
        """Count tokens cut from the end of a round (they were counted as emitted)."""
        self.trimmed += n
        self.emitted -= n

    def merge(self, other: "RequestStats") -> None:
        """Add another request's counters to these."""
        for name in ("rounds", "drafted", "accepted_native", "accepted_loose", "emitted", "trimmed",
                     "draft_model_rounds", "ngram_rounds", "plain_rounds", "forced", "grammar_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.drafted_by_position, other.drafted_by_position),
                             (self.accepted_by_position, other.accepted_by_position)):
            _grow(mine, len(theirs))
            for i, v in enumerate(theirs):
                mine[i] += v


def _grow(counts: list[int], n: int) -> None:
    if len(counts) < n:
        counts.extend([0] * (n - len(counts)))


class GrammarCacheStats(BaseModel):
    """The grammar caches' sizes and byte budgets (fly_llm.decoding.grammar): compiled grammars, constraints'
    grammar texts, the sandbox's verdicts; and the per-grammar cap on a compiled form."""

    compiled_bytes: int = 0
    compiled_entries: int = 0
    compiled_budget_bytes: int = 0
    texts_bytes: int = 0
    texts_budget_bytes: int = 0
    verdict_bytes: int = 0
    verdict_budget_bytes: int = 0
    max_grammar_bytes: int = 0

    def within_budgets(self) -> bool:
        """Whether every cache holds no more than its budget."""
        return (self.compiled_bytes <= self.compiled_budget_bytes and self.texts_bytes <= self.texts_budget_bytes
                and self.verdict_bytes <= self.verdict_budget_bytes)


class PromptStats(BaseModel):
    """Prompt work of an engine so far: prompt tokens admitted, how many the prefix cache served and
    how many were prefilled (target forwards), and the prefix cache's size (docs/design.md §3.5)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    cache_evictions: int = 0
    cache_bytes: int = 0
    cache_budget_bytes: int = 0

    @computed_field  # type: ignore[prop-decorator]
    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens served from the prefix cache."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
