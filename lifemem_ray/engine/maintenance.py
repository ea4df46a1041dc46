"""Maintenance: the queue of splits, merges, skill distillations and description refreshes,
and the scheduler that runs it (inline after each change, or on a background thread with
``evolution.background_maintenance``).

The queue lives in LMDB (written in the same transaction as the change that caused it),
so work a crash interrupts is picked up at the next open.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from lifemem_ray.core.decisions import ClusterView
from lifemem_ray.core.errors import MaintenanceError
from lifemem_ray.core.model import Trajectory
from lifemem_ray.core.tenancy import display_envs
from lifemem_ray.engine.clustering.clusters import ClusterRecord, example_task
from lifemem_ray.engine.restructure import Restructure
from lifemem_ray.engine.state import EngineState

__all__ = ["Maintenance"]

log = logging.getLogger("lifemem_ray.engine.memory")

Update = tuple[int, dict[str, Any], tuple[str, ...]]  # cluster id, fields to set, the todo flags it settles


class Maintenance:
    def __init__(self, state: EngineState) -> None:
        self.s = state
        self.restructure = Restructure(state, self.view, self.stopping)
        self._run_lock = threading.Lock()  # one maintenance pass at a time
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None

    # -- scheduling ----------------------------------------------------------------------------
    def start(self) -> None:
        """Begin: a background thread (``evolution.background_maintenance``), else one inline
        pass now for work a crash may have left queued."""
        if self.s.read_only:
            return
        if self.s.config.evolution.background_maintenance:
            self._thread = threading.Thread(target=self._loop, name="lifemem-maintenance", daemon=True)
            self._thread.start()
            self._wake.set()
        else:
            self.maintain()
        self.s.schedule = self.schedule

    @property
    def background(self) -> bool:
        return self._thread is not None

    def schedule(self) -> None:
        """After a change: wake the background thread, or run the queue now."""
        if self._thread is not None:
            self._wake.set()
        else:
            self.maintain()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    def raise_error(self) -> None:
        """Surface a failure of the background thread to the next caller (the todo stays queued)."""
        if self._error is not None:
            exc, self._error = self._error, None
            raise MaintenanceError(f"background maintenance failed: {exc}") from exc

    def stopping(self) -> bool:
        return self._stop.is_set() and threading.current_thread() is self._thread

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(timeout=1.0)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.maintain()
            except BaseException as exc:  # surfaced to the next caller; the todo stays queued
                log.exception("background maintenance failed")
                self._error = exc
                break

    # -- the queue -----------------------------------------------------------------------------
    def _todos(self) -> dict[int, dict[str, bool]]:
        with self.s.store.read() as txn:
            return self.s.store.todos(txn)

    def maintain(self, max_ops: int | None = None) -> int:
        """Run queued splits, merges, skill distillations and description refreshes; returns
        how many ran."""
        if self.s.read_only or self.s.closed:
            return 0
        with self._run_lock:
            done = 0
            while max_ops is None or done < max_ops:
                if not self._todos():
                    break
                before = done
                cleared: list[tuple[int, tuple[str, ...]]] = []
                for flag, attempt in (("split", self.restructure.try_split), ("merge", self.restructure.try_merge)):
                    done, stopped = self._restructure_round(flag, attempt, done, max_ops, cleared)
                    if stopped:
                        return done
                todos = self._todos()
                work = [(cid, f) for cid, f in sorted(todos.items()) if f.get("skill") or f.get("describe")]
                if max_ops is not None:
                    work = work[: max(0, max_ops - done)]
                if self.stopping():
                    return done
                updates = self._compute_updates(work)
                cleared.extend((cid, ()) for cid in todos if cid not in self.s.clusters)
                self._commit_updates(updates, cleared)
                done += len(updates)
                if done == before and not cleared:
                    break
            return done

    def _restructure_round(
        self, flag: str, attempt: Any, done: int, max_ops: int | None, cleared: list[tuple[int, tuple[str, ...]]]
    ) -> tuple[int, bool]:
        """Try every cluster queued for ``flag`` (split or merge); returns the count of work
        done so far and whether the thread was asked to stop. A cluster where nothing happened
        has the flag cleared (with the round's other clearances)."""
        for cid, flags in sorted(self._todos().items()):
            if not flags.get(flag) or (max_ops is not None and done >= max_ops):
                continue
            if self.stopping():
                return done, True
            if attempt(cid):
                done += 1  # a split's children carry their own todos; the parent's are gone
            else:
                cleared.append((cid, (flag,)))
        return done, False

    # -- skills and descriptions ---------------------------------------------------------------
    def _compute_updates(self, work: list[tuple[int, dict[str, bool]]]) -> list[Update]:
        """New skills and descriptions for the queued clusters (LLM calls run concurrently)."""
        if self.s.decider is None or len(work) <= 1:
            results = [self._update_one(cid, flags) for cid, flags in work]
        else:
            with ThreadPoolExecutor(
                max_workers=self.s.config.llm.concurrency, thread_name_prefix="lifemem-distil"
            ) as pool:
                results = list(pool.map(lambda wf: self._update_one(*wf), work))
        return [r for r in results if r is not None]

    def _update_one(self, cid: int, flags: dict[str, bool]) -> Update | None:
        s = self.s
        removals = s.shrunk.get(cid, 0)  # a removal from the cluster after this makes the update stale
        sample = self._sample_members(cid)
        if sample is None:
            return None
        record, trajs = sample
        count = record.count
        fields: dict[str, Any] = {}
        names: list[str] = []
        if flags.get("skill"):
            text, by = None, "offline"
            if s.decider is not None and count >= s.config.llm.min_cluster_size:
                view = self.view(cid)
                if view is None:  # merged or retired since the sample was read: nothing to update
                    return None
                text = s.decider.distil(view, trajs)
                by = "llm" if text else "fallback"
            skill = text or s.policy.distil(trajs)
            fields.update(skill=skill, skill_by=by, skill_n=count)
            if record.description_by != "llm":  # the offline description names the procedure's steps
                fields.update(
                    description=s.policy.describe(
                        count, display_envs(record.envs), record.flows, example_task(record), skill
                    ),
                    description_by="offline",
                )
            names.append("skill")
        if flags.get("describe"):
            # A view of None: the cluster was merged or retired since the sample was read.
            if s.decider is not None and (view := self.view(cid, examples=tuple(trajs[:3]))) is not None:
                text = s.decider.describe(view)
                if text:
                    fields.update(description=text, description_by="llm")
            # Success or not, do not ask again until the cluster has grown.
            fields["description_n"] = count
            names.append("describe")
        fields["_removals"] = removals
        return cid, fields, tuple(names)

    def _commit_updates(self, updates: list[Update], cleared: list[tuple[int, tuple[str, ...]]]) -> None:
        """All skill and description updates of a round in one transaction."""
        if not updates and not cleared:
            return
        s = self.s
        with s.lock:
            # Members were removed since the sample was read: its text may quote them. Dropped,
            # with its todo left queued (the removal queued a refresh where one is due).
            updates = [u for u in updates if u[1].pop("_removals", 0) == s.shrunk.get(u[0], 0)]
            records: list[ClusterRecord] = []
            for cid, fields, _ in updates:
                current = s.clusters.get(cid)
                if current is None:
                    continue
                record = current.copy()
                for name, value in fields.items():
                    setattr(record, name, value)
                records.append(record)
            usage_total = s.usage_totals()
            counts: dict[str, int] = {}
            for _, _, names in updates:
                for name in names:
                    counts[name] = counts.get(name, 0) + 1

            def write(txn: Any) -> None:
                for record in records:
                    s.store.put_cluster(txn, record)
                for cid, _, names in updates:
                    s.store.clear_todo(txn, cid, *names)
                for cid, names in cleared:
                    s.store.clear_todo(txn, cid, *names)
                s.add_counters(txn, counts)
                if usage_total is not None:
                    s.store.put_meta(txn, "llm_usage", usage_total)

            s.store.write(write)
            for record in records:
                s.clusters[record.id] = record

    def _sample_members(self, cid: int) -> tuple[ClusterRecord, list[Trajectory]] | None:
        """The cluster's state and an even sample of its members (at most ``skill_sample_size``),
        decoded: the offline skill reads their actions, the LLM their whole text. Read outside
        the engine lock."""
        s = self.s
        with s.lock:
            record = s.clusters.get(cid)
            if record is None:
                return None
        with s.store.read() as txn:
            vids = s.store.members(txn, cid)
            size = s.config.evolution.skill_sample_size
            picks = vids if len(vids) <= size else [vids[int(i)] for i in np.linspace(0, len(vids) - 1, size).round()]
            trajs = [got[0] for vid in picks if (got := s.store.trajectory(txn, vid)) is not None]
        return record, trajs

    def view(self, cid: int, examples: tuple[Trajectory, ...] = ()) -> ClusterView | None:
        record = self.s.clusters.get(cid)
        if record is None:
            return None
        return ClusterView(
            id=cid,
            count=record.count,
            description=record.description,
            skill=record.skill,
            envs=display_envs(record.envs),
            examples=examples,
        )
