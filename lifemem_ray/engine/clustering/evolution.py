"""Memory evolution for one batch: who joins which cluster, who opens a new one.

Pure planning, no I/O: given the batch's items, their stored neighbours and the
live clusters, :class:`BatchPlanner` returns a placement per item and the
resulting cluster states. The caller commits them in one transaction.

Items are decided in order and each sees the clusters opened earlier in the
same batch (provisional, negative ids), so several trajectories of one batch
that start the same new workflow open one cluster, not several.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from lifemem_ray.core.decisions import AssignRequest, Candidate, ClusterView, Decider
from lifemem_ray.core.model import Trajectory
from lifemem_ray.core.tenancy import display_envs, id_key, scope, scope_tenant
from lifemem_ray.engine.clustering.clusters import MAX_FLOWS, ClusterRecord, add_member, fold_member, new_cluster_record
from lifemem_ray.engine.clustering.policy import OfflinePolicy
from lifemem_ray.engine.memory_config import EvolutionConfig
from lifemem_ray.llm.llm_config import LLMConfig

__all__ = [
    "MAX_FLOWS",
    "MAX_PROVISIONAL_CANDIDATES",
    "BatchItem",
    "BatchPlan",
    "BatchPlanner",
    "CandidateArrays",
    "CandidateSet",
    "ItemBatch",
    "Placement",
    "add_member",
    "fold_member",
    "new_cluster_record",
]

log = logging.getLogger(__name__)

# The default of ``evolution.max_provisional_candidates`` (the coordinator reads this name).
MAX_PROVISIONAL_CANDIDATES = EvolutionConfig().max_provisional_candidates


@dataclass(slots=True)
class BatchItem:
    """One trajectory on its way into a store: what evolution needs, and its stored form.

    ``record`` is the msgpack record the store writes as is, so a trajectory is encoded
    once, where it enters (possibly a client process), never again on the way.
    """

    id: str  # the id key (tenancy.id_key: the caller's id, tenant-qualified for a tenant other than the default)
    env: str  # the scope (tenancy.scope: the environment, tenant-qualified likewise): what the engine partitions by
    query: str  # the task text (first 300 characters)
    success: bool | None
    fingerprint: str
    record: bytes
    vec: np.ndarray  # unit text vector
    wvec: np.ndarray  # unit workflow vector
    tokens: list[str]
    flow: str  # readable workflow summary
    vid: int = 0
    stored: bool = False  # already in the store, waiting for initialisation
    _traj: Trajectory | None = None

    @property
    def traj(self) -> Trajectory:
        """The trajectory itself (decoded on demand: only LLM prompts need it)."""
        if self._traj is None:
            from lifemem_ray.core.records import decode_trajectory

            self._traj = decode_trajectory(self.record)[0]
        return self._traj

    @classmethod
    def of(
        cls,
        traj: Trajectory,
        vec: np.ndarray,
        wvec: np.ndarray,
        tokens: list[str],
        flow: str,
        *,
        vid: int = 0,
        stored: bool = False,
    ) -> BatchItem:
        from lifemem_ray.core.records import encode_trajectory

        return cls(
            id=id_key(traj.tenant, traj.id),
            env=scope(traj.tenant, traj.env),
            query=traj.query_text[:300],
            success=traj.outcome.success,
            fingerprint=traj.fingerprint,
            record=encode_trajectory(traj, tokens, time.time()),
            vec=vec,
            wvec=wvec,
            tokens=tokens,
            flow=flow,
            vid=vid,
            stored=stored,
            _traj=traj,
        )


@dataclass
class ItemBatch:
    """Batch items in columns: a few lists and two matrices pickle far faster than
    thousands of small objects, which is what crosses process boundaries on Ray."""

    ids: list[str]
    envs: list[str]
    queries: list[str]
    successes: list[bool | None]
    fingerprints: list[str]
    records: list[bytes]
    vecs: np.ndarray  # (n, dim) float32
    wvecs: np.ndarray  # (n, wdim) float32
    tokens: list[list[str]]
    flows: list[str]
    features: str  # the workflow featurizer that computed wvecs (evolution.workflow_features)

    def __len__(self) -> int:
        return len(self.ids)

    @classmethod
    def of(cls, items: Sequence[BatchItem], features: str) -> ItemBatch:
        return cls(
            ids=[it.id for it in items],
            envs=[it.env for it in items],
            queries=[it.query for it in items],
            successes=[it.success for it in items],
            fingerprints=[it.fingerprint for it in items],
            records=[it.record for it in items],
            vecs=np.stack([it.vec for it in items]) if items else np.zeros((0, 0), np.float32),
            wvecs=np.stack([it.wvec for it in items]) if items else np.zeros((0, 0), np.float32),
            tokens=[it.tokens for it in items],
            flows=[it.flow for it in items],
            features=features,
        )

    def items(self) -> list[BatchItem]:
        return [
            BatchItem(i, e, q, s, f, r, v, w, t, fl)
            for i, e, q, s, f, r, v, w, t, fl in zip(
                self.ids,
                self.envs,
                self.queries,
                self.successes,
                self.fingerprints,
                self.records,
                self.vecs,
                self.wvecs,
                self.tokens,
                self.flows,
                strict=True,
            )
        ]

    def select(self, positions: Sequence[int]) -> ItemBatch:
        pos = list(positions)
        return ItemBatch(
            ids=[self.ids[i] for i in pos],
            envs=[self.envs[i] for i in pos],
            queries=[self.queries[i] for i in pos],
            successes=[self.successes[i] for i in pos],
            fingerprints=[self.fingerprints[i] for i in pos],
            records=[self.records[i] for i in pos],
            vecs=self.vecs[pos] if pos else self.vecs[:0],
            wvecs=self.wvecs[pos] if pos else self.wvecs[:0],
            tokens=[self.tokens[i] for i in pos],
            flows=[self.flows[i] for i in pos],
            features=self.features,
        )


@dataclass(slots=True)
class Placement:
    cluster: int  # a live cluster id (> 0) or a provisional one (< 0)
    op: str  # init | join | new
    by: str  # offline | llm | fallback
    score: float = 0.0
    description: str | None = None


@dataclass
class CandidateSet:
    """What a store knows about a batch: per item its top-k neighbours' clusters and the
    best-scoring clusters overall, both as (cluster id, score), and those clusters' states."""

    neighbours: list[list[tuple[int, float]]]
    extra: list[list[tuple[int, float]]]
    clusters: dict[int, ClusterRecord]
    scopes: dict[str, ScopeSums] = field(default_factory=dict)  # the batch's environments' running sums


