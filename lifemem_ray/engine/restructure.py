"""Splits and merges: the maintenance that changes which cluster a member belongs to.

A split reads the members without holding the engine lock (ingest goes on meanwhile) and
commits only if the cluster's version is still the one it read; a merge moves the smaller
of two converged clusters into the larger. Either leaves a tombstone (``split_into``) that
decisions naming the old cluster resolve through.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from lifemem_ray.core.decisions import ClusterView
from lifemem_ray.core.tenancy import display_envs
from lifemem_ray.engine.clustering.clusters import (
    ClusterRecord,
    fold_member,
    merged,
    needs_description,
    new_cluster_record,
    scrub_text,
)
from lifemem_ray.engine.clustering.workflow import workflow_summary
from lifemem_ray.engine.state import WORKFLOW_DIM, EngineState
from lifemem_ray.engine.store.codec import Brief

__all__ = ["Restructure"]

log = logging.getLogger("lifemem_ray.engine.memory")


class Restructure:
    def __init__(
        self, state: EngineState, view: Callable[[int], ClusterView | None], stopping: Callable[[], bool]
    ) -> None:
        self.s = state
        self.view = view
        self.stopping = stopping

    # -- splits ------------------------------------------------------------------------------
    def try_split(self, cid: int) -> bool:
        """Split ``cid`` if the split rule still holds and its members show structure."""
        record = self.s.clusters.get(cid)
        return record is not None and self.s.needs_split(record) and self.split(cid)

    def _member_snapshot(self, cid: int) -> tuple[int, list[int], np.ndarray, np.ndarray, list[Brief]] | None:
        """The cluster's version, member vids, vectors and briefs.

        Read without holding the engine lock, so ingest goes on meanwhile: the version is
        taken first, and a split commits only if the version is still the same then, which
        means the members read here are exactly the members at that version."""
        s = self.s
        with s.lock:
            record = s.clusters.get(cid)
            if record is None:
                return None
            version = record.version
        with s.store.read() as txn:
            vids = s.store.members(txn, cid)
            tv = np.empty((len(vids), s.dim), np.float32)
            wv = np.empty((len(vids), WORKFLOW_DIM), np.float32)
            briefs: list[Brief] = []
            for n, vid in enumerate(vids):
                _, vec, wvec = s.store.vectors(txn, vid)  # type: ignore[misc]
                tv[n] = vec
                wv[n] = wvec
                brief = s.store.brief(txn, vid)
                assert brief is not None
                briefs.append(brief)
        return version, vids, tv, wv, briefs

    def split(self, cid: int) -> bool:
        """Split cluster ``cid`` into finer clusters; False when no structure was found."""
        s = self.s
        evo = s.config.evolution
        for _ in range(3):
            snapshot = self._member_snapshot(cid)
            if snapshot is None:
                return False
            version, vids, tv, wv, briefs = snapshot
            labels, descriptions = None, None
            by = "offline"
            if s.decider is not None:
                answer = self._llm_split(cid, tv, wv, vids)
                if answer is not None:
                    labels, descriptions = answer
                by = "llm" if labels is not None else "fallback"
            if labels is None:
                labels = s.policy.split(
                    wv,
                    tau=evo.split_mrl_threshold,
                    min_size=evo.split_min_size,
                    max_parts=evo.split_max_parts,
                    seed=cid,
                    cut=evo.split_cut,
                    min_silhouette=evo.split_min_silhouette,
                )
            with s.lock:
                parent = s.clusters.get(cid)
                if parent is None:
                    return False
                if parent.version != version:
                    continue  # it changed while we computed: again, on fresh data
                if labels is None or len(set(labels.tolist())) < 2:
                    self._refuse_split(parent)
                    return False
                self._commit_split(parent, vids, tv, wv, briefs, labels, by, descriptions)
                return True
        return False

    def _refuse_split(self, parent: ClusterRecord) -> None:
        """No structure to split on: not again before the cluster has grown (under the lock)."""
        s = self.s
        parent = parent.copy()
        parent.no_split_until = int(parent.count * (1.0 + s.config.evolution.skill_refresh_growth)) + 1

        def write(txn: Any) -> None:
            s.store.put_cluster(txn, parent)
            s.store.clear_todo(txn, parent.id, "split")
            s.add_counters(txn, {"splits_refused": 1})

        s.store.write(write)
        s.clusters[parent.id] = parent

    def _llm_split(
        self, cid: int, tv: np.ndarray, wv: np.ndarray, vids: list[int]
    ) -> tuple[np.ndarray, list[str]] | None:
        """The LLM groups a sample of members (and describes each group); the rest follow
        their nearest group."""
        s = self.s
        assert s.decider is not None
        n = len(vids)
        sample = np.unique(np.linspace(0, n - 1, num=min(n, 24)).round().astype(int))
        view = self.view(cid)
        if view is None:
            return None
        with s.store.read() as txn:
            shown = [got[0] for i in sample if (got := s.store.trajectory(txn, vids[i])) is not None]
        if len(shown) != len(sample):
            return None
        groups = s.decider.split(view, shown, s.config.evolution.split_max_parts)
        if groups is None or len(groups[0]) != len(sample) or len(set(groups[0])) < 2:
            return None
        answer, described = groups
        w = s.config.policy.workflow_weight
        combined = np.hstack([wv * np.sqrt(w), tv * np.sqrt(1 - w)])
        labels_of = sorted(set(answer))
        centres = np.stack([combined[sample[np.asarray(answer) == g]].sum(axis=0) for g in labels_of])
        centres /= np.linalg.norm(centres, axis=1, keepdims=True)
        labels = np.argmax(combined @ centres.T, axis=1)
        labels[sample] = [labels_of.index(g) for g in answer]
        return labels, [described[g] if 0 <= g < len(described) else "" for g in labels_of]

    def _commit_split(
        self,
        parent: ClusterRecord,
        vids: list[int],
        tv: np.ndarray,
        wv: np.ndarray,
        briefs: list[Brief],
        labels: np.ndarray,
        by: str,
        descriptions: list[str] | None = None,
    ) -> None:
        """Replace ``parent`` by one child per label; a child's description is the LLM's for
        its group when given (``descriptions[i]`` for the i-th label in sorted order)."""
        s = self.s
        now = time.time()
        parts = sorted(set(labels.tolist()))
        children: list[ClusterRecord] = []
        examples: list[str] = []
        for part in parts:
            child = new_cluster_record(0, s.dim, WORKFLOW_DIM, "split", now)
            child.parent = parent.id
            rows = np.flatnonzero(labels == part)
            for n in rows:
                b = briefs[n]
                fold_member(child, tv[n], wv[n], b.env, b.success, workflow_summary(b.tokens), now)
            children.append(child)
            examples.append(briefs[int(rows[0])].task)

        def write(txn: Any) -> None:
            ids = s.store.next_cluster_ids(txn, len(children))
            for n, (child, child_id, example) in enumerate(zip(children, ids, examples, strict=True)):
                child.id = child_id
                described = descriptions[n] if descriptions is not None and n < len(descriptions) else ""
                if described:
                    child.description, child.description_by, child.description_n = described, "llm", child.count
                else:
                    child.description = s.policy.describe(child.count, display_envs(child.envs), child.flows, example)
                    child.description_by = "offline"
                s.store.put_cluster(txn, child)
                s.store.add_todo(
                    txn,
                    child_id,
                    skill=True,
                    split=s.needs_split(child),
                    describe=s.llm_mode and child.description_by != "llm",
                )
            entries = []
            for n, vid in enumerate(vids):
                child_id = ids[parts.index(int(labels[n]))]
                s.store.set_cluster_of(txn, vid, child_id, previous=parent.id)
                entries.append(
                    {
                        "vid": vid,
                        "id": briefs[n].id,
                        "cluster": child_id,
                        "from": parent.id,
                        "op": "split",
                        "by": by,
                        "t": now,
                    }
                )
            tomb = scrub_text(parent.copy())
            tomb.split_into = list(ids)
            tomb.updated = now
            s.store.put_cluster(txn, tomb)
            s.store.clear_todo(txn, parent.id)
            s.store.append_log(txn, entries)
            s.add_counters(txn, {"splits": 1})

        s.store.write(write)
        s.clusters.pop(parent.id, None)
        for child in children:
            s.clusters[child.id] = child
        s.centroids.remove([parent.id])
        s.centroids.update(children)
        log.info(
            "split cluster %d (n=%d, R=%.3f) into %s", parent.id, parent.count, parent.mrl, [c.count for c in children]
        )

    # -- merges ------------------------------------------------------------------------------
    def try_merge(self, cid: int) -> bool:
        """Merge cluster ``cid`` with the cluster of its environments it has converged with, if
        any (:meth:`OfflinePolicy.should_merge`) among its ``evolution.merge_candidates``
        nearest by centroid score; the larger one absorbs the smaller."""
        s = self.s
        evo = s.config.evolution
        with s.lock:
            record = s.clusters.get(cid)
            if record is None:
                return False
            row = s.centroids.query(_unit(record.tsum)[None, :], _unit(record.wsum)[None, :])
            ids, _ = s.centroids.search(row, evo.merge_candidates + 1, [record.tenant])
            for other_id in ids[0].tolist():
                other = s.clusters.get(int(other_id))
                if other is None or other.id == cid or set(other.envs) != set(record.envs):
                    continue
                if s.policy.should_merge(
                    record, other, ratio=evo.merge_ratio, tau=evo.split_mrl_threshold, max_size=evo.split_min_size
                ):
                    keep, gone = (
                        (record, other) if (record.count, -record.id) >= (other.count, -other.id) else (other, record)
                    )
                    self._commit_merge(keep, gone)
                    return True
        return False

    def _commit_merge(self, keep: ClusterRecord, gone: ClusterRecord) -> None:
        """Move ``gone``'s members into ``keep`` in one transaction; ``gone`` becomes a tombstone
        pointing at ``keep`` (decisions naming it resolve there, as for a split)."""
        s = self.s
        now = time.time()
        heir = merged(keep, gone, now)
        tomb = scrub_text(gone.copy())
        tomb.split_into = [keep.id]
        tomb.updated = now

        def write(txn: Any) -> None:
            entries = []
            for vid in s.store.members(txn, gone.id):
                s.store.set_cluster_of(txn, vid, keep.id, previous=gone.id)
                brief = s.store.brief(txn, vid)
                entries.append(
                    {
                        "vid": vid,
                        "id": brief.id if brief else "",
                        "cluster": keep.id,
                        "from": gone.id,
                        "op": "merge",
                        "by": "offline",
                        "t": now,
                    }
                )
            s.store.put_cluster(txn, heir)
            s.store.put_cluster(txn, tomb)
            s.store.clear_todo(txn, gone.id)
            s.store.add_todo(
                txn,
                keep.id,
                skill=True,
                merge=True,
                split=s.needs_split(heir),
                describe=s.llm_mode and needs_description(heir, s.config.evolution, s.config.llm),
            )
            s.store.append_log(txn, entries)
            s.add_counters(txn, {"merges": 1})

        s.store.write(write)
        s.clusters.pop(gone.id, None)
        s.clusters[keep.id] = heir
        s.centroids.remove([gone.id])
        s.centroids.update([heir])
        log.debug("merged cluster %d (n=%d) into %d (n=%d)", gone.id, gone.count, keep.id, keep.count)


def _unit(vec: np.ndarray) -> np.ndarray:
    norm = float(np.linalg.norm(vec))
    return (vec / norm if norm > 0 else vec).astype(np.float32)
