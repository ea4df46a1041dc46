"""Audit: what a memory holds (stats) and whether it is consistent (verify: every invariant
against a recomputation from the stored trajectories)."""

from __future__ import annotations

from typing import Any

import numpy as np

from lifemem_ray.core.errors import InvalidTrajectoryError
from lifemem_ray.core.model import Outcome, Step, Trajectory
from lifemem_ray.core.tenancy import DEFAULT_TENANT, check_tenant, display_envs, id_key, scope_tenant, split_scope
from lifemem_ray.engine.clustering.clusters import check_against_members
from lifemem_ray.engine.state import WORKFLOW_DIM, EngineState
from lifemem_ray.engine.store.storage import unpack_u64
from lifemem_ray.engine.versions import format_version

__all__ = ["Audit"]


class Audit:
    def __init__(self, state: EngineState) -> None:
        self.s = state

    def stats(self, tenant: str | None = None) -> dict[str, Any]:
        """What the memory holds; with ``tenant``, only that tenant's trajectories, clusters,
        environments and index entries (nothing about the store as a whole: its path, splits,
        merges, LLM usage and queue are shared by every tenant, so an admin's view); without,
        everything with ``per_tenant`` counts."""
        tenant = None if tenant is None else check_tenant(tenant, "tenant")
        s = self.s
        s.refresh()
        with s.lock:
            records = list(s.clusters.values())
            pending = list(s.pending)
        if tenant is not None:
            records = [r for r in records if r.tenant == tenant]
        per_env: dict[str, dict[str, int]] = {}
        per_tenant: dict[str, dict[str, int]] = {}
        for record in records:
            owner = record.tenant or DEFAULT_TENANT
            slot = per_tenant.setdefault(owner, {"trajectories": 0, "clusters": 0})
            slot["trajectories"] += record.count
            slot["clusters"] += 1
            for env, n in display_envs(record.envs).items():
                slot = per_env.setdefault(env, {"trajectories": 0, "clusters": 0})
                slot["trajectories"] += n
                slot["clusters"] += 1
        pending_mine = 0
        with s.store.read() as txn:
            total = s.store.count_trajectories(txn)
            counters = s.store.get_meta("counters", txn, {}) or {}
            usage = s.store.get_meta("llm_usage", txn, {}) or {}
            todo = len(s.store.todos(txn))
            version = format_version([int(s.store.get_meta("next_vid", txn))])
            for vid in pending:
                brief = s.store.brief(txn, vid)
                if brief is None:
                    continue
                owner, env = split_scope(brief.env)
                if tenant is not None and owner != tenant:
                    continue
                pending_mine += 1
                per_tenant.setdefault(owner, {"trajectories": 0, "clusters": 0})["trajectories"] += 1
                per_env.setdefault(env, {"trajectories": 0, "clusters": 0})["trajectories"] += 1
        live_usage = s.usage_totals()
        if live_usage is not None:
            usage = live_usage
        sizes = sorted((r.count for r in records), reverse=True)
        mine = {
            "trajectories": total if tenant is None else sum(r.count for r in records) + pending_mine,
            "clusters": len(records),
            "pending": len(pending) if tenant is None else pending_mine,
            "per_env": dict(sorted(per_env.items())),
            "cluster_sizes": {
                "max": sizes[0] if sizes else 0,
                "median": sizes[len(sizes) // 2] if sizes else 0,
                "singletons": sum(1 for n in sizes if n == 1),
            },
            "mixed_env_clusters": sum(1 for r in records if len(r.envs) > 1),
            "index": s.index.stats() if tenant is None else _index_of(s.index.stats(), tenant),
            "version": version,  # what a retrieve as_of this token sees: lifemem_ray.engine.versions
        }
        if tenant is not None:  # a tenant's view holds its own figures only: nothing of the store or of other tenants
            return {"tenant": tenant, **mine}
        embedding = s.embedding_stats()  # the embedding service's cache and batches, once it embedded texts
        return {
            "path": str(s.path),
            **mine,
            "per_tenant": dict(sorted(per_tenant.items())),
            **_store_figures(s, counters, usage, todo),
            **({"embedding": embedding} if embedding is not None else {}),
        }

    def verify(self, deep: bool = False) -> dict[str, Any]:
        """Check every invariant against a recomputation from the stored trajectories; ``deep``:
        also every record's fingerprint against its content (see :meth:`Memory.verify`)."""
        s = self.s
        s.refresh()
        store = s.store
        problems: list[str] = []
        with s.lock, store.read() as txn:  # no commit in between: LMDB and the index agree
            if s.read_only and int(store.get_meta("generation", txn)) != s.generation:
                s.load()  # a writer committed between the refresh and this snapshot
            n_traj = store.count_trajectories(txn)
            n_index = len(s.index)
            seen_ids: dict[str, int] = {}
            for vid, traj, extra in store.iter_trajectories(txn):
                key = id_key(traj.tenant, traj.id)
                if key in seen_ids:
                    problems.append(f"trajectory id {traj.id!r} of tenant {traj.tenant!r} stored twice")
                seen_ids[key] = vid
                if store.lookup_id(txn, key) != vid:
                    problems.append(f"id map does not point at trajectory {traj.id!r} of tenant {traj.tenant!r}")
                if deep:
                    problems.extend(_fingerprint_problems(vid, traj, extra["fingerprint"]))
            if deep:
                for raw_key, raw_vid in txn.cursor(db=store.db["tid"]):
                    tid, vid = raw_key.decode("utf-8", "replace"), unpack_u64(raw_vid)
                    stored = store.trajectory(txn, vid)
                    if stored is None:
                        problems.append(f"id index: {tid!r} points at vid {vid}, which holds no trajectory")
                    elif id_key(stored[0].tenant, stored[0].id) != tid:
                        problems.append(
                            f"id index: {tid!r} points at vid {vid}, which holds trajectory {stored[0].id!r}"
                        )
            pending = set(store.get_meta("pending", txn) or [])
            sums: dict[int, list[Any]] = {}
            stored_ids: dict[int, list[int]] = {}
            for vid, code, vec, wvec in store.iter_vectors(txn):
                stored_ids.setdefault(code, []).append(vid)
                cid = store.cluster_of(txn, vid)
                if cid is None:
                    if vid not in pending:
                        problems.append(f"trajectory vid {vid} is in no cluster")
                    continue
                slot = sums.setdefault(cid, [0, np.zeros(s.dim), np.zeros(WORKFLOW_DIM)])
                slot[0] += 1
                slot[1] += vec
                slot[2] += wvec
            live = 0
            for record in store.iter_clusters(txn):
                members = store.members(txn, record.id)
                if not record.live:
                    if members:
                        problems.append(f"cluster {record.id} is retired but has {len(members)} members")
                    continue
                live += 1
                got = sums.get(record.id, [0, np.zeros(s.dim), np.zeros(WORKFLOW_DIM)])
                problems.extend(check_against_members(record, len(members), got[0], got[1], got[2]))
            for cid in sums:
                pointed = store.get_cluster(txn, cid)
                if pointed is None or not pointed.live:
                    problems.append(f"trajectories point at cluster {cid}, which is not live")
            names = {code: name for name, code in store.env_codes(txn).items()}
            problems.extend(
                index_problems(
                    {names.get(code, f"env code {code}"): vids for code, vids in stored_ids.items()}, s.index.ids()
                )
            )
        if n_index != n_traj:
            problems.append(f"index holds {n_index} vectors, the store {n_traj} trajectories")
        return {
            "ok": not problems,
            "trajectories": n_traj,
            "clusters": live,
            "pending": len(pending),
            "problems": problems,
            **({"deep": True} if deep else {}),
        }


def index_problems(stored: dict[str, list[int]], indexed: dict[str, np.ndarray], shown: int = 5) -> list[str]:
    """Per environment, the stored trajectories' vids the vector index lacks (a search cannot
    find them) and the indexed ids no trajectory of that environment has (a search returns
    them), at most ``shown`` of each named.

    >>> index_problems({"sql": [1, 2, 3]}, {"sql": np.array([2, 3, 9])})
    ['index of env sql: lacks 1 stored trajectory vid(s) (1)', 'index of env sql: holds 1 id(s) no stored trajectory of it has (9)']
    """
    problems = []
    for env in sorted(set(stored) | set(indexed)):
        want = set(stored.get(env, ()))
        have = set(np.asarray(indexed.get(env, np.empty(0, dtype=np.int64))).tolist())
        for what, ids in (
            ("lacks {n} stored trajectory vid(s)", want - have),
            ("holds {n} id(s) no stored trajectory of it has", have - want),
        ):
            if ids:
                named = ", ".join(str(i) for i in sorted(ids)[:shown]) + (", ..." if len(ids) > shown else "")
                problems.append(f"index of env {env}: {what.format(n=len(ids))} ({named})")
    return problems


def _fingerprint_problems(vid: int, traj: Trajectory, stored_fp: str) -> list[str]:
    """The record's content hashed again (and validated) against the fingerprint stored with it."""
    try:
        fresh = Trajectory(
            env=traj.env,
            task=traj.task,
            steps=tuple(Step(s.action, s.thought, s.observation) for s in traj.steps),
            outcome=Outcome(success=traj.outcome.success, reward=traj.outcome.reward),
            id=traj.id,
            initial_observation=traj.initial_observation,
            metadata=traj.metadata,
            tenant=traj.tenant,
        )
    except (InvalidTrajectoryError, TypeError, ValueError) as exc:
        return [f"trajectory {traj.id!r} (vid {vid}): its stored content is not a valid trajectory: {exc}"]
    if fresh.fingerprint != stored_fp:
        return [
            f"trajectory {traj.id!r} (vid {vid}): its content does not match its stored fingerprint "
            f"({stored_fp[:16]}... stored, {fresh.fingerprint[:16]}... recomputed): the record was changed outside the engine"
        ]
    return []


def _index_of(stats: dict[str, Any], tenant: str) -> dict[str, Any]:
    """The index stats of one tenant: its environments only, named without the tenant."""
    out = dict(stats)
    envs = stats.get("envs")
    if isinstance(envs, dict):
        out["envs"] = {split_scope(name)[1]: v for name, v in envs.items() if scope_tenant(name) == tenant}
        out["ntotal"] = sum(int(v.get("ntotal", 0)) for v in out["envs"].values() if isinstance(v, dict))
    return out


def _store_figures(s: EngineState, counters: dict[str, Any], usage: dict[str, Any], todo: int) -> dict[str, Any]:
    """The figures of the store as a whole (shared by every tenant: an admin's view)."""
    return {
        "purging": list(s.store.get_meta("purging", default=[]) or []),
        "splits": int(counters.get("splits", 0)),
        # Splits the rule called for where the members showed no structure to split on.
        "splits_refused": int(counters.get("splits_refused", 0)),
        "merges": int(counters.get("merges", 0)),
        "maintenance_queued": todo,
        "background": {  # where maintenance and index retrains run (a Ray shard always runs both in the background)
            "maintenance": s.config.evolution.background_maintenance,
            "index_retrain": s.config.index.background_retrain,
        },
        "llm": {
            "backend": s.config.llm.backend if s.decider is not None else "offline",
            "calls": sum(int(v.get("calls", 0)) for v in usage.values()),
            "tokens": sum(int(v.get("prompt_tokens", 0)) + int(v.get("completion_tokens", 0)) for v in usage.values()),
            "fallbacks": int(counters.get("llm_fallbacks", 0)),
            # Generated descriptions and skills refused by the provenance rule (lifemem_ray.llm.provenance),
            # apart from other invalid answers; per operation in by_operation.
            "refused_generated": sum(int(v.get("refused_generated", 0)) for v in usage.values()),
            "decided_offline": int(counters.get("llm_skipped", 0)),
            "by_operation": usage,
        },
        "generation": s.store.generation(),
    }
