"""Ingest: check ids, prepare items, find candidates, plan, commit.

Every path in (``Memory.add_many``, prepared items, a shard's commit) follows the rules of
:mod:`lifemem_ray.engine.ingest_rules`: a repeated id with other content, stored or inside the
request, refuses the whole request. Before the initial partition exists (``evolution.
init_size`` trajectories), items are stored and indexed but left unclustered (``pending``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from lifemem_ray.core.errors import ArgumentTypeError, InvalidTrajectoryError, StoreError, UnknownClusterError
from lifemem_ray.core.model import Trajectory
from lifemem_ray.core.tenancy import display_envs, id_key, is_name, pool, scope_tenant
from lifemem_ray.engine.clustering.clusters import (
    ClusterRecord,
    add_member,
    cosine_to_sum,
    example_task,
    needs_description,
    needs_skill,
    new_cluster_record,
)
from lifemem_ray.engine.clustering.evolution import (
    BatchItem,
    CandidateArrays,
    CandidateSet,
    ItemBatch,
    Placement,
    scope_sums,
)
from lifemem_ray.engine.clustering.steps import featurize
from lifemem_ray.engine.clustering.workflow import workflow_summary
from lifemem_ray.engine.ingest_rules import (
    AddResult,
    IdClasses,
    classify_ids,
    make_planner,
    plan_counters,
    refuse_conflicts,
    unit_rows,
)
from lifemem_ray.engine.search import search_index
from lifemem_ray.engine.state import WORKFLOW_DIM, EngineState
from lifemem_ray.engine.store.storage import MemoryStore

__all__ = ["Ingest", "check_trajectories", "known_ids", "pack_trajectories", "prepare_items", "stored_lookup"]


class Ingest:
    def __init__(self, state: EngineState) -> None:
        self.s = state

    # -- the user's adds ---------------------------------------------------------------------
    def add_batch(self, trajectories: list[Trajectory], vectors: np.ndarray | None) -> list[AddResult]:
        """One transaction's worth of :meth:`Memory.add_many` (results name id keys, see
        :func:`lifemem_ray.core.tenancy.id_key`)."""
        with self.s.lock:
            classes = self.check_ids(
                [id_key(t.tenant, t.id) for t in trajectories], [t.fingerprint for t in trajectories]
            )
            placed = None
            if classes.fresh:
                fresh = classes.fresh
                placed = self.place(
                    self.prepare([trajectories[i] for i in fresh], None if vectors is None else vectors[fresh])
                )
            return classes.complete(placed)

    def add_items(self, items: list[BatchItem]) -> list[AddResult]:
        """Prepared items (vectors included): the engine decides and commits. The same id rules
        as :meth:`add_batch`: a conflict refuses the whole request."""
        self.s.check_writable()
        with self.s.lock:
            classes = self.check_ids([it.id for it in items], [it.fingerprint for it in items])
            placed = self.place([items[i] for i in classes.fresh]) if classes.fresh else None
        self.s.schedule()
        return classes.complete(placed)

    def check_ids(self, ids: Sequence[str], fingerprints: Sequence[str], *, refuse: bool = True) -> IdClasses:
        """The request's ids classified against this store (raises :class:`IdConflictError` on
        a conflict unless ``refuse`` is False)."""
        classes = classify_ids(ids, fingerprints, stored_lookup(self.s.store, ids))
        if refuse:
            refuse_conflicts(classes, str(self.s.path))
        return classes

    def prepare(self, trajectories: Sequence[Trajectory], vectors: np.ndarray | None = None) -> list[BatchItem]:
        """Batch items: task vectors (embedded here when not given), action tokens, workflow vectors."""
        if vectors is None:
            vectors = self.s.embedder.embed([t.query_text for t in trajectories])
        return prepare_items(trajectories, vectors, self.s.dim, self.s.features)

    # -- deciding ------------------------------------------------------------------------------
    def place(self, items: list[BatchItem]) -> list[AddResult]:
        """Decide (one planner per batch) and commit; before initialisation, collect."""
        s = self.s
        init_count = 0
        if not s.initialised:
            need = s.config.evolution.init_size - len(s.pending)
            if len(items) < need:
                return self.commit_pending(items)
            # The initial partition: everything pending plus enough of this batch.
            items = self.pending_items() + items
            init_count = len(s.pending) + need
        found = self.candidates(items[init_count:])
        planner = make_planner(found.clusters, s.policy, s.config, s.dim, WORKFLOW_DIM, s.decider)
        plan = planner.plan(
            items,
            [[]] * init_count + found.neighbours,
            init_count=init_count,
            extra=[[]] * init_count + [[c for c, _ in row] for row in found.extra],
            scopes=found.scopes,
        )
        return self.commit(items, plan.placements, initialise=bool(init_count), counters=plan_counters(plan))

    def candidates(self, items: Sequence[BatchItem]) -> CandidateSet:
        """For each item: (cluster id, similarity) of its top-k stored neighbours, and further
        candidates by the policy's score over all cluster centroids (see
        ``evolution.neighbour_scope``); plus the state of every cluster named."""
        if not items:
            return CandidateSet(neighbours=[], extra=[], clusters={})
        return self.candidate_arrays(
            np.stack([it.vec for it in items]), np.stack([it.wvec for it in items]), [it.env for it in items]
        ).to_set()

    def candidate_arrays(
        self, vectors: np.ndarray, workflow_vectors: np.ndarray, envs: Sequence[str]
    ) -> CandidateArrays:
        """:meth:`candidates` from the vectors alone, as arrays (what a shard sends the coordinator)."""
        s = self.s
        evo = s.config.evolution
        n = len(vectors)
        queries = np.asarray(vectors, dtype=np.float32)
        extra_ids, extra_scores = np.zeros((n, 0), np.int64), np.zeros((n, 0), np.float32)
        envs = list(envs)
        with s.lock:
            if n and evo.centroid_candidates:
                combined = s.centroids.query(queries, np.asarray(workflow_vectors, dtype=np.float32))
                extra_ids, extra_scores = s.centroids.search(
                    combined, evo.centroid_candidates, [scope_tenant(e) for e in envs]
                )
            if n and (evo.neighbour_scope == "env" or len(s.index)):
                # "global": every environment of the item's tenant (never another tenant's)
                targets = envs if evo.neighbour_scope == "env" else [pool(scope_tenant(e)) for e in envs]
                scores, vids = search_index(
                    s.index,
                    queries,
                    targets,
                    evo.top_k,
                    nprobe_fraction=s.config.index.candidate_nprobe_fraction,
                    max_codes=s.config.index.candidate_max_codes,
                )
            else:
                scores, vids = np.zeros((n, 0), np.float32), np.zeros((n, 0), dtype=np.int64)
            ids = self._clusters_of(vids)
            scores = np.where(ids >= 0, scores, np.float32(-np.inf)).astype(np.float32, copy=False)
            named = np.unique(np.concatenate([ids.ravel(), extra_ids.ravel()])).tolist()
            clusters = {cid: s.clusters[cid] for cid in named if cid in s.clusters}
            scopes = scope_sums(s.clusters.values(), set(envs)) if s.config.policy.env_contrast > 0 else {}
        return CandidateArrays(ids, scores, extra_ids, extra_scores, clusters, scopes)

    def _clusters_of(self, vids: np.ndarray) -> np.ndarray:
        """The live cluster of each vid (-1: none); each distinct vid looked up once
        (near-duplicate queries share neighbours)."""
        unique, inverse = np.unique(vids, return_inverse=True)
        cluster_of = np.full(len(unique), -1, dtype=np.int64)
        with self.s.store.read() as txn:
            for j, vid in enumerate(unique.tolist()):
                if vid >= 0:
                    cid = self.s.store.cluster_of(txn, vid)
                    if cid is not None and cid in self.s.clusters:
                        cluster_of[j] = cid
        return cluster_of[inverse.reshape(vids.shape)] if vids.size else np.zeros(vids.shape, np.int64)

    # -- before the initial partition -------------------------------------------------------
    def pending_items(self) -> list[BatchItem]:
        items = []
        store = self.s.store
        with store.read() as txn:
            for vid in self.s.pending:
                got = store.trajectory(txn, vid)
                vecs = store.vectors(txn, vid)
                if got is None or vecs is None:
                    raise StoreError(f"{self.s.path}: pending trajectory {vid} is missing; run `lifemem-ray check`")
                traj, extra = got
                _, vec, wvec = vecs
                tokens = list(extra["tokens"])
                items.append(
                    BatchItem.of(traj, vec.copy(), wvec.copy(), tokens, workflow_summary(tokens), vid=vid, stored=True)
                )
        return items

    def commit_pending(self, items: list[BatchItem]) -> list[AddResult]:
        """Before initialisation: store and index, leave unclustered until enough have arrived."""
        s = self.s
        now = time.time()

        def write(txn: Any) -> None:
            for it, vid in zip(items, s.store.allocate_vids(txn, len(items)), strict=True):
                it.vid = vid
                s.store.put_item(txn, it, s.store.env_code(txn, it.env), None)
            s.store.put_meta(txn, "pending", s.pending + [it.vid for it in items])
            s.store.append_log(txn, [{"vid": it.vid, "id": it.id, "op": "pending", "t": now} for it in items])

        s.store.write(write)
        s.pending = s.pending + [it.vid for it in items]
        s.index_add(items)
        return [AddResult(it.id, "pending", None) for it in items]

    # -- committing --------------------------------------------------------------------------
    def commit(
        self,
        items: list[BatchItem],
        placements: Sequence[Placement],
        *,
        initialise: bool = False,
        counters: dict[str, int] | None = None,
    ) -> list[AddResult]:
        """Store decided placements in one transaction and return once it is durable.

        A placement names a live cluster, or a negative id: items with the same negative id
        open one new cluster together. A cluster split since the decision was made is
        resolved to its best-scoring live part. Items marked ``stored`` (waiting for
        initialisation) only get their cluster."""
        self.s.check_writable()
        with self.s.lock:  # against the maintenance thread's splits and skill updates
            return _Commit(self.s, items, placements, initialise, counters).run()


def resolve_target(s: EngineState, cid: int, item: BatchItem) -> int:
    """A live cluster for a decided id: itself, or the best part of a cluster split since."""
    seen = 0
    while cid > 0 and cid not in s.clusters:
        record = s.stored_cluster(cid)
        if record is None or not record.split_into or seen > 32:
            raise UnknownClusterError(f"{s.path}: cluster {cid} is not stored here")
        found: list[ClusterRecord | None] = [s.clusters[c] for c in record.split_into if c in s.clusters] or [
            s.stored_cluster(c) for c in record.split_into
        ]
        parts = [p for p in found if p is not None]
        if not parts:
            raise UnknownClusterError(f"{s.path}: cluster {cid} was split and none of its parts is live")
        cid = max(
            parts, key=lambda r: s.policy.score(cosine_to_sum(item.vec, r.tsum), cosine_to_sum(item.wvec, r.wsum))
        ).id
        seen += 1
    return cid


class _Commit:
    """One commit of decided placements: the cluster states after the batch (recomputed from
    the authoritative live state), written in one transaction with the items, the log, the
    maintenance they call for and the counters; then the live view follows."""

    def __init__(
        self,
        s: EngineState,
        items: list[BatchItem],
        placements: Sequence[Placement],
        initialise: bool,
        counters: dict[str, int] | None,
    ) -> None:
        self.s, self.items, self.placements, self.initialise, self.counters = s, items, placements, initialise, counters
        self.now = time.time()
        self.targets = [resolve_target(s, p.cluster, it) for it, p in zip(items, placements, strict=True)]
        self.work: dict[int, ClusterRecord] = {}
        self.founders: dict[int, int] = {}
        for i, (it, cid) in enumerate(zip(items, self.targets, strict=True)):
            self.founders.setdefault(cid, i)
            record = self.work.get(cid)
            if record is None:
                base = s.clusters.get(cid)
                born = "init" if placements[i].op == "init" else "new"
                record = (
                    base.copy() if base is not None else new_cluster_record(cid, s.dim, WORKFLOW_DIM, born, self.now)
                )
                self.work[cid] = record
            add_member(record, it, self.now)
        self.fresh = [it for it in items if not it.stored]

    def run(self) -> list[AddResult]:
        s = self.s
        usage_total = s.usage_totals()
        written: dict[int, ClusterRecord] = {}

        def write(txn: Any) -> dict[int, int]:
            for it, vid in zip(self.fresh, s.store.allocate_vids(txn, len(self.fresh)), strict=True):
                it.vid = vid
            provisional = sorted((c for c in self.work if c < 0), reverse=True)
            real = dict(zip(provisional, s.store.next_cluster_ids(txn, len(provisional)), strict=True))
            written.clear()
            for cid, state in self.work.items():
                written[cid] = self._write_cluster(txn, cid, state, real)
            self._write_items(txn, real)
            if self.initialise:
                s.store.put_meta(txn, "pending", [])
                s.store.put_meta(txn, "initialised", True)
            if self.counters:
                s.add_counters(txn, self.counters)
            if usage_total is not None:
                s.store.put_meta(txn, "llm_usage", usage_total)
            return real

        real = s.store.write(write)
        # Committed: now the in-memory view may change.
        for record in written.values():
            s.clusters[record.id] = record
        s.centroids.update(written.values())
        if self.initialise:
            s.pending = []
            s.initialised = True
        s.index_add(self.fresh)
        return [
            AddResult(it.id, "added", real.get(cid, cid))
            for it, cid in zip(self.items, self.targets, strict=True)
            if not it.stored
        ]

    def _write_cluster(self, txn: Any, cid: int, state: ClusterRecord, real: dict[int, int]) -> ClusterRecord:
        s = self.s
        record = state.copy()
        record.id = real.get(cid, cid)
        founder = self.founders[cid]
        described = self.placements[founder].description
        if cid < 0 and described:
            record.description, record.description_by, record.description_n = described, "llm", record.count
        elif record.description_by != "llm" or not record.description:
            # Offline descriptions are cheap: refreshed on every change. description_n
            # only schedules LLM descriptions, so it is left alone here.
            example = self.items[founder].query if cid < 0 else example_task(record)
            record.description = s.policy.describe(
                record.count, display_envs(record.envs), record.flows, example, record.skill
            )
            record.description_by = "offline"
        s.store.put_cluster(txn, record)
        evo, llm = s.config.evolution, s.config.llm
        s.store.add_todo(
            txn,
            record.id,
            split=s.needs_split(record),
            skill=needs_skill(record, evo, llm, s.llm_mode),
            describe=s.llm_mode and needs_description(record, evo, llm),
            merge=evo.merge_ratio > 0,
        )
        return record

    def _write_items(self, txn: Any, real: dict[int, int]) -> None:
        s = self.s
        entries = []
        for i, (it, p, cid) in enumerate(zip(self.items, self.placements, self.targets, strict=True)):
            real_id = real.get(cid, cid)
            if it.stored:
                s.store.set_cluster_of(txn, it.vid, real_id)
            else:
                s.store.put_item(txn, it, s.store.env_code(txn, it.env), real_id)
            op = "new" if (cid < 0 and self.founders[cid] == i and p.op == "join") else p.op
            entries.append(
                {
                    "vid": it.vid,
                    "id": it.id,
                    "cluster": real_id,
                    "op": op,
                    "by": p.by,
                    "score": round(p.score, 4),
                    "t": self.now,
                }
            )
        s.store.append_log(txn, entries)


# -- module functions: what clients and shards call without a Memory ---------------------------
def stored_lookup(store: MemoryStore, ids: Sequence[str]) -> list[tuple[str, int | None] | None]:
    """Per id: the (fingerprint, cluster id) the store holds for it, or None."""
    out: list[tuple[str, int | None] | None] = []
    with store.read() as txn:
        for tid in ids:
            vid = store.lookup_id(txn, tid)
            out.append(None if vid is None else (store.fingerprint_of(txn, vid), store.cluster_of(txn, vid)))  # type: ignore[arg-type]
    return out


def known_ids(store: MemoryStore, ids: Sequence[str], fingerprints: Sequence[str]) -> list[AddResult | None]:
    """Per id: its stored result (``duplicate``, or ``conflict`` when stored with another
    fingerprint), or None when the store does not hold it."""
    out: list[AddResult | None] = []
    for tid, fp, got in zip(ids, fingerprints, stored_lookup(store, ids), strict=True):
        out.append(None if got is None else AddResult(tid, "duplicate" if got[0] == fp else "conflict", got[1]))
    return out


def check_trajectories(trajectories: Sequence[Any]) -> None:
    """What every add checks before anything else (the engine's and the client's): Trajectory
    objects, of tenants with valid names. A Trajectory may carry a tenant name an older version
    stored by mistake (so stored records still decode); nothing new is stored under one."""
    for i, traj in enumerate(trajectories):
        if not isinstance(traj, Trajectory):
            raise ArgumentTypeError(f"expected a Trajectory, got {type(traj).__name__}", where=f"trajectories[{i}]")
        if not is_name(traj.tenant):
            raise InvalidTrajectoryError(
                f"{traj.tenant[:80]!r} is not a tenant name (1-64 "
                "characters: letters, digits, '_', '.', '-', starting with a letter or digit)",
                where=f"trajectories[{i}].tenant",
            )


def prepare_items(
    trajectories: Sequence[Trajectory], vectors: Any, dim: int, features: str = "roles"
) -> list[BatchItem]:
    """Batch items from trajectories and their task vectors (validated, normalised), with the
    workflow featurizer ``features`` (``evolution.workflow_features``)."""
    return _featurized(trajectories, unit_rows(vectors, len(trajectories), dim, "vectors"), features)


def _featurized(trajectories: Sequence[Trajectory], vectors: np.ndarray, features: str) -> list[BatchItem]:
    items: list[BatchItem] = []
    for traj, vec in zip(trajectories, vectors, strict=True):
        tokens, wvec = featurize(traj, features, WORKFLOW_DIM)
        items.append(BatchItem.of(traj, vec, wvec, tokens, workflow_summary(tokens)))
    return items


def pack_trajectories(trajectories: Sequence[Trajectory], vectors: Any, dim: int, features: str = "roles") -> ItemBatch:
    """Trajectories ready to travel: encoded once, tokens and workflow vectors computed.

    Without ``vectors`` the task vectors are zeros, to be embedded where a model is
    (the coordinator's embedder actors)."""
    check_trajectories(trajectories)
    vecs = (
        np.zeros((len(trajectories), dim), np.float32)
        if vectors is None
        else unit_rows(vectors, len(trajectories), dim, "vectors")
    )
    return ItemBatch.of(_featurized(trajectories, vecs, features), features)
