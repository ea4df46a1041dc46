"""Coordinator: routes new trajectories to shards and decides for whole micro-batches.

Clients call :meth:`Coordinator.add_many` concurrently; requests queue (bounded:
callers wait, then get :class:`OverloadedError`) and are gathered into
micro-batches of ``cluster.batch_size`` within ``cluster.batch_wait_ms``. For each
micro-batch the coordinator

1. asks every shard which ids it already holds (duplicates, conflicts);
2. embeds the task texts that came without vectors (embedder actors);
3. asks every shard for candidate clusters in one fan-out;
4. decides join or new for the whole batch (LLM calls issued concurrently under one
   limit, or the offline policy), exactly as the single-process engine does;
5. sends each write to the shard owning the chosen cluster (a new cluster to the
   least-loaded shard) and acknowledges a request only after every shard it touched
   has committed.

Batches are pipelined: steps 1 and 3 of the next micro-batch run on the shards while the
coordinator plans the current one (step 4). That batch is then planned with what the
current one stored, so it decides as if it had been looked up afterwards: the stored
batch's trajectories join its neighbours (exact search within each environment), the
clusters it touched are planned with their committed states, the clusters it opened
are candidates, and its ids count as stored (``cluster.pipeline = false`` turns this off).

A request whose ids conflict with stored content is rejected whole before anything
of it is stored. A request that fails half-way (a shard died) may be retried: ids
make adds idempotent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import ray

from lifemem_ray.config import MemoryConfig
from lifemem_ray.decisions import Decider
from lifemem_ray.evolution import MAX_PROVISIONAL_CANDIDATES, BatchPlanner, CandidateArrays, CandidateSet, ItemBatch
from lifemem_ray.memory import WORKFLOW_DIM, AddResult, IdConflictError, pack_trajectories
from lifemem_ray.model import Trajectory
from lifemem_ray.policy import OfflinePolicy
from lifemem_ray.storage import ClusterRecord

from lifemem_ray.errors import EmbeddingError, UnknownClusterError

from .errors import OverloadedError, ShardUnavailableError, actor_failures
from .routing import RoutingTable

__all__ = ["Coordinator"]

log = logging.getLogger(__name__)


@dataclass
class _Request:
    batch: ItemBatch
    embedded: bool  # False: the task vectors are still to be computed here
    future: asyncio.Future
    enqueued: float = field(default_factory=time.monotonic)

    def __len__(self) -> int:
        return len(self.batch)


@dataclass
class _Stage:
    """One micro-batch on its way through the coordinator."""

    requests: list[_Request]
    whole: ItemBatch
    owner: list[int]  # per trajectory: its request
    results: list[AddResult | None] = field(default_factory=list)
    failed: dict[int, Exception] = field(default_factory=dict)  # request -> why it is rejected
    first: dict[str, int] = field(default_factory=dict)  # id -> its first position in the batch
    fresh: list[int] = field(default_factory=list)  # positions to store
    found: tuple[CandidateSet, dict[int, int]] | None = None  # merged candidates, cluster -> shard
    error: Exception | None = None

    @property
    def count(self) -> int:
        return len(self.whole)


@dataclass
class _Committed:
    """What a micro-batch stored: the next batch, looked up before this commit, is planned with it."""

    stored: dict[str, tuple[str, int | None]] = field(default_factory=dict)  # id -> (fingerprint, cluster)
    vecs: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))  # the added trajectories
    envs: list[str] = field(default_factory=list)
    clusters: list[int] = field(default_factory=list)  # their clusters
    states: dict[int, ClusterRecord] = field(default_factory=dict)  # the touched clusters after the commit
    owner: dict[int, int] = field(default_factory=dict)  # cluster -> shard
    opened: dict[str, list[int]] = field(default_factory=dict)  # env -> clusters this batch opened


class Coordinator:
    def __init__(self, store_dir: str, config: MemoryConfig, shard_names: list[str], embedder_names: list[str], dim: int) -> None:
        self.config = config
        self.dim = dim
        self.namespace = config.cluster.namespace
        self.routing = RoutingTable(Path(store_dir) / "coordinator")
        self.shard_names = shard_names
        self.embedder_names = embedder_names
        self.shards = [ray.get_actor(name, namespace=self.namespace) for name in shard_names]
        self.embedders = [ray.get_actor(name, namespace=self.namespace) for name in embedder_names]
        self.policy = OfflinePolicy(config.policy)
        self.decider: Decider | None = None
        if config.llm.backend == "openai":
            from lifemem_ray.llm import LLMDecider

            self.decider = LLMDecider(config.llm)
        self._queue: list[_Request] = []
        self._queued = 0
        self._wake: asyncio.Event | None = None
        self._space: asyncio.Condition | None = None
        self._loop_task: asyncio.Task | None = None
        self._next: asyncio.Task | None = None  # the next micro-batch's lookups, started early
        self._paused = False
        self._idle: asyncio.Event | None = None
        self._next_embedder = 0
        self._loads = self.routing.get_meta("shard_loads", [0] * len(self.shards))
        self._initialised = bool(self.routing.get_meta("initialised", False))
        self.counters = {"requests": 0, "trajectories": 0, "batches": 0, "pipelined": 0, "duplicates": 0, "rejected": 0, "overloaded": 0}
        # Seconds spent per stage of the micro-batch pipeline, to see where time goes. The next
        # batch's known/candidates overlap this batch's plan, which includes waiting for them,
        # so the stages add up to more than the wall time.
        self.stage_seconds = {"known": 0.0, "embed": 0.0, "candidates": 0.0, "plan": 0.0, "commit": 0.0}

    # -- the client API ------------------------------------------------------------------------
    async def add_many(self, trajectories: Sequence[Trajectory], vectors: np.ndarray | None = None) -> list[AddResult]:
        """Acknowledged (returned) once every trajectory of the request is committed on its shard."""
        batch = await asyncio.to_thread(pack_trajectories, list(trajectories), vectors, self.dim, self.config.evolution.workflow_features)
        return await self.add_batch(batch, vectors is not None)

    async def add_batch(self, batch: ItemBatch, embedded: bool) -> list[AddResult]:
        """:meth:`add_many` for trajectories packed by the client (the fast path: encoding and
        workflow vectors are computed in the client's process, not here)."""
        self._ensure_loop()
        if not isinstance(batch, ItemBatch):
            raise TypeError(f"batch: expected an ItemBatch, got {type(batch).__name__}")
        if batch.features != self.config.evolution.workflow_features:
            raise ValueError(f"batch: packed with workflow features {batch.features!r}, the deployment uses "
                             f"{self.config.evolution.workflow_features!r} (evolution.workflow_features)")
        if len(batch) and batch.vecs.shape != (len(batch), self.dim):
            raise ValueError(f"vectors: expected shape ({len(batch)}, {self.dim}), got {tuple(batch.vecs.shape)}")
        if not len(batch):
            return []
        trajectories = batch.ids
        n = len(trajectories)
        limit = self.config.cluster.max_pending
        assert self._space is not None and self._wake is not None
        async with self._space:
            try:
                await asyncio.wait_for(
                    self._space.wait_for(lambda: self._queued == 0 or self._queued + n <= limit),
                    timeout=self.config.cluster.overload_timeout_s,
                )
            except asyncio.TimeoutError:
                self.counters["overloaded"] += 1
                raise OverloadedError(
                    f"the coordinator's queue held {self._queued} trajectories (cluster.max_pending = {limit}) for "
                    f"{self.config.cluster.overload_timeout_s:.0f} s; retry later or add shards"
                ) from None
            future = asyncio.get_running_loop().create_future()
            self._queue.append(_Request(batch, embedded, future))
            self._queued += n
        self.counters["requests"] += 1
        self._wake.set()
        return await future

    async def stats(self) -> dict[str, Any]:
        return {
            "queued": self._queued,
            "initialised": self._initialised,
            "routes": len(self.routing),
            "shard_loads": list(self._loads),
            "counters": dict(self.counters),
            "stage_seconds": {k: round(v, 3) for k, v in self.stage_seconds.items()},
            "llm": self.decider.usage() if self.decider is not None else {},
        }

    async def deployment(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "shards": self.shard_names,
            "embedders": self.embedder_names,
            "dim": self.dim,
            "store": self.routing.get_meta("store"),
            "nodes": self.routing.get_meta("nodes"),
        }

    async def route(self, cluster_ids: list[int]) -> list[int | None]:
        return [self.routing.shard_of(c) for c in cluster_ids]

    async def pause(self) -> None:
        """Stop taking new micro-batches and wait for the one in flight (for a consistent snapshot)."""
        self._ensure_loop()
        self._paused = True
        assert self._idle is not None
        await self._idle.wait()

    async def resume(self) -> None:
        self._paused = False
        if self._wake is not None:
            self._wake.set()

    async def snapshot_routing(self, target: str) -> int:
        self.routing.put_meta("shard_loads", self._loads)
        self.routing.snapshot(target)
        return len(self.routing)

    async def resync(self) -> int:
        """Rebuild the routing table from what the shards hold (after a restore or a split)."""
        lists = await asyncio.gather(*[s.cluster_ids.remote() for s in self.shards])
        routes = {cid: i for i, ids in enumerate(lists) for cid in ids}
        self.routing.replace_all(routes)
        infos = await asyncio.gather(*[s.info.remote() for s in self.shards])
        self._loads = [info["trajectories"] for info in infos]
        self._initialised = any(info["initialised"] for info in infos)
        self.routing.put_meta("initialised", self._initialised)
        self.routing.put_meta("shard_loads", self._loads)
        return len(routes)

    async def ping(self) -> str:
        return "ok"

    # -- the batching loop -----------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self._loop_task is None:
            self._wake = asyncio.Event()
            self._space = asyncio.Condition()
            self._idle = asyncio.Event()
            self._idle.set()
            self._loop_task = asyncio.get_running_loop().create_task(self._batch_loop())

    async def _batch_loop(self) -> None:
        """One micro-batch after another, pipelined: while a batch is planned (coordinator CPU),
        the shards already look up the next one (ids, neighbours); that batch is then planned
        with what the one before it stored (see :meth:`_absorb_previous`)."""
        assert self._wake is not None and self._space is not None and self._idle is not None
        wait = self.config.cluster.batch_wait_ms / 1000.0
        previous: _Committed | None = None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._next is not None or (self._queue and not self._paused):
                self._idle.clear()
                if self._next is not None:
                    stage, pipelined = await self._next, True
                    self._next = None
                    if previous is None:
                        # The batch before failed after these lookups were made: it may have
                        # stored part of itself, so look again rather than plan without it.
                        stage, pipelined = await self._front(stage.requests), False
                    else:
                        self.counters["pipelined"] += 1
                else:
                    # Let a micro-batch fill for a moment, unless it is already full.
                    first = self._queue[0].enqueued
                    while self._queued < self.config.cluster.batch_size and time.monotonic() - first < wait:
                        await asyncio.sleep(min(wait, 0.002))
                    stage, pipelined = await self._front(self._take()), False
                try:
                    previous = await self._back(stage, previous if pipelined else None)
                except Exception as exc:  # the batch fails; the loop goes on
                    log.exception("micro-batch failed")
                    previous = None
                    for request in stage.requests:
                        if not request.future.done():
                            request.future.set_exception(exc)
                finally:
                    async with self._space:
                        self._queued -= stage.count
                        self._space.notify_all()
                    if self._next is None:
                        self._idle.set()

    def _take(self) -> list[_Request]:
        """The next micro-batch: whole requests, up to ``cluster.batch_size`` trajectories."""
        size = self.config.cluster.batch_size
        batch: list[_Request] = []
        count = 0
        while self._queue and (not batch or count + len(self._queue[0]) <= size):
            request = self._queue.pop(0)
            batch.append(request)
            count += len(request)
        return batch

    def _start_next(self) -> None:
        """Begin the next micro-batch's shard lookups now, if one is waiting (see _batch_loop)."""
        if self._next is None and self._queue and not self._paused and self._initialised and self.config.cluster.pipeline:
            self._next = asyncio.get_running_loop().create_task(self._front(self._take()))

    async def _call(self, shard: int, method: str, *args: Any) -> Any:
        """One shard call; a dead shard or node becomes a clear error naming it."""
        try:
            ref = getattr(self.shards[shard], method).remote(*args)
            return await asyncio.wait_for(ref, timeout=self.config.cluster.call_timeout_s)
        except (*actor_failures(), asyncio.TimeoutError) as exc:
            raise ShardUnavailableError(
                f"shard {shard} ({self.shard_names[shard]}) is unavailable during {method}: {type(exc).__name__}: {exc}"
            ) from exc

    async def _front(self, requests: list[_Request]) -> _Stage:
        """Ids (stored anywhere?), vectors, and once the memory is initialised the neighbour
        candidates: the shard-side half of a micro-batch. Never raises: a failure is kept
        in the stage and fails its requests in :meth:`_back`."""
        self.counters["batches"] += 1
        whole = _concat([r.batch for r in requests])
        stage = _Stage(requests=requests, whole=whole, owner=[ri for ri, r in enumerate(requests) for _ in range(len(r))])
        try:
            await self._check_ids(stage)
            if stage.fresh and self._initialised:
                stage.found = await self._candidates(whole, stage.fresh)
        except Exception as exc:
            stage.error = exc
        return stage

    async def _check_ids(self, stage: _Stage) -> None:
        whole, owner = stage.whole, stage.owner
        stage.results = [None] * len(whole)
        # 1. What is stored already, anywhere.
        t0 = time.perf_counter()
        known = await asyncio.gather(*[self._call(s, "known", whole.ids, whole.fingerprints) for s in range(len(self.shards))])
        self.stage_seconds["known"] += time.perf_counter() - t0
        failed = stage.failed
        fresh: list[int] = []
        for i, tid in enumerate(whole.ids):
            found = next((k[i] for k in known if k[i] is not None), None)
            if found is not None and found.status == "conflict":
                failed.setdefault(owner[i], _stored_differently(tid))
            elif found is not None:
                stage.results[i] = found
            elif tid in stage.first:
                if whole.fingerprints[stage.first[tid]] != whole.fingerprints[i]:
                    failed.setdefault(owner[i], IdConflictError(f"trajectory id {tid!r} is repeated with different content; nothing of this request was stored"))
            else:
                stage.first[tid] = i
                fresh.append(i)
        # A conflicting request is rejected whole, also the part that another request shares.
        fresh = [i for i in fresh if owner[i] not in failed]

        # 2. Vectors, embedded where a request brought none.
        need = [i for i in fresh if not stage.requests[owner[i]].embedded]
        if need:
            t0 = time.perf_counter()
            whole.vecs[need] = await self._embed([whole.queries[i] for i in need])
            self.stage_seconds["embed"] += time.perf_counter() - t0
        norms = np.linalg.norm(whole.vecs[fresh], axis=1) if fresh else np.ones(0)
        bad = [fresh[j] for j in np.flatnonzero(~np.isfinite(norms) | (norms == 0))]
        for i in bad:
            failed.setdefault(owner[i], ValueError(f"vectors: the vector of trajectory {whole.ids[i]!r} is zero or not finite"))
        fresh = [i for i in fresh if owner[i] not in failed]
        if fresh:
            whole.vecs[fresh] /= np.linalg.norm(whole.vecs[fresh], axis=1, keepdims=True)
        stage.fresh = fresh

    async def _back(self, stage: _Stage, previous: _Committed | None) -> _Committed | None:
        """Decide, commit and acknowledge a micro-batch; return what it stored, for the
        next batch when that one's lookups ran before this commit."""
        if stage.error is not None:
            raise stage.error
        whole, results, failed = stage.whole, stage.results, stage.failed
        fresh = stage.fresh
        if previous is not None:
            fresh = self._dedupe_previous(stage, previous)
        self.counters["rejected"] += len(failed)

        placed: dict[int, AddResult] = {}
        shard_error: dict[int, Exception] = {}
        committed: _Committed | None = None
        if fresh:
            if stage.found is None and not self._initialised:
                # Only what the initial partition needs goes to shard 0 this way.
                info = await self._call(0, "info")
                need_init = max(0, self.config.evolution.init_size - info["trajectories"])
                placed, shard_error = await self._add_before_init(fresh[:need_init], whole)
                fresh = fresh[need_init:]
            if fresh and self._initialised:
                found = stage.found
                if found is None:
                    found = await self._candidates(whole, fresh)
                elif len(fresh) != len(stage.fresh):  # some turned out stored by the previous batch
                    row_of = {i: r for r, i in enumerate(stage.fresh)}
                    found = _select_rows(found, [row_of[i] for i in fresh])
                more, more_errors, committed = await self._decide_and_commit(fresh, whole, found, previous)
            else:
                more, more_errors = await self._add_before_init(fresh, whole)
            placed.update(more)
            shard_error.update(more_errors)
        for i, result in placed.items():
            results[i] = result
        # Repeats of an id inside the batch point at the first occurrence.
        for i, tid in enumerate(whole.ids):
            if results[i] is None and tid in stage.first and stage.first[tid] != i and stage.first[tid] in placed:
                results[i] = AddResult(tid, "duplicate", placed[stage.first[tid]].cluster_id)
        self.counters["trajectories"] += sum(1 for r in placed.values() if r.status == "added")
        self.counters["duplicates"] += sum(1 for r in results if r is not None and r.status == "duplicate")

        # 3. Acknowledge each request whose trajectories are all committed.
        offset = 0
        for ri, request in enumerate(stage.requests):
            n = len(request)
            mine = results[offset : offset + n]
            error = failed.get(ri) or next((shard_error[i] for i in range(offset, offset + n) if i in shard_error), None)
            if error is None and any(r is None for r in mine):
                error = ShardUnavailableError("part of the request was not committed; retry it (ids make adds idempotent)")
            if not request.future.done():
                if error is not None:
                    request.future.set_exception(error)
                else:
                    request.future.set_result(mine)
            offset += n
        return committed

    def _dedupe_previous(self, stage: _Stage, previous: _Committed) -> list[int]:
        """Ids the previous batch stored after this batch's lookups: duplicates (or conflicts)."""
        keep = []
        for i in stage.fresh:
            tid = stage.whole.ids[i]
            got = previous.stored.get(tid)
            if got is None:
                keep.append(i)
            elif got[0] == stage.whole.fingerprints[i]:
                stage.results[i] = AddResult(tid, "duplicate", got[1])
            else:
                stage.failed.setdefault(stage.owner[i], _stored_differently(tid))
        return [i for i in keep if stage.owner[i] not in stage.failed]

    async def _candidates(self, whole: ItemBatch, positions: list[int]) -> tuple[CandidateSet, dict[int, int]]:
        """Every shard's candidates for these positions of the batch, merged (one fan-out)."""
        t0 = time.perf_counter()
        vecs, wvecs, envs = whole.vecs[positions], whole.wvecs[positions], [whole.envs[i] for i in positions]
        found = await asyncio.gather(*[self._call(s, "candidates", vecs, wvecs, envs) for s in range(len(self.shards))])
        self.stage_seconds["candidates"] += time.perf_counter() - t0
        return self._merge(found)

    async def _embed(self, texts: list[str]) -> np.ndarray:
        if not self.embedders:
            raise EmbeddingError("trajectories came without vectors and the deployment has no embedder actors; pass vectors, or deploy with embedders")
        size = 256
        chunks = [texts[i : i + size] for i in range(0, len(texts), size)]
        refs = []
        for chunk in chunks:
            actor = self.embedders[self._next_embedder % len(self.embedders)]
            self._next_embedder += 1
            refs.append(actor.embed.remote(chunk))
        parts = await asyncio.gather(*refs)
        return np.vstack(parts)

    async def _add_before_init(self, positions: list[int], whole: ItemBatch) -> tuple[dict[int, AddResult], dict[int, Exception]]:
        """Until the initial partition exists, trajectories go to shard 0, which runs the
        engine's own initialisation; the initial clusters start there."""
        if not positions:
            return {}, {}
        try:
            out = await self._call(0, "add_items", whole.select(positions))
        except Exception as exc:
            return {}, {i: exc for i in positions}
        self.routing.set((r.cluster_id, 0) for r in out if r.cluster_id is not None)
        self._loads[0] += sum(1 for r in out if r.status != "duplicate")
        info = await self._call(0, "info")
        if info["initialised"]:
            self._initialised = True
            self.routing.put_meta("initialised", True)
        self.routing.put_meta("shard_loads", self._loads)
        return dict(zip(positions, out)), {}

    async def _decide_and_commit(
        self, fresh: list[int], whole: ItemBatch, found: tuple[CandidateSet, dict[int, int]], previous: _Committed | None
    ) -> tuple[dict[int, AddResult], dict[int, Exception], _Committed]:
        part = whole.select(fresh)
        items = part.items()
        merged, owner_of = found
        if previous is not None:
            _absorb_previous(part, merged, owner_of, previous, self.config.evolution.top_k)
        t1 = time.perf_counter()
        self.routing.set(owner_of.items())
        planner = BatchPlanner(
            merged.clusters,
            self.policy,
            self.config.evolution,
            dim=self.dim,
            wdim=WORKFLOW_DIM,
            decider=self.decider,
            llm_config=self.config.llm,
        )
        extra = [[c for c, _ in row] for row in merged.extra]
        # The shards look up the next micro-batch while this one is planned.
        self._start_next()
        # Planning is CPU work (and LLM calls): off the event loop, so requests keep queueing.
        plan = await asyncio.to_thread(planner.plan, items, merged.neighbours, 0, extra)
        if self._next is not None:
            await asyncio.wait([self._next])  # its lookups must not see this batch half-committed
        t2 = time.perf_counter()
        self.stage_seconds["plan"] += t2 - t1
        counters = {"llm_requests": plan.llm_requests, "llm_fallbacks": plan.llm_fallbacks, "llm_skipped": plan.llm_skipped}

        # Route: joins to the owner of the cluster, each new cluster to the least-loaded shard.
        target: list[int] = []
        new_home: dict[int, int] = {}
        loads = list(self._loads)
        for p in plan.placements:
            if p.cluster < 0:
                if p.cluster not in new_home:
                    new_home[p.cluster] = int(np.argmin(loads))
                shard = new_home[p.cluster]
            else:
                shard = owner_of.get(p.cluster, self.routing.shard_of(p.cluster))
                if shard is None:
                    raise UnknownClusterError(f"no shard is known to own cluster {p.cluster}")
            loads[shard] += 1
            target.append(shard)
        per_shard: dict[int, list[int]] = {}
        for pos, shard in enumerate(target):
            per_shard.setdefault(shard, []).append(pos)
        calls = {
            shard: self._call(shard, "commit", part.select(positions), [plan.placements[p] for p in positions], counters if shard == min(per_shard) else None)
            for shard, positions in per_shard.items()
        }
        outcomes = await asyncio.gather(*calls.values(), return_exceptions=True)
        self.stage_seconds["commit"] += time.perf_counter() - t2
        placed: dict[int, AddResult] = {}
        errors: dict[int, Exception] = {}
        new_routes = []
        committed = _Committed()
        added_rows: list[int] = []
        for shard, outcome in zip(calls, outcomes):
            positions = per_shard[shard]
            if isinstance(outcome, BaseException):
                log.warning("commit on shard %d failed: %s", shard, outcome)
                for pos in positions:
                    errors[fresh[pos]] = outcome if isinstance(outcome, Exception) else RuntimeError(str(outcome))
                continue
            done, states = outcome
            committed.states.update(states)
            for cid in states:
                committed.owner[cid] = shard
            for pos, result in zip(positions, done):
                placed[fresh[pos]] = result
                committed.stored[result.id] = (part.fingerprints[pos], result.cluster_id)
                if result.cluster_id is not None:
                    new_routes.append((result.cluster_id, shard))
                if result.status == "added":
                    self._loads[shard] += 1
                    added_rows.append(pos)
                    committed.clusters.append(result.cluster_id)
                    if plan.placements[pos].cluster < 0:
                        opened = committed.opened.setdefault(part.envs[pos], [])
                        if result.cluster_id not in opened:
                            opened.append(result.cluster_id)
        committed.vecs = part.vecs[added_rows]
        committed.envs = [part.envs[p] for p in added_rows]
        self.routing.set(new_routes)
        self.routing.put_meta("shard_loads", self._loads)
        return placed, errors, committed

    def _merge(self, found: list[CandidateArrays]) -> tuple[CandidateSet, dict[int, int]]:
        """One candidate set from every shard's: the global top-k neighbours and best clusters."""
        merged = CandidateArrays.merge(found, self.config.evolution.top_k, self.config.evolution.centroid_candidates)
        owner_of = {cid: shard for shard, part in enumerate(found) for cid in part.clusters}
        return merged, owner_of


def _concat(batches: list[ItemBatch]) -> ItemBatch:
    if len(batches) == 1:
        only = batches[0]
        return ItemBatch(**{**only.__dict__, "vecs": only.vecs.copy()})
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
        features=_one_featurizer(batches),
    )


