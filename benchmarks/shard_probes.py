"""Probes the benchmarks run inside a shard actor, through Ray's ``actor.__ray_call__``
(``ray.get(shard.__ray_call__.remote(label_purity, "workflow"))``): the production
:class:`lifemem_ray.actors.cluster.shard_actor.MemoryShard` carries no benchmark code. Each takes the actor instance
first and reads the engine through its public API (``shard.memory``).

Imported by the benchmark scripts (this folder is their ``sys.path[0]``); the module is
pickled by value, so the actors need not import it.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np
from ray import cloudpickle  # Ray's own copy: the one that pickles what actors receive

__all__ = ["label_purity", "shard_cpu_seconds", "shard_resources", "timed_retrieve_many"]


def shard_cpu_seconds(shard: Any) -> float:
    """CPU seconds the shard's process has used so far (all its threads)."""
    return time.process_time()


def timed_retrieve_many(
    shard: Any, tasks: list[str], envs: list[str], k: int, vectors: np.ndarray
) -> tuple[Any, float]:
    """retrieve_many and the seconds it took inside the shard's process (to separate Ray's share)."""
    started = time.perf_counter()
    out = shard.memory.retrieve_many(tasks, envs, k, vectors=vectors)
    return out, time.perf_counter() - started


def shard_resources(shard: Any) -> dict[str, Any]:
    """Resident memory of the shard's process and bytes on disk of its store."""
    status = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                status[key] = int(value.split()[0]) * 1024
    disk = sum(p.stat().st_size for p in shard.path.rglob("*") if p.is_file())
    # RssFile is mostly LMDB pages this process has read through its map: page cache the
    # kernel can drop, unlike RssAnon (the index, Python objects, allocator arenas).
    return {
        "rss_bytes": status.get("VmRSS", 0),
        "anon_rss_bytes": status.get("RssAnon", 0),
        "file_rss_bytes": status.get("RssFile", 0),
        "disk_bytes": disk,
        "trajectories": len(shard.memory),
    }


def label_purity(shard: Any, key: str) -> dict[str, int]:
    """Members agreeing with their cluster's majority of ``metadata[key]`` (ground-truth labels)."""
    from collections import Counter, defaultdict

    labels: dict[int, Counter] = defaultdict(Counter)
    store = shard.memory.store
    with store.read() as txn:
        for vid, traj, _ in store.iter_trajectories(txn):
            cid = store.cluster_of(txn, vid)
            if cid is not None and key in traj.metadata:
                labels[cid][traj.metadata[key]] += 1
    agree = sum(c.most_common(1)[0][1] for c in labels.values())
    return {"agree": agree, "total": sum(sum(c.values()) for c in labels.values()), "clusters": len(labels)}


cloudpickle.register_pickle_by_value(sys.modules[__name__])
