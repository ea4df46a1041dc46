"""Search: retrieval for the user, and its two halves for a sharded client (the ids and
scores of each query's top-k, then the stored records of the winners across shards)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np

from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.core.tenancy import DEFAULT_TENANT, is_pool, scope_tenant, search_targets
from lifemem_ray.engine.index.vector_index import VectorIndex
from lifemem_ray.engine.ingest_rules import unit_rows
from lifemem_ray.engine.retrieval import (
    MAX_QUERIES,
    RecordHit,
    Retrieval,
    assemble,
    check_k,
    check_retrieve_args,
    paused_gc,
)
from lifemem_ray.engine.state import EngineState
from lifemem_ray.engine.versions import parse_version, search_as_of

__all__ = ["Search", "search_index"]


class Search:
    def __init__(self, state: EngineState) -> None:
        self.s = state

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
        """Many queries of ``tenant`` in one embedding call and one batched index search
        (``None`` envs: every environment of the tenant; ``as_of``: a version token, see
        :mod:`lifemem_ray.engine.versions`)."""
        self.s.check_open()
        tasks, envs, k, budget = check_retrieve_args(tasks, envs, k, token_budget, self.s.config.retrieval)
        watermark = None if as_of is None else parse_version(as_of, shards=1)[0]
        targets = search_targets(tenant, envs)
        retrieval = self.s.config.retrieval
        if not tasks:
            return []
        if vectors is None:
            vectors = self.s.embedder.embed(tasks)
        found = self.search_records(vectors, targets, k, skills=skills, as_of=watermark)
        with paused_gc():
            return [
                assemble(task, env, hits, texts, k, retrieval.max_skills, budget)
                for task, env, (hits, texts) in zip(tasks, envs, found, strict=True)
            ]

    def search_records(
        self, vectors: Any, envs: Sequence[str], k: int, *, skills: bool = True, as_of: int | None = None
    ) -> list[tuple[list[RecordHit], dict[int, str]]]:
        """Per query: the top-k hits as (score, cluster id, stored record bytes) and the skills
        of their clusters. What a shard returns to a client that merges several shards: the
        records travel undecoded and only the merged winners are decoded. ``as_of``: this
        store's watermark of a pinned read (None: everything committed)."""
        scores, ids = self.search_hits(vectors, envs, k, as_of=as_of)
        records, skill_texts = self.hit_records(ids.ravel(), skills=skills)
        max_skills = self.s.config.retrieval.max_skills
        out = []
        for q, row_s in enumerate(scores.tolist()):
            hits: list[RecordHit] = []
            texts: dict[int, str] = {}
            for score, found in zip(row_s, records[q * k : (q + 1) * k], strict=True):
                if found is None:
                    continue
                cid, raw = found
                hits.append((score, cid, raw))
                if cid in skill_texts and cid not in texts and len(texts) < max_skills:
                    texts[cid] = skill_texts[cid]
            out.append((hits, texts))
        return out

    def search_hits(
        self, vectors: Any, envs: Sequence[str], k: int, *, as_of: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(scores (q, k), ids (q, k))`` of each query's top-k, padded with -inf / -1: the first
        half of a sharded retrieval, which fetches records only for the winners across shards.
        ``as_of``: only trajectories committed below this store's watermark (a pinned read)."""
        self.s.check_open()
        envs = list(envs)
        queries = unit_rows(vectors, len(envs), self.s.dim, "vectors")
        if len(envs) > MAX_QUERIES:
            raise InvalidArgumentError(
                f"{len(envs):,} queries in one call, at most {MAX_QUERIES:,}; send fewer queries per call",
                where="vectors",
            )
        check_k(k, len(envs))
        self.s.refresh()
        if not envs:
            return np.zeros((0, k), dtype=np.float32), np.zeros((0, k), dtype=np.int64)
        if as_of is None:
            return search_index(self.s.index, queries, envs, k)
        if isinstance(as_of, bool) or not isinstance(as_of, int) or not 0 <= as_of <= self.watermark():
            raise InvalidArgumentError(
                f"{as_of!r} is not a version of this store (its watermark is {self.watermark()}); "
                "read the version from this memory's version() or stats()",
                where="as_of",
            )
        index = self.s.index
        return search_as_of(lambda n: search_index(index, queries, envs, n), k, as_of, len(index))

    def watermark(self) -> int:
        """How many numbers of its id sequence the store handed out: the trajectories committed
        so far are the ones below it (:mod:`lifemem_ray.engine.versions`)."""
        self.s.check_open()
        with self.s.store.read() as txn:
            return int(self.s.store.get_meta("next_vid", txn))

    def hit_records(
        self, ids: Any, *, skills: bool = True
    ) -> tuple[list[tuple[int | None, bytes] | None], dict[int, str]]:
        """Per id: ``(cluster id, stored record bytes)``, or None where it is not stored (padding,
        or removed since it was found); and the skill texts of those clusters (non-empty only)."""
        s = self.s
        s.check_open()
        out: list[tuple[int | None, bytes] | None] = []
        texts: dict[int, str] = {}
        looked: set[int] = set()
        with s.store.read() as txn:
            for vid in np.asarray(ids, dtype=np.int64).ravel().tolist():
                raw = s.store.trajectory_bytes(txn, vid) if vid >= 0 else None
                if raw is None:
                    out.append(None)
                    continue
                cid = s.store.cluster_of(txn, vid)
                out.append((cid, raw))
                if skills and cid is not None and cid not in looked:
                    looked.add(cid)
                    # The live view (replaced whole on every commit, never edited in place)
                    # instead of decoding the stored record with its sums for one string.
                    record = s.clusters.get(cid) or s.store.get_cluster(txn, cid)  # split meanwhile
                    if record is not None and record.skill.strip():
                        texts[cid] = record.skill
        return out, texts


def search_index(
    index: VectorIndex,
    queries: np.ndarray,
    targets: Sequence[str],
    k: int,
    *,
    nprobe_fraction: float = 1.0,
    max_codes: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Top-k per query within its target: a scope (:func:`lifemem_ray.core.tenancy.scope`) or a
    tenant's pool (:func:`lifemem_ray.core.tenancy.pool`: every scope of that tenant). There is no
    "every tenant" target: a search is always some tenant's. ``nprobe_fraction`` and
    ``max_codes`` apply to scoped searches (see :meth:`VectorIndex.search_envs`)."""
    targets = list(targets)
    for i, t in enumerate(targets):
        if not isinstance(t, str):
            raise InvalidArgumentError(
                f"{t!r} is not a search target; give a scope (tenancy.scope) or a tenant's "
                "pool (tenancy.pool, for every environment of one tenant)",
                where=f"targets[{i}]",
            )
    scoped = [i for i, t in enumerate(targets) if not is_pool(t)]
    if len(scoped) == len(targets):
        return index.search_envs(queries, k, targets, nprobe_fraction=nprobe_fraction, max_codes=max_codes)
    scores = np.full((len(targets), k), -np.inf, dtype=np.float32)
    ids = np.full((len(targets), k), -1, dtype=np.int64)
    if scoped:
        scores[scoped], ids[scoped] = index.search_envs(
            queries[scoped],
            k,
            [targets[i] for i in scoped],
            nprobe_fraction=nprobe_fraction,
            max_codes=max_codes,
        )
    groups: dict[str, list[int]] = {}
    for i, t in enumerate(targets):
        if is_pool(t):
            groups.setdefault(t, []).append(i)
    for target, rows in groups.items():
        tenant = target[:-1]
        scores[rows], ids[rows] = index.search(queries[rows], k, among=partial(_of_tenant, tenant))
    return scores, ids


def _of_tenant(tenant: str, scope: str) -> bool:
    """Whether the index scope ``scope`` (an environment of some tenant) is ``tenant``'s."""
    return scope_tenant(scope) == tenant
