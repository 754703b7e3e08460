"""A prompt on its way into the batch, prefilled chunk by chunk (docs/design.md §3.6).

The engine's invariant for a running row is that its target cache holds the context minus its
last token. A `PromptFill` builds that for a new request in one-row caches — seeded from the
prefix cache when it has a prefix of the prompt — and extends the target's by at most a given
number of tokens per call, so a long prompt enters over several engine steps while the running
rows keep decoding. When `done`, its caches are spliced into the batch. The draft model's cache
is never prefilled here: it joins with what the prefix cache gave it, and the draft stage
catches up on its own in the row's first draft-model round, if the policy ever pays for one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fly_llm.decoding.cache import BatchKV
from fly_llm.decoding.logprobs import PIECE, Logprob, token_logprobs


@dataclass
class PromptFill:
    """One-row caches of a prompt on its way in; the target's must come to hold `tokens` (the prompt minus its last token).

    `draft` is None when the engine has no draft model; else it keeps what the prefix cache gave
    it — a prefix of the context, which the draft stage catches up on its own if it is ever used.

    With `scored` (the whole prompt, for a request that asks for its prompt's log-probabilities; the
    target cache then starts empty), the target's logits at every position are kept as `logprobs` of
    the token after it (`fly_llm.decoding.logprobs`, `top` alternatives each): one per prompt token but the first.
    """

    tokens: list[int]
    target: BatchKV
    draft: BatchKV | None
    scored: list[int] | None = None
    top: int = 0
    logprobs: list[Logprob] = field(default_factory=list)

    @property
    def done(self) -> bool:
        """Whether the target cache holds all of `tokens`: the request may join."""
        return self.target.lengths[0] == len(self.tokens)

    def advance(self, target_model, budget: int) -> int:
        """Prefill up to `budget` more tokens into the target cache; return how many were computed."""
        if self.scored is not None:
            return self._score(target_model, budget)
        start = self.target.lengths[0]
        chunk = self.tokens[start:start + budget]
        self.target.extend(target_model, chunk)
        return len(chunk)

    def check(self) -> None:
        """Each cache is consistent and holds no more than `tokens`."""
        for kv in (self.target, self.draft):
            if kv is not None:
                kv.check()
                assert kv.batch_size == 1 and kv.lengths[0] <= len(self.tokens), (kv.lengths, len(self.tokens))

    def _score(self, model, budget: int) -> int:
        """Extend the target cache by up to `budget` tokens, keeping the log-probabilities of the tokens after them."""
        start = self.target.lengths[0]
        chunk = self.tokens[start:start + min(budget, PIECE)]
        if chunk:
            logits = self.target.forward(model, torch.tensor([chunk], device=self.target.device))
            self.logprobs += token_logprobs(logits[0], self.scored[start + 1:start + 1 + len(chunk)], self.top)
        return len(chunk)
