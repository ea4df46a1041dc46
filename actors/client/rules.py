"""The rules both memory clients follow, without their I/O: one add has one policy.

:class:`~lifemem_ray.actors.client.blocking.MemoryClient` (blocking) and
:class:`~lifemem_ray.actors.client.awaiting.AsyncMemoryClient` (awaitable) differ only in
how they wait for Ray. What to send, what a failed attempt means (send it again, or raise),
how an acknowledgement settles against the ids in doubt, and how the shards' answers merge
into the engine's results are decided here, once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from lifemem_ray.actors.cluster.cluster_config import ClusterConfig
from lifemem_ray.actors.cluster.coordinator_ref import CoordinatorRef
from lifemem_ray.actors.cluster.ray_metrics import RECORDER
from lifemem_ray.actors.cluster.remote_errors import ShardUnavailableError, actor_failures, remote_cause
from lifemem_ray.core.errors import ArgumentTypeError, DeploymentNotFoundError
from lifemem_ray.core.lru import LruCache
from lifemem_ray.core.model import Trajectory
from lifemem_ray.core.tenancy import check_tenant
from lifemem_ray.engine.clustering.clusters import check_listing_limit
from lifemem_ray.engine.clustering.evolution import ItemBatch
from lifemem_ray.engine.ingest import pack_trajectories
from lifemem_ray.engine.ingest_rules import AddResult
from lifemem_ray.engine.retrieval import Retrieval, assemble
from lifemem_ray.engine.versions import format_version, parse_version
from lifemem_ray.llm.transport import merge_usage, usage_refusals, usage_totals

__all__ = [
    "IN_DOUBT_MAX",
    "AddRequest",
    "BatchSender",
    "InDoubtLedger",
    "TwoRoundMerge",
    "any_conflict",
    "check_listing",
    "check_remove",
    "merge_clusters",
    "merge_stats",
    "one_round_results",
    "prepare_add",
    "resend_delay",
    "send_again",
    "with_deployment_stats",
]

IN_DOUBT_MAX = 1_000_000  # ids a client remembers as in doubt (the oldest are forgotten first)


class InDoubtLedger:
    """Ids of adds whose answer was lost, with the fingerprint each request carried.

    A request's first attempt may have committed them; a later answer ``duplicate`` for such
    an id with the same fingerprint is this client's own earlier commit, so it reads
    ``added``. Thread-safe: a client is shared by threads (the front door) and coroutines."""

    def __init__(self, limit: int = IN_DOUBT_MAX) -> None:
        self.limit = limit
        self._ids: LruCache[str, str] = LruCache(limit, "InDoubtLedger")  # id key -> fingerprint

    def __len__(self) -> int:
        return len(self._ids)

    def remember(self, sent: dict[str, str]) -> None:
        """A request whose answer was lost: its id keys and fingerprints (the oldest forgotten past ``limit``)."""
        for key, fingerprint in sent.items():
            self._ids.put(key, fingerprint)

    def settle(self, results: list[AddResult], sent: dict[str, str], keys: list[str] | None = None) -> list[AddResult]:
        """``duplicate`` for an id in doubt sent with the same fingerprint is ``added``; every
        id answered leaves the ledger. ``keys``: the request's id keys by position (the
        results name the caller's ids, without the tenant)."""
        if not len(self._ids):
            return results
        out = []
        for r, key in zip(results, keys if keys is not None else [r.id for r in results], strict=True):
            fp = self._ids.pop(key)
            if r.status == "duplicate" and fp is not None and fp == sent.get(key):
                r = AddResult(r.id, "added", r.cluster_id)
            out.append(r)
        return out


def resend_delay(attempt: int) -> float:
    """Seconds before the ``attempt``-th resend of a request whose coordinator died (it restarts by itself)."""
    return min(5.0, 0.5 * 2 ** (attempt - 1))


def send_again(resend: Callable[[], Any], request: AddRequest) -> Any:
    """``resend()``'s new ref; while no coordinator is found by name (the shards are starting a
    new one), waits and looks again, within the request's resends.

    Raises:
        DeploymentNotFoundError: still none once the resends are spent.
    """
    while True:
        try:
            return resend()
        except DeploymentNotFoundError as exc:
            delay = request.failed(exc)
            if delay is None:
                raise
            time.sleep(delay)


