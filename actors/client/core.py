"""Every client operation, written once as a script (:mod:`~lifemem_ray.actors.client.calls`).

Adds go through the coordinator and resolve on acknowledgement; retrievals go straight to the
shards (for a few queries, one call per shard; for more, chunked searches and then a second
call that fetches only the records that won the merge) and are merged here exactly as the
single-process engine orders them: top-k by score, then the skills of those trajectories'
clusters in order of first appearance. A retrieval's texts are embedded by the deployment's
embedder actors, except those the client embedded lately or is embedding for another caller
right now (:class:`~lifemem_ray.actors.client.query_vectors.QueryVectors`). What a failed call
means, how answers merge and how an add settles are :mod:`~lifemem_ray.actors.client.rules`'.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray

from lifemem_ray.actors.client.calls import Blocking, Remote, Script
from lifemem_ray.actors.client.connection import Connection, DeploymentHandles
from lifemem_ray.actors.client.query_vectors import QueryVectors
from lifemem_ray.actors.client.retrieve_options import RetrieveOptions
from lifemem_ray.actors.client.rules import (
    AddRequest,
    BatchSender,
    InDoubtLedger,
    TwoRoundMerge,
    any_conflict,
    check_listing,
    check_remove,
    merge_clusters,
    merge_stats,
    one_round_results,
    prepare_add,
    shard_pins,
    with_deployment_stats,
)
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.ray_metrics import RECORDER
from lifemem_ray.actors.cluster.ray_shards import embed_plan, gather_rows, pack_queries
from lifemem_ray.actors.cluster.remote_errors import ShardUnavailableError, actor_failures, raise_own
from lifemem_ray.core.errors import EmbeddingError
from lifemem_ray.core.model import Trajectory
from lifemem_ray.core.tenancy import DEFAULT_TENANT, check_tenant, search_targets
from lifemem_ray.engine.retrieval import Retrieval, check_retrieve_args, paused_gc
from lifemem_ray.engine.versions import format_version

__all__ = ["ClientCore"]


class ClientCore:
    """The operations of one client of the deployment in ``namespace``, each a script; the
    blocking and the awaitable client carry them out. Thread-safe."""

    def __init__(
        self, namespace: str, config: DeploymentConfig, address: str | None = None, reconnect_after_s: float = 0.0
    ) -> None:
        self.namespace = namespace
        self.config = config
        self.in_doubt = InDoubtLedger()  # ids of adds whose answer was lost
        # Recent retrieval texts' vectors, and the texts in flight (cluster.client_vector_cache);
        # forgotten at a reconnect: the deployment found again may embed with another model, and
        # an add sends these vectors along as its own.
        self.query_vectors = QueryVectors(config.cluster.client_vector_cache)
        self.connection = Connection(namespace, address, config, reconnect_after_s, self.query_vectors.forget)

    # -- calls to the shards ---------------------------------------------------------------
    def shard_answers(self, call: str, *args: Any, what: str = "retrieval") -> Script[list[Any]]:
        """``call(*args)`` on every shard, their answers in shard order (:meth:`answers`)."""
        shards = yield from self.connection.shards()
        return (yield from self.answers([getattr(s, call).remote(*args) for s in shards], what))

    def answers(self, refs: list[Any], what: str = "retrieval") -> Script[list[Any]]:
        """The shards' answers to ``refs``, within cluster.call_timeout_s; a shard that died, or
        did not answer, is a ShardUnavailableError, and the handles are looked up again next
        time; a shard's own refusal (a version above its watermark...) is raised as itself
        (:func:`~lifemem_ray.actors.cluster.remote_errors.raise_own`), not as Ray's wrapper."""
        limit = self.config.cluster.call_timeout_s
        try:
            return (yield Remote(refs, limit, many_objects=what == "retrieval"))
        except ray.exceptions.RayTaskError as exc:
            raise_own(exc)
        except actor_failures(TimeoutError) as exc:
            self.connection.forget_shards()
            why = f"no answer within cluster.call_timeout_s = {limit:g} s" if isinstance(exc, TimeoutError) else exc
            raise ShardUnavailableError(f"a shard is unavailable for {what}: {type(exc).__name__}: {why}") from exc

    # -- adding ----------------------------------------------------------------------------
    def prepare_add(self, trajectories: Sequence[Trajectory], vectors: Any) -> Script[tuple[AddRequest, BatchSender]]:
        """One request of ``add_many`` and its sender: encoded and abstracted here, in the
        caller's process, so the coordinator only routes and decides. Without ``vectors``, the
        query texts' vectors are sent along when this client holds every one of them (it
        retrieved for those tasks lately): the coordinator then embeds nothing."""
        handles = yield from self.connection.handles()
        if vectors is None and trajectories:
            known = [self.query_vectors.known(t.query_text) for t in trajectories]
            if all(v is not None for v in known):
                vectors = np.stack(known)  # type: ignore[arg-type]
        return prepare_add(
            trajectories,
            vectors,
            dim=handles.dim,
            features=self.config.evolution.workflow_features,
            coordinator=self.connection.coordinator,
            ledger=self.in_doubt,
            resends=self.config.cluster.add_resends,
            wait_s=self.config.cluster.call_timeout_s,
        )

    def stored_conflicts(self, ids: list[str], fingerprints: list[str]) -> Script[list[bool]]:
        """Per id key (:func:`lifemem_ray.core.tenancy.id_key`): whether a shard holds it with
        another fingerprint (one call per shard)."""
        return any_conflict((yield from self.shard_answers("known", ids, fingerprints)), len(ids))

    # -- retrieving --------------------------------------------------------------------------
    def embed(self, texts: list[str]) -> Script[np.ndarray]:
        """Embeddings of ``texts`` from the deployment's embedder actors: each text on the replica
        its hash names (:func:`~lifemem_ray.actors.cluster.ray_shards.route_texts`, as the
        coordinator's adds), so it meets that replica's cache; in calls of at most
        ``cluster.embed_chunk`` texts."""
        handles = yield from self.connection.handles()
        if not handles.embedders:
            raise EmbeddingError(
                "no embedder actors in this deployment (deployed with cluster.embedders = 0); pass vectors, or deploy with embedders"
            )
        plan = embed_plan(texts, len(handles.embedders), self.config.cluster.embed_chunk)
        limit = self.config.cluster.call_timeout_s
        refs = [handles.embedders[replica].embed.remote([texts[i] for i in at]) for replica, at in plan]
        try:
            answers = yield Remote(refs, limit)
        except ray.exceptions.RayTaskError as exc:  # an embedder's own error (EmbeddingError...) as itself
            raise_own(exc)
        except actor_failures(TimeoutError) as exc:  # its node is gone, or restarting
            yield Blocking(lambda: self.connection.find_embedders_again(handles))
            raise EmbeddingError(
                f"the deployment's embedders did not answer within {limit:g} s (cluster.call_timeout_s): "
                f"{type(exc).__name__}; retry later, or pass vectors"
            ) from None
        return gather_rows(texts, plan, answers)

    def vectors(self, texts: Sequence[str]) -> Script[np.ndarray]:
        """``texts``' vectors, from this client's cache or the embedders (one call for the texts
        no caller is embedding now)."""
        return (yield from self.query_vectors.vectors(texts, self.embed))

    def retrieve_many(
        self, tasks: Sequence[str], envs: Sequence[str | None] | str, options: RetrieveOptions, vectors: Any = None
    ) -> Script[list[Retrieval]]:
        """Like :meth:`lifemem_ray.engine.memory.Memory.retrieve_many`: queries of one tenant, which
        see only that tenant's trajectories and skills (``None`` envs: all of its environments);
        one round for up to ``cluster.one_round_max`` queries, two rounds beyond."""
        started = time.monotonic()
        tasks, envs, k, budget = check_retrieve_args(
            tasks, envs, options.k, options.token_budget, self.config.retrieval
        )
        targets = search_targets(options.tenant, envs)  # what the shards search: the tenant's scopes
        handles = yield from self.connection.handles()
        pins = shard_pins(options.as_of, len(handles.shard_names))  # each shard's watermark of a pinned read
        if not tasks:
            return []
        vecs = (yield from self.vectors(tasks)) if vectors is None else np.asarray(vectors, dtype=np.float32)
        shards = yield from self.connection.shards()
        if len(tasks) <= self.config.cluster.one_round_max:
            queries = pack_queries(vecs, len(tasks), handles.dim)
            calls = [
                s.search_records.remote(targets, k, queries, options.skills, p)
                for s, p in zip(shards, pins, strict=True)
            ]
            per_shard = yield from self.answers(calls)
            with paused_gc():
                out = one_round_results(tasks, envs, per_shard, k, self.config.retrieval.max_skills, budget)
        else:
            plan = TwoRoundMerge(len(tasks), len(shards), k, self.config.cluster)
            out = yield from self._two_rounds(plan, shards, tasks, envs, targets, vecs, options.skills, budget, pins)
        RECORDER.observe_latency("retrieve", "client", time.monotonic() - started)
        return out

    def _two_rounds(
        self,
        plan: TwoRoundMerge,
        shards: list[Any],
        tasks: list[str],
        envs: list[str | None],
        targets: list[str],
        vecs: np.ndarray,
        skills: bool,
        budget: int,
        pins: list[int | None],
    ) -> Script[list[Retrieval]]:
        """Scores and ids first, then only the merged top-k's records (:class:`TwoRoundMerge`):
        all searches go out at once; each chunk's records are fetched while the chunk before
        is decoded."""
        k = plan.k
        searches = [
            [s.search_hits.remote(targets[a:b], k, vecs[a:b], pin) for s, pin in zip(shards, pins, strict=True)]
            for a, b in plan.searches
        ]

        def fetch(a: int, b: int) -> Script[tuple[np.ndarray, np.ndarray, list[tuple[np.ndarray, Any]]]]:
            group = plan.group_of(a)
            if plan.needs(group):
                plan.merge(group, (yield from self.answers(searches[group])))
            scores, ids, wanted = plan.winners(a, b)
            return scores, ids, [(at, shards[i].hit_records.remote(ids.ravel()[at], skills)) for i, at in wanted]

        out: list[Retrieval] = []
        ahead = yield from fetch(*plan.chunks[0])
        for i, (a, b) in enumerate(plan.chunks):
            scores, ids, wanted = ahead
            if i + 1 < len(plan.chunks):
                ahead = yield from fetch(*plan.chunks[i + 1])  # its records travel while this chunk is decoded
            answers = yield from self.answers([ref for _, ref in wanted])
            positions = [at for at, _ in wanted]
            with paused_gc():
                max_skills = self.config.retrieval.max_skills
                out += plan.results(tasks[a:b], envs[a:b], scores, ids, positions, answers, max_skills, budget)
        return out

    # -- state -----------------------------------------------------------------------------
    def version(self) -> Script[str]:
        """The deployment's version now: one watermark per shard (:mod:`lifemem_ray.engine.versions`)."""
        return format_version((yield from self.shard_answers("watermark", what="version")))

    def stats(self, tenant: str | None) -> Script[dict[str, Any]]:
        """The deployment's counts (``tenant``: only that tenant's own figures; None: everything,
        with ``per_tenant``, LLM usage and the coordinator's figures)."""
        if tenant is not None:
            check_tenant(tenant, "tenant")
        shard_stats = yield from self.shard_answers("stats", tenant, what="stats")
        out = merge_stats(shard_stats, tenant)
        if tenant is None:
            out = with_deployment_stats(out, shard_stats, (yield self.coordinator_call("stats")))
        return out

    def clusters(self, env: str | None, tenant: str | None, limit: int | None) -> Script[list[Any]]:
        """``tenant``'s live clusters on every shard, largest first (None: every tenant's)."""
        check_listing(tenant, limit)
        return merge_clusters((yield from self.shard_answers("clusters", env, tenant, limit, what="clusters")), limit)

    def cluster_count(self, env: str | None, tenant: str | None) -> Script[int]:
        """How many clusters :meth:`clusters` would list without a limit."""
        check_listing(tenant)
        return sum((yield from self.shard_answers("cluster_count", env, tenant, what="cluster_count")))

    def remove(self, ids: Sequence[str], tenant: str = DEFAULT_TENANT) -> Script[int]:
        """Delete ``tenant``'s trajectories of these ids (through the coordinator; idempotent)."""
        return int((yield self.coordinator_call("remove", check_remove(ids, tenant), tenant)))

    def purge_tenant(self, tenant: str) -> Script[int]:
        """Delete everything of ``tenant`` on every shard (through the coordinator)."""
        check_tenant(tenant, "tenant", stored=True)
        return int((yield self.coordinator_call("purge_tenant", tenant)))

    def verify(self, deep: bool) -> Script[dict[str, Any]]:
        """Every shard's invariants (``deep``: also every record's fingerprint, recomputed)."""
        reports = yield from self.shard_answers("verify", deep, what="verify")
        return {"ok": all(r["ok"] for r in reports), "shards": reports}

    def maintain(self) -> Script[int]:
        """Every shard's queued splits and skills run now, its index retrains waited for."""
        return sum((yield from self.shard_answers("maintain", what="maintain")))

    def coordinator_call(self, method: str, *args: Any) -> Blocking:
        """``method(*args)`` on the coordinator (:class:`~lifemem_ray.actors.cluster.coordinator_ref.CoordinatorRef`'s rule)."""
        coordinator = self.connection.coordinator
        return Blocking(lambda: coordinator.call(method, *args), lambda: coordinator.acall(method, *args))

    def handles(self) -> Script[DeploymentHandles]:
        """The deployment's handles (connecting first if needed)."""
        return (yield from self.connection.handles())
