"""The public engine: a LifeMem memory in one folder, usable without Ray.

``Memory.open(path)`` gives a store that survives crashes (LMDB), a FAISS index
rebuilt or reloaded from it, and the LifeMem algorithm on top: initialise,
evolve, split, distil, retrieve. Every batch of adds is one write transaction;
an add is acknowledged (returned) only after that transaction is on disk.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from .centroids import ClusterCentroids
from .config import MemoryConfig
from .decisions import ClusterView, Decider
from .embedding import DIM as MINILM_DIM, Embedder
from .evolution import MAX_FLOWS, BatchItem, BatchPlanner, CandidateArrays, CandidateSet, ItemBatch, Placement, _cos, add_member, fold_member, new_cluster_record
from .index import VectorIndex
from .model import Trajectory
from .migrate import LEGACY_FEATURES, migrate_features, stored_features
from .policy import OfflinePolicy
from .retrieval import Retrieval, assemble, paused_gc
from .storage import ClusterRecord, MemoryStore, StoreError, pack_u64, record_to_trajectory
from .steps import FEATURES_VERSION, featurize, features_id
from .workflow import workflow_summary
from .errors import IdConflictError, MaintenanceError, UnknownClusterError

__all__ = ["AddResult", "ClusterInfo", "IdConflictError", "Memory", "UnknownClusterError", "known_ids", "pack_trajectories", "prepare_items"]

log = logging.getLogger(__name__)

WORKFLOW_DIM = 256
MERGE_CANDIDATES = 4  # nearest clusters (by the policy's centroid score) a cluster may merge with
MINILM_NAME = "all-MiniLM-L6-v2"


@dataclass(frozen=True, slots=True)
class AddResult:
    id: str
    status: str  # added | duplicate | pending (stored, waiting for the initial partition)
    cluster_id: int | None

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "status": self.status, "cluster_id": self.cluster_id}


@dataclass(frozen=True)
class ClusterInfo:
    id: int
    count: int
    envs: dict[str, int]
    description: str
    skill: str
    mrl: float
    born: str
    parent: int | None
    successes: int
    failures: int
    flows: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, record: ClusterRecord) -> "ClusterInfo":
        top = dict(sorted(record.flows.items(), key=lambda kv: -kv[1])[:5])
        return cls(
            id=record.id,
            count=record.count,
            envs=dict(record.envs),
            description=record.description,
            skill=record.skill,
            mrl=round(record.mrl, 6),
            born=record.born,
            parent=record.parent,
            successes=record.successes,
            failures=record.failures,
            flows=top,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "count": self.count,
            "envs": self.envs,
            "description": self.description,
            "skill": self.skill,
            "mrl": self.mrl,
            "born": self.born,
            "parent": self.parent,
            "successes": self.successes,
            "failures": self.failures,
            "flows": self.flows,
        }


def _unit(vec: np.ndarray) -> np.ndarray:
    norm = float(np.linalg.norm(vec))
    return (vec / norm if norm > 0 else vec).astype(np.float32)


def _unit_rows(vectors: Any, n: int, dim: int, what: str) -> np.ndarray:
    """Validated, L2-normalised float32 (n, dim) vectors, or a clear error."""
    try:
        arr = np.asarray(vectors, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what}: not numeric ({exc})") from None
    if arr.ndim == 1 and n == 1:
        arr = arr[None, :]
    if arr.shape != (n, dim):
        raise ValueError(f"{what}: expected shape ({n}, {dim}), got {tuple(arr.shape)}")
    if not np.isfinite(arr).all():
        bad = int(np.argwhere(~np.isfinite(arr))[0][0])
        raise ValueError(f"{what}[{bad}]: contains NaN or infinity")
    norms = np.linalg.norm(arr, axis=1)
    if (norms == 0).any():
        raise ValueError(f"{what}[{int(np.argmin(norms))}]: zero vector")
    return np.ascontiguousarray(arr / norms[:, None], dtype=np.float32)


class Memory:
    """A LifeMem memory stored in one folder. Thread-safe; one writer process per folder."""

    def __init__(
        self,
        path: str | Path,
        config: MemoryConfig | None = None,
        *,
        embedder: Embedder | None = None,
        decider: Decider | None = None,
        dim: int | None = None,
        read_only: bool = False,
        namespace: int = 0,
    ) -> None:
        self.config = (config or MemoryConfig()).validate()
        self.path = Path(path)
        self._embedder = embedder
        if dim is None:
            dim = embedder.dim if embedder is not None else None
        embedder_name = embedder.name if embedder is not None else None
        exists = (self.path / "data.mdb").exists()
        if not exists and dim is None:
            dim = MINILM_DIM
            embedder_name = embedder_name or f"{MINILM_NAME}@{self.config.embedding.max_tokens}"
        self.store = MemoryStore(
            self.path,
            dim=dim,
            workflow_dim=WORKFLOW_DIM,
            embedder=embedder_name,
            read_only=read_only,
            namespace=namespace,
            map_size_mb=self.config.store.map_size_mb,
            max_map_size_gb=self.config.store.max_map_size_gb,
            sync=self.config.store.sync,
        )
        self.dim = self.store.dim
        self.read_only = read_only
        self.policy = OfflinePolicy(self.config.policy)
        self._lock = threading.RLock()
        self._maintenance_lock = threading.Lock()  # one maintenance pass at a time
        self._closed = False
        try:
            self.decider = decider if decider is not None else self._default_decider()
            self.features = self._open_features()
            self._load_state()
        except BaseException:
            self.store.close()
            raise
        self._usage_base = self.store.get_meta("llm_usage", default={}) or {}
        self._maintainer: threading.Thread | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._maintenance_error: BaseException | None = None
        if not read_only:
            if self.config.evolution.background_maintenance:
                self._maintainer = threading.Thread(target=self._maintenance_loop, name="lifemem-maintenance", daemon=True)
                self._maintainer.start()
                self._wake.set()
            else:
                self.maintain()  # finish work a crash may have left queued

    # -- opening ---------------------------------------------------------------------------
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
    ) -> "Memory":
        """Open (or create) the memory in ``path``.

        ``dim`` sets the vector size of a new store fed with precomputed vectors;
        by default it is the embedding model's (384). ``namespace`` (set when a store is
        created) keeps its trajectory and cluster ids apart from other shards' stores.
        """
        return cls(path, config, embedder=embedder, decider=decider, dim=dim, read_only=read_only, namespace=namespace)

    def _default_decider(self) -> Decider | None:
        if self.config.llm.backend == "openai":
            from .llm import LLMDecider

            return LLMDecider(self.config.llm)
        return None

    def _open_features(self) -> str:
        """The workflow featurizer of this store: the config's (``evolution.workflow_features``).
        A store written by an older featurizer is migrated when opened for writing (see
        :mod:`lifemem_ray.migrate`); one written with another featurizer is refused."""
        kind = self.config.evolution.workflow_features
        target = features_id(kind)
        stored = stored_features(self.store)
        if stored == target:
            return kind
        with self.store.read() as txn:
            empty = self.store.count_trajectories(txn) == 0
        stored_kind, _, version = stored.rpartition("-v")
        if not version.isdigit() or int(version) > FEATURES_VERSION:
            raise StoreError(f"{self.path}: workflow features {stored!r} come from a newer version of lifemem-ray (this one writes {target!r}); upgrade it")
        if stored_kind != kind and stored != LEGACY_FEATURES and not empty:
            raise StoreError(f"{self.path}: the store's workflow features are {stored!r}, but evolution.workflow_features is {kind!r}; "
                             f"set evolution.workflow_features = {stored_kind!r} to open it, or export it and ingest it into a new store")
        if self.read_only:
            log.warning("%s: workflow features %s are older than %s; searches are unaffected, and a writable open migrates them", self.path, stored, target)
            return kind
        if empty:
            self.store.write(lambda txn: self.store.put_meta(txn, "workflow_features", target))
        else:
            migrate_features(self.store, kind, target, fold_member, self._needs_split, time.time())
        return kind

    def _load_state(self) -> None:
        """Live clusters into memory; the FAISS index from its saved copy if fresh, else from LMDB."""
        clusters: dict[int, ClusterRecord] = {}
        with self.store.read() as txn:
            for record in self.store.iter_clusters(txn):
                if record.live:
                    clusters[record.id] = record
            self._initialised = bool(self.store.get_meta("initialised", txn))
            self._pending: list[int] = list(self.store.get_meta("pending", txn) or [])
            generation = int(self.store.get_meta("generation", txn))
            count = self.store.count_trajectories(txn)
        self._clusters = clusters
        self._centroids = ClusterCentroids(self.dim, WORKFLOW_DIM, self.config.policy.workflow_weight)
        self._centroids.update(clusters.values())
        loaded = VectorIndex.load(self.path / "index", self.dim, self.config.index)
        if loaded is not None and loaded[1] == generation and len(loaded[0]) == count:
            self.index = loaded[0]
            return
        self.index = VectorIndex(self.dim, self.config.index)
        with self.store.read() as txn:
            names = {code: name for name, code in self.store.env_codes(txn).items()}
            by_env: dict[int, tuple[list[int], list[np.ndarray]]] = {}
            for vid, code, vec, _ in self.store.iter_vectors(txn):
                ids, vecs = by_env.setdefault(code, ([], []))
                ids.append(vid)
                vecs.append(vec)
                if len(ids) >= 65536:
                    self.index.add(names[code], np.asarray(ids, dtype=np.int64), np.stack(vecs))
                    by_env[code] = ([], [])
            for code, (ids, vecs) in by_env.items():
                if ids:
                    self.index.add(names[code], np.asarray(ids, dtype=np.int64), np.stack(vecs))

    @property
    def embedder(self) -> Embedder:
        with self._lock:
            if self._embedder is None:
                from .embedding import MiniLMEmbedder

                embedder = MiniLMEmbedder(self.config.embedding)
                if embedder.dim != self.dim:
                    raise StoreError(f"{self.path}: the store holds {self.dim}-dimensional vectors; the embedding model gives {embedder.dim}")
                self._embedder = embedder
            return self._embedder

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
        task texts; without them the embedding model computes them.
        """
        self._check_writable()
        trajectories = list(trajectories)
        for i, traj in enumerate(trajectories):
            if not isinstance(traj, Trajectory):
                raise TypeError(f"trajectories[{i}]: expected a Trajectory, got {type(traj).__name__}")
        if vectors is not None:
            vectors = _unit_rows(vectors, len(trajectories), self.dim, "vectors")
        results: list[AddResult] = []
        size = self.config.evolution.batch_size
        for start in range(0, len(trajectories), size):
            chunk = trajectories[start : start + size]
            chunk_vecs = None if vectors is None else vectors[start : start + size]
            results.extend(self._add_batch(chunk, chunk_vecs))
            if progress is not None:
                progress(len(chunk))
        if self._maintainer is not None:
            self._wake.set()
        else:
            self.maintain()
        return results

    def _add_batch(self, trajectories: list[Trajectory], vectors: np.ndarray | None) -> list[AddResult]:
        with self._lock:
            self._raise_maintenance_error()
            results, fresh = self.check_ids(trajectories)
            if fresh:
                items = self.prepare([trajectories[i] for i in fresh], None if vectors is None else vectors[fresh])
                for i, result in zip(fresh, self._place(items)):
                    results[i] = result
            return self._fill_batch_duplicates(trajectories, results)

    # -- the ingest pipeline, in stages (the Ray coordinator runs them across shards) ---------
    def check_ids(self, trajectories: Sequence[Trajectory], *, raise_conflicts: bool = True) -> tuple[list[AddResult | None], list[int]]:
        """Results for ids already stored (duplicates) and the positions of the new ones.

        Raises :class:`IdConflictError` when an id is stored, or repeated in the batch,
        with other content: then nothing of the batch may be stored. With
        ``raise_conflicts=False`` such ids get a result with status ``conflict`` instead.
        """
        results: list[AddResult | None] = [None] * len(trajectories)
        fresh: list[int] = []
        first_of: dict[str, int] = {}
        conflicts: list[str] = []
        with self.store.read() as txn:
            for i, traj in enumerate(trajectories):
                if traj.id in first_of:
                    if trajectories[first_of[traj.id]].fingerprint != traj.fingerprint:
                        conflicts.append(traj.id)
                    continue
                first_of[traj.id] = i
                vid = self.store.lookup_id(txn, traj.id)
                if vid is None:
                    fresh.append(i)
                elif self.store.fingerprint_of(txn, vid) != traj.fingerprint:
                    conflicts.append(traj.id)
                    results[i] = AddResult(traj.id, "conflict", self.store.cluster_of(txn, vid))
                else:
                    results[i] = AddResult(traj.id, "duplicate", self.store.cluster_of(txn, vid))
        if conflicts and raise_conflicts:
            shown = ", ".join(repr(c) for c in conflicts[:5])
            raise IdConflictError(
                f"{len(conflicts)} trajectory id(s) already stored (or repeated in this batch) with different content: {shown}; "
                "nothing of this batch was stored"
            )
        return results, fresh

    @staticmethod
    def _fill_batch_duplicates(trajectories: Sequence[Trajectory], results: list[AddResult | None]) -> list[AddResult]:
        """Repeats inside one batch point at the first occurrence's result."""
        first: dict[str, AddResult] = {}
        out = []
        for traj, result in zip(trajectories, results):
            if result is None:
                got = first[traj.id]
                result = AddResult(traj.id, "duplicate", got.cluster_id)
            first.setdefault(traj.id, result)
            out.append(result)
        return out

    def check_features(self, features: str) -> None:
        """Refuse items whose workflow vectors another featurizer computed (a client whose
        ``evolution.workflow_features`` differs from this store's)."""
        if features != self.features:
            raise ValueError(f"{self.path}: items carry {features!r} workflow vectors, this store holds {self.features!r} ones; "
                             f"set evolution.workflow_features = {self.features!r} where the trajectories are packed")

    def prepare(self, trajectories: Sequence[Trajectory], vectors: np.ndarray | None = None) -> list[BatchItem]:
        """Batch items: task vectors (embedded here when not given), action tokens, workflow vectors."""
        if vectors is None:
            vectors = self.embedder.embed([t.query_text for t in trajectories])
        return prepare_items(trajectories, vectors, self.dim, self.features)

    def add_items(self, items: list[BatchItem]) -> list[AddResult]:
        """:meth:`add_many` for prepared items (vectors included): the engine decides and commits."""
        self._check_writable()
        with self._lock:
            results = known_ids(self.store, [it.id for it in items], [it.fingerprint for it in items])
            seen: dict[str, int] = {}
            fresh = []
            for i, (it, got) in enumerate(zip(items, results)):
                if got is None and it.id not in seen:
                    seen[it.id] = i
                    fresh.append(i)
            if fresh:
                for i, result in zip(fresh, self._place([items[i] for i in fresh])):
                    results[i] = result
            for i, it in enumerate(items):
                if results[i] is None:
                    results[i] = AddResult(it.id, "duplicate", results[seen[it.id]].cluster_id)  # type: ignore[union-attr]
        if self._maintainer is not None:
            self._wake.set()
        else:
            self.maintain()
        return results  # type: ignore[return-value]

    @property
    def initialised(self) -> bool:
        return self._initialised

    def _place(self, items: list[BatchItem]) -> list[AddResult]:
        init_count = 0
        if not self._initialised:
            need = self.config.evolution.init_size - len(self._pending)
            if len(items) < need:
                return self._commit_pending(items)
            # The initial partition: everything pending plus enough of this batch.
            items = self._pending_items() + items
            init_count = len(self._pending) + need
        found = self.candidates(items[init_count:])
        planner = BatchPlanner(
            found.clusters,
            self.policy,
            self.config.evolution,
            dim=self.dim,
            wdim=WORKFLOW_DIM,
            decider=self.decider,
            llm_config=self.config.llm,
        )
        plan = planner.plan(
            items,
            [[]] * init_count + found.neighbours,
            init_count=init_count,
            extra=[[]] * init_count + [[c for c, _ in row] for row in found.extra],
        )
        counters = {"llm_requests": plan.llm_requests, "llm_fallbacks": plan.llm_fallbacks, "llm_skipped": plan.llm_skipped}
        return self.commit(items, plan.placements, initialise=bool(init_count), counters=counters)

    def candidates(self, items: Sequence[BatchItem]) -> CandidateSet:
        """For each item: (cluster id, similarity) of its top-k stored neighbours, and further
        candidates by the policy's score over all cluster centroids (see
        ``evolution.neighbour_scope``); plus the state of every cluster named."""
        if not items:
            return CandidateSet(neighbours=[], extra=[], clusters={})
        return self.candidates_for(np.stack([it.vec for it in items]), np.stack([it.wvec for it in items]), [it.env for it in items])

    def candidates_for(self, vectors: np.ndarray, workflow_vectors: np.ndarray, envs: Sequence[str]) -> CandidateSet:
        """:meth:`candidates` from the vectors alone."""
        return self.candidate_arrays(vectors, workflow_vectors, envs).to_set()

    def candidate_arrays(self, vectors: np.ndarray, workflow_vectors: np.ndarray, envs: Sequence[str]) -> CandidateArrays:
        """:meth:`candidates_for` as arrays (what a shard sends the coordinator)."""
        evo = self.config.evolution
        n = len(vectors)
        queries = np.asarray(vectors, dtype=np.float32)
        extra_ids, extra_scores = np.zeros((n, 0), np.int64), np.zeros((n, 0), np.float32)
        with self._lock:
            if n and evo.centroid_candidates:
                combined = self._centroids.query(queries, np.asarray(workflow_vectors, dtype=np.float32))
                extra_ids, extra_scores = self._centroids.search(combined, evo.centroid_candidates)
            if n and evo.neighbour_scope == "env":
                scores, vids = self.index.search_envs(queries, evo.top_k, list(envs),
                                                      nprobe_fraction=self.config.index.candidate_nprobe_fraction,
                                                      max_codes=self.config.index.candidate_max_codes)
            elif n and len(self.index):
                scores, vids = self.index.search(queries, evo.top_k)
            else:
                scores, vids = np.zeros((n, 0), np.float32), np.zeros((n, 0), dtype=np.int64)
            # Each distinct neighbour's cluster once (near-duplicate queries share neighbours).
            unique, inverse = np.unique(vids, return_inverse=True)
            cluster_of = np.full(len(unique), -1, dtype=np.int64)
            with self.store.read() as txn:
                for j, vid in enumerate(unique.tolist()):
                    if vid >= 0:
                        cid = self.store.cluster_of(txn, vid)
                        if cid is not None and cid in self._clusters:
                            cluster_of[j] = cid
            ids = cluster_of[inverse.reshape(vids.shape)] if vids.size else np.zeros(vids.shape, np.int64)
            scores = np.where(ids >= 0, scores, np.float32(-np.inf)).astype(np.float32, copy=False)
            named = np.unique(np.concatenate([ids.ravel(), extra_ids.ravel()])).tolist()
            clusters = {cid: self._clusters[cid] for cid in named if cid in self._clusters}
        return CandidateArrays(ids, scores, extra_ids, extra_scores, clusters)

    def _pending_items(self) -> list[BatchItem]:
        items = []
        with self.store.read() as txn:
            for vid in self._pending:
                got = self.store.trajectory(txn, vid)
                vecs = self.store.vectors(txn, vid)
                if got is None or vecs is None:
                    raise StoreError(f"{self.path}: pending trajectory {vid} is missing; run `lifemem-ray check`")
                traj, extra = got
                _, vec, wvec = vecs
                tokens = list(extra["tokens"])
                items.append(BatchItem.of(traj, vec.copy(), wvec.copy(), tokens, workflow_summary(tokens), vid=vid, stored=True))
        return items

    def _commit_pending(self, items: list[BatchItem]) -> list[AddResult]:
        """Before initialisation: store and index, leave unclustered until enough have arrived."""
        now = time.time()

        def write(txn: Any) -> None:
            for it, vid in zip(items, self.store.allocate_vids(txn, len(items))):
                it.vid = vid
                self.store.put_item(txn, it, self.store.env_code(txn, it.env), None)
            self.store.put_meta(txn, "pending", self._pending + [it.vid for it in items])
            self.store.append_log(txn, [{"vid": it.vid, "id": it.id, "op": "pending", "t": now} for it in items])

        self.store.write(write)
        self._pending = self._pending + [it.vid for it in items]
        self._index_add(items)
        return [AddResult(it.id, "pending", None) for it in items]

    def commit(
        self,
        items: list[BatchItem],
        placements: Sequence[Placement],
        *,
        initialise: bool = False,
        counters: dict[str, int] | None = None,
    ) -> list[AddResult]:
        """Store decided placements in one transaction and return once it is durable.

        A placement names a live cluster, or a negative id: items with the same
        negative id open one new cluster together. A cluster split since the decision
        was made is resolved to its best-scoring live part. Items marked ``stored``
        (waiting for initialisation) only get their cluster.
        """
        self._check_writable()
        with self._lock:  # against the maintenance thread's splits and skill updates
            return self._commit(items, placements, initialise, counters)

    def _commit(
        self, items: list[BatchItem], placements: Sequence[Placement], initialise: bool, counters: dict[str, int] | None
    ) -> list[AddResult]:
        now = time.time()
        llm_mode = self.decider is not None
        targets = [self._resolve_target(p.cluster, it) for it, p in zip(items, placements)]
        # Cluster states after this batch, recomputed from the authoritative live state.
        work: dict[int, ClusterRecord] = {}
        founders: dict[int, int] = {}
        for i, (it, cid) in enumerate(zip(items, targets)):
            founders.setdefault(cid, i)
            record = work.get(cid)
            if record is None:
                base = self._clusters.get(cid)
                born = "init" if placements[i].op == "init" else "new"
                record = base.copy() if base is not None else new_cluster_record(cid, self.dim, WORKFLOW_DIM, born, now)
                work[cid] = record
            add_member(record, it, now)
        provisional = sorted((c for c in work if c < 0), reverse=True)
        usage_total = self._usage_totals()
        fresh = [it for it in items if not it.stored]

        def write(txn: Any) -> dict[int, int]:
            for it, vid in zip(fresh, self.store.allocate_vids(txn, len(fresh))):
                it.vid = vid
            real = dict(zip(provisional, self.store.next_cluster_ids(txn, len(provisional))))
            final: dict[int, ClusterRecord] = {}
            for cid, state in work.items():
                record = state.copy()
                record.id = real.get(cid, cid)
                founder = founders[cid]
                described = placements[founder].description
                if cid < 0 and described:
                    record.description, record.description_by, record.description_n = described, "llm", record.count
                elif record.description_by != "llm" or not record.description:
                    # Offline descriptions are cheap: refreshed on every change. description_n
                    # only schedules LLM descriptions, so it is left alone here.
                    example = items[founder].query if cid < 0 else self._example_task(record)
                    record.description = self.policy.describe(record.count, record.envs, record.flows, example, record.skill)
                    record.description_by = "offline"
                self.store.put_cluster(txn, record)
                self.store.add_todo(
                    txn,
                    record.id,
                    split=self._needs_split(record),
                    skill=self._needs_skill(record),
                    describe=llm_mode and self._needs_description(record),
                    merge=self.config.evolution.merge_ratio > 0,
                )
                final[cid] = record
            entries = []
            for i, (it, p, cid) in enumerate(zip(items, placements, targets)):
                real_id = real.get(cid, cid)
                if it.stored:
                    self.store.set_cluster_of(txn, it.vid, real_id)
                else:
                    self.store.put_item(txn, it, self.store.env_code(txn, it.env), real_id)
                op = "new" if (cid < 0 and founders[cid] == i and p.op == "join") else p.op
                entries.append({"vid": it.vid, "id": it.id, "cluster": real_id, "op": op, "by": p.by, "score": round(p.score, 4), "t": now})
            self.store.append_log(txn, entries)
            if initialise:
                self.store.put_meta(txn, "pending", [])
                self.store.put_meta(txn, "initialised", True)
            if counters:
                totals = self.store.get_meta("counters", txn, {}) or {}
                for key, value in counters.items():
                    totals[key] = totals.get(key, 0) + value
                self.store.put_meta(txn, "counters", totals)
            if usage_total is not None:
                self.store.put_meta(txn, "llm_usage", usage_total)
            work.clear()
            work.update(final)
            return real

        real = self.store.write(write)
        # Committed: now the in-memory view may change.
        for record in work.values():
            self._clusters[record.id] = record
        self._centroids.update(work.values())
        if initialise:
            self._pending = []
            self._initialised = True
        self._index_add(fresh)
        return [AddResult(it.id, "added", real.get(cid, cid)) for it, cid in zip(items, targets) if not it.stored]

    def _resolve_target(self, cid: int, item: BatchItem) -> int:
        """A live cluster for a decided id: itself, or the best part of a cluster split since."""
        seen = 0
        while cid > 0 and cid not in self._clusters:
            with self.store.read() as txn:
                record = self.store.get_cluster(txn, cid)
            if record is None or not record.split_into or seen > 32:
                raise UnknownClusterError(f"{self.path}: cluster {cid} is not stored here")
            parts = [self._clusters[c] for c in record.split_into if c in self._clusters] or [
                self.store_cluster(c) for c in record.split_into
            ]
            parts = [p for p in parts if p is not None]
            if not parts:
                raise UnknownClusterError(f"{self.path}: cluster {cid} was split and none of its parts is live")
            cid = max(parts, key=lambda r: self.policy.score(_cos(item.vec, r.tsum), _cos(item.wvec, r.wsum))).id
            seen += 1
        return cid

    def store_cluster(self, cid: int) -> ClusterRecord | None:
        with self.store.read() as txn:
            return self.store.get_cluster(txn, cid)

    def _index_add(self, items: list[BatchItem]) -> None:
        by_env: dict[str, list[BatchItem]] = {}
        for it in items:
            by_env.setdefault(it.env, []).append(it)
        for env, group in by_env.items():
            self.index.add(env, np.asarray([it.vid for it in group], dtype=np.int64), np.stack([it.vec for it in group]))

    def _needs_split(self, record: ClusterRecord) -> bool:
        evo = self.config.evolution
        return record.count > evo.split_min_size and record.mrl < evo.split_mrl_threshold and record.count >= record.no_split_until

    def _needs_skill(self, record: ClusterRecord) -> bool:
        """Every cluster has a skill from its creation on. With an LLM, a cluster gets an LLM
        skill once it has ``llm.min_cluster_size`` members, then again each time it has grown
        by ``evolution.skill_refresh_growth`` (the paper's budget: few, well-fed calls)."""
        if record.skill_n == 0:
            return True
        if self.decider is not None and record.skill_by == "offline" and record.count >= self.config.llm.min_cluster_size:
            return True
        return record.count >= record.skill_n * (1.0 + self.config.evolution.skill_refresh_growth)

    def _needs_description(self, record: ClusterRecord) -> bool:
        """With an LLM: describe a cluster once it has ``llm.min_cluster_size`` members, then
        each time it has grown by ``description_refresh_growth`` since the last attempt."""
        return record.count >= max(float(self.config.llm.min_cluster_size), record.description_n * (1.0 + self.config.evolution.description_refresh_growth))

    @staticmethod
    def _example_task(record: ClusterRecord) -> str:
        return record.description.partition("Example goal: ")[2]

    # -- removing --------------------------------------------------------------------------
    def remove(self, ids: Iterable[str]) -> int:
        """Delete trajectories by id; their clusters' counts and sums follow. Unknown ids are ignored."""
        self._check_writable()
        ids = list(dict.fromkeys(ids))
        with self._lock:
            now = time.time()
            found: list[tuple[int, str, Trajectory, list[str], np.ndarray, np.ndarray, int | None]] = []
            with self.store.read() as txn:
                for tid in ids:
                    vid = self.store.lookup_id(txn, tid)
                    if vid is None:
                        continue
                    got = self.store.trajectory(txn, vid)
                    vecs = self.store.vectors(txn, vid)
                    assert got is not None and vecs is not None
                    found.append((vid, tid, got[0], got[1]["tokens"], vecs[1].copy(), vecs[2].copy(), self.store.cluster_of(txn, vid)))
            if not found:
                return 0
            touched: dict[int, ClusterRecord] = {}
            for vid, tid, traj, tokens, vec, wvec, cid in found:
                if cid is None or cid not in self._clusters:
                    continue
                record = touched.get(cid) or self._clusters[cid].copy()
                touched[cid] = record
                _remove_member(record, traj, vec, wvec, workflow_summary(tokens), now)
            removed_vids = {f[0] for f in found}
            pending = [v for v in self._pending if v not in removed_vids]

            def write(txn: Any) -> None:
                for vid, tid, *_ in found:
                    self.store.delete_trajectory(txn, vid, tid)
                for record in touched.values():
                    self.store.put_cluster(txn, record)
                    if record.count == 0:
                        self.store.clear_todo(txn, record.id)
                self.store.put_meta(txn, "pending", pending)
                self.store.append_log(txn, [{"vid": f[0], "id": f[1], "cluster": f[6], "op": "remove", "t": now} for f in found])

            self.store.write(write)
            for record in touched.values():
                if record.count == 0:
                    self._clusters.pop(record.id, None)
                else:
                    self._clusters[record.id] = record
            self._centroids.update(touched.values())
            self._pending = pending
            self.index.remove(np.asarray(sorted(removed_vids), dtype=np.int64))
            return len(found)

    # -- moving clusters between stores ------------------------------------------------------
    def absorb(self, source: str | Path, cluster_ids: Sequence[int] | None = None, *, include_pending: bool = False, chunk: int = 2000) -> dict[str, int]:
        """Copy whole clusters from another store folder (a snapshot), keeping every id.

        Used to restore a snapshot into a deployment with another shard count: each
        cluster moves with all of its trajectories, vectors and its skill. Copies are
        idempotent (a trajectory already here is skipped), so a restore can be rerun.
        """
        self._check_writable()
        src = MemoryStore(source, read_only=True)
        try:
            if src.dim != self.dim or src.workflow_dim != WORKFLOW_DIM:
                raise StoreError(f"{source}: vectors of {src.dim}/{src.workflow_dim} dimensions cannot join a store of {self.dim}/{WORKFLOW_DIM}")
            with src.read() as stxn:
                names = {code: name for name, code in src.env_codes(stxn).items()}
                wanted = list(cluster_ids) if cluster_ids is not None else [r.id for r in src.iter_clusters(stxn) if r.live]
                records = []
                for cid in wanted:
                    record = src.get_cluster(stxn, cid)
                    if record is None or not record.live:
                        raise StoreError(f"{source}: cluster {cid} is not a live cluster there")
                    records.append((record, src.members(stxn, cid)))
                pending = list(src.get_meta("pending", stxn) or []) if include_pending else []
                initialised = bool(src.get_meta("initialised", stxn))
                counters = src.get_meta("counters", stxn, {}) or {}
            moved = {"clusters": 0, "trajectories": 0, "skipped": 0}
            mask = (1 << 40) - 1
            top_vid = 0
            with self._lock:
                work: list[tuple[int | None, int]] = [(rec.id, vid) for rec, members in records for vid in members] + [(None, v) for v in pending]
                for start in range(0, len(work), chunk):
                    part = work[start : start + chunk]
                    with src.read() as stxn:
                        rows = []
                        for cid, vid in part:
                            key = pack_u64(vid)
                            raw_traj = stxn.get(key, db=src.db["traj"])
                            raw_vec = stxn.get(key, db=src.db["vec"])
                            raw_brief = stxn.get(key, db=src.db["brief"])
                            if raw_traj is None or raw_vec is None:
                                raise StoreError(f"{source}: trajectory {vid} of cluster {cid} is missing")
                            tid = record_to_trajectory(raw_traj)[0].id
                            rows.append((cid, vid, tid, raw_traj, raw_vec, raw_brief))

                    def write(txn: Any) -> int:
                        skipped = 0
                        for cid, vid, tid, raw_traj, raw_vec, raw_brief in rows:
                            if self.store.lookup_id(txn, tid) is not None:
                                skipped += 1
                                continue
                            key = pack_u64(vid)
                            if txn.get(key, db=self.store.db["traj"]) is not None:
                                raise StoreError(f"{self.path}: trajectory id {vid} is taken here by another trajectory")
                            code, vec, wvec = src.unpack_vectors(raw_vec)
                            txn.put(key, raw_traj, db=self.store.db["traj"])
                            txn.put(tid.encode("utf-8"), key, db=self.store.db["tid"])
                            txn.put(key, self.store.pack_vectors(self.store.env_code(txn, names[code]), vec, wvec), db=self.store.db["vec"])
                            if raw_brief is not None:
                                txn.put(key, raw_brief, db=self.store.db["brief"])
                            if cid is not None:
                                self.store.set_cluster_of(txn, vid, cid)
                        return skipped

                    moved["skipped"] += self.store.write(write)
                    moved["trajectories"] += len(part)
                    for _, vid in part:
                        top_vid = max(top_vid, vid & mask)
                now = time.time()

                def finish(txn: Any) -> None:
                    for record, members in records:
                        self.store.put_cluster(txn, record)
                        if not record.skill:
                            self.store.add_todo(txn, record.id, skill=True)
                    if pending:
                        self.store.put_meta(txn, "pending", list(dict.fromkeys((self.store.get_meta("pending", txn) or []) + pending)))
                    if initialised and not pending:
                        self.store.put_meta(txn, "initialised", True)
                    self.store.advance_sequences(txn, top_vid, max([r.id & mask for r, _ in records], default=0))
                    totals = self.store.get_meta("counters", txn, {}) or {}
                    totals["splits"] = totals.get("splits", 0) + int(counters.get("splits", 0))
                    self.store.put_meta(txn, "counters", totals)
                    self.store.append_log(txn, [{"cluster": r.id, "op": "absorb", "from": str(source), "n": r.count, "t": now} for r, _ in records])

                self.store.write(finish)
                moved["clusters"] = len(records)
                self._load_state()
        finally:
            src.close()
        return moved

    # -- maintenance: splits, skills, descriptions ------------------------------------------
    def maintain(self, max_ops: int | None = None) -> int:
        """Run queued splits, skill distillations and description refreshes; returns how many ran.

        The queue lives in LMDB (written in the same transaction as the change that
        caused it), so work a crash interrupts is picked up at the next open.
        """
        if self.read_only or self._closed:
            return 0
        with self._maintenance_lock:
            done = 0
            while max_ops is None or done < max_ops:
                with self.store.read() as txn:
                    todos = self.store.todos(txn)
                if not todos:
                    break
                before = done
                cleared: list[tuple[int, tuple[str, ...]]] = []
                for cid, flags in sorted(todos.items()):
                    if not flags.get("split") or (max_ops is not None and done >= max_ops):
                        continue
                    if self._stopping():
                        return done
                    record = self._clusters.get(cid)
                    if record is not None and self._needs_split(record) and self._split(cid):
                        done += 1  # the children carry their own todos; the parent's are gone
                    else:
                        cleared.append((cid, ("split",)))
                with self.store.read() as txn:
                    todos = self.store.todos(txn)
                for cid, flags in sorted(todos.items()):
                    if not flags.get("merge") or (max_ops is not None and done >= max_ops):
                        continue
                    if self._stopping():
                        return done
                    if cid in self._clusters and self._merge(cid):
                        done += 1
                    else:
                        cleared.append((cid, ("merge",)))
                with self.store.read() as txn:
                    todos = self.store.todos(txn)
                work = [(cid, f) for cid, f in sorted(todos.items()) if f.get("skill") or f.get("describe")]
                if max_ops is not None:
                    work = work[: max(0, max_ops - done)]
                if self._stopping():
                    return done
                updates = self._compute_updates(work)
                for cid, flags in todos.items():
                    if cid not in self._clusters:
                        cleared.append((cid, ()))
                self._commit_updates(updates, cleared)
                done += len(updates)
                if done == before and not cleared:
                    break
            return done

    def _stopping(self) -> bool:
        return self._stop.is_set() and threading.current_thread() is self._maintainer

    def _compute_updates(self, work: list[tuple[int, dict[str, bool]]]) -> list[tuple[int, dict[str, Any], tuple[str, ...]]]:
        """New skills and descriptions for the queued clusters (LLM calls run concurrently)."""

        def one(cid: int, flags: dict[str, bool]) -> tuple[int, dict[str, Any], tuple[str, ...]] | None:
            sample = self._sample_members(cid)
            if sample is None:
                return None
            record, trajs = sample
            count = record.count
            fields: dict[str, Any] = {}
            names: list[str] = []
            if flags.get("skill"):
                text, by = None, "offline"
                if self.decider is not None and count >= self.config.llm.min_cluster_size:
                    text = self.decider.distil(self._view(cid), trajs)
                    by = "llm" if text else "fallback"
                skill = text or self.policy.distil(trajs)
                fields.update(skill=skill, skill_by=by, skill_n=count)
                if record.description_by != "llm":  # the offline description names the procedure's steps
                    fields.update(description=self.policy.describe(count, record.envs, record.flows, self._example_task(record), skill),
                                  description_by="offline")
                names.append("skill")
            if flags.get("describe"):
                if self.decider is not None:
                    text = self.decider.describe(self._view(cid, examples=tuple(trajs[:3])))
                    if text:
                        fields.update(description=text, description_by="llm")
                # Success or not, do not ask again until the cluster has grown.
                fields["description_n"] = count
                names.append("describe")
            return cid, fields, tuple(names)

        if self.decider is None or len(work) <= 1:
            results = [one(cid, flags) for cid, flags in work]
        else:
            with ThreadPoolExecutor(max_workers=self.config.llm.concurrency, thread_name_prefix="lifemem-distil") as pool:
                results = list(pool.map(lambda wf: one(*wf), work))
        return [r for r in results if r is not None]

    def _commit_updates(self, updates: list[tuple[int, dict[str, Any], tuple[str, ...]]], cleared: list[tuple[int, tuple[str, ...]]]) -> None:
        """All skill and description updates of a round in one transaction."""
        if not updates and not cleared:
            return
        with self._lock:
            records: list[ClusterRecord] = []
            for cid, fields, _ in updates:
                current = self._clusters.get(cid)
                if current is None:
                    continue
                record = current.copy()
                for name, value in fields.items():
                    setattr(record, name, value)
                records.append(record)
            usage_total = self._usage_totals()

            def write(txn: Any) -> None:
                for record in records:
                    self.store.put_cluster(txn, record)
                for cid, _, names in updates:
                    self.store.clear_todo(txn, cid, *names)
                for cid, names in cleared:
                    self.store.clear_todo(txn, cid, *names)
                counters = self.store.get_meta("counters", txn, {}) or {}
                for _, _, names in updates:
                    for name in names:
                        counters[name] = counters.get(name, 0) + 1
                self.store.put_meta(txn, "counters", counters)
                if usage_total is not None:
                    self.store.put_meta(txn, "llm_usage", usage_total)

            self.store.write(write)
            for record in records:
                self._clusters[record.id] = record

    def _member_snapshot(self, cid: int) -> tuple[int, list[int], np.ndarray, np.ndarray, list[tuple]] | None:
        """The cluster's version, member vids, vectors and briefs (tokens, success, env, task, id).

        Read without holding the engine lock, so ingest goes on meanwhile: the version is
        taken first, and a split commits only if the version is still the same then, which
        means the members read here are exactly the members at that version.
        """
        with self._lock:
            record = self._clusters.get(cid)
            if record is None:
                return None
            version = record.version
        with self.store.read() as txn:
            vids = self.store.members(txn, cid)
            tv = np.empty((len(vids), self.dim), np.float32)
            wv = np.empty((len(vids), WORKFLOW_DIM), np.float32)
            briefs: list[tuple] = []
            for n, vid in enumerate(vids):
                _, vec, wvec = self.store.vectors(txn, vid)  # type: ignore[misc]
                tv[n] = vec
                wv[n] = wvec
                brief = self.store.brief(txn, vid)
                assert brief is not None
                briefs.append(tuple(brief))
        return version, vids, tv, wv, briefs

    def _split(self, cid: int) -> bool:
        """Split cluster ``cid`` into finer clusters; False when no structure was found."""
        evo = self.config.evolution
        for _ in range(3):
            snapshot = self._member_snapshot(cid)
            if snapshot is None:
                return False
            version, vids, tv, wv, briefs = snapshot
            labels, descriptions = None, None
            by = "offline"
            if self.decider is not None:
                answer = self._llm_split(cid, tv, wv, vids)
                if answer is not None:
                    labels, descriptions = answer
                by = "llm" if labels is not None else "fallback"
            if labels is None:
                labels = self.policy.split(
                    wv, tau=evo.split_mrl_threshold, min_size=evo.split_min_size, max_parts=evo.split_max_parts, seed=cid
                )
            with self._lock:
                parent = self._clusters.get(cid)
                if parent is None:
                    return False
                if parent.version != version:
                    continue  # it changed while we computed: again, on fresh data
                if labels is None or len(set(labels.tolist())) < 2:
                    parent = parent.copy()
                    parent.no_split_until = int(parent.count * (1.0 + evo.skill_refresh_growth)) + 1

                    def no_split(txn: Any) -> None:
                        self.store.put_cluster(txn, parent)
                        self.store.clear_todo(txn, cid, "split")
                        self._count(txn, "splits_refused")

                    self.store.write(no_split)
                    self._clusters[cid] = parent
                    return False
                self._commit_split(parent, vids, tv, wv, briefs, labels, by, descriptions)
                return True
        return False

    def _llm_split(self, cid: int, tv: np.ndarray, wv: np.ndarray, vids: list[int]) -> tuple[np.ndarray, list[str]] | None:
        """The LLM groups a sample of members (and describes each group); the rest follow
        their nearest group."""
        assert self.decider is not None
        evo = self.config.evolution
        n = len(vids)
        sample = np.unique(np.linspace(0, n - 1, num=min(n, 24)).round().astype(int))
        view = self._view(cid)
        if view is None:
            return None
        with self.store.read() as txn:
            shown = [got[0] for i in sample if (got := self.store.trajectory(txn, vids[i])) is not None]
        if len(shown) != len(sample):
            return None
        groups = self.decider.split(view, shown, evo.split_max_parts)
        if groups is None or len(groups[0]) != len(sample) or len(set(groups[0])) < 2:
            return None
        answer, described = groups
        w = self.config.policy.workflow_weight
        combined = np.hstack([wv * np.sqrt(w), tv * np.sqrt(1 - w)])
        groups = sorted(set(answer))
        centres = np.stack([combined[sample[np.asarray(answer) == g]].sum(axis=0) for g in groups])
        centres /= np.linalg.norm(centres, axis=1, keepdims=True)
        labels = np.argmax(combined @ centres.T, axis=1)
        labels[sample] = [groups.index(g) for g in answer]
        return labels, [described[g] if 0 <= g < len(described) else "" for g in groups]

    def _commit_split(
        self,
        parent: ClusterRecord,
        vids: list[int],
        tv: np.ndarray,
        wv: np.ndarray,
        briefs: list[tuple],
        labels: np.ndarray,
        by: str,
        descriptions: list[str] | None = None,
    ) -> None:
        """Replace ``parent`` by one child per label; a child's description is the LLM's for
        its group when given (``descriptions[i]`` for the i-th label in sorted order)."""
        now = time.time()
        parts = sorted(set(labels.tolist()))
        children: list[ClusterRecord] = []
        examples: list[str] = []
        for part in parts:
            child = new_cluster_record(0, self.dim, WORKFLOW_DIM, "split", now)
            child.parent = parent.id
            rows = np.flatnonzero(labels == part)
            for n in rows:
                tokens, success, env, _, _ = briefs[n]
                fold_member(child, tv[n], wv[n], env, success, workflow_summary(tokens), now)
            children.append(child)
            examples.append(briefs[int(rows[0])][3])
        llm_mode = self.decider is not None

        def write(txn: Any) -> None:
            ids = self.store.next_cluster_ids(txn, len(children))
            for n, (child, child_id, example) in enumerate(zip(children, ids, examples)):
                child.id = child_id
                described = descriptions[n] if descriptions is not None and n < len(descriptions) else ""
                if described:
                    child.description, child.description_by, child.description_n = described, "llm", child.count
                else:
                    child.description = self.policy.describe(child.count, child.envs, child.flows, example)
                    child.description_by = "offline"
                self.store.put_cluster(txn, child)
                self.store.add_todo(txn, child_id, skill=True, split=self._needs_split(child), describe=llm_mode and child.description_by != "llm")
            entries = []
            for n, vid in enumerate(vids):
                child_id = ids[parts.index(int(labels[n]))]
                self.store.set_cluster_of(txn, vid, child_id, previous=parent.id)
                entries.append({"vid": vid, "id": briefs[n][4], "cluster": child_id, "from": parent.id, "op": "split", "by": by, "t": now})
            tomb = parent.copy()
            tomb.split_into = list(ids)
            tomb.updated = now
            self.store.put_cluster(txn, tomb)
            self.store.clear_todo(txn, parent.id)
            self.store.append_log(txn, entries)
            self._count(txn, "splits")

        self.store.write(write)
        self._clusters.pop(parent.id, None)
        for child in children:
            self._clusters[child.id] = child
        self._centroids.remove([parent.id])
        self._centroids.update(children)
        log.info("split cluster %d (n=%d, R=%.3f) into %s", parent.id, parent.count, parent.mrl, [c.count for c in children])

    def _count(self, txn: Any, name: str) -> None:
        """Add one to the store's counter ``name`` (stats) inside the caller's transaction."""
        counters = self.store.get_meta("counters", txn, {}) or {}
        counters[name] = counters.get(name, 0) + 1
        self.store.put_meta(txn, "counters", counters)

    def _merge(self, cid: int) -> bool:
        """Merge cluster ``cid`` with the cluster of its environment it has converged with, if
        any (:meth:`OfflinePolicy.should_merge`); the larger one absorbs the smaller."""
        evo = self.config.evolution
        with self._lock:
            record = self._clusters.get(cid)
            if record is None:
                return False
            row = self._centroids.query(_unit(record.tsum)[None, :], _unit(record.wsum)[None, :])
            ids, _ = self._centroids.search(row, MERGE_CANDIDATES + 1)
            for other_id in ids[0].tolist():
                other = self._clusters.get(int(other_id))
                if other is None or other.id == cid or set(other.envs) != set(record.envs):
                    continue
                if self.policy.should_merge(record, other, ratio=evo.merge_ratio, tau=evo.split_mrl_threshold, max_size=evo.split_min_size):
                    keep, gone = (record, other) if (record.count, -record.id) >= (other.count, -other.id) else (other, record)
                    self._commit_merge(keep, gone)
                    return True
        return False

    def _commit_merge(self, keep: ClusterRecord, gone: ClusterRecord) -> None:
        """Move ``gone``'s members into ``keep`` in one transaction; ``gone`` becomes a tombstone
        pointing at ``keep`` (decisions naming it resolve there, as for a split)."""
        now = time.time()
        merged = keep.copy()
        merged.count += gone.count
        merged.tsum = merged.tsum + gone.tsum
        merged.wsum = merged.wsum + gone.wsum
        for env, n in gone.envs.items():
            merged.envs[env] = merged.envs.get(env, 0) + n
        for flow, n in gone.flows.items():
            key = flow if flow in merged.flows or len(merged.flows) < MAX_FLOWS else "(other)"
            merged.flows[key] = merged.flows.get(key, 0) + n
        merged.successes += gone.successes
        merged.failures += gone.failures
        merged.version += 1
        merged.updated = now
        tomb = gone.copy()
        tomb.split_into = [keep.id]
        tomb.updated = now
        llm_mode = self.decider is not None

        def write(txn: Any) -> None:
            entries = []
            for vid in self.store.members(txn, gone.id):
                self.store.set_cluster_of(txn, vid, keep.id, previous=gone.id)
                brief = self.store.brief(txn, vid)
                entries.append({"vid": vid, "id": brief[4] if brief else "", "cluster": keep.id, "from": gone.id, "op": "merge", "by": "offline", "t": now})
            self.store.put_cluster(txn, merged)
            self.store.put_cluster(txn, tomb)
            self.store.clear_todo(txn, gone.id)
            self.store.add_todo(txn, keep.id, skill=True, merge=True, split=self._needs_split(merged),
                                describe=llm_mode and self._needs_description(merged))
            self.store.append_log(txn, entries)
            self._count(txn, "merges")

        self.store.write(write)
        self._clusters.pop(gone.id, None)
        self._clusters[keep.id] = merged
        self._centroids.remove([gone.id])
        self._centroids.update([merged])
        log.debug("merged cluster %d (n=%d) into %d (n=%d)", gone.id, gone.count, keep.id, keep.count)

    def _sample_members(self, cid: int) -> tuple[ClusterRecord, list[Trajectory]] | None:
        """The cluster's state and an even sample of its members (at most ``skill_sample_size``),
        decoded: the offline skill reads their actions, the LLM their whole text. Read outside
        the engine lock."""
        with self._lock:
            record = self._clusters.get(cid)
            if record is None:
                return None
        with self.store.read() as txn:
            vids = self.store.members(txn, cid)
            size = self.config.evolution.skill_sample_size
            picks = vids if len(vids) <= size else [vids[int(i)] for i in np.linspace(0, len(vids) - 1, size).round()]
            trajs = [got[0] for vid in picks if (got := self.store.trajectory(txn, vid)) is not None]
        return record, trajs

    def _view(self, cid: int, examples: tuple[Trajectory, ...] = ()) -> ClusterView | None:
        record = self._clusters.get(cid)
        if record is None:
            return None
        return ClusterView(id=cid, count=record.count, description=record.description, skill=record.skill, envs=dict(record.envs), examples=examples)

    def _maintenance_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(timeout=1.0)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.maintain()
            except BaseException as exc:  # surfaced to the next caller; the todo stays queued
                log.exception("background maintenance failed")
                self._maintenance_error = exc
                break

    def _raise_maintenance_error(self) -> None:
        if self._maintenance_error is not None:
            exc, self._maintenance_error = self._maintenance_error, None
            raise MaintenanceError(f"background maintenance failed: {exc}") from exc

    def _usage_totals(self) -> dict[str, dict[str, float]] | None:
        if self.decider is None:
            return None
        totals = {op: dict(v) for op, v in self._usage_base.items()}
        for op, values in self.decider.usage().items():
            slot = totals.setdefault(op, {})
            for key, value in values.items():
                if isinstance(value, (int, float)):
                    slot[key] = slot.get(key, 0) + value
        return totals

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
    ) -> Retrieval:
        """Top-k trajectories of ``env`` most similar to ``task``, plus the skills of their clusters.

        ``env=None`` searches every environment (the unstructured-pool baseline the
        lifelong experiments compare against); ``skills=False`` leaves skills out."""
        return self.retrieve_many([task], [env], k, vectors=None if vector is None else [vector], token_budget=token_budget, skills=skills)[0]

    def retrieve_many(
        self,
        tasks: Sequence[str],
        envs: Sequence[str | None] | str,
        k: int | None = None,
        *,
        vectors: Any = None,
        token_budget: int | None = None,
        skills: bool = True,
    ) -> list[Retrieval]:
        """Many queries in one embedding call and one batched index search (``None`` envs: all)."""
        self._check_open()
        tasks = list(tasks)
        if isinstance(envs, str):
            envs = [envs] * len(tasks)
        envs = list(envs)
        if len(envs) != len(tasks):
            raise ValueError(f"envs: {len(envs)} given for {len(tasks)} tasks")
        for i, (task, env) in enumerate(zip(tasks, envs)):
            if not isinstance(task, str) or not task.strip():
                raise ValueError(f"tasks[{i}]: expected a non-empty string")
            if env is not None and (not isinstance(env, str) or not env.strip()):
                raise ValueError(f"envs[{i}]: expected a non-empty environment name or None (all environments)")
        k = self.config.retrieval.k if k is None else k
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k: expected a positive integer, got {k!r}")
        budget = self.config.retrieval.token_budget if token_budget is None else token_budget
        if not tasks:
            return []
        if vectors is None:
            vectors = self.embedder.embed(tasks)
        found = self.search_records(vectors, envs, k, skills=skills)
        max_skills = self.config.retrieval.max_skills
        with paused_gc():
            return [assemble(task, env, hits, texts, k, max_skills, budget) for task, env, (hits, texts) in zip(tasks, envs, found)]

    def _search(self, queries: np.ndarray, envs: Sequence[str | None], k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k per query within its environment, or over every environment where it is None."""
        scoped = [i for i, env in enumerate(envs) if env is not None]
        if len(scoped) == len(envs):
            return self.index.search_envs(queries, k, list(envs))
        scores = np.full((len(envs), k), -np.inf, dtype=np.float32)
        ids = np.full((len(envs), k), -1, dtype=np.int64)
        if scoped:
            scores[scoped], ids[scoped] = self.index.search_envs(queries[scoped], k, [envs[i] for i in scoped])
        pooled = [i for i, env in enumerate(envs) if env is None]
        scores[pooled], ids[pooled] = self.index.search(queries[pooled], k)
        return scores, ids

    def search_records(
        self, vectors: Any, envs: Sequence[str | None], k: int, *, skills: bool = True
    ) -> list[tuple[list[tuple[float, int | None, bytes]], dict[int, str]]]:
        """Per query: the top-k hits as (score, cluster id, stored record bytes) and the skills
        of their clusters. What a shard returns to a client that merges several shards: the
        records travel undecoded and only the merged winners are decoded."""
        scores, ids = self.search_hits(vectors, envs, k)
        records, skill_texts = self.hit_records(ids.ravel(), skills=skills)
        max_skills = self.config.retrieval.max_skills
        out = []
        for q, row_s in enumerate(scores.tolist()):
            hits: list[tuple[float, int | None, bytes]] = []
            texts: dict[int, str] = {}
            for s, found in zip(row_s, records[q * k : (q + 1) * k]):
                if found is None:
                    continue
                cid, raw = found
                hits.append((s, cid, raw))
                if cid in skill_texts and cid not in texts and len(texts) < max_skills:
                    texts[cid] = skill_texts[cid]
            out.append((hits, texts))
        return out

    def search_hits(self, vectors: Any, envs: Sequence[str | None], k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(scores (q, k), ids (q, k))`` of each query's top-k, padded with -inf / -1: the first
        half of a sharded retrieval, which fetches records only for the winners across shards."""
        self._check_open()
        envs = list(envs)
        queries = _unit_rows(vectors, len(envs), self.dim, "vectors")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k: expected a positive integer, got {k!r}")
        if not envs:
            return np.zeros((0, k), dtype=np.float32), np.zeros((0, k), dtype=np.int64)
        return self._search(queries, envs, k)

    def hit_records(self, ids: Any, *, skills: bool = True) -> tuple[list[tuple[int | None, bytes] | None], dict[int, str]]:
        """Per id: ``(cluster id, stored record bytes)``, or None where it is not stored (padding,
        or removed since it was found); and the skill texts of those clusters (non-empty only)."""
        self._check_open()
        out: list[tuple[int | None, bytes] | None] = []
        texts: dict[int, str] = {}
        looked: set[int] = set()
        with self.store.read() as txn:
            for vid in np.asarray(ids, dtype=np.int64).ravel().tolist():
                raw = self.store.trajectory_bytes(txn, vid) if vid >= 0 else None
                if raw is None:
                    out.append(None)
                    continue
                cid = self.store.cluster_of(txn, vid)
                out.append((cid, raw))
                if skills and cid is not None and cid not in looked:
                    looked.add(cid)
                    # The live view (replaced whole on every commit, never edited in place)
                    # instead of decoding the stored record with its sums for one string.
                    record = self._clusters.get(cid) or self.store.get_cluster(txn, cid)  # split meanwhile
                    if record is not None and record.skill.strip():
                        texts[cid] = record.skill
        return out, texts

    # -- reading ---------------------------------------------------------------------------
    def get(self, trajectory_id: str) -> Trajectory | None:
        with self.store.read() as txn:
            vid = self.store.lookup_id(txn, trajectory_id)
            got = None if vid is None else self.store.trajectory(txn, vid)
        return None if got is None else got[0]

    def cluster_of(self, trajectory_id: str) -> int | None:
        with self.store.read() as txn:
            vid = self.store.lookup_id(txn, trajectory_id)
            return None if vid is None else self.store.cluster_of(txn, vid)

    def cluster_states(self, cluster_ids: Iterable[int]) -> dict[int, ClusterRecord]:
        """Copies of these clusters' live states (those still live): what a coordinator plans
        the next batch with when that batch's candidates were searched before this commit."""
        with self._lock:
            return {cid: self._clusters[cid].copy() for cid in set(cluster_ids) if cid in self._clusters}

    def clusters(self, env: str | None = None) -> list[ClusterInfo]:
        """Live clusters, largest first; with ``env``, those holding trajectories of it."""
        with self._lock:
            records = list(self._clusters.values())
        if env is not None:
            records = [r for r in records if env in r.envs]
        return [ClusterInfo.of(r) for r in sorted(records, key=lambda r: (-r.count, r.id))]

    def members(self, cluster_id: int) -> list[str]:
        with self.store.read() as txn:
            out = []
            for vid in self.store.members(txn, cluster_id):
                got = self.store.trajectory(txn, vid)
                if got is not None:
                    out.append(got[0].id)
            return out

    def __len__(self) -> int:
        with self.store.read() as txn:
            return self.store.count_trajectories(txn)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            records = list(self._clusters.values())
            pending = len(self._pending)
        per_env: dict[str, dict[str, int]] = {}
        for record in records:
            for env, n in record.envs.items():
                slot = per_env.setdefault(env, {"trajectories": 0, "clusters": 0})
                slot["trajectories"] += n
                slot["clusters"] += 1
        with self.store.read() as txn:
            total = self.store.count_trajectories(txn)
            counters = self.store.get_meta("counters", txn, {}) or {}
            usage = self.store.get_meta("llm_usage", txn, {}) or {}
            todo = len(self.store.todos(txn))
        if pending:
            with self.store.read() as txn:
                for vid in self._pending:
                    got = self.store.trajectory(txn, vid)
                    if got is not None:
                        slot = per_env.setdefault(got[0].env, {"trajectories": 0, "clusters": 0})
                        slot["trajectories"] += 1
        live_usage = self._usage_totals()
        if live_usage is not None:
            usage = live_usage
        calls = sum(int(v.get("calls", 0)) for v in usage.values())
        tokens = sum(int(v.get("prompt_tokens", 0)) + int(v.get("completion_tokens", 0)) for v in usage.values())
        sizes = sorted((r.count for r in records), reverse=True)
        return {
            "path": str(self.path),
            "trajectories": total,
            "clusters": len(records),
            "pending": pending,
            "per_env": dict(sorted(per_env.items())),
            "cluster_sizes": {
                "max": sizes[0] if sizes else 0,
                "median": sizes[len(sizes) // 2] if sizes else 0,
                "singletons": sum(1 for s in sizes if s == 1),
            },
            "mixed_env_clusters": sum(1 for r in records if len(r.envs) > 1),
            "splits": int(counters.get("splits", 0)),
            # Splits the rule called for where the members showed no structure to split on.
            "splits_refused": int(counters.get("splits_refused", 0)),
            "merges": int(counters.get("merges", 0)),
            "maintenance_queued": todo,
            "llm": {
                "backend": self.config.llm.backend if self.decider is not None else "offline",
                "calls": calls,
                "tokens": tokens,
                "fallbacks": int(counters.get("llm_fallbacks", 0)),
                "decided_offline": int(counters.get("llm_skipped", 0)),
                "by_operation": usage,
            },
            "index": self.index.stats(),
            "generation": self.store.generation(),
        }

    def export(self, path: str | Path) -> dict[str, int]:
        """Trajectories as native JSONL (re-importable) to ``path``; clusters to ``<path stem>.clusters.jsonl``."""
        import json

        from .importers import write_jsonl

        path = Path(path)
        with self.store.read() as txn:
            trajectories = [t for _, t, _ in self.store.iter_trajectories(txn)]
            clusters = []
            for record in self.store.iter_clusters(txn):
                if not record.live:
                    continue
                info = ClusterInfo.of(record).to_dict()
                info["members"] = [self.store.trajectory(txn, v)[0].id for v in self.store.members(txn, record.id)]  # type: ignore[index]
                clusters.append(info)
        n = write_jsonl(trajectories, path)
        cluster_path = path.with_name(path.name.removesuffix(".jsonl") + ".clusters.jsonl")
        tmp = cluster_path.with_name(cluster_path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            for info in clusters:
                fh.write(json.dumps(info, ensure_ascii=False) + "\n")
        tmp.replace(cluster_path)
        return {"trajectories": n, "clusters": len(clusters), "clusters_path": str(cluster_path)}  # type: ignore[dict-item]

    def verify(self) -> dict[str, Any]:
        """Check every invariant against a recomputation from the stored trajectories."""
        problems: list[str] = []
        with self._lock, self.store.read() as txn:  # no commit in between: LMDB and the index agree
            n_traj = self.store.count_trajectories(txn)
            n_index = len(self.index)
            seen_ids: dict[str, int] = {}
            for vid, traj, _ in self.store.iter_trajectories(txn):
                if traj.id in seen_ids:
                    problems.append(f"trajectory id {traj.id!r} stored twice")
                seen_ids[traj.id] = vid
                if self.store.lookup_id(txn, traj.id) != vid:
                    problems.append(f"id map does not point at trajectory {traj.id!r}")
            pending = set(self.store.get_meta("pending", txn) or [])
            sums: dict[int, list[Any]] = {}
            for vid, code, vec, wvec in self.store.iter_vectors(txn):
                cid = self.store.cluster_of(txn, vid)
                if cid is None:
                    if vid not in pending:
                        problems.append(f"trajectory vid {vid} is in no cluster")
                    continue
                slot = sums.setdefault(cid, [0, np.zeros(self.dim), np.zeros(WORKFLOW_DIM)])
                slot[0] += 1
                slot[1] += vec
                slot[2] += wvec
            live = 0
            for record in self.store.iter_clusters(txn):
                members = self.store.members(txn, record.id)
                if not record.live:
                    if members:
                        problems.append(f"cluster {record.id} is retired but has {len(members)} members")
                    continue
                live += 1
                got = sums.get(record.id, [0, np.zeros(self.dim), np.zeros(WORKFLOW_DIM)])
                if record.count != len(members) or record.count != got[0]:
                    problems.append(f"cluster {record.id}: count {record.count}, members {len(members)}, recomputed {got[0]}")
                    continue
                if not np.allclose(record.tsum, got[1], atol=1e-3) or not np.allclose(record.wsum, got[2], atol=1e-3):
                    problems.append(f"cluster {record.id}: running sums differ from recomputation")
                r = float(np.linalg.norm(got[2]) / got[0]) if got[0] else 0.0
                if abs(r - record.mrl) > 1e-4:
                    problems.append(f"cluster {record.id}: R {record.mrl:.6f} != recomputed {r:.6f}")
            for cid in sums:
                record = self.store.get_cluster(txn, cid)
                if record is None or not record.live:
                    problems.append(f"trajectories point at cluster {cid}, which is not live")
        if n_index != n_traj:
            problems.append(f"index holds {n_index} vectors, the store {n_traj} trajectories")
        return {"ok": not problems, "trajectories": n_traj, "clusters": live, "pending": len(pending), "problems": problems}

    # -- lifecycle -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"{self.path}: the memory is closed")

    def _check_writable(self) -> None:
        self._check_open()
        if self.read_only:
            raise StoreError(f"{self.path}: opened read-only")

    def close(self) -> None:
        """Stop background work, save the index as a fresh cache, close the store."""
        if self._closed:
            return
        self._stop.set()
        self._wake.set()
        if self._maintainer is not None:
            self._maintainer.join()
        with self._lock:
            try:
                if not self.read_only:
                    self.index.save(self.path / "index", self.store.generation())
            except Exception:  # a cache: losing it costs a rebuild, never data
                log.warning("could not save the index cache", exc_info=True)
            if self.decider is not None and hasattr(self.decider, "close"):
                self.decider.close()
            self.store.close()
            self._closed = True

    def __enter__(self) -> "Memory":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def prepare_items(trajectories: Sequence[Trajectory], vectors: Any, dim: int, features: str = "roles") -> list[BatchItem]:
    """Batch items from trajectories and their task vectors (validated, normalised), with the
    workflow featurizer ``features`` (``evolution.workflow_features``)."""
    return _featurized(trajectories, _unit_rows(vectors, len(trajectories), dim, "vectors"), features)


def _featurized(trajectories: Sequence[Trajectory], vectors: np.ndarray, features: str) -> list[BatchItem]:
    items: list[BatchItem] = []
    for traj, vec in zip(trajectories, vectors):
        tokens, wvec = featurize(traj, features, WORKFLOW_DIM)
        items.append(BatchItem.of(traj, vec, wvec, tokens, workflow_summary(tokens)))
    return items


def pack_trajectories(trajectories: Sequence[Trajectory], vectors: Any, dim: int, features: str = "roles") -> ItemBatch:
    """Trajectories ready to travel: encoded once, tokens and workflow vectors computed.

    Without ``vectors`` the task vectors are zeros, to be embedded where a model is
    (the coordinator's embedder actors)."""
    for i, traj in enumerate(trajectories):
        if not isinstance(traj, Trajectory):
            raise TypeError(f"trajectories[{i}]: expected a Trajectory, got {type(traj).__name__}")
    vecs = np.zeros((len(trajectories), dim), np.float32) if vectors is None else _unit_rows(vectors, len(trajectories), dim, "vectors")
    return ItemBatch.of(_featurized(trajectories, vecs, features), features)


def known_ids(store: MemoryStore, ids: Sequence[str], fingerprints: Sequence[str]) -> list[AddResult | None]:
    """Per id: its stored result (``duplicate``, or ``conflict`` when stored with another
    fingerprint), or None when the store does not hold it."""
    out: list[AddResult | None] = []
    with store.read() as txn:
        for tid, fp in zip(ids, fingerprints):
            vid = store.lookup_id(txn, tid)
            if vid is None:
                out.append(None)
            else:
                status = "duplicate" if store.fingerprint_of(txn, vid) == fp else "conflict"
                out.append(AddResult(tid, status, store.cluster_of(txn, vid)))
    return out


def _remove_member(record: ClusterRecord, traj: Trajectory, vec: np.ndarray, wvec: np.ndarray, flow: str, now: float) -> None:
    record.count -= 1
    record.tsum -= vec
    record.wsum -= wvec
    env_n = record.envs.get(traj.env, 0) - 1
    if env_n > 0:
        record.envs[traj.env] = env_n
    else:
        record.envs.pop(traj.env, None)
    key = flow if flow in record.flows else "(other)"
    if key in record.flows:
        record.flows[key] -= 1
        if record.flows[key] <= 0:
            del record.flows[key]
    if traj.outcome.success is True:
        record.successes -= 1
    elif traj.outcome.success is False:
        record.failures -= 1
    record.version += 1
    record.updated = now
    if record.count == 0:
        record.tsum[:] = 0
        record.wsum[:] = 0
