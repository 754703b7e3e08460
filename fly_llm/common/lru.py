"""A bounded least-recently-used map for the content-keyed caches of grammars and constraints (no torch)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LruCache(Generic[K, V]):
    """At most `size` entries, the least recently used dropped first; safe across threads.

    `get_or_make` computes a missing value outside the cache's lock (a slow compile never blocks a
    hit), so two threads missing the same key at once may both compute it; the later one is kept.
    A value whose computation raises is not cached.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get_or_make(self, key: K, make: Callable[[], V]) -> V:
        """The value cached for `key`, or `make()`'s, cached now."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
        value = make()
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            if len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return value

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
