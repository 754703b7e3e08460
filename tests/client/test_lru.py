"""fly_llm.common.lru.LruCache: hits, least-recently-used eviction within a byte budget, failures not cached."""

import random
from collections import OrderedDict

import pytest

from fly_llm.common.lru import LruCache


def test_hits_evicts_the_least_recently_used_and_caches_no_failure():
    cache: LruCache[str, int] = LruCache(2, lambda key, value: 1)
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
    cache.check()


def test_a_value_bigger_than_the_budget_is_returned_not_kept():
    cache: LruCache[str, int] = LruCache(10, lambda key, value: value)
    assert cache.get_or_make("small", lambda: 4) == 4
    assert cache.get_or_make("huge", lambda: 11) == 11
    assert (len(cache), cache.bytes) == (1, 4)  # the huge one did not push out what fits
    cache.check()


@pytest.mark.parametrize("seed", range(5))
def test_random_traffic_matches_a_reference_and_never_exceeds_the_budget(seed):
    """Seeded random gets (`get_or_make`, or `get`, which makes nothing) of values of random sizes: after each, the
    byte count is the entries' sum and within the budget (`check`), and the cache holds exactly what a plain
    LRU-by-bytes reference holds."""
    rng = random.Random(seed)
    budget = rng.randint(5, 60)
    sizes = {key: rng.randint(1, 25) for key in range(40)}
    cache: LruCache[int, int] = LruCache(budget, lambda key, value: sizes[key])
    reference: OrderedDict[int, int] = OrderedDict()
    for _ in range(500):
        key = rng.randrange(40)
        hit = key in reference
        peek = rng.random() < 0.3
        if peek:
            assert cache.get(key) == (key * 7 if hit else None)
        else:
            assert cache.get_or_make(key, lambda: key * 7) == key * 7
        if hit:
            reference.move_to_end(key)
        elif sizes[key] <= budget and not peek:
            reference[key] = sizes[key]
            while sum(reference.values()) > budget:
                reference.popitem(last=False)
        cache.check()
        assert (len(cache), cache.bytes) == (len(reference), sum(reference.values()))
