"""MemoryClient: the sharded memory from any process of the cluster (rollout workers too).

Adds go through the coordinator and resolve on acknowledgement; retrievals go
straight to the shards (for a few queries, one call per shard; for more, chunked
searches and then a second call that fetches only the records that won the merge) and are merged
here exactly as the single-process engine orders them: top-k by score, then the
skills of those trajectories' clusters in order of first appearance.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray

from lifemem_ray.actors.cluster import deployment
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.ray_metrics import RECORDER
from lifemem_ray.actors.cluster.remote_errors import ShardUnavailableError, actor_failures, raise_remote, remote_cause
from lifemem_ray.core.errors import ArgumentTypeError, EmbeddingError
from lifemem_ray.core.model import Trajectory
from lifemem_ray.core.tenancy import DEFAULT_TENANT, check_tenant, search_targets
from lifemem_ray.engine.clustering.clusters import check_listing_limit
from lifemem_ray.engine.ingest_rules import AddResult
from lifemem_ray.engine.memory import pack_trajectories
from lifemem_ray.engine.protocols import MemoryStats
from lifemem_ray.engine.retrieval import Retrieval, assemble, check_retrieve_args, paused_gc
from lifemem_ray.llm.transport import merge_usage, usage_refusals, usage_totals

__all__ = ["AddFuture", "MemoryClient"]


def _coordinator_answer(ref: Any) -> Any:
    """A coordinator call's answer, its own errors without Ray's wrapping."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        raise_remote(exc)


@dataclass
class AddFuture:
    """Resolves when the coordinator acknowledged (every trajectory committed on its shard).

    When the answer is lost (an actor died), the request's ids are kept by the client as *in
    doubt*: its first attempt may have committed them. A later request of the same client
    that finds such an id stored with the same content reports it ``added`` (this client's
    own earlier attempt stored it), not ``duplicate``."""

    ref: Any
    single: bool = False
    sent: dict[str, str] | None = None  # id key -> fingerprint of what the request carried
    keys: list[str] | None = None  # per position of the request: its id key (tenancy.id_key)
    client: MemoryClient | None = None
    resend: Callable[[], Any] | None = None  # sends the same request again (a new ref)
    resends: int = 0  # how many times a request whose coordinator died is sent again
    started: float | None = None  # monotonic time of the add_many call; observed once, when it resolves

    def result(self, timeout: float | None = None) -> Any:
        """The per-trajectory results. A request whose coordinator died is sent again (up to
        ``cluster.add_resends`` times, the coordinator restarts by itself): ids its first
        attempt committed then come back ``duplicate`` and are reported ``added``."""
        attempt = 0
        while True:
            try:
                out = ray.get(self.ref, timeout=timeout)
                break
            except ray.exceptions.RayTaskError as exc:
                # The coordinator's own error (conflict, overload, a shard gone), without Ray's wrapping.
                if isinstance(remote_cause(exc), ShardUnavailableError):
                    self._doubt()
                raise_remote(exc)
            except ray.exceptions.GetTimeoutError:
                self._doubt()  # still running, or lost: unknown whether it will commit; not resent
                raise
            except actor_failures():
                self._doubt()  # unknown whether the request committed
                if self.resend is None or attempt >= self.resends:
                    raise
                attempt += 1
                time.sleep(min(5.0, 0.5 * 2 ** (attempt - 1)))
                self.ref = self.resend()
        if self.client is not None and self.sent:
            out = self.client._settle(out, self.sent, self.keys)
        if self.started is not None:  # the client's add latency: from add_many until acknowledged
            RECORDER.observe_latency("add", "client", time.monotonic() - self.started)
            self.started = None
        return out[0] if self.single else out

    def done(self) -> bool:
        ready, _ = ray.wait([self.ref], timeout=0)
        return bool(ready)

    def _doubt(self) -> None:
        if self.client is not None and self.sent:
            self.client._doubt(self.sent)


IN_DOUBT_MAX = 1_000_000  # ids a client remembers as in doubt (the oldest are forgotten first)


