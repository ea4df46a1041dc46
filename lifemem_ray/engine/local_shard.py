"""The shard side of a memory: the calls a coordinator or a sharded client makes on one
store (:class:`lifemem_ray.engine.protocols.ShardProtocol`), in process. The Ray actor
:class:`lifemem_ray.actors.cluster.shard_actor.MemoryShard` forwards to this."""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lifemem_ray.core.errors import ConfigError, InvalidArgumentError
from lifemem_ray.core.tenancy import DEFAULT_TENANT
from lifemem_ray.engine.clustering.clusters import ClusterInfo, ClusterRecord
from lifemem_ray.engine.clustering.evolution import CandidateArrays, ItemBatch, Placement
from lifemem_ray.engine.ingest import known_ids
from lifemem_ray.engine.ingest_rules import AddResult
from lifemem_ray.engine.parts import EngineParts
from lifemem_ray.engine.retrieval import RecordHit

__all__ = ["EngineShard"]


class EngineShard:
    """:class:`~lifemem_ray.engine.protocols.ShardProtocol` over one store's engine parts (the
    same parts a :class:`~lifemem_ray.engine.memory.Memory` of that store calls)."""

    def __init__(self, parts: EngineParts) -> None:
        self._parts = parts
        self._state = parts.state
        self._ingest = parts.ingest
        self._search = parts.search

    # -- ingest stages -----------------------------------------------------------------------
    def check_features(self, features: str) -> None:
        """Refuse items whose workflow vectors another featurizer computed (a client whose
        ``evolution.workflow_features`` differs from this store's)."""
        own = self._state.features
        if features != own:
            raise ConfigError(
                f"{self._state.path}: items carry {features!r} workflow vectors, this store holds {own!r} ones; "
                f"set evolution.workflow_features = {own!r} where the trajectories are packed"
            )

    def known(self, ids: Sequence[str], fingerprints: Sequence[str]) -> list[AddResult | None]:
        """Per id: its stored result (duplicate, or conflict for other content), or None when new here."""
        return known_ids(self._state.store, ids, fingerprints)

    def candidates(self, vectors: np.ndarray, workflow_vectors: np.ndarray, envs: Sequence[str]) -> CandidateArrays:
        return self._ingest.candidate_arrays(vectors, workflow_vectors, envs)

    def commit(
        self, batch: ItemBatch, placements: list[Placement], counters: dict[str, int] | None = None
    ) -> tuple[list[AddResult], dict[int, ClusterRecord]]:
        """Store the coordinator's decisions; return the results and the states of the clusters
        they went to. Idempotent: items already here are reported, not stored again (the
        coordinator refused conflicts before deciding; one that raced in is reported)."""
        started = time.perf_counter()
        self._state.check_writable()
        self.check_features(batch.features)
        items = batch.items()
        classes = self._ingest.check_ids(batch.ids, batch.fingerprints, refuse=False)
        placed = None
        if classes.fresh:
            placed = self._ingest.commit(
                [items[i] for i in classes.fresh], [placements[i] for i in classes.fresh], counters=counters
            )
        self._state.schedule()  # maintenance (splits, skills) for what just changed
        done = classes.complete(placed)
        self._state.metrics.observe_latency("add", "engine", time.perf_counter() - started)
        return done, self.cluster_states(r.cluster_id for r in done if r.cluster_id is not None)

    def add_items(self, batch: ItemBatch) -> list[AddResult]:
        """The engine's own ingest, decisions included (the first trajectories, before the
        initial partition exists, all go to one shard through here)."""
        started = time.perf_counter()
        self.check_features(batch.features)
        out = self._ingest.add_items(batch.items())
        self._state.metrics.observe_latency("add", "engine", time.perf_counter() - started)
        return out

    def cluster_states(self, cluster_ids: Any) -> dict[int, ClusterRecord]:
        """Copies of these clusters' live states (those still live): what a coordinator plans
        the next batch with when that batch's candidates were searched before this commit."""
        s = self._state
        with s.lock:
            return {cid: s.clusters[cid].copy() for cid in set(cluster_ids) if cid in s.clusters}

    # -- reading -----------------------------------------------------------------------------
    def search_records(
        self, envs: Sequence[str], k: int, vectors: np.ndarray, skills: bool = True, as_of: int | None = None
    ) -> list[tuple[list[RecordHit], dict[int, str]]]:
        """The top-k hits with their records; ``as_of``: this store's watermark of a pinned read."""
        started = time.perf_counter()
        out = self._search.search_records(vectors, envs, k, skills=skills, as_of=as_of)
        self._state.metrics.observe_latency("retrieve", "engine", time.perf_counter() - started)
        return out

    def search_hits(
        self, envs: Sequence[str], k: int, vectors: np.ndarray, as_of: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Scores and ids of the top-k; ``as_of``: this store's watermark of a pinned read."""
        started = time.perf_counter()
        out = self._search.search_hits(vectors, envs, k, as_of=as_of)
        self._state.metrics.observe_latency("retrieve", "engine", time.perf_counter() - started)
        return out

    def watermark(self) -> int:
        """This store's watermark now (:mod:`lifemem_ray.engine.versions`)."""
        return self._search.watermark()

    def hit_records(self, ids: np.ndarray, skills: bool = True) -> tuple[list[Any], dict[int, str]]:
        return self._search.hit_records(ids, skills=skills)

    def stats(self, tenant: str | None = None) -> dict[str, Any]:
        return self._parts.audit.stats(tenant)

    def clusters(
        self, env: str | None = None, tenant: str | None = DEFAULT_TENANT, limit: int | None = None
    ) -> list[ClusterInfo]:
        return self._parts.reads.clusters(env, tenant, limit)

    def cluster_count(self, env: str | None = None, tenant: str | None = DEFAULT_TENANT) -> int:
        return self._parts.reads.cluster_count(env, tenant)

    # -- deleting ----------------------------------------------------------------------------
    def remove(self, ids: Sequence[str], tenant: str = DEFAULT_TENANT) -> int:
        """Delete ``tenant``'s trajectories of these ids held here (idempotent: unknown ids are ignored)."""
        return self._parts.deletion.remove(ids, tenant=tenant)

    def purge_tenant(self, tenant: str) -> int:
        """Delete everything of ``tenant`` held here (resumed after a crash; idempotent)."""
        return self._parts.deletion.purge_tenant(tenant)

    def cluster_ids(self) -> list[int]:
        return [c.id for c in self._parts.reads.clusters(tenant=None)]  # every tenant's

    def verify(self, deep: bool = False) -> dict[str, Any]:
        return self._parts.audit.verify(deep=deep)

    def maintain(self) -> int:
        """Run queued splits and skills now and let background index retrains finish."""
        done = self._parts.maintenance.maintain()
        self._state.index.wait_retrains()
        return done

    def export_records(self, path: str) -> dict[str, Any]:
        return self._parts.transfer.export(path)

    # -- snapshots ---------------------------------------------------------------------------
    def snapshot(self, directory: str) -> dict[str, Any]:
        """A consistent copy of this store (one read transaction) in ``directory``, written record
        by record into fresh pages (:meth:`MemoryStore.copy_to`): no byte of a trajectory deleted
        before it is in it. The folder holds the data file only (no index cache)."""
        target = Path(directory)
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        self._state.store.copy_to(target)
        return {"path": str(target), "bytes": sum(p.stat().st_size for p in target.iterdir())}

    def compact(self) -> dict[str, Any]:
        """Rewrite this store in place into fresh pages (:meth:`MemoryStore.compact`), then save
        the index cache anew (the one on disk is from the last close and may hold vectors of
        trajectories deleted since), so neither keeps bytes of deleted trajectories. The index
        in memory stays. Returns the data file's bytes before and after."""
        s = self._state
        s.check_writable()
        out = s.store.compact()
        with s.lock:
            s.save_index()
        return {"path": str(s.path), **out}

    def absorb(
        self, source: str, cluster_ids: list[int] | None, pending: bool, accept_loss_from: int | None = None
    ) -> dict[str, int]:
        """Copy whole clusters (and, with ``pending``, unclustered trajectories) from a snapshot
        store. ``accept_loss_from`` is for a source that is a shared log (a Ray shard reads those);
        a store folder has no log entries to leave out.

        Raises:
            InvalidArgumentError: ``accept_loss_from`` given for a store folder.
        """
        if accept_loss_from is not None:
            raise InvalidArgumentError(
                f"absorb({source!r}): accept_loss_from is for a shared log, and this source is a store folder"
            )
        return self._parts.transfer.absorb(source, cluster_ids, include_pending=pending)

    def close(self) -> None:
        self._parts.close()
