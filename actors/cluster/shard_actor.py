"""MemoryShard: one engine store (LMDB folder + FAISS index) behind a Ray actor.

A cluster and all of its trajectories live on one shard, so evolution, the R
check, splits and skill distillation of a cluster are local. The shard is the engine's
:class:`lifemem_ray.engine.local_shard.EngineShard` (the calls of
:class:`lifemem_ray.engine.protocols.ShardProtocol`) over its store's parts; decisions for new
trajectories come from the coordinator, splits and skills run in the engine's background
thread. Every method is safe to retry: commits skip trajectories already stored, so a
call re-executed after the actor restarted stores nothing twice.

A shard always runs maintenance and index retrains in the background, whatever
``evolution.background_maintenance`` and ``index.background_retrain`` say (those
defaults are for a memory used in process): ingest must never wait for a split or a
retrain. The shard logs the override and ``stats()["background"]`` shows it.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import math
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lifemem_ray.actors.cluster import ray_metrics
from lifemem_ray.actors.cluster.checkpoints import CheckpointSchedule, shard_log_uri
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.coordinator_watch import CoordinatorSpec, CoordinatorWatch
from lifemem_ray.actors.cluster.ray_shards import unpack_queries
from lifemem_ray.core.tenancy import DEFAULT_TENANT
from lifemem_ray.engine.clustering.clusters import ClusterRecord
from lifemem_ray.engine.clustering.evolution import ItemBatch, Placement
from lifemem_ray.engine.index.vector_index import set_faiss_threads
from lifemem_ray.engine.ingest_rules import AddResult
from lifemem_ray.engine.local_shard import EngineShard
from lifemem_ray.engine.memory import Memory
from lifemem_ray.engine.retrieval import RecordHit
from lifemem_ray.engine.store.durable_copy import materialize

__all__ = ["SHARD_OVERRIDES", "MemoryShard", "release_free_memory", "shard_namespace"]

log = logging.getLogger(__name__)

# What a shard sets whatever its config says (see the module docstring).
SHARD_OVERRIDES = {"evolution.background_maintenance": True, "index.background_retrain": True}


def release_free_memory() -> int:
    """Give the allocator's free memory back to the system (glibc ``malloc_trim``); returns 1 if any was.

    Index retrains on background threads free large buffers into per-thread malloc arenas
    that glibc keeps until trimmed."""
    gc.collect()
    try:
        return int(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return 0


def shard_namespace(index: int) -> int:
    """Id namespace of shard ``index`` (0 is left to standalone stores)."""
    return index + 1


def shard_config(config: DeploymentConfig) -> DeploymentConfig:
    """``config`` with :data:`SHARD_OVERRIDES` applied (logged where it changes a setting)."""
    changed = [
        key
        for key, value in SHARD_OVERRIDES.items()
        if getattr(getattr(config, key.split(".")[0]), key.split(".")[1]) != value
    ]
    if changed:
        log.info(
            "shard: %s set to true (a shard runs maintenance and index retrains in the background)", ", ".join(changed)
        )
    return config.replace(SHARD_OVERRIDES)


class MemoryShard(EngineShard):
    """The Ray actor of one store: the engine's :class:`~lifemem_ray.engine.local_shard.EngineShard`
    (every call of :class:`~lifemem_ray.engine.protocols.ShardProtocol`, inherited) plus what
    a deployment needs of an actor: ``info`` and ``ping``, the shard gauges published after every
    change, the id namespace of its index, and the allocator's free memory given back after
    maintenance. The calls that change the store are overridden here, to publish; and
    ``search_records``, to take query vectors as raw bytes too (what the clients send)."""

    @classmethod
    def ray_options(cls, config: DeploymentConfig) -> dict[str, Any]:
        """The actor's Ray options: its CPU share; a few calls at once (a retrieval need not wait
        behind a commit); restarted, and its calls retried, after a crash (every call is safe
        to retry: commits skip what is stored)."""
        return {"num_cpus": config.cluster.shard_cpus, "max_concurrency": 4, "max_restarts": -1, "max_task_retries": -1}

    def __init__(
        self,
        index: int,
        path: str,
        config: DeploymentConfig,
        dim: int | None = None,
        coordinator: CoordinatorSpec | None = None,
    ) -> None:
        self.index = index  # the shard's position in the deployment (its id namespace is index + 1)
        self.path = Path(path)
        # Starts a new coordinator when the deployment's died for good (cluster.replace_dead_actors).
        self.coordinator_watch = (
            CoordinatorWatch(coordinator, config.cluster.health_check_s, f"lifemem-coordinator-watch-{index}")
            if coordinator is not None and config.cluster.replace_dead_actors
            else None
        )
        config = shard_config(config)
        cluster = config.cluster
        if cluster.durable_uri:  # every commit also reaches the shard's shared log, before it is acknowledged
            config = config.replace(
                {
                    "store.shared_log_uri": shard_log_uri(cluster.durable_uri, cluster.namespace, index),
                    "store.shared_log_endpoint_url": cluster.durable_endpoint_url,
                }
            )
        # FAISS's OpenMP threads beyond the CPUs this actor reserved only spin against the
        # other actors of the node (small batches per environment make that costly).
        set_faiss_threads(max(1, math.ceil(config.cluster.shard_cpus)))
        self.memory = Memory.open(
            self.path, config, dim=dim, namespace=shard_namespace(index), metrics=ray_metrics.SINK
        )  # owns the store's lifetime (lock, index, background thread); its parts serve the calls
        super().__init__(self.memory.parts)
        self.started = time.time()
        self.deployment = config.cluster.namespace  # the metrics' deployment tag
        # Checkpoints to the durable address, on their own thread (none without one).
        self.checkpoints = (
            CheckpointSchedule(self.checkpoint, cluster.snapshot_every_s, f"lifemem-checkpoint-{index}")
            if cluster.durable_uri and cluster.snapshot_every_s > 0
            else None
        )
        self.snapshots_kept = cluster.snapshots_kept
        self.durable_endpoint_url = cluster.durable_endpoint_url  # also where a restore's shared logs are read
        self._publish_sizes()

    # -- identity --------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        import ray

        stats = self.memory.stats()
        return {
            "index": self.index,
            "path": str(self.path),
            "node_id": ray.get_runtime_context().get_node_id(),
            "address": ray.util.get_node_ip_address(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "trajectories": stats["trajectories"],
            "clusters": stats["clusters"],
            "initialised": self.memory.initialised,
            "started": self.started,
            "gpu_index": stats["index"]["gpu"],
            "durable": self.durable_status(),
        }

    def durable_status(self) -> dict[str, Any] | None:
        """The shard's shared log (head, newest checkpoint, entries after it, what this copy
        holds) and its checkpoint schedule; None without a durable address."""
        shared = self.memory.parts.state.store.shared_log_status()
        if shared is None:
            return None
        return {**shared, "schedule": self.checkpoints.status() if self.checkpoints else None}

    def checkpoint(self) -> dict[str, Any]:
        """A checkpoint of this shard to its durable address now (cluster.snapshots_kept kept)."""
        return {"index": self.index, **self.memory.parts.state.store.checkpoint(self.snapshots_kept)}

    def ping(self) -> int:
        return self.index

    # -- retrieval: the engine's, with query vectors that may come as raw bytes -------------
    def search_records(
        self,
        envs: Sequence[str],
        k: int,
        vectors: np.ndarray | bytes,
        skills: bool = True,
        as_of: int | None = None,
    ) -> list[tuple[list[RecordHit], dict[int, str]]]:
        """The engine's; ``vectors`` may also be the raw float32 bytes the clients send
        (:func:`~lifemem_ray.actors.cluster.ray_shards.pack_queries`: cheaper through Ray)."""
        return super().search_records(envs, k, unpack_queries(vectors, len(envs), self.memory.dim), skills, as_of)

    # -- the calls that change the store: the engine's, then the gauges --------------------
    def commit(
        self, batch: ItemBatch, placements: list[Placement], counters: dict[str, int] | None = None
    ) -> tuple[list[AddResult], dict[int, ClusterRecord]]:
        out = super().commit(batch, placements, counters)
        self._publish_sizes()
        return out

    def add_items(self, batch: ItemBatch) -> list[AddResult]:
        """The engine's own ingest, decisions included (the first trajectories, before the
        initial partition exists, all go to one shard through here)."""
        out = super().add_items(batch)
        self._publish_sizes()
        return out

    def remove(self, ids: Sequence[str], tenant: str = DEFAULT_TENANT) -> int:
        """Idempotent (unknown ids are ignored), so a call retried after a restart is safe."""
        removed = super().remove(ids, tenant)
        self._publish_sizes()
        return removed

    def purge_tenant(self, tenant: str) -> int:
        """A purge a crash interrupted is finished when the restarted actor opens the store."""
        removed = super().purge_tenant(tenant)
        self._publish_sizes()
        return removed

    def maintain(self) -> int:
        """Run queued splits and skills now, let background index retrains finish, and give
        the memory they freed back to the system."""
        done = super().maintain()
        release_free_memory()
        self._publish_sizes()
        return done

    def absorb(
        self, source: str, cluster_ids: list[int] | None, pending: bool, accept_loss_from: int | None = None
    ) -> dict[str, int]:
        """Copy clusters from a snapshot's store folder, or from a shard's shared log (a durable
        address: the store it holds is first made in a temporary folder beside this shard's,
        from the entries before ``accept_loss_from`` when the operator accepted a loss)."""
        if "://" in source or (Path(source) / "identity.json").exists():
            staging = Path(tempfile.mkdtemp(prefix=".absorb-", dir=self.path.parent))
            try:
                folder = materialize(
                    source, staging / "store", self.durable_endpoint_url, accept_loss_from=accept_loss_from
                )
                out = super().absorb(str(folder), cluster_ids, pending)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        else:
            out = super().absorb(source, cluster_ids, pending)
        self._publish_sizes()
        return out

    # -- snapshots: tagged with the shard's index --------------------------------------------
    def snapshot(self, directory: str) -> dict[str, Any]:
        """A consistent copy of this shard's store (one read transaction), written into fresh pages."""
        return {"index": self.index, **super().snapshot(directory)}

    def compact(self) -> dict[str, Any]:
        """Rewrite this shard's store in place into fresh pages and save its index cache anew;
        the deployment pauses ingest around it. With a durable address, a checkpoint follows
        and only it is kept, with no log entry before it: no byte of a deleted trajectory is
        left in the durable storage either."""
        out: dict[str, Any] = {"index": self.index, **super().compact()}
        if self.memory.parts.state.store.shared_log_status() is not None:
            out["durable"] = self.memory.parts.state.store.checkpoint(keep=1)
        return out

    def arm_coordinator_watch(self) -> bool:
        """The deployment's coordinator runs now (the start that made this shard saw it answer):
        from now on this shard's watch starts a new one if it dies for good, also before the
        watch's own first look. Returns whether the shard has a watch."""
        if self.coordinator_watch is None:
            return False
        self.coordinator_watch.seen = True
        return True

    def close(self) -> None:
        if self.coordinator_watch is not None:
            self.coordinator_watch.stop()
        if self.checkpoints is not None:
            self.checkpoints.stop()
        super().close()

    def _publish_sizes(self) -> None:
        """The shard gauges (trajectories, clusters), after every change made through this actor;
        splits and merges in the background show at the next one."""
        trajectories, clusters = self.memory.sizes()
        ray_metrics.set_shard_sizes(self.deployment, self.index, trajectories, clusters)