class MemoryClient:
    """:class:`lifemem_ray.engine.protocols.MemoryAPI` over a Ray deployment (adds return an
    :class:`AddFuture`)."""

    def __init__(self, namespace: str, config: DeploymentConfig) -> None:
        self.namespace = namespace
        self.config = config
        self.coordinator = deployment.find_coordinator(namespace)
        info = ray.get(self.coordinator.deployment.remote())
        self.dim = info["dim"]
        self.shard_names = info["shards"]
        # Actor handles, typed Any: Ray types an actor's methods (ActorHandle.__getattr__) as Never.
        # Looked up again after a shard failed: the deployment may have started it anew elsewhere.
        self._shards: list[Any] | None = None
        self.embedders: list[Any] = [ray.get_actor(n, namespace=namespace) for n in info["embedders"]]
        self._next = 0
        self._in_doubt: OrderedDict[str, str] = OrderedDict()  # id -> fingerprint of an add whose answer was lost
        self._doubt_lock = threading.Lock()

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
        answer, is a ShardUnavailableError, and the handles are looked up again next time."""
        try:
            return ray.get(refs, timeout=self.config.cluster.call_timeout_s)
        except actor_failures(ray.exceptions.GetTimeoutError) as exc:
            self._shards = None
            raise ShardUnavailableError(f"a shard is unavailable for {what}: {type(exc).__name__}: {exc}") from exc

    @classmethod
    def connect(
        cls, namespace: str = "lifemem", address: str | None = None, config: DeploymentConfig | None = None
    ) -> MemoryClient:
        """Attach to the deployment in ``namespace`` (starting a Ray connection if needed)."""
        if not ray.is_initialized():
            ray.init(address=address or "auto", namespace=namespace, include_dashboard=False, log_to_driver=False)
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
        started = time.monotonic()
        batch = pack_trajectories(list(trajectories), vectors, self.dim, self.config.evolution.workflow_features)
        sent = dict(zip(batch.ids, batch.fingerprints, strict=True))
        embedded = vectors is not None

        def send() -> Any:
            # No transparent retry by Ray: the future resends a request whose coordinator died
            # itself, knowing its ids are in doubt (see AddFuture.result).
            return self.coordinator.add_batch.options(max_task_retries=0).remote(batch, embedded)

        return AddFuture(
            send(),
            sent=sent,
            keys=list(batch.ids),
            client=self,
            resend=send,
            resends=self.config.cluster.add_resends,
            started=started,
        )

    def stored_conflicts(self, ids: list[str], fingerprints: list[str]) -> list[bool]:
        """Per id key (:func:`lifemem_ray.core.tenancy.id_key`: the id itself for the default tenant):
        whether a shard holds it with another fingerprint (one call per shard)."""
        answers = self._answers([s.known.remote(ids, fingerprints) for s in self.shards])
        return [any(a[i] is not None and a[i].status == "conflict" for a in answers) for i in range(len(ids))]

    def _doubt(self, sent: dict[str, str]) -> None:
        """Remember a request whose answer was lost: its first attempt may have committed."""
        with self._doubt_lock:
            self._in_doubt.update(sent)
            while len(self._in_doubt) > IN_DOUBT_MAX:
                self._in_doubt.popitem(last=False)

    def _settle(self, results: list[AddResult], sent: dict[str, str], keys: list[str] | None = None) -> list[AddResult]:
        """``duplicate`` for an id this client sent before without an answer is its own
        earlier attempt's commit: ``added``. ``keys``: the request's id keys by position (the
        results name the caller's ids, without the tenant)."""
        if not self._in_doubt:
            return results
        out = []
        with self._doubt_lock:
            for r, key in zip(results, keys if keys is not None else [r.id for r in results], strict=True):
                fp = self._in_doubt.pop(key, None)
                if r.status == "duplicate" and fp is not None and fp == sent.get(key):
                    r = AddResult(r.id, "added", r.cluster_id)
                out.append(r)
        return out

    # -- retrieving --------------------------------------------------------------------------
    def embed(self, texts: list[str]) -> np.ndarray:
        """Embeddings of ``texts`` from the deployment's embedder actors (round robin)."""
        if not self.embedders:
            raise EmbeddingError(
                "no embedder actors in this deployment (deployed with cluster.embedders = 0); pass vectors, or deploy with embedders"
            )
        actor = self.embedders[self._next % len(self.embedders)]
        self._next += 1
        return ray.get(actor.embed.remote(texts))

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
    ) -> list[Retrieval]:
        """Like :meth:`lifemem_ray.engine.memory.Memory.retrieve_many`: queries of one tenant, which
        see only that tenant's trajectories and skills (``None`` envs: all of its environments)."""
        started = time.monotonic()
        tasks, envs, k, budget = check_retrieve_args(
            tasks, envs, k, token_budget, self.config.retrieval
        )  # the engine's checks
        targets = search_targets(tenant, envs)  # what the shards search: the tenant's scopes
        if not tasks:
            return []
        vecs = self.embed(tasks) if vectors is None else np.asarray(vectors, dtype=np.float32)
        with paused_gc():
            if len(tasks) <= self.config.cluster.one_round_max:
                out = self._retrieve_one_round(tasks, envs, targets, k, vecs, skills, budget)
            else:
                out = self._retrieve_two_rounds(tasks, envs, targets, k, vecs, skills, budget)
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
    ) -> list[Retrieval]:
        """Each shard sends its top-k with their records; the least latency for a few queries."""
        refs = [shard.search_records.remote(targets, k, vecs, skills) for shard in self.shards]
        per_shard = self._answers(refs)
        max_skills = self.config.retrieval.max_skills
        out = []
        for q, (task, env) in enumerate(zip(tasks, envs, strict=True)):
            hits = [h for part in per_shard for h in part[q][0]]
            texts = {cid: text for part in per_shard for cid, text in part[q][1].items()}
            out.append(assemble(task, env, hits, texts, k, max_skills, budget))
        return out

    def _retrieve_two_rounds(
        self,
        tasks: list[str],
        envs: list[str | None],
        targets: list[str],
        k: int,
        vecs: np.ndarray,
        skills: bool,
        budget: int,
    ) -> list[Retrieval]:
        """Shards send scores and ids, the top-k across shards is chosen here, then only those
        records are fetched: a shard's records that lose the merge never travel. Searches go
        out at once in large chunks (FAISS is cheaper per query on more queries of an
        environment); records come back in smaller chunks, each fetched while the one
        before is decoded (``cluster.search_chunk``, ``cluster.retrieve_chunk``)."""
        chunk = self.config.cluster.retrieve_chunk
        per_search = max(chunk, self.config.cluster.search_chunk // chunk * chunk)  # validated as a multiple of chunk
        starts = list(range(0, len(tasks), per_search))
        searches = [
            [
                shard.search_hits.remote(targets[a : a + per_search], k, vecs[a : a + per_search])
                for shard in self.shards
            ]
            for a in starts
        ]
        merged: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        owner = np.repeat(np.arange(len(self.shards)), k)  # column of the merged rows -> shard

        def fetch(a: int, b: int) -> tuple[np.ndarray, np.ndarray, list[tuple[np.ndarray, Any]]]:
            n, offset = divmod(a, per_search)
            if n not in merged:
                merged.pop(n - 1, None)
                parts = self._answers(searches[n])
                scores, ids = np.hstack([p[0] for p in parts]), np.hstack([p[1] for p in parts])
                best = np.argsort(-scores, axis=1, kind="stable")[:, :k]  # ties keep shard order, as assemble does
                merged[n] = (np.take_along_axis(scores, best, 1), np.take_along_axis(ids, best, 1), owner[best])
            scores, ids, shard_of = (x[offset : offset + b - a] for x in merged[n])
            wanted = []
            for i, shard in enumerate(self.shards):
                at = np.flatnonzero(((shard_of == i) & (ids >= 0)).ravel())
                if len(at):
                    wanted.append((at, shard.hit_records.remote(ids.ravel()[at], skills)))
            return scores, ids, wanted

        chunks = [(a, min(len(tasks), a + chunk)) for a in range(0, len(tasks), chunk)]
        max_skills = self.config.retrieval.max_skills
        out: list[Retrieval] = []
        ahead = fetch(*chunks[0])
        for i, (a, b) in enumerate(chunks):
            scores, ids, wanted = ahead
            if i + 1 < len(chunks):
                ahead = fetch(*chunks[i + 1])
            answers = self._answers([ref for _, ref in wanted])
            found: list[Any] = [None] * ids.size
            texts: dict[int, str] = {}
            for (at, _), (records, skill_texts) in zip(wanted, answers, strict=True):
                for pos, record in zip(at.tolist(), records, strict=True):
                    found[pos] = record
                texts.update(skill_texts)
            for q, (task, env) in enumerate(zip(tasks[a:b], envs[a:b], strict=True)):
                row = found[q * k : (q + 1) * k]
                hits = [(s, hit[0], hit[1]) for s, hit in zip(scores[q].tolist(), row, strict=True) if hit is not None]
                out.append(assemble(task, env, hits, texts, k, max_skills, budget))
        return out

    # -- state -----------------------------------------------------------------------------
    def stats(self, tenant: str | None = None) -> MemoryStats:
        """The deployment's counts (``tenant``: only that tenant's own figures, nothing of the
        deployment as a whole; None: everything, with ``per_tenant``, LLM usage and the
        coordinator's figures)."""
        if tenant is not None:
            check_tenant(tenant, "tenant")
        shard_stats = self._answers([s.stats.remote(tenant) for s in self.shards], "stats")
        per_env: dict[str, dict[str, int]] = {}
        per_tenant: dict[str, dict[str, int]] = {}
        for st in shard_stats:
            for table, key in ((per_env, "per_env"), (per_tenant, "per_tenant")):
                for name, v in st.get(key, {}).items():
                    slot = table.setdefault(name, {"trajectories": 0, "clusters": 0})
                    slot["trajectories"] += v["trajectories"]
                    slot["clusters"] += v["clusters"]
        out: dict[str, Any] = {
            "trajectories": sum(st["trajectories"] for st in shard_stats),
            "clusters": sum(st["clusters"] for st in shard_stats),
            "pending": sum(st["pending"] for st in shard_stats),
            "mixed_env_clusters": sum(st["mixed_env_clusters"] for st in shard_stats),
            "per_env": dict(sorted(per_env.items())),
        }
        if tenant is not None:
            out["tenant"] = tenant
            out["shards"] = [{"trajectories": st["trajectories"], "clusters": st["clusters"]} for st in shard_stats]
            return out  # type: ignore[return-value]
        coordinator = ray.get(self.coordinator.stats.remote())
        llm_shards = [st["llm"] for st in shard_stats]
        coord_usage = coordinator["llm"]
        coord_calls, coord_tokens = usage_totals(coord_usage)
        by_operation = merge_usage(coord_usage, *(usage.get("by_operation", {}) for usage in llm_shards))
        out.update(
            splits=sum(st["splits"] for st in shard_stats),
            llm={
                "calls": sum(usage["calls"] for usage in llm_shards) + coord_calls,
                "tokens": sum(usage["tokens"] for usage in llm_shards) + coord_tokens,
                "fallbacks": sum(usage["fallbacks"] for usage in llm_shards),
                "refused_generated": usage_refusals(by_operation),
                "by_operation": by_operation,
                "coordinator": coord_usage,
            },
            shards=[
                {
                    "trajectories": st["trajectories"],
                    "clusters": st["clusters"],
                    "maintenance_queued": st["maintenance_queued"],
                }
                for st in shard_stats
            ],
            per_tenant=dict(sorted(per_tenant.items())),
            coordinator=coordinator,
        )
        return out  # type: ignore[return-value]

    def clusters(
        self, env: str | None = None, *, tenant: str | None = DEFAULT_TENANT, limit: int | None = None
    ) -> list[Any]:
        """``tenant``'s live clusters on every shard, largest first (None: every tenant's); with
        ``limit``, the largest that many (each shard sends at most that many)."""
        if tenant is not None:
            check_tenant(tenant, "tenant")
        check_listing_limit(limit)
        parts = self._answers([s.clusters.remote(env, tenant, limit) for s in self.shards], "clusters")
        return sorted((c for part in parts for c in part), key=lambda c: (-c.count, c.id))[:limit]

    def cluster_count(self, env: str | None = None, *, tenant: str | None = DEFAULT_TENANT) -> int:
        """How many clusters :meth:`clusters` would list without a limit."""
        if tenant is not None:
            check_tenant(tenant, "tenant")
        return sum(self._answers([s.cluster_count.remote(env, tenant) for s in self.shards], "cluster_count"))

    # -- deleting ----------------------------------------------------------------------------
    def remove(self, ids: Sequence[str], *, tenant: str = DEFAULT_TENANT) -> int:
        """Delete ``tenant``'s trajectories of these ids; returns how many were stored. Sent
        through the coordinator, which runs it between its micro-batches (never beside a batch
        that may name the same clusters) on every shard; durable when this returns, and
        idempotent: sending it again is safe (unknown ids are ignored)."""
        check_tenant(tenant, "tenant", stored=True)
        if isinstance(ids, str):
            raise ArgumentTypeError("ids: expected a list of trajectory ids, got one string")
        return _coordinator_answer(self.coordinator.remove.remote([str(i) for i in ids], tenant))

    def purge_tenant(self, tenant: str) -> int:
        """Delete everything of ``tenant`` on every shard (see :meth:`remove`); each shard
        records the intent first and finishes an interrupted purge when it restarts."""
        check_tenant(tenant, "tenant", stored=True)
        return _coordinator_answer(self.coordinator.purge_tenant.remote(tenant))

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
