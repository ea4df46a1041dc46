"""A bounded, thread-safe LRU cache of text embeddings.

Keyed by (model name, text): a vector made by one model (or one ``max_tokens`` cut, which is
part of the name) is never served for another. The vectors are kept as read-only float32
copies, so a caller can neither change what the cache holds nor what another caller got.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from lifemem_ray.core.errors import InvalidArgumentError

__all__ = ["EmbeddingCache"]


def _frozen_row(vector: np.ndarray) -> np.ndarray:
    """A float32 copy of one vector that cannot be written to."""
    row = np.array(vector, dtype=np.float32, copy=True).reshape(-1)
    row.flags.writeable = False
    return row


class EmbeddingCache:
    """At most ``max_entries`` vectors (0: keeps nothing, every lookup a miss); the least
    recently used goes first. Counts hits, misses and evictions."""

    def __init__(self, max_entries: int) -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 0:
            raise InvalidArgumentError(
                f"EmbeddingCache: max_entries must be an integer >= 0 (0 turns the cache off), got {max_entries!r}"
            )
        self.max_entries = max_entries
        self._rows: OrderedDict[tuple[str, str], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._rows)

    def get_many(self, model: str, texts: Sequence[str]) -> list[np.ndarray | None]:
        """Per text: its cached vector (read-only), or None; each found one becomes the most recent."""
        found: list[np.ndarray | None] = []
        with self._lock:
            for text in texts:
                row = self._rows.get((model, text))
                if row is None:
                    self.misses += 1
                else:
                    self._rows.move_to_end((model, text))
                    self.hits += 1
                found.append(row)
        return found

    def put_many(self, model: str, texts: Sequence[str], vectors: np.ndarray) -> None:
        """Keep ``vectors[i]`` for ``texts[i]``, evicting the least recently used beyond the bound."""
        if len(texts) != len(vectors):
            raise InvalidArgumentError(f"EmbeddingCache.put_many: {len(texts)} texts but {len(vectors)} vectors")
        if self.max_entries == 0:
            return
        rows = [_frozen_row(v) for v in vectors]
        with self._lock:
            for text, row in zip(texts, rows, strict=True):
                self._rows[(model, text)] = row
                self._rows.move_to_end((model, text))
            while len(self._rows) > self.max_entries:
                self._rows.popitem(last=False)
                self.evictions += 1

    def get(self, model: str, text: str) -> np.ndarray | None:
        return self.get_many(model, [text])[0]

    def put(self, model: str, text: str, vector: np.ndarray) -> None:
        self.put_many(model, [text], np.asarray(vector, dtype=np.float32).reshape(1, -1))

    def clear(self) -> None:
        """Forget every vector (the counts stay)."""
        with self._lock:
            self._rows.clear()

    def stats(self) -> dict[str, Any]:
        """entries, capacity, hits, misses, evictions and hit_rate (hits per lookup; 0.0 before any)."""
        with self._lock:
            lookups = self.hits + self.misses
            return {
                "entries": len(self._rows),
                "capacity": self.max_entries,
                "hits": self.hits,
                "misses": self.misses,
                "evictions": self.evictions,
                "hit_rate": self.hits / lookups if lookups else 0.0,
            }