@dataclass
class ScopeSums:
    """An environment's (a scope's) members summed over its clusters: how alike the
    environment's trajectories are as a whole, which a cluster's join threshold is set
    against (``policy.env_contrast``, see :meth:`OfflinePolicy.threshold`)."""

    count: int
    tsum: np.ndarray  # (dim,) float64 sum of the members' unit text vectors
    wsum: np.ndarray  # (wdim,) float64 sum of their unit workflow vectors

    def add(self, other: ScopeSums) -> None:
        self.count += other.count
        self.tsum = self.tsum + other.tsum
        self.wsum = self.wsum + other.wsum

    def copy(self) -> ScopeSums:
        return ScopeSums(self.count, self.tsum.copy(), self.wsum.copy())


def scope_sums(clusters: Iterable[ClusterRecord], scopes: Iterable[str]) -> dict[str, ScopeSums]:
    """Per scope of ``scopes``: the sums of the live clusters that hold that scope alone (a
    cluster holding several environments counts for none of them)."""
    wanted = set(scopes)
    out: dict[str, ScopeSums] = {}
    for record in clusters:
        if record.count <= 0 or record.split_into is not None or len(record.envs) != 1:
            continue
        env = next(iter(record.envs))
        if env not in wanted:
            continue
        got = out.get(env)
        if got is None:
            out[env] = ScopeSums(record.count, record.tsum.astype(np.float64), record.wsum.astype(np.float64))
        else:
            got.add(ScopeSums(record.count, record.tsum, record.wsum))
    return out


