"""AsyncMemoryClient: the sharded memory from asyncio code (an async Ray actor, a web server).

Every operation of :class:`~lifemem_ray.actors.cluster.client.MemoryClient`, awaitable: Ray
object refs are awaited, never ``ray.get`` on the event loop, so one loop serves many
concurrent retrievals and adds. The rules are the blocking client's
(:mod:`~lifemem_ray.actors.cluster.client_rules`): the same timeouts
(``cluster.call_timeout_s`` for shard calls), the same resends of an add whose coordinator
died, the same ids in doubt, the same one-round and two-round retrieval, merged the same way.

Example (in a process of the Ray cluster that runs ``lifemem-ray serve --namespace lifemem``)::

    import asyncio

    from lifemem_ray.actors.cluster.async_client import AsyncMemoryClient
    from lifemem_ray.core.model import Step, Trajectory


    async def main() -> None:
        memory = await AsyncMemoryClient.connect(namespace="lifemem")
        done = Trajectory(env="shop", task="buy a usb stick", steps=(Step(action="search usb"),), id="t1")
        print(await memory.add_many([done]))  # resolves on acknowledgement
        hits = await asyncio.gather(*(memory.retrieve("buy a usb stick", "shop", 4) for _ in range(8)))
        print(hits[0].context)
        print((await memory.stats())["trajectories"])


    asyncio.run(main())
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import ray

from lifemem_ray.actors.cluster import deployment, ray_address
from lifemem_ray.actors.cluster.client_rules import (
    AddRequest,
    InDoubtLedger,
    TwoRoundMerge,
    any_conflict,
    check_listing,
    check_remove,
    merge_clusters,
    merge_stats,
    one_round_results,
    prepare_add,
    send_again,
    shard_pins,
    with_deployment_stats,
)
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.coordinator_ref import CoordinatorRef
from lifemem_ray.actors.cluster.query_vectors import QueryVectors
from lifemem_ray.actors.cluster.ray_metrics import RECORDER
from lifemem_ray.actors.cluster.ray_shards import embed_plan, find_embedders_again, gather_rows, pack_queries
from lifemem_ray.actors.cluster.remote_errors import ShardUnavailableError, actor_failures, raise_own, raise_remote
from lifemem_ray.core.errors import EmbeddingError
from lifemem_ray.core.model import Trajectory
from lifemem_ray.core.tenancy import DEFAULT_TENANT, check_tenant, search_targets
from lifemem_ray.engine.protocols import MemoryStats
from lifemem_ray.engine.retrieval import Retrieval, check_retrieve_args, paused_gc
from lifemem_ray.engine.versions import format_version

__all__ = ["AsyncAddFuture", "AsyncMemoryClient"]


class AsyncAddFuture:
    """The awaitable twin of :class:`~lifemem_ray.actors.cluster.client.AddFuture`: the request
    is already sent; ``await future`` (or ``await future.result(attempt_timeout_s)``) gives the
    per-trajectory results once the coordinator acknowledged.

    The same policy (:class:`~lifemem_ray.actors.cluster.client_rules.AddRequest`): the
    coordinator's own error is raised unwrapped; no answer within the attempt's time raises
    ``TimeoutError`` (the ids are then in doubt, not resent); a request whose coordinator died
    is sent again up to ``cluster.add_resends`` times, and what its first attempt committed
    reads ``added``. Awaiting it again gives the same results."""

    def __init__(self, ref: Any, request: AddRequest, resend: Callable[[], Any] | None = None) -> None:
        self.ref = ref
        self.request = request
        self.resend = resend  # sends the same request again (a new ref)
        self._results: Any = None
        self._settled = False
        self._lock = asyncio.Lock()  # one coroutine waits and resends; the others get its results

    def __await__(self) -> Generator[Any, None, Any]:
        return self.result().__await__()

    async def result(self, attempt_timeout_s: float | None = None) -> Any:
        """The per-trajectory results. ``attempt_timeout_s``: how long each attempt may wait
        (as ``AddFuture.result(timeout)``; None: ``cluster.call_timeout_s``); past it, ``TimeoutError``. A wait
        cancelled from outside (``asyncio.timeout``, a cancelled task) also leaves the ids in
        doubt: the request may still commit."""
        async with self._lock:
            if not self._settled:
                limit = self.request.wait_s if attempt_timeout_s is None else attempt_timeout_s
                self._results = self.request.answered(await self._acknowledged(limit))
                self._settled = True
        return self._results

    async def _acknowledged(self, attempt_timeout_s: float | None) -> Any:
        while True:
            try:
                return await asyncio.wait_for(self._answer(), attempt_timeout_s)
            except asyncio.CancelledError:
                self.request.ledger.remember(self.request.sent)
                raise
            except (ray.exceptions.RayError, TimeoutError) as exc:
                delay = self.request.failed(exc, self.resend is not None)
                if delay is None or self.resend is None:
                    raise_remote(exc)  # the coordinator's own error without Ray's wrapping, or exc as it came
                await asyncio.sleep(delay)
                self.ref = await asyncio.to_thread(send_again, self.resend, self.request)

    async def _answer(self) -> Any:
        return await self.ref

    def done(self) -> bool:
        """Whether the current attempt has an answer (an acknowledgement or an error)."""
        ready, _ = ray.wait([self.ref], timeout=0)
        return bool(ready)


class AsyncMemoryClient:
    """:class:`~lifemem_ray.actors.cluster.client.MemoryClient`'s operations as coroutines
    (adds return an :class:`AsyncAddFuture`). Make one with :meth:`connect`; use it from one
    event loop."""

    def __init__(
        self,
        namespace: str,
        config: DeploymentConfig,
        coordinator: CoordinatorRef,
        info: dict[str, Any],
        embedders: list[Any],
    ) -> None:
        self.namespace = namespace
        self.config = config
        self._coordinator = coordinator  # by name, found again after it died (coordinator_ref's rule)
        self.dim: int = info["dim"]
        self.shard_names: list[str] = info["shards"]
        self._shards: list[Any] | None = None  # looked up again after a shard failed
        self.embedder_names: list[str] = info["embedders"]
        self.embedders = embedders  # actor handles, typed Any: Ray types their methods as Never
        self.in_doubt = InDoubtLedger()  # ids of adds whose answer was lost
        # Recent retrieval texts' vectors, and the texts in flight (cluster.client_vector_cache).
        self.query_vectors = QueryVectors(config.cluster.client_vector_cache, self.dim)

    @classmethod
    async def connect(
        cls, namespace: str = "lifemem", address: str | None = None, config: DeploymentConfig | None = None
    ) -> AsyncMemoryClient:
        """Attach to the deployment in ``namespace`` (starting a Ray connection if needed, as
        :meth:`MemoryClient.connect <lifemem_ray.actors.cluster.client.MemoryClient.connect>`)."""
        if not ray.is_initialized():
            ray_address.connect(address, namespace, include_dashboard=False, log_to_driver=False)  # never a scan
        config = config or DeploymentConfig()
        coordinator = CoordinatorRef(namespace, config.cluster.call_timeout_s)
        info = await coordinator.acall("deployment")
        embedders = await asyncio.to_thread(_named_actors, info["embedders"], namespace)
        return cls(namespace, config, coordinator, info, embedders)

    @property
    def coordinator(self) -> Any:
        """The coordinator's actor handle in use (looked up by name again after it died)."""
        return self._coordinator.handle

    async def shards(self) -> list[Any]:
        """The shard actors' handles (looked up on first use, and after a shard failed)."""
        if self._shards is None:
            try:
                self._shards = await asyncio.to_thread(_named_actors, self.shard_names, self.namespace)
            except ValueError as exc:  # a shard actor is gone and not yet started again
                raise ShardUnavailableError(f"a shard is not running now ({exc}); retry shortly") from None
        return self._shards

    async def _answers(self, refs: list[Any], what: str = "retrieval") -> list[Any]:
        """The shards' answers, within cluster.call_timeout_s; a shard that died, or did not
        answer, is a ShardUnavailableError, and the handles are looked up again next time."""
        limit = self.config.cluster.call_timeout_s
        try:
            return await asyncio.wait_for(_gather(refs), limit)
        except actor_failures(TimeoutError) as exc:
            self._shards = None
            why = f"no answer within cluster.call_timeout_s = {limit:g} s" if isinstance(exc, TimeoutError) else exc
            raise ShardUnavailableError(f"a shard is unavailable for {what}: {type(exc).__name__}: {why}") from exc
        except ray.exceptions.RayTaskError as exc:  # a shard's own refusal as itself, as the blocking client
            raise_own(exc)

    # -- adding ----------------------------------------------------------------------------
    def add(self, trajectory: Trajectory, vector: Any = None) -> AsyncAddFuture:
        """One trajectory: ``await memory.add(t)`` gives its one result."""
        vectors = None if vector is None else np.asarray(vector, dtype=np.float32).reshape(1, -1)
        future = self.add_many([trajectory], vectors)
        future.request.single = True
        return future

    def add_many(self, trajectories: Sequence[Trajectory], vectors: Any = None) -> AsyncAddFuture:
        """One request, sent now: acknowledged as a whole; rejected whole if an id conflicts.
        ``await`` the future for the results. Packed in the caller's process, as
        :meth:`MemoryClient.add_many <lifemem_ray.actors.cluster.client.MemoryClient.add_many>`."""
        request, send = prepare_add(
            trajectories,
            vectors,
            dim=self.dim,
            features=self.config.evolution.workflow_features,
            coordinator=self._coordinator,
            ledger=self.in_doubt,
            resends=self.config.cluster.add_resends,
            wait_s=self.config.cluster.call_timeout_s,
        )
        return AsyncAddFuture(send(), request, resend=send)

    async def stored_conflicts(self, ids: list[str], fingerprints: list[str]) -> list[bool]:
        """Per id key: whether a shard holds it with another fingerprint (one call per shard)."""
        shards = await self.shards()
        return any_conflict(await self._answers([s.known.remote(ids, fingerprints) for s in shards]), len(ids))

    # -- retrieving --------------------------------------------------------------------------
    async def embed(self, texts: list[str]) -> np.ndarray:
        """Embeddings of ``texts`` from the deployment's embedder actors, routed as
        :meth:`MemoryClient.embed <lifemem_ray.actors.cluster.client.MemoryClient.embed>` routes
        them (each text on the replica its hash names, calls of ``cluster.embed_chunk`` texts)."""
        if not self.embedders:
            raise EmbeddingError(
                "no embedder actors in this deployment (deployed with cluster.embedders = 0); pass vectors, or deploy with embedders"
            )
        plan = embed_plan(texts, len(self.embedders), self.config.cluster.embed_chunk)
        limit = self.config.cluster.call_timeout_s
        try:
            answers = await asyncio.wait_for(
                _gather([self.embedders[replica].embed.remote([texts[i] for i in at]) for replica, at in plan]), limit
            )
        except ray.exceptions.RayTaskError as exc:  # an embedder's own error (EmbeddingError...) as itself
            raise_own(exc)
        except actor_failures(TimeoutError) as exc:  # its node is gone, or restarting
            self.embedders = await asyncio.to_thread(
                find_embedders_again, self.embedders, self.embedder_names, self.namespace
            )
            raise EmbeddingError(
                f"the deployment's embedders did not answer within {limit:g} s (cluster.call_timeout_s): "
                f"{type(exc).__name__}; retry later, or pass vectors"
            ) from None
        return gather_rows(texts, plan, answers)

    async def retrieve(
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
        """Like :meth:`lifemem_ray.engine.memory.Memory.retrieve` (``env=None``: every environment of the tenant)."""
        vectors = None if vector is None else [vector]
        found = await self.retrieve_many(
            [task], [env], k, vectors=vectors, token_budget=token_budget, skills=skills, tenant=tenant, as_of=as_of
        )
        return found[0]

    async def retrieve_many(
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
        """Like :meth:`lifemem_ray.engine.memory.Memory.retrieve_many`: queries of one tenant
        (``None`` envs: all of its environments); one round for up to
        ``cluster.one_round_max`` queries, two rounds beyond."""
        started = time.monotonic()
        tasks, envs, k, budget = check_retrieve_args(tasks, envs, k, token_budget, self.config.retrieval)
        targets = search_targets(tenant, envs)  # what the shards search: the tenant's scopes
        if not tasks:
            return []
        if vectors is None:
            vecs = await self.query_vectors.vectors_async(tasks, self.embed)
        else:
            vecs = np.asarray(vectors, dtype=np.float32)
        shards = await self.shards()
        pins = shard_pins(as_of, len(shards))  # each shard's watermark of a pinned read
        if len(tasks) <= self.config.cluster.one_round_max:
            queries = pack_queries(vecs, len(tasks), self.dim)
            per_shard = await self._answers(
                [s.search_records.remote(targets, k, queries, skills, pin) for s, pin in zip(shards, pins, strict=True)]
            )
            with paused_gc():
                out = one_round_results(tasks, envs, per_shard, k, self.config.retrieval.max_skills, budget)
        else:
            out = await self._retrieve_two_rounds(tasks, envs, targets, k, vecs, skills, budget, pins)
        RECORDER.observe_latency("retrieve", "client", time.monotonic() - started)
        return out

    async def _retrieve_two_rounds(
        self,
        tasks: list[str],
        envs: list[str | None],
        targets: list[str],
        k: int,
        vecs: np.ndarray,
        skills: bool,
        budget: int,
        pins: list[int | None],
    ) -> list[Retrieval]:
        """Scores and ids first, then only the merged top-k's records, as the blocking client
        (:class:`~lifemem_ray.actors.cluster.client_rules.TwoRoundMerge`)."""
        shards = await self.shards()
        plan = TwoRoundMerge(len(tasks), len(shards), k, self.config.cluster)
        searches = [
            [s.search_hits.remote(targets[a:b], k, vecs[a:b], pin) for s, pin in zip(shards, pins, strict=True)]
            for a, b in plan.searches
        ]

        async def fetch(a: int, b: int) -> tuple[np.ndarray, np.ndarray, list[tuple[np.ndarray, Any]]]:
            group = plan.group_of(a)
            if plan.needs(group):
                plan.merge(group, await self._answers(searches[group]))
            scores, ids, wanted = plan.winners(a, b)
            return scores, ids, [(at, shards[i].hit_records.remote(ids.ravel()[at], skills)) for i, at in wanted]

        out: list[Retrieval] = []
        ahead = await fetch(*plan.chunks[0])
        for i, (a, b) in enumerate(plan.chunks):
            scores, ids, wanted = ahead
            if i + 1 < len(plan.chunks):
                ahead = await fetch(*plan.chunks[i + 1])  # its records travel while this chunk is decoded
            answers = await self._answers([ref for _, ref in wanted])
            positions = [at for at, _ in wanted]
            with paused_gc():
                max_skills = self.config.retrieval.max_skills
                out += plan.results(tasks[a:b], envs[a:b], scores, ids, positions, answers, max_skills, budget)
        return out

    # -- state -----------------------------------------------------------------------------
    async def version(self) -> str:
        """As :meth:`MemoryClient.version <lifemem_ray.actors.cluster.client.MemoryClient.version>`."""
        shards = await self.shards()
        return format_version(await self._answers([s.watermark.remote() for s in shards], "version"))

    async def stats(self, tenant: str | None = None) -> MemoryStats:
        """The deployment's counts, as :meth:`MemoryClient.stats
        <lifemem_ray.actors.cluster.client.MemoryClient.stats>` (``tenant``: that tenant's own)."""
        if tenant is not None:
            check_tenant(tenant, "tenant")
        shard_stats = await self._answers([s.stats.remote(tenant) for s in await self.shards()], "stats")
        out = merge_stats(shard_stats, tenant)
        if tenant is None:
            out = with_deployment_stats(out, shard_stats, await self._coordinator.acall("stats"))
        return out  # type: ignore[return-value]

    async def clusters(
        self, env: str | None = None, *, tenant: str | None = DEFAULT_TENANT, limit: int | None = None
    ) -> list[Any]:
        """``tenant``'s live clusters on every shard, largest first (None: every tenant's)."""
        check_listing(tenant, limit)
        shards = await self.shards()
        return merge_clusters(
            await self._answers([s.clusters.remote(env, tenant, limit) for s in shards], "clusters"), limit
        )

    async def cluster_count(self, env: str | None = None, *, tenant: str | None = DEFAULT_TENANT) -> int:
        """How many clusters :meth:`clusters` would list without a limit."""
        check_listing(tenant)
        shards = await self.shards()
        return sum(await self._answers([s.cluster_count.remote(env, tenant) for s in shards], "cluster_count"))

    # -- deleting ----------------------------------------------------------------------------
    async def remove(self, ids: Sequence[str], *, tenant: str = DEFAULT_TENANT) -> int:
        """Delete ``tenant``'s trajectories of these ids (through the coordinator; idempotent)."""
        return int(await self._coordinator.acall("remove", check_remove(ids, tenant), tenant))

    async def purge_tenant(self, tenant: str) -> int:
        """Delete everything of ``tenant`` on every shard (see :meth:`remove`)."""
        check_tenant(tenant, "tenant", stored=True)
        return int(await self._coordinator.acall("purge_tenant", tenant))

    async def verify(self, deep: bool = False) -> dict[str, Any]:
        """Every shard's invariants (``deep``: also every record's fingerprint, recomputed)."""
        reports = await self._answers([s.verify.remote(deep) for s in await self.shards()], "verify")
        return {"ok": all(r["ok"] for r in reports), "shards": reports}

    async def maintain(self) -> int:
        """Run every shard's queued splits and skills now and wait for its index retrains."""
        return sum(await self._answers([s.maintain.remote() for s in await self.shards()], "maintain"))

    async def snapshot(self, directory: str | Path) -> dict[str, Any]:
        """A consistent copy of every shard and the routing (run in a thread: it waits on Ray)."""
        return await asyncio.to_thread(deployment.snapshot, directory, self.namespace)

    def close(self) -> None:
        """Drop the handles; the deployment keeps running (see ``lifemem-ray stop``)."""
        self._shards = []
        self.embedders = []


def _named_actors(names: list[str], namespace: str) -> list[Any]:
    """Handles of named actors (a blocking lookup: run in a thread)."""
    return [ray.get_actor(name, namespace=namespace) for name in names]


async def _gather(refs: list[Any]) -> list[Any]:
    """Every ref's value, awaited together (the first error is raised)."""
    return list(await asyncio.gather(*refs))
