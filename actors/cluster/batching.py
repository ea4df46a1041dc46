"""The coordinator's micro-batch ingest, without Ray: stages over an injected set of shards.

:class:`BatchIngest` runs one micro-batch (the trajectories of one or more client requests)
through the stages of a sharded add, calling the shards through a :class:`ShardSet`
(by index: ``known``, ``candidates``, ``commit``, ``add_items``, ``info``) and the task
embedder through an async function. The Ray actor (:mod:`.coordinator`) gives it actor
handles and keeps only the request queue, backpressure and pipelining; tests give it
in-process shards (:class:`LocalShards`).

1. :meth:`BatchIngest.front` asks every shard which ids it holds, classifies them with
   the engine's rules (:func:`lifemem_ray.engine.ingest_rules.classify_ids`: a request with a
   conflict is rejected whole, other requests of the micro-batch go on, a repeat with the
   same content is a duplicate of its first occurrence), embeds the task texts that came
   without vectors, validates the vectors (:func:`~lifemem_ray.engine.ingest_rules.unit_rows`; a
   request with a zero or non-finite vector is rejected) and, once the memory is
   initialised, asks every shard for candidate clusters in one fan-out.
2. :meth:`BatchIngest.back` classifies again against what the previous (pipelined) batch
   stored, makes the candidates as if looked up after that commit (:func:`absorb_previous`),
   plans the whole micro-batch as the engine does (:func:`~lifemem_ray.engine.ingest_rules.make_planner`),
   routes each write (:func:`route`), commits on the shards and returns each request's
   results or error and what the batch stored (:class:`Committed`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.routing import RoutingTable
from lifemem_ray.core.decisions import Decider
from lifemem_ray.core.errors import (
    ConfigError,
    EmbeddingError,
    ShardUnavailableError,
    UnknownClusterError,
)
from lifemem_ray.engine.clustering.evolution import (
    BatchPlan,
    CandidateArrays,
    CandidateSet,
    ItemBatch,
    Placement,
    ScopeSums,
    top_k_rows,
)
from lifemem_ray.engine.clustering.policy import OfflinePolicy
from lifemem_ray.engine.ingest_rules import (
    AddResult,
    IdClasses,
    caller_results,
    classify_ids,
    conflict_error,
    make_planner,
    plan_counters,
    unit_rows,
)
from lifemem_ray.engine.state import WORKFLOW_DIM

if TYPE_CHECKING:
    from lifemem_ray.engine.store.storage import ClusterRecord

__all__ = ["BatchIngest", "Committed", "LocalShards", "ShardSet", "Stage", "absorb_previous", "concat_batches", "route"]

log = logging.getLogger(__name__)

Found = tuple[CandidateSet, dict[int, int]]  # merged candidates, cluster -> owning shard
Embed = Callable[[list[str]], Awaitable[np.ndarray]]


class ShardSet(ABC):
    """The shards of a deployment by index, as the batching pipeline calls them: the typed calls
    are written here once; a subclass says only how a call travels (:meth:`call`), in process
    (:class:`LocalShards`) or to named actors
    (:class:`~lifemem_ray.actors.cluster.ray_shards.RayShards`). Every method may raise
    :class:`~lifemem_ray.core.errors.ShardUnavailableError`."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    async def call(self, shard: int, method: str, *args: Any) -> Any:
        """Run ``method`` of :class:`~lifemem_ray.engine.protocols.ShardProtocol` on shard ``shard``."""

    async def known(self, shard: int, ids: list[str], fingerprints: list[str]) -> list[AddResult | None]:
        return await self.call(shard, "known", ids, fingerprints)

    async def candidates(
        self, shard: int, vectors: np.ndarray, workflow_vectors: np.ndarray, envs: list[str]
    ) -> CandidateArrays:
        return await self.call(shard, "candidates", vectors, workflow_vectors, envs)

    async def commit(
        self, shard: int, batch: ItemBatch, placements: list[Placement], counters: dict[str, int] | None
    ) -> tuple[list[AddResult], dict[int, ClusterRecord]]:
        return await self.call(shard, "commit", batch, placements, counters)

    async def add_items(self, shard: int, batch: ItemBatch) -> list[AddResult]:
        return await self.call(shard, "add_items", batch)

    async def info(self, shard: int) -> dict[str, Any]:
        """At least ``trajectories`` (stored on the shard) and ``initialised``."""
        return await self.call(shard, "info")


