"""The two interfaces of the engine, typed.

* :class:`MemoryAPI`: the user operations. :class:`lifemem_ray.engine.memory.Memory` (one folder)
  and :class:`lifemem_ray.actors.client.blocking.MemoryClient` (a Ray deployment) both offer them, and both
  report :class:`MemoryStats` from ``stats()``.
* :class:`ShardProtocol`: what a coordinator or a sharded client calls on one store.
  :class:`lifemem_ray.engine.local_shard.EngineShard` (``Memory.shard``, in process) and the Ray
  actor :class:`lifemem_ray.actors.cluster.shard_actor.MemoryShard` both satisfy it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from lifemem_ray.core.model import Trajectory
    from lifemem_ray.engine.clustering.clusters import ClusterInfo, ClusterRecord
    from lifemem_ray.engine.clustering.evolution import CandidateArrays, ItemBatch, Placement
    from lifemem_ray.engine.ingest_rules import AddResult
    from lifemem_ray.engine.retrieval import RecordHit, Retrieval

__all__ = ["MemoryAPI", "MemoryStats", "ShardProtocol"]


class MemoryStats(TypedDict, total=False):
    """``stats()`` of a memory: these keys from either implementation (a store adds
    ``path``, ``cluster_sizes``, ``index`` and more; a deployment ``shards`` and ``coordinator``).
    A tenant's view (``stats(tenant)``) has ``tenant`` and only that tenant's own figures: no
    ``splits``, ``llm`` or other figure of the store as a whole."""

    trajectories: int
    clusters: int
    pending: int
    splits: int
    mixed_env_clusters: int
    per_env: dict[str, dict[str, int]]  # env -> {"trajectories": n, "clusters": n}
    llm: dict[str, Any]  # calls, tokens, fallbacks, refused_generated, by_operation (and backend where one applies)
    # The embedding service's figures (backend, hits, misses, hit_rate, batches, mean_batch_texts ...):
    # a deployment's embedder actors added up; a store's once it embedded texts itself. Not in a tenant's view.
    embedding: dict[str, Any]
    tenant: str  # in a tenant's view only
    version: str  # the memory's version now (lifemem_ray.engine.versions): what a retrieve as_of it sees


@runtime_checkable
class MemoryAPI(Protocol):
    """The user operations of a memory. ``add`` / ``add_many`` return the results (a store)
    or a future of them (a deployment). Every read and delete is of one tenant
    (:mod:`lifemem_ray.core.tenancy`; a trajectory carries its own): a tenant never sees another's
    trajectories, clusters or skills."""

    def add(self, trajectory: Trajectory, vector: Any = None) -> Any: ...

    def add_many(self, trajectories: Sequence[Trajectory], vectors: Any = None) -> Any: ...

    def retrieve(
        self,
        task: str,
        env: str | None,
        k: int | None = None,
        *,
        vector: Any = None,
        token_budget: int | None = None,
        skills: bool = True,
        tenant: str = "default",
    ) -> Retrieval: ...

    def retrieve_many(
        self,
        tasks: Sequence[str],
        envs: Sequence[str | None] | str,
        k: int | None = None,
        *,
        vectors: Any = None,
        token_budget: int | None = None,
        skills: bool = True,
        tenant: str = "default",
    ) -> list[Retrieval]: ...

    def remove(self, ids: Sequence[str], *, tenant: str = "default") -> int:
        """Delete the tenant's trajectories of these ids; how many were stored (idempotent)."""
        ...

    def purge_tenant(self, tenant: str) -> int:
        """Delete everything of ``tenant``; completes even if interrupted by a crash."""
        ...

    def stats(self, tenant: str | None = None) -> MemoryStats: ...

    def clusters(
        self, env: str | None = None, *, tenant: str | None = "default", limit: int | None = None
    ) -> list[ClusterInfo]: ...

    def cluster_count(self, env: str | None = None, *, tenant: str | None = "default") -> int: ...

    def verify(self, deep: bool = False) -> dict[str, Any]: ...

    def maintain(self) -> int: ...

    def version(self) -> str:
        """The memory's version now (:mod:`lifemem_ray.engine.versions`): what a read pinned
        ``as_of`` it sees, later writes left out."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class ShardProtocol(Protocol):
    """One store as a coordinator or sharded client sees it. Every call is safe to retry:
    a commit skips trajectories already stored."""

    def known(self, ids: Sequence[str], fingerprints: Sequence[str]) -> list[AddResult | None]: ...

    def candidates(self, vectors: np.ndarray, workflow_vectors: np.ndarray, envs: Sequence[str]) -> CandidateArrays: ...

    def commit(
        self, batch: ItemBatch, placements: list[Placement], counters: dict[str, int] | None = None
    ) -> tuple[list[AddResult], dict[int, ClusterRecord]]: ...

    def add_items(self, batch: ItemBatch) -> list[AddResult]: ...

    def search_records(
        self, envs: Sequence[str], k: int, vectors: np.ndarray, skills: bool = True, as_of: int | None = None
    ) -> list[tuple[list[RecordHit], dict[int, str]]]: ...

    def search_hits(
        self, envs: Sequence[str], k: int, vectors: np.ndarray, as_of: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]: ...

    def hit_records(self, ids: np.ndarray, skills: bool = True) -> tuple[list[Any], dict[int, str]]: ...

    def watermark(self) -> int: ...

    def stats(self, tenant: str | None = None) -> dict[str, Any]: ...

    def clusters(
        self, env: str | None = None, tenant: str | None = "default", limit: int | None = None
    ) -> list[ClusterInfo]: ...

    def cluster_count(self, env: str | None = None, tenant: str | None = "default") -> int: ...

    def remove(self, ids: Sequence[str], tenant: str = "default") -> int: ...

    def purge_tenant(self, tenant: str) -> int: ...

    def cluster_ids(self) -> list[int]: ...

    def verify(self, deep: bool = False) -> dict[str, Any]: ...

    def maintain(self) -> int: ...

    def export_records(self, path: str) -> dict[str, Any]: ...

    def snapshot(self, directory: str) -> dict[str, Any]: ...

    def absorb(
        self, source: str, cluster_ids: list[int] | None, pending: bool, accept_loss_from: int | None = None
    ) -> dict[str, int]: ...

    def close(self) -> None: ...
