"""The draft-model stage: greedy drafting with a draft model over its own batched KV cache (docs/design.md §1.1)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fly_llm.common.config import FLyConfig
from fly_llm.decoding.cache import BatchKV
from fly_llm.decoding.stages.base import Proposal, RowStart, Stage, common_prefix, continue_from

_CATCH_UP_AT = 4
"""A draft row more than this many tokens behind is caught up in separate forwards first."""
CATCH_UP_WIDTH = 256
"""The most tokens per row one catch-up forward feeds: a prompt-long backlog goes in pieces."""


class DraftModelStage(Stage):
    """Greedy drafting with a draft model over its own batched KV cache, rolled back to the accepted
    length after every round.

    With upstream stages (the n-gram stage, in the n-gram → model cascade) each forward also checks
    their proposal: the longest prefix equal to the draft model's own greedy choices is kept (lossless
    with respect to the draft model), plus the model's next token, until k tokens exist.

    Invariant: row b's cache holds a prefix of its context plus drafts (`kv.lengths[b]` tokens);
    before drafting, the tokens after that prefix are fed first (normally 1 or 2 tokens).
    """

    name = "draft_model"
    runs_model = True

    def __init__(self, model, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.kv = BatchKV(device)

    @classmethod
    def build(cls, config: FLyConfig, draft) -> DraftModelStage | None:
        """The stage over `draft` on its device; None without a draft model."""
        return cls(draft, next(draft.parameters()).device) if draft is not None else None

    def add_row(self, start: RowStart) -> None:
        """Append a row whose cache is `start.draft_kv`: a one-row BatchKV holding a prefix of the
        context (what the prefix cache seeded, often nothing: the rest is caught up on first use)."""
        self.kv.add_row(start.draft_kv)

    def remove_rows(self, keep: list[int]) -> None:
        """Keep only the rows at these indices."""
        self.kv.remove_rows(keep)

    def reset(self) -> None:
        """Drop every row (a fresh cache: a failed round may have left the old one mid-forward)."""
        self.kv = BatchKV(self.device)

    def check(self, contexts: list[list[int]]) -> None:
        """Assert the cache's invariant, one row per context, each holding at most its context."""
        self.kv.check()
        assert self.kv.batch_size == len(contexts), (self.kv.batch_size, len(contexts))
        assert all(n <= len(c) for n, c in zip(self.kv.lengths, contexts)), "draft cache past its context"

    def observe(self, valid: list[int], contexts: list[list[int]]) -> None:
        """Forget each row's cached tokens past the first valid[b] of its context."""
        self.kv.truncate(valid)

    def behind(self, contexts: list[list[int]]) -> list[int]:
        """Per row, the context tokens its cache lacks besides the last: what a round prefills first."""
        return [max(len(c) - 1 - n, 0) for c, n in zip(contexts, self.kv.lengths)]

    def propose(self, contexts: list[list[int]], ks: list[int], upstreams: list[Sequence[Stage]],
                configs: list[FLyConfig]) -> Proposal:
        """Draft up to ks[b] tokens per row (0 = row not drafting; it is left untouched), checking
        upstreams[b]'s continuations on the way. Row b stops drafting after a token of its own to
        which the draft model gives less than configs[b].draft_confidence probability (0: never)."""
        rows = len(contexts)
        drafts: list[list[int]] = [[] for _ in range(rows)]
        active = [b for b in range(rows) if ks[b] > 0]
        forwards = [0] * rows
        confidence = [c.draft_confidence for c in configs]
        self._catch_up(contexts, active, forwards)
        while active:
            for b in active:
                forwards[b] += 1
            feeds: list[list[int]] = [[] for _ in range(rows)]
            proposals: dict[int, list[int]] = {}
            for b in active:
                room = ks[b] - len(drafts[b]) - 1  # the model adds one token of its own
                proposals[b] = continue_from(upstreams[b], b, contexts[b], drafts[b], room)
                feeds[b] = (contexts[b] + drafts[b])[self.kv.lengths[b]:] + proposals[b]
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
            unsure = _unconfident(logits, own, confidence)
            active = [b for b in active if len(drafts[b]) < ks[b] and b not in unsure]
        return Proposal(drafts, forwards)

    def _catch_up(self, contexts: list[list[int]], active: list[int], forwards: list[int]) -> None:
        """Feed the backlogs (all but each active row's last token), when one is long, in forwards of
        their own, at most `CATCH_UP_WIDTH` tokens per row each. The catch-up counts as one forward per
        row whatever its pieces (the policy weighs its width as prefill, `PolicyState.behind`)."""
        behind = {b: contexts[b][self.kv.lengths[b]:-1] for b in active}
        longest = max((len(t) for t in behind.values()), default=0)
        if longest <= _CATCH_UP_AT:
            return
        for start in range(0, longest, CATCH_UP_WIDTH):
            feeds = [behind.get(b, [])[start:start + CATCH_UP_WIDTH] for b in range(len(contexts))]
            width = max(len(f) for f in feeds)
            target = [n + len(f) for n, f in zip(self.kv.lengths, feeds)]
            input_ids = torch.tensor([f + [0] * (width - len(f)) for f in feeds], device=self.device)
            self.kv.forward(self.model, input_ids, logits_to_keep=1)
            self.kv.truncate(target)
        for b in behind:
            forwards[b] += 1


def _unconfident(logits: torch.Tensor, columns: dict[int, int], confidence: list[float]) -> set[int]:
    """Rows whose greedy token at `columns[b]` has a draft probability below confidence[b] (> 0)."""
    rows = [b for b in columns if confidence[b] > 0]
    if not rows:
        return set()
    picked = logits[rows, [columns[b] for b in rows]].float()
    top = torch.softmax(picked, -1).max(-1).values.tolist()
    return {b for b, p in zip(rows, top) if p < confidence[b]}
