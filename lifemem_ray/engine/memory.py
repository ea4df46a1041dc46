"""The public engine: a LifeMem memory in one folder, usable without Ray.

``Memory.open(path)`` gives a store that survives crashes (LMDB), a FAISS index
rebuilt or reloaded from it, and the LifeMem algorithm on top: initialise,
evolve, split, distil, retrieve. Every batch of adds is one write transaction;
an add is acknowledged (returned) only after that transaction is on disk.

:class:`Memory` is the façade (the user operations of
:class:`lifemem_ray.engine.protocols.MemoryAPI`); the work is done by parts that share one
:class:`~lifemem_ray.engine.state.EngineState`, built and closed together
(:class:`~lifemem_ray.engine.parts.EngineParts`):

==================================  ===============================================
part                                job
==================================  ===============================================
:mod:`lifemem_ray.engine.ingest`    check ids, prepare, find candidates, plan, commit
:mod:`lifemem_ray.engine.maintenance`  the queue and its scheduler; skills, descriptions
:mod:`lifemem_ray.engine.restructure`  splits and merges
:mod:`lifemem_ray.engine.search`    retrieval and its two sharded halves
:mod:`lifemem_ray.engine.transfer`  absorb (from a snapshot), export
:mod:`lifemem_ray.engine.deletion`  remove by id, purge a tenant (resumed after a crash)
:mod:`lifemem_ray.engine.audit`     stats and verify
:mod:`lifemem_ray.engine.reads`     a trajectory, its cluster, clusters and their members
:mod:`lifemem_ray.engine.local_shard`  the shard protocol (``memory.shard``), over the same parts
==================================  ===============================================

The domain model (a cluster, fold / unfold of a member, the invariant ``verify`` checks)
is :mod:`lifemem_ray.engine.clustering.clusters`; the stored format :mod:`lifemem_ray.engine.store.codec`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from lifemem_ray.core.decisions import Decider
from lifemem_ray.core.metrics import MetricsSink
from lifemem_ray.core.model import Trajectory
from lifemem_ray.core.tenancy import DEFAULT_TENANT
from lifemem_ray.engine.clustering.clusters import ClusterInfo
from lifemem_ray.engine.clustering.evolution import BatchItem
from lifemem_ray.engine.embedding import Embedder
from lifemem_ray.engine.index.vector_index import VectorIndex
from lifemem_ray.engine.ingest import check_trajectories
from lifemem_ray.engine.ingest_rules import AddResult, caller_results, unit_rows
from lifemem_ray.engine.local_shard import EngineShard
from lifemem_ray.engine.memory_config import MemoryConfig
from lifemem_ray.engine.parts import EngineParts
from lifemem_ray.engine.retrieval import Retrieval
from lifemem_ray.engine.store.storage import MemoryStore
from lifemem_ray.engine.versions import format_version

__all__ = ["Memory"]  # the façade; the parts it uses are imported from where they are defined

log = logging.getLogger(__name__)


class Memory:
    """A LifeMem memory stored in one folder. Thread-safe; one writer process per folder."""

    def __init__(self, parts: EngineParts) -> None:
        """Over already opened parts; :meth:`open` is the way to open a store."""
        self._parts = parts
        self._state = self._parts.state
        self._ingest, self._search, self._reads = self._parts.ingest, self._parts.search, self._parts.reads
        self._maintenance = self._parts.maintenance
        # The shard protocol over the same parts: what a coordinator or sharded client calls.
        self.shard = EngineShard(self._parts)

    @property
    def parts(self) -> EngineParts:
        """The engine's parts this façade calls (a Ray shard builds its own EngineShard over them)."""
        return self._parts

    @classmethod
    def open(
        cls,
        path: str | Path,
        config: MemoryConfig | None = None,
        *,
        embedder: Embedder | None = None,
        decider: Decider | None = None,
        dim: int | None = None,
        read_only: bool = False,
        namespace: int = 0,
        metrics: MetricsSink | None = None,
    ) -> Memory:
        """Open (or create) the memory in ``path``.

        ``dim`` sets the vector size of a new store fed with precomputed vectors;
        by default it is the embedding model's (384). ``namespace`` (set when a store is
        created) keeps its trajectory and cluster ids apart from other shards' stores.
        ``metrics``: where the engine records its latency and its LLM calls (none: nowhere; a
        Ray shard gives the sink of :mod:`lifemem_ray.actors.cluster.ray_metrics`).

        Args:
            path: the store's folder (created if missing, unless ``read_only``).
            config: the engine's settings (default: the paper's).
            embedder: the embedding model (default: all-MiniLM-L6-v2 from the shipped package).
            decider: who assigns trajectories to clusters (default: per ``config.llm``).
            dim: the vector size of a new store fed with precomputed vectors.
            read_only: open without writing (another process may be the writer).
            namespace: a new store's id namespace (a shard's).
            metrics: where latencies and LLM calls are recorded.

        Returns:
            The open memory (a context manager: ``with Memory.open(path) as memory``).

        Raises:
            StoreLockedError: another process writes this store.
            StoreError: the folder holds no readable store, or one of another schema.
            ConfigError: a setting out of its bounds.
        """
        return cls(
            EngineParts.open(
                path,
                config,
                embedder=embedder,
                decider=decider,
                dim=dim,
                read_only=read_only,
                namespace=namespace,
                metrics=metrics,
            )
        )

    # -- what it is ------------------------------------------------------------------------
    @property
    def config(self) -> MemoryConfig:
        return self._state.config

    @property
    def path(self) -> Path:
        return self._state.path

    @property
    def dim(self) -> int:
        return self._state.dim

    @property
    def read_only(self) -> bool:
        return self._state.read_only

    @property
    def features(self) -> str:
        """The workflow featurizer of this store (``evolution.workflow_features``)."""
        return self._state.features

    @property
    def decider(self) -> Decider | None:
        return self._state.decider

    @property
    def store(self) -> MemoryStore:
        """The durable state (LMDB), for inspection and tools."""
        return self._state.store

    @property
    def index(self) -> VectorIndex:
        return self._state.index

    @property
    def initialised(self) -> bool:
        """Whether the initial partition exists (``evolution.init_size`` trajectories arrived)."""
        return self._state.initialised

    @property
    def embedder(self) -> Embedder:
        return self._state.embedder

    # -- adding ----------------------------------------------------------------------------
    def add(self, trajectory: Trajectory, vector: Any = None) -> AddResult:
        """Store one trajectory; returns after it is durable."""
        return self.add_many([trajectory], None if vector is None else [vector])[0]

    def add_many(
        self,
        trajectories: Sequence[Trajectory],
        vectors: Any = None,
        *,
        progress: Callable[[int], None] | None = None,
    ) -> list[AddResult]:
        """Store many trajectories, ``evolution.batch_size`` per transaction.

        ``vectors`` (n, dim) are precomputed retrieval vectors of the trajectories'
        task texts; without them the embedding model computes them. A trajectory id stored
        (or repeated in one batch) with other content refuses that batch
        (:class:`IdConflictError`): nothing of it is stored.

        Args:
            trajectories: what to store (each with its tenant).
            vectors: their task texts' vectors, ``(n, dim)`` (default: embedded here).
            progress: called with the count of each batch stored.

        Returns:
            One result per trajectory, in order: ``added`` (with its cluster) or ``duplicate``.

        Raises:
            InvalidTrajectoryError: a trajectory is malformed (naming it and the field).
            IdConflictError: an id is stored, or repeated, with other content.
            StoreError: the store is read-only, closed or cannot be written.
        """
        started = time.monotonic()
        self._state.check_writable()
        trajectories = list(trajectories)
        check_trajectories(trajectories)
        if vectors is not None:
            vectors = unit_rows(vectors, len(trajectories), self.dim, "vectors")
        results: list[AddResult] = []
        size = self.config.evolution.batch_size
        for start in range(0, len(trajectories), size):
            chunk = trajectories[start : start + size]
            self._maintenance.raise_error()
            results.extend(self._ingest.add_batch(chunk, None if vectors is None else vectors[start : start + size]))
            if progress is not None:
                progress(len(chunk))
        self._maintenance.schedule()
        self._state.metrics.observe_latency("add", "engine", time.monotonic() - started)
        return caller_results(results)

    def add_items(self, items: list[BatchItem]) -> list[AddResult]:
        """:meth:`add_many` for prepared items (vectors included, see :func:`prepare_items`):
        the engine decides and commits, under the same id rules."""
        self._maintenance.raise_error()
        return caller_results(self._ingest.add_items(items))

    # -- removing and moving ---------------------------------------------------------------
    def remove(self, ids: Iterable[str], *, tenant: str = DEFAULT_TENANT) -> int:
        """Delete ``tenant``'s trajectories by id; returns how many were stored. Their clusters'
        counts, sums and R follow, a cluster left empty is retired, skills are queued for
        re-distillation when the cluster shrank enough, the index forgets the vectors; all in
        one transaction, durable when this returns. Unknown ids are ignored (idempotent).

        Args:
            ids: the trajectory ids.
            tenant: whose trajectories.

        Returns:
            How many of them were stored.
        """
        return self._parts.deletion.remove(ids, tenant=tenant)

    def purge_tenant(self, tenant: str) -> int:
        """Delete every trajectory of ``tenant`` (and so its clusters and skills), in bounded
        transactions; returns how many were removed. The intent is recorded durably first: a
        purge a crash interrupts is completed at the next writable open."""
        return self._parts.deletion.purge_tenant(tenant)

    def absorb(
        self,
        source: str | Path,
        cluster_ids: Sequence[int] | None = None,
        *,
        include_pending: bool = False,
        chunk: int = 2000,
    ) -> dict[str, int]:
        """Copy whole clusters from another store folder (a snapshot), keeping every id.

        Used to restore a snapshot into a deployment with another shard count: each
        cluster moves with all of its trajectories, vectors and its skill. Copies are
        idempotent (a trajectory already here is skipped), so a restore can be rerun.
        """
        return self._parts.transfer.absorb(source, cluster_ids, include_pending=include_pending, chunk=chunk)

    def export(self, path: str | Path) -> dict[str, Any]:
        """Trajectories as native JSONL (re-importable) to ``path``; clusters to ``<path stem>.clusters.jsonl``."""
        return self._parts.transfer.export(path)

    # -- maintenance -----------------------------------------------------------------------
    def maintain(self, max_ops: int | None = None) -> int:
        """Run queued splits, merges, skill distillations and description refreshes; returns
        how many ran. The queue lives in LMDB (written in the same transaction as the change
        that caused it), so work a crash interrupts is picked up at the next open."""
        return self._maintenance.maintain(max_ops)

    # -- retrieval -------------------------------------------------------------------------
    def retrieve(
        self,
        task: str,
        env: str | None,
        k: int | None = None,
        *,
        vector: Any = None,
        token_budget: int | None = None,
        skills: bool = True,
        tenant: str = DEFAULT_TENANT,
        as_of: str | None = None,
    ) -> Retrieval:
        """Top-k trajectories of ``tenant``'s ``env`` most similar to ``task``, plus the skills of their clusters.

        ``env=None`` searches every environment of the tenant (the unstructured-pool baseline
        the lifelong experiments compare against); ``skills=False`` leaves skills out;
        ``as_of`` (a token from :meth:`version`) sees only what was committed then.

        Args:
            task: the new task's text.
            env: its environment (None: every environment of the tenant).
            k: how many trajectories (default: ``retrieval.k``, 1-1024).
            vector: the task's vector (default: embedded here).
            token_budget: the most tokens of the rendered context (default: ``retrieval.token_budget``).
            skills: whether to include the clusters' skills.
            tenant: whose memory to read.
            as_of: a version token: read the memory as it was then.

        Returns:
            The trajectories (best first), the skills of their clusters and the rendered context.

        Raises:
            InvalidArgumentError: an argument out of its bounds, or ``as_of`` malformed or later
                than this memory's version (naming it).
        """
        return self.retrieve_many(
            [task],
            [env],
            k,
            vectors=None if vector is None else [vector],
            token_budget=token_budget,
            skills=skills,
            tenant=tenant,
            as_of=as_of,
        )[0]

    def retrieve_many(
        self,
        tasks: Sequence[str],
        envs: Sequence[str | None] | str,
        k: int | None = None,
        *,
        vectors: Any = None,
        token_budget: int | None = None,
        skills: bool = True,
        tenant: str = DEFAULT_TENANT,
        as_of: str | None = None,
    ) -> list[Retrieval]:
        """Many queries of one tenant in one embedding call and one batched index search
        (``None`` envs: every environment of the tenant; ``as_of``: a version, see :meth:`version`)."""
        started = time.monotonic()
        out = self._search.retrieve_many(
            tasks, envs, k, vectors=vectors, token_budget=token_budget, skills=skills, tenant=tenant, as_of=as_of
        )
        self._state.metrics.observe_latency("retrieve", "engine", time.monotonic() - started)
        return out

    def version(self) -> str:
        """The memory's version now: a token a later ``retrieve(..., as_of=token)`` is pinned
        to (it sees the trajectories committed before this call, whatever is written after).
        A version read after an add returned covers that add. See :mod:`lifemem_ray.engine.versions`.

        Example::

            >>> import tempfile
            >>> with Memory.open(tempfile.mkdtemp()) as m:
            ...     m.version()
            'v1:1'
        """
        return format_version([self._search.watermark()])

    # -- reading ---------------------------------------------------------------------------
    def get(self, trajectory_id: str, tenant: str = DEFAULT_TENANT) -> Trajectory | None:
        """``tenant``'s trajectory of this id, or None (another tenant's is not seen)."""
        return self._reads.get(trajectory_id, tenant)

    def cluster_of(self, trajectory_id: str, tenant: str = DEFAULT_TENANT) -> int | None:
        return self._reads.cluster_of(trajectory_id, tenant)

    def clusters(
        self, env: str | None = None, *, tenant: str | None = DEFAULT_TENANT, limit: int | None = None
    ) -> list[ClusterInfo]:
        """``tenant``'s live clusters, largest first; with ``env``, those holding trajectories of
        it (``tenant=None``: every tenant's, for administration); with ``limit``, only that many
        (the largest)."""
        return self._reads.clusters(env, tenant, limit)

    def cluster_count(self, env: str | None = None, *, tenant: str | None = DEFAULT_TENANT) -> int:
        """How many clusters :meth:`clusters` would list without a limit."""
        return self._reads.cluster_count(env, tenant)

    def members(self, cluster_id: int, tenant: str = DEFAULT_TENANT) -> list[str]:
        """The ids of a cluster of ``tenant`` ([] for a cluster of another tenant)."""
        return self._reads.members(cluster_id, tenant)

    def sizes(self) -> tuple[int, int]:
        """(trajectories, live clusters): two counters, cheap enough to read after every commit."""
        return self._reads.sizes()

    def __len__(self) -> int:
        return self._reads.count()

    # -- audit -----------------------------------------------------------------------------
    def stats(self, tenant: str | None = None) -> dict[str, Any]:
        """Counts per environment, cluster sizes, splits and merges, maintenance queued, LLM usage.
        ``tenant``: that tenant's data only; None: everything (for administration), with counts per tenant."""
        return self._parts.audit.stats(tenant)

    def verify(self, deep: bool = False) -> dict[str, Any]:
        """Check every invariant against a recomputation from the stored trajectories. ``deep``
        also recomputes every stored record's fingerprint from its content and compares it with
        the stored one and the id index (reads and decodes every record)."""
        return self._parts.audit.verify(deep=deep)

    # -- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        """Stop background work, save the index as a fresh cache, close the store; idempotent."""
        self._parts.close()

    def __enter__(self) -> Memory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
