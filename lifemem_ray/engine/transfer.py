"""Moving trajectories between stores: absorb whole clusters from another store folder (a
snapshot), export as re-importable JSONL. (Removal is :mod:`lifemem_ray.engine.deletion`.)"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lifemem_ray.core.errors import StoreError
from lifemem_ray.core.ids import ID_SEQ_BITS
from lifemem_ray.core.tenancy import scope_tenant
from lifemem_ray.engine.clustering.clusters import ClusterInfo, ClusterRecord
from lifemem_ray.engine.state import WORKFLOW_DIM, EngineState
from lifemem_ray.engine.store.storage import MemoryStore, RawItem

__all__ = ["Transfer"]

_SEQ_MASK = (1 << ID_SEQ_BITS) - 1


class Transfer:
    def __init__(self, state: EngineState) -> None:
        self.s = state

    # -- absorb ------------------------------------------------------------------------------
    def absorb(
        self,
        source: str | Path,
        cluster_ids: Sequence[int] | None = None,
        *,
        include_pending: bool = False,
        chunk: int = 2000,
    ) -> dict[str, int]:
        """Copy whole clusters from another store folder (a snapshot), keeping every id.

        Used to restore a snapshot into a deployment with another shard count: each
        cluster moves with all of its trajectories, vectors and its skill. Copies are
        idempotent (a trajectory already here is skipped), so a restore can be rerun."""
        s = self.s
        s.check_writable()
        src = MemoryStore(source, read_only=True)
        try:
            if src.dim != s.dim or src.workflow_dim != WORKFLOW_DIM:
                raise StoreError(
                    f"{source}: vectors of {src.dim}/{src.workflow_dim} dimensions cannot join a store of {s.dim}/{WORKFLOW_DIM}"
                )
            records, pending, initialised, counters = self._source_clusters(src, source, cluster_ids, include_pending)
            moved = {"clusters": 0, "trajectories": 0, "skipped": 0}
            with s.lock:
                work: list[tuple[int | None, int]] = [(rec.id, vid) for rec, members in records for vid in members]
                work += [(None, v) for v in pending]
                top_vid = 0
                for start in range(0, len(work), chunk):
                    part = work[start : start + chunk]
                    moved["skipped"] += self._copy_items(src, source, part)
                    moved["trajectories"] += len(part)
                    top_vid = max([top_vid] + [vid & _SEQ_MASK for _, vid in part])
                self._finish_absorb(source, records, pending, initialised, counters, top_vid)
                moved["clusters"] = len(records)
                s.load()
        finally:
            src.close()
        return moved

    @staticmethod
    def _source_clusters(
        src: MemoryStore, source: Any, cluster_ids: Sequence[int] | None, include_pending: bool
    ) -> tuple[list[tuple[ClusterRecord, list[int]]], list[int], bool, dict[str, Any]]:
        with src.read() as stxn:
            wanted = list(cluster_ids) if cluster_ids is not None else [r.id for r in src.iter_clusters(stxn) if r.live]
            # A snapshot taken between two transactions of a tenant purge holds part of that
            # tenant and the intent: the purge was acknowledged, so none of it comes back.
            purging = set(src.get_meta("purging", stxn) or [])
            records = []
            for cid in wanted:
                record = src.get_cluster(stxn, cid)
                if record is None or not record.live:
                    raise StoreError(f"{source}: cluster {cid} is not a live cluster there")
                if record.tenant not in purging:
                    records.append((record, src.members(stxn, cid)))
            pending = list(src.get_meta("pending", stxn) or []) if include_pending else []
            if purging:
                pending = [
                    v for v in pending if (b := src.brief(stxn, v)) is not None and scope_tenant(b.env) not in purging
                ]
            return records, pending, bool(src.get_meta("initialised", stxn)), src.get_meta("counters", stxn, {}) or {}

    def _copy_items(self, src: MemoryStore, source: Any, part: list[tuple[int | None, int]]) -> int:
        """Copy these (cluster, vid) trajectories in one transaction; returns how many were here already."""
        store = self.s.store
        rows: list[tuple[int | None, RawItem]] = []
        with src.read() as stxn:
            names = {code: name for name, code in src.env_codes(stxn).items()}
            for cid, vid in part:
                raw = src.raw_item(stxn, vid, names)
                if raw is None:
                    raise StoreError(f"{source}: trajectory {vid} of cluster {cid} is missing")
                rows.append((cid, raw))

        def write(txn: Any) -> int:
            skipped = 0
            for cid, raw in rows:
                if store.lookup_id(txn, raw.trajectory_id) is not None:
                    skipped += 1
                    continue
                if store.holds_vid(txn, raw.vid):
                    raise StoreError(f"{self.s.path}: trajectory id {raw.vid} is taken here by another trajectory")
                store.put_raw_item(txn, raw, cid)
            return skipped

        return store.write(write)

    def _finish_absorb(
        self,
        source: Any,
        records: list[tuple[ClusterRecord, list[int]]],
        pending: list[int],
        initialised: bool,
        counters: dict[str, Any],
        top_vid: int,
    ) -> None:
        s = self.s
        now = time.time()

        def finish(txn: Any) -> None:
            for record, _ in records:
                s.store.put_cluster(txn, record)
                if not record.skill:
                    s.store.add_todo(txn, record.id, skill=True)
            if pending:
                s.store.put_meta(
                    txn, "pending", list(dict.fromkeys((s.store.get_meta("pending", txn) or []) + pending))
                )
            if initialised and not pending:
                s.store.put_meta(txn, "initialised", True)
            s.store.advance_sequences(txn, top_vid, max([r.id & _SEQ_MASK for r, _ in records], default=0))
            s.add_counters(txn, {"splits": int(counters.get("splits", 0))})
            s.store.append_log(
                txn,
                [{"cluster": r.id, "op": "absorb", "from": str(source), "n": r.count, "t": now} for r, _ in records],
            )

        s.store.write(finish)

    # -- export ------------------------------------------------------------------------------
    def export(self, path: str | Path) -> dict[str, Any]:
        """Trajectories as native JSONL (re-importable) to ``path``; clusters to ``<path stem>.clusters.jsonl``."""
        from lifemem_ray.core.importers import write_jsonl

        store = self.s.store
        path = Path(path)
        with store.read() as txn:
            trajectories = [t for _, t, _ in store.iter_trajectories(txn)]
            clusters = []
            for record in store.iter_clusters(txn):
                if not record.live:
                    continue
                info = ClusterInfo.of(record).to_dict()
                info["members"] = [store.trajectory(txn, v)[0].id for v in store.members(txn, record.id)]  # type: ignore[index]
                clusters.append(info)
        n = write_jsonl(trajectories, path)
        cluster_path = path.with_name(path.name.removesuffix(".jsonl") + ".clusters.jsonl")
        tmp = cluster_path.with_name(cluster_path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            for info in clusters:
                fh.write(json.dumps(info, ensure_ascii=False) + "\n")
        tmp.replace(cluster_path)
        return {"trajectories": n, "clusters": len(clusters), "clusters_path": str(cluster_path)}