@dataclass
class CandidateArrays:
    """:class:`CandidateSet` as arrays, padded with cluster id -1 (score -inf): what a shard
    sends, cheap to build, pickle and merge for thousands of items at once."""

    neighbour_ids: np.ndarray  # (n, k) int64 cluster ids of the top-k stored neighbours, best first
    neighbour_scores: np.ndarray  # (n, k) float32
    extra_ids: np.ndarray  # (n, m) int64 best clusters by centroid score, best first
    extra_scores: np.ndarray  # (n, m) float32
    clusters: dict[int, ClusterRecord]
    scopes: dict[str, ScopeSums] = field(default_factory=dict)  # the store's sums of the batch's environments

    def to_set(self) -> CandidateSet:
        return CandidateSet(
            neighbours=_rows(self.neighbour_ids, self.neighbour_scores),
            extra=_rows(self.extra_ids, self.extra_scores),
            clusters=self.clusters,
            scopes=self.scopes,
        )

    @staticmethod
    def merge(parts: Sequence[CandidateArrays], k: int, m: int) -> CandidateSet:
        """The global top-k neighbours and top-m clusters over several stores' candidates
        (stable: equal scores keep the stores' order)."""
        clusters: dict[int, ClusterRecord] = {}
        scopes: dict[str, ScopeSums] = {}
        for part in parts:
            clusters.update(part.clusters)
            for env, sums in part.scopes.items():  # a cluster lives on one store: the stores' sums add up
                if env in scopes:
                    scopes[env].add(sums)
                else:
                    scopes[env] = sums.copy()
        return CandidateSet(
            neighbours=_rows(
                *_top(np.hstack([p.neighbour_ids for p in parts]), np.hstack([p.neighbour_scores for p in parts]), k)
            ),
            extra=_rows(*_top(np.hstack([p.extra_ids for p in parts]), np.hstack([p.extra_scores for p in parts]), m)),
            clusters=clusters,
            scopes=scopes,
        )


