"""A bounded, thread-safe LRU cache of text embeddings.

Keyed by (model name, text): a vector made by one model (or one ``max_tokens`` cut, which is
part of the name) is never served for another. The vectors are kept as read-only float32
copies, so a caller can neither change what the cache holds nor what another caller got.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.core.lru import LruCache

__all__ = ["EmbeddingCache"]


def _frozen_row(vector: np.ndarray) -> np.ndarray:
    """A float32 copy of one vector that cannot be written to."""
    row = np.array(vector, dtype=np.float32, copy=True).reshape(-1)
    row.flags.writeable = False
    return row


class EmbeddingCache:
    """At most ``max_entries`` vectors (0: keeps nothing, every lookup a miss); the least
    recently used goes first (a :class:`~lifemem_ray.core.lru.LruCache` keyed by (model, text)).
    Counts hits, misses and evictions."""

    def __init__(self, max_entries: int) -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 0:
            raise InvalidArgumentError(
                f"max_entries must be an integer >= 0 (0 turns the cache off), got {max_entries!r}",
                where="EmbeddingCache",
            )
        self.max_entries = max_entries
        self._rows: LruCache[tuple[str, str], np.ndarray] = LruCache(max_entries, "EmbeddingCache")

    def __len__(self) -> int:
        return len(self._rows)

    def get_many(self, model: str, texts: Sequence[str]) -> list[np.ndarray | None]:
        """Per text: its cached vector (read-only), or None; each found one becomes the most recent."""
        return [self._rows.get((model, text)) for text in texts]

    def put_many(self, model: str, texts: Sequence[str], vectors: np.ndarray) -> None:
        """Keep ``vectors[i]`` for ``texts[i]``, evicting the least recently used beyond the bound."""
        if len(texts) != len(vectors):
            raise InvalidArgumentError(
                f"{len(texts)} texts but {len(vectors)} vectors", where="EmbeddingCache.put_many"
            )
        if self.max_entries == 0:
            return
        for text, vector in zip(texts, vectors, strict=True):
            self._rows.put((model, text), _frozen_row(vector))

    def get(self, model: str, text: str) -> np.ndarray | None:
        return self.get_many(model, [text])[0]

    def put(self, model: str, text: str, vector: np.ndarray) -> None:
        self.put_many(model, [text], np.asarray(vector, dtype=np.float32).reshape(1, -1))

    def clear(self) -> None:
        """Forget every vector (the counts stay)."""
        self._rows.clear()

    def stats(self) -> dict[str, Any]:
        """entries, capacity, hits, misses, evictions and hit_rate (hits per lookup; 0.0 before any)."""
        return self._rows.stats()
