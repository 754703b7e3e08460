"""A bounded LRU store of values per fixed-size token block, keyed by token prefix (docs/design.md §3.5).

A prompt is cut into blocks of `block_size` tokens; block i is keyed by (the id of block i−1,
its own tokens), so a key names a whole prefix exactly (no hashing, no collisions) while each
block stores only its own tokens and value. A prompt's first block is keyed by (its scope, its
tokens): the scope is a string, a block id an int, so no chain of one scope is ever found from
another (the daemon's tenants, docs/daemon.md). `match(tokens)` walks the blocks from the start and
returns the longest cached chain — its last block may extend past the end of `tokens` (a prompt
that ends inside a cached block matches all of its tokens); `insert(tokens, value_of)` adds the
missing whole blocks (and may replace the values of existing ones).

Eviction is LRU by block under a byte budget, and it never breaks a chain: a touched chain is
moved to the most-recent end leaf first, so every block is more recent than all of its
descendants and the least recently used block is always a leaf. `check()` asserts this order, the
index and the budget.

Pure Python: the values are opaque (the engine stores KV tensors, the tests small stand-ins);
`size(value)` gives a value's bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import count
from typing import Generic, TypeVar

V = TypeVar("V")
Parent = int | str
"""What a block's key starts with: the id of the block before it, or (for a prompt's first block) its scope."""


@dataclass(eq=False)
class Block(Generic[V]):
    """One cached block: its tokens, the id of the block before it (or its scope), and its value."""

    id: int
    parent: Parent
    tokens: tuple[int, ...]
    value: V
    nbytes: int


class PrefixStore(Generic[V]):
    """Blocks of `block_size` tokens with a value each, at most `budget` bytes of values in all."""

    def __init__(self, budget: int, block_size: int, size: Callable[[V], int]) -> None:
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.budget = budget
        self.block_size = block_size
        self.size = size
        self.bytes = 0
        self.evictions = 0  # blocks evicted so far
        self._blocks: OrderedDict[tuple[Parent, tuple[int, ...]], Block[V]] = OrderedDict()  # oldest first
        self._by_id: dict[int, Block[V]] = {}
        self._children: dict[Parent, dict[int, Block[V]]] = {}  # parent -> its cached children by id
        self._ids = count()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, tokens: Sequence[int], scope: str = "") -> list[Block[V]]:
        """The cached blocks of `scope` that begin `tokens`, in order (the longest chain); marks them used.

        They hold min(len(chain) × block_size, len(tokens)) tokens of `tokens`: when the tokens left
        after the whole blocks begin a cached block, that block comes last (the one with the smallest
        tokens if several do).
        """
        chain, parent, n = [], scope, self.block_size
        for start in range(0, len(tokens) - n + 1, n):
            block = self._blocks.get((parent, tuple(tokens[start:start + n])))
            if block is None:
                break
            chain.append(block)
            parent = block.id
        rest = tuple(tokens[len(chain) * n:])
        if 0 < len(rest) < n:
            partial = [b for b in self._children.get(parent, {}).values() if b.tokens[:len(rest)] == rest]
            chain += [min(partial, key=lambda b: b.tokens)] if partial else []
        self._touch(chain)
        return chain

    def insert(self, tokens: Sequence[int], value_of: Callable[[int, V | None], V | None], scope: str = "") -> None:
        """Store the whole blocks of `tokens` in `scope`, evicting least recently used blocks to make room.

        `value_of(i, old)` gives block i's value: for a missing block (old is None) a new value,
        for a cached one a replacement or None to keep `old`. Blocks of `tokens` itself are never
        evicted to make room for it: when only they are left, the rest is not stored.
        """
        n = self.block_size
        chain = self.match(tokens, scope)[:len(tokens) // n]
        keep = {block.id for block in chain}
        for i, block in enumerate(chain):
            value = value_of(i, block.value)
            if value is not None:
                size = self.size(value)
                if self._make_room(size - block.nbytes, keep):
                    self.bytes += size - block.nbytes
                    block.value, block.nbytes = value, size
        for i in range(len(chain), len(tokens) // n):
            value = value_of(i, None)
            if value is None:
                break
            size = self.size(value)
            if not self._make_room(size, keep):
                break
            block = Block(next(self._ids), chain[-1].id if chain else scope, tuple(tokens[i * n:(i + 1) * n]),
                          value, size)
            self._blocks[(block.parent, block.tokens)] = block
            self._by_id[block.id] = block
            self._children.setdefault(block.parent, {})[block.id] = block
            self.bytes += size
            chain.append(block)
            keep.add(block.id)
        self._touch(chain)

    def clear(self) -> None:
        """Drop every block (the counters stay)."""
        self._blocks.clear()
        self._by_id.clear()
        self._children.clear()
        self.bytes = 0

    def check(self) -> None:
        """Assert the invariants: bytes ≤ budget and equal to the values' sizes; every key names its
        block; every block's parent is a scope, or a cached block more recently used than the block;
        the children index lists exactly the blocks."""
        assert self.bytes <= self.budget, (self.bytes, self.budget)
        assert self.bytes == sum(b.nbytes for b in self._blocks.values()), "byte count ≠ blocks"
        assert len(self._by_id) == len(self._blocks), "id index ≠ blocks"
        assert sum(map(len, self._children.values())) == len(self._blocks), "children index ≠ blocks"
        order = {}
        for position, (key, block) in enumerate(self._blocks.items()):
            assert key == (block.parent, block.tokens) and len(block.tokens) == self.block_size, key
            assert self._by_id.get(block.id) is block, f"block {block.id} missing from the id index"
            assert self._children[block.parent].get(block.id) is block, f"block {block.id} not its parent's child"
            assert block.nbytes == self.size(block.value), f"block {block.id}: stale size"
            order[block.id] = position
        for block in self._blocks.values():
            if isinstance(block.parent, int):
                assert block.parent in order, f"block {block.id} lost its parent {block.parent}"
                assert order[block.parent] > order[block.id], f"block {block.id} is more recent than its parent"

    def _touch(self, chain: list[Block[V]]) -> None:
        """Mark a chain used: its leaf first, so each block ends up more recent than its descendants."""
        for block in reversed(chain):
            self._blocks.move_to_end((block.parent, block.tokens))

    def _make_room(self, size: int, keep: set[int]) -> bool:
        """Evict least recently used blocks until `size` more bytes fit; False if only `keep` is left."""
        while self.bytes + size > self.budget:
            if not self._blocks:
                return False
            key, oldest = next(iter(self._blocks.items()))
            if oldest.id in keep:
                return False
            del self._blocks[key]
            del self._by_id[oldest.id]
            siblings = self._children[oldest.parent]
            del siblings[oldest.id]
            if not siblings:
                del self._children[oldest.parent]
            self.bytes -= oldest.nbytes
            self.evictions += 1
        return True
