"""What every part of the engine shares: the store, the live clusters and their centroids,
the vector index, the pending (not yet clustered) trajectories, and the lock that orders
changes to them. Opening a memory is building this state from its folder."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from lifemem_ray.core.decisions import Decider
from lifemem_ray.core.errors import StoreError
from lifemem_ray.core.metrics import MetricsSink, Recorder
from lifemem_ray.engine.clustering.centroids import ClusterCentroids
from lifemem_ray.engine.clustering.clusters import ClusterRecord, fold_member, needs_split
from lifemem_ray.engine.clustering.policy import OfflinePolicy
from lifemem_ray.engine.clustering.steps import FEATURES_VERSION, features_id
from lifemem_ray.engine.embedding import DIM as MINILM_DIM
from lifemem_ray.engine.embedding import Embedder
from lifemem_ray.engine.index.vector_index import VectorIndex
from lifemem_ray.engine.ingest_rules import make_decider
from lifemem_ray.engine.memory_config import MemoryConfig
from lifemem_ray.engine.store.migrate import LEGACY_FEATURES, migrate_features, stored_features
from lifemem_ray.engine.store.shared_log import open_shared_log
from lifemem_ray.engine.store.storage import MemoryStore

__all__ = ["MINILM_NAME", "WORKFLOW_DIM", "EngineState"]

log = logging.getLogger("lifemem_ray.engine.memory")

WORKFLOW_DIM = 256
MINILM_NAME = "all-MiniLM-L6-v2"


class EngineState:
    """One open memory's shared state. ``lock`` guards ``clusters``, ``pending``,
    ``initialised`` and the index against concurrent ingest and maintenance; the live
    view changes only after the transaction that made the change has committed."""

    def __init__(
        self,
        path: str | Path,
        config: MemoryConfig | None,
        *,
        embedder: Embedder | None,
        decider: Decider | None,
        dim: int | None,
        read_only: bool,
        namespace: int,
        metrics: MetricsSink | None = None,
    ) -> None:
        self.config = (config or MemoryConfig()).validate()
        self.metrics = Recorder(metrics)  # the engine's latency and its LLM decider's calls go to the injected sink
        self.path = Path(path)
        self._embedder = embedder
        self._owns_embedder = False  # True once this memory opened its own (see embedder)
        self.store = self._open_store(embedder, dim, read_only, namespace)
        self.dim = self.store.dim
        self.read_only = read_only
        self.policy = OfflinePolicy(self.config.policy)
        self.lock = threading.RLock()
        self.closed = False
        self.shrunk: dict[
            int, int
        ] = {}  # cluster id -> removals from it in this session (maintenance drops stale samples)
        self.schedule: Callable[[], None] = lambda: None  # set by the maintenance part: run or wake it after a change
        try:
            self.decider = decider if decider is not None else make_decider(self.config, metrics)
            self.features = self._open_features()
            self.load()
        except BaseException:
            self.store.close()
            raise
        self.usage_base = self.store.get_meta("llm_usage", default={}) or {}

    # -- opening ---------------------------------------------------------------------------
    def _open_store(self, embedder: Embedder | None, dim: int | None, read_only: bool, namespace: int) -> MemoryStore:
        if dim is None:
            dim = embedder.dim if embedder is not None else None
        embedder_name = embedder.name if embedder is not None else None
        store = self.config.store
        shared = (
            open_shared_log(store.shared_log_uri, store.shared_log_endpoint_url, owner=store.shared_log_owner)
            if not read_only
            else None
        )
        rebuilt = shared is not None and not shared.is_empty()  # the log holds the store: its meta says the dims
        if not (self.path / "data.mdb").exists() and dim is None and not rebuilt:
            dim = MINILM_DIM
            embedder_name = embedder_name or f"{MINILM_NAME}@{self.config.embedding.max_tokens}"
        return MemoryStore(
            self.path,
            dim=dim,
            workflow_dim=WORKFLOW_DIM,
            embedder=embedder_name,
            read_only=read_only,
            namespace=namespace,
            map_size_mb=store.map_size_mb,
            max_map_size_gb=store.max_map_size_gb,
            sync=store.sync,
            shared_log=shared,
        )

    def _open_features(self) -> str:
        """The workflow featurizer of this store: the config's (``evolution.workflow_features``).
        A store written by an older featurizer is migrated when opened for writing (see
        :mod:`lifemem_ray.engine.store.migrate`); one written with another featurizer is refused."""
        kind = self.config.evolution.workflow_features
        target = features_id(kind)
        stored = stored_features(self.store)
        if stored == target:
            return kind
        with self.store.read() as txn:
            empty = self.store.count_trajectories(txn) == 0
        stored_kind, _, version = stored.rpartition("-v")
        if not version.isdigit() or int(version) > FEATURES_VERSION:
            raise StoreError(
                f"{self.path}: workflow features {stored!r} come from a newer version of lifemem-ray (this one writes {target!r}); upgrade it"
            )
        if stored_kind != kind and stored != LEGACY_FEATURES and not empty:
            raise StoreError(
                f"{self.path}: the store's workflow features are {stored!r}, but evolution.workflow_features is {kind!r}; "
                f"set evolution.workflow_features = {stored_kind!r} to open it, or export it and ingest it into a new store"
            )
        if self.read_only:
            log.warning(
                "%s: workflow features %s are older than %s; searches are unaffected, and a writable open migrates them",
                self.path,
                stored,
                target,
            )
            return kind
        if empty:
            self.store.write(lambda txn: self.store.put_meta(txn, "workflow_features", target))
        else:
            migrate_features(self.store, kind, target, fold_member, self.needs_split, time.time())
        return kind

    def load(self) -> None:
        """Live clusters into memory; the FAISS index from its saved copy if fresh, else from LMDB."""
        clusters: dict[int, ClusterRecord] = {}
        with self.store.read() as txn:
            for record in self.store.iter_clusters(txn):
                if record.live:
                    clusters[record.id] = record
            self.initialised = bool(self.store.get_meta("initialised", txn))
            self.pending: list[int] = list(self.store.get_meta("pending", txn) or [])
            generation = int(self.store.get_meta("generation", txn))
            count = self.store.count_trajectories(txn)
            identity = self.store.index_identity(txn)
            # A read-only view is of this transaction's snapshot; a writer may move on meanwhile.
            self.generation = generation
            self.clusters = clusters
            self.centroids = ClusterCentroids(self.dim, WORKFLOW_DIM, self.config.policy.workflow_weight)
            self.centroids.update(clusters.values())
            loaded = VectorIndex.load(self.path / "index", self.dim, self.config.index, identity=identity)
            if loaded is not None and loaded[1] == generation and len(loaded[0]) == count:
                self.index = loaded[0]
                return
            self.index = self._build_index(txn)

    def _build_index(self, txn: Any) -> VectorIndex:
        """The vector index of everything stored, from LMDB (in ``txn``'s snapshot)."""
        index = VectorIndex(self.dim, self.config.index)
        names = {code: name for name, code in self.store.env_codes(txn).items()}
        by_env: dict[int, tuple[list[int], list[np.ndarray]]] = {}
        for vid, code, vec, _ in self.store.iter_vectors(txn):
            ids, vecs = by_env.setdefault(code, ([], []))
            ids.append(vid)
            vecs.append(vec)
            if len(ids) >= 65536:
                index.add(names[code], np.asarray(ids, dtype=np.int64), np.stack(vecs))
                by_env[code] = ([], [])
        for code, (ids, vecs) in by_env.items():
            if ids:
                index.add(names[code], np.asarray(ids, dtype=np.int64), np.stack(vecs))
        return index

    def refresh(self) -> None:
        """A read-only view follows the writer: when the store's generation moved on since
        this view was loaded, reload the clusters, pending list and index (from the writer's
        saved cache when it matches, else rebuilt from LMDB). A writer's view is always current."""
        if not self.read_only:
            return
        self.check_open()
        with self.lock:
            if self.store.generation() != self.generation:
                log.info(
                    "%s: the store moved on (generation %d -> %d); reloading the read-only view",
                    self.path,
                    self.generation,
                    self.store.generation(),
                )
                self.load()

    def save_index(self) -> None:
        """Save the index as a cache stamped with the store's generation and identity."""
        with self.store.read() as txn:
            generation = int(self.store.get_meta("generation", txn))
            identity = self.store.index_identity(txn)
        self.index.save(self.path / "index", generation, identity=identity)

    @property
    def embedder(self) -> Embedder:
        with self.lock:
            if self._embedder is None:
                from lifemem_ray.engine.embedding import open_embedder

                embedder = open_embedder(self.config.embedding)
                if embedder.dim != self.dim:
                    embedder.close()
                    raise StoreError(
                        f"{self.path}: the store holds {self.dim}-dimensional vectors; the embedding model gives {embedder.dim}"
                    )
                self._embedder = embedder
                self._owns_embedder = True
            return self._embedder

    def embedding_stats(self) -> dict[str, Any] | None:
        """The embedding service's figures (cache hit rate, model calls) once this memory embedded
        texts itself; None before, and for an embedder given by the caller that keeps none."""
        stats = getattr(self._embedder, "stats", None)
        return stats() if callable(stats) else None

    def close_embedder(self) -> None:
        """End the embedding service this memory opened (its batcher's thread); one the caller gave is theirs."""
        if self._owns_embedder and self._embedder is not None:
            close = getattr(self._embedder, "close", None)
            if callable(close):
                close()

    # -- shared helpers ----------------------------------------------------------------------
    @property
    def llm_mode(self) -> bool:
        return self.decider is not None

    def needs_split(self, record: ClusterRecord) -> bool:
        return needs_split(record, self.config.evolution)

    def check_open(self) -> None:
        if self.closed:
            raise StoreError(f"{self.path}: the memory is closed")

    def check_writable(self) -> None:
        self.check_open()
        if self.read_only:
            raise StoreError(f"{self.path}: opened read-only")

    def stored_cluster(self, cid: int) -> ClusterRecord | None:
        """A cluster's stored record, live or a tombstone."""
        with self.store.read() as txn:
            return self.store.get_cluster(txn, cid)

    def index_add(self, items: list[Any]) -> None:
        """Batch items (with their vids) into the vector index, one call per environment."""
        by_env: dict[str, list[Any]] = {}
        for it in items:
            by_env.setdefault(it.env, []).append(it)
        for env, group in by_env.items():
            self.index.add(
                env, np.asarray([it.vid for it in group], dtype=np.int64), np.stack([it.vec for it in group])
            )

    def add_counters(self, txn: Any, counts: dict[str, int]) -> None:
        """Add to the store's ``counters`` (stats) inside the caller's transaction."""
        totals = self.store.get_meta("counters", txn, {}) or {}
        for key, value in counts.items():
            totals[key] = totals.get(key, 0) + value
        self.store.put_meta(txn, "counters", totals)

    def usage_totals(self) -> dict[str, dict[str, float]] | None:
        """LLM usage so far: what the store recorded when opened plus this session's."""
        if self.decider is None:
            return None
        totals = {op: dict(v) for op, v in self.usage_base.items()}
        for op, values in self.decider.usage().items():
            slot = totals.setdefault(op, {})
            for key, value in values.items():
                if isinstance(value, (int, float)):
                    slot[key] = slot.get(key, 0) + value
        return totals