def _one_featurizer(batches: list[ItemBatch]) -> str:
    kinds = {b.features for b in batches}
    if len(kinds) != 1:
        raise ValueError(f"batches packed with different workflow featurizers {sorted(kinds)}; every client needs one evolution.workflow_features")
    return kinds.pop()


def _stored_differently(tid: str) -> IdConflictError:
    return IdConflictError(f"trajectory id {tid!r} is stored with different content; nothing of this request was stored")


def _select_rows(found: tuple[CandidateSet, dict[int, int]], rows: list[int]) -> tuple[CandidateSet, dict[int, int]]:
    merged, owner_of = found
    return CandidateSet([merged.neighbours[r] for r in rows], [merged.extra[r] for r in rows], merged.clusters), owner_of


def _absorb_previous(part: ItemBatch, merged: CandidateSet, owner_of: dict[int, int], previous: _Committed, k: int) -> None:
    """Make candidates looked up before the previous batch's commit as if looked up after it.

    The previous batch's trajectories join each item's neighbours (exact search within the
    environment), the clusters it touched are planned with their committed states, and
    the clusters it opened in an item's environment become candidates, as clusters opened
    earlier in the same batch are. The result is what one batch twice the size would see.
    """
    merged.clusters.update(previous.states)
    owner_of.update(previous.owner)
    if len(previous.envs):
        prev_envs = np.asarray(previous.envs, dtype=object)
        envs = np.asarray(part.envs, dtype=object)
        for env in set(part.envs) & set(previous.envs):
            rows = np.flatnonzero(envs == env)
            cols = np.flatnonzero(prev_envs == env)
            sims = part.vecs[rows] @ previous.vecs[cols].T
            kk = min(k, len(cols))
            top = np.argpartition(-sims, kk - 1, axis=1)[:, :kk]
            top_s = np.take_along_axis(sims, top, 1)
            for r, row_top, row_s in zip(rows.tolist(), top.tolist(), top_s.tolist()):
                pool = merged.neighbours[r] + [(previous.clusters[cols[j]], s) for j, s in zip(row_top, row_s)]
                merged.neighbours[r] = sorted(pool, key=lambda cs: -cs[1])[:k]
    for r, env in enumerate(part.envs):
        opened = previous.opened.get(env)
        if opened:
            have = {c for c, _ in merged.extra[r]}
            merged.extra[r] = merged.extra[r] + [(c, 0.0) for c in opened[-MAX_PROVISIONAL_CANDIDATES:] if c not in have]
