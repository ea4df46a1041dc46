"""Small helpers several test layers use (no Ray, no Ray layer: the Ray-free run imports this)."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]

# Several deployments share the test session's Ray instance: reserve little CPU per actor.
SMALL_ACTORS = {
    "cluster.shard_cpus": 0.1,
    "cluster.coordinator_cpus": 0.1,
    "cluster.embedder_cpus": 0.1,
    "cluster.start_timeout_s": 60,
}


def shared_dir() -> Path:
    """The shared material beside the checkout (or where LIFEMEM_SHARED_DIR points)."""
    return Path(os.environ.get("LIFEMEM_SHARED_DIR", ROOT.parent / "shared"))


def purity(memory) -> float:
    """Share of trajectories whose cluster's majority workflow label is their own."""
    total = agree = 0
    for cluster in memory.clusters():
        labels = Counter(memory.get(i).metadata["workflow"] for i in memory.members(cluster.id))
        agree += labels.most_common(1)[0][1]
        total += sum(labels.values())
    return agree / total if total else 0.0


def unit(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)
