"""The embedding service: one backend behind a cache and a dynamic batcher.

Every path that embeds texts in a process (a retrieval's query, the later add of the same task,
a bulk load) goes through one :class:`EmbeddingService`: a text seen before is served from the
cache, a text twice in one call is computed once, and the texts still to compute from
concurrent callers share model calls (:class:`~.batcher.DynamicBatcher`).
:func:`open_embedder` builds it from the ``[embedding]`` settings, choosing the backend.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lifemem_ray.core.errors import EmbeddingError
from lifemem_ray.engine.embedding.base import Embedder, checked_texts
from lifemem_ray.engine.embedding.batcher import DynamicBatcher
from lifemem_ray.engine.embedding.cache import EmbeddingCache
from lifemem_ray.engine.memory_config import EmbeddingConfig

__all__ = ["EmbeddingService", "choose_backend", "open_embedder"]

log = logging.getLogger(__name__)

ONNX_MODULE = "lifemem_ray.engine.embedding.onnx_backend"


class EmbeddingService:
    """An :class:`~.base.Embedder` (the backend's ``name`` and ``dim``) with a cache of
    ``cache_entries`` texts (0: none) and batching across concurrent callers (up to
    ``batch_size`` texts per model call, a text waiting at most ``batch_wait_ms``).

    ``observe_lookups(cached, computed)`` is told, per call, how many distinct texts came from
    the cache and how many from the model; ``observe_batch(n)`` each model call's size."""

    def __init__(
        self,
        backend: Embedder,
        *,
        cache_entries: int = 100_000,
        batch_size: int = 64,
        batch_wait_ms: float = 0.0,
        kind: str = "",
        observe_lookups: Callable[[int, int], None] | None = None,
        observe_batch: Callable[[int], None] | None = None,
    ) -> None:
        self.backend = backend
        self.name: str = backend.name
        self.dim: int = backend.dim
        self.kind = kind or type(backend).__name__  # "torch", "onnx", or the backend's class
        self.device: str = str(getattr(backend, "device", "cpu"))
        self.cache = EmbeddingCache(cache_entries) if cache_entries > 0 else None
        self.batcher = DynamicBatcher(
            backend.embed, self.dim, batch_size=batch_size, wait_ms=batch_wait_ms, observe_batch=observe_batch
        )
        self._observe_lookups = observe_lookups
        self._lock = threading.Lock()
        self.texts = 0  # texts asked for, duplicates included
        self.computed = 0  # distinct texts sent to the model (cache misses)
        self.cached = 0  # distinct texts served from the cache

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Unit vectors (n, dim) float32, one row per text in order."""
        texts = checked_texts(texts)
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        rows_of: dict[str, list[int]] = {}
        for i, text in enumerate(texts):
            rows_of.setdefault(text, []).append(i)
        distinct = list(rows_of)
        found = self.cache.get_many(self.name, distinct) if self.cache is not None else [None] * len(distinct)
        missing = [text for text, row in zip(distinct, found, strict=True) if row is None]
        for text, row in zip(distinct, found, strict=True):
            if row is not None:
                out[rows_of[text]] = row
        if missing:
            vectors = self.batcher.submit(missing)
            if self.cache is not None:
                self.cache.put_many(self.name, missing, vectors)
            for text, vector in zip(missing, vectors, strict=True):
                out[rows_of[text]] = vector
        self._count(len(texts), len(distinct) - len(missing), len(missing))
        return out

    def _count(self, asked: int, cached: int, computed: int) -> None:
        with self._lock:
            self.texts += asked
            self.cached += cached
            self.computed += computed
        if self._observe_lookups is not None:
            try:
                self._observe_lookups(cached, computed)
            except Exception:  # a metrics hook must never fail an embedding
                log.warning("the embedding service's observe_lookups hook failed", exc_info=True)

    def stats(self) -> dict[str, Any]:
        """What this service did: backend, model, device, texts asked, distinct texts served
        from the cache (``hits``) or the model (``misses``), ``hit_rate``, the cache's entries,
        capacity and evictions, model calls (``batches``) and ``mean_batch_texts``."""
        with self._lock:
            texts, cached, computed = self.texts, self.cached, self.computed
        cache = self.cache.stats() if self.cache is not None else {"entries": 0, "capacity": 0, "evictions": 0}
        batcher = self.batcher.stats()
        return {
            "backend": self.kind,
            "model": self.name,
            "device": self.device,
            "texts": texts,
            "hits": cached,
            "misses": computed,
            "hit_rate": cached / (cached + computed) if cached + computed else 0.0,
            "entries": cache["entries"],
            "capacity": cache["capacity"],
            "evictions": cache["evictions"],
            "batches": batcher["batches"],
            "mean_batch_texts": batcher["mean_batch_texts"],
            "failed_batches": batcher["failed_batches"],
        }

    def close(self) -> None:
        """End the batcher's thread; later embeds are refused."""
        self.batcher.close()


def _onnx_available() -> bool:
    """ONNX Runtime is importable and the ONNX backend module is present."""
    if importlib.util.find_spec(ONNX_MODULE) is None:
        return False
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def choose_backend(config: EmbeddingConfig) -> str:
    """The backend ``config.backend`` names, "torch" or "onnx"; for "auto": ONNX on CPU where ONNX
    Runtime and the ONNX backend are there, torch on CUDA (``device`` cuda, or auto with a CUDA
    device) and otherwise."""
    if config.backend != "auto":
        return config.backend
    if config.device == "cuda" or not _onnx_available():
        return "torch"
    if config.device == "auto" and _cuda_available():
        return "torch"
    return "onnx"


def _open_backend(kind: str, config: EmbeddingConfig) -> Embedder:
    if kind == "onnx":
        if importlib.util.find_spec(ONNX_MODULE) is None:
            raise EmbeddingError(
                f"embedding.backend = 'onnx' but the module {ONNX_MODULE} is not installed; set embedding.backend to 'torch' or 'auto'"
            )
        from lifemem_ray.engine.embedding.onnx_backend import OnnxMiniLMEmbedder

        onnx_backend: Embedder = OnnxMiniLMEmbedder(config)
        return onnx_backend
    from lifemem_ray.engine.embedding.torch_backend import MiniLMEmbedder

    return MiniLMEmbedder(config)


def open_embedder(
    config: EmbeddingConfig | None = None,
    *,
    observe_lookups: Callable[[int, int], None] | None = None,
    observe_batch: Callable[[int], None] | None = None,
) -> EmbeddingService:
    """The ``[embedding]`` settings' service: the backend :func:`choose_backend` picks, behind a
    cache of ``cache_entries`` texts and batches of up to ``batch_size`` gathered within
    ``batch_wait_ms``. The hooks are :class:`EmbeddingService`'s (metrics)."""
    config = config or EmbeddingConfig()
    config.checked()
    kind = choose_backend(config)
    return EmbeddingService(
        _open_backend(kind, config),
        cache_entries=config.cache_entries,
        batch_size=config.batch_size,
        batch_wait_ms=config.batch_wait_ms,
        kind=kind,
        observe_lookups=observe_lookups,
        observe_batch=observe_batch,
    )
