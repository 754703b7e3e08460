"""Repetition, presence and frequency penalties on the target's logits (docs/design.md §1.6).

llama.cpp's rule, which Ollama and llama-server apply and OpenAI documents: for a token seen `c > 0`
times in the last `repeat_last_n` tokens of the context (prompt and output),

    z -> (z / r if z > 0 else z * r) - c * frequency - presence

Within one speculative round the history moves with the position: position i of a row scores the token
after its context plus draft tokens d[0..i-1], so its counts include those drafts (and, in a bounded
window, drop the tokens they push out). Penalizing every position with its own history makes the
verified distribution at i the one plain decoding would see after accepting d[0..i-1]: exact mode stays
exact, greedy and sampled. Only the tokens in a row's windows are touched (gathered and scattered back),
never the whole vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fly_llm.common.config import SamplingParams


@dataclass(frozen=True)
class Penalty:
    """One row's penalties: the repetition ratio, the presence and frequency subtrahends, the window."""

    repetition: float
    presence: float
    frequency: float
    last_n: int  # tokens of the context counted; -1: all of it

    @classmethod
    def of(cls, sampling: SamplingParams) -> Penalty | None:
        """The request's penalties, None when they change nothing (all at their off value, or no window)."""
        penalty = cls(sampling.repetition_penalty, sampling.presence_penalty, sampling.frequency_penalty,
                      sampling.repeat_last_n)
        off = penalty.repetition == 1.0 and penalty.presence == 0.0 and penalty.frequency == 0.0
        return None if off or penalty.last_n == 0 else penalty

    def apply_(self, logits: torch.Tensor, context: Sequence[int], drafts: Sequence[int]) -> None:
        """In place on one row's logits [P, V] (P >= len(drafts) + 1): position i penalized by the window of
        `context + drafts[:i]`. Positions past len(drafts) repeat the last one's counts (they are padding)."""
        ids, counts = window_counts(context, drafts, self.last_n, logits.shape[0], logits.device)
        if not len(ids):
            return
        columns = ids.expand(logits.shape[0], -1)
        seen = logits.gather(1, columns)
        counts = counts.to(seen.dtype)
        present = counts > 0
        penalized = torch.where(seen > 0, seen / self.repetition, seen * self.repetition)
        penalized = torch.where(present, penalized, seen) - counts * self.frequency - present.to(seen.dtype) * self.presence
        # A tiny repetition penalty (1e-40) overflows a positive logit to inf, and sampling over inf fails: it is the
        # largest finite one instead (-inf stays: a token the grammar masked).
        logits.scatter_(1, columns, penalized.clamp(max=torch.finfo(seen.dtype).max))


def window_counts(context: Sequence[int], drafts: Sequence[int], last_n: int, positions: int,
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct tokens `ids` [U] of the row's windows and `counts` [positions, U]: how often each occurs in
    the last `last_n` tokens (-1: all) of `context + drafts[:i]`, for each position i (clipped to the drafts)."""
    width = len(context) if last_n < 0 else min(last_n, len(context))
    tail = list(context[len(context) - width:])
    sequence = torch.tensor(tail + list(drafts), dtype=torch.long)
    ids, index = torch.unique(sequence, return_inverse=True)
    delta = torch.zeros(positions, len(ids), dtype=torch.long)
    delta[0].index_add_(0, index[:width], torch.ones(width, dtype=torch.long))
    entering = torch.arange(1, min(len(drafts), positions - 1) + 1)  # position i gains drafts[i-1] ...
    delta.index_put_((entering, index[width + entering - 1]), torch.ones(len(entering), dtype=torch.long),
                     accumulate=True)
    if last_n >= 0:  # ... and loses the token it pushes out of a full window
        leaving = entering[width + entering - 1 - last_n >= 0]
        delta.index_put_((leaving, index[width + leaving - 1 - last_n]), torch.full((len(leaving),), -1),
                         accumulate=True)
    return ids.to(device), delta.cumsum(0).to(device)
