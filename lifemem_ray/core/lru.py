"""One bounded, thread-safe LRU mapping for every cache of the project (embeddings, a client's
in-doubt adds, the environments' memoised builds and plans): at most ``limit`` entries, the
least recently used evicted first, with hit, miss and eviction counts.

>>> cache = LruCache(2)
>>> cache.put("a", 1); cache.put("b", 2)
>>> cache.get("a")
1
>>> cache.put("c", 3)  # "b" was the least recently used
>>> "b" in cache, len(cache), cache.stats()["evictions"]
(False, 2, 1)
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any, Generic, TypeVar

from lifemem_ray.core.errors import InvalidArgumentError

__all__ = ["LruCache"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LruCache(Generic[K, V]):
    """At most ``limit`` entries (0: keeps nothing, every lookup a miss); thread-safe."""

    def __init__(self, limit: int, name: str = "LruCache") -> None:
        """
        Args:
            limit: the most entries kept (0 turns the cache off).
            name: what errors call it.

        Raises:
            InvalidArgumentError: ``limit`` is not an integer >= 0.
        """
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise InvalidArgumentError(f"{name}: the limit must be an integer >= 0 (0 keeps nothing), got {limit!r}")
        self.limit = limit  # the most entries kept
        self._entries: OrderedDict[K, V] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()  # callers share a cache across threads
        self.hits = 0  # lookups that found their key
        self.misses = 0  # lookups that did not
        self.evictions = 0  # entries dropped for the bound

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is kept (neither counted nor made recent)."""
        return key in self._entries

    def get(self, key: K) -> V | None:
        """``key``'s value, made the most recent; None when absent (counted either way)."""
        with self._lock:
            if key not in self._entries:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return self._entries[key]

    def put(self, key: K, value: V) -> None:
        """Keep ``value`` for ``key`` as the most recent, evicting beyond the limit."""
        if self.limit == 0:
            return
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.limit:
                self._entries.popitem(last=False)
                self.evictions += 1

    def pop(self, key: K) -> V | None:
        """``key``'s value, no longer kept; None when absent (not counted)."""
        with self._lock:
            return self._entries.pop(key, None)

    def clear(self) -> None:
        """Forget every entry (the counts stay)."""
        with self._lock:
            self._entries.clear()

    def stats(self) -> dict[str, Any]:
        """entries, capacity, hits, misses, evictions and hit_rate (hits per lookup; 0.0 before any)."""
        with self._lock:
            lookups = self.hits + self.misses
            return {
                "entries": len(self._entries),
                "capacity": self.limit,
                "hits": self.hits,
                "misses": self.misses,
                "evictions": self.evictions,
                "hit_rate": self.hits / lookups if lookups else 0.0,
            }