class LocalShards(ShardSet):
    """A :class:`ShardSet` over in-process shard objects (engine shards, or
    :class:`~lifemem_ray.actors.cluster.shard_actor.MemoryShard` objects made without Ray): each
    call runs in a thread, as an actor's would run in its own process."""

    def __init__(self, shards: Sequence[Any]) -> None:
        self.shards = list(shards)  # by index, as the routing numbers them

    def __len__(self) -> int:
        return len(self.shards)

    async def call(self, shard: int, method: str, *args: Any) -> Any:
        return await asyncio.to_thread(getattr(self.shards[shard], method), *args)

    async def info(self, shard: int) -> dict[str, Any]:
        # MemoryShard.info also names the Ray node; only these two are needed here.
        memory = self.shards[shard].memory
        return {"trajectories": len(memory), "initialised": memory.initialised}


@dataclass
class Stage:
    """One micro-batch on its way through :class:`BatchIngest`."""

    whole: ItemBatch
    sizes: list[int]  # trajectories per request
    embedded: list[bool]  # per request: False when its task vectors are still to be computed
    owner: list[int] = field(default_factory=list)  # per position: its request
    stored: list[tuple[str, int | None] | None] = field(default_factory=list)  # per position: what a store holds
    failed: dict[int, Exception] = field(default_factory=dict)  # request -> why it is rejected
    kept: list[int] = field(default_factory=list)  # positions of the requests not rejected
    classes: IdClasses | None = None  # the kept positions' ids, classified
    fresh: list[int] = field(default_factory=list)  # positions to store
    ready: set[int] = field(default_factory=set)  # positions whose vectors are checked and normalised
    found: Found | None = None
    error: Exception | None = None

    def __post_init__(self) -> None:
        if not self.owner:
            self.owner = [r for r, n in enumerate(self.sizes) for _ in range(n)]

    @property
    def count(self) -> int:
        return len(self.whole)


@dataclass
class Committed:
    """What a micro-batch stored: the next batch, looked up before this commit, is planned with it."""

    stored: dict[str, tuple[str, int | None]] = field(default_factory=dict)  # id -> (fingerprint, cluster)
    vecs: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))  # the added trajectories
    wvecs: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))  # their workflow vectors
    envs: list[str] = field(default_factory=list)
    clusters: list[int] = field(default_factory=list)  # their clusters
    states: dict[int, ClusterRecord] = field(default_factory=dict)  # the touched clusters after the commit
    owner: dict[int, int] = field(default_factory=dict)  # cluster -> shard
    opened: dict[str, list[int]] = field(default_factory=dict)  # env -> clusters this batch opened

    def note_added(self, cluster: int, env: str, *, opened: bool) -> None:
        self.clusters.append(cluster)
        if opened:
            mine = self.opened.setdefault(env, [])
            if cluster not in mine:
                mine.append(cluster)


