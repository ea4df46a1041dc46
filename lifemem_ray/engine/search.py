"""Search: retrieval for the user, and its two halves for a sharded client (the ids and
scores of each query's top-k, then the stored records of the winners across shards)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..ingest_rules import unit_rows
from ..config import BOUNDS
from ..retrieval import MAX_QUERIES, MAX_QUERY_HITS, RecordHit, Retrieval, assemble, check_retrieve_args, paused_gc
from .state import EngineState

__all__ = ["Search"]


class Search:
    def __init__(self, state: EngineState) -> None:
        self.s = state

    def retrieve_many(self, tasks: Sequence[str], envs: Sequence[str | None] | str, k: int | None = None, *,
                      vectors: Any = None, token_budget: int | None = None, skills: bool = True) -> list[Retrieval]:
        """Many queries in one embedding call and one batched index search (``None`` envs: all)."""
        self.s.check_open()
        tasks, envs, k, budget = check_retrieve_args(tasks, envs, k, token_budget, self.s.config.retrieval)
        retrieval = self.s.config.retrieval
        if not tasks:
            return []
        if vectors is None:
            vectors = self.s.embedder.embed(tasks)
        found = self.search_records(vectors, envs, k, skills=skills)
        with paused_gc():
            return [assemble(task, env, hits, texts, k, retrieval.max_skills, budget) for task, env, (hits, texts) in zip(tasks, envs, found)]

    def search_records(self, vectors: Any, envs: Sequence[str | None], k: int, *, skills: bool = True) -> list[tuple[list[RecordHit], dict[int, str]]]:
        """Per query: the top-k hits as (score, cluster id, stored record bytes) and the skills
        of their clusters. What a shard returns to a client that merges several shards: the
        records travel undecoded and only the merged winners are decoded."""
        scores, ids = self.search_hits(vectors, envs, k)
        records, skill_texts = self.hit_records(ids.ravel(), skills=skills)
        max_skills = self.s.config.retrieval.max_skills
        out = []
        for q, row_s in enumerate(scores.tolist()):
            hits: list[RecordHit] = []
            texts: dict[int, str] = {}
            for score, found in zip(row_s, records[q * k : (q + 1) * k]):
                if found is None:
                    continue
                cid, raw = found
                hits.append((score, cid, raw))
                if cid in skill_texts and cid not in texts and len(texts) < max_skills:
                    texts[cid] = skill_texts[cid]
            out.append((hits, texts))
        return out

    def search_hits(self, vectors: Any, envs: Sequence[str | None], k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(scores (q, k), ids (q, k))`` of each query's top-k, padded with -inf / -1: the first
        half of a sharded retrieval, which fetches records only for the winners across shards."""
        self.s.check_open()
        envs = list(envs)
        queries = unit_rows(vectors, len(envs), self.s.dim, "vectors")
        low, high = BOUNDS["retrieval.k"]
        if isinstance(k, bool) or not isinstance(k, int) or not low <= k <= high:
            raise ValueError(f"k: expected an integer within [{int(low)}, {int(high)}] (retrieval.k's bounds), got {k!r}")
        if len(envs) > MAX_QUERIES or len(envs) * k > MAX_QUERY_HITS:
            raise ValueError(f"vectors: {len(envs):,} queries x k = {k} in one call, at most {MAX_QUERIES:,} queries and "
                             f"{MAX_QUERY_HITS:,} results; send fewer queries per call")
        self.s.refresh()
        if not envs:
            return np.zeros((0, k), dtype=np.float32), np.zeros((0, k), dtype=np.int64)
        return self._search(queries, envs, k)

    def _search(self, queries: np.ndarray, envs: Sequence[str | None], k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k per query within its environment, or over every environment where it is None."""
        index = self.s.index
        scoped = [i for i, env in enumerate(envs) if env is not None]
        if len(scoped) == len(envs):
            return index.search_envs(queries, k, list(envs))
        scores = np.full((len(envs), k), -np.inf, dtype=np.float32)
        ids = np.full((len(envs), k), -1, dtype=np.int64)
        if scoped:
            scores[scoped], ids[scoped] = index.search_envs(queries[scoped], k, [envs[i] for i in scoped])
        pooled = [i for i, env in enumerate(envs) if env is None]
        scores[pooled], ids[pooled] = index.search(queries[pooled], k)
        return scores, ids

    def hit_records(self, ids: Any, *, skills: bool = True) -> tuple[list[tuple[int | None, bytes] | None], dict[int, str]]:
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
