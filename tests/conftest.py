"""Shared fixtures. Heavy things (the embedding model, Ray) start once per session."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.lab.synthetic import generate, label_vectors

ROOT = Path(__file__).resolve().parents[1]


def shared_dir() -> Path:
    """The shared material beside the checkout (or where LIFEMEM_SHARED_DIR points)."""
    return Path(os.environ.get("LIFEMEM_SHARED_DIR", ROOT.parent / "shared"))


@pytest.fixture(scope="session")
def trainset_dir() -> Path:
    path = shared_dir() / "data" / "lifemem-trainset"
    if not path.is_dir():
        pytest.skip(f"shared trajectory data not found at {path}")
    return path


@pytest.fixture(scope="session")
def embedder():
    from lifemem_ray.engine.embedding import MiniLMEmbedder

    return MiniLMEmbedder()


@pytest.fixture
def config() -> DeploymentConfig:
    return DeploymentConfig()


@pytest.fixture(scope="session")
def synthetic():
    """600 labelled synthetic trajectories with direct vectors (no embedding model needed)."""
    trajs = list(generate(600, seed=1, length_scale=0.2))
    vecs = label_vectors([t.metadata["workflow"] for t in trajs], list(range(len(trajs))))
    return trajs, vecs


def purity(memory) -> float:
    """Share of trajectories whose cluster's majority workflow label is their own."""
    from collections import Counter

    total = agree = 0
    for cluster in memory.clusters():
        labels = Counter(memory.get(i).metadata["workflow"] for i in memory.members(cluster.id))
        agree += labels.most_common(1)[0][1]
        total += sum(labels.values())
    return agree / total if total else 0.0


def unit(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


# Several deployments share the test session's Ray instance: reserve little CPU per actor.
SMALL_ACTORS = {
    "cluster.shard_cpus": 0.1,
    "cluster.coordinator_cpus": 0.1,
    "cluster.embedder_cpus": 0.1,
    "cluster.start_timeout_s": 60,
}


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray instance for the whole session (token authentication stays on)."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        from lifemem_ray.actors.cluster.ray_address import private_ray

        # A Ray of the session's own: never RAY_ADDRESS or a cluster Ray's address file names.
        private_ray(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_metrics_url(ray_local) -> str:
    """The Prometheus endpoint of this session's Ray node (its metrics agent picks a free port,
    read back from ``ray.nodes()``; token authentication does not cover it)."""
    node_id = ray_local.get_runtime_context().get_node_id()
    node = next(n for n in ray_local.nodes() if n["NodeID"] == node_id)
    return f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"


@pytest.fixture
def deployment(ray_local, tmp_path):
    """A factory for sharded deployments, each in its own namespace; all stopped afterwards."""
    from lifemem_ray.actors.cluster import deployment as dep

    started: list[str] = []

    def start(shards: int = 2, store=None, **overrides):
        namespace = f"t{len(started)}-{os.getpid()}-{tmp_path.name[-12:]}"
        config = DeploymentConfig().replace(
            {"cluster.namespace": namespace, "cluster.batch_wait_ms": 5, **SMALL_ACTORS, **overrides}
        )
        info = dep.deploy(store or tmp_path / f"store-{namespace}", config, shards=shards)
        started.append(namespace)
        from lifemem_ray.actors.cluster.client import MemoryClient

        return MemoryClient(namespace, config), info

    yield start
    for namespace in started:
        dep.stop(namespace)
