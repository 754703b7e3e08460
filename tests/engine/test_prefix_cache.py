"""The prefix store against a plain reference, under random inserts, replacements and lookups in scopes.

The reference keeps an OrderedDict from each cached (scope, prefix) (the whole token tuple up to a
block's end) to that block's value, with the same LRU rule and the same choice of a last, partly
matched block; the store keys blocks by (parent id or scope, tokens). A lookup in one scope never
returns a value that only another scope stored.
After every rule both give the same lookups, bytes and evictions, and `PrefixStore.check()` holds
(bytes ≤ budget, index consistent, every block's parent cached and more recent).
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from fly_llm.decoding.prefix_store import PrefixStore

Value = tuple[str, int]  # (label, bytes)

tokens_st = st.lists(st.integers(0, 2), max_size=14)
scopes_st = st.sampled_from(["", "a", "b"])
sizes_st = st.lists(st.integers(1, 12), min_size=7, max_size=7)


def size(value: Value) -> int:
    return value[1]


class Reference:
    """The obvious model: an LRU OrderedDict from cached (scope, prefix) pairs (whole blocks) to values."""

    def __init__(self, budget: int, block_size: int) -> None:
        self.budget, self.n = budget, block_size
        self.entries: OrderedDict[tuple[str, tuple[int, ...]], Value] = OrderedDict()  # oldest first
        self.bytes = self.evictions = 0

    def match(self, tokens: list[int], scope: str) -> list[tuple[str, tuple[int, ...]]]:
        chain = []
        for end in range(self.n, len(tokens) + 1, self.n):
            if (scope, tuple(tokens[:end])) not in self.entries:
                break
            chain.append((scope, tuple(tokens[:end])))
        done = len(chain) * self.n
        if 0 < len(tokens) - done < self.n:  # the rest begins a cached block: the one with the smallest tokens
            partial = sorted(k for k in self.entries
                             if k[0] == scope and len(k[1]) == done + self.n and k[1][:len(tokens)] == tuple(tokens))
            chain += partial[:1]
        for key in reversed(chain):
            self.entries.move_to_end(key)
        return chain

    def insert(self, tokens: list[int], value_of, scope: str) -> None:
        chain = self.match(tokens, scope)[:len(tokens) // self.n]
        for i, key in enumerate(chain):
            value = value_of(i, self.entries[key])
            if value is not None and self._room(value[1] - self.entries[key][1], chain):
                self.bytes += value[1] - self.entries[key][1]
                self.entries[key] = value
        for i in range(len(chain), len(tokens) // self.n):
            value = value_of(i, None)
            if not self._room(value[1], chain):
                break
            key = scope, tuple(tokens[:(i + 1) * self.n])
            self.entries[key] = value
            self.bytes += value[1]
            chain.append(key)
        for key in reversed(chain):
            self.entries.move_to_end(key)

    def _room(self, size: int, chain: list[tuple[str, tuple[int, ...]]]) -> bool:
        while self.bytes + size > self.budget:
            oldest = next(iter(self.entries), None)
            if oldest is None or oldest in chain:
                return False
            self.bytes -= self.entries.pop(oldest)[1]
            self.evictions += 1
        return True


def values_for(label: str, sizes: list[int], grow: int):
    """A value_of: new block i gets (label/i, sizes[i]); a cached block labelled 'a…' is replaced by a
    bigger 'b…' value when grow > 0 (as the engine adds draft KV to a block that has only the target's)."""
    def value_of(i: int, old: Value | None) -> Value | None:
        if old is None:
            return f"a{label}/{i}", sizes[i % len(sizes)]
        if grow and old[0].startswith("a"):
            return "b" + old[0][1:], old[1] + grow
        return None
    return value_of


class StoreMachine(RuleBasedStateMachine):
    @initialize(budget=st.integers(0, 60), block_size=st.integers(1, 3))
    def start(self, budget, block_size):
        self.store = PrefixStore(budget, block_size, size)
        self.ref = Reference(budget, block_size)
        self.scope_of: dict[str, str] = {}  # insert label -> the scope it stored into

    @rule(tokens=tokens_st, sizes=sizes_st, grow=st.integers(0, 4), scope=scopes_st)
    def insert(self, tokens, sizes, grow, scope):
        label = str(len(self.scope_of))
        self.scope_of[label] = scope
        value_of = values_for(label, sizes, grow)
        self.store.insert(tokens, value_of, scope)
        self.ref.insert(tokens, value_of, scope)

    @rule(tokens=tokens_st, scope=scopes_st)
    def match(self, tokens, scope):
        chain = self.store.match(tokens, scope)
        expected = self.ref.match(tokens, scope)
        assert [b.value for b in chain] == [self.ref.entries[k] for k in expected]
        assert all(self.scope_of[b.value[0][1:].split("/")[0]] == scope for b in chain), "another scope's block"
        matched = min(len(chain) * self.store.block_size, len(tokens))
        assert [t for b in chain for t in b.tokens][:matched] == list(tokens[:matched])

    @rule()
    def clear(self):
        self.store.clear()
        self.ref.entries.clear()
        self.ref.bytes = 0

    @invariant()
    def consistent(self):
        self.store.check()
        assert (self.store.bytes, self.store.evictions, len(self.store)) == (
            self.ref.bytes, self.ref.evictions, len(self.ref.entries))


StoreMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_prefix_store = StoreMachine.TestCase


def test_block_size_must_be_positive():
    with pytest.raises(ValueError):
        PrefixStore(10, 0, size)