def _top(ids: np.ndarray, scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    if ids.shape[1] == 0:
        return ids, scores
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(ids, order, 1), np.take_along_axis(scores, order, 1)


def _rows(ids: np.ndarray, scores: np.ndarray) -> list[list[tuple[int, float]]]:
    return [
        [(c, s) for c, s in zip(row_c, row_s, strict=True) if c >= 0]
        for row_c, row_s in zip(ids.tolist(), scores.tolist(), strict=True)
    ]


@dataclass
class BatchPlan:
    placements: list[Placement]
    clusters: dict[int, ClusterRecord]  # working states while planning (the store recomputes them at commit)
    llm_requests: int = 0
    llm_fallbacks: int = 0
    llm_skipped: int = 0  # decided offline because the offline answer was unambiguous


def top_k_rows(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's ``k`` best columns (unordered) and their scores: the neighbour selection
    every in-batch search uses (the planner's within a batch, the coordinator's against the
    batch committed just before)."""
    kk = min(k, scores.shape[1])
    top = np.argpartition(-scores, kk - 1, axis=1)[:, :kk]
    return top, np.take_along_axis(scores, top, 1)


def _earlier_neighbours(
    vecs: np.ndarray, k: int, w: int, groups: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """For each item, its k most similar items among the ``w`` before it
    (``evolution.in_batch_window``; index -1 where there are fewer) of the same group
    (``groups``: a code per item: the environment's scope, or the tenant), so another
    environment's or tenant's items of the batch never take a neighbour's place. Blocked,
    so a large batch costs linear time: the clusters opened further back in the batch are
    candidates anyway (see :meth:`BatchPlanner.plan`)."""
    n = len(vecs)
    sims = np.full((n, k), -np.inf, dtype=np.float32)
    idx = np.full((n, k), -1, dtype=np.int64)
    for start in range(0, n, w):
        stop = min(n, start + w)
        lo = max(0, start - w)
        block = vecs[start:stop] @ vecs[lo:stop].T  # rows: this block; columns: window + block
        rows = np.arange(start, stop)[:, None]
        cols = np.arange(lo, stop)[None, :]
        keep = (cols < rows) & (cols >= rows - w)
        if groups is not None:
            keep &= groups[lo:stop][None, :] == groups[start:stop][:, None]
        block = np.where(keep, block, -np.inf)
        top, top_s = top_k_rows(block, k)
        kk = top.shape[1]
        valid = np.isfinite(top_s)
        sims[start:stop, :kk] = np.where(valid, top_s, -np.inf)
        idx[start:stop, :kk] = np.where(valid, top + lo, -1)
    return sims, idx


class _SumNorms:
    """Norms of clusters' running sums, recomputed only when a cluster changed (its version):
    most candidates of an item are scored again for the next items unchanged."""

    def __init__(self) -> None:
        self._cache: dict[int, tuple[int, int, float, float]] = {}

    def of(self, record: ClusterRecord) -> tuple[float, float]:
        got = self._cache.get(id(record))
        if got is not None and got[0] == record.version and got[1] == record.count:
            return got[2], got[3]
        tn = math.sqrt(float(record.tsum @ record.tsum))
        wn = math.sqrt(float(record.wsum @ record.wsum))
        self._cache[id(record)] = (record.version, record.count, tn, wn)
        return tn, wn


@dataclass
class _PlanState:
    """What :meth:`BatchPlanner.plan` carries from one item to the next."""

    plan: BatchPlan
    lowest: int  # the last provisional (negative) cluster id handed out
    provisional_by_env: dict[str, list[int]] = field(default_factory=dict)
    candidates_of: list[list[Candidate]] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    norms: _SumNorms = field(default_factory=lambda: _SumNorms())
    scopes: dict[str, ScopeSums] = field(
        default_factory=dict
    )  # the environments' sums, with this batch's items placed so far


class BatchPlanner:
    def __init__(
        self,
        live: dict[int, ClusterRecord],
        policy: OfflinePolicy,
        config: EvolutionConfig,
        *,
        dim: int,
        wdim: int,
        decider: Decider | None = None,
        llm_config: LLMConfig | None = None,
    ) -> None:
        self.live = live
        self.policy = policy
        self.config = config
        self.dim = dim
        self.wdim = wdim
        self.decider = decider
        self.llm_config = llm_config or LLMConfig()

    def plan(
        self,
        items: Sequence[BatchItem],
        neighbours: Sequence[Sequence[tuple[int, float]]],
        init_count: int = 0,
        extra: Sequence[Sequence[int]] | None = None,
        scopes: dict[str, ScopeSums] | None = None,
    ) -> BatchPlan:
        """Place every item.

        ``neighbours[i]`` are (cluster id, similarity) of item i's nearest stored
        trajectories, best first; ``extra[i]`` are further candidate clusters (found by
        centroid similarity). The first ``init_count`` items form the initial memory:
        they are partitioned among themselves. ``scopes``: the stored sums of the items'
        environments (:func:`scope_sums`; missing ones count as empty).
        """
        now = time.time()
        n = len(items)
        vecs = np.stack([it.vec for it in items]) if n else np.zeros((0, self.dim), np.float32)
        # Sums are float64: compare in float64 (a mixed-dtype dot would cast on every call).
        vec64 = vecs.astype(np.float64)
        wvec64 = np.stack([it.wvec for it in items]).astype(np.float64) if n else np.zeros((0, self.wdim))
        # In-batch neighbours come from where stored ones do: the item's environment (its scope,
        # tenant included) with neighbour_scope "env", else anywhere in its tenant.
        groups_of = [it.env if self.config.neighbour_scope == "env" else scope_tenant(it.env) for it in items]
        codes = {g: c for c, g in enumerate(dict.fromkeys(groups_of))}
        neighbour_groups = np.asarray([codes[g] for g in groups_of], dtype=np.int32) if len(codes) > 1 else None
        near_s, near_j = _earlier_neighbours(vecs, self.config.top_k, self.config.in_batch_window, neighbour_groups)
        near = (near_s.tolist(), near_j.tolist())  # Python floats: the loop below is per item
        plan = BatchPlan(placements=[], clusters={})
        groups = self._partition(plan, items[:init_count]) if self.decider is not None and init_count >= 2 else None
        init_labels, init_descriptions = groups if groups is not None else (None, [])
        state = _PlanState(plan, -(max(init_labels) + 1) if init_labels else 0)  # the last provisional id handed out
        state.scopes = {env: sums.copy() for env, sums in (scopes or {}).items()}
        if init_labels:
            for label, it in zip(init_labels, items, strict=False):  # labels cover the first init_count items
                ids = state.provisional_by_env.setdefault(it.env, [])
                if -(label + 1) not in ids:
                    ids.append(-(label + 1))
        for i, item in enumerate(items):
            if init_labels is not None and i < init_count:
                plan.placements.append(
                    Placement(
                        cluster=-(init_labels[i] + 1),
                        op="init",
                        by="llm",
                        description=init_descriptions[init_labels[i]] or None,
                    )
                )
                state.candidates_of.append([])
                state.margins.append(1.0)
                self._apply(plan.clusters, plan.placements[i].cluster, item, now, born="init")
                self._count_in_scope(state, item)
                continue
            hits = self._hits(
                i,
                item,
                state,
                [] if i < init_count else neighbours[i],
                near,
                extra[i] if extra is not None and i >= init_count else (),
            )
            self._place_one(i, item, hits, vec64[i], wvec64[i], state, init_count, now)
        if self.decider is not None and n > init_count:
            self._ask_decider(plan, items, state.candidates_of, state.margins, init_count)
        return plan

    def _hits(
        self,
        i: int,
        item: BatchItem,
        state: _PlanState,
        stored: Sequence[tuple[int, float]],
        near: tuple[list[list[float]], list[list[int]]],
        extra: Sequence[int],
    ) -> dict[int, int]:
        """Item i's candidate clusters, each with its number of top-k neighbours in it: the
        top-k among its stored neighbours and the earlier items of this batch, the ``extra``
        clusters, and the clusters opened earlier in this batch in its environment (not in
        the centroid search yet: the last ``evolution.max_provisional_candidates`` of them)."""
        placements = state.plan.placements
        pool: list[tuple[float, int]] = [(s, c) for c, s in stored]
        for sim, j in zip(near[0][i], near[1][i], strict=True):
            if j >= 0:
                pool.append((float(sim), placements[j].cluster))
        pool.sort(key=lambda sc: -sc[0])
        hits: dict[int, int] = {}
        for _, cid in pool[: self.config.top_k]:
            hits[cid] = hits.get(cid, 0) + 1
        for cid in extra:
            hits.setdefault(cid, 0)
        for cid in state.provisional_by_env.get(item.env, ())[-self.config.max_provisional_candidates :]:
            hits.setdefault(cid, 0)
        return hits

    def _place_one(
        self,
        i: int,
        item: BatchItem,
        hits: dict[int, int],
        vec64: np.ndarray,
        wvec64: np.ndarray,
        state: _PlanState,
        init_count: int,
        now: float,
    ) -> None:
        """Score item i against its candidates and join the best one that passes, or open a
        new (provisional) cluster."""
        work = state.plan.clusters
        scored: list[tuple[float, int, float, float]] = []
        thresholds: list[float] = []
        tenant = scope_tenant(item.env)
        env = state.scopes.get(item.env) if self.policy.config.env_contrast > 0 else None
        env_norms = (
            (env.count, math.sqrt(float(env.tsum @ env.tsum)), math.sqrt(float(env.wsum @ env.wsum)))
            if env is not None
            else None
        )
        for cid in hits:
            record = work.get(cid) or self.live.get(cid)
            if record is None or record.count == 0 or record.tenant != tenant:
                continue  # clusters never mix tenants, whatever a search or an earlier item of the batch suggested
            tn, wn = state.norms.of(record)
            ts = float(vec64 @ record.tsum) / tn if tn > 0 else 0.0
            ws = float(wvec64 @ record.wsum) / wn if wn > 0 else 0.0
            scored.append((self.policy.score(ts, ws), cid, ts, ws))
            thresholds.append(self.policy.threshold(record.count, tn, wn, env_norms))
        order = sorted(range(len(scored)), key=lambda j: -scored[j][0])
        scored = [scored[j] for j in order]
        thresholds = [thresholds[j] for j in order]
        candidates: list[Candidate] = []
        if self.decider is not None:
            for score, cid, ts, ws in scored:
                record = work.get(cid) or self.live[cid]
                view = ClusterView(
                    id=cid, count=record.count, description=record.description, envs=display_envs(record.envs)
                )
                candidates.append(Candidate(view, score, ts, ws, hits[cid]))
        choice, margin = self.policy.decide([x[0] for x in scored], thresholds)
        by = "fallback" if i < init_count and self.decider is not None and init_count >= 2 else "offline"
        if choice is None:
            state.lowest -= 1
            cid = state.lowest
            state.provisional_by_env.setdefault(item.env, []).append(cid)
            op = "init" if i < init_count else "new"
            score = scored[0][0] if scored else 0.0
        else:
            score, cid = scored[choice][0], scored[choice][1]
            op = "init" if i < init_count else "join"
        state.plan.placements.append(Placement(cluster=cid, op=op, by=by, score=score))
        state.candidates_of.append(candidates)
        state.margins.append(margin)
        self._apply(work, cid, item, now, born="init" if i < init_count else "new")
        self._count_in_scope(state, item)

    def _count_in_scope(self, state: _PlanState, item: BatchItem) -> None:
        """Add a placed item to its environment's sums (later items of the batch see it); only
        the environment contrast reads them."""
        if self.policy.config.env_contrast <= 0:
            return
        sums = state.scopes.get(item.env)
        if sums is None:
            state.scopes[item.env] = ScopeSums(1, item.vec.astype(np.float64), item.wvec.astype(np.float64))
        else:
            sums.count += 1
            sums.tsum += item.vec
            sums.wsum += item.wvec

    def _partition(self, plan: BatchPlan, items: Sequence[BatchItem]) -> tuple[list[int], list[str]] | None:
        """Initial groups from the LLM as dense labels 0..g-1 with a description each, or None
        (offline instead). Each tenant's items are partitioned by their own call: a group
        never holds two tenants."""
        assert self.decider is not None
        by_tenant: dict[str, list[int]] = {}
        for i, it in enumerate(items):
            by_tenant.setdefault(scope_tenant(it.env), []).append(i)
        out = [0] * len(items)
        described: list[str] = []
        for positions in by_tenant.values():
            if len(positions) == 1:
                out[positions[0]] = len(described)
                described.append("")
                continue
            groups = self.decider.partition([items[i].traj for i in positions])
            plan.llm_requests += 1
            if groups is None or len(groups[0]) != len(positions):
                plan.llm_fallbacks += len(items)
                return None
            labels, descriptions = groups
            dense: dict[int, int] = {}
            for i, label in zip(positions, labels, strict=True):
                out[i] = len(described) + dense.setdefault(label, len(dense))
            start = len(described)
            described.extend([""] * len(dense))
            for label, d in dense.items():
                described[start + d] = descriptions[label] if 0 <= label < len(descriptions) else ""
        return out, described

    # -- internals -------------------------------------------------------------------------
    def _apply(self, work: dict[int, ClusterRecord], cid: int, item: BatchItem, now: float, born: str) -> None:
        record = work.get(cid)
        if record is None:
            base = self.live.get(cid)
            record = base.copy() if base is not None else new_cluster_record(cid, self.dim, self.wdim, born, now)
            work[cid] = record
        add_member(record, item, now)

    def _ask_decider(
        self,
        plan: BatchPlan,
        items: Sequence[BatchItem],
        candidates_of: list[list[Candidate]],
        margins: list[float],
        init_count: int,
    ) -> None:
        """Let the LLM decide what the offline pass found ambiguous; keep offline answers otherwise."""
        assert self.decider is not None
        placements = plan.placements
        asked: list[AssignRequest] = []
        skip = self.llm_config.skip_confident
        for i in range(init_count, len(items)):
            cands = candidates_of[i]
            if not cands:
                plan.llm_skipped += 1  # nothing to choose from: a new cluster is the only answer
                continue
            if skip and margins[i] >= self.policy.config.confident_margin:
                plan.llm_skipped += 1
                continue
            views = tuple(self._view(c, placements, items) for c in cands)
            asked.append(AssignRequest(key=i, trajectory=items[i].traj, candidates=views))
        if asked:
            answers = self.decider.assign(asked)
            plan.llm_requests += len(asked)
            groups: dict[tuple[str, str], int] = {}
            next_new = min([p.cluster for p in placements if p.cluster < 0], default=0) - 1
            for request, answer in zip(asked, answers, strict=False):  # a Decider may answer fewer: None
                i = request.key
                allowed = {c.cluster.id for c in request.candidates}
                if answer is None or (answer.cluster_id is not None and answer.cluster_id not in allowed):
                    plan.llm_fallbacks += 1
                    placements[i].by = "fallback"
                    continue
                if answer.cluster_id is not None:
                    placements[i] = Placement(cluster=answer.cluster_id, op="join", by="llm", score=placements[i].score)
                    continue
                if placements[i].op == "new" and not answer.new_group:
                    placements[i] = Placement(
                        cluster=placements[i].cluster, op="new", by="llm", description=answer.description
                    )
                    continue
                key = (scope_tenant(items[i].env), answer.new_group or f"item-{i}")  # a new group never spans tenants
                if key not in groups:
                    groups[key] = next_new
                    next_new -= 1
                placements[i] = Placement(cluster=groups[key], op="new", by="llm", description=answer.description)

    def _view(self, candidate: Candidate, placements: list[Placement], items: Sequence[BatchItem]) -> Candidate:
        cid = candidate.cluster.id
        if cid > 0:
            return candidate
        founder = next(i for i, p in enumerate(placements) if p.cluster == cid)
        view = ClusterView(
            id=cid,
            count=candidate.cluster.count,
            description=f"A workflow opened earlier in this batch: {items[founder].flow}",
            envs=candidate.cluster.envs,
            examples=(items[founder].traj,),
        )
        return Candidate(
            view, candidate.score, candidate.text_similarity, candidate.workflow_similarity, candidate.neighbour_hits
        )