@dataclass
class BatchSender:
    """Sends one packed request to the coordinator; again on each call (a new object ref).

    No transparent retry by Ray: the request itself resends, knowing its ids are in doubt.
    Picklable (an actor handle and the batch), so a request can travel to another process
    and be sent again from there (a rollout worker hands its add to the pool)."""

    coordinator: CoordinatorRef
    batch: ItemBatch
    embedded: bool
    sent: int = 0  # attempts so far: a resend looks the coordinator up by name again (it may be a new actor)

    def __call__(self) -> Any:
        handle = self.coordinator.handle if self.sent == 0 else self.coordinator.refreshed()
        self.sent += 1
        return handle.add_batch.options(max_task_retries=0).remote(self.batch, self.embedded)


@dataclass
class AddRequest:
    """One add request's policy, shared by the blocking and the awaitable future.

    ``sent``: id key -> fingerprint of what it carries; ``keys``: its id keys by position;
    ``resends``: how often it may be sent again after its coordinator died (or the process
    that owned its answer); ``attempts``: resends made so far; ``started``: monotonic time
    of the call, observed once as the client's add latency."""

    sent: dict[str, str]
    keys: list[str]
    ledger: InDoubtLedger = field(default_factory=InDoubtLedger)
    resends: int = 0
    single: bool = False
    started: float | None = None
    attempts: int = 0
    wait_s: float | None = None  # how long an attempt waits when the caller gives no bound (cluster.call_timeout_s)

    def failed(self, exc: BaseException, can_resend: bool = True) -> float | None:
        """What a failed attempt means: seconds to wait before sending it again, or None when
        the caller raises ``exc`` (through :func:`~.remote_errors.raise_remote`). Ids whose
        fate is unknown are remembered as in doubt first:

        * the coordinator's own error: raised; in doubt when a shard was unavailable (part
          of the batch may have committed);
        * no answer in time (a ``TimeoutError``): in doubt, not resent (it may still commit);
        * the coordinator died, or the process that owned the answer, or a resend found no
          coordinator by name (a new one is being started): in doubt, resent up to ``resends``
          times (the new coordinator answers ``duplicate`` for what the first attempt
          committed, settled as ``added``);
        * anything else: raised as it is."""
        if isinstance(exc, ray.exceptions.RayTaskError):
            if isinstance(remote_cause(exc), ShardUnavailableError):
                self.ledger.remember(self.sent)
            return None
        if isinstance(exc, TimeoutError):
            self.ledger.remember(self.sent)
            return None
        if isinstance(exc, actor_failures(ray.exceptions.OwnerDiedError, DeploymentNotFoundError)):
            # (DeploymentNotFoundError: a resend found no coordinator by name, a new one is being started)
            self.ledger.remember(self.sent)
            if not can_resend or self.attempts >= self.resends:
                return None
            self.attempts += 1
            return resend_delay(self.attempts)
        return None

    def answered(self, results: list[AddResult]) -> Any:
        """The caller's results: settled against the ids in doubt, one result for :meth:`add`."""
        if self.sent:
            results = self.ledger.settle(results, self.sent, self.keys)
        if self.started is not None:  # the client's add latency: from add_many until acknowledged
            RECORDER.observe_latency("add", "client", time.monotonic() - self.started)
            self.started = None
        return results[0] if self.single else results

    def __getstate__(self) -> dict[str, Any]:
        """Travelling to another process: the client's ledger and clock stay behind (the
        receiver keeps the doubts of this request in a ledger of its own)."""
        return {**self.__dict__, "ledger": None, "started": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.ledger = InDoubtLedger()


def prepare_add(
    trajectories: Sequence[Trajectory],
    vectors: Any,
    *,
    dim: int,
    features: str,
    coordinator: CoordinatorRef,
    ledger: InDoubtLedger,
    resends: int,
    wait_s: float | None = None,
) -> tuple[AddRequest, BatchSender]:
    """One request of ``add_many``: the trajectories encoded and their workflows abstracted in
    the caller's process (the coordinator only routes and decides), and its policy."""
    started = time.monotonic()
    batch = pack_trajectories(list(trajectories), vectors, dim, features)
    request = AddRequest(
        dict(zip(batch.ids, batch.fingerprints, strict=True)),
        list(batch.ids),
        ledger,
        resends=resends,
        started=started,
        wait_s=wait_s,
    )
    return request, BatchSender(coordinator, batch, vectors is not None)


# -- reading the shards' answers ------------------------------------------------------------
def any_conflict(answers: list[list[Any]], count: int) -> list[bool]:
    """Per id of a ``known`` call: whether some shard holds it with another fingerprint."""
    return [any(a[i] is not None and a[i].status == "conflict" for a in answers) for i in range(count)]


def one_round_results(
    tasks: list[str],
    envs: list[str | None],
    per_shard: list[Any],
    k: int,
    max_skills: int,
    budget: int,
) -> list[Retrieval]:
    """Each shard's top-k with their records (``search_records``), merged per query."""
    out = []
    for q, (task, env) in enumerate(zip(tasks, envs, strict=True)):
        hits = [h for part in per_shard for h in part[q][0]]
        texts = {cid: text for part in per_shard for cid, text in part[q][1].items()}
        out.append(assemble(task, env, hits, texts, k, max_skills, budget))
    return out


class TwoRoundMerge:
    """The plan and the merge of a two-round retrieval.

    Shards send scores and ids (``search_hits``) for groups of ``per_search`` queries; the
    top-k across shards is chosen here; then only the winners' records are fetched
    (``hit_records``), ``retrieve_chunk`` queries at a time, each chunk fetched while the one
    before is decoded (``cluster.search_chunk``, ``cluster.retrieve_chunk``)."""

    def __init__(self, queries: int, shards: int, k: int, cluster: ClusterConfig) -> None:
        chunk = cluster.retrieve_chunk
        self.k = k
        self.shards = shards
        self.per_search = max(chunk, cluster.search_chunk // chunk * chunk)  # validated as a multiple of chunk
        self.searches = [(a, min(queries, a + self.per_search)) for a in range(0, queries, self.per_search)]
        self.chunks = [(a, min(queries, a + chunk)) for a in range(0, queries, chunk)]
        self._owner = np.repeat(np.arange(shards), k)  # column of the merged rows -> shard
        self._merged: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def group_of(self, start: int) -> int:
        """The search group (index into :attr:`searches`) holding the chunk that starts at ``start``."""
        return start // self.per_search

    def needs(self, group: int) -> bool:
        return group not in self._merged

    def merge(self, group: int, parts: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Keep the top-k across the shards' ``(scores, ids)`` of one search group (the group
        before it is done with: dropped)."""
        self._merged.pop(group - 1, None)
        scores, ids = np.hstack([p[0] for p in parts]), np.hstack([p[1] for p in parts])
        best = np.argsort(-scores, axis=1, kind="stable")[:, : self.k]  # ties keep shard order, as assemble does
        self._merged[group] = (
            np.take_along_axis(scores, best, 1),
            np.take_along_axis(ids, best, 1),
            self._owner[best],
        )

    def winners(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray, list[tuple[int, np.ndarray]]]:
        """Queries ``a:b``: their merged scores and ids, and per shard holding winners
        ``(shard, positions in ids.ravel())`` whose records to fetch."""
        offset = a - self.group_of(a) * self.per_search
        scores, ids, shard_of = (x[offset : offset + b - a] for x in self._merged[self.group_of(a)])
        wanted = []
        for shard in range(self.shards):
            at = np.flatnonzero(((shard_of == shard) & (ids >= 0)).ravel())
            if len(at):
                wanted.append((shard, at))
        return scores, ids, wanted

    def results(
        self,
        tasks: list[str],
        envs: list[str | None],
        scores: np.ndarray,
        ids: np.ndarray,
        positions: list[np.ndarray],
        answers: list[tuple[list[Any], dict[int, str]]],
        max_skills: int,
        budget: int,
    ) -> list[Retrieval]:
        """One chunk's retrievals from the fetched records (``answers`` by ``positions``)."""
        k = self.k
        found: list[Any] = [None] * ids.size
        texts: dict[int, str] = {}
        for at, (records, skill_texts) in zip(positions, answers, strict=True):
            for pos, record in zip(at.tolist(), records, strict=True):
                found[pos] = record
            texts.update(skill_texts)
        out = []
        for q, (task, env) in enumerate(zip(tasks, envs, strict=True)):
            row = found[q * k : (q + 1) * k]
            hits = [(s, hit[0], hit[1]) for s, hit in zip(scores[q].tolist(), row, strict=True) if hit is not None]
            out.append(assemble(task, env, hits, texts, k, max_skills, budget))
        return out


# -- state ----------------------------------------------------------------------------------
def _summed(shard_stats: list[dict[str, Any]], key: str) -> dict[str, dict[str, int]]:
    """A per-name table of the shards' stats (``per_env``, ``per_tenant``) summed, sorted by name."""
    table: dict[str, dict[str, int]] = {}
    for st in shard_stats:
        for name, v in st.get(key, {}).items():
            slot = table.setdefault(name, {"trajectories": 0, "clusters": 0})
            slot["trajectories"] += v["trajectories"]
            slot["clusters"] += v["clusters"]
    return dict(sorted(table.items()))


def shard_pins(as_of: str | None, shards: int) -> list[int | None]:
    """Each shard's watermark of a read pinned to version ``as_of`` (None: not pinned)."""
    return [None] * shards if as_of is None else list(parse_version(as_of, shards))


def merge_stats(shard_stats: list[dict[str, Any]], tenant: str | None) -> dict[str, Any]:
    """The deployment's counts from its shards' (``tenant``: that tenant's own figures, with
    each shard's counts and nothing of the deployment as a whole; None: the totals, which
    :func:`with_deployment_stats` completes)."""
    out: dict[str, Any] = {
        "trajectories": sum(st["trajectories"] for st in shard_stats),
        "clusters": sum(st["clusters"] for st in shard_stats),
        "pending": sum(st["pending"] for st in shard_stats),
        "mixed_env_clusters": sum(st["mixed_env_clusters"] for st in shard_stats),
        "per_env": _summed(shard_stats, "per_env"),
        # one watermark per shard, in the deployment's shard order: lifemem_ray.engine.versions
        "version": format_version([parse_version(st["version"], 1, "a shard's version")[0] for st in shard_stats]),
    }
    if tenant is not None:
        out["tenant"] = tenant
        out["shards"] = [{"trajectories": st["trajectories"], "clusters": st["clusters"]} for st in shard_stats]
    return out


def with_deployment_stats(
    out: dict[str, Any], shard_stats: list[dict[str, Any]], coordinator: dict[str, Any]
) -> dict[str, Any]:
    """:func:`merge_stats`'s totals with the deployment's own figures: splits, LLM usage of
    the shards and the coordinator, each shard's counts, the embedder actors' figures, and the
    coordinator's stats."""
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
        per_tenant=_summed(shard_stats, "per_tenant"),
        embedding=coordinator.get("embedding", {}),  # the embedder actors' cache hit rate and model calls
        coordinator=coordinator,
    )
    return out


def check_listing(tenant: str | None, limit: int | None = None) -> None:
    """The checks of ``clusters``/``cluster_count`` before anything is sent."""
    if tenant is not None:
        check_tenant(tenant, "tenant")
    check_listing_limit(limit)


def merge_clusters(parts: list[list[Any]], limit: int | None) -> list[Any]:
    """Every shard's clusters, largest first (ties: by id), the first ``limit``."""
    return sorted((c for part in parts for c in part), key=lambda c: (-c.count, c.id))[:limit]


def check_remove(ids: Sequence[str], tenant: str) -> list[str]:
    """``remove``'s arguments checked: the ids as strings."""
    check_tenant(tenant, "tenant", stored=True)
    if isinstance(ids, str):
        raise ArgumentTypeError("expected a list of trajectory ids, got one string", where="ids")
    return [str(i) for i in ids]
