"""Coordinator: routes new trajectories to shards and decides for whole micro-batches.

Clients call :meth:`Coordinator.add_many` concurrently; requests queue (bounded:
callers wait, then get :class:`OverloadedError`) and are gathered into
micro-batches of ``cluster.batch_size`` within ``cluster.batch_wait_ms``. Each
micro-batch goes through the stages of :class:`~.batching.BatchIngest` (Ray-free; see
there): ids checked on every shard, task texts embedded (embedder actors), candidates
from every shard in one fan-out, one plan for the whole batch exactly as the
single-process engine makes it, each write sent to the shard owning the chosen cluster
(a new cluster to the least-loaded shard); a request is acknowledged only after every
shard it touched has committed.

This actor keeps the I/O (:class:`RayShards`, the embedder actors), the queue, the
backpressure and the pipelining: the shards look up the next micro-batch while the
coordinator plans the current one. That batch is then planned with what the current one
stored, as if looked up afterwards (``cluster.pipeline = false`` turns this off).

A request whose ids conflict with stored content is rejected whole before anything
of it is stored. A request that fails half-way (a shard died) may be retried: ids
make adds idempotent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lifemem_ray.actors.cluster import ray_metrics
from lifemem_ray.actors.cluster.batching import BatchIngest, Committed, Stage
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.coordinator_watch import CoordinatorSpec
from lifemem_ray.actors.cluster.placement import HEAD_RESOURCE
from lifemem_ray.actors.cluster.ray_shards import RayEmbedders, RayShards
from lifemem_ray.actors.cluster.remote_errors import OverloadedError
from lifemem_ray.actors.cluster.routing import RoutingTable
from lifemem_ray.actors.cluster.shard_keeper import ShardKeeper
from lifemem_ray.core.decisions import Decider
from lifemem_ray.core.errors import ArgumentTypeError, ConfigError, InvalidArgumentError
from lifemem_ray.core.model import Trajectory
from lifemem_ray.core.tenancy import DEFAULT_TENANT, check_tenant
from lifemem_ray.engine.clustering.evolution import ItemBatch
from lifemem_ray.engine.ingest import pack_trajectories
from lifemem_ray.engine.ingest_rules import AddResult, make_decider

if TYPE_CHECKING:
    pass

__all__ = ["Coordinator", "RayShards"]  # RayShards: re-exported from ray_shards

log = logging.getLogger(__name__)

MAX_EARLY_RESUMES = 1_024  # resumes remembered whose pause has not started yet
RECOVERY_WAIT_S = 30.0  # the first batch after a start waits this long at most for the routes rebuilt from the shards


@dataclass
class _Request:
    batch: ItemBatch
    embedded: bool  # False: the task vectors are still to be computed here
    future: asyncio.Future
    enqueued: float = field(default_factory=time.monotonic)

    def __len__(self) -> int:
        return len(self.batch)


@dataclass
class _InFlight:
    requests: list[_Request]
    stage: Stage


class Coordinator:
    @classmethod
    def ray_options(cls, config: DeploymentConfig) -> dict[str, Any]:
        """Ray actor options of the coordinator (besides name, namespace and lifetime)."""
        # With the shards' coordinator watch on, a coordinator that died is started anew by them
        # (a new actor clients find by name, see coordinator_watch.py); else Ray restarts it.
        watched = config.cluster.replace_dead_actors
        return {
            "num_cpus": config.cluster.coordinator_cpus,
            # An async actor: every waiting add_many is a pending call.
            "max_concurrency": 1000,
            "max_restarts": 0 if watched else -1,
            "max_task_retries": 0 if watched else -1,
        }

    def __init__(
        self,
        store_dir: str,
        config: DeploymentConfig,
        shard_names: list[str],
        embedder_names: list[str],
        dim: int,
        *,
        shards: Any = None,
        embed: Any = None,
        decider: Decider | None = None,
    ) -> None:
        """``shards`` (a :class:`~.batching.ShardSet`) and ``embed`` default to the named
        actors, looked up on first use; tests pass in-process ones."""
        self.config = config
        self.dim = dim
        self.namespace = config.cluster.namespace
        self.routing = RoutingTable(Path(store_dir) / "coordinator")
        self.shard_names = shard_names
        self.embedder_names = embedder_names
        self.keeper: ShardKeeper | None = None  # restarts and rebuilds shards whose node went (Ray deployments)
        self._keeper_task: asyncio.Task | None = None
        self._recovery: asyncio.Task | None = None  # the routing state rebuilt from the shards after a start
        self.store_dir = Path(store_dir)  # the deployment's store folder (its routing table is in coordinator/)
        if shards is None:
            ray_shards = RayShards(
                shard_names, self.namespace, config.cluster.call_timeout_s, check_s=config.cluster.health_check_s
            )
            spec = CoordinatorSpec(
                str(store_dir),
                config,
                shard_names,
                embedder_names,
                dim,
                self.routing.get_meta("home", HEAD_RESOURCE),
                Coordinator,
            )
            self.keeper = ShardKeeper(shard_names, Path(store_dir), config, dim, self.routing, ray_shards.mark, spec)
            shards = ray_shards
        self.shards = shards
        if embed is None and embedder_names:
            embed = RayEmbedders(
                embedder_names, self.namespace, config.cluster.embed_chunk, config.cluster.call_timeout_s
            )
        self.embedders = embed  # RayEmbedders (its stats show in stats()), a test's callable, or None
        self.decider = decider if decider is not None else make_decider(config, ray_metrics.SINK)
        self.ingest = BatchIngest(config, self.shards, self.routing, dim, embed=embed, decider=self.decider)
        self._queue: list[_Request] = []
        self._queued = 0
        self._wake: asyncio.Event | None = None
        self._space: asyncio.Condition | None = None
        self._loop_task: asyncio.Task | None = None
        self._next: asyncio.Task | None = None  # the next micro-batch's lookups, started early
        self._paused = False
        self._holds = 0  # pauses not yet resumed (a snapshot's, a removal's): batches wait while any is held
        self._held_tokens: set[str] = set()  # tokens of the pauses holding now
        self._resumed_early: dict[str, None] = {}  # tokens resumed before their pause started (oldest first, bounded)
        self._idle: asyncio.Event | None = None
        self.counters = {"requests": 0, "pipelined": 0, "overloaded": 0}

    # -- the client API ------------------------------------------------------------------------
    async def add_many(self, trajectories: Sequence[Trajectory], vectors: np.ndarray | None = None) -> list[AddResult]:
        """Acknowledged (returned) once every trajectory of the request is committed on its shard."""
        batch = await asyncio.to_thread(
            pack_trajectories, list(trajectories), vectors, self.dim, self.config.evolution.workflow_features
        )
        return await self.add_batch(batch, vectors is not None)

    async def add_batch(self, batch: ItemBatch, embedded: bool) -> list[AddResult]:
        """:meth:`add_many` for trajectories packed by the client (the fast path: encoding and
        workflow vectors are computed in the client's process, not here)."""
        self._ensure_loop()
        if not isinstance(batch, ItemBatch):
            raise ArgumentTypeError(f"expected an ItemBatch, got {type(batch).__name__}", where="batch")
        if batch.features != self.config.evolution.workflow_features:
            raise ConfigError(
                f"packed with workflow features {batch.features!r}, the deployment uses "
                f"{self.config.evolution.workflow_features!r} (evolution.workflow_features)",
                where="batch",
            )
        if len(batch) and batch.vecs.shape != (len(batch), self.dim):
            raise InvalidArgumentError(
                f"expected shape ({len(batch)}, {self.dim}), got {tuple(batch.vecs.shape)}",
                where="vectors",
            )
        if not len(batch):
            return []
        n = len(batch)
        limit = self.config.cluster.max_pending
        assert self._space is not None and self._wake is not None
        async with self._space:
            try:
                await asyncio.wait_for(
                    self._space.wait_for(lambda: self._queued == 0 or self._queued + n <= limit),
                    timeout=self.config.cluster.overload_timeout_s,
                )
            except TimeoutError:
                self.counters["overloaded"] += 1
                raise OverloadedError(
                    f"the coordinator's queue held {self._queued} trajectories (cluster.max_pending = {limit}) for "
                    f"{self.config.cluster.overload_timeout_s:.0f} s; retry later or add shards"
                ) from None
            future = asyncio.get_running_loop().create_future()
            self._queue.append(_Request(batch, embedded, future))
            self._queued += n
            ray_metrics.set_queue_depth(self.namespace, self._queued)
        self.counters["requests"] += 1
        self._wake.set()
        return await future

    async def stats(self) -> dict[str, Any]:
        ingest = self.ingest
        return {
            "queued": self._queued,
            "initialised": ingest.initialised,
            "routes": len(self.routing),
            "shard_loads": list(ingest.loads),
            "counters": {**self.counters, **ingest.counters},
            "stage_seconds": {k: round(v, 3) for k, v in ingest.stage_seconds.items()},
            "llm": self.decider.usage() if self.decider is not None else {},
            "embedding": await self._embedding_stats(),
        }

    async def _embedding_stats(self) -> dict[str, Any]:
        """The embedder replicas' figures added up (cache hit rate, model calls; see
        :func:`~.ray_shards.embedding_totals`); empty without embedder actors."""
        stats = getattr(self.embedders, "stats", None)
        return await stats() if callable(stats) else {}

    async def deployment(self) -> dict[str, Any]:
        self._ensure_keeper()
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

    async def pause(self, token: str | None = None) -> None:
        """Stop taking new micro-batches and wait for the one in flight (for a consistent snapshot,
        or a removal). Pauses nest: batches go on once every pause is resumed. ``token`` pairs
        it with its :meth:`resume`, which may then arrive first (Ray does not order an async
        actor's calls): a pause whose token was already resumed holds nothing."""
        self._ensure_loop()
        if token is not None and token in self._resumed_early:
            self._resumed_early.pop(token)
            return
        if token is not None:
            self._held_tokens.add(token)
        self._holds += 1
        self._paused = True
        assert self._idle is not None
        await self._idle.wait()

    async def resume(self, token: str | None = None) -> None:
        if token is not None and token not in self._held_tokens:
            self._resumed_early[token] = None  # its pause has not started: it will hold nothing
            while len(self._resumed_early) > MAX_EARLY_RESUMES:
                self._resumed_early.pop(next(iter(self._resumed_early)))
            return
        self._held_tokens.discard(token)
        self._holds = max(0, self._holds - 1)
        self._paused = self._holds > 0
        if self._wake is not None and not self._paused:
            self._wake.set()

    # -- deleting ------------------------------------------------------------------------------
    async def remove(self, ids: list[str], tenant: str = DEFAULT_TENANT) -> int:
        """Delete ``tenant``'s trajectories of these ids on every shard; how many were stored.

        Runs between micro-batches (no batch in flight, none started until it is done), so a
        batch never plans with, or commits to, a cluster the removal changes or retires; the
        next batch looks its candidates up afterwards. Idempotent: a resent removal (the
        coordinator or a shard restarted) removes what is left and ignores what is gone."""
        check_tenant(tenant, "tenant", stored=True)
        if isinstance(ids, str) or not all(isinstance(i, str) for i in ids):
            raise ArgumentTypeError("expected a list of trajectory id strings", where="ids")
        return await self._exclusive("remove", list(ids), tenant)

    async def purge_tenant(self, tenant: str) -> int:
        """Delete everything of ``tenant`` on every shard (between micro-batches, as :meth:`remove`).
        Each shard records the intent durably first and finishes it after a crash."""
        check_tenant(tenant, "tenant", stored=True)
        return await self._exclusive("purge_tenant", tenant)

    async def _exclusive(self, method: str, *args: Any) -> int:
        """``method`` on every shard between micro-batches; the shard loads follow what each
        shard removed, also when another shard failed (whose error is then raised: a resent
        call removes what that shard still holds)."""
        await self.pause()
        try:
            answers = await asyncio.gather(
                *[self.shards.call(s, method, *args) for s in range(len(self.shards))], return_exceptions=True
            )
        finally:
            await self.resume()
        counts = [0 if isinstance(a, BaseException) else int(a) for a in answers]
        loads = self.ingest.loads
        for shard, n in enumerate(counts):
            loads[shard] = max(0, loads[shard] - n)
        self.routing.put_meta("shard_loads", loads)
        self.counters["removed"] = self.counters.get("removed", 0) + sum(counts)
        failed = next((a for a in answers if isinstance(a, BaseException)), None)
        if failed is not None:
            raise failed
        return sum(counts)

    async def snapshot_routing(self, target: str) -> int:
        self.routing.put_meta("shard_loads", self.ingest.loads)
        self.routing.snapshot(target)
        return len(self.routing)

    async def resync(self) -> int:
        """Rebuild the routing table from what the shards hold (after a restore, a split, or a
        restart of this actor, also on a head node that came back with an empty disk): the
        routes, the shard loads, whether the memory is initialised, and where each shard runs."""
        shards = range(len(self.shards))
        lists = await asyncio.gather(*[self.shards.call(s, "cluster_ids") for s in shards])
        routes = {cid: i for i, ids in enumerate(lists) for cid in ids}
        self.routing.replace_all(routes)
        infos = await asyncio.gather(*[self.shards.info(s) for s in shards])
        self.ingest.loads = [info["trajectories"] for info in infos]
        self.ingest.initialised = any(info["initialised"] for info in infos)
        self.routing.put_meta("initialised", self.ingest.initialised)
        self.routing.put_meta("shard_loads", self.ingest.loads)
        nodes = [info.get("node_id") for info in infos]
        if all(nodes) and self.keeper is not None:  # where the shards run now (a Ray deployment)
            self.routing.put_meta("nodes", nodes)
        if self.routing.get_meta("store") is None:  # the routing table was lost with its disk
            self.routing.put_meta("store", str(self.store_dir))
        return len(routes)

    async def _recover(self) -> None:
        """After this actor starts (also restarted by Ray, on a head node that came back): the
        routing state rebuilt from the live shards, tried until they answer (each try bounded
        by ``cluster.call_timeout_s``, then a growing pause up to 30 s)."""
        pause = 1.0
        while True:
            try:
                routes = await asyncio.wait_for(self.resync(), self.config.cluster.call_timeout_s)
            except Exception as exc:  # noqa: BLE001 - shards not reachable yet: try again
                log.warning(
                    "routes not rebuilt from the shards yet (%s: %s); again in %.0f s", type(exc).__name__, exc, pause
                )
                await asyncio.sleep(pause)
                pause = min(30.0, pause * 2)
            else:
                log.info("routing state rebuilt from the shards: %d routes", routes)
                return

    async def _recovered(self) -> None:
        """Wait (at most :data:`RECOVERY_WAIT_S`) for :meth:`_recover` before the first batch:
        a batch planned on routes the shards no longer agree with would fail; past it (a shard
        still down), batches go on with the routing table as it was."""
        if self._recovery is not None and not self._recovery.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._recovery), RECOVERY_WAIT_S)
            except TimeoutError:
                log.warning("first batch planned before the routes were rebuilt from the shards")

    async def ping(self) -> str:
        self._ensure_keeper()
        return "ok"

    async def health(self) -> dict[str, Any]:
        """What the shard keeper sees: per shard, why it is down (if it is), for how long, and
        its restarts and rebuilds."""
        self._ensure_keeper()
        down = getattr(self.shards, "down", {})
        kept = self.keeper.status() if self.keeper is not None else []
        return {
            "looks": self.keeper.looks if self.keeper is not None else 0,
            "shards": [{**k, "down": down.get(k["index"])} for k in kept],
        }

    def _ensure_keeper(self) -> None:
        """The shard keeper's loop and the routing state's recovery from the shards, started with
        the first call the actor serves (also after a restart)."""
        if self.keeper is not None and self._keeper_task is None:
            self._keeper_task = asyncio.get_running_loop().create_task(self.keeper.run())
            self._recovery = asyncio.get_running_loop().create_task(self._recover())

    # -- the batching loop -----------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        self._ensure_keeper()
        if self._loop_task is None:
            self._wake = asyncio.Event()
            self._space = asyncio.Condition()
            self._idle = asyncio.Event()
            self._idle.set()
            self._loop_task = asyncio.get_running_loop().create_task(self._batch_loop())

    async def _batch_loop(self) -> None:
        """One micro-batch after another, pipelined: while a batch is planned (coordinator CPU),
        the shards already look up the next one (ids, neighbours); that batch is then planned
        with what the one before it stored (see :func:`~.batching.absorb_previous`)."""
        assert self._wake is not None and self._space is not None and self._idle is not None
        wait = self.config.cluster.batch_wait_ms / 1000.0
        previous: Committed | None = None
        await self._recovered()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._next is not None or (self._queue and not self._paused):
                self._idle.clear()
                if self._next is not None:
                    flight, pipelined = await self._next, True
                    self._next = None
                    if previous is None:
                        # The batch before failed after these lookups were made: it may have
                        # stored part of itself, so look again rather than plan without it.
                        flight, pipelined = await self._front(flight.requests), False
                    else:
                        self.counters["pipelined"] += 1
                else:
                    # Let a micro-batch fill for a moment, unless it is already full.
                    first = self._queue[0].enqueued
                    # A poll bounded by batch_wait_ms (2 ms steps), not a wait for an event.
                    while self._queued < self.config.cluster.batch_size and time.monotonic() - first < wait:  # noqa: ASYNC110
                        await asyncio.sleep(min(wait, 0.002))
                    flight, pipelined = await self._front(self._take()), False
                try:
                    outcomes, previous = await self.ingest.back(
                        flight.stage, previous if pipelined else None, self._overlap
                    )
                    for request, outcome in zip(flight.requests, outcomes, strict=True):
                        if not request.future.done():
                            if isinstance(outcome, Exception):
                                request.future.set_exception(outcome)
                            else:
                                request.future.set_result(outcome)
                except Exception as exc:  # the batch fails; the loop goes on
                    log.exception("micro-batch failed")
                    previous = None
                    for request in flight.requests:
                        if not request.future.done():
                            request.future.set_exception(exc)
                finally:
                    async with self._space:
                        self._queued -= flight.stage.count
                        self._space.notify_all()
                    ray_metrics.observe_batch(self.namespace, flight.stage.count)
                    ray_metrics.set_queue_depth(self.namespace, self._queued)
                    if self._next is None:
                        self._idle.set()

    async def _front(self, requests: list[_Request]) -> _InFlight:
        stage = await self.ingest.front([r.batch for r in requests], [r.embedded for r in requests])
        return _InFlight(requests, stage)

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

    def _overlap(self) -> asyncio.Task | None:
        """Called as a batch's planning starts: begin the next micro-batch's shard lookups now,
        if one is waiting (see _batch_loop); the batch commits only once they are done."""
        if (
            self._next is None
            and self._queue
            and not self._paused
            and self.ingest.initialised
            and self.config.cluster.pipeline
        ):
            self._next = asyncio.get_running_loop().create_task(self._front(self._take()))
        return self._next
