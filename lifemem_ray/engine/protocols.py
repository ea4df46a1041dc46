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

    def add(self, trajectory: Trajectory, vector: Any = None) -> Any:
        """Store one trajectory (see :meth:`add_many`).

        Args:
            trajectory: what to store; its ``tenant`` says whose memory it joins.
            vector: its query text's embedding (None: the memory embeds it).

        Returns:
            Its :class:`~lifemem_ray.engine.ingest_rules.AddResult` (a store), or a future of it
            (a deployment: ``.result()``, or ``await`` for the async client).

        Raises:
            InvalidTrajectoryError: the trajectory or its vector is refused (``where`` names the field).
            IdConflictError: its id is stored with other content; nothing was stored.
        """
        ...

    def add_many(self, trajectories: Sequence[Trajectory], vectors: Any = None) -> Any:
        """Store trajectories as one request: each joins a cluster of its neighbours or opens
        one; acknowledged as a whole, refused whole if an id conflicts.

        Args:
            trajectories: what to store.
            vectors: their query texts' embeddings, one row each (None: the memory embeds them).

        Returns:
            One :class:`~lifemem_ray.engine.ingest_rules.AddResult` per trajectory
            (``added``/``duplicate``), or a future of them (a deployment).

        Raises:
            InvalidTrajectoryError: a trajectory or a vector is refused (nothing is stored).
            IdConflictError: an id is stored, or repeated here, with other content.
        """
        ...

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
        as_of: str | None = None,
    ) -> Retrieval:
        """The ``k`` stored trajectories nearest to ``task`` in ``env``, with their clusters'
        skills, rendered within ``token_budget`` tokens (paper section 5.5).

        Args:
            task: the new task's text.
            env: its environment (None: every environment of the tenant).
            k: trajectories to return (None: ``retrieval.k``).
            vector: the task's embedding (None: embedded here).
            token_budget: the rendered context's budget (None: ``retrieval.token_budget``).
            skills: whether the clusters' skills come along.
            tenant: whose memory is searched.
            as_of: a version (:meth:`version`) to read at: later writes left out.

        Returns:
            The :class:`~lifemem_ray.engine.retrieval.Retrieval`: trajectories, skills, context.

        Raises:
            InvalidArgumentError: an argument refused, named in ``where``.
        """
        ...

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
        as_of: str | None = None,
    ) -> list[Retrieval]:
        """:meth:`retrieve` for many tasks in one call (one search per environment).

        Args:
            tasks: the tasks' texts.
            envs: one environment per task, or one for all (None entries: every environment).
            k: trajectories per task (None: ``retrieval.k``).
            vectors: the tasks' embeddings (None: embedded here).
            token_budget: each context's budget (None: ``retrieval.token_budget``).
            skills: whether the clusters' skills come along.
            tenant: whose memory is searched.
            as_of: a version to read at.

        Returns:
            One :class:`~lifemem_ray.engine.retrieval.Retrieval` per task, in order.

        Raises:
            InvalidArgumentError: an argument refused (``tasks[i]``, ``envs[i]``, ``k`` ... in ``where``).
        """
        ...

    def remove(self, ids: Sequence[str], *, tenant: str = "default") -> int:
        """Delete the tenant's trajectories of these ids (idempotent: unknown ids are ignored).

        Args:
            ids: the trajectory ids.
            tenant: whose trajectories.

        Returns:
            How many were stored.
        """
        ...

    def purge_tenant(self, tenant: str) -> int:
        """Delete everything of ``tenant``; completes even if interrupted by a crash.

        Args:
            tenant: whose trajectories, clusters and skills go.

        Returns:
            How many trajectories were deleted.
        """
        ...

    def stats(self, tenant: str | None = None) -> MemoryStats:
        """The memory's counts.

        Args:
            tenant: only that tenant's own figures (None: everything, with ``per_tenant``).

        Returns:
            The :class:`MemoryStats`.
        """
        ...

    def clusters(
        self, env: str | None = None, *, tenant: str | None = "default", limit: int | None = None
    ) -> list[ClusterInfo]:
        """The live workflow clusters, largest first.

        Args:
            env: only this environment's (None: all).
            tenant: whose (None: every tenant's).
            limit: at most this many (the largest).

        Returns:
            One :class:`~lifemem_ray.engine.clustering.clusters.ClusterInfo` per cluster.
        """
        ...

    def cluster_count(self, env: str | None = None, *, tenant: str | None = "default") -> int:
        """How many clusters :meth:`clusters` would list without a limit.

        Args:
            env: only this environment's (None: all).
            tenant: whose (None: every tenant's).

        Returns:
            The count.
        """
        ...

    def verify(self, deep: bool = False) -> dict[str, Any]:
        """The stored state's invariants checked.

        Args:
            deep: also every record's fingerprint, recomputed.

        Returns:
            ``{"ok": bool, ...}`` with what was found.
        """
        ...

    def maintain(self) -> int:
        """Run the queued splits and skills now (they also run in the background).

        Returns:
            How many maintenance steps ran.
        """
        ...

    def version(self) -> str:
        """The memory's version now (:mod:`lifemem_ray.engine.versions`): what a read pinned
        ``as_of`` it sees, later writes left out.

        Returns:
            The version token (``v1:`` then one watermark per shard).
        """
        ...

    def close(self) -> None:
        """Release what the memory holds (a store's files, a client's handles)."""
        ...


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
