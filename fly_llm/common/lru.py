"""A least-recently-used map bounded in bytes, for the content-keyed caches of grammars and constraints (no torch)."""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

ENTRY_BYTES = 256
"""What one entry costs beyond its key's and value's own bytes (the map's node, tuples, the object headers)."""


def text_bytes(*texts: str | bytes) -> int:
    """Bytes the interpreter holds for these strings (header included: `sys.getsizeof`)."""
    return sum(sys.getsizeof(text) for text in texts)


class LruCache(Generic[K, V]):
    """Entries of at most `budget` bytes in all, the least recently used dropped first; safe across threads.

    An entry's bytes are `size(key, value)` (computed once, when it is stored). A value bigger than
    the whole budget is returned but not kept. `get_or_make` computes a missing value outside the
    cache's lock (a slow compile never blocks a hit), so two threads missing the same key at once
    may both compute it; the later one is kept. A value whose computation raises is not cached.
    """

    def __init__(self, budget: int, size: Callable[[K, V], int]) -> None:
        self.budget = budget
        self.size = size
        self.bytes = 0
        """Bytes of the entries held now (their sizes' sum)."""
        self.evictions = 0
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()  # oldest first
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        """The value cached for `key` (now the most recently used), or None (for a cache that holds no None)."""
        with self._lock:
            if key not in self._entries:
                return None
            self._entries.move_to_end(key)
            return self._entries[key][0]

    def get_or_make(self, key: K, make: Callable[[], V]) -> V:
        """The value cached for `key`, or `make()`'s, cached now if it fits the budget."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key][0]
        value = make()
        nbytes = self.size(key, value)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            if nbytes <= self.budget:
                self._entries[key] = (value, nbytes)
                self.bytes += nbytes
                while self.bytes > self.budget:
                    _, (_, dropped) = self._entries.popitem(last=False)
                    self.bytes -= dropped
                    self.evictions += 1
        return value

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def check(self) -> None:
        """Assert the invariant: the byte count is the entries' sizes' sum and within the budget."""
        with self._lock:
            assert self.bytes == sum(nbytes for _, nbytes in self._entries.values()), "byte count ≠ entries"
            assert self.bytes <= self.budget, (self.bytes, self.budget)
