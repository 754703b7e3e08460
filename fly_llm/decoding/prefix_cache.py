"""The prefix cache: the target's and the draft model's KV of recent prompts and finished requests
(docs/design.md §3.5).

A `PrefixStore` of `KVBlock`s: each block holds, per layer, the keys and values of `block_size`
tokens for the target and, when they were known, for the draft model. `seed` turns the longest
cached prefix of a prompt into one-row caches for both models (the rest of the prompt is then
prefilled); `save` stores a row's KV, for a prompt when it joins the batch and for prompt +
output when a request leaves, so the next turn of a conversation starts where this one ended.
Both take a `scope` (the daemon passes the request's tenant): what one scope saved is never seeded
into another's request.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import takewhile

import torch

from fly_llm.decoding.cache import BatchKV
from fly_llm.decoding.prefix_store import PrefixStore

Layers = list[tuple[torch.Tensor, torch.Tensor]]
"""Keys and values per layer, `[H, n, D]` each."""


@dataclass(frozen=True)
class KVBlock:
    """One block's KV: the target's, and the draft model's when it was computed."""

    target: Layers
    draft: Layers | None = None

    @property
    def nbytes(self) -> int:
        layers = self.target + (self.draft or [])
        return sum(k.nbytes + v.nbytes for k, v in layers)


class PrefixCache:
    """Both models' KV for token prefixes, in blocks of `block_size` tokens, within `budget` bytes
    (0: off — nothing is stored, every lookup misses)."""

    def __init__(self, budget: int, block_size: int = 16) -> None:
        self.store: PrefixStore[KVBlock] = PrefixStore(budget, block_size, lambda block: block.nbytes)

    @torch.inference_mode()
    def seed(self, prompt: list[int], device: torch.device, draft_device: torch.device | None,
             scope: str = "") -> tuple[BatchKV, BatchKV | None]:
        """One-row caches for the target (and the draft model, with `draft_device`) holding the longest
        prefix of the prompt minus its last token that `scope` has cached (the engine's invariant: the
        last token is fed in the first round)."""
        limit = len(prompt) - 1
        chain = [block.value for block in self.store.match(prompt[:limit], scope)]
        target = BatchKV.single_row(_parts([b.target for b in chain], limit), device)
        if draft_device is None:
            return target, None
        drafted = [b.draft for b in takewhile(lambda b: b.draft is not None, chain)]
        return target, BatchKV.single_row(_parts(drafted, limit), draft_device)

    @torch.inference_mode()
    def save(self, tokens: list[int], target: BatchKV, row: int, draft: BatchKV | None, scope: str = "") -> None:
        """Store row `row`'s KV of `tokens` (the row's context) in `scope`: as many tokens as each cache holds.

        Nothing is copied when the budget is 0 (the cache is off). If the device runs out of memory
        while copying, the cache empties itself and the request goes on."""
        if not self.store.budget:
            return
        n = self.store.block_size
        drafted = min(draft.lengths[row], len(tokens)) if draft is not None else 0

        def value_of(i: int, old: KVBlock | None) -> KVBlock | None:
            """A new block, or an old one that lacks the draft's KV with it added; None keeps `old`."""
            add_draft = (i + 1) * n <= drafted and (old is None or old.draft is None)
            if old is not None and not add_draft:
                return None
            draft_kv = draft.row_kv(row, i * n, (i + 1) * n) if add_draft else None
            return KVBlock(old.target if old is not None else target.row_kv(row, i * n, (i + 1) * n), draft_kv)

        try:
            self.store.insert(tokens[:target.lengths[row]], value_of, scope)
        except torch.OutOfMemoryError:
            self.store.clear()  # memory pressure: give the cache's memory back rather than fail the request

    def check(self) -> None:
        """The store's invariants (`PrefixStore.check`)."""
        self.store.check()

    def clear(self) -> None:
        """Drop every block."""
        self.store.clear()


def _parts(blocks: list[Layers], limit: int) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Per layer, the blocks' key parts and value parts, cut to `limit` tokens in all ([] for none)."""
    if not blocks or limit <= 0:
        return []
    n = blocks[0][0][0].shape[1]
    blocks = blocks[:-(-limit // n)]  # the blocks that hold the first `limit` tokens
    last = limit - n * (len(blocks) - 1)  # tokens of the last of them
    return [([b[i][0] for b in blocks[:-1]] + [blocks[-1][i][0][:, :last]],
             [b[i][1] for b in blocks[:-1]] + [blocks[-1][i][1][:, :last]]) for i in range(len(blocks[0]))]
