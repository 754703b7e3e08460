"""fly_llm.common.lru.LruCache: hits, least-recently-used eviction, failures not cached."""

import pytest

from fly_llm.common.lru import LruCache


def test_hits_evicts_the_least_recently_used_and_caches_no_failure():
    cache: LruCache[str, int] = LruCache(2)
    made: list[str] = []

    def make(key: str) -> int:
        made.append(key)
        return len(made)

    assert cache.get_or_make("a", lambda: make("a")) == 1
    assert cache.get_or_make("b", lambda: make("b")) == 2
    assert cache.get_or_make("a", lambda: make("a")) == 1  # a hit, and "a" is now the most recent
    cache.get_or_make("c", lambda: make("c"))  # evicts "b"
    assert len(cache) == 2 and made == ["a", "b", "c"]
    assert cache.get_or_make("a", lambda: make("a")) == 1
    assert cache.get_or_make("b", lambda: make("b")) == 4  # made again
    with pytest.raises(ValueError):
        cache.get_or_make("x", lambda: (_ for _ in ()).throw(ValueError("no")))
    assert cache.get_or_make("x", lambda: 9) == 9  # the failure was not cached