class BatchIngest:
    """The stages of a sharded add (see the module docstring); state: the routing table,
    the shards' loads, whether the memory is initialised, counters and stage timings."""

    def __init__(
        self,
        config: DeploymentConfig,
        shards: ShardSet,
        routing: RoutingTable,
        dim: int,
        *,
        embed: Embed | None = None,
        decider: Decider | None = None,
    ) -> None:
        self.config = config
        self.shards = shards
        self.routing = routing
        self.dim = dim
        self.embed = embed
        self.decider = decider
        self.policy = OfflinePolicy(config.policy)
        self.loads: list[int] = list(routing.get_meta("shard_loads", [0] * len(shards)))
        self.initialised = bool(routing.get_meta("initialised", False))
        self.counters = {"batches": 0, "trajectories": 0, "duplicates": 0, "rejected": 0}
        # Seconds spent per stage, to see where time goes. With pipelining the next batch's
        # known/candidates overlap this batch's plan, which includes waiting for them, so
        # the stages add up to more than the wall time.
        self.stage_seconds = {"known": 0.0, "embed": 0.0, "candidates": 0.0, "plan": 0.0, "commit": 0.0}

    # -- 1. the shard-side half: ids, vectors, candidates ---------------------------------------
    async def front(self, batches: Sequence[ItemBatch], embedded: Sequence[bool]) -> Stage:
        """Never raises: a failure is kept in the stage and fails its requests in :meth:`back`."""
        self.counters["batches"] += 1
        stage = Stage(concat_batches(list(batches)), [len(b) for b in batches], list(embedded))
        try:
            whole = stage.whole
            t0 = time.perf_counter()
            known = await asyncio.gather(
                *[self.shards.known(s, whole.ids, whole.fingerprints) for s in range(len(self.shards))]
            )
            self.stage_seconds["known"] += time.perf_counter() - t0
            stage.stored = [
                _as_stored(fp, next((k[i] for k in known if k[i] is not None), None))
                for i, fp in enumerate(whole.fingerprints)
            ]
            await self.settle(stage)
            if stage.fresh and self.initialised:
                stage.found = await self.candidates(whole, stage.fresh)
        except Exception as exc:  # noqa: BLE001 - not lost: the stage's requests fail with it
            stage.error = exc
        return stage

    async def settle(self, stage: Stage) -> None:
        """Classify the ids of the requests not rejected, then embed and check the fresh
        positions' vectors, until no further request is rejected (a rejected request's
        first occurrence of an id passes to the next request that repeats it)."""
        whole, owner, failed = stage.whole, stage.owner, stage.failed
        while True:
            kept = [i for i in range(len(whole)) if owner[i] not in failed]
            classes = classify_ids(
                [whole.ids[i] for i in kept], [whole.fingerprints[i] for i in kept], [stage.stored[i] for i in kept]
            )
            if classes.conflicts:
                per_request: dict[int, list[tuple[int, str]]] = {}
                for j, why in classes.conflicts:
                    per_request.setdefault(owner[kept[j]], []).append((j, why))
                for r, conflicts in per_request.items():
                    failed[r] = conflict_error(conflicts)
                continue
            stage.kept, stage.classes = kept, classes
            stage.fresh = [kept[j] for j in classes.fresh]
            need = [i for i in stage.fresh if i not in stage.ready and not stage.embedded[owner[i]]]
            if need:
                t0 = time.perf_counter()
                whole.vecs[need] = await self._embed([whole.queries[i] for i in need])
                self.stage_seconds["embed"] += time.perf_counter() - t0
            rows_of: dict[int, list[int]] = {}
            for i in stage.fresh:
                if i not in stage.ready:
                    rows_of.setdefault(owner[i], []).append(i)
            rejected = False
            for r, rows in rows_of.items():
                error = self._check_vectors(whole, rows)
                if error is not None:
                    failed[r] = error
                    rejected = True
                else:
                    stage.ready.update(rows)
            if not rejected:
                return

    def _check_vectors(self, whole: ItemBatch, rows: list[int]) -> ValueError | None:
        """Normalise these rows' vectors in place, or the error naming the first bad one."""
        try:
            whole.vecs[rows] = unit_rows(whole.vecs[rows], len(rows), self.dim)
            return None
        except ValueError:
            for i in rows:  # name the trajectory (rare path)
                try:
                    unit_rows(whole.vecs[i], 1, self.dim, what=f"vectors: trajectory {whole.ids[i]!r}")
                except ValueError as exc:
                    return exc
            raise

    async def _embed(self, texts: list[str]) -> np.ndarray:
        if self.embed is None:
            raise EmbeddingError(
                "trajectories came without vectors and the deployment has no embedder actors; pass vectors, or deploy with embedders"
            )
        return await self.embed(texts)

    async def candidates(self, whole: ItemBatch, positions: list[int]) -> Found:
        """Every shard's candidates for these positions of the batch, merged (one fan-out)."""
        t0 = time.perf_counter()
        vecs, wvecs, envs = whole.vecs[positions], whole.wvecs[positions], [whole.envs[i] for i in positions]
        found = await asyncio.gather(*[self.shards.candidates(s, vecs, wvecs, envs) for s in range(len(self.shards))])
        self.stage_seconds["candidates"] += time.perf_counter() - t0
        merged = CandidateArrays.merge(found, self.config.evolution.top_k, self.config.evolution.centroid_candidates)
        owner_of = {cid: shard for shard, part in enumerate(found) for cid in part.clusters}
        return merged, owner_of

    # -- 2. the coordinator-side half: decide, commit, acknowledge ------------------------------
    async def back(
        self,
        stage: Stage,
        previous: Committed | None = None,
        overlap: Callable[[], Awaitable[Any] | None] | None = None,
    ) -> tuple[list[Any], Committed | None]:
        """Decide and commit a micro-batch whose lookups ran before ``previous`` was
        committed (None: after every commit). ``overlap`` is called once planning starts
        (the next batch's lookups); what it returns is awaited before anything is committed.
        Returns per request its results or its error, and what the batch stored."""
        if stage.error is not None:
            raise stage.error
        whole = stage.whole
        looked_up = list(stage.fresh)
        found = stage.found
        if previous is not None and previous.stored:
            for i, tid in enumerate(whole.ids):
                if stage.stored[i] is None and tid in previous.stored:
                    stage.stored[i] = previous.stored[tid]
            await self.settle(stage)
        fresh = stage.fresh
        if found is not None and fresh != looked_up:
            if set(fresh) <= set(looked_up):  # some turned out stored by the previous batch
                row_of = {i: r for r, i in enumerate(looked_up)}
                found = select_rows(found, [row_of[i] for i in fresh])
            else:  # a rejected request passed an id on: look up again, after the previous commit
                found, previous = None, None
        self.counters["rejected"] += len(stage.failed)

        placed: dict[int, AddResult] = {}
        errors: dict[int, Exception] = {}
        committed: Committed | None = None
        if fresh:
            if found is None and not self.initialised:
                # Only what the initial partition needs goes to shard 0 this way.
                info = await self.shards.info(0)
                need_init = max(0, self.config.evolution.init_size - info["trajectories"])
                placed, errors = await self.add_before_init(fresh[:need_init], whole)
                fresh = fresh[need_init:]
            if fresh and self.initialised:
                if found is None:
                    found = await self.candidates(whole, fresh)
                more, more_errors, committed = await self.decide_and_commit(fresh, whole, found, previous, overlap)
            else:
                more, more_errors = await self.add_before_init(fresh, whole)
            placed.update(more)
            errors.update(more_errors)
        return self._outcomes(stage, placed, errors), committed

    def _outcomes(self, stage: Stage, placed: dict[int, AddResult], errors: dict[int, Exception]) -> list[Any]:
        """Per request: its results, or why it failed (rejected, or a shard failed under it)."""
        assert stage.classes is not None or not stage.kept
        results: list[AddResult | None] = [None] * stage.count
        if stage.classes is not None:
            kept_results = stage.classes.results
            for j, i in enumerate(stage.kept):
                results[i] = placed.get(i, kept_results[j])
            for i in stage.kept:  # repeats report their first occurrence
                if results[i] is None:
                    first = results[stage.kept[stage.classes.first[stage.whole.ids[i]]]]
                    if first is not None:
                        results[i] = AddResult(stage.whole.ids[i], "duplicate", first.cluster_id)
        self.counters["trajectories"] += sum(1 for r in placed.values() if r.status == "added")
        self.counters["duplicates"] += sum(
            1 for i in stage.kept if (result := results[i]) is not None and result.status == "duplicate"
        )
        out: list[Any] = []
        offset = 0
        for r, n in enumerate(stage.sizes):
            mine = results[offset : offset + n]
            error = stage.failed.get(r) or next((errors[i] for i in range(offset, offset + n) if i in errors), None)
            if error is None and any(x is None for x in mine):
                error = ShardUnavailableError(
                    "part of the request was not committed; retry it (ids make adds idempotent)"
                )
            out.append(error if error is not None else caller_results(mine))  # type: ignore[arg-type]
            offset += n
        return out

    async def add_before_init(
        self, positions: list[int], whole: ItemBatch
    ) -> tuple[dict[int, AddResult], dict[int, Exception]]:
        """Until the initial partition exists, trajectories go to shard 0, which runs the
        engine's own initialisation; the initial clusters start there."""
        if not positions:
            return {}, {}
        try:
            out = await self.shards.add_items(0, whole.select(positions))
        except Exception as exc:  # noqa: BLE001 - not lost: these positions' requests fail with it
            return {}, {i: exc for i in positions}
        self.routing.set((r.cluster_id, 0) for r in out if r.cluster_id is not None)
        self.loads[0] += sum(1 for r in out if r.status != "duplicate")
        info = await self.shards.info(0)
        if info["initialised"]:
            self.initialised = True
            self.routing.put_meta("initialised", True)
        self.routing.put_meta("shard_loads", self.loads)
        return dict(zip(positions, out, strict=True)), {}

    async def decide_and_commit(
        self,
        fresh: list[int],
        whole: ItemBatch,
        found: Found,
        previous: Committed | None,
        overlap: Callable[[], Awaitable[Any] | None] | None = None,
    ) -> tuple[dict[int, AddResult], dict[int, Exception], Committed]:
        part = whole.select(fresh)
        plan, owner_of = await self.plan(part, found, previous, overlap)
        return await self.commit(fresh, part, plan, owner_of)

    async def plan(
        self,
        part: ItemBatch,
        found: Found,
        previous: Committed | None,
        overlap: Callable[[], Awaitable[Any] | None] | None = None,
    ) -> tuple[BatchPlan, dict[int, int]]:
        """One plan for the batch, as the engine makes it; ``overlap`` runs while it is made."""
        merged, owner_of = found
        if previous is not None:
            absorb_previous(
                part,
                merged,
                owner_of,
                previous,
                self.config.evolution.top_k,
                self.config.evolution.max_provisional_candidates,
                count_scopes=self.config.policy.env_contrast > 0,
            )
        t0 = time.perf_counter()
        self.routing.set(owner_of.items())
        planner = make_planner(merged.clusters, self.policy, self.config, self.dim, WORKFLOW_DIM, self.decider)
        extra = [[c for c, _ in row] for row in merged.extra]
        pending = overlap() if overlap is not None else None  # e.g. the next batch's lookups
        # Planning is CPU work (and LLM calls): off the event loop, so requests keep queueing.
        plan = await asyncio.to_thread(planner.plan, part.items(), merged.neighbours, 0, extra, merged.scopes)
        if pending is not None:
            await asyncio.wait([asyncio.ensure_future(pending)])  # its lookups must not see this batch half-committed
        self.stage_seconds["plan"] += time.perf_counter() - t0
        return plan, owner_of

    async def commit(
        self, fresh: list[int], part: ItemBatch, plan: BatchPlan, owner_of: dict[int, int]
    ) -> tuple[dict[int, AddResult], dict[int, Exception], Committed]:
        """Each placement to its shard (:func:`route`), all shards at once; returns the results
        and errors by batch position, and what was stored."""
        t0 = time.perf_counter()
        target = route(plan.placements, owner_of, self.routing.shard_of, self.loads)
        per_shard: dict[int, list[int]] = {}
        for pos, shard in enumerate(target):
            per_shard.setdefault(shard, []).append(pos)
        counters = plan_counters(plan)
        calls = {
            shard: self.shards.commit(
                shard,
                part.select(positions),
                [plan.placements[p] for p in positions],
                counters if shard == min(per_shard) else None,
            )
            for shard, positions in per_shard.items()
        }
        outcomes = await asyncio.gather(*calls.values(), return_exceptions=True)
        self.stage_seconds["commit"] += time.perf_counter() - t0
        placed: dict[int, AddResult] = {}
        errors: dict[int, Exception] = {}
        committed = Committed()
        added_rows: list[int] = []
        new_routes = []
        for shard, outcome in zip(calls, outcomes, strict=True):
            positions = per_shard[shard]
            if isinstance(outcome, BaseException):
                log.warning("commit on shard %d failed: %s", shard, outcome)
                for pos in positions:
                    errors[fresh[pos]] = (
                        outcome
                        if isinstance(outcome, Exception)
                        else ShardUnavailableError(f"commit on shard {shard} was interrupted: {outcome!r}")
                    )
                continue
            done, states = outcome
            committed.states.update(states)
            committed.owner.update((cid, shard) for cid in states)
            for pos, result in zip(positions, done, strict=True):
                if result.status == "duplicate":
                    # Sent as new (classified against every shard and the previous batch), yet
                    # stored with this content: an earlier attempt of this very commit stored it
                    # (Ray resent the commit to a shard that restarted). It is this request's add.
                    result = AddResult(result.id, "added", result.cluster_id)
                placed[fresh[pos]] = result
                committed.stored[result.id] = (part.fingerprints[pos], result.cluster_id)
                if result.cluster_id is None:  # not placed (the engine names the cluster of every added one)
                    continue
                new_routes.append((result.cluster_id, shard))
                if result.status == "added":
                    self.loads[shard] += 1
                    added_rows.append(pos)
                    committed.note_added(result.cluster_id, part.envs[pos], opened=plan.placements[pos].cluster < 0)
        committed.vecs = part.vecs[added_rows]
        committed.wvecs = part.wvecs[added_rows]
        committed.envs = [part.envs[p] for p in added_rows]
        self.routing.set(new_routes)
        self.routing.put_meta("shard_loads", self.loads)
        return placed, errors, committed


