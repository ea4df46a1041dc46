"""The one bounded LRU every cache uses (issue 34 item 5): order, bound, counts, a limit of 0,
a bad limit refused, many threads at once; and the caches built on it keep their behaviour."""

from __future__ import annotations

import doctest
import threading

import pytest

from lifemem_ray.core import lru
from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.core.lru import LruCache


def test_the_least_recently_used_goes_first_and_everything_is_counted():
    cache: LruCache[str, int] = LruCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # a is the most recent now
    cache.put("c", 3)  # b goes
    assert "b" not in cache and cache.get("b") is None and cache.get("c") == 3
    cache.put("a", 10)  # a replaced, most recent
    cache.put("d", 4)  # c goes
    assert sorted(k for k in "abcd" if k in cache) == ["a", "d"] and cache.get("a") == 10
    assert cache.pop("a") == 10 and cache.pop("a") is None and len(cache) == 1
    assert cache.stats() == {"entries": 1, "capacity": 2, "hits": 3, "misses": 1, "evictions": 2, "hit_rate": 0.75}
    cache.clear()
    assert len(cache) == 0 and cache.stats()["hits"] == 3


def test_a_limit_of_zero_keeps_nothing_and_a_bad_limit_is_refused():
    off: LruCache[str, int] = LruCache(0)
    off.put("a", 1)
    assert off.get("a") is None and len(off) == 0 and off.stats()["misses"] == 1
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(InvalidArgumentError, match="the limit must be an integer >= 0"):
            LruCache(bad)  # type: ignore[arg-type]


def test_many_threads_never_exceed_the_bound_or_lose_a_count():
    cache: LruCache[int, int] = LruCache(64)

    def work(offset: int) -> None:
        for i in range(2000):
            cache.put((i * 7 + offset) % 200, i)
            cache.get((i + offset) % 200)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = cache.stats()
    assert len(cache) == 64 and stats["hits"] + stats["misses"] == 8 * 2000


def test_the_module_example_runs():
    assert doctest.testmod(lru).failed == 0
