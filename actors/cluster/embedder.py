"""Embedding actors: the MiniLM encoder behind Ray, one per GPU where there are GPUs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.engine.embedding import MiniLMEmbedder
from lifemem_ray.engine.memory_config import EmbeddingConfig

__all__ = ["EmbedderActor"]


class EmbedderActor:
    @classmethod
    def ray_options(cls, config: DeploymentConfig, *, gpu: bool) -> dict[str, Any]:
        """Ray actor options of an embedder (besides name, namespace and lifetime); ``gpu``:
        it takes one GPU (one embedder per GPU of the cluster)."""
        return {
            "num_cpus": config.cluster.embedder_cpus,
            "num_gpus": 1 if gpu else 0,
            "max_restarts": -1,
            "max_task_retries": -1,
        }

    def __init__(self, config: EmbeddingConfig) -> None:
        self.embedder = MiniLMEmbedder(config)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        return self.embedder.embed(texts)

    def ping(self) -> str:
        return "ok"

    def info(self) -> dict[str, Any]:
        return {"device": self.embedder.device, "dim": self.embedder.dim, "name": self.embedder.name}