# -- plain functions ------------------------------------------------------------------------------
def route(
    placements: Sequence[Placement],
    owner_of: dict[int, int],
    shard_of: Callable[[int], int | None],
    loads: Sequence[int],
) -> list[int]:
    """The shard of each placement: a join goes to its cluster's owner, each new cluster
    (one provisional id, however many items open it) to the least-loaded shard."""
    target: list[int] = []
    new_home: dict[int, int] = {}
    loads = list(loads)
    for p in placements:
        if p.cluster < 0:
            if p.cluster not in new_home:
                new_home[p.cluster] = int(np.argmin(loads))
            shard = new_home[p.cluster]
        else:
            got = owner_of.get(p.cluster, shard_of(p.cluster))
            if got is None:
                raise UnknownClusterError(f"no shard is known to own cluster {p.cluster}")
            shard = got
        loads[shard] += 1
        target.append(shard)
    return target


def concat_batches(batches: list[ItemBatch]) -> ItemBatch:
    """One batch of several requests' (vectors copied: the coordinator writes into them)."""
    if len(batches) == 1:
        only = batches[0]
        return ItemBatch(**{**only.__dict__, "vecs": only.vecs.copy()})
    kinds = {b.features for b in batches}
    if len(kinds) != 1:
        raise ConfigError(
            f"batches packed with different workflow featurizers {sorted(kinds)}; every client needs one evolution.workflow_features"
        )
    return ItemBatch(
        ids=[x for b in batches for x in b.ids],
        envs=[x for b in batches for x in b.envs],
        queries=[x for b in batches for x in b.queries],
        successes=[x for b in batches for x in b.successes],
        fingerprints=[x for b in batches for x in b.fingerprints],
        records=[x for b in batches for x in b.records],
        vecs=np.vstack([b.vecs for b in batches]).astype(np.float32),
        wvecs=np.vstack([b.wvecs for b in batches]).astype(np.float32),
        tokens=[x for b in batches for x in b.tokens],
        flows=[x for b in batches for x in b.flows],
        features=kinds.pop(),
    )


