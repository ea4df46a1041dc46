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
from lifemem_ray.evolution import BatchPlanner, CandidateSet, ItemBatch
from lifemem_ray.memory import WORKFLOW_DIM, AddResult, IdConflictError, pack_trajectories
from lifemem_ray.model import Trajectory
from lifemem_ray.policy import OfflinePolicy

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
        self._paused = False
        self._idle: asyncio.Event | None = None
        self._next_embedder = 0
        self._loads = self.routing.get_meta("shard_loads", [0] * len(self.shards))
        self._initialised = bool(self.routing.get_meta("initialised", False))
        self.counters = {"requests": 0, "trajectories": 0, "batches": 0, "duplicates": 0, "rejected": 0, "overloaded": 0}
        # Seconds spent per stage of the micro-batch pipeline, to see where time goes.
        self.stage_seconds = {"known": 0.0, "embed": 0.0, "prepare": 0.0, "candidates": 0.0, "plan": 0.0, "commit": 0.0}

    # -- the client API ------------------------------------------------------------------------
    async def add_many(self, trajectories: Sequence[Trajectory], vectors: np.ndarray | None = None) -> list[AddResult]:
        """Acknowledged (returned) once every trajectory of the request is committed on its shard."""
        batch = await asyncio.to_thread(pack_trajectories, list(trajectories), vectors, self.dim)
        return await self.add_batch(batch, vectors is not None)

    async def add_batch(self, batch: ItemBatch, embedded: bool) -> list[AddResult]:
        """:meth:`add_many` for trajectories packed by the client (the fast path: encoding and
        workflow vectors are computed in the client's process, not here)."""
        self._ensure_loop()
        if not isinstance(batch, ItemBatch):
            raise TypeError(f"batch: expected an ItemBatch, got {type(batch).__name__}")
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
        assert self._wake is not None and self._space is not None and self._idle is not None
        wait = self.config.cluster.batch_wait_ms / 1000.0
        size = self.config.cluster.batch_size
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue and not self._paused:
                # Let a micro-batch fill for a moment, unless it is already full.
                first = self._queue[0].enqueued
                while self._queued < size and time.monotonic() - first < wait:
                    await asyncio.sleep(min(wait, 0.002))
                batch: list[_Request] = []
                count = 0
                while self._queue and (not batch or count + len(self._queue[0]) <= size):
                    request = self._queue.pop(0)
                    batch.append(request)
                    count += len(request)
                self._idle.clear()
                try:
                    await self._process(batch)
                except Exception as exc:  # the batch fails; the loop goes on
                    log.exception("micro-batch failed")
                    for request in batch:
                        if not request.future.done():
                            request.future.set_exception(exc)
                finally:
                    self._idle.set()
                    async with self._space:
                        self._queued -= count
                        self._space.notify_all()

    async def _call(self, shard: int, method: str, *args: Any) -> Any:
        """One shard call; a dead shard or node becomes a clear error naming it."""
        try:
            ref = getattr(self.shards[shard], method).remote(*args)
            return await asyncio.wait_for(ref, timeout=self.config.cluster.call_timeout_s)
        except (*actor_failures(), asyncio.TimeoutError) as exc:
            raise ShardUnavailableError(
                f"shard {shard} ({self.shard_names[shard]}) is unavailable during {method}: {type(exc).__name__}: {exc}"
            ) from exc

    async def _process(self, batch: list[_Request]) -> None:
        self.counters["batches"] += 1
        whole = _concat([r.batch for r in batch])
        owner = [ri for ri, r in enumerate(batch) for _ in range(len(r))]
        results: list[AddResult | None] = [None] * len(whole)

        # 1. What is stored already, anywhere.
        t0 = time.perf_counter()
        known = await asyncio.gather(*[self._call(s, "known", whole.ids, whole.fingerprints) for s in range(len(self.shards))])
        self.stage_seconds["known"] += time.perf_counter() - t0
        failed: dict[int, Exception] = {}
        first: dict[str, int] = {}
        fresh: list[int] = []
        for i, tid in enumerate(whole.ids):
            found = next((k[i] for k in known if k[i] is not None), None)
            if found is not None and found.status == "conflict":
                failed.setdefault(owner[i], IdConflictError(f"trajectory id {tid!r} is stored with different content; nothing of this request was stored"))
            elif found is not None:
                results[i] = found
            elif tid in first:
                if whole.fingerprints[first[tid]] != whole.fingerprints[i]:
                    failed.setdefault(owner[i], IdConflictError(f"trajectory id {tid!r} is repeated with different content; nothing of this request was stored"))
            else:
                first[tid] = i
                fresh.append(i)
        # A conflicting request is rejected whole, also the part that another request shares.
        fresh = [i for i in fresh if owner[i] not in failed]
        self.counters["rejected"] += len(failed)

        # 2. Vectors, embedded where a request brought none.
        need = [i for i in fresh if not batch[owner[i]].embedded]
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

        placed: dict[int, AddResult] = {}
        shard_error: dict[int, Exception] = {}
        if fresh:
            if not self._initialised:
                # Only what the initial partition needs goes to shard 0 this way.
                info = await self._call(0, "info")
                need_init = max(0, self.config.evolution.init_size - info["trajectories"])
                placed, shard_error = await self._add_before_init(fresh[:need_init], whole)
                fresh = fresh[need_init:]
            if fresh and self._initialised:
                more, more_errors = await self._decide_and_commit(fresh, whole)
            else:
                more, more_errors = await self._add_before_init(fresh, whole)
            placed.update(more)
            shard_error.update(more_errors)
        for i, result in placed.items():
            results[i] = result
        # Repeats of an id inside the batch point at the first occurrence.
        for i, tid in enumerate(whole.ids):
            if results[i] is None and tid in first and first[tid] != i and first[tid] in placed:
                results[i] = AddResult(tid, "duplicate", placed[first[tid]].cluster_id)
        self.counters["trajectories"] += sum(1 for r in placed.values() if r.status == "added")
        self.counters["duplicates"] += sum(1 for r in results if r is not None and r.status == "duplicate")

        # 3. Acknowledge each request whose trajectories are all committed.
        offset = 0
        for ri, request in enumerate(batch):
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

    async def _embed(self, texts: list[str]) -> np.ndarray:
        if not self.embedders:
            raise RuntimeError("trajectories came without vectors and the deployment has no embedder actors")
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

    async def _decide_and_commit(self, fresh: list[int], whole: ItemBatch) -> tuple[dict[int, AddResult], dict[int, Exception]]:
        part = whole.select(fresh)
        items = part.items()
        vectors, wvectors, envs = part.vecs, part.wvecs, part.envs
        t0 = time.perf_counter()
        found = await asyncio.gather(*[self._call(s, "candidates", vectors, wvectors, envs) for s in range(len(self.shards))])
        merged, owner_of = self._merge(found)
        t1 = time.perf_counter()
        self.stage_seconds["candidates"] += t1 - t0
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
        # Planning is CPU work (and LLM calls): off the event loop, so requests keep queueing.
        plan = await asyncio.to_thread(planner.plan, items, merged.neighbours, 0, extra)
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
                    raise RuntimeError(f"no shard is known to own cluster {p.cluster}")
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
        for shard, outcome in zip(calls, outcomes):
            positions = per_shard[shard]
            if isinstance(outcome, BaseException):
                log.warning("commit on shard %d failed: %s", shard, outcome)
                for pos in positions:
                    errors[fresh[pos]] = outcome if isinstance(outcome, Exception) else RuntimeError(str(outcome))
                continue
            for pos, result in zip(positions, outcome):
                placed[fresh[pos]] = result
                if result.cluster_id is not None:
                    new_routes.append((result.cluster_id, shard))
                if result.status == "added":
                    self._loads[shard] += 1
        self.routing.set(new_routes)
        self.routing.put_meta("shard_loads", self._loads)
        return placed, errors

    def _merge(self, found: list[CandidateSet]) -> tuple[CandidateSet, dict[int, int]]:
        """One candidate set from every shard's: the global top-k neighbours and best clusters."""
        k = self.config.evolution.top_k
        m = self.config.evolution.centroid_candidates
        n = len(found[0].neighbours) if found else 0
        merged = CandidateSet(neighbours=[[] for _ in range(n)], extra=[[] for _ in range(n)], clusters={})
        owner_of: dict[int, int] = {}
        for shard, part in enumerate(found):
            merged.clusters.update(part.clusters)
            for cid in part.clusters:
                owner_of[cid] = shard
            for row in range(n):
                merged.neighbours[row].extend(part.neighbours[row])
                merged.extra[row].extend(part.extra[row])
        for row in range(n):
            merged.neighbours[row] = sorted(merged.neighbours[row], key=lambda cs: -cs[1])[:k]
            merged.extra[row] = sorted(merged.extra[row], key=lambda cs: -cs[1])[:m]
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
    )
