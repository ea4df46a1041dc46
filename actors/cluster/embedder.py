"""Embedding actors: the embedding service (:func:`~lifemem_ray.engine.embedding.open_embedder`:
the MiniLM model behind a cache and a dynamic batcher) behind Ray, one per GPU where there
are GPUs.

An embedder is a threaded actor: up to ``MAX_CONCURRENCY`` calls run at once, and the texts
they still need computed share model calls. Callers route each text to one replica by a hash
of the text (:func:`~lifemem_ray.actors.cluster.ray_shards.route_texts`), so a text always
meets the same replica's cache, whichever path (a retrieval, the coordinator's add) sends it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from lifemem_ray.actors.cluster import ray_metrics
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.engine.embedding import open_embedder
from lifemem_ray.engine.memory_config import EmbeddingConfig

__all__ = ["MAX_CONCURRENCY", "EmbedderActor"]

MAX_CONCURRENCY = 32  # embed calls an actor runs at once (their texts gathered into shared model calls)


class EmbedderActor:
    @classmethod
    def ray_options(cls, config: DeploymentConfig, *, gpu: bool) -> dict[str, Any]:
        """Ray actor options of an embedder (besides name, namespace and lifetime); ``gpu``:
        it takes one GPU (one embedder per GPU of the cluster)."""
        # With cluster.replace_dead_actors, one that died is started anew by the coordinator's
        # keeper (a new actor, which clients connected before a head loss can reach); else Ray restarts it.
        replaced = config.cluster.replace_dead_actors
        return {
            "num_cpus": config.cluster.embedder_cpus,
            "num_gpus": 1 if gpu else 0,
            "max_restarts": 0 if replaced else -1,
            "max_task_retries": 0 if replaced else -1,
            "max_concurrency": MAX_CONCURRENCY,
        }

    def __init__(self, config: EmbeddingConfig, deployment: str) -> None:
        """``deployment``: the deployment's Ray namespace (its metrics' ``deployment`` tag)."""
        self.deployment = deployment
        self.embedder = open_embedder(config, observe_lookups=self._count_texts, observe_batch=self._observe_batch)

    def _count_texts(self, cached: int, computed: int) -> None:
        ray_metrics.count_embedding_texts(self.deployment, cached, computed)

    def _observe_batch(self, size: int) -> None:
        ray_metrics.observe_embedding_batch(self.deployment, size)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        return self.embedder.embed(texts)

    def stats(self) -> dict[str, Any]:
        """The service's figures: backend, cache hits and misses, hit rate, model calls."""
        return self.embedder.stats()

    def ping(self) -> str:
        return "ok"

    def info(self) -> dict[str, Any]:
        return {
            "device": self.embedder.device,
            "dim": self.embedder.dim,
            "name": self.embedder.name,
            "backend": self.embedder.kind,
        }
