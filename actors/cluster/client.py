"""MemoryClient: the sharded memory from any process of the cluster (rollout workers too).

Adds go through the coordinator and resolve on acknowledgement; retrievals go
straight to the shards (for a few queries, one call per shard; for more, chunked
searches and then a second call that fetches only the records that won the merge) and are merged
here exactly as the single-process engine orders them: top-k by score, then the
skills of those trajectories' clusters in order of first appearance. A retrieval's texts are
embedded by the deployment's embedder actors, except those the client embedded lately or is
embedding for another thread right now (:class:`~.query_vectors.QueryVectors`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
from lifemem_ray.core.errors import DeploymentNotFoundError, EmbeddingError
from lifemem_ray.core.model import Trajectory
from lifemem_ray.core.tenancy import DEFAULT_TENANT, check_tenant, search_targets
from lifemem_ray.engine.protocols import MemoryStats
from lifemem_ray.engine.retrieval import Retrieval, check_retrieve_args, paused_gc
from lifemem_ray.engine.versions import format_version

__all__ = ["AddFuture", "MemoryClient"]


def _read_the_rest(refs: list[Any], wait_s: float = 1.0) -> None:
    """Read the answers of ``refs`` that come within ``wait_s`` after one of them failed: every
    shard usually refuses the same call, and an error never read is printed by Ray, with its
    traceback, when its ref is dropped (an "Unhandled error" on the caller's stderr)."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
    for ref in ready:
        with contextlib.suppress(Exception):  # read only so that Ray does not print it; the first error is raised
            ray.get(ref, timeout=0)


@dataclass(eq=False)  # a future is itself: compared and hashed by identity
class AddFuture:
    """Resolves when the coordinator acknowledged (every trajectory committed on its shard).

    When the answer is lost (an actor died), the request's ids are kept by the client as *in
    doubt*: its first attempt may have committed them. A later request of the same client
    that finds such an id stored with the same content reports it ``added`` (this client's
    own earlier attempt stored it), not ``duplicate``. The policy is
    :class:`~lifemem_ray.actors.cluster.client_rules.AddRequest`'s, shared with
    :class:`~lifemem_ray.actors.cluster.async_client.AsyncAddFuture`.

    Picklable: a future may be handed to another process (a rollout worker hands its adds to
    the pool), which waits for it, and sends it again, in the same way; the doubts of a
    travelling future are then its own."""

    ref: Any
    request: AddRequest = field(default_factory=lambda: AddRequest({}, []))
    resend: Callable[[], Any] | None = None  # sends the same request again (a new ref)
    resend_at: float | None = None  # poll(): monotonic time when a request whose coordinator died goes out again

    @property
    def single(self) -> bool:
        """Whether it answers one result (:meth:`MemoryClient.add`) rather than a list."""
        return self.request.single

    @single.setter
    def single(self, value: bool) -> None:
        self.request.single = value

    def result(self, timeout: float | None = None) -> Any:
        """The per-trajectory results (``timeout``: per attempt; None: ``cluster.call_timeout_s``).
        A request whose coordinator died is sent again (up to ``cluster.add_resends`` times, to
        the coordinator found by name again): ids its first attempt committed then come back
        ``duplicate`` and are reported ``added``. No answer in time: ``TimeoutError`` (the ids
        are in doubt: the request may still commit)."""
        self._resend_due(wait=True)
        limit = self.request.wait_s if timeout is None else timeout
        while True:
            try:
                out = ray.get(self.ref, timeout=limit)
                break
            except ray.exceptions.RayError as exc:
                delay = self.request.failed(exc, self.resend is not None)
                if delay is None or self.resend is None:
                    raise_remote(exc)  # the coordinator's own error without Ray's wrapping, or exc as it came
                time.sleep(delay)
                self.ref = send_again(self.resend, self.request)
        return self.request.answered(out)

    def poll(self) -> Any | None:
        """The results once acknowledged, else None at once (never waits): a request whose
        coordinator died is sent again when its delay has passed. Raises what
        :meth:`result` would."""
        if not self._resend_due(wait=False) or not self.done():
            return None
        try:
            out = ray.get(self.ref, timeout=0)
        except ray.exceptions.RayError as exc:
            delay = self.request.failed(exc, self.resend is not None)
            if delay is None:
                raise_remote(exc)
            self.resend_at = time.monotonic() + delay
            return None
        return self.request.answered(out)

    def done(self) -> bool:
        """Whether the current attempt has an answer (an acknowledgement or an error)."""
        ready, _ = ray.wait([self.ref], timeout=0)
        return bool(ready)

    def _resend_due(self, wait: bool) -> bool:
        """Send a request :meth:`poll` decided to send again once its time came (``wait``: now,
        after sleeping until then); False while that time has not come."""
        if self.resend_at is None or self.resend is None:
            return True
        if not wait and time.monotonic() < self.resend_at:
            return False
        time.sleep(max(0.0, self.resend_at - time.monotonic()))
        self.resend_at = None
        if wait:
            self.ref = send_again(self.resend, self.request)
            return True
        try:  # poll never waits: no coordinator found by name yet is another delay
            self.ref = self.resend()
        except DeploymentNotFoundError as exc:
            delay = self.request.failed(exc)
            if delay is None:
                raise
            self.resend_at = time.monotonic() + delay
            return False
        return True

    @staticmethod
    def ready(futures: Sequence[AddFuture], timeout: float = 0.0) -> list[AddFuture]:
        """Those of ``futures`` that may move on now (an answer came, or a resend is due), for
        :meth:`poll`; when none may, waits up to ``timeout`` seconds for one. One ``ray.wait``
        for them all."""
        now = time.monotonic()
        backing_off = [f.resend_at - now for f in futures if f.resend_at is not None]
        waiting = [f for f in futures if f.resend_at is None]
        if timeout > 0 and not any(left <= 0 for left in backing_off):
            limit = min([timeout, *backing_off])
            if waiting:
                ray.wait([f.ref for f in waiting], num_returns=1, timeout=limit)
            else:
                time.sleep(limit)
        answered: set[Any] = set()
        if waiting:
            answered = set(ray.wait([f.ref for f in waiting], num_returns=len(waiting), timeout=0)[0])
        now = time.monotonic()
        return [f for f in futures if (f.ref in answered if f.resend_at is None else f.resend_at <= now)]


class MemoryClient:
    """:class:`lifemem_ray.engine.protocols.MemoryAPI` over a Ray deployment (adds return an
    :class:`AddFuture`). Its rules (resends, doubts, merging the shards' answers) are
    :mod:`~lifemem_ray.actors.cluster.client_rules`', shared with
    :class:`~lifemem_ray.actors.cluster.async_client.AsyncMemoryClient`."""

    def __init__(self, namespace: str, config: DeploymentConfig) -> None:
        self.namespace = namespace
        self.config = config
        # The coordinator by name, found again after it died, every call bounded (one rule: coordinator_ref).
        self._coordinator = CoordinatorRef(namespace, config.cluster.call_timeout_s)
        info = self._coordinator.call("deployment")
        self.dim = info["dim"]
        self.shard_names = info["shards"]
        # Actor handles, typed Any: Ray types an actor's methods (ActorHandle.__getattr__) as Never.
        # Looked up again after a shard failed: the deployment may have started it anew elsewhere.
        self._shards: list[Any] | None = None
        self.embedder_names: list[str] = info["embedders"]
        self.embedders: list[Any] = [ray.get_actor(n, namespace=namespace) for n in self.embedder_names]
        self.in_doubt = InDoubtLedger()  # ids of adds whose answer was lost
        # Recent retrieval texts' vectors, and the texts in flight (cluster.client_vector_cache).
        self.query_vectors = QueryVectors(config.cluster.client_vector_cache, self.dim)

    @property
    def coordinator(self) -> Any:
        """The coordinator's actor handle in use (looked up by name again after it died)."""
        return self._coordinator.handle

    @property
    def shards(self) -> list[Any]:
        """The shard actors' handles (looked up on first use, and after a shard failed)."""
        if self._shards is None:
            try:
                self._shards = [ray.get_actor(n, namespace=self.namespace) for n in self.shard_names]
            except ValueError as exc:  # a shard actor is gone and not yet started again
                raise ShardUnavailableError(f"a shard is not running now ({exc}); retry shortly") from None
        return self._shards

    def _answers(self, refs: list[Any], what: str = "retrieval") -> list[Any]:
        """The shards' answers, within cluster.call_timeout_s; a shard that died, or did not
        answer, is a ShardUnavailableError, and the handles are looked up again next time; a
        shard's own refusal (a version above its watermark...) is raised as itself
        (:func:`~.remote_errors.raise_own`), not as Ray's wrapper led by the shard's traceback."""
        try:
            return ray.get(refs, timeout=self.config.cluster.call_timeout_s)
        except actor_failures(ray.exceptions.GetTimeoutError) as exc:
            self._shards = None
            raise ShardUnavailableError(f"a shard is unavailable for {what}: {type(exc).__name__}: {exc}") from exc
        except ray.exceptions.RayTaskError as exc:
            _read_the_rest(refs)
            raise_own(exc)

    @classmethod
    def connect(
        cls, namespace: str = "lifemem", address: str | None = None, config: DeploymentConfig | None = None
    ) -> MemoryClient:
        """Attach to the deployment in ``namespace`` (starting a Ray connection if needed)."""
        if not ray.is_initialized():
            ray_address.connect(address, namespace, include_dashboard=False, log_to_driver=False)  # never a scan
        return cls(namespace, config or DeploymentConfig())

    # -- adding ----------------------------------------------------------------------------
    def add(self, trajectory: Trajectory, vector: Any = None) -> AddFuture:
        vectors = None if vector is None else np.asarray(vector, dtype=np.float32).reshape(1, -1)
        future = self.add_many([trajectory], vectors)
        future.single = True
        return future

    def add_many(self, trajectories: Sequence[Trajectory], vectors: Any = None) -> AddFuture:
        """One request: acknowledged as a whole; rejected whole if an id conflicts.

        The trajectories are encoded and their workflows abstracted here, in the caller's
        process, so the coordinator only routes and decides."""
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
        return AddFuture(send(), request, resend=send)

    def stored_conflicts(self, ids: list[str], fingerprints: list[str]) -> list[bool]:
        """Per id key (:func:`lifemem_ray.core.tenancy.id_key`: the id itself for the default tenant):
        whether a shard holds it with another fingerprint (one call per shard)."""
        return any_conflict(self._answers([s.known.remote(ids, fingerprints) for s in self.shards]), len(ids))

    # -- retrieving --------------------------------------------------------------------------
    def embed(self, texts: list[str]) -> np.ndarray:
        """Embeddings of ``texts`` from the deployment's embedder actors: each text on the replica
        its hash names (:func:`~.ray_shards.route_texts`, as the coordinator's adds), so it meets
        that replica's cache; in calls of at most ``cluster.embed_chunk`` texts."""
        if not self.embedders:
            raise EmbeddingError(
                "no embedder actors in this deployment (deployed with cluster.embedders = 0); pass vectors, or deploy with embedders"
            )
        plan = embed_plan(texts, len(self.embedders), self.config.cluster.embed_chunk)
        refs = [self.embedders[replica].embed.remote([texts[i] for i in at]) for replica, at in plan]
        try:
            answers = ray.get(refs, timeout=self.config.cluster.call_timeout_s)
        except ray.exceptions.RayTaskError as exc:  # an embedder's own error (EmbeddingError...) as itself
            raise_own(exc)
        except actor_failures(ray.exceptions.GetTimeoutError) as exc:  # its node is gone, or restarting
            self.embedders = find_embedders_again(self.embedders, self.embedder_names, self.namespace)
            raise EmbeddingError(
                f"the deployment's embedders did not answer within {self.config.cluster.call_timeout_s:g} s "
                f"(cluster.call_timeout_s): {type(exc).__name__}; retry later, or pass vectors"
            ) from None
        return gather_rows(texts, plan, answers)

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
        """Like :meth:`lifemem_ray.engine.memory.Memory.retrieve` (``env=None``: every environment of the tenant)."""
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
        """Like :meth:`lifemem_ray.engine.memory.Memory.retrieve_many`: queries of one tenant, which
        see only that tenant's trajectories and skills (``None`` envs: all of its environments)."""
        started = time.monotonic()
        tasks, envs, k, budget = check_retrieve_args(
            tasks, envs, k, token_budget, self.config.retrieval
        )  # the engine's checks
        targets = search_targets(tenant, envs)  # what the shards search: the tenant's scopes
        pins = shard_pins(as_of, len(self.shards))  # each shard's watermark of a pinned read
        if not tasks:
            return []
        if vectors is None:
            vecs = self.query_vectors.vectors(tasks, self.embed)
        else:
            vecs = np.asarray(vectors, dtype=np.float32)
        with paused_gc():
            if len(tasks) <= self.config.cluster.one_round_max:
                out = self._retrieve_one_round(tasks, envs, targets, k, vecs, skills, budget, pins)
            else:
                out = self._retrieve_two_rounds(tasks, envs, targets, k, vecs, skills, budget, pins)
        RECORDER.observe_latency("retrieve", "client", time.monotonic() - started)
        return out

    def _retrieve_one_round(
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
        """Each shard sends its top-k with their records; the least latency for a few queries."""
        queries = pack_queries(vecs, len(tasks), self.dim)
        per_shard = self._answers(
            [
                shard.search_records.remote(targets, k, queries, skills, pin)
                for shard, pin in zip(self.shards, pins, strict=True)
            ]
        )
        return one_round_results(tasks, envs, per_shard, k, self.config.retrieval.max_skills, budget)

    def _retrieve_two_rounds(
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
        """Scores and ids first, then only the merged top-k's records (:class:`TwoRoundMerge`):
        all searches go out at once; each chunk's records are fetched while the chunk before
        is decoded."""
        shards = self.shards
        plan = TwoRoundMerge(len(tasks), len(shards), k, self.config.cluster)
        searches = [
            [s.search_hits.remote(targets[a:b], k, vecs[a:b], pin) for s, pin in zip(shards, pins, strict=True)]
            for a, b in plan.searches
        ]

        def fetch(a: int, b: int) -> tuple[np.ndarray, np.ndarray, list[tuple[np.ndarray, Any]]]:
            group = plan.group_of(a)
            if plan.needs(group):
                plan.merge(group, self._answers(searches[group]))
            scores, ids, wanted = plan.winners(a, b)
            return scores, ids, [(at, shards[i].hit_records.remote(ids.ravel()[at], skills)) for i, at in wanted]

        out: list[Retrieval] = []
        ahead = fetch(*plan.chunks[0])
        for i, (a, b) in enumerate(plan.chunks):
            scores, ids, wanted = ahead
            if i + 1 < len(plan.chunks):
                ahead = fetch(*plan.chunks[i + 1])
            answers = self._answers([ref for _, ref in wanted])
            positions = [at for at, _ in wanted]
            max_skills = self.config.retrieval.max_skills
            out += plan.results(tasks[a:b], envs[a:b], scores, ids, positions, answers, max_skills, budget)
        return out

    # -- state -----------------------------------------------------------------------------
    def version(self) -> str:
        """The deployment's version now: one watermark per shard (:mod:`lifemem_ray.engine.versions`).
        A retrieve ``as_of`` it sees what the shards had committed when each answered this
        call; a version read after an add's acknowledgement covers that add."""
        return format_version(self._answers([s.watermark.remote() for s in self.shards], "version"))

    def stats(self, tenant: str | None = None) -> MemoryStats:
        """The deployment's counts (``tenant``: only that tenant's own figures, nothing of the
        deployment as a whole; None: everything, with ``per_tenant``, LLM usage and the
        coordinator's figures)."""
        if tenant is not None:
            check_tenant(tenant, "tenant")
        shard_stats = self._answers([s.stats.remote(tenant) for s in self.shards], "stats")
        out = merge_stats(shard_stats, tenant)
        if tenant is None:
            out = with_deployment_stats(out, shard_stats, self._coordinator.call("stats"))
        return out  # type: ignore[return-value]

    def clusters(
        self, env: str | None = None, *, tenant: str | None = DEFAULT_TENANT, limit: int | None = None
    ) -> list[Any]:
        """``tenant``'s live clusters on every shard, largest first (None: every tenant's); with
        ``limit``, the largest that many (each shard sends at most that many)."""
        check_listing(tenant, limit)
        parts = self._answers([s.clusters.remote(env, tenant, limit) for s in self.shards], "clusters")
        return merge_clusters(parts, limit)

    def cluster_count(self, env: str | None = None, *, tenant: str | None = DEFAULT_TENANT) -> int:
        """How many clusters :meth:`clusters` would list without a limit."""
        check_listing(tenant)
        return sum(self._answers([s.cluster_count.remote(env, tenant) for s in self.shards], "cluster_count"))

    # -- deleting ----------------------------------------------------------------------------
    def remove(self, ids: Sequence[str], *, tenant: str = DEFAULT_TENANT) -> int:
        """Delete ``tenant``'s trajectories of these ids; returns how many were stored. Sent
        through the coordinator, which runs it between its micro-batches (never beside a batch
        that may name the same clusters) on every shard; durable when this returns, and
        idempotent: sending it again is safe (unknown ids are ignored)."""
        return int(self._coordinator.call("remove", check_remove(ids, tenant), tenant))

    def purge_tenant(self, tenant: str) -> int:
        """Delete everything of ``tenant`` on every shard (see :meth:`remove`); each shard
        records the intent first and finishes an interrupted purge when it restarts."""
        check_tenant(tenant, "tenant", stored=True)
        return int(self._coordinator.call("purge_tenant", tenant))

    def verify(self, deep: bool = False) -> dict[str, Any]:
        """Every shard's invariants (``deep``: also every record's fingerprint, recomputed)."""
        reports = self._answers([s.verify.remote(deep) for s in self.shards], "verify")
        return {"ok": all(r["ok"] for r in reports), "shards": reports}

    def maintain(self) -> int:
        """Run every shard's queued splits and skills now and wait for its index retrains
        (all of which also run in the background)."""
        return sum(self._answers([s.maintain.remote() for s in self.shards], "maintain"))

    def snapshot(self, directory: str | Path) -> dict[str, Any]:
        return deployment.snapshot(directory, self.namespace)

    def close(self) -> None:
        """Drop the handles; the deployment keeps running (see ``lifemem-ray stop``)."""
        self._shards = []
        self.embedders = []