def select_rows(found: Found, rows: list[int]) -> Found:
    merged, owner_of = found
    return CandidateSet(
        [merged.neighbours[r] for r in rows], [merged.extra[r] for r in rows], merged.clusters, merged.scopes
    ), owner_of


def absorb_previous(
    part: ItemBatch,
    merged: CandidateSet,
    owner_of: dict[int, int],
    previous: Committed,
    k: int,
    max_provisional: int,
    count_scopes: bool = False,
) -> None:
    """Make candidates looked up before the previous batch's commit as if looked up after it.

    The previous batch's trajectories join each item's neighbours (exact search within the
    environment), the clusters it touched are planned with their committed states, and
    the clusters it opened in an item's environment become candidates, as clusters opened
    earlier in the same batch are (at most ``max_provisional``, the latest). The result is
    what one batch twice the size would see. With ``count_scopes`` (``policy.env_contrast``
    on, so the shards reported their environments' sums) those sums gain the previous
    batch's trajectories.
    """
    merged.clusters.update(previous.states)
    owner_of.update(previous.owner)
    if count_scopes and len(previous.envs):
        for row, env in enumerate(previous.envs):
            sums = merged.scopes.get(env)
            if sums is None:
                merged.scopes[env] = ScopeSums(
                    1, previous.vecs[row].astype(np.float64), previous.wvecs[row].astype(np.float64)
                )
            else:
                sums.add(ScopeSums(1, previous.vecs[row], previous.wvecs[row]))
    if len(previous.envs):
        prev_envs = np.asarray(previous.envs, dtype=object)
        envs = np.asarray(part.envs, dtype=object)
        for env in set(part.envs) & set(previous.envs):
            rows = np.flatnonzero(envs == env)
            cols = np.flatnonzero(prev_envs == env)
            top, top_s = top_k_rows(part.vecs[rows] @ previous.vecs[cols].T, k)
            for r, row_top, row_s in zip(rows.tolist(), top.tolist(), top_s.tolist(), strict=True):
                pool = merged.neighbours[r] + [
                    (previous.clusters[cols[j]], s) for j, s in zip(row_top, row_s, strict=True)
                ]
                merged.neighbours[r] = sorted(pool, key=lambda cs: -cs[1])[:k]
    for r, env in enumerate(part.envs):
        opened = previous.opened.get(env)
        if opened:
            have = {c for c, _ in merged.extra[r]}
            merged.extra[r] = merged.extra[r] + [(c, 0.0) for c in opened[-max_provisional:] if c not in have]


def _as_stored(fingerprint: str, known: AddResult | None) -> tuple[str, int | None] | None:
    """A shard's ``known`` answer as :func:`classify_ids` takes it: (stored fingerprint,
    cluster). A shard reports a conflict, not the other fingerprint: any other string does."""
    if known is None:
        return None
    return (fingerprint if known.status == "duplicate" else "\x00other:" + fingerprint, known.cluster_id)
