"""Deletion: remove trajectories by id, and purge everything of a tenant.

A removal is one write transaction: the trajectories' records, id keys, vectors, briefs and
cluster links go, the ids in their assignment-log entries are blanked (found through the
log's index by trajectory, :meth:`MemoryStore.forget_logged_id`; the removal's own entries
name no id), their clusters' counts, running sums (so R) and profiles are unfolded
(:func:`lifemem_ray.engine.clustering.clusters.unfold_member`), a cluster left without members is retired
(stored with count 0, which is not live: a reopened store does not load it), a cluster that
shrank enough is queued for a new skill in the same transaction (as growth queues one), and
the pending list drops them. Only after the commit do the live view and the vector index
follow; the index cache on disk is stamped with the store's generation and a digest of its
vectors (:meth:`EngineState.save_index`), so a cache saved before the removal is never
loaded after it, crash or not.

A purge records its intent (the ``purging`` meta entry) in its own transaction first, then
removes the tenant's trajectories ``PURGE_CHUNK`` at a time (bounded transactions), then
blanks the tenant's ids in the assignment log and keeps only numbers of its retired
clusters in bounded transactions too, and in the last one removes what is left, redoes
both for what came after them, replaces the names of its environments in the code table
by placeholders and clears the intent. :meth:`Deletion.resume` finishes a
purge a crash interrupted, at the next writable open: an acknowledged purge always
completes.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from lifemem_ray.core.errors import ArgumentTypeError, StoreError
from lifemem_ray.core.tenancy import DEFAULT_TENANT, check_tenant, display_envs, id_key
from lifemem_ray.engine.clustering.clusters import (
    ClusterRecord,
    example_task,
    needs_skill_after_removal,
    scrub_text,
    unfold_member,
)
from lifemem_ray.engine.clustering.workflow import workflow_summary
from lifemem_ray.engine.state import EngineState

__all__ = ["PURGE_CHUNK", "Deletion"]

log = logging.getLogger("lifemem_ray.engine.memory")

PURGE_CHUNK = 1000  # trajectories per purge transaction: bounded, so a purge never holds the writer for long
PURGE_LOG_CHUNK = 50_000  # log entries, or clusters, read per transaction of a purge's last passes


@dataclass
class _Row:
    """One stored trajectory to remove, as the removal reads it."""

    vid: int
    key: str  # its id key
    scope: str
    success: bool | None
    tokens: list[str]
    query: str  # the task text's head
    vec: np.ndarray
    wvec: np.ndarray
    cluster: int | None


class Deletion:
    def __init__(self, state: EngineState) -> None:
        self.s = state

    # -- by id -------------------------------------------------------------------------------
    def remove(self, ids: Iterable[str], *, tenant: str = DEFAULT_TENANT) -> int:
        """Delete ``tenant``'s trajectories by id (see the module docstring); unknown ids are
        ignored, so sending a removal again is safe. Returns how many were stored. A cluster
        that shrank enough gets its skill redone by maintenance (scheduled here)."""
        s = self.s
        s.check_writable()
        tenant = check_tenant(tenant, "tenant", stored=True)
        if isinstance(ids, str):
            raise ArgumentTypeError("expected a list of trajectory ids, got one string", where="ids")
        keys = list(dict.fromkeys(id_key(tenant, str(i)) for i in ids))
        with s.lock:
            removed = self.remove_keys(keys, "remove")
        if removed:
            s.schedule()
        return removed

    def remove_keys(self, keys: list[str], op: str, finish: Any = None) -> int:
        """Remove the trajectories of these id keys in one transaction (the caller holds the
        lock); ``finish(txn)`` runs last inside it (a purge clears its intent there)."""
        s = self.s
        now = time.time()
        rows = self._rows(keys)
        if not rows and finish is None:
            return 0
        touched: dict[int, ClusterRecord] = {}
        for row in rows:
            if row.cluster is None or row.cluster not in s.clusters:
                continue
            record = touched.get(row.cluster) or s.clusters[row.cluster].copy()
            touched[row.cluster] = record
            unfold_member(record, row.vec, row.wvec, row.scope, row.success, workflow_summary(row.tokens), now)
        removed = {row.vid for row in rows}
        self._redescribe(touched, rows, removed)
        pending = [v for v in s.pending if v not in removed]
        evo = s.config.evolution

        for record in touched.values():
            if record.count == 0:
                scrub_text(record)  # retired: no words about members that are gone

        def write(txn: Any) -> None:
            for row in rows:
                s.store.delete_trajectory(txn, row.vid, row.key)
            self._scrub_ancestors(txn, touched.values())
            for record in touched.values():
                s.store.put_cluster(txn, record)
                if record.count == 0:
                    s.store.clear_todo(txn, record.id)  # retired: nothing left to maintain
                elif needs_skill_after_removal(record, evo):
                    s.store.add_todo(txn, record.id, skill=True)
            if len(pending) != len(s.pending):
                s.store.put_meta(txn, "pending", pending)
            if rows:
                # The removal's own entries name no id: the trajectory's earlier ones were blanked with it.
                s.store.append_log(
                    txn, [{"vid": r.vid, "id": "", "cluster": r.cluster, "op": op, "t": now} for r in rows]
                )
                s.add_counters(txn, {"removed": len(rows)})
            if finish is not None:
                finish(txn)

        s.store.write(write)
        # Committed: now the live view and the index follow.
        for cid in touched:
            s.shrunk[cid] = s.shrunk.get(cid, 0) + 1
        for record in touched.values():
            if record.count == 0:
                s.clusters.pop(record.id, None)
            else:
                s.clusters[record.id] = record
        s.centroids.update(touched.values())  # drops the retired ones
        s.pending = pending
        if removed:
            s.index.remove(np.asarray(sorted(removed), dtype=np.int64))
        return len(rows)

    def _scrub_ancestors(self, txn: Any, records: Iterable[ClusterRecord]) -> None:
        """The tombstones a cluster was split from may still describe members in words (stores
        written before tombstones were scrubbed when made): scrub them too."""
        store = self.s.store
        seen: set[int] = set()
        for record in records:
            parent = record.parent
            while parent is not None and parent not in seen and len(seen) < 10_000:
                seen.add(parent)
                tomb = store.get_cluster(txn, parent)
                if tomb is None or tomb.live:
                    break
                if tomb.description or tomb.skill or tomb.flows:
                    store.put_cluster(txn, scrub_text(tomb))
                parent = tomb.parent

    def _rows(self, keys: list[str]) -> list[_Row]:
        store = self.s.store
        rows = []
        with store.read() as txn:
            for key in keys:
                vid = store.lookup_id(txn, key)
                if vid is None:
                    continue
                brief = store.brief(txn, vid)
                vecs = store.vectors(txn, vid)
                if brief is None or vecs is None:
                    raise _damaged(self.s, key, vid)
                rows.append(
                    _Row(
                        vid,
                        key,
                        brief.env,
                        brief.success,
                        list(brief.tokens),
                        brief.task,
                        vecs[1].copy(),
                        vecs[2].copy(),
                        store.cluster_of(txn, vid),
                    )
                )
        return rows

    def _redescribe(self, touched: dict[int, ClusterRecord], rows: list[_Row], removed: set[int]) -> None:
        """An offline description names an example goal: when that goal was a removed
        trajectory's, it names a remaining member's instead (and the counts as they are now)."""
        s = self.s
        gone = {" ".join(r.query.split())[:120] for r in rows}
        with s.store.read() as txn:
            for record in touched.values():
                if record.count == 0 or record.description_by != "offline":
                    continue
                example = example_task(record)
                if example in gone:
                    example = next(
                        (
                            b.task
                            for v in s.store.members(txn, record.id)
                            if v not in removed and (b := s.store.brief(txn, v)) is not None
                        ),
                        "",
                    )
                record.description = s.policy.describe(
                    record.count, display_envs(record.envs), record.flows, example, record.skill
                )

    # -- a whole tenant ------------------------------------------------------------------------
    def purge_tenant(self, tenant: str) -> int:
        """Delete every trajectory of ``tenant``; returns how many were removed. The intent is
        committed first, so a purge a crash interrupts is finished by :meth:`resume`."""
        s = self.s
        s.check_writable()
        tenant = check_tenant(tenant, "tenant", stored=True)
        with s.lock:
            purging = list(s.store.get_meta("purging", default=[]) or [])
            if tenant not in purging:
                s.store.write(lambda txn: s.store.put_meta(txn, "purging", [*purging, tenant]))
        removed = self._purge(tenant)
        s.schedule()
        return removed

    def _purge(self, tenant: str) -> int:
        s = self.s
        total = 0
        while True:
            with s.lock:
                with s.store.read() as txn:
                    keys = s.store.tenant_id_keys(txn, tenant, PURGE_CHUNK)
                if len(keys) >= PURGE_CHUNK:
                    total += self.remove_keys(keys, "purge")
                    continue
            # Fewer than a chunk left: the words the tenant left elsewhere go first, in bounded
            # transactions (the log is append-only; tombstones stay scrubbed), so the last one
            # redoes only what came after them.
            log_from = self._redact_log_in_chunks(tenant)
            self._forget_tombstones_in_chunks(tenant)
            with s.lock:
                with s.store.read() as txn:
                    keys = s.store.tenant_id_keys(txn, tenant, PURGE_CHUNK)
                if len(keys) >= PURGE_CHUNK:
                    continue  # adds of the tenant arrived meanwhile
                total += self.remove_keys(keys, "purge", partial(_finish_purge, s, tenant=tenant, log_from=log_from))
            log.info("%s: purged tenant %r (%d trajectories)", s.path, tenant, total)
            return total

    def _redact_log_in_chunks(self, tenant: str) -> int:
        """Blank the tenant's ids in the log, PURGE_LOG_CHUNK entries per transaction (the
        lock taken per chunk); returns the sequence number the pass reached (the log's end then)."""
        s = self.s
        start = 0
        while True:
            with s.lock:
                _, next_start, end = s.store.write(
                    partial(_redact_log_chunk, s, tenant=tenant, start=start), changed=lambda got: got[0] > 0
                )
            if next_start is None:
                return int(end)
            start = next_start

    def _forget_tombstones_in_chunks(self, tenant: str) -> None:
        """:func:`_forget_tombstones` over the clusters PURGE_LOG_CHUNK at a time."""
        s = self.s
        after: int | None = -1
        while after is not None:  # None: the last chunk reached the end
            with s.lock:
                _, after = s.store.write(
                    partial(_forget_tombstones, s, tenant=tenant, after=after, limit=PURGE_LOG_CHUNK),
                    changed=lambda got: got[0] > 0,
                )

    def resume(self) -> int:
        """Finish the purges a crash interrupted (at a writable open); returns trajectories removed."""
        s = self.s
        if s.read_only:
            return 0
        purging = list(s.store.get_meta("purging", default=[]) or [])
        total = 0
        for tenant in purging:
            log.warning("%s: finishing the purge of tenant %r that was interrupted", s.path, tenant)
            total += self._purge(tenant)
        return total


def _finish_purge(s: EngineState, txn: Any, tenant: str, log_from: int) -> None:
    """The last removal's transaction of a purge (the intent is cleared in it): what the
    chunked passes of :meth:`Deletion._purge` left, from the log entry ``log_from`` on."""
    _forget_tombstones(s, txn, tenant)  # reads every cluster, rewrites only ones not yet scrubbed
    s.store.redact_log(txn, tenant, start=log_from)  # the entries since the chunked pass, this removal's own too
    s.store.forget_env_names(txn, tenant)  # none of its trajectories is left to name them
    left = [t for t in (s.store.get_meta("purging", txn, []) or []) if t != tenant]
    s.store.put_meta(txn, "purging", left)


def _redact_log_chunk(s: EngineState, txn: Any, tenant: str, start: int) -> tuple[int, int | None, int]:
    """One transaction of :meth:`Deletion._redact_log_in_chunks`: entries blanked, where the
    next chunk starts (None: done) and the log's end now."""
    return (*s.store.redact_log(txn, tenant, start, PURGE_LOG_CHUNK), s.store.get_meta("next_log", txn) or 0)


def _forget_tombstones(
    s: EngineState, txn: Any, tenant: str, after: int = -1, limit: int | None = None
) -> tuple[int, int | None]:
    """Of ``tenant``'s clusters that are no longer live (split, merged, retired) only numbers
    stay: no words, no environment names. Clusters with ids above ``after``, at most ``limit``
    read; returns how many were rewritten and the last id read when it stopped at the limit,
    else None (the end). A scrubbed record names no environment, so no tenant: it is not
    written again."""
    records = list(itertools.islice(s.store.iter_clusters(txn, after=after), None if limit is None else limit + 1))
    more = limit is not None and len(records) > limit
    rewritten = 0
    for record in records[:limit]:
        if not record.live and record.tenant == tenant:
            scrub_text(record)
            record.envs = {}
            s.store.put_cluster(txn, record)
            rewritten += 1
    return rewritten, records[limit - 1].id if more and limit else None


def _damaged(s: EngineState, key: str, vid: int) -> StoreError:
    return StoreError(
        f"{s.path}: trajectory {key!r} (vid {vid}) has no stored brief or vectors; run `lifemem-ray check`"
    )
