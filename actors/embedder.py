"""Embedding actors: the MiniLM encoder behind Ray, one per GPU where there are GPUs."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from lifemem_ray.config import EmbeddingConfig
from lifemem_ray.embedding import MiniLMEmbedder

__all__ = ["EmbedderActor"]


class EmbedderActor:
    def __init__(self, config: EmbeddingConfig) -> None:
        self.embedder = MiniLMEmbedder(config)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        return self.embedder.embed(texts)

    def ping(self) -> str:
        return "ok"

    def info(self) -> dict[str, Any]:
        return {"device": self.embedder.device, "dim": self.embedder.dim, "name": self.embedder.name}
